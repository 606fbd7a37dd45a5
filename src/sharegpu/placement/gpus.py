"""Choosing GPUs inside one node.

Strategies: ``bestfit`` (= ACK ``binpack``: the GPU left with the least free memory that still
fits, so one GPU fills before the next), ``spread`` (the GPU with the most free memory, then the
fewest pods), ``topology`` (whole cards: the best-connected set given the node's link matrix).
A policy may also hand over its own ordering of GPUs. Multi-container pods are assigned
container by container on a scratch copy of the node's row, so containers of one pod can share a
GPU and the per-GPU rules hold for their sum.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import names
from ..annotations import Allocation
from ..modes import Placement
from ..request import ContainerRequest, Kind, PodRequest
from ..state import ClusterState
from ..topology import best_set

# order(free_after, pods, candidates) -> candidates sorted best first
Order = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]

STRATEGIES = ("bestfit", "binpack", "spread", "topology")


def _order(strategy: str) -> Order:
    if strategy in ("bestfit", "binpack", "topology"):
        return lambda after, pods, idx: idx[np.lexsort((idx, after[idx]))]
    if strategy == "spread":
        return lambda after, pods, idx: idx[np.lexsort((idx, pods[idx], -after[idx]))]
    raise ValueError(f"unknown GPU strategy {strategy!r}; one of {', '.join(STRATEGIES)}")


def node_strategy(state: ClusterState, node: int, default: str) -> str:
    """The node label ``ack.node.gpu.placement`` wins over the policy's own preference."""
    spec = state.specs[node]
    if spec is not None and spec.placement is not None:
        return "spread" if spec.placement is Placement.SPREAD else "bestfit"
    return default


def assign(
    state: ClusterState,
    req: PodRequest,
    node: int,
    strategy: str = "bestfit",
    prefer: dict[int, tuple[int, ...]] | None = None,
) -> Allocation | None:
    """GPUs for every container of ``req`` on ``node``; ``None`` when they do not all fit.

    ``prefer`` maps a container index to the GPUs a policy already picked for it; they are
    checked like any other choice.
    """
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
    for c in req.containers:
        chosen = _choose(state, c, free, total, core, pods, touched, order, strategy, links, prefer)
        if chosen is None:
            return None
        for gpu in chosen:
            use = int(total[gpu]) if c.whole else c.gpu_mem
            free[gpu] -= use
            core[gpu] -= names.CORE_PER_GPU if c.whole else c.gpu_core
            if not touched[gpu]:
                pods[gpu] += 1
                touched[gpu] = True
        mem[c.index] = {int(gpu): (int(total[gpu]) if c.whole else c.gpu_mem) for gpu in chosen}
        if c.gpu_core or c.whole:
            cores[c.index] = {
                int(gpu): names.CORE_PER_GPU if c.whole else c.gpu_core for gpu in chosen
            }
    return Allocation(mem=mem, core=cores)


def _choose(
    state: ClusterState,
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
    if c.whole:
        ok = (pods == 0) & (free == total) & ~touched
    else:
        ok = (free >= c.gpu_mem) & (pods + ~touched < state.max_pods_per_gpu + 1)
        if c.gpu_core:
            ok &= core >= c.gpu_core
    if prefer and c.index in prefer:
        want = prefer[c.index]
        if len(set(want)) == c.gpus and all(0 <= x < len(ok) and ok[x] for x in want):
            return tuple(sorted(want))
        return None
    idx = np.flatnonzero(ok)
    if len(idx) < c.gpus:
        return None
    if c.whole and (strategy == "topology" or links is not None):
        return best_set(links, [int(x) for x in idx], c.gpus)
    after = free - (0 if c.whole else c.gpu_mem)
    ranked = order(after, pods, idx)
    return tuple(sorted(int(x) for x in ranked[: c.gpus]))


def request_strategy(req: PodRequest, default: str) -> str:
    return "topology" if req.kind is Kind.TOPOLOGY else default
