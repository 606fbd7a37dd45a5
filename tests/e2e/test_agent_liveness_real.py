"""The agent's liveness writes against the REAL kube-apiserver:

- the ``assigned`` mark carries the pod's UID (``metadata.uid`` in the merge patch): a pod
  deleted and recreated under its name is refused the old one's mark (409, ``PodGone`` to the
  agent) and left unmarked; its own UID is accepted;
- ``GPUAgentServing`` written through ``nodes/status`` with the agent's heartbeat and transition
  times, read back by the extender's view: the node leaves filter's answer when the condition
  turns False, and comes back when it is True again.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from lightkube import Client
from lightkube.resources.core_v1 import Node, Pod

from sharegpu.agent.kube import PodGone
from sharegpu.agent.lightkube_api import LightkubeApi, make_client
from sharegpu.agent.marks import Marks
from sharegpu.agent.serving import ServingCondition
from sharegpu.core import agentserving, names
from sharegpu.core.annotations import is_assigned
from sharegpu.core.request import parse_pod
from sharegpu.extender.view import ClusterView

from .controlplane import ControlPlane
from .realcluster import cleanup, gpu_node, gpu_pod, make_namespace


def test_marks_name_the_uid_and_the_condition_reaches_the_extender(
        controlplane: ControlPlane, admin: Client) -> None:
    run = f"live-{uuid.uuid4().hex[:6]}"
    ns = make_namespace(admin, "liveness")
    node = gpu_node(admin, f"{run}-n", "cgpu", [16, 16], run)
    try:
        asyncio.run(_check(controlplane, admin, ns, node, run))
    finally:
        cleanup(admin, ns, [node])


async def _check(cp: ControlPlane, admin: Client, ns: str, node: str, run: str) -> None:
    kube = LightkubeApi(make_client(str(cp.admin_kubeconfig)))

    def create() -> str:
        pod = admin.create(Pod.from_dict({**gpu_pod("p", run, mem=4), "metadata": {
            "name": "p", "namespace": ns, "labels": {"e2e.sharegpu.io/run": run}}}))
        return str(pod.metadata.uid)

    old = create()
    admin.delete(Pod, "p", namespace=ns, grace_period=0)
    new = create()
    assert old != new
    try:
        await kube.patch_pod_annotations(ns, "p", {names.ANN_ASSIGNED: "true"}, uid=old)
    except PodGone:
        pass
    else:
        raise AssertionError("the old pod's mark was accepted for the new pod")
    assert not is_assigned(admin.get(Pod, "p", namespace=ns).metadata.annotations or {})
    marks = Marks(node, kube)
    assert await marks.mark(ns, "p", new) is True
    assert is_assigned(admin.get(Pod, "p", namespace=ns).metadata.annotations or {})
    assert await marks.mark(ns, "gone", "00000000-0000-0000-0000-000000000000") is False

    view = ClusterView()
    view.reset([admin.get(Node, node).to_dict()], [])
    req = parse_pod(gpu_pod("q", run, mem=4) | {"metadata": {"name": "q", "namespace": ns}})
    assert view.filter(req, [node])[0] == [node]  # never published: filtered as before
    cond = ServingCondition(node, kube, lambda: [])
    await cond.tick()
    got = admin.get(Node, node).to_dict()
    pub = agentserving.published(got)
    assert pub is not None and pub.serving and pub.heartbeat_at is not None
    assert abs(pub.heartbeat_at - time.time()) < 120
    view.upsert_node(got)
    assert view.filter(req, [node])[0] == [node]
    await cond.stop()
    got = admin.get(Node, node).to_dict()
    view.upsert_node(got)
    passed, _, unres = view.filter(req, [node])
    assert passed == [] and "AgentStopping" in unres[node], unres
    # the kubelet's own conditions are untouched by the agent's writes
    types = [c["type"] for c in got["status"].get("conditions") or []]
    assert types.count(names.CONDITION_AGENT_SERVING) == 1, types
