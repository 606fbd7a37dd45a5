"""Per-node caches keyed by pod shape, invalidated by the state's node versions.

A node's score for a pod shape only changes when that node changes, so policies that are costly
to evaluate (FGD) keep, per shape, the value and the state version it was computed at, and only
recompute the stale nodes. Shapes are columns kept in least-recently-used order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from ..state import ClusterState


class ShapeCache:
    def __init__(self, fields: dict[str, type], columns: int = 256) -> None:
        self.fields = fields
        self.columns = columns
        self.rows = 0
        self.keys: OrderedDict[Hashable, int] = OrderedDict()
        self.ver = np.zeros((0, columns), dtype=np.int64)
        self.data: dict[str, np.ndarray] = {}
        self._resize(64)

    def _resize(self, rows: int) -> None:
        ver = np.full((rows, self.columns), -1, dtype=np.int64)
        ver[: self.rows] = self.ver[: self.rows]
        self.ver = ver
        for name, dtype in self.fields.items():
            a = np.zeros((rows, self.columns), dtype=dtype)
            if name in self.data:
                a[: self.rows] = self.data[name][: self.rows]
            self.data[name] = a
        self.rows = rows

    def column(self, key: Hashable) -> int:
        """The column of ``key`` (a fresh, all-stale one when unseen)."""
        col = self.keys.get(key)
        if col is not None:
            self.keys.move_to_end(key)
            return col
        if len(self.keys) < self.columns:
            col = len(self.keys)
        else:
            _, col = self.keys.popitem(last=False)
        self.keys[key] = col
        self.ver[:, col] = -1
        return col

    def stale(self, state: ClusterState, nodes: np.ndarray, col: int) -> np.ndarray:
        if state.n > self.rows:
            self._resize(max(state.n, self.rows * 2))
        return nodes[self.ver[nodes, col] != state.version[nodes]]

    def store(self, state: ClusterState, nodes: np.ndarray, col: int, **values: np.ndarray) -> None:
        self.ver[nodes, col] = state.version[nodes]
        for name, v in values.items():
            self.data[name][nodes, col] = v

    def get(self, name: str, nodes: np.ndarray | int, col: int) -> np.ndarray:
        return self.data[name][nodes, col]
