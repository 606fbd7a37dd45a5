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
from ..rowmemo import RowMemo, row_keys
from ..stranding import ResourcesAndClaim, StrandingModel
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
        self.both: ResourcesAndClaim
        self._reset()

    def _reset(self) -> None:
        self.reset_cache()
        self.memo = RowMemo()  # F, R and V of a node row, by the row's content
        self._models = -1

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
        self.both = ResourcesAndClaim(self.model, self.claim)  # R and V in one pass
        self._reset()

    def rate(self, gain_f: np.ndarray, gain_r: np.ndarray, gain_v: np.ndarray) -> np.ndarray:
        """Score of moves from the decrease of FGD's fragmentation (``gain_f``), of the GPU
        stranded by CPU and memory (``gain_r``) and of the claimed capacity (``gain_v``)."""
        primary = sigmoid_score(gain_f + self.beta * gain_v, self.scale)
        quantum = QUANTUM * self.scale
        tie = 0.5 + 0.49 * np.tanh(np.round(gain_r / quantum) * quantum / self.scale)
        return primary + tie

    beta = 1.0

    # -- F, R and V of node rows ---------------------------------------------------------------
    def measures(self, keys: np.ndarray) -> np.ndarray:
        """[R, 3]: F, R and V of rows given by :func:`..rowmemo.row_keys` (free GPU, CPU,
        memory, model), each distinct row computed once."""
        return self.memo(keys, self._compute)

    def _compute(self, keys: np.ndarray) -> np.ndarray:
        assert self.model is not None
        w = keys.shape[1] - 3
        free = np.ascontiguousarray(keys[:, :w])
        cpu, mem, model = keys[:, w], keys[:, w + 1], keys[:, w + 2]
        r, v = self.both.rows(free, cpu, mem, model)
        return np.stack([self.frag.values(free, cpu, model), r, v], axis=1)

    def move_measures(
        self, state: ClusterState, req: PodRequest, nodes: np.ndarray, ri: np.ndarray,
        rows: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The measures (:meth:`measures`' columns) of each move's node before and after it."""
        cpu, mem, model = state.cpu_free[nodes], state.mem_free[nodes], state.model[nodes]
        before = row_keys(state.gpu_free[nodes], cpu, mem, model)
        after = row_keys(rows, cpu[ri] - req.cpu_milli, mem[ri] - req.mem_mib, model[ri])
        m = self.measures(np.concatenate([before, after]))
        return m[: len(nodes)][ri], m[len(nodes) :]

    def rate_moves(self, before: np.ndarray, after: np.ndarray) -> np.ndarray:
        """Strand's score of moves from their nodes' measures before and after."""
        d = before - after
        return self.rate(d[:, 0], d[:, 1], d[:, 2])

    def gains(
        self, state: ClusterState, req: PodRequest, nodes: np.ndarray, ri: np.ndarray,
        rows: np.ndarray,
    ) -> np.ndarray:
        return self.rate_moves(*self.move_measures(state, req, nodes, ri, rows))

    def refresh(self, state: ClusterState) -> None:
        if self.model is None:
            raise RuntimeError("strand: prepare() was not called with a target workload")
        self.model.refresh(state.models)
        self.claim.refresh(state.models)
        self.frag.refresh(state)
        if len(state.models) != self._models:  # a new card model: access to it changed
            self.memo.clear()
            self._models = len(state.models)
