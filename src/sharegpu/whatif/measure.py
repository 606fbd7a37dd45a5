"""What a state's GPUs hold: allocated, free, and *stranded* (free, but no pod of the shapes
this cluster asks for fits there), per GPU.

A shape is one of the target workload's (every shape of the history, as the extender learns
it: GPU memory per GPU, number of GPUs, CPU and host memory). A free GPU's memory is usable when
some shape fits its node with this GPU among those it takes: enough of the node's GPUs have
that much free and room for one more pod, and the node's free CPU and memory admit the shape.
Everything else free is stranded. Compute (percent of a GPU) is counted on ``core_mem`` nodes
only, the mode that limits it; its stranded part is the free compute of GPUs whose memory no
shape can use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core import names
from ..core.modes import Mode
from ..core.placement.fragmentation import TargetWorkload
from ..core.state import ClusterState

CHUNK = 32  # shapes per pass (bounds the [nodes, GPUs, shapes] temporaries)


@dataclass(frozen=True)
class GpuFigures:
    """Per GPU of every active node (``[nodes, GPU slots]``; missing slots are 0/False)."""

    total: np.ndarray
    free: np.ndarray
    core_free: np.ndarray
    exists: np.ndarray
    usable: np.ndarray  # free memory some shape can use
    nodes: list[str]
    #: per node: it limits compute (core_mem mode); compute figures count these nodes only
    limits_core: np.ndarray

    @property
    def allocated(self) -> np.ndarray:
        return np.where(self.exists, self.total - self.free, 0)

    @property
    def stranded(self) -> np.ndarray:
        return np.where(self.exists & ~self.usable, self.free, 0)

    @property
    def _core_gpus(self) -> np.ndarray:
        return self.exists & self.limits_core[:, None]

    @property
    def core_allocated(self) -> np.ndarray:
        return np.where(self._core_gpus, names.CORE_PER_GPU - self.core_free, 0)

    @property
    def core_free_gpus(self) -> np.ndarray:
        return np.where(self._core_gpus, self.core_free, 0)

    @property
    def core_stranded(self) -> np.ndarray:
        return np.where(self._core_gpus & ~self.usable, self.core_free, 0)

    @property
    def whole_free(self) -> np.ndarray:
        """GPUs nothing holds."""
        return self.exists & (self.free == self.total) & (self.core_free == names.CORE_PER_GPU)

    def totals(self) -> dict[str, int]:
        ex = self.exists
        return {
            "gpus": int(ex.sum()),
            "mem_total": int(self.total[ex].sum()),
            "mem_allocated": int(self.allocated.sum()),
            "mem_free": int(self.free[ex].sum()),
            "mem_stranded": int(self.stranded.sum()),
            "core_total": int(self._core_gpus.sum()) * names.CORE_PER_GPU,
            "core_allocated": int(self.core_allocated.sum()),
            "core_free": int(self.core_free_gpus.sum()),
            "core_stranded": int(self.core_stranded.sum()),
            "gpus_free": int(self.whole_free.sum()),
        }


def figures(state: ClusterState, workload: TargetWorkload | None) -> GpuFigures:
    rows = np.flatnonzero(state.active[: state.n])
    exists = state.gpu_exists[rows]
    free = np.where(exists, state.gpu_free[rows], 0)
    total = np.where(exists, state.gpu_total[rows], 0)
    core = np.where(exists, state.core_free[rows], 0)
    room = exists & (state.gpu_pods[rows] < state.max_pods_per_gpu) & (free > 0)
    usable = np.zeros_like(exists)
    if workload is not None:
        wl = workload.full or workload
        keep = wl.gpu > 0
        gpu, k, cpu = wl.gpu[keep], wl.k[keep], wl.cpu[keep]
        mem = (wl.mem if wl.mem is not None else np.zeros(wl.size))[keep]
        cpu_free, mem_free = state.cpu_free[rows], state.mem_free[rows]
        for s in range(0, len(gpu), CHUNK):
            g, kk = gpu[s:s + CHUNK], k[s:s + CHUNK]
            fit = room[:, :, None] & (free[:, :, None] >= g[None, None, :])  # [R, W, T]
            node_ok = ((fit.sum(axis=1) >= kk[None, :])
                       & (cpu_free[:, None] >= cpu[s:s + CHUNK][None, :])
                       & (mem_free[:, None] >= mem[s:s + CHUNK][None, :]))  # [R, T]
            usable |= (fit & node_ok[:, None, :]).any(axis=2)
    names_ = [state.specs[i].name for i in rows]  # type: ignore[union-attr]
    limits_core = state.mode[rows] == list(Mode).index(Mode.CORE_MEM)
    return GpuFigures(total, free, core, exists, usable, names_, limits_core)
