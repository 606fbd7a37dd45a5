"""What a node's free GPUs are worth to the pods still to come, counting CPU, memory and models.

For each pod shape of the history, the GPU it could use on a node against what the node's free
CPU and memory still admit, weighted by the shape's frequency and scarcity, gives two measures:
``resources`` (GPU stranded by CPU or memory running out first) and ``claim`` (the capacity left
to model-restricted shapes). Definitions and units: docs/strand.md ("The idea").
"""

from __future__ import annotations

import numpy as np

from .fragmentation import TargetWorkload

MEASURES = ("resources", "claim")


class StrandingModel:
    """One of :data:`MEASURES` for node rows, identical rows computed once."""

    def __init__(
        self, workload: TargetWorkload, model_ids: dict[str, int], measure: str = "resources"
    ) -> None:
        if measure not in MEASURES:
            raise ValueError(f"measure must be one of {', '.join(MEASURES)}")
        self.measure = measure
        keep = workload.gpu > 0
        if measure == "claim":
            keep &= np.array([m is not None for m in workload.models], dtype=bool)
        self.gpu = workload.gpu[keep].astype(np.int64)
        self.k = workload.k[keep].astype(np.int64)
        self.cpu = workload.cpu[keep].astype(np.int64)
        mem = workload.mem if workload.mem is not None else np.zeros(workload.size)
        self.mem = np.asarray(mem, dtype=np.float64)[keep]
        #: per-shape weights (the history's shares until :meth:`weigh` scales them)
        self.p = workload.p[keep].astype(np.float64)
        self.workload = workload
        self._keep = keep
        self._const = {  # what values() would otherwise work out again for every batch
            "cpu_used": self.cpu > 0, "cpu_div": np.maximum(self.cpu, 1),
            "mem_used": self.mem > 0, "mem_div": np.maximum(self.mem, 1.0),
            "per_pod": (self.k * self.gpu)[None, :],
        }
        self._models = -1
        self.access = np.zeros((0, 0), dtype=bool)
        self.refresh(model_ids)

    @property
    def size(self) -> int:
        return len(self.p)

    def refresh(self, model_ids: dict[str, int]) -> None:
        if len(model_ids) != self._models:
            self.access = self.workload.access(model_ids)[self._keep]
            self._models = len(model_ids)

    def scarcity(
        self, gpus: np.ndarray, cpu: np.ndarray, mem: np.ndarray, model: np.ndarray,
        cap: float,
    ) -> np.ndarray:
        """[T] all GPUs / GPUs on the nodes that could host shape t when empty, at most
        ``cap``; nodes given by their GPU count, CPU and memory capacity and model id."""
        hosts = (
            (gpus[:, None] >= self.k[None, :])
            & (cpu[:, None] >= self.cpu[None, :])
            & (mem[:, None] >= self.mem[None, :])
            & self.access[:, model].T
        )
        total = float(gpus.sum())
        supply = (hosts * gpus[:, None]).sum(axis=0).astype(np.float64)
        return np.minimum(total / np.maximum(supply, 1.0), cap)

    def weigh(self, weights: np.ndarray) -> None:
        self.p = self.p * weights

    def rows(
        self, free: np.ndarray, cpu: np.ndarray, mem: np.ndarray, model: np.ndarray
    ) -> np.ndarray:
        """The measure for each row: ``free`` [R, W] free GPU per slot (0 for missing slots),
        free ``cpu`` and ``mem`` [R], ``model`` [R] model ids. Each row is computed on its own
        (strand keeps the values of the rows it has seen)."""
        if len(free) == 0 or self.size == 0:
            return np.zeros(len(free))
        gpu_use, usable = self._usable(free, cpu, mem, model)
        per_shape = gpu_use - usable if self.measure == "resources" else -usable
        return _weighted(per_shape, self.p)

    def _usable(
        self, free: np.ndarray, cpu: np.ndarray, mem: np.ndarray, model: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """[R, T] ``gpu_t`` and ``u_t`` of each row. Whole numbers in float64, so a column's
        values do not depend on the other columns."""
        fit = free[:, :, None] >= self.gpu[None, None, :]  # [R, W, T]
        ok = (fit.sum(axis=1) >= self.k[None, :]) & self.access[:, model].T
        gpu_use = np.where(ok, np.einsum("rw,rwt->rt", free, fit, dtype=np.float64), 0.0)
        c = self._const
        by_cpu = np.where(c["cpu_used"], np.floor(cpu[:, None] / c["cpu_div"]), np.inf)
        by_mem = np.where(c["mem_used"], np.floor(mem[:, None] / c["mem_div"]), np.inf)
        cap = np.maximum(np.minimum(by_cpu, by_mem), 0.0) * c["per_pod"]
        return gpu_use, np.minimum(gpu_use, cap)


class ResourcesAndClaim:
    """``resources`` and ``claim`` of the same history for node rows in one pass: the claim's
    shapes are a subset of the resources' and share their ``u_t``, so it is computed once. The
    values are the very values of the two models' own :meth:`StrandingModel.rows`."""

    def __init__(self, resources: StrandingModel, claim: StrandingModel) -> None:
        if (resources.measure, claim.measure) != ("resources", "claim") or (
                resources.workload is not claim.workload):
            raise ValueError("a resources and a claim model of the same workload are needed")
        self.resources = resources
        self.claim = claim
        #: where each of the claim's shapes is among the resources'
        self.columns = np.flatnonzero(claim._keep[resources._keep])

    def rows(
        self, free: np.ndarray, cpu: np.ndarray, mem: np.ndarray, model: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """R and V of each row (arguments as :meth:`StrandingModel.rows`)."""
        res, claim = self.resources, self.claim
        if len(free) == 0 or res.size == 0:
            return np.zeros(len(free)), np.zeros(len(free))
        gpu_use, usable = res._usable(free, cpu, mem, model)
        r = _weighted(gpu_use - usable, res.p)
        if claim.size == 0:
            return r, np.zeros(len(free))
        return r, _weighted(-usable[:, self.columns], claim.p)


def _weighted(per_shape: np.ndarray, p: np.ndarray) -> np.ndarray:
    # a row-wise sum so that equal rows give bit-equal values whatever the batch
    return (per_shape * p[None, :]).sum(axis=1)
