"""Replays a pod stream through the core scheduler and measures what the paper measures.

After every pod (placed or not): allocated GPU (milli, fractions count) and arrived GPU demand
(every pod tried so far, failed ones included). The curve's point at integer arrived-% x is the
mean allocation over the events whose arrived % rounds to x (x±1 when none does); the headline is
``100 − curve[100]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import ValidationError
from ..core.placement.base import get_policy
from ..core.placement.fragmentation import TargetWorkload
from ..core.placement.policies.fgd import FragmentationModel
from ..core.scheduler import Decision, Scheduler
from ..core.state import ClusterState, NodeSpec
from .trace import GPU_UNITS, TracePod
from .workload import stream

CURVE_MAX = 130
#: the last arrived % the headline reads: :func:`curve_points`' point at 100 takes the events
#: whose arrived % rounds to 100, or those within 99..101 when none does, so nothing at or above
#: 101.5 % changes the headline or the fragmentation at 100 %
HEADLINE_END_PCT = 101.5


@dataclass
class RunResult:
    policy: str
    workload: str
    seed: int
    unallocated_pct: float
    curve: list[float | None]
    frag_pct: float
    pods: int
    placed: int
    seconds: float
    decision_seconds: float
    extra: dict[str, float] = field(default_factory=dict)
    gpu_choice: str = "policy"

    @property
    def pods_per_s(self) -> float:
        return self.pods / self.decision_seconds if self.decision_seconds > 0 else 0.0


def curve_points(arrived_pct: np.ndarray, alloc_pct: np.ndarray) -> list[float | None]:
    """Mean allocation % at each integer arrived % 0..130 (None where nothing arrived near)."""
    a = np.round(arrived_pct)
    b = np.round(alloc_pct, 2)
    out: list[float | None] = []
    for x in range(CURVE_MAX + 1):
        sel = a == x
        if not sel.any():
            sel = (a >= x - 1) & (a <= x + 1)
        out.append(round(float(b[sel].mean()), 2) if sel.any() else None)
    return out


def crossing(arrived_pct: np.ndarray, alloc_pct: np.ndarray, x: float) -> float | None:
    """The allocation % when the arrived demand crosses ``x`` %, interpolated between the last
    arrival below it and the first at or above it (a pod larger than 2 % of the cluster can jump
    over the ±1 % window of :func:`curve_points`); ``None`` when demand never reaches ``x``."""
    above = np.flatnonzero(arrived_pct >= x)
    if len(above) == 0:
        return None
    j = int(above[0])
    if j == 0 or arrived_pct[j] == arrived_pct[j - 1]:
        return round(float(alloc_pct[j]), 2)
    a0, a1 = float(arrived_pct[j - 1]), float(arrived_pct[j])
    b0, b1 = float(alloc_pct[j - 1]), float(alloc_pct[j])
    return round(b0 + (b1 - b0) * (x - a0) / (a1 - a0), 2)


def headline_length(seq: Sequence[TracePod], capacity: int) -> int:
    """Pods of the stream ``seq`` up to the first whose arrival brings the demand to
    :data:`HEADLINE_END_PCT` % of the ``capacity`` GPUs (all of them when it never does):
    every pod the headline and the fragmentation at 100 % depend on."""
    arrived = np.cumsum([tp.gpu_demand for tp in seq], dtype=np.int64).astype(np.float64)
    past = np.flatnonzero(arrived / capacity / 10.0 >= HEADLINE_END_PCT)
    return int(past[0]) + 1 if len(past) else len(seq)


def node_order(n: int, seed: int) -> np.ndarray:
    """Each node's rank for the seed: the paper's simulator lists nodes in a per-seed random
    order, and ties go to the first."""
    return np.random.default_rng([seed, 1]).permutation(n)


def unallocated(
    arrived: np.ndarray, used: np.ndarray, capacity: int, workload_name: str, inflation: float
) -> tuple[float, list[float | None]]:
    """The headline (GPU % left unallocated when the arrived demand reaches 100 %) and the
    curve, from the arrived and allocated milli-GPU after each pod of a run."""
    curve = curve_points(arrived / capacity / 10.0, used / capacity / 10.0)
    at100 = curve[100]
    if at100 is None:
        at100 = crossing(arrived / capacity / 10.0, used / capacity / 10.0, 100.0)
    if at100 is None:
        raise ValidationError(
            "workload", workload_name,
            f"its GPU demand never reaches 100 % of the cluster's capacity (it reaches "
            f"{float(arrived[-1]) / capacity / 10.0:.1f} % after inflating it "
            f"{inflation:g}×): use a larger workload or a smaller cluster")
    return 100.0 - at100, curve


def run_one(
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    policy: str,
    seed: int,
    workload_name: str,
    target: TargetWorkload,
    inflation: float = 1.3,
    on_progress: Callable[[int], None] | None = None,
    placements: list[str | None] | None = None,
    gpu_choice: str = "policy",
    headline_only: bool = False,
    decisions: list[Decision | None] | None = None,
) -> RunResult:
    """One policy over one seed's pod stream. ``placements``, when given, gets each pod's node
    (``None`` when it was not placed), in stream order; ``decisions`` each pod's decision (node
    and GPUs). ``on_progress`` gets the number of pods
    decided so far, every 64 pods. ``gpu_choice="allocator"``: the policy
    picks the node, the GPUs inside it are the DRA allocator's (first fit in device order).
    ``headline_only``: the stream stops at :func:`headline_length`, so the headline and the
    fragmentation are those of the whole stream and the curve ends near 101 %."""
    started = time.perf_counter()
    state = ClusterState(nodes)
    capacity = int(state.gpu_count[: state.n].sum())
    total_units = float(capacity * GPU_UNITS)
    pol = get_policy(policy)
    pol.prepare(state, target)
    state.set_order(node_order(state.n, seed))
    sched = Scheduler(state, pol, seed=seed, gpu_choice=gpu_choice)
    seq = stream(pods, capacity, seed, inflation)
    if headline_only:
        seq = seq[: headline_length(seq, capacity)]
    n = len(seq)
    arrived = np.zeros(n)
    used = np.zeros(n)
    total_arrived = 0
    total_used = 0
    placed = 0
    frag_at_100: float | None = None
    fmodel = FragmentationModel(state, target)
    t_dec = 0.0
    for i, tp in enumerate(seq):
        req = tp.request(f"{tp.name}#{i}")
        t0 = time.perf_counter()
        d = sched.schedule(req)
        t_dec += time.perf_counter() - t0
        total_arrived += tp.gpu_demand
        if placements is not None:
            placements.append(d.node_name if d is not None else None)
        if decisions is not None:
            decisions.append(d)
        if d is not None:
            placed += 1
            total_used += tp.gpu_demand
        arrived[i] = total_arrived
        used[i] = total_used
        if frag_at_100 is None and total_arrived >= total_units:
            live = np.flatnonzero(state.active[: state.n])
            frag_at_100 = float(fmodel.nodes(state, live).sum()) / total_units * 100.0
        if on_progress is not None and (i & 63) == 63:
            on_progress(i + 1)
    unalloc, curve = unallocated(arrived, used, capacity, workload_name, inflation)
    if frag_at_100 is None:
        live = np.flatnonzero(state.active[: state.n])
        frag_at_100 = float(fmodel.nodes(state, live).sum()) / total_units * 100.0
    return RunResult(
        policy=policy,
        workload=workload_name,
        seed=seed,
        unallocated_pct=round(unalloc, 4),
        curve=curve,
        frag_pct=round(frag_at_100, 4),
        pods=n,
        placed=placed,
        seconds=time.perf_counter() - started,
        decision_seconds=t_dec,
        gpu_choice=gpu_choice,
    )
