"""The target workload the view's policy is prepared with: learnt from the shapes of the pods
seen (first after ``workload_refresh`` pods, then each time their number doubled) or fixed,
and a default until pods have been seen. A part of :class:`~.view.ClusterView`."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from ..annotations import Allocation
from ..placement.fragmentation import Shape, TargetWorkload
from ..placement.nodecache import ShapeCache
from ..request import PodRequest
from ..state import ClusterState


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
    """The workload refresh of :class:`~.view.ClusterView` (its attributes are made by
    :class:`~.cache.ClusterCache`: ``history``, ``shapes``, ``policy``, ``state``...)."""

    def _prepare(self, force: bool = True) -> None:
        """Learn the target workload and hand it to the policy. Unless ``force``d (a new
        state), a workload that barely moved (total variation below 5 %) is not handed over
        again, since that would drop the policy's caches for nothing."""
        total = self._seen
        if self.fixed_workload is not None:
            workload = self.fixed_workload
        elif total:
            # every pod's shape with its host memory, as the simulator's history has them
            pods = list(self.history.elements())
            workload = TargetWorkload.from_shapes([t for t, _ in pods],
                                                  mem=[m for _, m in pods])
        else:
            workload = default_workload(self.state)
        self._shapes_at_prepare = total
        if not force and self.workload is not None and _distance(self.workload, workload) < 0.05:
            return
        self.workload = workload
        self.policy.prepare(self.state, self.workload)
        self._epoch += 1
        if self._scores is not None:
            self._scores = ShapeCache({"score": np.float64})

    def use_workload(self, workload: TargetWorkload | None) -> None:
        """Fix the policy's target workload (``None``: learn it from the pods seen again)."""
        self.fixed_workload = workload
        self._prepare()

    def maybe_refresh_workload(self) -> None:
        """Re-learn the target workload from the pods seen: first after ``workload_refresh``
        pods, then each time their number doubled."""
        total = self._seen
        if total < self.workload_refresh or self.fixed_workload is not None:
            return
        if self._shapes_at_prepare < self.workload_refresh:
            self._prepare()
        elif total >= 2 * self._shapes_at_prepare:
            self._prepare(force=False)

    def _count_shape(self, key: str, req: PodRequest, alloc: Allocation) -> None:
        if key in self._shape_of:
            return
        s = shape_of(req, alloc)
        if s is not None:
            self._shape_of[key] = s
            self._seen += 1
            self.shapes[s] += 1
            self.history[(s, req.mem_mib)] += 1


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

