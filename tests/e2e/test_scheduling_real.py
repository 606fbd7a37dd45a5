"""sharegpu's node agent and scheduler extender against the REAL control plane.

1. ``test_agent_registers_the_node``: ``sharegpu agent`` (fake NVML, the chart's agent
   ServiceAccount and RBAC) with the test kubelet playing the kubelet's part (kubelet_play.py):
   card-model labels, ``sharegpu.io/gpu-mem``, the resources advertised per mode as the node's
   capacity/allocatable, live mode switches through the label ``ack.node.gpu.schedule``, the
   remembered mode when the label goes, and an Allocate for a pod bound to the node (the agent
   finds it through the API and marks it assigned).
2. ``test_real_kube_scheduler_places_gpu_pods``: the real kube-scheduler, run with the
   KubeSchedulerConfiguration the chart renders (only urlPrefix's host and port changed: https,
   the chart's CA as caData and the Service's name as serverName stay, so kube-scheduler
   verifies the extender's certificate) and the chart's
   scheduler ServiceAccount, calls ``sharegpu extender`` over TLS (the chart's arguments and
   certificate, its
   ServiceAccount, leader election on the chart's Lease) for ~100 pods of every kind on 15 nodes
   of every mode. Everything is checked from the API objects: annotations and bindings (SPEC §3),
   no over-commit, ``kubectl inspect cgpu``'s model agreeing with the pods, the GPU choice inside
   binpack/spread/topology nodes, and every pod left Pending carrying kube-scheduler's
   FailedScheduling Event with the extender's reason (no ``%!`` in any Event).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import Client
from lightkube.resources.core_v1 import Event, Node, Pod

from sharegpu.core import names
from sharegpu.core.annotations import Allocation, decode, encode, first_generation_holds
from sharegpu.core.errors import ValidationError
from sharegpu.core.modes import Mode, advertised_resources
from sharegpu.core.nodes import spec_from_node
from sharegpu.core.placement.gpus import assign, node_strategy, request_strategy
from sharegpu.core.request import Kind, parse_pod
from sharegpu.core.state import ClusterState
from sharegpu.extender.events import REASON_INVALID, REASON_UNSCHEDULABLE
from sharegpu.extender.view import ClusterView
from sharegpu.inspect_cgpu import model as inspect_model
from sharegpu.inspect_cgpu import render as inspect_render

from .components import ROOT, SharegpuProcess, create_node, free_port
from .controlplane import ControlPlane
from .kubelet_play import KubeletPlay
from .realcluster import (
    RUN_LABEL,
    ChartRbac,
    LocalExtender,
    PodWatch,
    Report,
    StandInKubelets,
    cleanup,
    gpu_node,
    gpu_pod,
    make_namespace,
    metric,
    node_dicts,
    pod_dicts,
    render_chart,
    sa_client,
    scheduler_config_for,
    set_node_label,
    start_extender,
    wait_allowed,
    wait_for,
)

if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))
from scheduler_driver import over_commits

RELEASE = "sg-sched"
MANAGED = (names.RES_GPU_MEM, names.RES_GPU_CORE, names.RES_TOPOLOGY_GPU, names.RES_NVIDIA_GPU)


@pytest.fixture(scope="module")
def chart(admin: Client) -> Iterator[dict[str, Any]]:
    """A namespace, the chart rendered for it and the chart's RBAC of every component."""
    ns = make_namespace(admin, "sg-sched")
    docs = render_chart(RELEASE, ns)
    rbac = ChartRbac(admin, docs, RELEASE)
    try:
        sas = {c: rbac.apply(c) for c in ("agent", "extender", "scheduler")}
        yield {"namespace": ns, "docs": docs, "sa": sas}
    finally:
        rbac.delete()
        cleanup(admin, ns)


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Iterator[Report]:
    r = Report()
    yield r
    r.flush(capsys)


# ---------------------------------------------------------------------------------------------
# 3. the agent registers its node through the real API server

FAKE_GPUS = "Tesla-T4:15,Tesla-V100-SXM2-32GB:32"
GPU_MEM = [15, 32]


def _gpu_status(node: Node) -> tuple[dict[str, int], dict[str, int]]:
    cap = node.status.capacity or {}
    alloc = node.status.allocatable or {}
    return ({r: int(cap[r]) for r in names.ALL_GPU_RESOURCES if r in cap},
            {r: int(alloc[r]) for r in names.ALL_GPU_RESOURCES if r in alloc})


def test_agent_registers_the_node(controlplane: ControlPlane, admin: Client,
                                  chart: dict[str, Any], report: Report) -> None:
    ns = chart["namespace"]
    run = uuid.uuid4().hex[:6]
    node = create_node(admin, f"agent-{run}",
                       labels={RUN_LABEL: run, names.LABEL_SCHEDULE: "cgpu"},
                       resources={"cpu": "16", "memory": "64Gi", "pods": "110"})
    kubeconfig, sa = sa_client(controlplane, ns, chart["sa"]["agent"])
    wait_allowed("the agent to read its node", lambda: sa.get(Node, node))
    dp_dir = tempfile.mkdtemp(prefix="sg-dp-")  # short: unix socket paths
    state_dir = tempfile.mkdtemp(prefix="sg-state-")
    play = KubeletPlay(controlplane.admin_kubeconfig, node, dp_dir).start()
    agent = SharegpuProcess(controlplane, f"agent-{node}", [
        "agent", "--nvml=fake", f"--fake-gpus={FAKE_GPUS}", f"--node-name={node}",
        f"--device-plugin-dir={dp_dir}", f"--state-dir={state_dir}", "--isolation=none",
        f"--kubeconfig={kubeconfig}", f"--metrics-listen=127.0.0.1:{free_port()}",
        "--compute-policy=5", "--log-level=INFO",
    ])
    try:
        t0 = time.time()
        agent.start()

        def registered() -> Node | None:
            n = admin.get(Node, node)
            cap, alloc = _gpu_status(n)
            want = advertised_resources(Mode.CGPU, GPU_MEM)
            return n if cap == want and alloc == want else None

        agent.wait_until(lambda: bool(registered()), "the node's GPU resources", timeout=60)
        n = registered()
        assert n is not None
        t_ready = play.writes[-1][0] - t0
        labels, anns = n.metadata.labels, n.metadata.annotations
        # card-model labels from NVML (GPU 0), sizes per GPU, the remembered mode
        assert labels[names.LABEL_CARD_NAME] == "Tesla-T4"
        assert labels[names.LABEL_CARD_MEM] == "15360MiB"
        assert labels[names.LABEL_CARD_COUNT] == "2"
        assert anns[names.ANN_NODE_GPU_MEM] == "15,32"
        assert anns[names.ANN_NODE_LAST_MODE] == "cgpu"
        conds = {c.type: c for c in n.status.conditions or []}
        assert conds["GPUIsolationReady"].status == "True"
        assert conds["GPUIsolationReady"].reason == "NotIsolated"
        # every resource registered with the kubelet, one device per GiB of each GPU
        regs = {r for _, r, _ in play.kubelet.registrations}
        assert regs == set(names.ALL_GPU_RESOURCES)
        counts = play.counts()
        assert counts[names.RES_GPU_MEM] == (47, 47)
        # what the extender and kubectl inspect cgpu read from this node
        spec = spec_from_node(n.to_dict())
        assert spec is not None and list(spec.gpu_mem) == GPU_MEM and spec.mode is Mode.CGPU
        report(f"agent: node {node} registered {time.time() - t0:.2f}s after the agent started "
               f"(GPU resources on the node {t_ready:.2f}s): labels "
               f"{ {k: v for k, v in labels.items() if k.startswith('aliyun.')} }, "
               f"{names.ANN_NODE_GPU_MEM}={anns[names.ANN_NODE_GPU_MEM]}")
        report(f"  cgpu       allocatable {_gpu_status(n)[1]}")

        # live mode switches: the label changes what the node advertises
        for mode in ("core_mem", "share", "mps", "topology", "default", "cgpu"):
            want = advertised_resources(Mode(mode), GPU_MEM)
            t1 = time.monotonic()
            set_node_label(admin, node, names.LABEL_SCHEDULE, mode)

            def switched(want: dict[str, int] = want, mode: str = mode) -> bool:
                n = admin.get(Node, node)
                return (_gpu_status(n) == (want, want)
                        and n.metadata.annotations.get(names.ANN_NODE_LAST_MODE) == mode)

            agent.wait_until(switched, f"mode {mode} on the node", timeout=30)
            report(f"  {mode:<10} allocatable {want} "
                   f"({time.monotonic() - t1:.2f}s after the label changed)")

        # the label removed: the last explicit mode stays
        set_node_label(admin, node, names.LABEL_SCHEDULE, None)
        time.sleep(2.0)
        n = admin.get(Node, node)
        assert names.LABEL_SCHEDULE not in n.metadata.labels
        want = advertised_resources(Mode.CGPU, GPU_MEM)
        assert _gpu_status(n) == (want, want)
        assert n.metadata.annotations[names.ANN_NODE_LAST_MODE] == "cgpu"
        spec = spec_from_node(n.to_dict())
        assert spec is not None and spec.mode is Mode.CGPU
        report("  label removed: still cgpu (sharegpu.io/last-mode=cgpu), "
               f"allocatable {_gpu_status(n)[1]}")

        # a pod bound to the node with the extender's decision (4 GiB on GPU 1): the kubelet's
        # GetPreferredAllocation and Allocate; the agent finds the pod through the API server
        # (its ServiceAccount lists the node's pods) and marks it assigned
        alloc = Allocation(mem={0: {1: 4}})
        pod = gpu_pod("agent-alloc", run, mem=4)
        pod["metadata"]["annotations"] = encode(alloc, assume_time_ns=time.time_ns(),
                                                gpu_capacity={0: 15, 1: 32})
        pod["spec"]["nodeName"] = node
        admin.create(Pod.from_dict(pod), namespace=ns)
        ids = [i for i, h in play.kubelet.devices[names.RES_GPU_MEM] if h == "Healthy"]
        chosen = play.call(play.kubelet.preferred, names.RES_GPU_MEM, ids, 4)
        assert len(chosen) == 4
        v100 = chosen[0].split("-_-")[0]
        assert all(c.startswith(v100 + "-_-") for c in chosen)
        resp = play.call(play.kubelet.allocate, names.RES_GPU_MEM, chosen)
        env = dict(resp.envs)
        assert env[names.ENV_VISIBLE_DEVICES] == v100
        assert env[names.ENV_MEM_IDX] == "1"
        assert env[names.ENV_MEM_CONTAINER] == "4"
        assert env[names.ENV_MEM_DEV] == "32"

        def assigned() -> bool:
            a = admin.get(Pod, "agent-alloc", namespace=ns).metadata.annotations or {}
            return a.get(names.ANN_ASSIGNED) == "true" and a.get(names.ANN_MEM_ASSIGNED) == "true"

        agent.wait_until(assigned, "the pod marked assigned", timeout=30)
        report(f"  Allocate of 4 GiB for {ns}/agent-alloc: {names.ENV_VISIBLE_DEVICES}={v100} "
               f"(GPU 1), pod marked assigned by the agent")
        assert agent.alive(), agent.log_tail()
        assert not play.errors, play.errors
        log = agent.log.read_text(errors="replace")
        assert "Forbidden" not in log and " ERROR " not in log, agent.log_tail(200)
    finally:
        agent.stop()
        play.stop()
        with_pods = [p.metadata.name for p in admin.list(Pod, namespace=ns)]
        for p in with_pods:
            admin.delete(Pod, p, namespace=ns, grace_period=0)
        admin.delete(Node, node)
        shutil.rmtree(dp_dir, ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)
    controlplane.check_alive()


# ---------------------------------------------------------------------------------------------
# 4. the real kube-scheduler with the chart's configuration calls sharegpu extender

NV_PAIRS = [["X", "SYS", "NV2", "SYS"], ["SYS", "X", "SYS", "NV2"],
            ["NV2", "SYS", "X", "SYS"], ["SYS", "NV2", "SYS", "X"]]

# name, mode label (None: no label, exclusive), GPUs in GiB, ack.node.gpu.placement
NODES: list[tuple[str, str | None, list[int], str]] = [
    ("cgpu-a", "cgpu", [16, 16, 16, 16], "binpack"),
    ("cgpu-b", "cgpu", [16, 16, 16, 16], "spread"),
    ("cgpu-c", "cgpu", [32, 32], ""),
    ("cgpu-d", "cgpu", [16, 16, 32, 32], "spread"),
    ("core-a", "core_mem", [16, 16, 16, 16], ""),
    ("core-b", "core_mem", [32, 32], "spread"),
    ("core-c", "core_mem", [24, 24], "binpack"),
    ("share-a", "share", [16, 16], ""),
    ("share-b", "share", [24, 24, 24, 24], "spread"),
    ("mps-a", "mps", [32, 32], "binpack"),
    ("mps-b", "mps", [16, 16, 16, 16], ""),
    ("excl-a", "default", [24, 24, 24, 24], ""),
    ("excl-b", None, [80, 80], ""),
    ("topo-a", "topology", [80] * 8, ""),
    ("topo-b", "topology", [40] * 4, ""),
]


def _pods(run: str, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    shapes: list[dict[str, Any]] = []
    shapes += [{"mem": rng.choice([1, 2, 3, 4, 6, 8])} for _ in range(54)]
    shapes += [{"mem": rng.choice([2, 4]), "core": rng.choice([10, 20, 25, 50])}
               for _ in range(12)]
    shapes += [{"mem": rng.choice([8, 16]), "gpu_count": 2} for _ in range(6)]
    shapes += [{"mem": 12, "gpu_count": 4} for _ in range(2)]
    shapes += [{"containers": [{names.RES_GPU_MEM: 2}, {names.RES_GPU_MEM: rng.choice([1, 5])}]}
               for _ in range(6)]
    shapes += [{"containers": [{names.RES_GPU_MEM: 2, names.RES_GPU_CORE: 20},
                               {names.RES_GPU_MEM: 3, names.RES_GPU_CORE: 30}]}
               for _ in range(3)]
    shapes += [{"cards": c} for c in (1, 1, 2, 1, 2, 1, 1)]  # 9 cards for 6
    shapes += [{"topology": c} for c in (1, 2, 4, 2, 1, 2, 2)]  # 14 cards for 12
    # never fit: more memory than any GPU has (the extender's reason), a compute share that is
    # not a multiple of 5 (the extender's reason), more topology cards than any node has
    # (kube-scheduler's own reason)
    shapes += [{"mem": 40}] * 3 + [{"mem": 2, "core": 33}] + [{"topology": 16}]
    rng.shuffle(shapes)
    return [gpu_pod(f"gpu-{i:03d}", run, **s) for i, s in enumerate(shapes)]


def _requests(pod: dict[str, Any]) -> dict[str, int]:
    """What kube-scheduler counts for the managed resources: the sum over the containers."""
    out: dict[str, int] = defaultdict(int)
    for c in pod["spec"]["containers"]:
        for r, v in ((c.get("resources") or {}).get("requests") or {}).items():
            if r in MANAGED:
                out[r] += int(v)
    return dict(out)


def _kube_fit(nodes: list[dict[str, Any]], pods: list[dict[str, Any]],
              pod: dict[str, Any]) -> list[str]:
    """The nodes that pass kube-scheduler's own resource check for ``pod`` (allocatable minus
    what the bound pods request), i.e. those it passes on to the extender."""
    used: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for p in pods:
        n = p["spec"].get("nodeName")
        if n:
            for r, v in _requests(p).items():
                used[n][r] += v
    want = _requests(pod)
    out = []
    for node in nodes:
        name = node["metadata"]["name"]
        alloc = node["status"]["allocatable"]
        if all(int(alloc.get(r, 0)) - used[name][r] >= v for r, v in want.items()):
            out.append(name)
    return out


def _refused(pod: dict[str, Any]) -> bool:
    try:
        parse_pod(pod)
    except ValidationError:
        return True
    return False


def _events(admin: Client, ns: str) -> list[dict[str, Any]]:
    return [e.to_dict() for e in admin.list(Event, namespace=ns)]


def _check_annotations(pod: dict[str, Any], node: dict[str, Any]) -> None:
    """SPEC §3: both generations, per container, matching the request and the node."""
    key = pod["metadata"]["name"]
    anns = pod["metadata"].get("annotations") or {}
    req = parse_pod(pod)
    for a in (names.ANN_MEM_ASSIGNED, names.ANN_MEM_ASSUME_TIME, names.ANN_ALLOCATION,
              names.ANN_ASSIGNED, names.ANN_ASSUME_TIME):
        assert a in anns, f"{key}: no {a}"
    # "false" from the extender; "true" once the node's kubelet and agent (StandInKubelets) start it
    assert anns[names.ANN_ASSIGNED] == anns[names.ANN_MEM_ASSIGNED] in ("false", "true")
    assert anns[names.ANN_ASSUME_TIME] == anns[names.ANN_MEM_ASSUME_TIME]
    alloc = decode(anns)
    assert alloc is not None
    gpu_mem = [int(x) for x in node["metadata"]["annotations"][names.ANN_NODE_GPU_MEM].split(",")]
    # the first generation: the same GPUs, the pod's total, the first GPU's size (only where it
    # says the placement: the same amount on every GPU)
    if first_generation_holds(alloc):
        assert anns[names.ANN_MEM_IDX] == ",".join(map(str, alloc.gpus))
        assert int(anns[names.ANN_MEM_POD]) == alloc.total_mem
        assert int(anns[names.ANN_MEM_DEV]) == gpu_mem[alloc.gpus[0]]
    else:
        assert names.ANN_MEM_IDX not in anns and names.ANN_MEM_POD not in anns, key
    for c in req.containers:
        got = alloc.mem[c.index]
        assert len(got) == c.gpus, f"{key} container {c.index}: {got}"
        for g, v in got.items():
            assert v == (gpu_mem[g] if c.whole else c.gpu_mem), f"{key}: {got}"
        if c.gpu_core:
            assert alloc.core[c.index] == dict.fromkeys(got, c.gpu_core), f"{key}: {alloc}"
    if req.kind in (Kind.SHARED, Kind.SHARED_CORE) and first_generation_holds(alloc):
        assert int(anns[names.ANN_MEM_POD]) == req.total_mem
    if req.kind is Kind.SHARED_CORE:
        assert names.ANN_CORE in anns
    mode = spec_from_node(node).mode  # type: ignore[union-attr]
    allowed = {Kind.SHARED: {Mode.CGPU, Mode.CORE_MEM, Mode.SHARE, Mode.MPS},
               Kind.SHARED_CORE: {Mode.CORE_MEM}, Kind.EXCLUSIVE: {Mode.EXCLUSIVE},
               Kind.TOPOLOGY: {Mode.TOPOLOGY}}[req.kind]
    assert mode in allowed, f"{key} ({req.kind}) on a {mode} node"


def _replay(node: dict[str, Any], pods: list[dict[str, Any]], policy_strategy: str) -> int:
    """Replay the node's pods in the order they were placed (assume-time) through the core's
    GPU choice under the node's strategy (ack.node.gpu.placement, or whole cards by topology):
    each pod's recorded GPUs must be that choice. Returns how many were checked."""
    spec = spec_from_node(node)
    assert spec is not None
    state = ClusterState([spec])
    here = sorted((p for p in pods if p["spec"].get("nodeName") == spec.name),
                  key=lambda p: int(p["metadata"]["annotations"][names.ANN_ASSUME_TIME]))
    for p in here:
        req = parse_pod(p)
        got = decode(p["metadata"]["annotations"])
        assert got is not None
        strategy = request_strategy(req, node_strategy(state, 0, policy_strategy))
        want = assign(state, req, 0, strategy)
        assert want is not None and want.mem == got.mem, (
            f"{p['metadata']['name']} on {spec.name} ({strategy}): got {got.mem}, "
            f"the core would choose {want.mem if want else None}")
        state.reserve(req, 0, got)
    return len(here)


def test_real_kube_scheduler_places_gpu_pods(controlplane: ControlPlane, admin: Client,
                                             chart: dict[str, Any], report: Report) -> None:
    ns, docs = chart["namespace"], chart["docs"]
    run = uuid.uuid4().hex[:6]
    node_names = [f"{n}-{run}" for n, *_ in NODES]
    ext_kubeconfig, ext = sa_client(controlplane, ns, chart["sa"]["extender"])
    wait_allowed("the extender to list pods", lambda: list(ext.list(Pod, namespace="*")))
    watch: PodWatch | None = None
    local: LocalExtender | None = None
    extender: SharegpuProcess | None = None
    try:
        for (name, mode, gpus, placement), full in zip(NODES, node_names, strict=True):
            gpu_node(admin, full, mode, gpus, run, placement=placement,
                     links=NV_PAIRS if name == "topo-b" else None)
        local = start_extender(controlplane, docs, "sharegpu-extender-0", ext_kubeconfig)
        extender, url = local.proc, local.url
        cfg = scheduler_config_for(controlplane, docs, RELEASE, ns, url)
        assert url.startswith("https://127.0.0.1:")
        assert cfg["extenders"][0]["enableHTTPS"] is True
        tls = cfg["extenders"][0]["tlsConfig"]
        assert set(tls) == {"caData", "serverName", "certFile", "keyFile"}
        # kube-scheduler presents the chart's client certificate: the extender answers no other
        assert Path(tls["certFile"]).read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
        controlplane.restart_scheduler(config=cfg, extra_args=["--leader-elect=true", "--v=2"])
        watch = StandInKubelets(controlplane.admin_kubeconfig, ns).start()
        pods = _pods(run)
        t0 = time.monotonic()
        for p in pods:
            admin.create(Pod.from_dict(p), namespace=ns)
        t_created = time.monotonic() - t0

        # until every pod is bound or marked Unschedulable, and nothing has changed for 5 s
        last: list[Any] = [None, time.monotonic()]

        def settled() -> bool:
            now = pod_dicts(admin, ns)
            state = sorted((p["metadata"]["name"], p["spec"].get("nodeName") or "") for p in now)
            if state != last[0]:
                last[0], last[1] = state, time.monotonic()
            decided = all(
                p["spec"].get("nodeName") or any(
                    c["type"] == "PodScheduled" and c["status"] == "False"
                    and c.get("reason") == "Unschedulable"
                    for c in (p.get("status") or {}).get("conditions") or [])
                for p in now)
            return decided and time.monotonic() - last[1] > 5.0

        wait_for("every pod bound or unschedulable", settled, timeout=120, every=0.5)
        bound_times = sorted(t for t, _ in watch.bound.values())
        span = bound_times[-1] - bound_times[0] if bound_times else 0.0

        nodes = node_dicts(admin, run)
        pods_now = pod_dicts(admin, ns)
        by_node = {n["metadata"]["name"]: n for n in nodes}
        bound = [p for p in pods_now if p["spec"].get("nodeName")]
        pending = [p for p in pods_now if not p["spec"].get("nodeName")]

        # --- the scheduler's lease and the extender's lease are the chart's
        sched_lease = controlplane.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/ack-co-scheduler")
        ext_lease = controlplane.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/sharegpu-extender")
        assert sched_lease[0] == 200, sched_lease
        assert ext_lease[0] == 200 and "sharegpu-extender-0" in ext_lease[1], ext_lease

        # --- bindings and annotations (SPEC §3)
        kinds: dict[str, int] = defaultdict(int)
        for p in bound:
            name = p["metadata"]["name"]
            _check_annotations(p, by_node[p["spec"]["nodeName"]])
            assert watch.annotated_at_bind.get(name), f"{name} was bound before its decision"
            assert len(watch.nodes[name]) == 1
            cond = {c["type"]: c for c in p["status"].get("conditions") or []}
            assert cond["PodScheduled"]["status"] == "True"
            kinds[parse_pod(p).kind.value] += 1
        multi = [p for p in bound if len(p["spec"]["containers"]) > 1]
        assert len(multi) >= 6, "multi-container pods were placed"
        assert kinds["shared"] >= 50 and kinds["shared-core"] >= 8
        assert kinds["exclusive"] >= 4 and kinds["topology"] >= 4

        # --- no over-commit: per GPU from the annotations, per node from the requests
        assert over_commits(nodes, pods_now) == []
        for name, n in by_node.items():
            used: dict[str, int] = defaultdict(int)
            for p in bound:
                if p["spec"]["nodeName"] == name:
                    for r, v in _requests(p).items():
                        used[r] += v
            for r, v in used.items():
                assert v <= int(n["status"]["allocatable"][r]), f"{name}: {r} {v}"

        # --- kubectl inspect cgpu's model agrees with the pods
        usage = inspect_model.build(nodes, pods_now)
        assert not usage.warnings, usage.warnings
        shared_nodes = {n for n, (_, mode, _, _) in zip(node_names, NODES, strict=True)
                        if mode in ("cgpu", "core_mem", "share", "mps")}
        assert {u.name for u in usage.nodes} == shared_nodes
        for u in usage.nodes:
            mem: dict[int, int] = defaultdict(int)
            core: dict[int, int] = defaultdict(int)
            count: dict[int, int] = defaultdict(int)
            holders = set()
            for p in bound:
                if p["spec"]["nodeName"] != u.name:
                    continue
                holders.add(p["metadata"]["name"])
                a = decode(p["metadata"]["annotations"])
                assert a is not None
                for g, v in a.per_gpu_mem().items():
                    mem[g] += v
                for g, v in a.per_gpu_core().items():
                    core[g] += v
                for g in a.gpus:
                    count[g] += 1
            assert u.mem_total == int(by_node[u.name]["status"]["allocatable"][names.RES_GPU_MEM])
            assert not u.has_pending
            assert {p.name for p in u.pods} == holders
            for g in u.gpus:
                assert (g.mem_allocated, g.core_allocated, g.pods) == (
                    mem[g.index], core[g.index], count[g.index]), (u.name, g)
                assert g.mem_allocated <= g.mem_total
        assert usage.mem_allocated == sum(
            parse_pod(p).total_mem for p in bound
            if p["spec"]["nodeName"] in shared_nodes)
        live = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "kubectl-inspect-cgpu")], capture_output=True,
            text=True, timeout=60,
            env={**os.environ, "KUBECONFIG": str(controlplane.admin_kubeconfig)})
        assert live.returncode == 0, live.stderr
        every = inspect_model.build([n.to_dict() for n in admin.list(Node)],
                                    [p.to_dict() for p in admin.list(Pod, namespace="*")])
        assert live.stdout.strip() == inspect_render.summary(every).strip()

        # --- sharegpu whatif reads the same dump: each shared node's allocation is inspect's;
        # the replay under the extender's policy, in the order it decided, is reported (the
        # extender re-learnt its target as the pods came; the replay holds the final one)
        from sharegpu.whatif.cluster import read as whatif_read
        from sharegpu.whatif.measure import figures
        from sharegpu.whatif.policyreplay import holders, orderings, replay_one

        listed = sorted(nodes, key=lambda n: n["metadata"]["name"])
        wcluster = whatif_read(listed, pods_now)
        wstate, wproblems = wcluster.state()
        assert wproblems == [], wproblems
        # the pods whose request the webhook would refuse are left out, each named
        refused = {p["metadata"]["name"] for p in pending if _refused(p)}
        assert sorted(wcluster.warnings) == sorted(
            w for w in wcluster.warnings if any(f"/{n} left out: " in w for n in refused))
        fig = figures(wstate, None)
        walloc = dict(zip(fig.nodes, fig.allocated.sum(axis=1).tolist(), strict=True))
        for u in usage.nodes:
            assert walloc[u.name] == u.mem_allocated, u.name
        assert len(wcluster.bound) == len(bound)
        how, orders = orderings(wcluster, 1)
        wrun = replay_one(wcluster, "default", orders[0], holders(wstate))
        report(f"whatif on the real dump: {len(wcluster.bound)} bound and "
               f"{len(wcluster.pending)} pending GPU pods in {how}; the replay under default "
               f"holds {wrun.differences} GPUs otherwise, {len(wrun.unplaced)} bound pods not "
               f"placed, {wrun.pending_fit} pending pods placed")

        # --- GPU choice inside the node: binpack/spread labels and topology (topo-b's link
        # matrix pairs 0-2 and 1-3), replayed in the order the pods were placed
        checked = 0
        for (short, _mode, _gpus, placement), name in zip(NODES, node_names, strict=True):
            if placement or short.startswith("topo"):
                checked += _replay(by_node[name], pods_now, "bestfit")
        topo_pairs = [decode(p["metadata"]["annotations"]).gpus  # type: ignore[union-attr]
                      for p in bound if p["spec"]["nodeName"] == f"topo-b-{run}"
                      and parse_pod(p).total_gpus == 2]

        # --- every pod left Pending: kube-scheduler's FailedScheduling with the reason; where
        # kube-scheduler passed nodes to the extender, the extender's reason for them
        offline = ClusterView("default")
        offline.reset(nodes, pods_now)
        extender_path: dict[str, list[str]] = {}
        kube_path: list[str] = []
        for p in pending:
            name = p["metadata"]["name"]
            fit = _kube_fit(nodes, pods_now, p)
            if not fit:
                kube_path.append(name)
                continue
            ans = local.post("/filter", {"Pod": p, "NodeNames": fit})
            assert not ans.get("NodeNames"), f"{name} fits {ans['NodeNames']} but is Pending"
            reasons = {**(ans.get("FailedNodes") or {}),
                       **(ans.get("FailedAndUnresolvableNodes") or {})}
            assert set(reasons) == set(fit), ans
            extender_path[name] = sorted(set(reasons.values()))
            try:
                req = offline.reader.request(p)
            except Exception:  # an invalid request fits nowhere
                continue
            passed, _, _ = offline.filter(req, fit)
            assert passed == [], f"{name} would fit {passed} (view rebuilt from the API)"

        def failed_scheduling() -> dict[str, list[str]]:
            out: dict[str, list[str]] = defaultdict(list)
            for e in _events(admin, ns):
                if e.get("reason") == "FailedScheduling":
                    out[e["involvedObject"]["name"]].append(e.get("message") or "")
            return out

        def explained() -> bool:
            fs = failed_scheduling()
            for name, reasons in extender_path.items():
                if not any(r in m for m in fs.get(name, []) for r in reasons):
                    return False
            for name in kube_path:
                pod = next(p for p in pending if p["metadata"]["name"] == name)
                wanted = [f"Insufficient {r}" for r in _requests(pod)]
                if not any(w in m for m in fs.get(name, []) for w in wanted):
                    return False
            return True

        try:
            wait_for("FailedScheduling events with the reasons", explained, timeout=30,
                     every=1.0)
        except AssertionError:
            fs = failed_scheduling()
            detail = {n: (extender_path.get(n), fs.get(n)) for n in
                      list(extender_path) + kube_path}
            raise AssertionError(f"pending pods without their reason: {detail}") from None
        events = _events(admin, ns)
        bad = [e["message"] for e in events if "%!" in (e.get("message") or "")]
        assert bad == [], bad
        ext_reasons = {e["involvedObject"]["name"] for e in events
                       if e.get("reason") in (REASON_UNSCHEDULABLE, REASON_INVALID)}
        assert set(extender_path) <= ext_reasons
        fs = failed_scheduling()
        mem40 = [n for n in extender_path if _requests(
            next(p for p in pending if p["metadata"]["name"] == n)).get(names.RES_GPU_MEM) == 40]
        assert len(mem40) == 3 and len(pending) >= 5
        assert extender.alive(), extender.log_tail()
        errors = [ln for ln in extender.log.read_text(errors="replace").splitlines()
                  if " ERROR " in ln or "Traceback" in ln or "Forbidden" in ln]
        assert errors == [], errors
        ok_binds = metric(local.metrics_url, "sharegpu_extender_decisions_total",
                          {"verb": "bind", "result": "ok"})
        assert ok_binds == len(bound)
        # its consistency check ran when it took the Lease, while kube-scheduler's first pods
        # were being bound: no difference (see test_extender_ha_real.py)
        assert metric(local.metrics_url, "sharegpu_extender_state_drift_total") == 0

        # --- a deleted pod's GPUs are free again: kube-scheduler retries the pending
        # whole-card pods and the extender, whose view followed the deletion, places them
        excl_a = f"excl-a-{run}"  # 4 cards; the pods waiting for cards need 3 at most
        excl = [p for p in bound if p["spec"]["nodeName"] == excl_a]
        waiting = [p["metadata"]["name"] for p in pending
                   if names.RES_NVIDIA_GPU in _requests(p)]
        assert excl and waiting, "some whole-card pods wait for cards"
        freed = 0
        t_del = time.monotonic()
        for p in excl:
            admin.delete(Pod, p["metadata"]["name"], namespace=ns, grace_period=0)
            freed += parse_pod(p).total_gpus

        def rebound() -> bool:
            return all(admin.get(Pod, n, namespace=ns).spec.nodeName for n in waiting)

        try:
            wait_for("the waiting whole-card pods placed on the freed cards", rebound,
                     timeout=45)
        except AssertionError:
            fs = failed_scheduling()
            raise AssertionError(
                f"{waiting} not bound after {freed} card(s) on {excl_a} were freed: "
                f"{ {n: fs.get(n, [])[-2:] for n in waiting} }\n{extender.log_tail(30)}"
            ) from None
        t_rebound = time.monotonic() - t_del
        pods_after = pod_dicts(admin, ns)
        assert over_commits(node_dicts(admin, run), pods_after) == []
        for p in pods_after:
            if p["metadata"]["name"] in waiting and p["spec"].get("nodeName"):
                _check_annotations(p, by_node[p["spec"]["nodeName"]])

        report(f"real kube-scheduler v1.37.2 + sharegpu extender: {len(pods)} pods created in "
               f"{t_created:.1f}s on {len(nodes)} nodes; {len(bound)} bound "
               f"({dict(kinds)}), binds over {span:.1f}s; {len(pending)} pending")
        report(f"  decision annotated before the binding: {len(bound)}/{len(bound)}; "
               f"over-commits: 0; GPU choice replayed on binpack/spread/topology nodes: "
               f"{checked} pods; 2-card topology pods on topo-b: {topo_pairs}")
        for name in sorted(extender_path):
            msg = max(fs[name], key=len)
            report(f"  {name} pending: {msg[:300]}")
        for name in sorted(kube_path):
            report(f"  {name} pending (kube-scheduler's own filter): {fs[name][-1][:200]}")
        report(f"  {freed} whole card(s) on {excl_a} freed by deleting its pods: the waiting "
               f"pods {waiting} bound {t_rebound:.2f}s later; still no over-commit")
        report("kubectl inspect cgpu (model.build over the run's nodes and pods):")
        for line in inspect_render.summary(usage).splitlines():
            report("  " + line)
    finally:
        if watch is not None:
            watch.stop()
        controlplane.restart_scheduler()
        if extender is not None:
            extender.stop()
        for p in admin.list(Pod, namespace=ns):
            admin.delete(Pod, p.metadata.name, namespace=ns, grace_period=0)
        cleanup(admin, None, node_names)
    controlplane.check_alive()
