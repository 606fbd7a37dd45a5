"""No GPU pod goes to a node whose agent does not serve (sharegpu.core.agentserving): the
filter leaves it out with a reason that says so, a bind's reservation there is refused, and the
node comes back as soon as its agent's condition says serving again. A node that never had the
condition is filtered as before."""

from __future__ import annotations

import time
from typing import Any

import pytest

from sharegpu.core import agentserving, names
from sharegpu.core.errors import PlacementError
from sharegpu.core.request import parse_pod
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects


def with_condition(node: dict[str, Any], ok: bool, at: float, reason: str = "") -> dict[str, Any]:
    node.setdefault("status", {})["conditions"] = [agentserving.condition(
        ok, reason or ("DevicePluginsServing" if ok else "AgentStopping"), "stopping",
        now=at, since=at)]
    return node


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_view() -> tuple[ClusterView, Clock]:
    view = ClusterView()
    clock = Clock()
    view.clock = clock
    now = time.time()
    view.reset([with_condition(kobjects.node("up", [16]), True, now),
                with_condition(kobjects.node("stopped", [16]), False, now),
                with_condition(kobjects.node("stale", [16]), True,
                               now - agentserving.STALE_AFTER_S - 5),
                kobjects.node("never", [16])], [])
    return view, clock


NAMES = ["up", "stopped", "stale", "never"]


def test_the_filter_passes_no_node_whose_agent_does_not_serve() -> None:
    view, _ = make_view()
    passed, failed, unres = view.filter(parse_pod(kobjects.pod("p", mem=4)), NAMES)
    assert passed == ["up", "never"]
    assert not failed
    assert set(unres) == {"stopped", "stale"}
    assert "the sharegpu agent does not serve GPU pods" in unres["stopped"]
    assert f"{names.CONDITION_AGENT_SERVING}=False, AgentStopping" in unres["stopped"]
    assert "has not renewed its GPUAgentServing condition" in unres["stale"]
    # a pod without GPUs is not sharegpu's to keep away
    assert view.filter(parse_pod(kobjects.pod("cpu", containers=[{}])), NAMES)[0] == NAMES


def test_a_bind_to_a_node_whose_agent_stopped_is_refused() -> None:
    view, _ = make_view()
    with pytest.raises(PlacementError, match="the sharegpu agent does not serve"):
        view.reserve(parse_pod(kobjects.pod("p", mem=4)), "stopped")
    assert view.reserve(parse_pod(kobjects.pod("q", mem=4)), "up").node == "up"


def test_the_node_follows_its_agent_and_staleness_is_the_extenders_clock() -> None:
    """A graceful stop (False) takes the node out at its event; serving again brings it back;
    a condition not renewed for STALE_AFTER_S on the extender's own clock takes it out, whatever
    the node's clock says; the next renewal brings it back."""
    view, clock = make_view()
    req = parse_pod(kobjects.pod("p", mem=4))
    skewed = time.time() + 3600  # the node's clock an hour ahead: its age reads as 0
    view.upsert_node(with_condition(kobjects.node("up", [16]), True, skewed))
    assert "up" in view.filter(req, ["up"])[0]
    view.upsert_node(with_condition(kobjects.node("up", [16]), False, skewed + 1))
    assert view.filter(req, ["up"])[0] == []
    view.upsert_node(with_condition(kobjects.node("up", [16]), True, skewed + 2))
    assert view.filter(req, ["up"])[0] == ["up"]
    clock.t += agentserving.STALE_AFTER_S - 1
    assert view.filter(req, ["up"])[0] == ["up"]
    clock.t += 2 + view.agents.rescan_s
    passed, _, unres = view.filter(req, ["up"])
    assert passed == [] and "has not renewed" in unres["up"]
    view.upsert_node(with_condition(kobjects.node("up", [16]), True, skewed + 50))  # renewed
    assert view.filter(req, ["up"])[0] == ["up"]
    view.upsert_node(kobjects.node("up", [16]))  # the condition removed: as before
    assert view.filter(req, ["up"])[0] == ["up"]
    view.delete_node("stopped")
    assert not view.agents.published("stopped")


def test_an_unreadable_heartbeat_is_not_fresh() -> None:
    view, _ = make_view()
    node = with_condition(kobjects.node("odd", [16]), True, time.time())
    node["status"]["conditions"][0]["lastHeartbeatTime"] = "yesterday"
    view.upsert_node(node)
    _, _, unres = view.filter(parse_pod(kobjects.pod("p", mem=4)), ["odd"])
    assert "has not renewed" in unres["odd"]


def test_a_relist_keeps_when_the_heartbeat_was_last_seen() -> None:
    """A relist (410 Gone, a repair) does not make a silent agent fresh again, even where the
    node's clock is behind or ahead of the extender's."""
    view, clock = make_view()
    req = parse_pod(kobjects.pod("p", mem=4))
    node = with_condition(kobjects.node("quiet", [16]), True, time.time() + 3600)
    view.upsert_node(node)
    clock.t += agentserving.STALE_AFTER_S - 10
    view.reset([node], [])
    assert view.filter(req, ["quiet"])[0] == ["quiet"]
    clock.t += 11 + view.agents.rescan_s
    assert view.filter(req, ["quiet"])[0] == []
    view.reset([kobjects.node("up", [16])], [])
    assert view.agents.nodes() == set()


def test_a_pick_held_before_the_agent_stopped_is_not_bound() -> None:
    """kube-scheduler's filter held a pick on the node; its agent stops before the bind: the
    bind's reservation is refused and the held GPUs are given back."""
    view, _ = make_view()
    pod = kobjects.pod("p", mem=4)
    view.upsert_pod(pod)  # a pick is held only for a pod the informer shows waiting
    req = parse_pod(pod)
    assert view.pick(req, ["up"], hold=True) == "up"
    assert "default/p" in view.inflight
    view.upsert_node(with_condition(kobjects.node("up", [16]), False, time.time()))
    with pytest.raises(PlacementError, match="does not serve"):
        view.reserve(req, "up")
    assert "default/p" not in view.inflight and "default/p" not in view.state.pods
