"""The target workload a cluster's policy is prepared with (the extender's, and
``sharegpu whatif``'s replays): learnt from the shapes of the
pods seen (first after ``workload_refresh`` pods, then each time their number doubled) or
fixed, and a default until pods have been seen."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..annotations import Allocation
from ..request import PodRequest
from ..state import ClusterState
from .base import Policy
from .fragmentation import Shape, TargetWorkload


def shape_of(req: PodRequest, alloc: Allocation) -> Shape | None:
    """The FGD shape of a placed pod: its CPU, GPU per GPU of its first container and how many
    GPUs (as the simulator's trace shapes)."""
    if not req.containers:
        return None
    c = req.containers[0]
    per = alloc.mem.get(c.index) or {}
    if not per:
        return None
    models = "|".join(sorted(req.models)) if req.models else ""
    return (req.cpu_milli, int(max(per.values())), len(per), models)


def default_workload(state: ClusterState) -> TargetWorkload:
    """Used until pods have been seen: fractions of the most common GPU size, and whole cards."""
    n = state.n
    sizes = state.gpu_total[:n][state.gpu_exists[:n]]
    size = int(Counter(sizes.tolist()).most_common(1)[0][0]) if len(sizes) else 16
    parts = sorted({max(size // d, 1) for d in (8, 4, 2, 1)})
    shapes: list[Shape] = [(0, m, 1, "") for m in parts] + [(0, size, 2, "")]
    return TargetWorkload.from_shapes(shapes, coverage=1.0)


class LearnedWorkload:
    """The policy's target workload: learnt from the shapes of the pods counted (or fixed),
    handed to the policy with the state it scores. ``epoch`` grows each time the policy is
    prepared afresh (scores kept from before are stale then)."""

    def __init__(self, policy: Policy, *, refresh: int = 50,
                 fixed: TargetWorkload | None = None) -> None:
        self.policy = policy
        self.workload_refresh = refresh
        self.fixed_workload = fixed
        self.workload: TargetWorkload | None = None
        self.shapes: Counter[Shape] = Counter()
        # the same pods by (shape, host memory MiB): the history the workload is learnt from
        self.history: Counter[tuple[Shape, int]] = Counter()
        self._shape_of: dict[str, Shape] = {}  # live pods already counted in ``shapes``
        self._seen = 0  # pods counted in ``shapes``
        self._shapes_at_prepare = -1
        self.epoch = 0

    def prepare(self, state: ClusterState, force: bool = True) -> None:
        """Learn the target workload and hand it to the policy with ``state``. Unless
        ``force``d (a new state), a workload that barely moved (total variation below 5 %) is
        not handed over again, since that would drop the policy's caches for nothing."""
        total = self._seen
        if self.fixed_workload is not None:
            workload = self.fixed_workload
        elif total:
            # every pod's shape with its host memory, as the simulator's history has them
            pods = list(self.history.elements())
            workload = TargetWorkload.from_shapes([t for t, _ in pods],
                                                  mem=[m for _, m in pods])
        else:
            workload = default_workload(state)
        self._shapes_at_prepare = total
        if not force and self.workload is not None and _distance(self.workload, workload) < 0.05:
            return
        self.workload = workload
        self.policy.prepare(state, self.workload)
        self.epoch += 1

    def use(self, workload: TargetWorkload | None, state: ClusterState) -> None:
        """Fix the policy's target workload (``None``: learn it from the pods seen again)."""
        self.fixed_workload = workload
        self.prepare(state)

    def maybe_refresh(self, state: ClusterState) -> None:
        """Re-learn the target workload from the pods seen: first after ``workload_refresh``
        pods, then each time their number doubled."""
        total = self._seen
        if total < self.workload_refresh or self.fixed_workload is not None:
            return
        if self._shapes_at_prepare < self.workload_refresh:
            self.prepare(state)
        elif total >= 2 * self._shapes_at_prepare:
            self.prepare(state, force=False)

    def count(self, key: str, req: PodRequest, alloc: Allocation) -> None:
        """Count a placed pod's shape once (it stays in the history after the pod ends)."""
        if key in self._shape_of:
            return
        s = shape_of(req, alloc)
        if s is not None:
            self._shape_of[key] = s
            self._seen += 1
            self.shapes[s] += 1
            self.history[(s, req.mem_mib)] += 1

    def forget(self, key: str) -> None:
        """The pod is gone: its shape stays in the history."""
        self._shape_of.pop(key, None)

    def clear(self) -> None:
        """Forget every count (a rebuild counts the placed pods again)."""
        self._shape_of.clear()
        self._seen = 0
        self.shapes.clear()
        self.history.clear()


def _distance(a: TargetWorkload, b: TargetWorkload) -> float:
    """Total variation distance between two workloads' shape distributions."""

    def dist(w: TargetWorkload) -> dict[tuple[Any, ...], float]:
        out: dict[tuple[Any, ...], float] = {}
        for t in range(w.size):
            k = (int(w.cpu[t]), int(w.gpu[t]), int(w.k[t]), w.models[t])
            out[k] = out.get(k, 0.0) + float(w.p[t])
        return out

    da, db = dist(a), dist(b)
    return 0.5 * sum(abs(da.get(k, 0.0) - db.get(k, 0.0)) for k in set(da) | set(db))

