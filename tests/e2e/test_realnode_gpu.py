"""GPU pods on the REAL node (realnode.py) with the chart installed (nodepods.install_release):
their shares in every mode, fail-closed isolation, node-side faults and ``kubectl inspect cgpu``.

- Every mode, one after the other on the node (``ack.node.gpu.schedule``: cgpu, core_mem, share,
  mps, topology, default = exclusive), with single-, multi-container and multi-GPU pods written
  with ACK's pod spec: placed by the chart's kube-scheduler through the extender, admitted by
  the kubelet through the agent's device plugins, started by containerd. Each container reports
  what it received (nodepods.REPORTER) and the test compares it with the pod's decision
  annotations; a table per mode (pods placed, containers started, mismatches) is printed and
  every row must show 0 mismatches. After a kubelet restart a further batch is admitted.
- Node-side faults with pods running: the kubelet restarted, containerd restarted, the agent pod
  killed (its DaemonSet makes a new one): the running pods keep running with what they got, no
  GPU is over-committed, and new pods get the right shares; the times are printed.
- ``kubectl inspect cgpu`` (the project's kubectl plugin) shows the pods placed on the node.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from sharegpu.core import annotations, names

from .nodepods import (
    NAMESPACE,
    WORKLOADS,
    Check,
    compare,
    create,
    events,
    expected_backend,
    get_pod,
    gpu_pod,
    list_pods,
    node_uuids,
    pod_summary,
    ready,
    report,
    wait,
)
from .realnode import RealNode, RealNodeCluster

MEM, CORE = names.RES_GPU_MEM, names.RES_GPU_CORE
COUNT_LABEL = names.POD_LABEL_GPU_COUNT
BATCH = "sharegpu-e2e-batch"

# Per mode: (pod name suffix, per-container limits, pod labels). The node has two 15 GiB T4s.
# The multi-GPU pod comes first (the scheduler takes pods in creation order): binpack then fills
# one GPU before the other, and a pod wanting room on both would find none (refused, rightly).
SHARED = [
    ("multi-gpu", [{MEM: 4}], {COUNT_LABEL: "2"}),
    ("a", [{MEM: 2}], {}), ("b", [{MEM: 3}], {}), ("c", [{MEM: 4}], {}), ("d", [{MEM: 2}], {}),
    ("e", [{MEM: 3}], {}), ("f", [{MEM: 1}], {}),
    ("multi-container", [{MEM: 2}, {MEM: 1}], {}),
]
CORE_MEM = [
    ("a", [{MEM: 2, CORE: 20}], {}), ("b", [{MEM: 3, CORE: 30}], {}),
    ("c", [{MEM: 4, CORE: 40}], {}), ("d", [{MEM: 2, CORE: 10}], {}),
    ("e", [{MEM: 3, CORE: 50}], {}), ("f", [{MEM: 1, CORE: 5}], {}),
    ("multi-container", [{MEM: 2, CORE: 20}, {MEM: 1, CORE: 10}], {}),
]
MODES: dict[str, list[tuple[str, list[dict[str, int]], dict[str, str]]]] = {
    "cgpu": SHARED,
    "core_mem": CORE_MEM,
    "share": SHARED,
    "mps": SHARED,
    "topology": [("one", [{names.RES_TOPOLOGY_GPU: 1}], {}),
                 ("other", [{names.RES_TOPOLOGY_GPU: 1}], {})],
    "default": [("two-gpus", [{names.RES_NVIDIA_GPU: 2}], {})],
}
ADVERTISED = {"cgpu": MEM, "core_mem": CORE, "share": MEM, "mps": MEM,
              "topology": names.RES_TOPOLOGY_GPU, "default": names.RES_NVIDIA_GPU}


class Tally:
    """Rows of the per-mode table."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = {}
        self.checks: list[Check] = []

    def add(self, mode: str, pods: int, started: int, checks: Sequence[Check]) -> None:
        row = self.rows.setdefault(mode, {"pods": 0, "containers": 0, "mismatches": 0})
        row["pods"] += pods
        row["containers"] += started
        row["mismatches"] += sum(1 for c in checks if c.mismatches)
        self.checks += checks

    def table(self) -> str:
        lines = ["| mode | pods placed | containers started | mismatches |",
                 "| --- | --- | --- | --- |"]
        for mode, r in self.rows.items():
            lines.append(f"| {mode} | {r['pods']} | {r['containers']} | {r['mismatches']} |")
        total = {k: sum(r[k] for r in self.rows.values()) for k in ("pods", "containers",
                                                                     "mismatches")}
        lines.append(f"| all | {total['pods']} | {total['containers']} | "
                     f"{total['mismatches']} |")
        return "\n".join(lines)


TALLY = Tally()


def node_obj(cluster: RealNodeCluster, node: RealNode) -> dict[str, Any]:
    status, body = cluster.cp.request("GET", f"/api/v1/nodes/{node.name}")
    assert status == 200, body
    return json.loads(body)


def set_mode(cluster: RealNodeCluster, node: RealNode, mode: str) -> float:
    """Label the node with ``mode``; wait until it advertises the mode's resource."""
    t0 = time.monotonic()
    _patch_node(cluster, node, {"metadata": {"labels": {names.LABEL_SCHEDULE: mode}}})
    want = ADVERTISED[mode]
    # core_mem advertises memory too
    others = set(ADVERTISED.values()) - {want, MEM if want == CORE else want}

    def advertised() -> bool:
        alloc = node_obj(cluster, node)["status"].get("allocatable", {})
        return int(alloc.get(want, "0")) > 0 and all(int(alloc.get(r, "0")) == 0 for r in others)

    wait(f"{node.name} to advertise {want} in mode {mode}", advertised, 120, every=0.5)
    # and its isolation back-end is ready (the agent refuses shared pods until then)
    backend = expected_backend(mode)
    want_msg = (f"isolation back-end {backend} is ready" if backend != "none"
                else f"mode {mode}: no isolation back-end")

    def isolation_ready() -> bool:
        c = _condition(cluster, node)
        return c is not None and c["status"] == "True" and want_msg in c.get("message", "")

    wait(f"{node.name}: GPUIsolationReady for mode {mode} ({want_msg!r})", isolation_ready,
         120, every=0.5)
    return time.monotonic() - t0


def _patch_node(cluster: RealNodeCluster, node: RealNode, patch: Mapping[str, Any]) -> None:
    import urllib.request

    cp = cluster.cp
    req = urllib.request.Request(f"{cp.server}/api/v1/nodes/{node.name}",
                                 data=json.dumps(patch).encode(), method="PATCH")
    req.add_header("Content-Type", "application/merge-patch+json")
    with urllib.request.urlopen(req, context=cp._admin_ssl, timeout=10) as r:
        assert r.status == 200


def run_batch(cluster: RealNodeCluster, node: RealNode, mode: str, prefix: str,
              specs: Sequence[tuple[str, list[dict[str, int]], dict[str, str]]],
              timeout: float = 240) -> list[dict[str, Any]]:
    """Create the pods, wait until every container runs, compare each container's report with
    the pod's decision; add the row to the table. Returns the pods."""
    cp = cluster.cp
    image = cluster.refs["SHAREGPU_REF"]
    made = []
    for suffix, limits, labels in specs:
        name = f"{prefix}-{suffix}"
        status, body = create(cp, WORKLOADS, gpu_pod(name, limits, node=node.name, image=image,
                                                     labels={BATCH: prefix, **labels}))
        assert status == 201, body
        made.append(name)
        if COUNT_LABEL in labels:
            # placed before the others fill one GPU (binpack): then room on both is there
            wait(f"{name} bound", lambda n=name: (p := get_pod(cp, WORKLOADS, n)) and
                 p["spec"].get("nodeName"), 60, every=0.3)

    def all_running() -> list[dict[str, Any]] | None:
        pods = [get_pod(cp, WORKLOADS, n) for n in made]
        if all(p and ready(p) for p in pods):
            return pods  # type: ignore[return-value]
        return None

    try:
        pods = wait(f"the {mode} batch {prefix} to run", all_running, timeout, every=1)
    except BaseException:
        print(pod_summary([p for n in made if (p := get_pod(cp, WORKLOADS, n))]),
              file=sys.stderr)
        for n in made:  # why each of the batch's pods is where it is
            for e in events(cp, WORKLOADS, n):
                print(f"  {n}: {e.get('reason')}: {e.get('message', '')[:400]}", file=sys.stderr)
            p = get_pod(cp, WORKLOADS, n)
            if p is not None and (p.get("status") or {}).get("phase") == "Failed":
                st = p["status"]
                print(f"  {n}: Failed: {st.get('reason')}: {st.get('message')}", file=sys.stderr)
        raise
    uuids = node_uuids(node)
    checks = []
    started = 0
    for p in pods:
        for i, c in enumerate(p["spec"]["containers"]):
            got = report(node, p, c["name"])
            started += got is not None
            checks.append(compare(p, i, got, mode, uuids))
    TALLY.add(mode, len(pods), started, checks)
    bad = [c for c in checks if c.mismatches]
    assert not bad, "\n".join(f"{c.pod}/{c.container}: {c.mismatches}" for c in bad)
    assert_no_overcommit(pods, mode)
    return pods


def assert_no_overcommit(pods: Sequence[Mapping[str, Any]], mode: str) -> None:
    """No GPU holds more than its 15 GiB (shared) or more than one pod (whole GPUs)."""
    per_gpu: dict[int, int] = {}
    holders: dict[int, set[str]] = {}
    for p in pods:
        alloc = annotations.decode(p["metadata"].get("annotations") or {})
        assert alloc is not None, p["metadata"]["name"]
        for g, v in alloc.per_gpu_mem().items():
            per_gpu[g] = per_gpu.get(g, 0) + v
            holders.setdefault(g, set()).add(p["metadata"]["name"])
    if mode in ("topology", "default"):
        assert all(len(h) == 1 for h in holders.values()), holders
    else:
        assert all(v <= 15 for v in per_gpu.values()), per_gpu


def delete_batch(cluster: RealNodeCluster, prefix: str) -> None:
    cp = cluster.cp
    cp.request("DELETE", f"/api/v1/namespaces/{WORKLOADS}/pods?labelSelector={BATCH}%3D{prefix}")
    wait(f"batch {prefix} gone", lambda: not list_pods(cp, WORKLOADS, f"{BATCH}%3D{prefix}"),
         120, every=0.5)


@pytest.fixture(scope="module")
def gpu_node(real_release: RealNodeCluster) -> RealNode:
    return real_release.nodes[0]


@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_pods_start_with_their_shares(real_release: RealNodeCluster, gpu_node: RealNode,
                                          mode: str) -> None:
    took = set_mode(real_release, gpu_node, mode)
    print(f"\nmode {mode}: advertised and isolation ready {took:.1f}s after the label",
          file=sys.stderr)
    prefix = f"m-{mode.replace('_', '-')}"
    t0 = time.monotonic()
    run_batch(real_release, gpu_node, mode, prefix, MODES[mode])
    print(f"mode {mode}: {len(MODES[mode])} pods running and checked in "
          f"{time.monotonic() - t0:.1f}s", file=sys.stderr)
    delete_batch(real_release, prefix)


def test_multi_gpu_pod_with_compute_is_admitted(real_release: RealNodeCluster,
                                                gpu_node: RealNode) -> None:
    """gpu-core.percentage 40 with gpu-count 2: like gpu-mem, the total over the pod's GPUs
    (the kubelet hands it 40 core devices), 20 % on each GPU in the decision."""
    set_mode(real_release, gpu_node, "core_mem")
    try:
        run_batch(real_release, gpu_node, "core_mem", "core-multi-gpu",
                  [("p", [{MEM: 4, CORE: 40}], {COUNT_LABEL: "2"})], timeout=60)
    finally:
        delete_batch(real_release, "core-multi-gpu")


def test_faults_with_pods_running(real_release: RealNodeCluster, gpu_node: RealNode) -> None:
    """kubelet restart, containerd restart, agent pod killed: running pods keep running with
    their shares; a batch admitted after each fault gets the right shares."""
    cluster, cp = real_release, real_release.cp
    set_mode(cluster, gpu_node, "cgpu")
    running = run_batch(cluster, gpu_node, "cgpu", "f-before", SHARED[:4])
    before = {p["metadata"]["name"]: (p["metadata"]["uid"],
                                      [s.get("restartCount", 0) for s in
                                       p["status"]["containerStatuses"]]) for p in running}
    times: dict[str, float] = {}

    def still_running() -> None:
        for name, (uid, restarts) in before.items():
            p = get_pod(cp, WORKLOADS, name)
            assert p is not None and p["metadata"]["uid"] == uid, f"{name} lost"
            assert ready(p), f"{name} not running after the fault:\n{pod_summary([p])}"
            assert [s.get("restartCount", 0) for s in p["status"]["containerStatuses"]] == \
                restarts, f"{name} restarted"

    def gpu_pod_admitted(tag: str) -> float:
        t0 = time.monotonic()
        run_batch(cluster, gpu_node, "cgpu", f"f-{tag}", [SHARED[1], SHARED[7]])
        return time.monotonic() - t0

    # the kubelet restarted: the agent's plugins register again with the new kubelet
    started = time.time()
    times["kubelet restart -> Node Ready"] = gpu_node.restart_kubelet()
    times["kubelet restart -> device plugins registered again"] = wait(
        "the agent's device plugins to register with the new kubelet",
        lambda: (t := gpu_node.plugin_registered_after(started)) and t - started, 120)
    wait("the kubelet to have synced its pods from the API server",
         lambda: gpu_node.api_synced_after(started), 120)
    times["kubelet restart -> new GPU pods running"] = gpu_pod_admitted("kubelet")
    still_running()
    # containerd restarted: shims and containers live on
    times["containerd restart -> CRI answers"] = gpu_node.restart_containerd()
    times["containerd restart -> new GPU pods running"] = gpu_pod_admitted("containerd")
    still_running()
    # the agent pod killed: its DaemonSet makes a new one
    (agent,) = [p for p in list_pods(cp, NAMESPACE, "app.kubernetes.io/component%3Dagent")]
    t0, killed_at = time.monotonic(), time.time()
    status, _ = cp.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/"
                                     f"{agent['metadata']['name']}?gracePeriodSeconds=0")
    assert status == 200

    def new_agent_ready() -> bool:
        pods = list_pods(cp, NAMESPACE, "app.kubernetes.io/component%3Dagent")
        return any(p["metadata"]["uid"] != agent["metadata"]["uid"] and ready(p) for p in pods)

    wait("a new agent pod Ready", new_agent_ready, 180, every=0.5)
    times["agent pod killed -> new agent Ready"] = time.monotonic() - t0
    # the agent pod is Ready before the kubelet has its plugins' devices again; a GPU pod the
    # kubelet admits in between is rejected by the kubelet ("no healthy devices present"):
    # wait until the kubelet has the new agent's GPU memory devices
    wait("the kubelet to have the new agent's GPU memory devices",
         lambda: gpu_node.plugin_registered_after(killed_at, MEM), 120)
    times["agent pod killed -> devices with the kubelet again"] = time.monotonic() - t0
    times["agent pod killed -> new GPU pods running"] = gpu_pod_admitted("agent")
    still_running()
    all_pods = list_pods(cp, WORKLOADS)
    assert_no_overcommit([p for p in all_pods if ready(p)], "cgpu")
    print("\n" + "\n".join(f"{k}: {v:.1f}s" for k, v in times.items()), file=sys.stderr)
    for prefix in ("f-before", "f-kubelet", "f-containerd", "f-agent"):
        delete_batch(cluster, prefix)


def test_mode_changed_by_label_while_pods_run(real_release: RealNodeCluster,
                                             gpu_node: RealNode) -> None:
    """The node's mode changed by label (cgpu -> share) with cgpu pods running: they keep
    running (same pods, no restart), the node advertises the new mode, pods of the new mode
    start with its shares beside them, and no GPU holds more than it has."""
    cluster, cp = real_release, real_release.cp
    set_mode(cluster, gpu_node, "cgpu")
    running = run_batch(cluster, gpu_node, "cgpu", "mc-cgpu", SHARED[1:4])
    before = {p["metadata"]["name"]: (p["metadata"]["uid"],
                                      [s.get("restartCount", 0) for s in
                                       p["status"]["containerStatuses"]]) for p in running}
    took = set_mode(cluster, gpu_node, "share")
    t0 = time.monotonic()
    run_batch(cluster, gpu_node, "share", "mc-share", SHARED[4:7])
    after = time.monotonic() - t0
    for name, (uid, restarts) in before.items():
        p = get_pod(cp, WORKLOADS, name)
        assert p is not None and p["metadata"]["uid"] == uid, f"{name} lost"
        assert ready(p), f"{name} not running after the mode change:\n{pod_summary([p])}"
        assert [s.get("restartCount", 0) for s in p["status"]["containerStatuses"]] == \
            restarts, f"{name} restarted"
    assert_no_overcommit([p for p in list_pods(cp, WORKLOADS) if ready(p)], "share")
    print(f"\ncgpu -> share with {len(before)} pods running: advertised and ready {took:.1f}s "
          f"after the label, the new mode's pods running {after:.1f}s later", file=sys.stderr)
    for prefix in ("mc-cgpu", "mc-share"):
        delete_batch(cluster, prefix)
    set_mode(cluster, gpu_node, "cgpu")


def test_look_alike_pods_start_together_named_by_the_kubelet(real_release: RealNodeCluster,
                                                             gpu_node: RealNode) -> None:
    """The agent names each pod through the real kubelet's pod-resources API, so the node
    carries the promise and eight pods of one shape, filling one GPU and spilling onto the
    other (look-alike pods on different GPUs), are bound without waiting for each other and
    start with their own shares."""
    set_mode(real_release, gpu_node, "cgpu")
    cp = real_release.cp
    def promised() -> dict[str, Any] | None:
        n = node_obj(real_release, gpu_node)
        ann = n["metadata"].get("annotations") or {}
        return n if ann.get(names.ANN_NODE_POD_RESOURCES) == "v1" else None

    node = wait("the node's promise to name pods", promised, 120, every=1)
    assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("v1.37")
    pods = run_batch(real_release, gpu_node, "cgpu", "look-alike",
                     [(f"p{i}", [{MEM: 3}], {}) for i in range(8)])
    gpus = {annotations.decode(p["metadata"]["annotations"]).gpus for p in pods}  # type: ignore[union-attr]
    assert len(gpus) == 2, gpus  # the same request on two GPUs: not twins
    for p in pods:
        waits = [e for e in events(cp, WORKLOADS, p["metadata"]["name"])
                 if "starting pod" in (e.get("message") or "")]
        assert not waits, waits
    delete_batch(real_release, "look-alike")


def test_batch_after_kubelet_restart_and_table(real_release: RealNodeCluster,
                                               gpu_node: RealNode) -> None:
    """A batch admitted after a kubelet restart; then the whole table: >= 50 pods, 0
    mismatches."""
    set_mode(real_release, gpu_node, "cgpu")
    started = time.time()
    gpu_node.restart_kubelet()
    # pods the kubelet admits before it has the agent's devices again, or before it has
    # synced its pods from the API server (until then it still counts the devices of pods
    # deleted just before the restart), are refused by the kubelet itself ("requested number
    # of devices unavailable"): wait until it has both
    wait("the kubelet to have the agent's GPU memory devices again",
         lambda: gpu_node.plugin_registered_after(started, MEM), 120)
    wait("the kubelet to have synced its pods from the API server",
         lambda: gpu_node.api_synced_after(started), 120)
    run_batch(real_release, gpu_node, "cgpu", "after-restart", SHARED)
    delete_batch(real_release, "after-restart")
    print("\n" + TALLY.table(), file=sys.stderr)
    total = sum(r["pods"] for r in TALLY.rows.values())
    assert total >= 50, TALLY.table()
    assert all(r["mismatches"] == 0 for r in TALLY.rows.values()), TALLY.table()


def test_kubectl_inspect_cgpu_shows_the_pods_on_the_real_node(
        real_release: RealNodeCluster, gpu_node: RealNode) -> None:
    set_mode(real_release, gpu_node, "cgpu")
    pods = run_batch(real_release, gpu_node, "cgpu", "inspect", SHARED[1:4])
    kubectl = (Path(__file__).resolve().parents[2] / ".tools" / "bin" / "kubectl")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
           "KUBECONFIG": str(real_release.cp.admin_kubeconfig), "HOME": "/tmp"}
    r = subprocess.run([str(kubectl) if kubectl.exists() else "kubectl", "inspect", "cgpu",
                        "-d"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    print("\n" + r.stdout, file=sys.stderr)
    assert gpu_node.name in r.stdout
    for p in pods:
        assert p["metadata"]["name"] in r.stdout, r.stdout
    delete_batch(real_release, "inspect")


def _condition(cluster: RealNodeCluster, node: RealNode) -> dict[str, Any] | None:
    conds = node_obj(cluster, node)["status"].get("conditions") or []
    return next((c for c in conds if c["type"] == names.CONDITION_ISOLATION), None)


def test_fail_closed_without_the_library_then_starts_once_it_is_there(
        real_release: RealNodeCluster, gpu_node: RealNode) -> None:
    """The chart without its HAMi install (agent.hami.install=false: the agent looks for
    hamiLibrary, /usr/local/vgpu/libvgpu.so, which the node lacks): a shared pod is refused with
    the agent's message as an Event, the node's GPUIsolationReady is False; once the library is
    put there, the condition turns True and a new pod starts isolated. The release is put back
    as installed afterwards."""
    from .components import CHART, helm

    cluster, cp = real_release, real_release.cp
    set_mode(cluster, gpu_node, "cgpu")
    helm(cp, "upgrade", "sharegpu", str(CHART), "-n", NAMESPACE, "--set",
         "agent.hami.install=false", timeout=300)
    try:
        wait("the agent without the library to report GPUIsolationReady False",
             lambda: (c := _condition(cluster, gpu_node)) and c["status"] == "False" and c,
             180, every=1)
        cond = _condition(cluster, gpu_node)
        assert cond is not None
        print(f"\nGPUIsolationReady False: {cond['message']}", file=sys.stderr)
        status, body = create(cp, WORKLOADS, gpu_pod("no-lib", [{MEM: 2}], node=gpu_node.name,
                                                     image=cluster.refs["SHAREGPU_REF"]))
        assert status == 201, body

        def refused() -> dict[str, Any] | None:
            # the agent refuses at Allocate (its Event), or, having withdrawn the node's isolated
            # resources, nothing places the pod (Pending, the scheduler's and extender's Events)
            p = get_pod(cp, WORKLOADS, "no-lib")
            evs = [e for e in events_of(cp, "no-lib") if e.get("reason") in (
                "GPUIsolationUnavailable", "GPUSharingUnschedulable", "FailedScheduling",
                "UnexpectedAdmissionError")]
            return {"pod": p, "event": evs[0]} if p and evs else None

        got = wait("the pod's refusal", refused, 120, every=1)
        time.sleep(5)
        pod, event = get_pod(cp, WORKLOADS, "no-lib"), got["event"]
        print(f"event {event['reason']}: {event['message']}", file=sys.stderr)
        print(pod_summary([pod]), file=sys.stderr)
        assert not any("running" in (s.get("state") or {})
                       for s in pod["status"].get("containerStatuses") or []), pod_summary([pod])
        if event["reason"] == "GPUIsolationUnavailable":
            assert "the HAMi-core library /usr/local/vgpu/libvgpu.so does not exist" in \
                event["message"], event["message"]
        else:
            # withheld: the agent marks its devices unhealthy while the back-end is unusable, so
            # the node offers no GPU memory and the kubelet refuses the pod
            alloc = node_obj(cluster, gpu_node)["status"].get("allocatable", {})
            assert int(alloc.get(MEM, "0")) == 0, alloc
            if event["reason"] == "UnexpectedAdmissionError":
                assert "no healthy devices present" in event["message"], event["message"]
        # the library arrives where the chart says it is
        installed = gpu_node.host_path("/usr/local/vgpu/sharegpu/installed")
        lib = gpu_node.host_path(installed.read_text().strip())
        target = gpu_node.host_path("/usr/local/vgpu/libvgpu.so")
        target.write_bytes(lib.read_bytes())
        target.chmod(0o755)
        t0 = time.monotonic()
        wait("GPUIsolationReady True once the library is there",
             lambda: (c := _condition(cluster, gpu_node)) and c["status"] == "True", 120, every=1)
        print(f"GPUIsolationReady True {time.monotonic() - t0:.1f}s after the library arrived",
              file=sys.stderr)
        run_batch(cluster, gpu_node, "cgpu", "lib-back", [SHARED[1]])
        delete_batch(cluster, "lib-back")
        cp.request("DELETE", f"/api/v1/namespaces/{WORKLOADS}/pods/no-lib")
        target.unlink()
    finally:
        # without values helm upgrade would reuse the last ones (agent.hami.install=false)
        helm(cp, "upgrade", "sharegpu", str(CHART), "-n", NAMESPACE, "--reset-values",
             timeout=300)
        wait("the release Ready again", lambda: all(ready(p) for p in list_pods(cp, NAMESPACE))
             and len(list_pods(cp, NAMESPACE)) == 7, 240, every=1)


def events_of(cp: Any, pod: str) -> list[dict[str, Any]]:
    return events(cp, WORKLOADS, pod)
