"""The agent's liveness towards the scheduler: the ``assigned`` mark is never lost (set by
Allocate, else by reconciliation, always for the pod's own UID), and the node condition
``GPUAgentServing`` says whether the agent serves, renewed, and False before a graceful stop
unregisters the device plugins."""

from __future__ import annotations

import asyncio
import os

from agent_helpers import NODE, Harness, make_pod, short_dir  # noqa: F401
from agent_kubelet import TestPodResources, wait_until

from sharegpu.agent.kube import MemoryKube
from sharegpu.agent.marks import Marks
from sharegpu.agent.serving import ServingCondition
from sharegpu.core import agentserving, names
from sharegpu.core.annotations import is_assigned


def condition(kube: MemoryKube) -> dict | None:
    for c in kube.nodes[NODE].get("status", {}).get("conditions", []):
        if c["type"] == names.CONDITION_AGENT_SERVING:
            return c
    return None


def admitted(pod: dict) -> dict:
    pod["status"] = {"phase": "Pending", "containerStatuses": [
        {"name": "c0", "state": {"waiting": {"reason": "ContainerCreating"}}}]}
    return pod


async def start(short_dir: str, **cfg) -> tuple[Harness, TestPodResources]:  # type: ignore[no-untyped-def]
    sock = os.path.join(short_dir, "pr.sock")
    pr = TestPodResources(sock)
    await pr.start()
    h = Harness(short_dir, [("Tesla-T4", 15), ("Tesla-T4", 15)], "cgpu",
                pod_resources_socket=sock, **cfg)
    h.kube.nodes[NODE]["status"] = {"nodeInfo": {"kubeletVersion": "v1.37.2"}}
    await h.start()
    return h, pr


async def test_a_mark_lost_with_the_agent_is_set_by_reconciliation(short_dir):
    """The agent answered Allocate and stopped before its mark (as when its pod is deleted
    right after a bind): the pod the kubelet admitted and lists with its devices is marked by
    the next reconciliation; a pod not admitted yet, or admitted without its devices in the
    listing, is not."""
    h, pr = await start(short_dir)
    try:
        lost = make_pod("lost", [{"mem": 2}], alloc={0: {1: 2}})
        h.kube.add_pod(lost)

        async def mark_lost(*a, **k) -> bool:  # the agent is gone before its mark
            return False

        marks = h.agent.allocating.marks
        marks.mark, real_mark = mark_lost, marks.mark  # type: ignore[method-assign]
        pr.admit(lost)
        free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        ids = await h.kubelet.preferred(names.RES_GPU_MEM, free, 2)
        await h.kubelet.allocate(names.RES_GPU_MEM, ids)
        pr.record(lost, "c0", names.RES_GPU_MEM, ids)
        await asyncio.sleep(0.1)
        assert not is_assigned(h.kube.pods[("default", "lost")]["metadata"]["annotations"])
        marks.mark = real_mark  # type: ignore[method-assign]

        waiting = make_pod("waiting", [{"mem": 2}], alloc={0: {0: 2}})  # bound, not admitted
        h.kube.add_pod(waiting)
        listed_only = admitted(make_pod("listed", [{"mem": 2}], alloc={0: {0: 2}}))
        h.kube.add_pod(listed_only)
        pr.admit(listed_only)  # in the pod manager, no devices recorded
        assert await marks.reconcile() == 0  # "lost" has no container status yet either
        admitted(h.kube.pods[("default", "lost")])
        assert await marks.reconcile() == 1
        ann = {k: p["metadata"]["annotations"] for k, p in h.kube.pods.items()}
        assert is_assigned(ann[("default", "lost")])
        assert not is_assigned(ann[("default", "waiting")])
        assert not is_assigned(ann[("default", "listed")])
        assert marks.reconciled == 1
        from sharegpu.agent.metrics import render

        assert "sharegpu_agent_marks_reconciled_total 1" in render(h.agent)
        assert await marks.reconcile() == 0  # nothing left to mark
    finally:
        await h.close()
        await pr.stop()


async def test_reconciliation_runs_at_start(short_dir):
    """An agent that starts finds the pod its predecessor did not mark."""
    kube = MemoryKube()
    kube.add_node(NODE)
    kube.add_pod(admitted(make_pod("old", [{"mem": 2}], alloc={0: {0: 2}})))
    marks = Marks(NODE, kube, None, every_s=3600)
    t = asyncio.create_task(marks.run())
    try:
        await wait_until(lambda: is_assigned(kube.pods[("default", "old")]["metadata"]
                                             ["annotations"]))
    finally:
        t.cancel()


async def test_the_mark_names_the_pods_uid():
    """A pod deleted and recreated under its name before its own Allocate is not marked for
    the one that was admitted before (the patch carries the UID)."""
    kube = MemoryKube()
    kube.add_node(NODE)
    kube.add_pod(make_pod("p", [{"mem": 2}], alloc={0: {0: 2}}, uid="uid-new"))
    marks = Marks(NODE, kube)
    assert await marks.mark("default", "p", "uid-old") is False
    assert not is_assigned(kube.pods[("default", "p")]["metadata"]["annotations"])
    assert await marks.mark("default", "gone", "uid-x") is False
    assert await marks.mark("default", "p", "uid-new") is True
    assert is_assigned(kube.pods[("default", "p")]["metadata"]["annotations"])


async def test_the_serving_condition_follows_the_agent_and_goes_first_on_stop(short_dir):
    """True once the kubelet listed every resource, False (AgentStopping) on a graceful stop,
    written before the device plugins are unregistered."""
    h, pr = await start(short_dir)
    try:
        await wait_until(lambda: (condition(h.kube) or {}).get("status") == "True")
        c = condition(h.kube)
        assert c["reason"] == agentserving.REASON_SERVING
        from sharegpu.agent.metrics import render

        assert "sharegpu_agent_serving 1" in render(h.agent)
        assert agentserving.published(h.kube.nodes[NODE]).heartbeat_at is not None
        order: list[str] = []
        real_patch, real_stop = h.kube.patch_node_condition, h.agent.plugin_set.stop

        async def patch(name, cond):  # type: ignore[no-untyped-def]
            order.append(f"condition {cond['status']}")
            await real_patch(name, cond)

        async def stop_plugins() -> None:
            order.append("plugins stop")
            await real_stop()

        h.kube.patch_node_condition = patch  # type: ignore[method-assign]
        h.agent.plugin_set.stop = stop_plugins  # type: ignore[method-assign]
        await h.agent.stop()
        h.agent = None
        assert order[0] == "condition False" and "plugins stop" in order
        assert order.index("condition False") < order.index("plugins stop")
        assert condition(h.kube)["reason"] == agentserving.REASON_STOPPING
    finally:
        await h.close()
        await pr.stop()


async def test_a_graceful_stop_lets_bound_pods_be_admitted_first(short_dir):
    """Pods bound here before the stop was published get their devices: the device plugins
    stay until they are marked (or the drain's bound passes)."""
    h, pr = await start(short_dir, stop_drain_s=5.0)
    try:
        pod = make_pod("late", [{"mem": 2}], alloc={0: {1: 2}})
        h.kube.add_pod(pod)
        stopping = asyncio.create_task(h.agent.stop())
        await wait_until(lambda: (condition(h.kube) or {}).get("status") == "False")
        await asyncio.sleep(0.2)
        assert not stopping.done()  # waits for "late"
        free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        ids = await h.kubelet.preferred(names.RES_GPU_MEM, free, 2)
        await h.kubelet.allocate(names.RES_GPU_MEM, ids)
        await asyncio.wait_for(stopping, 5)
        h.agent = None
        assert is_assigned(h.kube.pods[("default", "late")]["metadata"]["annotations"])
    finally:
        await h.close()
        await pr.stop()


async def test_the_heartbeat_is_renewed_and_a_change_written_at_once():
    kube = MemoryKube()
    kube.add_node(NODE)
    why: list[str] = ["the kubelet has not listed aliyun.com/gpu-mem's devices yet"]
    wall = [1_000_000.0]
    cond = ServingCondition(NODE, kube, lambda: list(why), heartbeat_s=10.0,
                            wall=lambda: wall[0])
    await cond.tick()
    first = condition(kube)
    assert first["status"] == "False" and "gpu-mem" in first["message"]
    why.clear()
    wall[0] += 1
    await cond.tick()  # the answer changed: written at once
    c = condition(kube)
    assert c["status"] == "True" and c["lastTransitionTime"] == c["lastHeartbeatTime"]
    writes = len(kube.calls)
    await cond.tick()
    assert len(kube.calls) == writes  # nothing changed, not due
    cond._sent_at -= 10.0
    wall[0] += 10
    await cond.tick()  # due: renewed, the transition time kept
    renewed = condition(kube)
    assert renewed["lastHeartbeatTime"] != c["lastHeartbeatTime"]
    assert renewed["lastTransitionTime"] == c["lastTransitionTime"]
