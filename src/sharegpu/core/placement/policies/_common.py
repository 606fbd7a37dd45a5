"""Shared helpers of the paper's baseline policies (integer scores on a 0..100 scale)."""

from __future__ import annotations

import numpy as np

from ...request import PodRequest
from ...state import UNBOUNDED, ClusterState


def spec_max(state: ClusterState) -> tuple[float, float]:
    """The largest node CPU and the largest node GPU total (the paper's 128 cores and 8 GPUs on
    openb); CPU is 0 when the cluster does not track it."""
    n = state.n
    act = state.active[:n]
    cpu = state.cpu_cap[:n][act]
    cpu = cpu[cpu < UNBOUNDED]
    gpu = state.total_sum[:n][act]
    return float(cpu.max(initial=0)), float(gpu.max(initial=0))


def gpu_demand(req: PodRequest) -> int:
    return sum(c.total_mem for c in req.containers)


def left(state: ClusterState, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Free CPU (0 where untracked) and free GPU total of each node."""
    cpu = state.cpu_free[nodes]
    cpu = np.where(state.cpu_cap[nodes] >= UNBOUNDED, 0, cpu).astype(np.float64)
    return cpu, state.free_sum[nodes].astype(np.float64)
