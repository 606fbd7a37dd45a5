"""Bad input on the DRA pool gets a clear refusal (issue 21), on the REAL control plane
(kube-apiserver, kube-controller-manager, kube-scheduler v1.37.2, default feature gates;
docs/dra.md, "Not refused at admission, and why").

kube-scheduler's DynamicResources plugin refuses a DRA pod before any extender is asked
(``cannot allocate all claims``, ``didn't match Pod's node affinity/selector``). ``sharegpu
extender``, run as a process with the chart's arguments for ``agent.dra.enabled=true`` and the
chart's ServiceAccount and RBAC, watches such a pod and posts a Warning Event
``GPUSharingDRAUnschedulable`` naming the field and the rule:

- an ACK pod (translated by the chart's webhook, ``test_dra_webhook_real``'s fixture: 4
  kubelet-less DRA nodes, slices from ``build_slice``, GPUs of 15-40 GiB) asking for 48 GiB;
- one aimed by ``nodeSelector kubernetes.io/hostname`` at a device-plugin GPU node;
- one while every GPU of the pool carries the ``isolation-unavailable`` device taint (then the
  taints are lifted and it is placed).

Meanwhile ordinary DRA pods are placed and get no such Event (disturbs nothing).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from lightkube import ApiError, Client, KubeConfig
from lightkube.resources.core_v1 import Node

from sharegpu.core.modes import Mode
from sharegpu.dra.resourceslices import SliceGpu, build_slice

from .components import create_node_object, wait_for
from .controlplane import ControlPlane
from .realcluster import (
    ChartRbac,
    LocalExtender,
    cleanup,
    gpu_node_object,
    make_namespace,
    render_chart,
    sa_client,
    start_extender,
)
from .test_dra_webhook_real import (  # noqa: F401  (env: the fixture)
    NODES,
    POOL,
    RA,
    Env,
    env,
    get,
    gpu_pod,
    post,
    scheduler_events,
)

RELEASE = "sg-dra-refuse"
REASON = "GPUSharingDRAUnschedulable"


def our_events(cp: ControlPlane, ns: str, pod: str) -> list[dict[str, Any]]:
    return [e for e in get(cp, f"/api/v1/namespaces/{ns}/events?fieldSelector="
                               f"involvedObject.name={pod}")["items"] if e["reason"] == REASON]


class Refusals:
    def __init__(self, cluster: Env, ext: LocalExtender, dp: str) -> None:
        self.env, self.ext, self.dp = cluster, ext, dp


@pytest.fixture(scope="module")
def refusals(env: Env, controlplane: ControlPlane) -> Iterator[Refusals]:  # noqa: F811
    cp = controlplane
    admin = Client(KubeConfig.from_file(cp.admin_kubeconfig))
    release_ns = make_namespace(admin, "sg-refuse")
    docs = render_chart(RELEASE, release_ns, {"agent.dra.enabled": "true"})
    rbac = ChartRbac(admin, docs, RELEASE)
    ext = None
    dp = f"e2e-refuse-dp-{release_ns.rsplit('-', 1)[1]}"
    try:
        # a device-plugin GPU node (two 16 GiB GPUs advertised by the device plugins)
        create_node_object(admin, gpu_node_object(dp, "cgpu", [16, 16], release_ns))
        sa = rbac.apply("extender")
        kubeconfig, _ = sa_client(cp, release_ns, sa)
        ext = start_extender(cp, docs, "sharegpu-extender-refuse", kubeconfig)
        assert "--dra" in ext.proc.args, ext.proc.args
        yield Refusals(env, ext, dp)
    finally:
        if ext is not None:
            ext.proc.stop()
        with contextlib.suppress(ApiError):
            admin.delete(Node, dp)
        cleanup(admin, release_ns)
        rbac.delete()


def refused(r: Refusals, name: str) -> tuple[str, str]:
    """kube-scheduler's FailedScheduling message and the extender's Event message."""
    cp, ns = r.env.cp, r.env.ns
    (ks,) = wait_for(f"{name}'s FailedScheduling", lambda: scheduler_events(cp, ns, name)[:1],
                     timeout=60)
    ours = wait_for(f"{name}'s {REASON} Event", lambda: our_events(cp, ns, name), timeout=60)
    ev = ours[-1]
    assert ev["type"] == "Warning" and ev["source"]["component"] == "sharegpu-extender", ev
    assert get(cp, f"/api/v1/namespaces/{ns}/pods/{name}")["spec"].get("nodeName") is None
    print(f"\n{name}: kube-scheduler: {ks['message']}\n{name}: sharegpu-extender: "
          f"{ev['message']}")
    return ks["message"], ev["message"]


def placed(r: Refusals, name: str) -> str:
    cp, ns = r.env.cp, r.env.ns
    return wait_for(f"{name} placed", lambda: get(
        cp, f"/api/v1/namespaces/{ns}/pods/{name}")["spec"].get("nodeName"), timeout=60)


def create(r: Refusals, pod: dict[str, Any]) -> dict[str, Any]:
    code, body = post(r.env.cp, f"/api/v1/namespaces/{r.env.ns}/pods", pod)
    assert code == 201, body
    assert body["spec"].get("resourceClaims"), "translated by the webhook"
    return body


def set_taints(r: Refusals, tainted: bool) -> None:
    """Every DRA node's slice written again, its GPUs with or without the taint (as the agent
    does when HAMi-core goes or comes back)."""
    cp = r.env.cp
    for key, sizes in NODES.items():
        node = r.env.nodes[key]
        path = f"{RA}/resourceslices/{node}-gpu.sharegpu.io"
        cur = get(cp, path)
        gpus = [SliceGpu(i, cur["spec"]["devices"][i]["attributes"]["uuid"]["string"],
                         "Tesla T4", gib * 1024, gib, isolation_unavailable=tainted)
                for i, gib in enumerate(sizes)]
        new = build_slice(node, gpus, Mode.CGPU,
                          generation=cur["spec"]["pool"]["generation"] + 1)
        new["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
        status, body = cp.request("PUT", path, new)
        assert status == 200, body


def test_bad_input_on_the_dra_pool_gets_the_extenders_reason(refusals: Refusals) -> None:
    r = refusals
    create(r, gpu_pod("fine-1", 4))
    assert placed(r, "fine-1")

    # 1. larger than every GPU of the pool
    create(r, gpu_pod("too-big", 48))
    ks, ours = refused(r, "too-big")
    assert "cannot allocate all claims" in ks
    claim = get(r.env.cp, f"/api/v1/namespaces/{r.env.ns}/pods/too-big")["status"][
        "resourceClaimStatuses"][0]["resourceClaimName"]
    assert ours == (
        "no node of the DRA pool (driver gpu.sharegpu.io) can take this pod as it is: "
        f"ResourceClaim {r.env.ns}/{claim} spec.devices.requests[0].exactly.capacity.requests."
        "memory=48Gi (spec.containers[0] aliyun.com/gpu-mem=48): larger than every GPU of the "
        f"DRA pool (largest: 40Gi, node {r.env.nodes['d']} gpu-0)"), ours

    # 2. aimed at a device-plugin node by its hostname
    create(r, gpu_pod("aimed-at-dp", 1, selector={**POOL, "kubernetes.io/hostname": r.dp}))
    ks, ours = refused(r, "aimed-at-dp")
    assert "didn't match Pod's node affinity/selector" in ks
    pool = ", ".join(sorted(r.env.nodes[k] for k in NODES))
    assert ours.endswith(
        f"spec.nodeSelector[kubernetes.io/hostname]={r.dp}: selects no node of the DRA pool "
        f"(nodes with a ResourceSlice of gpu.sharegpu.io: {pool}); {r.dp} serves its GPUs "
        "through the device plugins"), ours

    # 3. every GPU of the pool tainted isolation-unavailable; then back
    set_taints(r, True)
    try:
        create(r, gpu_pod("while-tainted", 2))
        ks, ours = refused(r, "while-tainted")
        assert "cannot allocate all claims" in ks
        assert "every GPU of the DRA pool that could hold it carries a device taint the claim " \
               "does not tolerate: gpu.sharegpu.io/isolation-unavailable on " in ours, ours
        assert "the node's GPU isolation back-end (HAMi-core or MPS) is not usable" in ours
    finally:
        set_taints(r, False)
    assert placed(r, "while-tainted")  # kube-scheduler tries again once the slices change

    # disturbs nothing: an ordinary pod is placed, and placed pods got no such Event
    create(r, gpu_pod("fine-2", 3, core=20))
    assert placed(r, "fine-2")
    for name in ("fine-1", "fine-2"):
        assert our_events(r.env.cp, r.env.ns, name) == []
    assert r.ext.proc.alive(), r.ext.proc.log_tail()
    log = r.ext.proc.log.read_text(errors="replace")
    assert "Traceback" not in log, r.ext.proc.log_tail()
    print(json.dumps({"extender log lines": len(log.splitlines())}))
