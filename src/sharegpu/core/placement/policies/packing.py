"""GpuPacking: prefer a partly used GPU, then a free GPU on a used node, then an idle node."""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import ClusterState
from ..base import Policy, register


@register
class GpuPacking(Policy):
    name = "packing"

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        if not req.containers:
            return np.zeros(len(nodes))
        c = req.containers[0]
        free = state.gpu_free[nodes]
        total = state.gpu_total[nodes]
        exists = state.gpu_exists[nodes]
        full = (free == total) & exists
        n_full = full.sum(axis=1)
        n_gpu = state.gpu_count[nodes]
        idle_node = n_full == n_gpu
        out = np.maximum(33 - n_full, n_full).astype(np.float64)
        fits = state.gpu_fits(c, nodes)
        # the GPUs best fit would take: ascending free amount, lowest index first
        rank = np.argsort(np.where(fits, free, np.iinfo(np.int64).max), axis=1, kind="stable")
        taken = np.take_along_axis(free, rank[:, : c.gpus], axis=1)
        taken_full = np.take_along_axis(full, rank[:, : c.gpus], axis=1)
        u = taken_full.sum(axis=1)
        per_gpu = np.maximum(total.max(axis=1, keepdims=True), 1)
        r = (taken * 100 // per_gpu).sum(axis=1)
        used_score = np.where(u > 0, np.maximum(50 - u, 33), np.maximum(100 - r // 10, 50))
        return np.where(idle_node, out, used_score).astype(np.float64)
