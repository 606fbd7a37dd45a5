"""BestFit: the node with the least leftover of ``0.5·CPU/max CPU + 0.5·GPU/max GPU`` after the
pod (the paper's baseline); inside the node, the tightest GPU that fits."""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import ClusterState
from ..base import Policy, register
from ._common import gpu_demand, left, spec_max


@register
class BestFit(Policy):
    name = "bestfit"

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        max_cpu, max_gpu = spec_max(state)
        cpu, gpu = left(state, nodes)
        cpu_term = 0.5 * (cpu - req.cpu_milli) / max_cpu if max_cpu else 0.0
        leftover = cpu_term + 0.5 * (gpu - gpu_demand(req)) / max(max_gpu, 1.0)
        return np.floor(100.0 * (1.0 - leftover))
