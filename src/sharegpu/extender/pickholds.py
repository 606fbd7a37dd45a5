"""The picks a filter answered with, held in the cluster cache as in-flight reservations until
their binds: the feature object that gives them back (on their timeout, when the pod is
filtered again, bound by someone else or deleted, or when a bound pod's record needs the room).
The bookkeeping of which keys are held, and until when, is :class:`~.picks.HeldPicks`.

Each pick given back without its bind leaves one log line and is counted by reason
(``ended``, exported as ``sharegpu_extender_picks_ended``)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..core.pods import is_terminated, node_of
from .cache import ClusterCache
from .picks import HeldPicks

log = logging.getLogger(__name__)


class PickHolds:
    """The held picks (``picks``) over the cluster cache ``ledger`` that holds their GPUs;
    ``waiting(key, uid)``: whether that pod exists, unbound, as the informer shows it."""

    def __init__(self, ledger: ClusterCache, picks: HeldPicks,
                 waiting: Callable[[str, str], bool] = lambda key, uid: False) -> None:
        self.ledger = ledger
        self.picks = picks
        self.waiting = waiting
        self.ended: collections.Counter[str] = collections.Counter()  # by reason

    def _ended(self, key: str, node: str | None, reason: str, why: str = "") -> None:
        self.ended[reason] += 1
        log.info("pick %s on %s given back (%s)%s", key, node or "?", reason,
                 f": {why}" if why else "")

    def hold(self, key: str, node: str) -> None:
        """``key``'s GPUs are reserved in flight on ``node``: held as its pick."""
        self.picks.hold(key, node)

    def may_hold(self) -> bool:
        return self.picks.may_hold()

    def may_hold_for(self, key: str, uid: str) -> bool:
        """Whether a pick may be held for this pod: only for a pod that exists, unbound, with
        this UID (filters of made-up pods hold nothing, so they cannot fill the cluster: at
        most one pick per pod that exists)."""
        return self.picks.may_hold() and self.waiting(key, uid)

    def held_pick(self, key: str) -> str | None:
        """The node held for ``key`` since its filter, if any."""
        return self.picks.node(key) if key in self.ledger.inflight else None

    def take(self, key: str) -> str | None:
        """Stop holding ``key`` (its reservation stays); the node it was held on."""
        return self.picks.take(key)

    def expire(self) -> list[str]:
        """Give back every pick whose timeout passed; their keys."""
        keys = self.picks.expired()
        for key in keys:
            r = self.ledger.inflight.get(key)
            self.ledger.give_back(key)
            self._ended(key, r.node if r is not None else None, "expired",
                        f"no bind within {self.picks.timeout:g} s")
        return keys

    def drop(self, node: str | None = None) -> list[str]:
        """Give back every pick held (on ``node`` only, when given); their keys."""
        keys = self.picks.keys() if node is None else self.picks.on_node(node)
        for key in keys:
            self.drop_one(key, "dropped", "this replica no longer binds" if node is None
                          else f"a pod bound on {node} needs the room")
        return keys

    def drop_one(self, key: str, reason: str = "refiltered", why: str = "") -> bool:
        """Give back ``key``'s pick, if it holds one (whether it did)."""
        node = self.picks.take(key)
        if node is None:
            return False
        self.ledger.give_back(key)
        self._ended(key, node, reason, why)
        return True

    def forget(self, key: str) -> None:
        """The pod was deleted: its pick (the ledger drops its reservation) ends."""
        node = self.picks.take(key)
        if node is not None:
            self._ended(key, node, "deleted")

    def on_pod(self, key: str, obj: Mapping[str, Any]) -> None:
        """A pod's event: a pick whose pod was bound by someone else (or ended) is no longer
        ours; its reservation goes without a trace."""
        ledger = self.ledger
        if key in ledger.inflight and key in self.picks and (node_of(obj) or is_terminated(obj)):
            node = self.picks.take(key)
            ledger.inflight.pop(key, None)
            if key in ledger.state.pods:
                ledger.scheduler.release(key)
            self._ended(key, node, "bound-elsewhere" if node_of(obj) else "ended")
