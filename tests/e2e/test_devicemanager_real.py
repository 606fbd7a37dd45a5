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
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Pod, ServiceAccount

from sharegpu.core import names
from sharegpu.core.annotations import is_assigned
from sharegpu.core.startingpods import StartingPods

from .components import SharegpuProcess, create_node, free_port, wait_for
from .controlplane import ControlPlane
from .devicemanager_play import DeviceManagerRun, fake_gpus, mismatches, place, pod_object

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from agent_helpers import standin_library

GPUS = ",".join(["Tesla-T4:15"] * 4 + ["Tesla-V100-SXM2-32GB:32"] * 4)
N_PODS = 50




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
         seed: int, kubelet_first: bool) -> None:
    node = create_node(admin, f"gpu-dm-{uuid.uuid4().hex[:6]}",
                       labels={names.LABEL_SCHEDULE: mode})
    gpus = fake_gpus(GPUS)
    capacity = {g.index: g.gib for g in gpus}
    # bound while the kubelet is down: only pods the extender's binder lets through together,
    # those the kubelet can tell apart or twins (sharegpu.core.startingpods)
    shapes = place(N_PODS, gpus, seed=seed, core=(mode == "core_mem"),
                   starting=None if kubelet_first else StartingPods())
    kinds: dict[str, int] = {}
    for kind, *_ in shapes:
        kinds[kind] = kinds.get(kind, 0) + 1
    pods: dict[str, dict[str, Any]] = {}

    def bind_all() -> float:
        t0 = time.monotonic()
        for i, (_, reqs, alloc, count) in enumerate(shapes):
            # the extender's bind: decision and assume-time recorded, then bound (nodeName set at
            # creation); one pod after another, so assume-times follow the bind order
            obj = pod_object(f"p{i:02d}", namespace, node, reqs, alloc, time.time_ns(),
                             gpu_count=count, capacity=capacity)
            pods[f"{namespace}/{obj['metadata']['name']}"] = admin.create(
                Pod.from_dict(obj)).to_dict()
        return time.monotonic() - t0

    lib = standin_library()
    agent = SharegpuProcess(cp, f"agent-{node}", [
        "agent", f"--node-name={node}", f"--kubeconfig={cp.admin_kubeconfig}", "--nvml=fake",
        f"--fake-gpus={GPUS}", f"--device-plugin-dir={d / 'dp'}", f"--state-dir={d / 'state'}",
        "--isolation=hami", f"--hami-library={lib}", f"--metrics-listen=127.0.0.1:{free_port()}",
    ])
    resources = [names.RES_GPU_MEM] + ([names.RES_GPU_CORE] if mode == "core_mem" else [])
    dm = DeviceManagerRun(
        binary, node=node, plugin_dir=d / "dp", expect_pods=N_PODS, wait_resources=resources,
        # the kubelet's identity: the Node authorizer and system:node let it watch its pods
        kubeconfig=cp.kubeconfig_for(f"system:node:{node}", ["system:nodes"]),
        output=cp.workdir / f"kubelet-devicemanager-{node}.json",
        log=cp.workdir / f"kubelet-devicemanager-{node}.log")
    try:
        if not kubelet_first:
            bind_s = bind_all()
        agent.start()
        agent.wait_until(lambda: (d / "dp" / "sharegpu-gpu-mem.sock").exists(),
                         "its device-plugin sockets")
        dm.start()
        dm.wait_ready()
        if kubelet_first:
            bind_s = bind_all()
        report, wall = dm.finish()
        assert agent.alive(), agent.log_tail()
    finally:
        dm.stop()
        agent.stop()

    containers = sum(len(p["spec"]["containers"]) for p in pods.values())
    secs = report["seconds"]
    batches = [len(b) for b in report["batches"]]
    print(f"\n{mode}, {'bound while the kubelet runs' if kubelet_first else 'one batch'}: "
          f"{N_PODS} pods {kinds}, {containers} containers, bound in {bind_s:.2f}s; "
          f"ADD batches {batches if len(batches) < 8 else f'{len(batches)} (max {max(batches)})'};"
          f" device manager {wall:.1f}s wall, admission {secs['admission']:.2f}s "
          f"(max {max(p['admit_ms'] for p in report['pods']):.0f} ms/pod), first pod to last "
          f"started {secs['first_pod_to_last_started']:.2f}s; capacity {report['capacity']}",
          file=sys.stderr)
    assert report["capacity"][names.RES_GPU_MEM] == sum(g.gib for g in gpus)
    assert len(report["pods"]) == N_PODS
    if not kubelet_first:
        assert batches == [N_PODS]
    assert sum(len(p["containers"]) for p in report["pods"]) == containers
    # the kubelet's code asked the plugin where to allocate before each Allocate
    allocations = containers * len(resources)
    assert dm.count("Issuing a GetPreferredAllocation call") == allocations
    assert dm.count("Making allocation request for device plugin") == allocations
    bad = mismatches(report, pods, gpus, lib)
    wrong = {line.split(": ", 1)[0] for line in bad}
    wrong_gpu = {line.split(": ", 1)[0] for line in bad if "devices on GPUs" in line}
    print(f"{mode}: {len(bad)} mismatches: {len(wrong)} of {containers} containers differ from "
          f"their own pod's decision, {len(wrong_gpu)} got other GPUs", file=sys.stderr)
    assert bad == [], f"{len(bad)} mismatches:\n" + "\n".join(bad[:40])
    wait_for("every pod marked assigned", lambda: all(
        is_assigned(p.metadata.annotations or {}) for p in admin.list(Pod, namespace=namespace)),
        timeout=30)


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
