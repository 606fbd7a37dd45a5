"""FGD, Fragmentation Gradient Descent (Weng et al., USENIX ATC'23).

Each pod goes where the cluster's fragmentation (see :mod:`..fragmentation`) grows least. The
node score is ``floor(100 · sigmoid((F_before − F_after) / 1000))`` for the best GPU choice on the
node (lowest GPU index among equal scores); whole-card and multi-GPU pods take the lowest-index
free GPUs. Scores are integers and ties go to a random node, as in the paper's simulator.

Per decision only the nodes that changed since this pod shape was last scored are evaluated
(:class:`..nodecache.ShapeCache`), and identical node rows are evaluated once.
"""

from __future__ import annotations

import numpy as np

from ...annotations import Allocation
from ...request import PodRequest
from ...state import ClusterState
from ..base import Policy, register
from ..fragmentation import TargetWorkload, fragmentation
from ..gpus import assign, node_strategy
from ..nodecache import ShapeCache

SCALE = 1000.0  # F deltas are divided by this (milli-GPU in the paper) before the sigmoid


def unique_rows(free: np.ndarray, cpu: np.ndarray, model: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rows with GPU amounts sorted (F ignores GPU order), de-duplicated; returns the unique
    (free, cpu, model) and the inverse index."""
    srt = -np.sort(-free, axis=1)
    key = np.concatenate([srt, cpu[:, None], model[:, None].astype(np.int64)], axis=1)
    key = np.ascontiguousarray(key)
    void = key.view(np.dtype((np.void, key.dtype.itemsize * key.shape[1]))).ravel()
    _, first, inverse = np.unique(void, return_index=True, return_inverse=True)
    return srt[first], cpu[first], model[first], inverse.ravel()


class FragmentationModel:
    """F of node rows under one target workload, with identical rows computed once."""

    def __init__(self, state: ClusterState, workload: TargetWorkload) -> None:
        self.workload = workload
        self._models = -1
        self._access = np.zeros((0, 0), dtype=bool)
        self.refresh(state)

    def refresh(self, state: ClusterState) -> None:
        if len(state.models) != self._models:
            self._access = self.workload.access(state.models)
            self._models = len(state.models)

    def rows(self, free: np.ndarray, cpu: np.ndarray, model: np.ndarray) -> np.ndarray:
        if len(free) == 0:
            return np.zeros(0)
        f, c, m, inv = unique_rows(free, cpu, model)
        return fragmentation(f, c, m, self.workload, self._access)[inv]

    def nodes(self, state: ClusterState, nodes: np.ndarray) -> np.ndarray:
        self.refresh(state)
        return self.rows(state.gpu_free[nodes], state.cpu_free[nodes], state.model[nodes])


def sigmoid_score(delta: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.floor(100.0 / (1.0 + np.exp(-delta / SCALE)))


def shape_key(req: PodRequest) -> tuple[int, ...] | None:
    """Cache key for pods FGD evaluates with the fast path (one container, no compute)."""
    if not req.containers:
        return (req.cpu_milli, 0, 0)
    if len(req.containers) == 1 and not req.containers[0].gpu_core and not req.containers[0].whole:
        c = req.containers[0]
        return (req.cpu_milli, c.gpu_mem, c.gpus)
    return None


@register
class FGD(Policy):
    name = "fgd"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.model: FragmentationModel | None = None
        self.cache = ShapeCache({"score": np.float64, "gpu": np.int64})
        self._before = ShapeCache({"f": np.float64}, columns=1)

    def prepare(self, state: ClusterState, workload: object | None = None) -> None:
        if not isinstance(workload, TargetWorkload):
            raise ValueError("fgd needs a target workload (a TargetWorkload)")
        self.model = FragmentationModel(state, workload)
        self.cache = ShapeCache({"score": np.float64, "gpu": np.int64})
        self._before = ShapeCache({"f": np.float64}, columns=1)

    # -- F before, cached per node version ------------------------------------------------------
    def f_before(self, state: ClusterState, nodes: np.ndarray) -> np.ndarray:
        assert self.model is not None
        stale = self._before.stale(state, nodes, 0)
        if len(stale):
            self._before.store(state, stale, 0, f=self.model.nodes(state, stale))
        return self._before.get("f", nodes, 0)

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        if self.model is None:
            raise RuntimeError("fgd: prepare() was not called with a target workload")
        key = shape_key(req)
        if key is None:
            return self._score_slow(state, req, nodes)
        col = self.cache.column(key)
        stale = self.cache.stale(state, nodes, col)
        if len(stale):
            score, gpu = self._evaluate(state, req, stale)
            self.cache.store(state, stale, col, score=score, gpu=gpu)
        return self.cache.get("score", nodes, col)

    def _evaluate(
        self, state: ClusterState, req: PodRequest, nodes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        assert self.model is not None
        self.model.refresh(state)
        before = self.f_before(state, nodes)
        free = state.gpu_free[nodes]
        cpu = state.cpu_free[nodes] - req.cpu_milli
        model = state.model[nodes]
        gpu_out = np.full(len(nodes), -1, dtype=np.int64)
        if not req.containers:
            after = self.model.rows(free, cpu, model)
            return sigmoid_score(before - after), gpu_out
        c = req.containers[0]
        if c.gpus > 1:
            # the tightest GPUs that fit, lowest index first among equals (as best fit takes)
            fits = state.gpu_fits(c, nodes)
            rank = np.argsort(np.where(fits, free, np.iinfo(np.int64).max), axis=1, kind="stable")
            take = np.zeros_like(fits)
            np.put_along_axis(take, rank[:, : c.gpus], True, axis=1)
            rows = free - (take & fits) * c.gpu_mem
            after = self.model.rows(rows, cpu, model)
            return sigmoid_score(before - after), gpu_out
        fits = state.gpu_fits(c, nodes)
        w = free.shape[1]
        # the first GPU of each distinct free amount stands for all GPUs with that amount
        same = (free[:, :, None] == free[:, None, :]) & fits[:, None, :]
        earlier = np.tril(np.ones((w, w), dtype=bool), -1)
        dup = (same & earlier[None, :, :]).any(axis=2)
        ri, gj = np.nonzero(fits & ~dup)
        rows = free[ri].copy()
        rows[np.arange(len(ri)), gj] -= c.gpu_mem
        after = self.model.rows(rows, cpu[ri], model[ri])
        s = sigmoid_score(before[ri] - after)
        # per node: the highest score, lowest GPU index among equals
        order = np.lexsort((gj, -s, ri))
        ri, gj, s = ri[order], gj[order], s[order]
        first = np.ones(len(ri), dtype=bool)
        first[1:] = ri[1:] != ri[:-1]
        score = np.zeros(len(nodes))
        score[ri[first]] = s[first]
        gpu_out[ri[first]] = gj[first]
        return score, gpu_out

    def _score_slow(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        """Pods with several containers or compute requests: evaluate each node's best-fit
        allocation (rare in practice; no cache)."""
        assert self.model is not None
        before = self.f_before(state, nodes)
        rows = state.gpu_free[nodes].copy()
        for r, node in enumerate(nodes):
            alloc = assign(state, req, int(node), "bestfit")
            if alloc is not None:
                for gpu, v in alloc.per_gpu_mem().items():
                    rows[r, gpu] -= v
        cpu = state.cpu_free[nodes] - req.cpu_milli
        after = self.model.rows(rows, cpu, state.model[nodes])
        return sigmoid_score(before - after)

    def select(self, state: ClusterState, req: PodRequest, node: int) -> Allocation | None:
        strategy = node_strategy(state, node, "fgd")
        key = shape_key(req)
        if strategy != "fgd" or key is None or not req.containers or req.containers[0].gpus != 1:
            return assign(state, req, node, "bestfit" if strategy == "fgd" else strategy)
        col = self.cache.column(key)
        if self.cache.stale(state, np.array([node]), col).size:
            self.score(state, req, np.array([node]))
        gpu = int(self.cache.get("gpu", node, col))
        if gpu < 0:
            return None
        return assign(state, req, node, "bestfit", prefer={req.containers[0].index: (gpu,)})
