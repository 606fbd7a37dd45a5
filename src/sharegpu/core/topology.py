"""GPU-to-GPU link matrices and the choice of the best-connected set of K GPUs on a node."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import numpy as np

# Bandwidth weights for the link kinds ``nvidia-smi topo -m`` prints (bigger is better).
LINK_WEIGHT = {"X": 0, "SYS": 1, "NODE": 2, "PHB": 3, "PXB": 4, "PIX": 5}
NVLINK_BASE = 10  # NV1, NV2, ... count bonded NVLinks: weight NVLINK_BASE * n

# Above this many candidate sets an exact search is replaced by a greedy one.
EXACT_LIMIT = 20_000


def link_weight(kind: str) -> int:
    if not isinstance(kind, str):
        raise ValueError(f"unknown GPU link kind {kind!r}")
    kind = kind.strip().upper()
    if kind.startswith("NV") and kind[2:].isdigit():
        return NVLINK_BASE * int(kind[2:])
    if kind in LINK_WEIGHT:
        return LINK_WEIGHT[kind]
    raise ValueError(f"unknown GPU link kind {kind!r}")


def matrix_from_kinds(rows: Sequence[Sequence[str]]) -> np.ndarray:
    """A weight matrix from link kinds as ``nvidia-smi topo -m`` names them."""
    if not isinstance(rows, list | tuple) or not all(isinstance(r, list | tuple) for r in rows):
        raise ValueError("a link matrix must be a list of rows")
    m = np.array([[link_weight(k) for k in row] for row in rows], dtype=np.int64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError("a link matrix must be square")
    return m


def connectivity(links: np.ndarray, gpus: Sequence[int]) -> int:
    """Sum of pairwise link weights inside a set of GPUs."""
    idx = np.asarray(gpus, dtype=np.int64)
    return int(links[np.ix_(idx, idx)].sum() // 2)


def best_set(links: np.ndarray | None, free: Sequence[int], k: int) -> tuple[int, ...] | None:
    """The best-connected ``k`` GPUs among ``free`` (ties: lowest indices).

    Exact over all combinations while they are few, greedy (best pair, then the GPU adding most
    bandwidth) beyond that. Without a matrix, the lowest ``k`` free indices.
    """
    free = sorted(free)
    if k > len(free) or k <= 0:
        return None
    if links is None or k == 1:
        return tuple(free[:k])
    n = len(free)
    count = 1
    for i in range(k):
        count = count * (n - i) // (i + 1)
    if count <= EXACT_LIMIT:
        best: tuple[int, ...] | None = None
        best_score = -1
        for combo in combinations(free, k):
            s = connectivity(links, combo)
            if s > best_score:
                best, best_score = combo, s
        return best
    chosen = list(max(combinations(free, 2), key=lambda p: links[p[0], p[1]]))
    rest = [g for g in free if g not in chosen]
    while len(chosen) < k:
        g = max(rest, key=lambda x: int(links[x, chosen].sum()))
        chosen.append(g)
        rest.remove(g)
    return tuple(sorted(chosen))
