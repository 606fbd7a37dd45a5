"""Choosing GPUs inside one node (core: below the state, which asks it whether a pod fits;
``sharegpu.core.placement.gpus`` re-exports it for the policies).

Strategies: ``bestfit`` (= ACK ``binpack``: the GPU left with the least free memory that still
fits, so one GPU fills before the next), ``spread`` (the GPU with the most free memory, then the
fewest pods), ``topology`` (whole cards: the best-connected set given the node's link matrix),
``firstfit`` (the lowest-index GPUs that fit, links ignored: what kube-scheduler's DRA allocator
takes inside a node, see :data:`FIRSTFIT`).
A policy may also hand over its own ordering of GPUs. Multi-container pods are assigned
container by container on a scratch copy of the node's row, so containers of one pod can share a
GPU and the per-GPU rules hold for their sum.

:func:`assign` is complete: it first takes, container by container, the strategy's best GPUs
(the greedy choice), and when that dead-ends it searches every choice, in the strategy's order,
for one that fits all containers. So ``assign`` finds GPUs exactly when some assignment exists,
whatever the strategy — the scheduler's filter (:meth:`ClusterState.feasible`) and its GPU choice
(``Policy.select``) are one decision.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from . import names
from .annotations import Allocation
from .modes import Placement
from .request import ContainerRequest, Kind, PodRequest
from .topology import best_set


class GpuRows(Protocol):
    """What the GPU choice reads of the cluster state (:class:`sharegpu.core.state.ClusterState`
    has it): per node, the GPU count, per GPU free and total memory, free compute and pods, the
    node's spec (its placement label and link matrix) and the per-GPU pod limit. A protocol,
    so that the state can ask this module whether a pod fits without the two importing each
    other: the state imports the GPU choice, and placement builds on both."""

    gpu_count: np.ndarray
    gpu_free: np.ndarray
    gpu_total: np.ndarray
    core_free: np.ndarray
    gpu_pods: np.ndarray
    specs: Sequence[Any]  # NodeSpec | None per node
    max_pods_per_gpu: int


# order(free_after, pods, candidates) -> candidates sorted best first
Order = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]

STRATEGIES = ("bestfit", "binpack", "spread", "topology", "firstfit")

#: kube-scheduler's DRA allocator (k8s.io/dynamic-resource-allocation v0.37.2,
#: ``structured/internal/incubating``, the implementation chosen once ``DRAConsumableCapacity`` is
#: on) walks the node's pools (sorted by ID), their slices (by name) and each slice's devices in
#: the order the slice lists them, and takes the first device that is not tainted, matches the
#: selectors and whose capacity still holds the request (``CmpRequestOverCapacity``: allocated +
#: being allocated + requested ≤ capacity) — no scoring. The next device of the same request is
#: searched from the one after; it backtracks only when a later request or claim finds none. A
#: sharegpu slice lists ``gpu-<index>`` by index, so this is the lowest-index GPU that fits.
FIRSTFIT = "firstfit"


def _order(strategy: str) -> Order:
    if strategy == FIRSTFIT:
        return lambda after, pods, idx: np.sort(idx)
    if strategy in ("bestfit", "binpack", "topology"):
        return lambda after, pods, idx: idx[np.lexsort((idx, after[idx]))]
    if strategy == "spread":
        return lambda after, pods, idx: idx[np.lexsort((idx, pods[idx], -after[idx]))]
    raise ValueError(f"unknown GPU strategy {strategy!r}; one of {', '.join(STRATEGIES)}")


def node_strategy(state: GpuRows, node: int, default: str) -> str:
    """The node label ``ack.node.gpu.placement`` wins over the policy's own preference."""
    spec = state.specs[node]
    if spec is not None and spec.placement is not None:
        return "spread" if spec.placement is Placement.SPREAD else "bestfit"
    return default


def assign(
    state: GpuRows,
    req: PodRequest,
    node: int,
    strategy: str = "bestfit",
    prefer: dict[int, tuple[int, ...]] | None = None,
) -> Allocation | None:
    """GPUs for every container of ``req`` on ``node``; ``None`` when they do not all fit.

    ``prefer`` maps a container index to the GPUs a policy already picked for it; they are
    checked like any other choice.
    """
    if len(req.containers) == 1 and strategy in _ONE_GPU_ORDERS:
        c = req.containers[0]
        if c.gpus == 1 and not c.whole:
            return _assign_one(state, c, node, strategy, prefer)
    g = int(state.gpu_count[node])
    free = state.gpu_free[node, :g].copy()
    total = state.gpu_total[node, :g]
    core = state.core_free[node, :g].copy()
    pods = state.gpu_pods[node, :g].astype(np.int64)
    touched = np.zeros(g, dtype=bool)  # GPUs this pod already counts on
    order = _order(strategy)
    spec = state.specs[node]
    links = spec.links if spec is not None else None
    mem: dict[int, dict[int, int]] = {}
    cores: dict[int, dict[int, int]] = {}
    start = (free.copy(), core.copy(), pods.copy())
    for c in req.containers:
        chosen = _choose(state, c, free, total, core, pods, touched, order, strategy, links, prefer)
        if chosen is None:
            if prefer or len(req.containers) == 1:
                return None  # one container: the greedy choice is exact; prefer: as asked
            found = _search(state, req, total, *start, order)
            if found is None:
                return None
            return _allocation(req, found, total)
        _take(c, chosen, free, total, core, pods, touched)
        mem[c.index] = {int(gpu): (int(total[gpu]) if c.whole else c.gpu_mem) for gpu in chosen}
        if c.gpu_core or c.whole:
            cores[c.index] = {
                int(gpu): names.CORE_PER_GPU if c.whole else c.gpu_core for gpu in chosen
            }
    return Allocation(mem=mem, core=cores)


# the strategies' orders for one share of one GPU, as sort keys over (free after, pods, index):
# the same orders as _order's
_ONE_GPU_ORDERS: dict[str, Callable[[int, int, int], tuple[int, ...]]] = {
    FIRSTFIT: lambda after, pods, i: (i,),
    "bestfit": lambda after, pods, i: (after, i),
    "binpack": lambda after, pods, i: (after, i),
    "topology": lambda after, pods, i: (after, i),
    "spread": lambda after, pods, i: (-after, pods, i),
}


def _assign_one(
    state: GpuRows, c: ContainerRequest, node: int, strategy: str,
    prefer: dict[int, tuple[int, ...]] | None,
) -> Allocation | None:
    """:func:`assign` for a pod of one container on a share of one GPU (most pods), on the
    node's row as Python numbers: a numpy pipeline over a few GPUs costs more than the rules."""
    g = int(state.gpu_count[node])
    free = state.gpu_free[node, :g].tolist()
    pods = state.gpu_pods[node, :g].tolist()
    core = state.core_free[node, :g].tolist() if c.gpu_core else None
    limit = state.max_pods_per_gpu
    fits = [i for i in range(g) if free[i] >= c.gpu_mem and pods[i] < limit
            and (core is None or core[i] >= c.gpu_core)]
    if prefer and c.index in prefer:
        want = prefer[c.index]
        if len(set(want)) != 1 or want[0] not in fits:
            return None
        gpu = int(want[0])
    elif not fits:
        return None
    else:
        key = _ONE_GPU_ORDERS[strategy]
        gpu = min(fits, key=lambda i: key(free[i] - c.gpu_mem, pods[i], i))
    return Allocation(mem={c.index: {gpu: c.gpu_mem}},
                      core={c.index: {gpu: c.gpu_core}} if c.gpu_core else {})


def _take(
    c: ContainerRequest,
    chosen: tuple[int, ...],
    free: np.ndarray,
    total: np.ndarray,
    core: np.ndarray,
    pods: np.ndarray,
    touched: np.ndarray,
) -> None:
    for gpu in chosen:
        free[gpu] -= int(total[gpu]) if c.whole else c.gpu_mem
        core[gpu] -= names.CORE_PER_GPU if c.whole else c.gpu_core
        if not touched[gpu]:
            pods[gpu] += 1
            touched[gpu] = True


def _allocation(
    req: PodRequest, chosen: dict[int, tuple[int, ...]], total: np.ndarray
) -> Allocation:
    mem: dict[int, dict[int, int]] = {}
    cores: dict[int, dict[int, int]] = {}
    for c in req.containers:
        gpus = chosen[c.index]
        mem[c.index] = {int(g): (int(total[g]) if c.whole else c.gpu_mem) for g in gpus}
        if c.gpu_core or c.whole:
            cores[c.index] = {int(g): names.CORE_PER_GPU if c.whole else c.gpu_core for g in gpus}
    return Allocation(mem=mem, core=cores)


def _fits(
    state: GpuRows, c: ContainerRequest, free: np.ndarray, total: np.ndarray,
    core: np.ndarray, pods: np.ndarray, touched: np.ndarray,
) -> np.ndarray:
    if c.whole:
        return (pods == 0) & (free == total) & ~touched
    ok = (free >= c.gpu_mem) & (pods + ~touched < state.max_pods_per_gpu + 1)
    if c.gpu_core:
        ok &= core >= c.gpu_core
    return ok


def _search(
    state: GpuRows,
    req: PodRequest,
    total: np.ndarray,
    free: np.ndarray,
    core: np.ndarray,
    pods: np.ndarray,
    order: Order,
) -> dict[int, tuple[int, ...]] | None:
    """Every choice of GPUs for the containers, each container's candidates in the strategy's
    order, until one fits them all; ``None`` when none does. Dead ends are remembered by the
    node's remaining row, so a row is explored once per container."""
    containers = list(req.containers)
    touched = np.zeros(len(free), dtype=bool)
    dead: set[tuple[int, bytes, bytes, bytes, bytes]] = set()

    def rec(i: int) -> dict[int, tuple[int, ...]] | None:
        if i == len(containers):
            return {}
        key = (i, free.tobytes(), core.tobytes(), pods.tobytes(), touched.tobytes())
        if key in dead:
            return None
        c = containers[i]
        idx = np.flatnonzero(_fits(state, c, free, total, core, pods, touched))
        if len(idx) >= c.gpus:
            after = free - (0 if c.whole else c.gpu_mem)
            ranked = [int(x) for x in order(after, pods, idx)]
            for combo in itertools.combinations(ranked, c.gpus):
                saved = (free.copy(), core.copy(), pods.copy(), touched.copy())
                _take(c, combo, free, total, core, pods, touched)
                rest = rec(i + 1)
                free[:], core[:], pods[:], touched[:] = saved
                if rest is not None:
                    rest[c.index] = tuple(sorted(combo))
                    return rest
        dead.add(key)
        return None

    return rec(0)


def _choose(
    state: GpuRows,
    c: ContainerRequest,
    free: np.ndarray,
    total: np.ndarray,
    core: np.ndarray,
    pods: np.ndarray,
    touched: np.ndarray,
    order: Order,
    strategy: str,
    links: np.ndarray | None,
    prefer: dict[int, tuple[int, ...]] | None,
) -> tuple[int, ...] | None:
    ok = _fits(state, c, free, total, core, pods, touched)
    if prefer and c.index in prefer:
        want = prefer[c.index]
        if len(set(want)) == c.gpus and all(0 <= x < len(ok) and ok[x] for x in want):
            return tuple(sorted(want))
        return None
    idx = np.flatnonzero(ok)
    if len(idx) < c.gpus:
        return None
    if c.whole and strategy != FIRSTFIT and (strategy == "topology" or links is not None):
        return best_set(links, [int(x) for x in idx], c.gpus)
    after = free - (0 if c.whole else c.gpu_mem)
    ranked = order(after, pods, idx)
    return tuple(sorted(int(x) for x in ranked[: c.gpus]))


def request_strategy(req: PodRequest, default: str) -> str:
    return "topology" if req.kind is Kind.TOPOLOGY else default
