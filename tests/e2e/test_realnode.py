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

The chart is installed with its defaults: ``nodepods.OVERRIDES`` is empty. What the machine lacks is
supplied around the chart instead (docs/real-node.md): the cluster DNS and the GPU driver are
stand-ins, the images are made locally (the base image, HAMi's image and kube-scheduler's).
"""

from __future__ import annotations

import sys

from sharegpu.core import names
from sharegpu.core import request as rules

from .nodepods import (
    NAMESPACE,
    WORKLOADS,
    compare,
    container_log,
    create,
    get_pod,
    gpu_pod,
    list_pods,
    node_uuids,
    pod_summary,
    ready,
    report,
    wait,
)
from .realnode import RealNodeCluster

HOOK = "pods.validate.sharegpu.io"


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
    done = wait("the plain pod to finish",
                 lambda: (p := get_pod(cp, "default", "plain")) and p["status"].get("phase") in
                 ("Succeeded", "Failed") and p, 120)
    log = container_log(node, done, "c")
    assert done["status"]["phase"] == "Succeeded", log
    assert done["spec"]["nodeName"] == node.name
    assert done["status"]["podIP"].startswith(node.gateway.rsplit(".", 1)[0] + ".")
    assert "VERSION v1.37.2" in log, log
    cp.request("DELETE", "/api/v1/namespaces/default/pods/plain")


def test_every_pod_of_the_release_runs_ready_on_the_real_node(real_release: RealNodeCluster) -> None:
    pods = list_pods(real_release.cp, NAMESPACE)
    print("\n" + pod_summary(pods), file=sys.stderr)
    node = real_release.nodes[0].name
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
    installed = real_release.nodes[0].host_path("/usr/local/vgpu/sharegpu/installed")
    lib = installed.read_text().strip()
    assert lib.startswith("/usr/local/vgpu/sharegpu/hami-") and lib.endswith("/libvgpu.so")
    assert real_release.nodes[0].host_path(lib).is_file()
    print(f"release Running and Ready {real_release.seconds['helm-install-ready']:.1f}s after "
          "helm install", file=sys.stderr)


def test_the_api_server_calls_the_webhook_pod(real_release: RealNodeCluster) -> None:
    bad = gpu_pod("core-33", [{names.RES_GPU_MEM: 4, names.RES_GPU_CORE: 33}],
                  node=real_release.nodes[0].name, image=real_release.refs["SHAREGPU_REF"])
    status, body = create(real_release.cp, WORKLOADS, bad)
    assert status == 422, body
    assert body["message"].startswith(f'admission webhook "{HOOK}" denied the request: ')
    assert rules.RULE_CORE in body["message"]


def test_a_shared_gpu_pod_is_placed_by_the_charts_scheduler_and_starts_with_its_share(
        real_release: RealNodeCluster) -> None:
    cp, node = real_release.cp, real_release.nodes[0]
    obj = gpu_pod("shared-1", [{names.RES_GPU_MEM: 3}], node=node.name,
                  image=real_release.refs["SHAREGPU_REF"])
    status, body = create(cp, WORKLOADS, obj)
    assert status == 201, body
    try:
        pod = wait("shared-1 running",
                   lambda: (p := get_pod(cp, WORKLOADS, "shared-1")) and ready(p) and p, 120)
        got = report(node, pod, "c0")
        check = compare(pod, 0, got, "cgpu", node_uuids(node))
        assert not check.mismatches, (check, got)
    finally:
        # the node is shared with the GPU tests of the session: a memory-only pod left on it
        # would keep the pods asking for compute (core_mem) off it
        cp.request("DELETE", f"/api/v1/namespaces/{WORKLOADS}/pods/shared-1")
        wait("shared-1 gone", lambda: get_pod(cp, WORKLOADS, "shared-1") is None, 120)
