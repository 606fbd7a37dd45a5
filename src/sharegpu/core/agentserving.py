"""Whether a node's agent serves GPU pods: the node condition ``GPUAgentServing`` that the
agent renews and the rule the extender reads it by. Pure: the caller passes the clocks.

The agent sets the condition ``True`` once the kubelet has registered and listed every GPU
resource it serves (its readiness), ``False`` while it starts and when it stops (a graceful
stop says so before its device plugins go), and renews ``lastHeartbeatTime`` every
:data:`HEARTBEAT_S` seconds. The extender passes no node for a GPU pod while the condition is
``False`` or was not renewed for :data:`STALE_AFTER_S` seconds (the agent died without a word):
the kubelet fails a pod for good when no plugin serves its resource. A node that never had the
condition (no sharegpu agent of this version ran there) is filtered as before. How stale is
measured: the extender notes on its own monotonic clock when it saw the heartbeat change, so
clocks of the node and the extender need not agree; the first time it sees a node it starts
from the heartbeat's own age (wall clocks, clamped at 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from . import names

HEARTBEAT_S = 10.0  # the agent renews the condition this often
STALE_AFTER_S = 40.0  # the extender treats a condition not renewed this long as not serving

REASON_SERVING = "DevicePluginsServing"
REASON_STARTING = "AgentStarting"
REASON_STOPPING = "AgentStopping"


def condition(serving: bool, reason: str, message: str, *, now: float,
              since: float) -> dict[str, str]:
    """The condition the agent writes (``now`` and ``since``: wall-clock seconds of the
    heartbeat and of the last change of status)."""
    return {"type": names.CONDITION_AGENT_SERVING, "status": "True" if serving else "False",
            "reason": reason, "message": message[:1024],
            "lastHeartbeatTime": _stamp(now), "lastTransitionTime": _stamp(since)}


@dataclass(frozen=True)
class Published:
    """The condition as a Node object carries it."""

    serving: bool
    reason: str
    message: str
    heartbeat: str  # as written (compared for renewal)
    heartbeat_at: float | None  # wall-clock seconds, None when unreadable


def published(node: Mapping[str, Any]) -> Published | None:
    """The node's ``GPUAgentServing`` condition, ``None`` when it has none."""
    conds = (node.get("status") or {}).get("conditions")
    for c in conds if isinstance(conds, list) else []:
        if isinstance(c, Mapping) and c.get("type") == names.CONDITION_AGENT_SERVING:
            hb = c.get("lastHeartbeatTime")
            hb = hb if isinstance(hb, str) else ""
            return Published(c.get("status") == "True", str(c.get("reason") or ""),
                             str(c.get("message") or ""), hb, _parse(hb))
    return None


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: str) -> float | None:
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


class AgentLiveness:
    """The extender's record of each node's condition: when it last saw it renewed (its
    monotonic clock) and whether it says serving."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S, rescan_s: float = 1.0) -> None:
        self.stale_after_s = stale_after_s
        self.rescan_s = rescan_s  # :meth:`down` scans every node at most this often
        # node -> (the condition, monotonic time its heartbeat was last seen to change)
        self._nodes: dict[str, tuple[Published, float]] = {}
        self._down: tuple[float, dict[str, str]] | None = None  # the last scan

    def observe(self, name: str, node: Mapping[str, Any], *, mono: float, wall: float) -> None:
        """A Node object (listed or from a watch event)."""
        got = published(node)
        old = self._nodes.get(name)
        if old is None or got is None or old[0].serving != got.serving or (
                self._down is not None and name in self._down[1]):
            self._down = None  # a node's answer changed (or may have): scan again
        if got is None:
            self._nodes.pop(name, None)
            return
        if old is not None and old[0].heartbeat == got.heartbeat:
            self._nodes[name] = (got, old[1])  # status may change without a new heartbeat
            return
        if old is None and got.heartbeat_at is not None:
            seen = mono - max(0.0, wall - got.heartbeat_at)  # its age when first seen
        elif got.heartbeat_at is None:
            seen = mono - self.stale_after_s - 1.0  # unreadable: not trusted as fresh
        else:
            seen = mono
        self._nodes[name] = (got, seen)

    def forget(self, name: str) -> None:
        self._nodes.pop(name, None)
        self._down = None

    def clear(self) -> None:
        self._nodes.clear()
        self._down = None

    def nodes(self) -> set[str]:
        """The nodes that have the condition."""
        return set(self._nodes)

    def published(self, name: str) -> bool:
        return name in self._nodes

    def why_not(self, name: str, mono: float) -> str | None:
        """Why ``name``'s agent does not serve GPU pods now; ``None`` when it does, or when the
        node never had the condition."""
        rec = self._nodes.get(name)
        if rec is None:
            return None
        got, seen = rec
        if not got.serving:
            what = f"{got.reason}: {got.message}" if got.message else got.reason or "False"
            return (f"node {name}: the sharegpu agent does not serve GPU pods "
                    f"({names.CONDITION_AGENT_SERVING}=False, {what}); the kubelet would fail "
                    "a GPU pod it cannot admit, so none is placed here until the agent serves "
                    "again")
        age = mono - seen
        if age > self.stale_after_s:
            return (f"node {name}: the sharegpu agent has not renewed its "
                    f"{names.CONDITION_AGENT_SERVING} condition for {age:.0f}s (it renews every "
                    f"{HEARTBEAT_S:.0f}s; stale after {self.stale_after_s:.0f}s): it may have "
                    "stopped; no GPU pod is placed here until it renews it (see the agent pod "
                    "on this node)")
        return None

    def serving(self, name: str, mono: float) -> bool:
        """Whether ``name`` has the condition, ``True`` and fresh."""
        return name in self._nodes and self.why_not(name, mono) is None

    def down(self, mono: float) -> dict[str, str]:
        """Every node whose agent does not serve now, with why (scanned again when a node's
        status changed, else at most every ``rescan_s``: staleness is coarse)."""
        if self._down is not None and mono - self._down[0] < self.rescan_s:
            return self._down[1]
        out = {}
        for name in self._nodes:
            why = self.why_not(name, mono)
            if why is not None:
                out[name] = why
        self._down = (mono, out)
        return out


__all__ = ["HEARTBEAT_S", "STALE_AFTER_S", "AgentLiveness", "Published", "condition",
           "published"]
