"""strandlp: strand, with GPU shares packed by the prior's LP dual prices.

A share pod's move (node, GPU) gives up ``loss = K(g) − y_s − K(g − s)`` of the GPU's worth to
an optimal packing of the prior's shares (:mod:`..shareprices`): 0 when the GPU can still be
completed into a pattern of an optimal packing, more when the move closes that door (a 320
on a GPU holding a 470 leaves 210 that only rare 160s fit, where a 470 would have left 60).
The score of a move is strand's minus :data:`WEIGHT` times that loss rounded to
:data:`LOSS_QUANTUM`, so the packing decides first and strand (FGD's fragmentation, CPU,
memory, models, the node order) decides among the moves that pack equally well. Pods that are
not shares of one GPU lose nothing anywhere and are placed exactly as strand places them.
See docs/strandlp.md.
"""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import ClusterState
from ..base import register
from ..fragmentation import TargetWorkload
from ..shareprices import SharePrices
from .fgd import gpu_scale
from .strand import Strand

WEIGHT = 1000.0  # strand's scores lie in [0, 101): a loss step outweighs all of them
LOSS_QUANTUM = 0.01  # losses closer than this tie (and strand decides)


def prior_prices(workload: TargetWorkload, capacity: int) -> SharePrices:
    """Prices of the shares of one GPU in the prior (every shape of the history)."""
    history = workload.full or workload
    share = (history.k == 1) & (history.gpu > 0) & (history.gpu < capacity)
    return SharePrices(history.gpu[share], history.p[share], capacity)


@register
class StrandLP(Strand):
    name = "strandlp"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.prices: SharePrices | None = None

    def prepare(self, state: ClusterState, workload: object | None = None) -> None:
        super().prepare(state, workload)
        assert isinstance(workload, TargetWorkload)
        self.prices = prior_prices(workload, int(gpu_scale(state)))

    def gains(
        self, state: ClusterState, req: PodRequest, nodes: np.ndarray, ri: np.ndarray,
        rows: np.ndarray,
    ) -> np.ndarray:
        score = super().gains(state, req, nodes, ri, rows)
        if self.prices is None or not req.containers or req.containers[0].gpus != 1:
            return score
        before = state.gpu_free[nodes][ri]
        loss = self.move_loss(before, rows, int(req.containers[0].gpu_mem))
        return score - WEIGHT * np.round(loss / LOSS_QUANTUM) * LOSS_QUANTUM

    def move_loss(self, before: np.ndarray, after: np.ndarray, share: int) -> np.ndarray:
        """Per move: the worth its GPU gives up (rows of free GPU before and after)."""
        assert self.prices is not None
        k = self.prices.value
        return (k(before) - k(after)).sum(axis=1) - self.prices.price(share)
