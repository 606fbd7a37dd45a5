"""GPU fragmentation of a node for a target workload (FGD, USENIX ATC'23), vectorised.

The target workload is a distribution over pod shapes ``(cpu, gpu per GPU, GPUs, models)``,
learnt from history (the simulator uses the trace file's own shapes, as the paper does).
For a node with free GPU amounts ``L`` and free CPU, shape ``t`` is *satisfied* when the node's
model is allowed, CPU fits and at least ``k_t`` GPUs have ``L_i >= m_t``; then only the GPUs
with ``L_i < m_t`` are fragment for ``t``. Otherwise (including CPU-only shapes) all idle GPU is
fragment. ``F(node) = sum_t p_t * frag_t(node)``, in the state's memory units.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

Shape = tuple[int, int, int, str]  # (cpu_milli, gpu per GPU, number of GPUs, models "A|B" or "")


@dataclass(frozen=True)
class TargetWorkload:
    cpu: np.ndarray  # [T] int64
    gpu: np.ndarray  # [T] int64, per GPU
    k: np.ndarray  # [T] int64
    p: np.ndarray  # [T] float64, sums to 1
    models: tuple[frozenset[str] | None, ...]

    @property
    def size(self) -> int:
        return len(self.p)

    @classmethod
    def from_shapes(cls, shapes: Iterable[Shape], coverage: float = 0.95) -> TargetWorkload:
        """The most frequent shapes until they cover ``coverage`` of the pods (the shape that
        crosses the line included), renormalised. Ties in frequency: larger shape first."""
        counts = Counter(shapes)
        if not counts:
            raise ValueError("a target workload needs at least one pod shape")
        total = sum(counts.values())
        items = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
        expected = coverage * total
        taken: list[tuple[Shape, int]] = []
        cum = 0
        for shape, n in items:
            if cum >= expected:
                break
            taken.append((shape, n))
            cum += n
        denom = total if len(taken) == len(items) else cum
        return cls(
            cpu=np.array([s[0] for s, _ in taken], dtype=np.int64),
            gpu=np.array([s[1] for s, _ in taken], dtype=np.int64),
            k=np.array([s[2] for s, _ in taken], dtype=np.int64),
            p=np.array([n / denom for _, n in taken], dtype=np.float64),
            models=tuple(frozenset(s[3].split("|")) - {""} or None for s, _ in taken),
        )

    def access(self, model_ids: dict[str, int]) -> np.ndarray:
        """[T, model ids] mask: may shape t run on a node of that model."""
        out = np.ones((self.size, len(model_ids) + 1), dtype=bool)
        for t, allowed in enumerate(self.models):
            if allowed is None:
                continue
            out[t, :] = False
            for name, i in model_ids.items():
                if name in allowed:
                    out[t, i] = True
        return out


def fragmentation(
    free: np.ndarray, cpu_free: np.ndarray, model: np.ndarray, wl: TargetWorkload,
    access: np.ndarray,
) -> np.ndarray:
    """F for each row: ``free`` [R, W] free GPU amount per slot (0 for missing slots),
    ``cpu_free`` [R], ``model`` [R] model ids; ``access`` from :meth:`TargetWorkload.access`."""
    if free.shape[0] == 0:
        return np.zeros(0)
    idle = free.sum(axis=1)  # [R]
    below = free[:, :, None] < wl.gpu[None, None, :]  # [R, W, T]
    frag_below = np.einsum("rw,rwt->rt", free, below, dtype=np.float64)
    enough = (free.shape[1] - below.sum(axis=1)) >= wl.k[None, :]  # [R, T]
    ok = enough & (cpu_free[:, None] >= wl.cpu[None, :]) & access[:, model].T & (wl.gpu > 0)
    frag = np.where(ok, frag_below, idle[:, None].astype(np.float64))
    # a row-wise sum (not a matrix product) so that equal rows give bit-equal F whatever the batch
    return (frag * wl.p[None, :]).sum(axis=1)
