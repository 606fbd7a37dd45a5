"""Values of a pure function of a node's row, kept by the row's content.

FGD's fragmentation and strand's measures read a node row (its free GPU amounts, sorted, since
the measures ignore GPU order, its free CPU, memory and card model) and nothing else. Rows
repeat a great deal, both within one call (nodes alike) and across calls (a node returns to a
state it had, the moves of one pod shape land on the same rows), so each distinct row is
computed once, then looked up: a decision that finds one or two changed nodes does not pay
the numpy pipeline's fixed cost. The functions sum row-wise, so a row's value does not depend
on the batch it was computed in, and a looked-up value is the very value a fresh computation
would give.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

LIMIT = 1 << 18  # distinct rows kept (then the memo starts again)
FEW = 64  # rows computed as they come, without looking for repeats among them


def row_keys(free: np.ndarray, *columns: np.ndarray) -> np.ndarray:
    """[R, W + len(columns)] int64: each row's free GPU amounts sorted largest first, then
    ``columns`` (each [R])."""
    r, w = free.shape
    out = np.empty((r, w + len(columns)), dtype=np.int64)
    out[:, :w] = np.sort(free, axis=1)[:, ::-1]
    for j, c in enumerate(columns):
        out[:, w + j] = c
    return out


def unique_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the first row of each distinct key, and each row's index among them."""
    void = keys.view(np.dtype((np.void, keys.dtype.itemsize * keys.shape[1]))).ravel()
    _, first, inverse = np.unique(void, return_index=True, return_inverse=True)
    return first, inverse.ravel()


class RowMemo:
    """``memo(keys, compute)``: ``compute(distinct_keys)`` for the rows not seen yet, the rest
    looked up. ``compute`` gets [D, K] keys (see :func:`row_keys`) and gives [D] floats."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self.values: dict[bytes, float] = {}

    def clear(self) -> None:
        self.values.clear()

    def __call__(
        self, keys: np.ndarray, compute: Callable[[np.ndarray], np.ndarray]
    ) -> np.ndarray:
        r = len(keys)
        if r == 0:
            return np.zeros(0)
        raw = keys.tobytes()
        w = len(raw) // r
        ks = [raw[i : i + w] for i in range(0, len(raw), w)]
        get = self.values.get
        vals = [get(k) for k in ks]
        miss = [j for j, v in enumerate(vals) if v is None]
        if miss:
            sub = keys[miss]
            if len(miss) <= FEW:  # computing a repeat costs less than finding repeats
                got = compute(sub).tolist()
                inverse: list[int] | range = range(len(miss))
            else:
                first, inv = unique_keys(sub)
                got = compute(sub[first]).tolist()
                inverse = inv.tolist()
            if len(self.values) + len(miss) > self.limit:
                self.values.clear()
            for j, g in zip(miss, inverse, strict=True):
                vals[j] = self.values[ks[j]] = got[g]
        return np.array(vals, dtype=np.float64)
