"""The kubelet's device manager against sharegpu's agent, on the real API server.

- :func:`place` makes pods as the extender leaves them: bound to a node (``spec.nodeName``), the
  decision recorded with :func:`sharegpu.core.annotations.encode` (both generations, an assume-time
  per bind), shapes mixed — one container, several containers (possibly on different GPUs),
  several GPUs (``aliyun.com/gpu-count``), memory and compute (``core_mem``).
- :class:`DeviceManagerRun` runs ``sharegpu-controlplane kubelet-devicemanager`` (the kubelet's
  ``pkg/kubelet/cm/devicemanager`` behind the topology manager's admission, see
  e2e/controlplane/devicemanager.go) and returns its JSON report; with a pod-resources socket it
  also serves the kubelet's pod-resources API there, read with :func:`list_pod_resources`.
- :func:`expected` is what a container must get, read from its own pod's annotations and the
  fake NVML's GPUs alone; :func:`mismatches` compares every container of the report with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from sharegpu.agent.allocate import ANN_GRANT
from sharegpu.agent.devices import SEP
from sharegpu.agent.isolation import HAMI_CONTAINER_LIBRARY
from sharegpu.agent.proto import podresources_v1_pb2 as pr
from sharegpu.agent.proto import podresources_v1_pb2_grpc as pr_grpc
from sharegpu.core import names
from sharegpu.core.annotations import Allocation, decode, encode
from sharegpu.core.request import parse_pod
from sharegpu.core.startingpods import StartingPods, container_grants

IMAGE = "registry.invalid/sharegpu/cuda:never-pulled"  # no container runtime: never pulled


@dataclass(frozen=True)
class FakeGpu:
    index: int
    name: str
    gib: int

    @property
    def uuid(self) -> str:
        # sharegpu.agent.nvml.FakeNvml's UUIDs
        i = self.index
        return f"GPU-fake{i:04d}-0000-4000-8000-{i:012d}"


def fake_gpus(spec: str) -> list[FakeGpu]:
    """``"Tesla-T4:15,..."`` (the agent's --fake-gpus) → the GPUs the fake NVML will report."""
    out = []
    for i, part in enumerate(spec.split(",")):
        name, _, gib = part.rpartition(":")
        out.append(FakeGpu(i, name, int(gib)))
    return out


def pod_object(name: str, namespace: str, node: str, reqs: Sequence[Mapping[str, int]],
               alloc: Allocation, assume_ns: int, *, gpu_count: int | None = None,
               capacity: Mapping[int, int] | None = None) -> dict[str, Any]:
    """A pod with one container per ``reqs`` entry ({"mem": GiB, "core": %}), bound to ``node``
    with the extender's annotations for ``alloc``."""
    containers = []
    for i, r in enumerate(reqs):
        limits = {names.RES_GPU_MEM: str(r["mem"])}
        if r.get("core"):
            limits[names.RES_GPU_CORE] = str(r["core"])
        containers.append({"name": f"c{i}", "image": IMAGE,
                           "resources": {"limits": limits, "requests": dict(limits)}})
    labels = {"sharegpu-e2e": "devicemanager"}
    if gpu_count:
        labels[names.POD_LABEL_GPU_COUNT] = str(gpu_count)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels,
                     "annotations": encode(alloc, assume_time_ns=assume_ns,
                                           gpu_capacity=capacity)},
        "spec": {"nodeName": node, "containers": containers,
                 "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0},
    }


def place(n: int, gpus: Sequence[FakeGpu], *, seed: int, core: bool = False,
          starting: StartingPods | None = None,
          ) -> list[tuple[str, list[dict[str, int]], Allocation, int | None]]:
    """``n`` pod shapes and placements, as a bin-packing scheduler could have chosen them on
    these GPUs: (kind, container requests, decision, gpu-count label). With ``core`` every
    container also asks for compute on its (single) GPU. With ``starting`` (the pods of the
    node the kubelet has not started), only placements the extender's binder lets through
    while none of them has started (sharegpu.core.startingpods)."""
    rng = random.Random(seed)
    free_mem = [g.gib for g in gpus]
    free_core = [100] * len(gpus)
    out: list[tuple[str, list[dict[str, int]], Allocation, int | None]] = []
    kinds = ["single"] * 3 + ["multi-container"] * 2 + ([] if core else ["multi-gpu"])
    twins: dict[str, Allocation] = {}  # a placed shape's decision, to place a twin on
    for _ in range(100_000):
        if len(out) == n:
            break
        kind = rng.choice(kinds)
        count = None
        if kind == "single":
            reqs = [{"mem": rng.randint(1, 3)}]
        elif kind == "multi-container":
            reqs = [{"mem": rng.randint(1, 2)} for _ in range(rng.randint(2, 3))]
        else:
            count = 2
            reqs = [{"mem": 2 * rng.randint(1, 2)}]
        if core:
            for r in reqs:
                r["core"] = rng.choice([5, 10])
        mem, cores = list(free_mem), list(free_core)
        alloc_mem: dict[int, dict[int, int]] = {}
        alloc_core: dict[int, dict[int, int]] = {}
        # with the kubelet not running, the binder lets a pod through beside a starting pod
        # making the same first request only as its twin: half the time take a twin's GPUs
        twin = twins.get(repr((reqs, count))) if starting is not None else None
        if twin is not None and rng.random() < 0.5:
            twin = None
        for c, r in enumerate(reqs):
            k = count or 1
            per = r["mem"] // k
            fits = [g for g in range(len(gpus)) if mem[g] >= per and cores[g] >= r.get("core", 0)]
            if twin is not None:
                fits = [g for g in twin.mem[c] if g in fits]
            if len(fits) < k:
                break
            chosen = rng.sample(fits, k)
            for g in chosen:
                mem[g] -= per
                cores[g] -= r.get("core", 0)
            alloc_mem[c] = {g: per for g in chosen}
            if r.get("core"):
                alloc_core[c] = {g: r["core"] for g in chosen}
        else:
            alloc = Allocation(mem=alloc_mem, core=alloc_core)
            if starting is not None:
                obj = pod_object(f"p{len(out):02d}", "ns", "node", reqs, alloc, 0,
                                 gpu_count=count)
                req = parse_pod(obj)
                if starting.conflict("node", req, alloc) is not None:
                    continue
                starting.add(req.key, "node", req, alloc)
                twins.setdefault(repr((reqs, count)), alloc)
            free_mem, free_core = mem, cores
            out.append((kind, reqs, alloc, count))
    assert len(out) == n, f"only {len(out)} pods fit"
    return out


class DeviceManagerRun:
    """``sharegpu-controlplane kubelet-devicemanager`` as a process (killed with its group)."""

    READY = b"pod source synced"

    def __init__(self, binary: Path, *, node: str, kubeconfig: Path, plugin_dir: Path,
                 expect_pods: int, output: Path, log: Path, wait_resources: Sequence[str],
                 timeout: float = 240, pod_resources_socket: Path | None = None,
                 linger: float = 0) -> None:
        """With ``pod_resources_socket`` it serves the kubelet's pod-resources API there from
        before it takes the pods; with ``linger`` it keeps serving (kubelet.sock and that socket)
        this many seconds after writing its report."""
        self.argv = [str(binary), "kubelet-devicemanager", f"--node={node}",
                     f"--kubeconfig={kubeconfig}", f"--device-plugin-dir={plugin_dir}",
                     f"--expect-pods={expect_pods}", f"--timeout={int(timeout)}s",
                     f"--wait-resources={','.join(wait_resources)}", f"--output={output}",
                     "--v=4"]
        if pod_resources_socket is not None:
            self.argv.append(f"--pod-resources-socket={pod_resources_socket}")
        if linger:
            self.argv.append(f"--linger={linger:g}s")
        self.pod_resources_socket = pod_resources_socket
        self.output, self.log, self.timeout = output, log, timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.t0 = 0.0

    def start(self) -> DeviceManagerRun:
        from .controlplane import _die_with_parent

        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        return self

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 60) -> None:
        """Until the plugins' devices arrived and its pod source has listed the node's pods (so
        pods bound from now on reach it one watch event at a time)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.READY not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"kubelet-devicemanager not ready:\n{self.log_tail()}")
            time.sleep(0.05)

    def wait_report(self) -> dict[str, Any]:
        """Its report, once written (it may still be running: ``linger``)."""
        assert self.proc is not None
        deadline = time.monotonic() + self.timeout + 30
        while not self.output.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"kubelet-devicemanager wrote no report:\n{self.log_tail()}")
            time.sleep(0.05)
        return json.loads(self.output.read_text())

    def finish(self) -> tuple[dict[str, Any], float]:
        """Its report and wall time, once it exits."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=self.timeout + 30)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"kubelet-devicemanager still running:\n{self.log_tail()}") from None
        wall = time.monotonic() - self.t0
        if rc != 0:
            raise AssertionError(f"kubelet-devicemanager exited {rc}:\n{self.log_tail()}")
        return json.loads(self.output.read_text()), wall

    def end_linger(self) -> None:
        """SIGTERM it: it stops lingering and exits 0 (read the report with :meth:`finish`)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        from .controlplane import _kill_group

        if self.proc is not None:
            _kill_group(self.proc, grace=5)

    def count(self, text: str) -> int:
        return self.log.read_text(errors="replace").count(text)


def list_pod_resources(socket: Path, timeout: float = 10) -> dict[str, dict[str, dict[str, list[str]]]]:
    """The kubelet's pod-resources API v1 ``List`` on ``socket``, through sharegpu's stubs:
    "namespace/name" → container → resource → device IDs (sorted)."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        resp = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(),
                                                              timeout=timeout)
    out: dict[str, dict[str, dict[str, list[str]]]] = {}
    for p in resp.pod_resources:
        containers = out.setdefault(f"{p.namespace}/{p.name}", {})
        for c in p.containers:
            devs = containers.setdefault(c.name, {})
            for d in c.devices:
                devs.setdefault(d.resource_name, []).extend(d.device_ids)
            for ids in devs.values():
                ids.sort()
    return out


def device_requests(pod: Mapping[str, Any]) -> dict[str, set[str]]:
    """container → the device-plugin resources (sharegpu's) its limits ask for."""
    ours = {names.RES_GPU_MEM, names.RES_GPU_CORE}
    return {c["name"]: {r for r in (c.get("resources") or {}).get("limits") or {} if r in ours}
            for c in pod["spec"]["containers"]}


class PodResourcesPoller:
    """Lists the pod-resources API over and over in a thread while the kubelet admits pods, and
    counts in each answer the *pending* pods: those with a container that asks for one of its
    device resources (``requests``: "namespace/name" → :func:`device_requests`) but holds none
    of it. The kubelet adds a pod to its pod manager just before admitting it and allocates all
    of its containers in the admission, so no answer may show more than one. Refusals by the
    server's rate limiter, and a socket not there yet, are skipped."""

    def __init__(self, socket: Path, requests: Mapping[str, Mapping[str, set[str]]],
                 interval: float = 0.02) -> None:
        self.socket, self.requests, self.interval = socket, requests, interval
        self.lists = 0  # answers read
        self.with_pending = 0  # answers showing exactly one pending pod
        self.refused = 0  # calls refused (rate limit, no socket yet)
        self.violations: list[list[str]] = []  # the pending pods of answers with several
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-resources-poller",
                                        daemon=True)

    def start(self) -> PodResourcesPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                listing = list_pod_resources(self.socket, timeout=5)
            except grpc.RpcError:
                self.refused += 1
                continue
            self.lists += 1
            pending = pending_pods(listing, self.requests)
            if len(pending) > 1:
                self.violations.append(pending)
            elif pending:
                self.with_pending += 1


def pending_pods(listing: Mapping[str, Mapping[str, Mapping[str, list[str]]]],
                 requests: Mapping[str, Mapping[str, set[str]]]) -> list[str]:
    """The pods of a :func:`list_pod_resources` answer with a container that asks for a device
    resource and holds none of it."""
    out = []
    for ref, containers in listing.items():
        for name, resources in requests.get(ref, {}).items():
            if any(not containers.get(name, {}).get(r) for r in resources):
                out.append(ref)
                break
    return sorted(out)


def expected(pod: Mapping[str, Any], container: int, gpus: Sequence[FakeGpu],
             hami_library: str) -> dict[str, str]:
    """The environment container ``container`` must get, from its own pod's annotations."""
    alloc = decode(pod["metadata"]["annotations"])
    assert alloc is not None
    mem = alloc.mem[container]
    on = sorted(mem)
    env = {
        names.ENV_VISIBLE_DEVICES: ",".join(gpus[g].uuid for g in on),
        names.ENV_MEM_IDX: ",".join(str(g) for g in on),
        names.ENV_MEM_POD: str(alloc.total_mem),
        names.ENV_MEM_CONTAINER: str(sum(mem.values())),
        names.ENV_MEM_DEV: str(gpus[on[0]].gib),
        "LD_PRELOAD": HAMI_CONTAINER_LIBRARY,
    }
    for i, g in enumerate(on):
        env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{mem[g] * 1024}m"
    core = alloc.core.get(container) or {}
    if core:
        env["CUDA_DEVICE_SM_LIMIT"] = str(min(core[g] for g in on if core.get(g)))
        env["GPU_CORE_UTILIZATION_POLICY"] = "force"
    else:
        env["GPU_CORE_UTILIZATION_POLICY"] = "disable"
    return env


def mismatches(report: Mapping[str, Any], pods: Mapping[str, Mapping[str, Any]],
               gpus: Sequence[FakeGpu], hami_library: str) -> list[str]:
    """Every way a container of the report differs from what its own pod's decision says: its
    environment, the plugin devices the kubelet took for it (on the decision's GPUs, as many as
    it asked for on each), each resource's answer on its own (a compute answer naming other GPUs
    than the memory answer is hidden by the kubelet's merge), and the pod container the agent
    says it handed out (``sharegpu.io/allocated-to``)."""
    by_uuid = {g.uuid: g.index for g in gpus}
    out: list[str] = []
    seen = set()
    # what each pod container gets, as the kubelet can see it (sharegpu.core.startingpods): two
    # containers with the same grant are the same to the kubelet and get the same answer
    same: dict[str, Any] = {}
    for ref, pod in pods.items():
        alloc = decode(pod["metadata"]["annotations"])
        assert alloc is not None
        req = parse_pod(pod)
        names_of = {c.index: c.name for c in req.containers}
        for i, g in container_grants(req, alloc).items():
            same[f"{ref}/{names_of[i]}"] = g
    handed: dict[tuple[str, str], str] = {}
    for rp in report["pods"]:
        ref = f"{rp['namespace']}/{rp['name']}"
        seen.add(ref)
        pod = pods.get(ref)
        if pod is None:
            continue
        if not rp["admitted"]:
            out.append(f"{ref}: not admitted: {rp.get('reason')}: {rp.get('message')}")
            continue
        alloc = decode(pod["metadata"]["annotations"])
        assert alloc is not None
        for i, c in enumerate(rp["containers"]):
            where = f"{ref}/{c['name']}"
            if c.get("error"):
                out.append(f"{where}: {c['error']}")
                continue
            for k, v in expected(pod, i, gpus, hami_library).items():
                if c["envs"].get(k) != v:
                    out.append(f"{where}: {k}={c['envs'].get(k)!r}, its pod's decision says {v!r}")
            lib = [m.get("host_path") for m in c.get("mounts") or []
                   if m.get("container_path") == HAMI_CONTAINER_LIBRARY]
            if lib != [hami_library]:
                out.append(f"{where}: {HAMI_CONTAINER_LIBRARY} mounted from {lib}, not "
                           f"{hami_library!r}")
            mem = alloc.mem[i]
            want_dev = {names.RES_GPU_MEM: mem}
            if alloc.core.get(i):
                want_dev[names.RES_GPU_CORE] = dict(alloc.core[i])
            for res, want in want_dev.items():
                per: dict[int, int] = {}
                for d in c["device_ids"].get(res, []):
                    g = by_uuid.get(d.split(SEP, 1)[0], -1)
                    per[g] = per.get(g, 0) + 1
                if per != dict(want):
                    out.append(f"{where}: {res} devices on GPUs {per}, decision {dict(want)}")
                resp = c["responses"].get(res) or {}
                envs = resp.get("envs") or {}
                vis = envs.get(names.ENV_VISIBLE_DEVICES)
                if vis != ",".join(gpus[g].uuid for g in sorted(mem)):
                    out.append(f"{where}: the {res} answer gives {names.ENV_VISIBLE_DEVICES}="
                               f"{vis!r}")
                granted = (resp.get("annotations") or {}).get(ANN_GRANT)
                if granted != where and (granted not in same or same[granted] != same[where]):
                    out.append(f"{where}: the {res} answer was handed out to {granted!r}")
                if granted is not None and (granted, res) in handed:
                    out.append(f"{where}: the {res} answer of {granted} was handed out twice "
                               f"(also to {handed[granted, res]})")
                handed[granted or where, res] = where
    for ref in pods:
        if ref not in seen:
            out.append(f"{ref}: not in the device manager's report")
    return out


__all__ = ["IMAGE", "DeviceManagerRun", "FakeGpu", "PodResourcesPoller", "device_requests",
           "expected", "fake_gpus", "list_pod_resources", "mismatches", "pending_pods", "place",
           "pod_object"]
