"""FGD, Fragmentation Gradient Descent (Weng et al., USENIX ATC'23).

Each pod goes where the cluster's fragmentation (see :mod:`..fragmentation`) grows least. The
node score is ``floor(100 · sigmoid((F_before − F_after) / 1000))`` for the best GPU choice on the
node (lowest GPU index among equal scores); whole-card and multi-GPU pods take the lowest-index
free GPUs. Scores are integers and ties go to a random node, as in the paper's simulator.

The moves, their caching per pod shape and the GPU choice are :class:`..moves.MovePolicy`'s;
each distinct node row is evaluated once (:mod:`..rowmemo`).
"""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import ClusterState
from ..base import register
from ..fragmentation import TargetWorkload, fragmentation
from ..moves import MovePolicy
from ..nodecache import ShapeCache
from ..rowmemo import RowMemo, row_keys

PAPER_SCALE = 1000.0  # the paper divides F deltas (milli-GPU) by 1000: one GPU


class FragmentationModel:
    """F of node rows under one target workload, with identical rows computed once."""

    def __init__(self, state: ClusterState, workload: TargetWorkload) -> None:
        self.workload = workload
        self._models = -1
        self._access = np.zeros((0, 0), dtype=bool)
        self.memo = RowMemo()
        self.refresh(state)

    def refresh(self, state: ClusterState) -> None:
        if len(state.models) != self._models:
            self._access = self.workload.access(state.models)
            self._models = len(state.models)
            self.memo.clear()

    def rows(self, free: np.ndarray, cpu: np.ndarray, model: np.ndarray) -> np.ndarray:
        if len(free) == 0:
            return np.zeros(0)
        w = free.shape[1]
        return self.memo(row_keys(free, cpu, model), lambda k: self.values(
            np.ascontiguousarray(k[:, :w]), k[:, w], k[:, w + 1]))

    def values(self, free: np.ndarray, cpu: np.ndarray, model: np.ndarray) -> np.ndarray:
        """F of rows, computed (no memo); ``free`` rows sorted largest first."""
        return fragmentation(free, cpu, model, self.workload, self._access)

    def nodes(self, state: ClusterState, nodes: np.ndarray) -> np.ndarray:
        self.refresh(state)
        return self.rows(state.gpu_free[nodes], state.cpu_free[nodes], state.model[nodes])


def sigmoid_score(delta: np.ndarray, scale: float = PAPER_SCALE) -> np.ndarray:
    """``floor(100 · sigmoid(delta / scale))``; ``scale`` is one GPU in the state's units."""
    with np.errstate(over="ignore"):
        return np.floor(100.0 / (1.0 + np.exp(-delta / scale)))


def gpu_scale(state: ClusterState) -> float:
    """One GPU in the state's memory units (1000 in the simulator, GiB of the largest GPU in a
    cluster), so scores mean the same whatever the units."""
    n = state.n
    return float(state.gpu_total[:n].max(initial=0)) or PAPER_SCALE


@register
class FGD(MovePolicy):
    name = "fgd"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.model: FragmentationModel | None = None
        self.scale = PAPER_SCALE
        self._before = ShapeCache({"f": np.float64}, columns=1)

    def prepare(self, state: ClusterState, workload: object | None = None) -> None:
        if not isinstance(workload, TargetWorkload):
            raise ValueError("fgd needs a target workload (a TargetWorkload)")
        self.model = FragmentationModel(state, workload)
        self.scale = gpu_scale(state)
        self.reset_cache()
        self._before = ShapeCache({"f": np.float64}, columns=1)

    def refresh(self, state: ClusterState) -> None:
        if self.model is None:
            raise RuntimeError("fgd: prepare() was not called with a target workload")
        self.model.refresh(state)

    def f_before(self, state: ClusterState, nodes: np.ndarray) -> np.ndarray:
        """F of each node as it is, cached per node version."""
        assert self.model is not None
        stale = self._before.stale(state, nodes, 0)
        if len(stale):
            self._before.store(state, stale, 0, f=self.model.nodes(state, stale))
        return self._before.get("f", nodes, 0)

    def gains(
        self, state: ClusterState, req: PodRequest, nodes: np.ndarray, ri: np.ndarray,
        rows: np.ndarray,
    ) -> np.ndarray:
        assert self.model is not None
        before = self.f_before(state, nodes)
        cpu = state.cpu_free[nodes][ri] - req.cpu_milli
        after = self.model.rows(rows, cpu, state.model[nodes][ri])
        return sigmoid_score(before[ri] - after, self.scale)
