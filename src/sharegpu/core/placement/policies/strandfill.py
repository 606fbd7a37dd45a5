"""strandfill: strandlp, with a node's gaps priced only while the node can still fill them.

A node is worth ``N = Σ_i K(g_i) · live_i``: each GPU's free amount at strandlp's LP price
(:mod:`..shareprices`) while more than :data:`LIVE` of the pods that could use it still fit the
node's free CPU, memory and card model. A move's score is strand's minus
:data:`.strandlp.WEIGHT` times its loss ``N(before) − y − N(after)``, rounded to
:data:`.strandlp.LOSS_QUANTUM`. Why, and what it was measured to do: docs/strandfill.md.
"""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import ClusterState
from ..base import register
from ..fragmentation import TargetWorkload
from .strandlp import LOSS_QUANTUM, WEIGHT, StrandLP

#: a free amount counts while more than this share of the pods that could fill it still fit the
#: node's CPU, memory and model (measured on openb ``default``, 10 seeds: 0 → 4.04 %, with
#: shares only; 0.2 → 3.90, 0.3 → 3.91, 0.4 → 3.93, 0.5 → 3.96, all pods priced)
LIVE = 0.25
WORTH = 3  # the column of ``N`` among a row's measures (after strand's F, R and V)


@register
class StrandFill(StrandLP):
    name = "strandfill"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self._history: TargetWorkload | None = None
        self._access_models = -1

    def prepare(self, state: ClusterState, workload: object | None = None) -> None:
        super().prepare(state, workload)
        assert isinstance(workload, TargetWorkload) and self.prices is not None
        h = workload.full or workload
        self._history = h
        capacity = self.prices.capacity
        worth = np.array([
            float(k) if g >= capacity else (self.prices.price(g) if g > 0 and k == 1 else 0.0)
            for g, k in zip(h.gpu.tolist(), h.k.tolist(), strict=True)
        ])
        self.t_gpu = h.gpu.astype(np.int64)
        self.t_whole = h.k > 1  # these need whole GPUs
        self.t_cpu = h.cpu.astype(np.int64)
        mem = h.mem if h.mem is not None else np.zeros(h.size)
        self.t_mem = np.asarray(mem, dtype=np.float64)
        self.t_weight = h.p * worth  # frequency × price (× GPUs for whole-GPU pods)
        self.access = h.access(state.models)
        self._access_models = len(state.models)
        self.memo.clear()

    def refresh(self, state: ClusterState) -> None:
        super().refresh(state)  # clears the measures when a card model is new
        if self._history is not None and len(state.models) != self._access_models:
            self.access = self._history.access(state.models)  # a new card model
            self._access_models = len(state.models)
            self.memo.clear()

    # -- a node's worth -----------------------------------------------------------------------
    def _compute(self, keys: np.ndarray) -> np.ndarray:
        """Strand's F, R and V of each row, then its worth ``N`` (column :data:`WORTH`)."""
        return np.concatenate([super()._compute(keys), self._worth(keys)[:, None]], axis=1)

    def node_worth(self, keys: np.ndarray) -> np.ndarray:
        """``N`` of rows given by :func:`..rowmemo.row_keys` (free GPU, CPU, memory, model)."""
        return self.measures(keys)[:, WORTH]

    def _worth(self, keys: np.ndarray) -> np.ndarray:
        assert self.prices is not None
        w = keys.shape[1] - 3
        free = keys[:, :w]
        cpu, mem, model = keys[:, w], keys[:, w + 1], keys[:, w + 2]
        whole = free >= self.prices.capacity
        # [R, W, T]: shape t could use GPU i's free amount (whole-GPU pods: whole GPUs only)
        uses = (self.t_gpu[None, None, :] <= free[:, :, None]) & (
            ~self.t_whole[None, None, :] | whole[:, :, None])
        fits = ((self.t_cpu[None, :] <= cpu[:, None]) & (self.t_mem[None, :] <= mem[:, None])
                & self.access[:, model].T)  # [R, T]
        weight = uses * self.t_weight[None, None, :]
        could = weight.sum(axis=2)
        can = (weight * fits[:, None, :]).sum(axis=2)
        live = can > LIVE * could
        # a row-wise sum so that equal rows give bit-equal values whatever the batch
        return (self.prices.value(free) * live).sum(axis=1)

    def pod_worth(self, req: PodRequest) -> float:
        assert self.prices is not None
        if not req.containers:
            return 0.0
        c = req.containers[0]
        if c.gpus == 1 and c.gpu_mem < self.prices.capacity:
            return self.prices.price(int(c.gpu_mem))
        return float(sum(x.gpus * x.gpu_mem for x in req.containers)) / self.prices.capacity

    def gains(
        self, state: ClusterState, req: PodRequest, nodes: np.ndarray, ri: np.ndarray,
        rows: np.ndarray,
    ) -> np.ndarray:
        before, after = self.move_measures(state, req, nodes, ri, rows)
        score = self.rate_moves(before, after)  # strand's
        loss = before[:, WORTH] - self.pod_worth(req) - after[:, WORTH]
        return score - WEIGHT * np.round(loss / LOSS_QUANTUM) * LOSS_QUANTUM
