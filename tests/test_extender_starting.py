"""The binder and starting pods (sharegpu.core.startingpods): a pod that the kubelet could mistake
for
one starting on its node is bound only once that one has started (the agent marked it
assigned), or refused with the reason after ``start_wait``; a twin binds at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from sharegpu.core import agentserving, names
from sharegpu.core.annotations import assigned_patch, decode
from sharegpu.extender.bind import Binder, BindError
from sharegpu.extender.view import ClusterView
from sharegpu.extender.wire import BindingArgs
from sharegpu_testing import kobjects
from sharegpu_testing.memapi import MemoryApi

# one spread node (identical pods go to different GPUs), one binpack node (they share a GPU)
NODES = [kobjects.node("spread", [16, 16], "cgpu", placement="spread"),
         kobjects.node("pack", [16, 16], "cgpu")]


def _serving(node: dict[str, Any], ok: bool = True, at: float | None = None) -> dict[str, Any]:
    """``node`` with its agent's GPUAgentServing condition, renewed at ``at`` (now)."""
    now = time.time() if at is None else at
    node.setdefault("status", {}).setdefault("conditions", []).append(
        agentserving.condition(ok, "DevicePluginsServing" if ok else "AgentStopping", "",
                               now=now, since=now))
    return node


def _env(pods: list[dict[str, Any]], start_wait: float) -> tuple[ClusterView, MemoryApi, Binder]:
    view = ClusterView()
    view.reset(NODES, [])
    api = MemoryApi(pods)
    return view, api, Binder(api, lambda: view, start_wait=start_wait)


def _args(pod: dict[str, Any], node: str) -> BindingArgs:
    m = pod["metadata"]
    return BindingArgs(m["name"], m["namespace"], m["uid"], node)


def _seen(view: ClusterView, api: MemoryApi, name: str, *, started: bool = False) -> None:
    """The informer's event for the stored pod (marked assigned first when ``started``)."""
    pod = api.pods[f"default/{name}"]
    if started:
        pod["metadata"]["annotations"].update(assigned_patch())
    view.upsert_pod(pod)


def test_look_alike_waits_for_the_starting_pod_and_binds_once_it_started() -> None:
    p1, p2 = kobjects.pod("p1", mem=4), kobjects.pod("p2", mem=4)
    view, api, binder = _env([p1, p2], start_wait=5.0)

    async def go() -> float:
        await binder.bind(_args(p1, "spread"))
        _seen(view, api, "p1")
        assert view.starting.on("spread") == {"default/p1"}
        t0 = time.monotonic()
        task = asyncio.create_task(binder.bind(_args(p2, "spread")))
        await asyncio.sleep(0.2)
        assert not task.done()  # spread puts p2 on the other GPU: waits
        _seen(view, api, "p1", started=True)
        out = await task
        assert out.gpus != (decode(api.pods["default/p1"]["metadata"]["annotations"]).gpus)
        return time.monotonic() - t0

    waited = asyncio.run(go())
    assert 0.2 <= waited < 2.0
    assert view.starting.on("spread") == {"default/p2"}


def test_look_alike_is_refused_with_the_reason_after_start_wait_and_holds_nothing() -> None:
    p1, p2 = kobjects.pod("p1", mem=4), kobjects.pod("p2", mem=4)
    view, api, binder = _env([p1, p2], start_wait=0.3)

    async def go() -> None:
        await binder.bind(_args(p1, "spread"))
        _seen(view, api, "p1")
        with pytest.raises(BindError) as e:
            await binder.bind(_args(p2, "spread"))
        assert e.value.reason == "starting"
        assert "starting pod default/p1" in str(e.value) and "waited 0.3 s" in str(e.value)

    asyncio.run(go())
    assert "default/p2" not in view.state.pods and not view.inflight
    assert view.starting.on("spread") == {"default/p1"}
    assert not api.pods["default/p2"]["spec"].get("nodeName")


def test_twins_and_other_requests_bind_at_once() -> None:
    p1, p2 = kobjects.pod("p1", mem=4), kobjects.pod("p2", mem=4)
    p3 = kobjects.pod("p3", mem=3)
    view, api, binder = _env([p1, p2, p3], start_wait=30.0)

    async def go() -> float:
        t0 = time.monotonic()
        await binder.bind(_args(p1, "pack"))
        _seen(view, api, "p1")
        await binder.bind(_args(p2, "pack"))  # binpack: the same GPU, a twin
        _seen(view, api, "p2")
        await binder.bind(_args(p3, "spread"))  # another request on another node
        return time.monotonic() - t0

    assert asyncio.run(go()) < 2.0
    a1 = decode(api.pods["default/p1"]["metadata"]["annotations"])
    a2 = decode(api.pods["default/p2"]["metadata"]["annotations"])
    assert a1 is not None and a2 is not None and a1.mem == a2.mem
    assert view.starting.on("pack") == {"default/p1", "default/p2"}


def test_a_relist_keeps_starting_pods_and_the_pod_being_bound() -> None:
    p1 = kobjects.pod("p1", mem=4)
    view, api, binder = _env([p1], start_wait=1.0)
    asyncio.run(binder.bind(_args(p1, "spread")))
    stored = api.pods["default/p1"]
    view.reset(NODES, [stored])
    assert view.starting.on("spread") == {"default/p1"}
    stored["metadata"]["annotations"].update(assigned_patch())
    view.reset(NODES, [stored])
    assert view.starting.on("spread") == set()


def test_a_node_whose_agent_names_pods_lets_look_alikes_bind_at_once() -> None:
    """``sharegpu.io/pod-resources: v1`` on the node (its agent names the pod of each kubelet
    call): a look-alike on another GPU binds beside a starting pod; taking the annotation away
    brings the rule back."""
    p1, p2, p3 = (kobjects.pod(n, mem=4) for n in ("p1", "p2", "p3"))
    view, api, binder = _env([p1, p2, p3], start_wait=0.3)
    naming = _serving(kobjects.node("spread", [16, 16, 16], "cgpu", placement="spread"))
    naming["metadata"].setdefault("annotations", {})[names.ANN_NODE_POD_RESOURCES] = "v1"
    view.upsert_node(naming)

    async def go() -> None:
        await binder.bind(_args(p1, "spread"))
        _seen(view, api, "p1")
        t0 = time.monotonic()
        await binder.bind(_args(p2, "spread"))  # spread: another GPU, not a twin
        assert time.monotonic() - t0 < 0.2
        _seen(view, api, "p2")
        plain = kobjects.node("spread", [16, 16, 16], "cgpu", placement="spread")
        view.upsert_node(plain)
        with pytest.raises(BindError) as e:
            await binder.bind(_args(p3, "spread"))
        assert e.value.reason == "starting"

    asyncio.run(go())
    a1 = decode(api.pods["default/p1"]["metadata"]["annotations"])
    a2 = decode(api.pods["default/p2"]["metadata"]["annotations"])
    assert a1 is not None and a2 is not None and a1.gpus != a2.gpus
    assert view.starting.on("spread") == {"default/p1", "default/p2"}


def test_the_promise_is_read_at_start_and_relist_too() -> None:
    """A listed node (the extender's start, a relist) carries its promise as a watched one."""
    p1, p2 = kobjects.pod("p1", mem=4), kobjects.pod("p2", mem=4)
    naming = _serving(kobjects.node("spread", [16, 16], "cgpu", placement="spread"))
    naming["metadata"].setdefault("annotations", {})[names.ANN_NODE_POD_RESOURCES] = "v1"
    view = ClusterView()
    view.reset([naming], [])
    api = MemoryApi([p1, p2])
    binder = Binder(api, lambda: view, start_wait=0.3)

    async def go() -> None:
        await binder.bind(_args(p1, "spread"))
        _seen(view, api, "p1")
        await binder.bind(_args(p2, "spread"))

    asyncio.run(go())
    assert view.starting.on("spread") == {"default/p1", "default/p2"}
    view.reset([kobjects.node("spread", [16, 16], "cgpu", placement="spread")], [])
    assert not view.starting.naming


@pytest.mark.parametrize("agent", ["absent", "stopped", "stale"])
def test_the_promise_holds_only_while_the_agent_serves(agent: str) -> None:
    """The promise outlives an agent that was rolled back or removed (the annotation stays on
    the Node): it is trusted only while the node's GPUAgentServing condition is True and fresh.
    Without the condition the look-alike waits for the starting pod as on a node without the
    promise; with a stopped or stale agent no GPU pod is bound there at all."""
    p1, p2 = kobjects.pod("p1", mem=4), kobjects.pod("p2", mem=4)
    node = kobjects.node("spread", [16, 16], "cgpu", placement="spread")
    if agent == "stopped":
        _serving(node, ok=False)
    elif agent == "stale":
        _serving(node, at=time.time() - agentserving.STALE_AFTER_S - 30)
    node["metadata"].setdefault("annotations", {})[names.ANN_NODE_POD_RESOURCES] = "v1"
    view = ClusterView()
    view.reset([node], [])
    api = MemoryApi([p1, p2])
    binder = Binder(api, lambda: view, start_wait=0.3)
    assert view.starting.naming == {"spread"}  # the promise is read ...
    assert not view.ledger.naming_trusted("spread")  # ... and not trusted

    async def go() -> None:
        if agent == "absent":
            await binder.bind(_args(p1, "spread"))
            _seen(view, api, "p1")
        with pytest.raises(BindError) as e:
            await binder.bind(_args(p2, "spread"))
        if agent == "absent":
            assert e.value.reason == "starting"
        else:
            assert "the sharegpu agent" in str(e.value)

    asyncio.run(go())
    node["status"]["conditions"] = []
    _serving(node)
    view.reset([node], [])
    assert view.ledger.naming_trusted("spread")


def test_a_running_pod_is_started_whatever_its_mark_says() -> None:
    """A bound pod the kubelet runs is not starting, though its mark was lost (the agent
    stopped between Allocate and the mark) or removed: it no longer holds look-alikes back."""
    p1 = kobjects.pod("p1", mem=4)
    view, api, binder = _env([p1], start_wait=0.3)

    async def go() -> None:
        await binder.bind(_args(p1, "spread"))

    asyncio.run(go())
    stored = api.pods["default/p1"]
    view.upsert_pod(stored)
    assert view.starting.on("spread") == {"default/p1"}
    stored["status"] = {"phase": "Pending", "containerStatuses": [
        {"name": "main", "state": {"waiting": {"reason": "ContainerCreating"}}}]}
    view.upsert_pod(stored)
    assert view.starting.on("spread") == {"default/p1"}  # admitted, not running yet
    stored["status"] = {"phase": "Running", "containerStatuses": [
        {"name": "main", "state": {"running": {}}}]}
    view.upsert_pod(stored)
    assert view.starting.on("spread") == set()
    view.reset(NODES, [stored])  # a rebuild reads it the same way
    assert view.starting.on("spread") == set()
