"""sharegpu on a REAL node: the upstream kubelet v1.37.2 with containerd v2.4.2 and runc on this
machine (realnode.py), the project's image built from its own Dockerfile (buildah), and the chart
installed with helm.

- A plain pod of the project's image runs on the node, gets an address on the node's bridge,
  and reaches the API server through the ``kubernetes`` Service (kube-proxy) by its DNS name.
- ``helm install`` of charts/sharegpu: every pod of the release (agent DaemonSet with its
  ``hami-install`` init container and ``mps-control`` container, extender, webhook and the
  chart's kube-scheduler) Running and Ready on the real node. The chart's kube-scheduler calls
  the extender over TLS through its Service; the API server calls the webhook pod.
- GPU pods written with ACK's pod spec are placed by the chart's kube-scheduler and the
  extender, admitted by the kubelet through the agent's device plugins, and their containers
  start; each reports what it received and the test compares it with the pod's decision
  annotations.

The chart is installed with its defaults: :data:`OVERRIDES` is empty. What the machine lacks is
supplied around the chart instead (docs/real-node.md): the cluster DNS and the GPU driver are
stand-ins, the images are made locally (the base image, HAMi's image and kube-scheduler's).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sharegpu import names
from sharegpu import request as rules

from .components import helm
from .nodepods import (
    compare,
    create,
    get_pod,
    gpu_pod,
    list_pods,
    node_uuids,
    ready,
    report,
)
from .realnode import RealNodeCluster

NAMESPACE = "sharegpu-system"
RELEASE = "sharegpu"
# every value given to helm beyond the chart's defaults, with the reason: none are needed
OVERRIDES: dict[str, str] = {}
WORKLOADS = "gpu-workloads"
HOOK = "pods.validate.sharegpu.io"


def _wait(what: str, fn: Any, timeout: float, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def _pod_summary(pods: list[dict[str, Any]]) -> str:
    lines = []
    for p in pods:
        st = p.get("status", {})
        conts = [f"{s['name']}:{next(iter(s.get('state') or {'?': 0}))}"
                 f"{'(ready)' if s.get('ready') else ''}"
                 for s in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses")
                                                                     or [])]
        lines.append(f"  {p['metadata']['name']:<45} {st.get('phase')} node="
                     f"{p['spec'].get('nodeName')} {' '.join(conts)}")
    return "\n".join(lines)


def _events(cluster: RealNodeCluster, namespace: str) -> str:
    status, body = cluster.cp.request("GET", f"/api/v1/namespaces/{namespace}/events")
    if status != 200:
        return body
    return "\n".join(f"  {e['involvedObject'].get('name')}: {e.get('reason')}: "
                     f"{e.get('message', '')[:300]}" for e in json.loads(body)["items"][-40:])


@pytest.fixture(scope="module")
def release(real_cluster: RealNodeCluster) -> Iterator[RealNodeCluster]:
    cp = real_cluster.cp
    t0 = time.monotonic()
    helm(cp, "install", RELEASE, str(_chart()), "-n", NAMESPACE, "--create-namespace",
         *[a for k, v in OVERRIDES.items() for a in ("--set", f"{k}={v}")], timeout=300)

    def all_ready() -> bool:
        pods = list_pods(cp, NAMESPACE)
        return bool(pods) and all(ready(p) for p in pods) and len(pods) >= 7

    try:
        _wait("every pod of the release Running and Ready", all_ready, 300, every=1)
    except BaseException:
        print(_pod_summary(list_pods(cp, NAMESPACE)), file=sys.stderr)
        print(_events(real_cluster, NAMESPACE), file=sys.stderr)
        raise
    real_cluster.seconds["helm-install-ready"] = time.monotonic() - t0
    status, _ = cp.request("POST", "/api/v1/namespaces",
                           {"apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": WORKLOADS}})
    assert status in (201, 409)
    yield real_cluster


def _chart() -> Any:
    from .components import CHART

    return CHART


def test_a_plain_pod_runs_and_reaches_the_api_server_by_its_service_name(
        real_cluster: RealNodeCluster) -> None:
    cp, node = real_cluster.cp, real_cluster.nodes[0]
    script = (
        "import json, ssl, urllib.request\n"
        "sa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
        "ctx = ssl.create_default_context(cafile=sa + '/ca.crt')\n"
        "req = urllib.request.Request('https://kubernetes.default.svc.cluster.local/version',\n"
        "    headers={'Authorization': 'Bearer ' + open(sa + '/token').read()})\n"
        "print('VERSION ' + json.loads(urllib.request.urlopen(req, context=ctx).read())"
        "['gitVersion'], flush=True)\n")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "c", "image": real_cluster.refs["SHAREGPU_REF"],
                                    "imagePullPolicy": "Never",
                                    "command": ["python3", "-c", script]}]}}
    status, body = create(cp, "default", pod)
    assert status == 201, body
    done = _wait("the plain pod to finish",
                 lambda: (p := get_pod(cp, "default", "plain")) and p["status"].get("phase") in
                 ("Succeeded", "Failed") and p, 120)
    from .nodepods import container_log

    log = container_log(node, done, "c")
    assert done["status"]["phase"] == "Succeeded", log
    assert done["spec"]["nodeName"] == node.name
    assert done["status"]["podIP"].startswith(node.gateway.rsplit(".", 1)[0] + ".")
    assert "VERSION v1.37.2" in log, log
    cp.request("DELETE", "/api/v1/namespaces/default/pods/plain")


def test_every_pod_of_the_release_runs_ready_on_the_real_node(release: RealNodeCluster) -> None:
    pods = list_pods(release.cp, NAMESPACE)
    print("\n" + _pod_summary(pods), file=sys.stderr)
    node = release.nodes[0].name
    assert all(p["spec"]["nodeName"] == node for p in pods)
    by_component: dict[str, int] = {}
    for p in pods:
        comp = p["metadata"]["labels"].get("app.kubernetes.io/component", "?")
        by_component[comp] = by_component.get(comp, 0) + 1
    assert by_component == {"agent": 1, "extender": 2, "webhook": 2, "scheduler": 2}
    (agent,) = [p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"] ==
                "agent"]
    inits = agent["status"]["initContainerStatuses"]
    assert [s["name"] for s in inits] == ["hami-install"]
    assert inits[0]["state"]["terminated"]["exitCode"] == 0
    assert {s["name"] for s in agent["status"]["containerStatuses"]} == {"agent", "mps-control"}
    # the HAMi stand-in's library was installed where the agent looks for it
    installed = release.nodes[0].host_path("/usr/local/vgpu/sharegpu/installed")
    lib = installed.read_text().strip()
    assert lib.startswith("/usr/local/vgpu/sharegpu/hami-") and lib.endswith("/libvgpu.so")
    assert release.nodes[0].host_path(lib).is_file()
    print(f"release Running and Ready {release.seconds['helm-install-ready']:.1f}s after "
          "helm install", file=sys.stderr)


def test_the_api_server_calls_the_webhook_pod(release: RealNodeCluster) -> None:
    bad = gpu_pod("core-33", [{names.RES_GPU_MEM: 4, names.RES_GPU_CORE: 33}],
                  node=release.nodes[0].name, image=release.refs["SHAREGPU_REF"])
    status, body = create(release.cp, WORKLOADS, bad)
    assert status == 422, body
    assert body["message"].startswith(f'admission webhook "{HOOK}" denied the request: ')
    assert rules.RULE_CORE in body["message"]


def test_a_shared_gpu_pod_is_placed_by_the_charts_scheduler_and_starts_with_its_share(
        release: RealNodeCluster) -> None:
    cp, node = release.cp, release.nodes[0]
    obj = gpu_pod("shared-1", [{names.RES_GPU_MEM: 3}], node=node.name,
                  image=release.refs["SHAREGPU_REF"])
    status, body = create(cp, WORKLOADS, obj)
    assert status == 201, body
    pod = _wait("shared-1 running",
                lambda: (p := get_pod(cp, WORKLOADS, "shared-1")) and ready(p) and p, 120)
    got = report(node, pod, "c0")
    check = compare(pod, 0, got, "cgpu", node_uuids(node))
    assert not check.mismatches, (check, got)
