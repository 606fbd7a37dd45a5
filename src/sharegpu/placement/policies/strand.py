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

The moves, their caching per pod shape and the GPU choice are :class:`..moves.MovePolicy`'s.
"""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import ClusterState
from ..base import register
from ..fragmentation import TargetWorkload
from ..moves import MovePolicy
from ..nodecache import ShapeCache
from ..stranding import StrandingModel
from .fgd import PAPER_SCALE, FragmentationModel, gpu_scale, sigmoid_score

QUANTUM = 0.5  # gains of R closer than half a GPU tie (so that ties still go to the node order)
WEIGHT_CAP = 10.0  # the largest scarcity weight of a shape


@register
class Strand(MovePolicy):
    name = "strand"
    integer_scores = False
    key_has_memory = True

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.model: StrandingModel | None = None  # R
        self.scale = PAPER_SCALE
        self.frag: FragmentationModel  # F
        self.claim: StrandingModel  # V
        self._reset()

    def _reset(self) -> None:
        self.reset_cache()
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

    def gains(
        self, state: ClusterState, req: PodRequest, nodes: np.ndarray, ri: np.ndarray,
        rows: np.ndarray,
    ) -> np.ndarray:
        assert self.model is not None
        f0, r0, v0 = self.before(state, nodes)
        cpu = state.cpu_free[nodes][ri] - req.cpu_milli
        mem = state.mem_free[nodes][ri] - req.mem_mib
        model = state.model[nodes][ri]
        f1 = self.frag.rows(rows, cpu, model)
        r1 = self.model.rows(rows, cpu, mem, model)
        v1 = self.claim.rows(rows, cpu, mem, model)
        return self.rate(f0[ri] - f1, r0[ri] - r1, v0[ri] - v1)

    def refresh(self, state: ClusterState) -> None:
        if self.model is None:
            raise RuntimeError("strand: prepare() was not called with a target workload")
        self.model.refresh(state.models)
        self.claim.refresh(state.models)
        self.frag.refresh(state)
