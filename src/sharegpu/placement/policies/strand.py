"""Strand: FGD's fragmentation gradient, aware of CPU, memory and scarce GPU models.

Each candidate move (node, GPU) is scored from three changes it causes on its node:

* ``F``, FGD's fragmentation under the trace's typical shapes (:mod:`..fragmentation`);
* ``V``, the capacity that model-restricted shapes could still use there, weighted by how
  scarce their models are (:mod:`..stranding`, ``claim``);
* ``R``, the GPU that shapes could use were it not for CPU or memory running out first,
  weighted by scarcity (:mod:`..stranding`, ``resources``).

Score = ``floor(100 · sigmoid((ΔF + ΔV) / 1000))`` (FGD's integer score, with the claim
added) plus a fraction that grows with the decrease of ``R`` rounded to :data:`QUANTUM`; what
still ties goes to the node first in the state's order, as for FGD. See docs/strand.md.

Per decision only the nodes that changed since this pod shape was last scored are evaluated
(:class:`..nodecache.ShapeCache`), and identical node rows are evaluated once.
"""

from __future__ import annotations

import numpy as np

from ...annotations import Allocation
from ...request import PodRequest
from ...state import ClusterState
from ..base import Policy, register
from ..fragmentation import TargetWorkload
from ..gpus import assign, node_strategy
from ..nodecache import ShapeCache
from ..stranding import StrandingModel
from .fgd import PAPER_SCALE, FragmentationModel, gpu_scale, sigmoid_score

QUANTUM = 0.5  # gains of R closer than half a GPU tie (so that ties still go to the node order)
WEIGHT_CAP = 10.0  # the largest scarcity weight of a shape


def shape_key(req: PodRequest) -> tuple[int, ...] | None:
    """Cache key of pods with the fast path (CPU-only, or one container without compute)."""
    if not req.containers:
        return (req.cpu_milli, req.mem_mib, 0, 0)
    if len(req.containers) == 1 and not req.containers[0].gpu_core and not req.containers[0].whole:
        c = req.containers[0]
        return (req.cpu_milli, req.mem_mib, c.gpu_mem, c.gpus)
    return None


@register
class Strand(Policy):
    name = "strand"
    integer_scores = False

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.model: StrandingModel | None = None  # R
        self.scale = PAPER_SCALE
        self.frag: FragmentationModel  # F
        self.claim: StrandingModel  # V
        self._reset()

    def _reset(self) -> None:
        self.cache = ShapeCache({"score": np.float64, "gpu": np.int64})
        self._before = ShapeCache({"f": np.float64, "r": np.float64, "v": np.float64}, columns=1)

    def prepare(self, state: ClusterState, workload: object | None = None) -> None:
        if not isinstance(workload, TargetWorkload):
            raise ValueError("strand needs a target workload (a TargetWorkload)")
        self.frag = FragmentationModel(state, workload)
        self.scale = gpu_scale(state)  # one GPU in the state's units (1000 in the simulator)
        # the whole history of shapes: rare big shapes (8-GPU pods) are the ones that strand most
        history = workload.full or workload
        self.model = StrandingModel(history, state.models, "resources")
        self.claim = StrandingModel(history, state.models, "claim")
        n = state.n
        act = state.active[:n]
        caps = (state.gpu_count[:n][act].astype(np.int64), state.cpu_cap[:n][act],
                state.mem_cap[:n][act], state.model[:n][act])
        for m in (self.model, self.claim):
            m.weigh(m.scarcity(*caps, cap=WEIGHT_CAP))
        self._reset()

    def rate(self, gain_f: np.ndarray, gain_r: np.ndarray, gain_v: np.ndarray) -> np.ndarray:
        """Score of moves from the decrease of FGD's fragmentation (``gain_f``), of the GPU
        stranded by CPU and memory (``gain_r``) and of the claimed capacity (``gain_v``)."""
        primary = sigmoid_score(gain_f + self.beta * gain_v, self.scale)
        quantum = QUANTUM * self.scale
        tie = 0.5 + 0.49 * np.tanh(np.round(gain_r / quantum) * quantum / self.scale)
        return primary + tie

    beta = 1.0

    # -- F and R before, cached per node version ------------------------------------------------
    def before(self, state: ClusterState, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self.model is not None
        stale = self._before.stale(state, nodes, 0)
        if len(stale):
            free, cpu = state.gpu_free[stale], state.cpu_free[stale]
            mem, model = state.mem_free[stale], state.model[stale]
            self._before.store(
                state, stale, 0, f=self.frag.rows(free, cpu, model),
                r=self.model.rows(free, cpu, mem, model),
                v=self.claim.rows(free, cpu, mem, model),
            )
        return (self._before.get("f", nodes, 0), self._before.get("r", nodes, 0),
                self._before.get("v", nodes, 0))

    def _gains(
        self, state: ClusterState, nodes: np.ndarray, ri: np.ndarray, rows: np.ndarray,
        req: PodRequest,
    ) -> np.ndarray:
        """Scores of the moves that leave node ``nodes[ri]`` with free GPU ``rows``."""
        assert self.model is not None
        f0, r0, v0 = self.before(state, nodes)
        cpu = state.cpu_free[nodes][ri] - req.cpu_milli
        mem = state.mem_free[nodes][ri] - req.mem_mib
        model = state.model[nodes][ri]
        f1 = self.frag.rows(rows, cpu, model)
        r1 = self.model.rows(rows, cpu, mem, model)
        v1 = self.claim.rows(rows, cpu, mem, model)
        return self.rate(f0[ri] - f1, r0[ri] - r1, v0[ri] - v1)

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        if self.model is None:
            raise RuntimeError("strand: prepare() was not called with a target workload")
        self.model.refresh(state.models)
        self.claim.refresh(state.models)
        self.frag.refresh(state)
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
        free = state.gpu_free[nodes]
        every = np.arange(len(nodes))
        gpu_out = np.full(len(nodes), -1, dtype=np.int64)
        if not req.containers:
            return self._gains(state, nodes, every, free, req), gpu_out
        c = req.containers[0]
        fits = state.gpu_fits(c, nodes)
        if c.gpus > 1:
            # the tightest GPUs that fit, lowest index first among equals (as best fit takes)
            rank = np.argsort(np.where(fits, free, np.iinfo(np.int64).max), axis=1, kind="stable")
            take = np.zeros_like(fits)
            np.put_along_axis(take, rank[:, : c.gpus], True, axis=1)
            rows = free - (take & fits) * c.gpu_mem
            return self._gains(state, nodes, every, rows, req), gpu_out
        w = free.shape[1]
        # the first GPU of each distinct free amount stands for all GPUs with that amount
        same = (free[:, :, None] == free[:, None, :]) & fits[:, None, :]
        earlier = np.tril(np.ones((w, w), dtype=bool), -1)
        dup = (same & earlier[None, :, :]).any(axis=2)
        ri, gj = np.nonzero(fits & ~dup)
        rows = free[ri].copy()
        rows[np.arange(len(ri)), gj] -= c.gpu_mem
        s = self._gains(state, nodes, ri, rows, req)
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
        """Pods with several containers or compute requests: each node's best-fit allocation
        (rare; no cache)."""
        rows = state.gpu_free[nodes].copy()
        for r, node in enumerate(nodes):
            alloc = assign(state, req, int(node), "bestfit")
            if alloc is not None:
                for gpu, v in alloc.per_gpu_mem().items():
                    rows[r, gpu] -= v
        return self._gains(state, nodes, np.arange(len(nodes)), rows, req)

    def select(self, state: ClusterState, req: PodRequest, node: int) -> Allocation | None:
        strategy = node_strategy(state, node, "strand")
        key = shape_key(req)
        if strategy != "strand" or key is None or not req.containers or req.containers[0].gpus != 1:
            return assign(state, req, node, "bestfit" if strategy == "strand" else strategy)
        col = self.cache.column(key)
        if self.cache.stale(state, np.array([node]), col).size:
            self.score(state, req, np.array([node]))
        gpu = int(self.cache.get("gpu", node, col))
        if gpu < 0:
            return None
        return assign(state, req, node, "bestfit", prefer={req.containers[0].index: (gpu,)})
