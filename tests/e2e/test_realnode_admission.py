"""How the agent matches a kubelet call to a pod, on the REAL node (realnode.py) with the chart
installed: the attacks of issue 40 that reach the agent (4: a pod without a decision takes a
pending pod's; 5: a pod sets its own limits by ``envFrom`` or a mount over the preload list),
each tried as a tenant would, with the real kubelet admitting the pods."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from sharegpu.core import annotations, names

from .nodepods import (
    WORKLOADS,
    create,
    events,
    get_pod,
    gpu_pod,
    node_uuids,
    pod_summary,
    ready,
    report,
    wait,
)
from .realnode import RealNode, RealNodeCluster
from .test_realnode_gpu import set_mode

GPU = names.RES_NVIDIA_GPU
MEM = names.RES_GPU_MEM
PRELOAD = "/etc/ld.so.preload"


@pytest.fixture(scope="module")
def gpu_node(real_release: RealNodeCluster) -> RealNode:
    return real_release.nodes[0]


def settled(cp: Any, name: str) -> dict[str, Any] | None:
    """The pod once it runs or has failed."""
    p = get_pod(cp, WORKLOADS, name)
    if p is None:
        return None
    return p if ready(p) or p.get("status", {}).get("phase") == "Failed" else None


def outcome(cp: Any, node: RealNode, pod: dict[str, Any]) -> str:
    """What the pod got: its container's GPUs, or why it failed."""
    st = pod.get("status", {})
    if st.get("phase") == "Failed":
        return f"Failed: {st.get('reason')}: {st.get('message')}"
    got = report(node, pod, "c0")
    return f"Running on {(got or {}).get('env', {}).get(names.ENV_VISIBLE_DEVICES)}"


def delete(cp: Any, name: str) -> None:
    cp.request("DELETE", f"/api/v1/namespaces/{WORKLOADS}/pods/{name}?gracePeriodSeconds=0")
    wait(f"{name} gone", lambda: get_pod(cp, WORKLOADS, name) is None, 120, every=0.5)


def test_attack4_exclusive_cards_never_serve_two_pods(real_release: RealNodeCluster,
                                                      gpu_node: RealNode) -> None:
    """Issue 40, attack 4, exclusive mode, two cards. Created while the kubelet is down (so
    that the restarted kubelet admits them by creation time): S, a plain ``nvidia.com/gpu: 1``
    pod with ``spec.nodeName`` and no decision, then Y, placed by sharegpu on a card. After S
    ends, Z is placed on the card the extender believes free. No card may ever serve two
    running pods, and a pod with a decision that runs has its decision's card."""
    cluster, cp = real_release, real_release.cp
    set_mode(cluster, gpu_node, "default")
    image = cluster.refs["SHAREGPU_REF"]
    uuids = node_uuids(gpu_node)
    s = gpu_pod("a4-s", [{GPU: 1}], node=gpu_node.name, image=image,
                scheduler="default-scheduler")
    del s["spec"]["nodeSelector"]
    s["spec"]["nodeName"] = gpu_node.name
    try:
        _attack4(cp, gpu_node, s, image, uuids)
    finally:  # the next test wants the node empty, whatever happened here
        for n in ("a4-s", "a4-y", "a4-z"):
            if get_pod(cp, WORKLOADS, n) is not None:
                delete(cp, n)


def _attack4(cp: Any, gpu_node: RealNode, s: dict[str, Any], image: str,
             uuids: list[str]) -> None:
    gpu_node.stop_kubelet()
    try:
        status, body = create(cp, WORKLOADS, s)
        assert status == 201, body
        status, body = create(cp, WORKLOADS, gpu_pod("a4-y", [{GPU: 1}], node=gpu_node.name,
                                                     image=image))
        assert status == 201, body
        wait("a4-y placed by the extender", lambda: (p := get_pod(cp, WORKLOADS, "a4-y"))
             and p["spec"].get("nodeName")
             and annotations.decode(p["metadata"].get("annotations") or {}), 60)
    finally:
        gpu_node.start_kubelet()
    pods = {n: wait(f"{n} Running or Failed", lambda n=n: settled(cp, n), 180)
            for n in ("a4-s", "a4-y")}
    lines = {n: outcome(cp, gpu_node, p) for n, p in pods.items()}
    assert ready(pods["a4-s"]), f"the plain pod must run on the kubelet's card: {lines}"
    delete(cp, "a4-s")
    status, body = create(cp, WORKLOADS, gpu_pod("a4-z", [{GPU: 1}], node=gpu_node.name,
                                                 image=image))
    assert status == 201, body
    pods["a4-z"] = wait("a4-z Running or Failed", lambda: settled(cp, "a4-z"), 180)
    lines["a4-z"] = outcome(cp, gpu_node, pods["a4-z"])
    print("\nattack 4:\n" + "\n".join(f"  {n}: {v}" for n, v in lines.items()), file=sys.stderr)
    print(pod_summary(list(pods.values())), file=sys.stderr)
    holders: dict[str, str] = {}
    running = {n: p for n, p in pods.items() if n != "a4-s" and ready(p)}
    for n, p in running.items():
        got = report(gpu_node, p, "c0")
        assert got is not None, n
        visible = got["env"].get(names.ENV_VISIBLE_DEVICES, "")
        alloc = annotations.decode(p["metadata"].get("annotations") or {})
        assert alloc is not None, n
        want = ",".join(uuids[g] for g in alloc.container_gpus(0))
        assert visible == want, f"{n} runs on {visible}, its decision says {want}"
        for card in visible.split(","):
            assert card not in holders, f"{n} and {holders[card]} both run on {card}"
            holders[card] = n


def _configmap(cp: Any, name: str, data: dict[str, str]) -> None:
    status, body = cp.request("POST", f"/api/v1/namespaces/{WORKLOADS}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data})
    assert status in (201, 409), body


def test_attack5_own_limits_by_envfrom_or_a_preload_mount_are_refused(
        real_release: RealNodeCluster, gpu_node: RealNode) -> None:
    """Issue 40, attack 5, cgpu mode (HAMi-core): a tenant's ConfigMap or Secret holding
    ``CUDA_DEVICE_MEMORY_LIMIT_0`` through ``envFrom`` (with and without a prefix), or a
    ConfigMap mounted over ``/etc/ld.so.preload``, would replace the limit the agent gives. Each
    is refused (at admission by the webhook, or by the agent with the field named: the pod
    fails, UnexpectedAdmissionError); an envFrom whose prefix cannot begin a limit variable runs
    with the agent's limit."""
    cluster, cp = real_release, real_release.cp
    set_mode(cluster, gpu_node, "cgpu")
    image = cluster.refs["SHAREGPU_REF"]
    _configmap(cp, "a5-limits", {"CUDA_DEVICE_MEMORY_LIMIT_0": "15g", "preload": "\n"})
    _configmap(cp, "a5-suffix", {"0": "15g"})
    status, body = cp.request("POST", f"/api/v1/namespaces/{WORKLOADS}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "a5-secret"},
        "stringData": {"CUDA_DEVICE_SM_LIMIT": "100"}})
    assert status in (201, 409), body

    def pod(name: str, **container: Any) -> dict[str, Any]:
        p = gpu_pod(name, [{MEM: 2}], node=gpu_node.name, image=image)
        p["spec"]["containers"][0].update(container)
        return p

    attacks = {
        "a5-envfrom": (pod("a5-envfrom", envFrom=[{"configMapRef": {"name": "a5-limits"}}]),
                       "envFrom[0] (configMapRef a5-limits, no prefix"),
        "a5-prefix": (pod("a5-prefix", envFrom=[{"configMapRef": {"name": "a5-suffix"},
                                                 "prefix": "CUDA_DEVICE_MEMORY_LIMIT_"}]),
                      "envFrom[0] (configMapRef a5-suffix, prefix 'CUDA_DEVICE_MEMORY_LIMIT_'"),
        "a5-secret": (pod("a5-secret", envFrom=[{"secretRef": {"name": "a5-secret"}}]),
                      "envFrom[0] (secretRef a5-secret, no prefix"),
        "a5-mount": (pod("a5-mount", volumeMounts=[{"name": "l", "mountPath": PRELOAD,
                                                    "subPath": "preload"}]),
                     f"volumeMounts[0] at {PRELOAD}"),
    }
    attacks["a5-mount"][0]["spec"]["volumes"] = [{"name": "l",
                                                  "configMap": {"name": "a5-limits"}}]
    lines = {}
    made = []
    for name, (obj, field) in attacks.items():
        status, body = create(cp, WORKLOADS, obj)
        if status != 201:  # refused at admission: it must say why
            lines[name] = f"refused at admission ({status}): {body.get('message')}"
            continue
        made.append(name)
        p = wait(f"{name} Running or Failed", lambda n=name: settled(cp, n), 180)
        lines[name] = outcome(cp, gpu_node, p)
        assert p["status"].get("phase") == "Failed", f"{name}: {lines[name]}"
        assert p["status"].get("reason") == "UnexpectedAdmissionError", lines[name]
        assert field in (p["status"].get("message") or ""), lines[name]
        assert "Rule: a container under isolation gets its limits from the agent alone" in \
            p["status"]["message"]
        assert any(e.get("reason") == "GPUIsolationUnavailable" and field in e.get("message", "")
                   for e in events(cp, WORKLOADS, name)), name
    # the control: a prefix that cannot begin a limit variable
    _configmap(cp, "a5-app", {"MODE": "x"})
    status, body = create(cp, WORKLOADS, pod("a5-ok", envFrom=[
        {"configMapRef": {"name": "a5-app"}, "prefix": "APP_"}]))
    assert status == 201, body
    made.append("a5-ok")
    ok = wait("a5-ok Running", lambda: (p := get_pod(cp, WORKLOADS, "a5-ok")) and ready(p)
              and p, 180)
    got = report(gpu_node, ok, "c0")
    assert got is not None
    assert got["env"].get("CUDA_DEVICE_MEMORY_LIMIT_0") == "2048m", got["env"]
    assert got["env_all"].get("APP_MODE") == "x"
    lines["a5-ok"] = "Running, CUDA_DEVICE_MEMORY_LIMIT_0=2048m"
    print("\nattack 5:\n" + "\n".join(f"  {n}: {v}" for n, v in lines.items()), file=sys.stderr)
    for n in made:
        delete(cp, n)



def latest_report(node: RealNode, pod: dict[str, Any], container: str) -> dict[str, Any] | None:
    """The report of the container's latest start (its newest CRI log file)."""
    import json

    meta = pod["metadata"]
    d = node.host_path(f"/var/log/pods/{meta['namespace']}_{meta['name']}_{meta['uid']}"
                       f"/{container}")
    logs = sorted(d.glob("*.log"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1)
    if not logs:
        return None
    tag = "SHAREGPU-REPORT "
    message = ""
    for line in logs[-1].read_text(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) != 4:
            continue
        message += parts[3]
        if parts[2] == "P":
            continue
        if message.startswith(tag):
            return json.loads(message[len(tag):])
        message = ""
    return None


def test_lost_checkpoint_readmits_the_pod_with_its_own_share(real_release: RealNodeCluster,
                                                              gpu_node: RealNode) -> None:
    """Issue 41, fault 1: a pod placed by sharegpu (restartPolicy Always, 2 GiB) runs and is
    marked assigned; the kubelet is killed, the pod's container killed, the kubelet's device
    checkpoint deleted, the kubelet started. The kubelet admits the pod again and calls
    Allocate; the agent serves the recorded decision: the pod runs again with its own share."""
    from .nodepods import compare

    cluster, cp = real_release, real_release.cp
    set_mode(cluster, gpu_node, "cgpu")
    image = cluster.refs["SHAREGPU_REF"]
    uuids = node_uuids(gpu_node)
    obj = gpu_pod("r41-a", [{MEM: 2}], node=gpu_node.name, image=image)
    obj["spec"]["restartPolicy"] = "Always"
    status, body = create(cp, WORKLOADS, obj)
    assert status == 201, body
    pod = wait("r41-a Running and marked assigned", lambda: (p := get_pod(cp, WORKLOADS, "r41-a"))
               and ready(p) and annotations.is_assigned(p["metadata"].get("annotations") or {})
               and p, 180)
    restarts = pod["status"]["containerStatuses"][0].get("restartCount", 0)
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    gpu_node.stop_kubelet()
    try:
        assert gpu_node.ctr("tasks", "kill", "-s", "SIGKILL", cid) is not None
        checkpoint = gpu_node.host_path(
            "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")
        assert checkpoint.exists()
        checkpoint.unlink()
    finally:
        gpu_node.start_kubelet()

    def back() -> dict[str, Any] | None:
        p = get_pod(cp, WORKLOADS, "r41-a")
        assert p is not None and p["status"].get("phase") != "Failed", (
            f"r41-a failed: {p and p['status'].get('message')}")
        st = (p["status"].get("containerStatuses") or [{}])[0]
        return p if ready(p) and st.get("restartCount", 0) > restarts else None

    pod = wait("r41-a Running again after the lost checkpoint", back, 180)
    got = latest_report(gpu_node, pod, "c0")
    check = compare(pod, 0, got, "cgpu", uuids)
    print(f"\nlost checkpoint: r41-a restarted {pod['status']['containerStatuses'][0]['restartCount']}"
          f" time(s), mismatches {check.mismatches}", file=sys.stderr)
    assert not check.mismatches, check.mismatches
    delete(cp, "r41-a")
