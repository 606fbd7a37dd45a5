"""GpuClustering: prefer nodes already running pods of the same GPU demand (sharing pods with
sharing pods, k-GPU pods with k-GPU pods), then fuller nodes."""

from __future__ import annotations

import numpy as np

from ...annotations import Allocation
from ...request import PodRequest
from ...state import ClusterState
from ..base import Policy, register
from ._common import spec_max


def tag(state: ClusterState, req: PodRequest, node: int | None = None) -> str | None:
    if not req.containers:
        return None
    c = req.containers[0]
    per_gpu = int(state.gpu_total[node].max()) if node is not None else None
    if c.whole or (per_gpu is not None and c.gpu_mem >= per_gpu) or c.gpus > 1:
        return f"{c.gpus}-gpu"
    return "share-gpu"


@register
class GpuClustering(Policy):
    name = "clustering"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.tags: dict[str, int] = {}
        self.counts = np.zeros((0, 0), dtype=np.int64)

    def prepare(self, state: ClusterState, workload: object | None = None) -> None:
        self.tags = {}
        self.counts = np.zeros((0, 0), dtype=np.int64)

    def _col(self, state: ClusterState, name: str) -> int:
        if name not in self.tags:
            self.tags[name] = len(self.tags)
        rows = max(state.n, self.counts.shape[0])
        cols = len(self.tags)
        if self.counts.shape != (rows, cols):
            grown = np.zeros((rows, cols), dtype=np.int64)
            grown[: self.counts.shape[0], : self.counts.shape[1]] = self.counts
            self.counts = grown
        return self.tags[name]

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        if not req.containers:
            return np.zeros(len(nodes))
        c = req.containers[0]
        per_gpu = state.gpu_total[nodes].max(axis=1)
        whole = c.whole or c.gpus > 1
        _, max_gpu = spec_max(state)
        mg = int(max(max_gpu, 1))
        base = 25 * (mg - state.free_sum[nodes]) // mg
        share_col = self._col(state, "share-gpu")
        k_col = self._col(state, f"{c.gpus}-gpu")
        counts = self.counts[nodes]
        total = counts.sum(axis=1)
        is_whole = whole | (c.gpu_mem >= per_gpu)
        mine = np.where(is_whole, counts[:, k_col], counts[:, share_col])
        with_mine = np.where(total == mine, 75 + base, 50 + base)
        out = np.where(mine > 0, with_mine, np.where(total == 0, 25 + base, base))
        return out.astype(np.float64)

    def placed(self, state: ClusterState, req: PodRequest, node: int, alloc: Allocation) -> None:
        t = tag(state, req, node)
        if t is not None:
            self.counts[node, self._col(state, t)] += 1

    def removed(self, state: ClusterState, req: PodRequest, node: int) -> None:
        t = tag(state, req, node)
        if t is not None:
            self.counts[node, self._col(state, t)] -= 1
