"""ACK ``spread``: the emptiest node that fits, and inside it the GPU with the most room."""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import ClusterState
from ..base import Policy, register
from .binpack import gpu_used_fraction


@register
class Spread(Policy):
    name = "spread"
    gpu_strategy = "spread"
    integer_scores = False

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        return -gpu_used_fraction(state, nodes)
