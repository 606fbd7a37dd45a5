"""ACK ``binpack``: fill the fullest node that fits, and inside it fill one GPU before the next."""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import ClusterState
from ..base import Policy, register


def gpu_used_fraction(state: ClusterState, nodes: np.ndarray) -> np.ndarray:
    total = state.total_sum[nodes]
    return (total - state.free_sum[nodes]) / np.maximum(total, 1)


@register
class Binpack(Policy):
    name = "binpack"
    gpu_strategy = "bestfit"
    integer_scores = False

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        return gpu_used_fraction(state, nodes)
