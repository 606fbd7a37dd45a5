"""The picks a filter answered with, held in the cluster cache as in-flight reservations until
their binds: the feature object that gives them back (on their timeout, when the pod is
filtered again, bound by someone else or deleted, or when a bound pod's record needs the room).
The bookkeeping of which keys are held, and until when, is :class:`~.picks.HeldPicks`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.pods import is_terminated, node_of
from .cache import ClusterCache
from .picks import HeldPicks


class PickHolds:
    """The held picks (``picks``) over the cluster cache ``ledger`` that holds their GPUs;
    ``waiting(key, uid)``: whether that pod exists, unbound, as the informer shows it."""

    def __init__(self, ledger: ClusterCache, picks: HeldPicks,
                 waiting: Callable[[str, str], bool] = lambda key, uid: False) -> None:
        self.ledger = ledger
        self.picks = picks
        self.waiting = waiting

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
            self.ledger.give_back(key)
        return keys

    def drop(self, node: str | None = None) -> list[str]:
        """Give back every pick held (on ``node`` only, when given); their keys."""
        keys = self.picks.keys() if node is None else self.picks.on_node(node)
        for key in keys:
            self.drop_one(key)
        return keys

    def drop_one(self, key: str) -> None:
        """Give back ``key``'s pick, if it holds one."""
        if self.picks.take(key) is not None:
            self.ledger.give_back(key)

    def on_pod(self, key: str, obj: Mapping[str, Any]) -> None:
        """A pod's event: a pick whose pod was bound by someone else (or ended) is no longer
        ours; its reservation goes without a trace."""
        ledger = self.ledger
        if key in ledger.inflight and key in self.picks and (node_of(obj) or is_terminated(obj)):
            self.picks.take(key)
            ledger.inflight.pop(key, None)
            if key in ledger.state.pods:
                ledger.scheduler.release(key)
