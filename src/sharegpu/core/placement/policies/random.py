"""Random: a uniformly random feasible node, and inside it any GPU that fits (uniformly)."""

from __future__ import annotations

import numpy as np

from ...annotations import Allocation
from ...request import PodRequest
from ...state import ClusterState
from ..base import Policy, register
from ..gpus import assign, node_strategy


@register
class RandomFit(Policy):
    name = "random"
    integer_scores = False

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        return self.rng.random(len(nodes))

    def select(self, state: ClusterState, req: PodRequest, node: int) -> Allocation | None:
        strategy = node_strategy(state, node, "random")
        if strategy != "random" or len(req.containers) != 1 or req.containers[0].gpus != 1:
            return assign(state, req, node, "bestfit" if strategy == "random" else strategy)
        c = req.containers[0]
        fits = np.flatnonzero(state.gpu_fits(c, slice(node, node + 1))[0])
        if len(fits) == 0:
            return None
        gpu = int(fits[self.rng.integers(len(fits))])
        return assign(state, req, node, "bestfit", prefer={c.index: (gpu,)})
