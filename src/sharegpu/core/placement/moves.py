"""Policies that score a node by its best *move*: what placing the pod there does to a measure
of the node's own row (FGD's fragmentation, strand's stranded GPU, ...).

A subclass says how good a move is (:meth:`MovePolicy.gains`); this base enumerates the moves
and keeps the bookkeeping that makes it fast:

- a CPU-only pod has one move per node; a pod on k > 1 GPUs takes the tightest GPUs that fit
  (as best fit does); a pod on one GPU has one move per GPU that fits, and GPUs with the same
  free amount count once (the lowest index stands for them);
- a node's score is its best move's, and that move's GPU is what :meth:`select` places on
  (lowest GPU index among equals);
- scores and GPUs are cached per pod shape and node, and only nodes whose state version changed
  since the shape was last scored are evaluated again (:class:`.nodecache.ShapeCache`).

Pods with several containers or compute requests take a slower path: each node's best-fit
allocation is the one move, and nothing is cached.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np

from ..annotations import Allocation
from ..gpuchoice import assign, node_strategy
from ..request import PodRequest
from ..state import ClusterState
from .base import Policy
from .nodecache import ShapeCache


@functools.cache
def _earlier(w: int) -> np.ndarray:
    """[w, w]: True where the column's GPU comes before the row's."""
    return np.tril(np.ones((w, w), dtype=bool), -1)


def has_fast_path(req: PodRequest) -> bool:
    """CPU-only pods, and pods with one container that asks for no compute and no whole card."""
    if not req.containers:
        return True
    c = req.containers[0]
    return len(req.containers) == 1 and not c.gpu_core and not c.whole


class MovePolicy(Policy):
    """Base of FGD-like policies; subclasses implement :meth:`gains`."""

    #: whether the pod's host memory changes its score (part of the cache key)
    key_has_memory: ClassVar[bool] = False

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.cache = ShapeCache({"score": np.float64, "gpu": np.int64})

    def reset_cache(self) -> None:
        self.cache = ShapeCache({"score": np.float64, "gpu": np.int64})

    def shape_key(self, req: PodRequest) -> tuple[int, ...] | None:
        """Cache key of a pod with the fast path; ``None`` for the slow path."""
        if not has_fast_path(req):
            return None
        head = (req.cpu_milli, req.mem_mib) if self.key_has_memory else (req.cpu_milli,)
        if not req.containers:
            return (*head, 0, 0)
        c = req.containers[0]
        return (*head, c.gpu_mem, c.gpus)

    # -- what a subclass provides ---------------------------------------------------------------
    def refresh(self, state: ClusterState) -> None:
        """Called before every scoring: check readiness, follow new card models."""

    def gains(
        self, state: ClusterState, req: PodRequest, nodes: np.ndarray, ri: np.ndarray,
        rows: np.ndarray,
    ) -> np.ndarray:
        """Scores of the moves that leave node ``nodes[ri]`` with free GPU ``rows`` (the pod's
        CPU and memory taken)."""
        raise NotImplementedError

    # -- scoring --------------------------------------------------------------------------------
    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        self.refresh(state)
        key = self.shape_key(req)
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
        free = state.gpu_free[nodes]
        every = np.arange(len(nodes))
        gpu_out = np.full(len(nodes), -1, dtype=np.int64)
        if not req.containers:
            return self.gains(state, req, nodes, every, free), gpu_out
        c = req.containers[0]
        fits = state.gpu_fits(c, nodes)
        if c.gpus > 1:
            # the tightest GPUs that fit, lowest index first among equals (as best fit takes)
            rank = np.argsort(np.where(fits, free, np.iinfo(np.int64).max), axis=1, kind="stable")
            take = np.zeros_like(fits)
            np.put_along_axis(take, rank[:, : c.gpus], True, axis=1)
            rows = free - (take & fits) * c.gpu_mem
            return self.gains(state, req, nodes, every, rows), gpu_out
        w = free.shape[1]
        # the first GPU of each distinct free amount stands for all GPUs with that amount
        same = (free[:, :, None] == free[:, None, :]) & fits[:, None, :]
        earlier = _earlier(w)
        dup = (same & earlier[None, :, :]).any(axis=2)
        ri, gj = np.nonzero(fits & ~dup)
        rows = free[ri].copy()
        rows[np.arange(len(ri)), gj] -= c.gpu_mem
        s = self.gains(state, req, nodes, ri, rows)
        # per node: the best move, lowest GPU index among equals
        order = np.lexsort((gj, -s, ri))
        ri, gj, s = ri[order], gj[order], s[order]
        first = np.ones(len(ri), dtype=bool)
        first[1:] = ri[1:] != ri[:-1]
        score = np.full(len(nodes), -np.inf)
        score[ri[first]] = s[first]
        gpu_out[ri[first]] = gj[first]
        return score, gpu_out

    def _score_slow(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        rows = state.gpu_free[nodes].copy()
        for r, node in enumerate(nodes):
            alloc = assign(state, req, int(node), "bestfit")
            if alloc is not None:
                for gpu, v in alloc.per_gpu_mem().items():
                    rows[r, gpu] -= v
        return self.gains(state, req, nodes, np.arange(len(nodes)), rows)

    def select(self, state: ClusterState, req: PodRequest, node: int) -> Allocation | None:
        """The best move's GPU for a pod on one GPU; best fit otherwise. The node label
        ``ack.node.gpu.placement`` wins over both."""
        strategy = node_strategy(state, node, self.name)
        key = self.shape_key(req)
        one_gpu = bool(req.containers) and req.containers[0].gpus == 1
        if strategy != self.name or key is None or not one_gpu:
            return assign(state, req, node, "bestfit" if strategy == self.name else strategy)
        col = self.cache.column(key)
        if self.cache.stale(state, np.array([node]), col).size:
            self.score(state, req, np.array([node]))
        gpu = int(self.cache.get("gpu", node, col))
        if gpu < 0:
            return None
        return assign(state, req, node, "bestfit", prefer={req.containers[0].index: (gpu,)})
