"""Unsettled binds: Bindings sent whose outcome is not known (no answer in time, the connection
lost, an API server error that may follow a commit).

The API server may still commit such a write, so the pod's GPUs (its in-flight reservation)
and its ResourcePolicy unit stay taken until the outcome is seen: the watch shows the pod bound
to the node (confirmed), or bound elsewhere or deleted, or the API server's own timeout for the
write plus a grace has passed and a read shows the pod still unbound (released). Pure
bookkeeping: the binder reads the pod and gives the reservation back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_GRACE_S = 5.0  # after the API server's timeout, before a write is taken as never landing


@dataclass
class Unsettled:
    node: str
    until: float  # clock time after which a read decides
    reason: str  # why the outcome is unknown (for the log)


class UnsettledBinds:
    """Pod key -> :class:`Unsettled`."""

    def __init__(self, grace: float = DEFAULT_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if grace < 0:
            raise ValueError("unsettled binds: grace must be >= 0 seconds")
        self.grace = grace
        self.clock = clock
        self._binds: dict[str, Unsettled] = {}

    def add(self, key: str, node: str, server_timeout: float, reason: str) -> Unsettled:
        """The Binding of ``key`` to ``node`` may still land: the API server gives it up
        ``server_timeout`` seconds from now at the latest."""
        u = Unsettled(node, self.clock() + max(0.0, server_timeout) + self.grace, reason)
        self._binds[key] = u
        return u

    def get(self, key: str) -> Unsettled | None:
        return self._binds.get(key)

    def pop(self, key: str) -> Unsettled | None:
        return self._binds.pop(key, None)

    def due(self) -> list[str]:
        """The keys whose API server timeout (and grace) passed: a read decides them."""
        now = self.clock()
        return [k for k, u in self._binds.items() if u.until <= now]

    def postpone(self, key: str, seconds: float) -> None:
        u = self._binds.get(key)
        if u is not None:
            u.until = self.clock() + seconds

    def __contains__(self, key: object) -> bool:
        return key in self._binds

    def __len__(self) -> int:
        return len(self._binds)
