"""What a GPU share is worth to an optimal packing of the prior's shares: LP dual prices.

Pods that ask for a share of one GPU must be packed into whole GPUs. For the distribution of
share sizes in the history (the prior: sizes ``s`` with weights ``n_s``), the configuration LP
packs them into as few GPUs as possible::

    min Σ_p x_p   s.t.  Σ_p a_sp x_p ≥ n_s,  x ≥ 0

over *patterns* ``p`` (multisets of sizes that fit one GPU, ``a_sp`` copies of ``s``). Its dual
prices each size: ``max Σ_s n_s y_s  s.t.  Σ_s a_sp y_s ≤ 1`` for every pattern. A GPU "costs"
1, a share of size ``s`` is worth ``y_s``, and the GPUs of an optimal packing are exactly the
patterns worth 1 (complementary slackness). So ``K(r)`` = the most that shares fitting in a free
amount ``r`` are worth (an unbounded knapsack over the prices), and putting a share of size
``s`` on a GPU with free ``g`` gives up ``K(g) − y_s − K(g − s) ≥ 0``: 0 when the GPU can still
be completed into an optimal pattern, more when the move closes that door.

The dual is solved here directly (it has one variable per size and ``b = 1 ≥ 0``, so the origin
is a feasible start and a plain tableau simplex suffices), with its constraints generated as
needed: the most violated pattern is the knapsack's best, added until none is violated.
Numpy only; sizes are a few dozen and patterns a few hundred, so it takes milliseconds
(about 30 ms for openb ``default``, once per :meth:`prepare`).
"""

from __future__ import annotations

import math
from functools import reduce

import numpy as np

EPS = 1e-9
MAX_STEPS = 2000  # the knapsack's grid has at most this many points (coarser units beyond)


def simplex_max(c: np.ndarray, a: np.ndarray, b: np.ndarray, max_iter: int = 10_000) -> np.ndarray:
    """``argmax c·y  s.t.  a y ≤ b, y ≥ 0`` for ``b ≥ 0`` (Bland's rule, bounded problems)."""
    m, n = a.shape
    t = np.zeros((m + 1, n + m + 1))
    t[:m, :n] = a
    t[:m, n : n + m] = np.eye(m)
    t[:m, -1] = b
    t[m, :n] = -c
    basis = np.arange(n, n + m)
    for _ in range(max_iter):
        negative = np.flatnonzero(t[m, :-1] < -EPS)
        if len(negative) == 0:
            break
        enter = int(negative[0])  # Bland: the first improving column
        col = t[:m, enter]
        pos = col > EPS
        if not pos.any():
            raise ValueError("unbounded LP")
        ratio = np.full(m, np.inf)
        ratio[pos] = t[:m, -1][pos] / col[pos]
        rows = np.flatnonzero(ratio <= ratio.min() + EPS)
        leave = int(rows[np.argmin(basis[rows])])  # Bland: smallest basic index
        t[leave] /= t[leave, enter]
        f = t[:, enter].copy()
        f[leave] = 0.0
        t -= np.outer(f, t[leave])
        basis[leave] = enter
    y = np.zeros(n + m)
    y[basis] = t[:m, -1]
    return y[:n]


def knapsack(sizes: np.ndarray, values: np.ndarray, cap: int, unit: int) -> tuple[np.ndarray,
                                                                                 np.ndarray]:
    """Unbounded knapsack on the grid ``0, unit, ..., cap``: best value ``K[r // unit]`` and,
    per grid point, the last size taken in a best solution (-1 for none)."""
    steps = cap // unit
    best = np.zeros(steps + 1)
    last = np.full(steps + 1, -1, dtype=np.int64)
    w = -(-sizes // unit).astype(np.int64)  # a size takes whole grid steps, rounded up
    for r in range(1, steps + 1):
        best[r], last[r] = best[r - 1], -1
        for i in range(len(w)):
            if 0 < w[i] <= r and best[r - w[i]] + values[i] > best[r] + EPS:
                best[r] = best[r - w[i]] + values[i]
                last[r] = i
    return best, last


class SharePrices:
    """Dual prices of share sizes for GPUs of ``capacity``, and the knapsack values ``K``."""

    def __init__(self, sizes: np.ndarray, weights: np.ndarray, capacity: int) -> None:
        keep = (sizes > 0) & (sizes <= capacity) & (weights > 0)
        sizes, weights = sizes[keep].astype(np.int64), weights[keep].astype(np.float64)
        merged: dict[int, float] = {}
        for s, w in zip(sizes.tolist(), weights.tolist(), strict=True):
            merged[s] = merged.get(s, 0.0) + w
        self.sizes = np.array(sorted(merged), dtype=np.int64)
        self.weights = np.array([merged[s] for s in self.sizes.tolist()])
        self.capacity = int(capacity)
        self.unit = reduce(math.gcd, [*self.sizes.tolist(), self.capacity]) or 1
        if self.capacity // self.unit > MAX_STEPS:  # e.g. memory in MiB: a coarser grid
            self.unit = -(-self.capacity // MAX_STEPS)
        self.prices = self._solve() if len(self.sizes) else np.zeros(0)
        self.k, _ = knapsack(self.sizes, self.prices, self.capacity, self.unit)

    def _solve(self) -> np.ndarray:
        n = len(self.sizes)
        # start from the one-size patterns, then add the most violated pattern until none is
        patterns = [np.eye(n)[i] * (self.capacity // int(s)) for i, s in enumerate(self.sizes)]
        for _ in range(500):
            y = simplex_max(self.weights, np.array(patterns), np.ones(len(patterns)))
            best, last = knapsack(self.sizes, y, self.capacity, self.unit)
            if best[-1] <= 1.0 + 1e-7:
                return y
            p = np.zeros(n)
            r = len(best) - 1
            while r > 0:
                if last[r] < 0:
                    r -= 1
                    continue
                p[last[r]] += 1
                r -= int(-(-self.sizes[last[r]] // self.unit))
            patterns.append(p)
        return y

    def price(self, share: int) -> float:
        i = np.searchsorted(self.sizes, share)
        if i < len(self.sizes) and self.sizes[i] == share:
            return float(self.prices[i])
        return 0.0

    def value(self, free: np.ndarray) -> np.ndarray:
        """``K`` of free amounts (in the state's units; amounts above capacity count as it)."""
        idx = np.clip(np.asarray(free) // self.unit, 0, len(self.k) - 1)
        return self.k[idx]

    def loss(self, free: np.ndarray, share: int) -> np.ndarray:
        """What putting ``share`` on GPUs with free ``free`` gives up: K(g) − y_s − K(g − s)."""
        return self.value(free) - self.price(share) - self.value(np.maximum(free - share, 0))
