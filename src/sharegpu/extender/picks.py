"""Held picks: the node (and GPUs) a filter answered with, held until the pod's bind.

kube-scheduler assumes a pod on the node it chose the moment its scheduling cycle ends, so the
next pod's cycle already counts it. The extender does the same with the one node its filter
answers: the view reserves the pod's GPUs there (in flight) when it answers, and this object
remembers which in-flight reservations are such picks, and until when. A pick ends when its
bind takes it (the bind then confirms what was held), when the pod is filtered again, deleted or
bound by someone else, or when its timeout passes (kube-scheduler gave the pod up, or chose
otherwise).

Pure bookkeeping: the view owns the reservations and gives them back for every key this object
lets go of.
"""

from __future__ import annotations

import time
from collections.abc import Callable

DEFAULT_TIMEOUT_S = 120.0  # outlasts kube-scheduler's usual Permit and PreBind waits


class HeldPicks:
    """Pod key -> (node, deadline, when held) of the picks held now, oldest first."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns) -> None:
        if timeout <= 0:
            raise ValueError("held picks: timeout must be > 0 seconds")
        self.timeout = timeout
        self.clock = clock
        self.wall_ns = wall_ns
        self._held: dict[str, tuple[str, float, int]] = {}
        self.expired_total = 0  # picks given up on their timeout (for metrics)
        # whether this replica holds picks now (the one that binds: a follower's holds would
        # stand for binds it never sees)
        self.may_hold: Callable[[], bool] = lambda: True

    def hold(self, key: str, node: str) -> None:
        """Hold ``key``'s pick on ``node`` from now until the timeout."""
        self._held.pop(key, None)  # re-inserted last: the dict stays in deadline order
        self._held[key] = (node, self.clock() + self.timeout, self.wall_ns())

    def node(self, key: str) -> str | None:
        got = self._held.get(key)
        return got[0] if got is not None else None

    def held_since_ns(self, key: str) -> int | None:
        """When ``key``'s pick was made (UnixNano): the moment its GPUs were assumed."""
        got = self._held.get(key)
        return got[2] if got is not None else None

    def take(self, key: str) -> str | None:
        """Stop holding ``key`` and return the node it was held on (None: not held)."""
        got = self._held.pop(key, None)
        return got[0] if got is not None else None

    def on_node(self, node: str) -> list[str]:
        """The keys held on ``node``."""
        return [k for k, (n, _d, _t) in self._held.items() if n == node]

    def keys(self) -> list[str]:
        return list(self._held)

    def expired(self) -> list[str]:
        """Stop holding every pick whose timeout passed; their keys."""
        if not self._held:
            return []
        now = self.clock()
        out: list[str] = []
        for key, (_node, deadline, _t) in self._held.items():
            if deadline > now:
                break
            out.append(key)
        for key in out:
            del self._held[key]
        self.expired_total += len(out)
        return out

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)
