"""The kubelet's OWN DRA code prepares claims the REAL kube-scheduler allocated, through the
agent's DRA kubelet plugin (docs/dra.md, "The plugin in the agent").

On the real kube-apiserver, kube-controller-manager and kube-scheduler v1.37.2 (default feature
gates): the chart's DeviceClass; a DRA node whose agent (``sharegpu agent --nvml fake --dra on``,
HAMi-core isolation with a stand-in library so the fail-closed check passes) publishes its
ResourceSlice and serves its kubelet plugin in a directory; ResourceClaims with
``capacity.requests`` (memory, and cores for some) for N pods, allocated by kube-scheduler (it
picks the GPU, consumes capacity, sets shareIDs and reserves each claim for its pod); then
``sharegpu-controlplane kubelet-dra`` (e2e/controlplane/dramanager.go): k8s.io/kubernetes v1.37.2
``pkg/kubelet/pluginmanager`` (the plugin watcher registers the agent's plugin from its
registration socket) and ``pkg/kubelet/cm/dra`` ``Manager.PrepareResources`` for every pod bound
to the node, as at pod admission (NodePrepareResources over the plugin's socket), with the
kubelet's identity (Node authorizer).

Every claim's CDI spec must carry its own claim's GPU (the UUID the slice publishes for the
device the scheduler chose) and limits (memory MiB, SM limit from the cores it asked for), and
every container gets exactly its claim's CDI device: 0 mismatches. Then
``Manager.UnprepareResources`` for every pod: no spec, record or cache directory left. With
``restart``, the agent is stopped (SIGTERM) once a third of the claims are prepared and started
again; the kubelet's retries (as its pod workers) end with every pod prepared, nothing lost.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Pod, ServiceAccount

from sharegpu.core import names
from sharegpu.dra import driver as dra

from .components import CHART, SharegpuProcess, create_node, free_port, helm, wait_for
from .controlplane import ControlPlane

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from agent_helpers import standin_library
from dra_kubelet import cdi_registry, container_view

GPUS = ",".join(["Tesla-T4:15"] * 4 + ["Tesla-V100-SXM2-32GB:32"] * 4)
N_PODS = 40
DRIVER = dra.DRIVER
RS = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
def namespace(admin: Client) -> Iterator[str]:
    name = f"drap-{uuid.uuid4().hex[:8]}"
    admin.create(Namespace(metadata=ObjectMeta(name=name)))
    wait_for(f"ServiceAccount {name}/default",
             lambda: any(True for _ in admin.list(ServiceAccount, namespace=name)))
    yield name
    admin.delete(Namespace, name)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sg-drap-"))  # unix socket paths stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def device_class(controlplane: ControlPlane) -> Iterator[str]:
    """The chart's DeviceClass, as `helm template` renders it with agent.dra.enabled."""
    out = helm(None, "template", "x", str(CHART), "--kube-version", "1.37.2", "--set",
               "agent.dra.enabled=true", "--show-only", "templates/deviceclass.yaml")
    dc = yaml.safe_load(out)
    path = "/apis/resource.k8s.io/v1/deviceclasses"
    code, body = controlplane.request("POST", path, dc)
    assert code in (201, 409), body
    yield dc["metadata"]["name"]
    if code == 201:
        controlplane.request("DELETE", f"{path}/{dc['metadata']['name']}")


def get(cp: ControlPlane, path: str) -> dict[str, Any] | None:
    code, body = cp.request("GET", path)
    if code == 404:
        return None
    assert code == 200, f"GET {path}: HTTP {code}: {body[:500]}"
    return json.loads(body)


def shapes(seed: int) -> list[tuple[int, int | None]]:
    """(GiB, cores or None) per claim: 1-4 GiB, a third with a compute share."""
    rng = random.Random(seed)
    return [(rng.randint(1, 4), rng.choice([None, None, 10, 20, 30])) for _ in range(N_PODS)]


class KubeletDra:
    """``sharegpu-controlplane kubelet-dra`` as a process (killed with its group)."""

    def __init__(self, binary: Path, cp: ControlPlane, node: str, d: Path) -> None:
        self.out = d / "prepared.json"
        self.after = d / "unprepared.json"
        self.trigger = d / "unprepare-now"
        self.log = cp.workdir / f"kubelet-dra-{node}.log"
        self.argv = [str(binary), "kubelet-dra", f"--node={node}",
                     # the kubelet's identity: the Node authorizer lets it read its pods' claims
                     # and delete its node's ResourceSlices
                     f"--kubeconfig={cp.kubeconfig_for(f'system:node:{node}', ['system:nodes'])}",
                     f"--plugins-registry={d / 'registry'}", f"--state-dir={d / 'kubelet-dra'}",
                     f"--expect-pods={N_PODS}", "--timeout=240s", f"--output={self.out}",
                     f"--unprepare-trigger={self.trigger}", f"--unprepare-output={self.after}",
                     "--v=4"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> KubeletDra:
        from .controlplane import _die_with_parent

        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        return self

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_file(self, path: Path, timeout: float) -> dict[str, Any]:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None and not path.exists():
                raise AssertionError(f"kubelet-dra exited {self.proc.returncode}:\n"
                                     f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {path.name} after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.1)
        return json.loads(path.read_text())

    def count(self, text: str) -> int:
        return self.log.read_text(errors="replace").count(text)

    def stop(self) -> None:
        from .controlplane import _kill_group

        if self.proc is not None:
            _kill_group(self.proc, grace=5)


def _run(cp: ControlPlane, binary: Path, admin: Client, ns: str, d: Path, *, seed: int,
         restart: bool) -> None:
    node = create_node(admin, f"gpu-drap-{uuid.uuid4().hex[:6]}",
                       labels={names.LABEL_SCHEDULE: "cgpu"})
    cdi_dir = d / "cdi"
    lib = standin_library()
    agent = SharegpuProcess(cp, f"agent-{node}", [
        "agent", f"--node-name={node}", f"--kubeconfig={cp.admin_kubeconfig}", "--nvml=fake",
        f"--fake-gpus={GPUS}", f"--device-plugin-dir={d / 'dp'}", f"--state-dir={d / 'state'}",
        "--isolation=hami", f"--hami-library={lib}", f"--metrics-listen=127.0.0.1:{free_port()}",
        "--dra=on", f"--dra-plugins-registry={d / 'registry'}",
        f"--dra-plugin-dir={d / 'plugin'}", f"--cdi-dir={cdi_dir}",
    ])
    kubelet = KubeletDra(binary, cp, node, d)
    want = shapes(seed)
    slice_path = f"{RS}/{node}-{DRIVER}"
    try:
        agent.start()
        agent.wait_until(lambda: (d / "registry" / f"{DRIVER}-reg.sock").exists(),
                         "its DRA registration socket")
        t0 = time.monotonic()
        kubelet.start()
        # the kubelet's DRA manager wipes the node's slices when it starts; the agent's watch
        # puts its slice back
        wait_for("the kubelet plugin registered", lambda: kubelet.count(
            f"kubelet-dra: DRA driver {DRIVER} registered"), timeout=60)
        registered_s = time.monotonic() - t0
        slc = wait_for("the node's slice", lambda: get(cp, slice_path), timeout=60)
        uuids = {dv["name"]: dv["attributes"]["uuid"]["string"]
                 for dv in slc["spec"]["devices"]}
        t_create = time.monotonic()
        for i, (gib, cores) in enumerate(want):
            cap = {"memory": f"{gib}Gi", **({"cores": str(cores)} if cores else {})}
            claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": f"c{i:02d}", "namespace": ns},
                     "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                         "deviceClassName": DRIVER,
                         "capacity": {"requests": cap}}}]}}}
            code, body = cp.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/"
                                    "resourceclaims", claim)
            assert code == 201, body
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"p{i:02d}", "namespace": ns},
                   "spec": {"schedulerName": "default-scheduler",
                            "nodeSelector": {"kubernetes.io/hostname": node},
                            "resourceClaims": [{"name": "gpu", "resourceClaimName": f"c{i:02d}"}],
                            "containers": [{"name": "main", "image": "registry.invalid/x",
                                            "resources": {"claims": [{"name": "gpu"}]}}]}}
            code, body = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
            assert code == 201, body
        restarted_at = None
        if restart:
            # stop the agent in the middle: once a third of the claims have their CDI spec
            deadline = time.monotonic() + 180
            while len(list(cdi_dir.glob("*.json"))) < N_PODS // 3:
                assert time.monotonic() < deadline, kubelet.log_tail()
                time.sleep(0.02)
            restarted_at = len(list(cdi_dir.glob("*.json")))
            agent.stop()
            assert not (d / "registry" / f"{DRIVER}-reg.sock").exists()
            time.sleep(1.0)  # the kubelet's prepares meanwhile fail: no plugin registered
            agent.start()
        report = kubelet.wait_file(kubelet.out, timeout=240)
        prepare_s = time.monotonic() - t_create

        # what the scheduler decided, from the API
        claims = {c["metadata"]["name"]: c for c in get(
            cp, f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims")["items"]}
        registry = cdi_registry(str(cdi_dir))
        bad: list[str] = []
        per_gpu: dict[str, int] = {}
        shares = set()
        defaulted = 0  # claims that asked for no cores yet consumed the policy's default
        for i, (gib, cores) in enumerate(want):
            c = claims[f"c{i:02d}"]
            uid = c["metadata"]["uid"]
            res = c["status"]["allocation"]["devices"]["results"]
            assert len(res) == 1 and res[0]["pool"] == node, res
            dev = res[0]["device"]
            per_gpu[dev] = per_gpu.get(dev, 0) + 1
            shares.add((dev, res[0].get("shareID")))
            consumed = res[0]["consumedCapacity"]
            if cores is None and consumed.get("cores"):
                defaulted += 1
            pod = next(p for p in report["pods"] if p["name"] == f"p{i:02d}")
            cid = f"sharegpu.io/gpu={uid}-{dev}"
            if not pod["prepared"] or [x["cdi_devices"] for x in pod["containers"]] != [[cid]]:
                bad.append(f"p{i:02d}: prepared={pod['prepared']} errors={pod.get('errors')} "
                           f"containers={pod['containers']} want {cid}")
                continue
            got = pod["containers"][0]["claims"]
            if [(x["uid"], [(v["device"], v["share_id"]) for v in x["devices"]])
                    for x in got] != [(uid, [(dev, res[0]["shareID"])])]:
                bad.append(f"p{i:02d}: claim infos {got}")
            env, mounts = container_view(registry, [cid])
            expect = {
                "NVIDIA_VISIBLE_DEVICES": uuids[dev],
                "CUDA_DEVICE_MEMORY_LIMIT_0": f"{gib * 1024}m",
                "CUDA_DEVICE_SM_LIMIT": str(cores) if cores else None,
                "LD_PRELOAD": "/usr/local/vgpu/libvgpu.so",
                "ALIYUN_COM_GPU_MEM_IDX": dev.removeprefix("gpu-"),
                "ALIYUN_COM_GPU_MEM_CONTAINER": str(gib),
            }
            wrong = {k: (env.get(k), v) for k, v in expect.items() if env.get(k) != v}
            if consumed.get("memory") != f"{gib}Gi":
                wrong["consumedCapacity.memory"] = (consumed.get("memory"), f"{gib}Gi")
            if mounts.get("/usr/local/vgpu/libvgpu.so", ("",))[0] != lib:
                wrong["library"] = (mounts.get("/usr/local/vgpu/libvgpu.so"), lib)
            if mounts.get("/tmp/sharegpu-vgpu", ("",))[0] != f"/tmp/sharegpu-vgpu/{uid}":
                wrong["cache"] = (mounts.get("/tmp/sharegpu-vgpu"), uid)
            if wrong:
                bad.append(f"p{i:02d} ({dev}, {gib} GiB, cores {cores}, consumed {consumed}): "
                           f"{wrong}")
        attempts = sum(p["attempts"] for p in report["pods"])
        retried = sum(1 for p in report["pods"] if p["attempts"] > 1)
        checkpoint = json.loads((d / "state" / "dra-claims.json").read_text())["claims"]
        print(f"\n{N_PODS} claims allocated by kube-scheduler over {len(per_gpu)} GPUs "
              f"{dict(sorted(per_gpu.items()))}, {len(shares)} distinct (device, shareID); "
              f"plugin registered {registered_s:.2f}s after kubelet-dra started; all prepared "
              f"{prepare_s:.1f}s after the first claim was created; {attempts} "
              f"PrepareResources calls, {retried} pods retried"
              + (f"; agent restarted after {restarted_at} specs" if restart else "")
              + f"; {defaulted} claims asked for no cores and consumed the default "
              f"{dra.CAPACITY_CORES} (no SM limit given); {len(bad)} mismatches",
              file=sys.stderr)
        assert bad == [], f"{len(bad)} mismatches:\n" + "\n".join(bad[:40])
        assert len(shares) == N_PODS
        assert len(list(cdi_dir.glob("*.json"))) == N_PODS and len(checkpoint) == N_PODS
        if restart:
            assert retried > 0, "no prepare failed across the restart"

        # the pods end: the kubelet unprepares every claim
        kubelet.trigger.write_text("now")
        after = kubelet.wait_file(kubelet.after, timeout=120)
        assert [p["name"] for p in after["pods"] if not p.get("unprepared")] == [], after
        assert list(cdi_dir.glob("*.json")) == []
        assert json.loads((d / "state" / "dra-claims.json").read_text())["claims"] == {}
        assert not [u for u in checkpoint if os.path.exists(f"/tmp/sharegpu-vgpu/{u}")]
        print(f"unprepared {N_PODS} pods in {after['seconds']['unprepare']:.2f}s: no CDI spec, "
              "record or cache directory left", file=sys.stderr)
        assert agent.alive(), agent.log_tail()
    finally:
        kubelet.stop()
        agent.stop()
        for p in admin.list(Pod, namespace=ns):
            admin.delete(Pod, p.metadata.name, namespace=ns, grace_period=0)


def test_the_kubelets_dra_manager_prepares_scheduler_allocated_claims(
        controlplane: ControlPlane, controlplane_binary: Path, admin: Client, namespace: str,
        short_dir: Path, device_class: str) -> None:
    _run(controlplane, controlplane_binary, admin, namespace, short_dir, seed=21, restart=False)


def test_an_agent_restart_in_the_middle_loses_nothing(
        controlplane: ControlPlane, controlplane_binary: Path, admin: Client, namespace: str,
        short_dir: Path, device_class: str) -> None:
    _run(controlplane, controlplane_binary, admin, namespace, short_dir, seed=22, restart=True)
