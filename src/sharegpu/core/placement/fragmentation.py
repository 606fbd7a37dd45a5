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
    #: [T] float64 mean host memory (MiB) of the pods of each shape; zeros when unknown. FGD
    #: ignores it; policies that also watch host memory read it.
    mem: np.ndarray | None = None
    #: every shape of the history (coverage 1), when this workload was cut at a lower coverage
    full: TargetWorkload | None = None

    @property
    def size(self) -> int:
        return len(self.p)

    @classmethod
    def from_shapes(
        cls, shapes: Iterable[Shape], coverage: float = 0.95,
        mem: Iterable[float] | None = None,
    ) -> TargetWorkload:
        """The most frequent shapes until they cover ``coverage`` of the pods (the shape that
        crosses the line included), renormalised. Ties in frequency: larger shape first.
        ``mem``, when given, is each pod's host memory, in the order of ``shapes``; the
        workload then keeps each shape's mean memory. When the cut leaves shapes out, the
        uncut distribution is kept as :attr:`full`."""
        shapes = list(shapes)
        counts = Counter(shapes)
        if not counts:
            raise ValueError("a target workload needs at least one pod shape")
        mems = None if mem is None else [float(m) for m in mem]
        mem_sum: dict[Shape, float] = {}
        if mems is not None:
            for shape, m in zip(shapes, mems, strict=True):
                mem_sum[shape] = mem_sum.get(shape, 0.0) + m
        items = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
        total = sum(counts.values())
        expected = coverage * total
        taken: list[tuple[Shape, int]] = []
        cum = 0
        for shape, n in items:
            if cum >= expected:
                break
            taken.append((shape, n))
            cum += n
        return cls._build(taken, cum, mem_sum, _full(shapes, mems, cls))

    @classmethod
    def _build(
        cls, taken: list[tuple[Shape, int]], denom: int, mem_sum: dict[Shape, float],
        full: TargetWorkload | None,
    ) -> TargetWorkload:
        return cls(
            cpu=np.array([s[0] for s, _ in taken], dtype=np.int64),
            gpu=np.array([s[1] for s, _ in taken], dtype=np.int64),
            k=np.array([s[2] for s, _ in taken], dtype=np.int64),
            p=np.array([n / denom for _, n in taken], dtype=np.float64),
            models=tuple(frozenset(s[3].split("|")) - {""} or None for s, _ in taken),
            mem=np.array([mem_sum.get(s, 0.0) / n for s, n in taken], dtype=np.float64),
            full=full,
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


def _full(
    shapes: list[Shape], mem: list[float] | None, cls: type[TargetWorkload]
) -> TargetWorkload:
    """Every shape of the history, memory included in the shape when known."""
    mems = mem if mem is not None else [0.0] * len(shapes)
    counts = Counter(zip(shapes, mems, strict=True))
    items = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    total = sum(counts.values())
    return cls(
        cpu=np.array([s[0] for (s, _), _ in items], dtype=np.int64),
        gpu=np.array([s[1] for (s, _), _ in items], dtype=np.int64),
        k=np.array([s[2] for (s, _), _ in items], dtype=np.int64),
        p=np.array([n / total for _, n in items], dtype=np.float64),
        models=tuple(frozenset(s[3].split("|")) - {""} or None for (s, _), _ in items),
        mem=np.array([m for (_, m), _ in items], dtype=np.float64),
    )


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
