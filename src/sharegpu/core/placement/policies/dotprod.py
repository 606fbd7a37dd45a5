"""DotProd (Tetris-like): score ``100 · (1 − (free · demand) / 2)`` over normalised
(CPU, GPU) vectors, as the paper's simulator computes it; inside the node, best-fit GPU."""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import ClusterState
from ..base import Policy, register
from ._common import gpu_demand, left, spec_max


@register
class DotProd(Policy):
    name = "dotprod"

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        max_cpu, max_gpu = spec_max(state)
        cpu, gpu = left(state, nodes)
        d = gpu * gpu_demand(req) / max(max_gpu, 1.0) ** 2
        if max_cpu:
            d = d + cpu * req.cpu_milli / max_cpu**2
        return np.floor(100.0 * (1.0 - d / 2.0))
