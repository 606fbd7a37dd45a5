"""The kubelet's own device manager allocates for bound pods through sharegpu's agent.

On the real API server: a GPU node, 50 pods bound to it with the extender's decisions (mixed
shapes: one container, several containers on different GPUs, two GPUs; memory and compute on a
``core_mem`` node), the agent (``sharegpu agent --nvml fake``, HAMi-core isolation with a
stand-in library so the fail-closed check passes) serving its device plugins in a directory, and
``sharegpu-controlplane kubelet-devicemanager`` (e2e/controlplane/devicemanager.go):
k8s.io/kubernetes v1.37.2 ``pkg/kubelet/cm/devicemanager`` registering the agent over the real
``kubelet.sock``, fed by the kubelet's own pod source and admitting pods as ``HandlePodAdditions``
does (topology-manager Admit → device manager Allocate → GetPreferredAllocation and Allocate over
gRPC), then starting every pod at once (GetDeviceRunContainerOptions).

Every container must get its own pod's GPUs and limits (its environment, the plugin devices the
kubelet took, each resource's answer, the pod container the agent says it served — or its twin's,
identical in all of these, see sharegpu.core.startingpods) and every pod must end up marked
assigned.

- bound while the kubelet runs: the 50 pods are bound as fast as the API server takes them while
  the device manager watches; it admits them as its pod source delivers them (bind order).
- bound before the kubelet starts: the 50 pods reach it as ONE batch (a kubelet restart, a
  relist), which the kubelet admits by creationTimestamp (1 s resolution; ties in its pod
  source's map order). The agent cannot know that order; the extender's binder lets pods be
  starting together on a node only where the agent cannot get them wrong
  (sharegpu.core.startingpods), and the 50 pods are placed so.
- the kubelet's pod-resources API: the device manager also serves it (upstream's v1 server on its
  pod manager and device manager); read all along the batch's admission, no answer shows more
  than one pod still waiting for its devices, and once the pods are admitted it lists each
  admitted pod's containers with the very devices the device manager gave them, and not the pod
  it rejected.
- look-alike pods on different GPUs in one batch (placed without the starting-pods rule): the
  agent, given the pod-resources socket, promises to name pods (the node's
  ``sharegpu.io/pod-resources``) and names the pod of every call, so every container gets its own
  pod's GPUs; the same batch without the socket (the control) does not all start right.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod, ServiceAccount

from sharegpu.core import names
from sharegpu.core.annotations import Allocation, decode, is_assigned
from sharegpu.core.request import parse_pod
from sharegpu.core.startingpods import StartingPods

from .components import SharegpuProcess, create_node_object, free_port, node_object, wait_for
from .controlplane import ControlPlane
from .devicemanager_play import (
    DeviceManagerRun,
    PodResourcesPoller,
    device_requests,
    fake_gpus,
    list_pod_resources,
    mismatches,
    place,
    pod_object,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from agent_helpers import standin_library

GPUS = ",".join(["Tesla-T4:15"] * 4 + ["Tesla-V100-SXM2-32GB:32"] * 4)
N_PODS = 50
KUBELET_VERSION = "v1.37.2"  # k8s.io/kubernetes of e2e/controlplane (its device manager)




@pytest.fixture
def namespace(admin: Client) -> Iterator[str]:
    name = f"dm-{uuid.uuid4().hex[:8]}"
    admin.create(Namespace(metadata=ObjectMeta(name=name)))
    wait_for(f"ServiceAccount {name}/default",
          lambda: any(True for _ in admin.list(ServiceAccount, namespace=name)))
    yield name
    admin.delete(Namespace, name)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sg-dm-"))  # unix socket paths stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(cp: ControlPlane, binary: Path, admin: Client, namespace: str, d: Path, *, mode: str,
         seed: int, kubelet_first: bool, starting_rule: bool = True,
         pod_resources: str = "", may_reject: bool = False,
         may_mismatch: bool = False) -> dict[str, Any]:
    """One run; returns what it saw (rejected pods, look-alike pairs).

    ``starting_rule``: in one batch, the pods are placed only as the extender's binder lets
    them through together while none has started (sharegpu.core.startingpods); without it, as
    a bin-packing scheduler could place them, look-alike pods on different GPUs included.

    ``pod_resources`` (one batch only), the device manager serving the kubelet's pod-resources
    API, read all along (:class:`PodResourcesPoller`, another client of the API as a monitoring
    agent would be) with never more than one pod waiting for its devices: ``"checked"``: read
    after the report too, and one more pod, asking for more GPU memory than the node has, is
    bound with the others and rejected; ``"agent"``: the agent is given the socket and must name
    the pod of each call (the node then carries its promise, ``names.ANN_NODE_POD_RESOURCES``).

    Every admitted container must get its own pod's decision unless ``may_mismatch``; every pod
    must be admitted unless ``may_reject``."""
    assert pod_resources in ("", "checked", "agent")
    assert not (pod_resources and kubelet_first)
    node_obj = node_object(f"gpu-dm-{uuid.uuid4().hex[:6]}", labels={names.LABEL_SCHEDULE: mode})
    # the kubelet whose device manager runs here (the agent reads it before it promises to
    # name pods: from 1.34 the pod-resources List shows active pods only)
    node_obj["status"]["nodeInfo"] = {
        "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": "", "architecture": "amd64",
        "operatingSystem": "linux", "osImage": "", "kernelVersion": "", "bootID": "",
        "machineID": "", "systemUUID": "", "containerRuntimeVersion": ""}
    node = create_node_object(admin, node_obj)
    gpus = fake_gpus(GPUS)
    capacity = {g.index: g.gib for g in gpus}
    # bound while the kubelet is down: only pods the extender's binder lets through together,
    # those the kubelet can tell apart or twins (sharegpu.core.startingpods) — unless the node
    # names pods to the kubelet
    shapes = place(N_PODS, gpus, seed=seed, core=(mode == "core_mem"),
                   starting=None if kubelet_first or not starting_rule else StartingPods())
    kinds: dict[str, int] = {}
    for kind, *_ in shapes:
        kinds[kind] = kinds.get(kind, 0) + 1
    pods: dict[str, dict[str, Any]] = {}
    too_big = None  # the pod the device manager must reject
    if pod_resources == "checked":
        too_big = pod_object("too-big", namespace, node, [{"mem": 10 * sum(capacity.values())}],
                             Allocation(mem={}), 0)
        del too_big["metadata"]["annotations"]  # no decision: the agent is never asked

    def bind_all() -> float:
        t0 = time.monotonic()
        if too_big is not None:
            admin.create(Pod.from_dict(too_big))
        for i, (_, reqs, alloc, count) in enumerate(shapes):
            # the extender's bind: decision and assume-time recorded, then bound (nodeName set at
            # creation); one pod after another, so assume-times follow the bind order
            obj = pod_object(f"p{i:02d}", namespace, node, reqs, alloc, time.time_ns(),
                             gpu_count=count, capacity=capacity)
            pods[f"{namespace}/{obj['metadata']['name']}"] = admin.create(
                Pod.from_dict(obj)).to_dict()
        return time.monotonic() - t0

    sock = d / "pod-resources.sock" if pod_resources else None
    lib = standin_library()
    metrics_port = free_port()
    agent = SharegpuProcess(cp, f"agent-{node}", [
        "agent", f"--node-name={node}", f"--kubeconfig={cp.admin_kubeconfig}", "--nvml=fake",
        f"--fake-gpus={GPUS}", f"--device-plugin-dir={d / 'dp'}", f"--state-dir={d / 'state'}",
        "--isolation=hami", f"--hami-library={lib}", f"--metrics-listen=127.0.0.1:{metrics_port}",
    ] + ([f"--pod-resources-socket={sock}"] if pod_resources == "agent" else []))
    resources = [names.RES_GPU_MEM] + ([names.RES_GPU_CORE] if mode == "core_mem" else [])
    n_pods = N_PODS + (too_big is not None)
    dm = DeviceManagerRun(
        binary, node=node, plugin_dir=d / "dp", expect_pods=n_pods, wait_resources=resources,
        # the kubelet's identity: the Node authorizer and system:node let it watch its pods
        kubeconfig=cp.kubeconfig_for(f"system:node:{node}", ["system:nodes"]),
        output=cp.workdir / f"kubelet-devicemanager-{node}.json",
        log=cp.workdir / f"kubelet-devicemanager-{node}.log",
        pod_resources_socket=sock, linger=300 if pod_resources == "checked" else 0)
    poller = None
    promise = None
    try:
        if not kubelet_first:
            bind_s = bind_all()
        if pod_resources == "agent":
            # the kubelet (re)starts first, as after a node reboot: its pod-resources API answers
            # when the agent starts, so the agent promises to name pods
            dm.start()
            wait_for("the pod-resources socket", lambda: sock is not None and sock.exists(),
                     timeout=30)
        agent.start()
        agent.wait_until(lambda: (d / "dp" / "sharegpu-gpu-mem.sock").exists(),
                         "its device-plugin sockets")
        if pod_resources:
            requests = {ref: device_requests(p) for ref, p in pods.items()}
            if too_big is not None:
                requests[f"{namespace}/too-big"] = device_requests(too_big)
            poller = PodResourcesPoller(sock, requests).start()
        if pod_resources != "agent":
            dm.start()
        dm.wait_ready()
        if kubelet_first:
            bind_s = bind_all()
        if pod_resources == "checked":
            assert poller is not None and sock is not None
            dm.wait_report()
            poller.stop()
            listing = list_pod_resources(sock)
            dm.end_linger()
        report, wall = dm.finish()
        if poller is not None:
            poller.stop()
        assert agent.alive(), agent.log_tail()
        metrics = _metrics(metrics_port)
        if pod_resources != "agent":  # published at the agent's start
            promise = (admin.get(Node, node).metadata.annotations or {}).get(
                names.ANN_NODE_POD_RESOURCES)
        else:
            promise = wait_for("the node's promise to name pods", lambda: (
                admin.get(Node, node).metadata.annotations or {}).get(
                    names.ANN_NODE_POD_RESOURCES), timeout=30)
    finally:
        if poller is not None:
            poller.stop()
        dm.stop()
        agent.stop()

    containers = sum(len(p["spec"]["containers"]) for p in pods.values())
    if pod_resources == "agent":
        # the kubelet's pod-resources server refuses calls beyond 100 per second (burst 10)
        unanswered = agent.log.read_text(errors="replace").count(
            "the kubelet's pod-resources API did not answer")
        print(f"\nthe agent's pod-resources List calls not answered: {unanswered}",
              file=sys.stderr)
    secs = report["seconds"]
    batches = [len(b) for b in report["batches"]]
    rejected = sorted(f"{p['namespace']}/{p['name']}" for p in report["pods"]
                      if not p["admitted"] and f"{p['namespace']}/{p['name']}" in pods)
    look_alikes = _look_alike_pods(pods)
    print(f"\n{mode}, {'bound while the kubelet runs' if kubelet_first else 'one batch'}"
          f"{'' if starting_rule else ', placed without the starting-pods rule'}"
          f"{', the agent naming pods' if pod_resources == 'agent' else ''}: "
          f"{N_PODS} pods {kinds} ({look_alikes} with an earlier look-alike placed differently), "
          f"{containers} containers, bound in {bind_s:.2f}s; "
          f"ADD batches {batches if len(batches) < 8 else f'{len(batches)} (max {max(batches)})'};"
          f" device manager {wall:.1f}s wall, admission {secs['admission']:.2f}s "
          f"(max {max(p['admit_ms'] for p in report['pods']):.0f} ms/pod), first pod to last "
          f"started {secs['first_pod_to_last_started']:.2f}s; capacity {report['capacity']}; "
          f"{len(rejected)} pods rejected", file=sys.stderr)
    assert report["capacity"][names.RES_GPU_MEM] == sum(g.gib for g in gpus)
    assert len(report["pods"]) == n_pods
    if poller is not None:
        print(f"{mode}: pod-resources List read {poller.lists} times during the run "
              f"({poller.with_pending} showing one pod waiting for its devices, "
              f"{poller.refused} refused), {len(poller.violations)} showing several",
              file=sys.stderr)
        assert poller.lists > 0
        assert poller.violations == [], poller.violations[:5]
    if pod_resources == "checked":
        assert poller is not None
        _check_pod_resources(report, listing, f"{namespace}/too-big")
    assert promise == ("v1" if pod_resources == "agent" else None)
    assert metrics["sharegpu_agent_pod_resources_promised"] == (1 if pod_resources == "agent" else 0)
    if pod_resources == "agent":
        # every GetPreferredAllocation and Allocate call named its pod
        calls = (dm.count("Issuing a GetPreferredAllocation call")
                 + dm.count("Making allocation request for device plugin"))
        assert metrics["sharegpu_agent_pod_resources_named_total"] == calls > 0
    if not kubelet_first:
        assert batches == [n_pods]
    assert sum(len(p["containers"]) for p in report["pods"] if p["admitted"]) == sum(
        len(pods[f"{p['namespace']}/{p['name']}"]["spec"]["containers"])
        for p in report["pods"] if p["admitted"] and f"{p['namespace']}/{p['name']}" in pods)
    # the kubelet's code asked the plugin where to allocate before each Allocate
    allocations = containers * len(resources)
    if not rejected:
        assert dm.count("Issuing a GetPreferredAllocation call") == allocations
        assert dm.count("Making allocation request for device plugin") == allocations
    bad = mismatches(report, pods, gpus, lib)
    refused = [line for line in bad if ": not admitted: " in line]
    wrong_lines = [line for line in bad if ": not admitted: " not in line]
    wrong = {line.split(": ", 1)[0] for line in wrong_lines}
    wrong_gpu = {line.split(": ", 1)[0] for line in wrong_lines if "devices on GPUs" in line}
    print(f"{mode}: {len(wrong_lines)} mismatches: {len(wrong)} of {containers} containers "
          f"differ from their own pod's decision, {len(wrong_gpu)} got other GPUs; "
          f"{len(refused)} pods not admitted", file=sys.stderr)
    for line in refused[:5]:
        print(f"  {line}", file=sys.stderr)
    if not may_mismatch:
        assert wrong_lines == [], (f"{len(wrong_lines)} mismatches:\n"
                                   + "\n".join(wrong_lines[:40]))
    if not may_reject:
        assert refused == [], "\n".join(refused[:40])

    def all_assigned() -> bool:
        got = {f"{namespace}/{p.metadata.name}" for p in admin.list(Pod, namespace=namespace)
               if is_assigned(p.metadata.annotations or {})}
        return got >= set(pods) - set(rejected)

    wait_for("every admitted pod marked assigned", all_assigned, timeout=30)
    return {"rejected": rejected, "look_alikes": look_alikes, "promise": promise,
            "wrong": sorted(wrong), "wrong_gpu": sorted(wrong_gpu)}


def _metrics(port: int) -> dict[str, float]:
    """The agent's /metrics samples without labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            out[name] = float(value)
    return out


def _look_alike_pods(pods: dict[str, dict[str, Any]]) -> int:
    """How many of the pods (in bind order) have a look-alike bound before them that is placed
    differently (the same first kubelet request, another grant): what the starting-pods rule
    keeps from starting together on a node, StartingPods.conflict (sharegpu.core.startingpods)."""
    starting = StartingPods()
    found = 0
    for pod in pods.values():
        req = parse_pod(pod)
        alloc = decode(pod["metadata"]["annotations"])
        assert alloc is not None
        node = pod["spec"]["nodeName"]
        found += starting.conflict(node, req, alloc) is not None
        starting.add(req.key, node, req, alloc)
    return found


def _check_pod_resources(report: dict[str, Any], listing: dict[str, Any], rejected: str) -> None:
    """The pod-resources API after the admission against the device manager's report: the
    same pods (the admitted ones), each container with the plugin device IDs the device manager
    gave it."""
    by_ref = {f"{p['namespace']}/{p['name']}": p for p in report["pods"]}
    assert not by_ref[rejected]["admitted"], by_ref[rejected]
    assert "requested number of devices unavailable" in by_ref[rejected]["message"]
    admitted = {ref: {c["name"]: c["device_ids"] for c in p["containers"]}
                for ref, p in by_ref.items() if p["admitted"]}
    assert len(admitted) == N_PODS
    assert all(ids for cs in admitted.values() for ids in cs.values())
    assert listing == admitted


@pytest.mark.parametrize(("mode", "seed"), [("cgpu", 7), ("core_mem", 11)])
def test_50_pods_bound_while_the_kubelet_runs(controlplane: ControlPlane,
                                              controlplane_binary: Path, admin: Client,
                                              namespace: str, short_dir: Path, mode: str,
                                              seed: int) -> None:
    _run(controlplane, controlplane_binary, admin, namespace, short_dir, mode=mode, seed=seed,
         kubelet_first=True)


def test_50_pods_in_one_batch_as_after_a_kubelet_restart(controlplane: ControlPlane,
                                                         controlplane_binary: Path,
                                                         admin: Client, namespace: str,
                                                         short_dir: Path) -> None:
    _run(controlplane, controlplane_binary, admin, namespace, short_dir, mode="cgpu", seed=10,
         kubelet_first=False)


def test_pod_resources_api_lists_what_the_device_manager_gave(controlplane: ControlPlane,
                                                              controlplane_binary: Path,
                                                              admin: Client, namespace: str,
                                                              short_dir: Path) -> None:
    _run(controlplane, controlplane_binary, admin, namespace, short_dir, mode="cgpu", seed=10,
         kubelet_first=False, pod_resources="checked")


@pytest.mark.parametrize(("mode", "seed"), [("cgpu", 10), ("core_mem", 11)])
def test_50_look_alike_pods_on_different_gpus_in_one_batch(controlplane: ControlPlane,
                                                           controlplane_binary: Path,
                                                           admin: Client, namespace: str,
                                                           short_dir: Path, mode: str,
                                                           seed: int) -> None:
    seen = _run(controlplane, controlplane_binary, admin, namespace, short_dir, mode=mode,
                seed=seed, kubelet_first=False, starting_rule=False, pod_resources="agent")
    assert seen["look_alikes"] >= 10, seen


def test_50_look_alike_pods_in_one_batch_need_the_pod_resources_api(controlplane: ControlPlane,
                                                                    controlplane_binary: Path,
                                                                    admin: Client,
                                                                    namespace: str,
                                                                    short_dir: Path) -> None:
    """The control: the same batch, the agent not given the socket. The node then makes no
    promise, and the agent, matching by assume-time, cannot get the kubelet's order of
    look-alike pods right: not every container starts on its own pod's GPUs (or, refused, not
    every pod starts). This is why the extender keeps look-alike pods apart on such a node."""
    seen = _run(controlplane, controlplane_binary, admin, namespace, short_dir, mode="cgpu",
                seed=10, kubelet_first=False, starting_rule=False, may_reject=True,
                may_mismatch=True)
    assert seen["look_alikes"] >= 10, seen
    assert seen["promise"] is None
    assert seen["wrong"] or seen["rejected"], seen
