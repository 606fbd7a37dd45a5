"""What exists in the cluster as the informer shows it, for the checks at the verbs' doors:
the name of every Node (GPUs or not), and every live pod not bound yet (its UID).

A bind goes only to a node that exists; a filter holds a pick only for a pod that exists,
unbound, with the UID it was filtered with (so filters of made-up pods hold nothing)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..core.pods import is_terminated, node_of


def _uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


class Presence:
    """Node names, and unbound live pods' keys -> UID."""

    def __init__(self) -> None:
        self.nodes: set[str] = set()
        self.unbound: dict[str, str] = {}

    def reset(self, nodes: Iterable[Mapping[str, Any]],
              pods: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
        """From listed Nodes and (key, Pod) pairs."""
        self.nodes = {str((n.get("metadata") or {}).get("name") or "") for n in nodes}
        self.nodes.discard("")
        self.unbound = {key: _uid(obj) for key, obj in pods
                        if not node_of(obj) and not is_terminated(obj)}

    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        if name:
            self.nodes.add(name)

    def delete_node(self, name: str) -> None:
        self.nodes.discard(name)

    def upsert_pod(self, key: str, obj: Mapping[str, Any]) -> None:
        if node_of(obj) or is_terminated(obj):
            self.unbound.pop(key, None)
        else:
            self.unbound[key] = _uid(obj)

    def delete_pod(self, key: str) -> None:
        self.unbound.pop(key, None)

    def has_node(self, name: str) -> bool:
        return name in self.nodes

    def waiting(self, key: str, uid: str) -> bool:
        """Whether pod ``key`` exists, unbound and live, with this ``uid``."""
        got = self.unbound.get(key)
        return got is not None and bool(uid) and got == uid
