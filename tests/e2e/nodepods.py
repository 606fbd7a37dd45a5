"""Pods on real nodes for the real-node tests: creating them, waiting for them, reading what
their containers report, and comparing that with the placement recorded on the pod.

Every GPU container runs :data:`REPORTER` (python3 of the project's image): it prints one line
``SHAREGPU-REPORT {json}`` with what it received (the GPU, isolation and MPS variables; whether the
preload library, /etc/ld.so.preload, the NVML library and the MPS control socket are at their
paths; whether the preload library is mapped into the process; its whole environment, its
mounts (source root, read-only, a file's sha256, a marker written into writable directories
under ``/tmp`` when a container name is its second argument) and its device nodes) and then
sleeps, so the pod keeps running. The test reads that line from the container's log file on the
node (the kubelet's ``/var/log/pods``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sharegpu.agent.isolation import HAMI_CONTAINER_LIBRARY, PRELOAD_LIST
from sharegpu.core import annotations, names

from .controlplane import ControlPlane
from .realnode import RealNode

NAMESPACE = "sharegpu-system"  # the release's namespace
RELEASE = "sharegpu"
WORKLOADS = "gpu-workloads"  # the GPU pods' namespace
# every value given to helm beyond the chart's defaults, with the reason: none are needed
OVERRIDES: dict[str, str] = {}
REPORT_TAG = "SHAREGPU-REPORT "
REPORTER = r"""
import hashlib, json, os, stat, sys, time
env = {k: v for k, v in os.environ.items()
       if k.startswith(("NVIDIA_", "CUDA_", "ALIYUN_", "GPU_", "LD_PRELOAD"))}
pre = os.environ.get("LD_PRELOAD", "")
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
def isfile(p):
    return bool(p) and os.path.isfile(p)
maps = open("/proc/self/maps").read()
report = {
    "env": env,
    "preload_file": isfile(pre),
    "preload_list": open("/etc/ld.so.preload").read().split() if isfile("/etc/ld.so.preload") else [],
    "preload_mapped": bool(pre) and pre in maps,
    "nvml": isfile("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
    "mps_control": bool(pipe) and os.path.exists(os.path.join(pipe, "control")),
    "shm_mounted": any(l.split()[4] == "/dev/shm" and "shm" not in l.split()[-2]
                       for l in open("/proc/self/mountinfo")),
    "env_all": dict(os.environ),
}
# every mount point: the root of its source, read-only or not; a file's sha256; with a
# container name (argv[2]), a marker file written into each writable directory under /tmp
mounts = {}
for line in open("/proc/self/mountinfo"):
    f = line.split()
    mounts[f[4]] = {"root": f[3], "ro": "ro" in f[5].split(",")}
for mp, m in mounts.items():
    if mp.startswith(("/proc", "/sys")):
        continue
    try:
        if os.path.isfile(mp) and os.path.getsize(mp) < (64 << 20):
            m["sha256"] = hashlib.sha256(open(mp, "rb").read()).hexdigest()
        elif len(sys.argv) > 2 and os.path.isdir(mp) and not m["ro"] and mp.startswith("/tmp/"):
            m["marker"] = ".report-" + os.environ.get("HOSTNAME", "") + "-" + sys.argv[2]
            open(os.path.join(mp, m["marker"]), "w").write("written by the container\n")
    except OSError as e:
        m["error"] = str(e)
report["mounts"] = mounts
devices = {}
for d, _, files in os.walk("/dev"):
    for n in files:
        st = os.lstat(os.path.join(d, n))
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            devices[os.path.join(d, n)] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
report["devices"] = devices
print("SHAREGPU-REPORT " + json.dumps(report, sort_keys=True), flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def gpu_pod(name: str, limits: Sequence[Mapping[str, int]], *, node: str,
            image: str, scheduler: str = names.CO_SCHEDULER_NAME, sleep: int = 3600,
            labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A pod written as ACK's users write it: GPU resources in each container's limits, the
    co-scheduler's name; ``node`` pins it with a nodeSelector on the hostname label."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "sharegpu-e2e-gpu", **(labels or {})}},
        "spec": {
            "schedulerName": scheduler,
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 0,
            "restartPolicy": "Never",
            "containers": [
                {"name": f"c{i}", "image": image, "imagePullPolicy": "Never",
                 "command": ["python3", "-c", REPORTER, str(sleep), f"c{i}"],
                 "resources": {"limits": {r: str(v) for r, v in lim.items()}}}
                for i, lim in enumerate(limits)
            ],
        },
    }


def wait(what: str, fn: Any, timeout: float, every: float = 0.5) -> Any:
    """``fn()``'s first truthy value; fails the test after ``timeout`` seconds."""
    import pytest

    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def pod_summary(pods: Sequence[Mapping[str, Any]]) -> str:
    """One line per pod: phase, node, each container's state."""
    lines = []
    for p in pods:
        st = p.get("status", {})
        conts = [f"{s['name']}:{next(iter(s.get('state') or {'?': 0}))}"
                 f"{'(ready)' if s.get('ready') else ''}"
                 for s in (st.get("initContainerStatuses") or [])
                 + (st.get("containerStatuses") or [])]
        lines.append(f"  {p['metadata']['name']:<45} {st.get('phase')} node="
                     f"{p['spec'].get('nodeName')} {' '.join(conts)}")
    return "\n".join(lines)


def events(cp: ControlPlane, namespace: str, name: str | None = None) -> list[dict[str, Any]]:
    sel = f"?fieldSelector=involvedObject.name={name}" if name else ""
    status, body = cp.request("GET", f"/api/v1/namespaces/{namespace}/events{sel}")
    assert status == 200, body
    return json.loads(body)["items"]


def events_text(cp: ControlPlane, namespace: str) -> str:
    return "\n".join(f"  {e['involvedObject'].get('name')}: {e.get('reason')}: "
                     f"{e.get('message', '')[:300]}" for e in events(cp, namespace)[-40:])


def install_release(cluster: Any, timeout: float = 300) -> float:
    """``helm install`` of charts/sharegpu with :data:`OVERRIDES`; wait until every pod of the
    release is Running and Ready; return the seconds it took."""
    from .components import CHART, helm

    cp = cluster.cp
    t0 = time.monotonic()
    helm(cp, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
         *[a for k, v in OVERRIDES.items() for a in ("--set", f"{k}={v}")], timeout=300)

    def all_ready() -> bool:
        pods = list_pods(cp, NAMESPACE)
        return len(pods) >= 7 and all(ready(p) for p in pods)

    try:
        wait("every pod of the release Running and Ready", all_ready, timeout, every=1)
    except BaseException:
        print(pod_summary(list_pods(cp, NAMESPACE)), file=sys.stderr)
        print(events_text(cp, NAMESPACE), file=sys.stderr)
        raise
    status, _ = cp.request("POST", "/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": WORKLOADS}})
    assert status in (201, 409)
    return time.monotonic() - t0


def create(cp: ControlPlane, namespace: str, obj: Mapping[str, Any]) -> tuple[int, dict]:
    status, body = cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", obj)
    return status, json.loads(body) if body.startswith("{") else {"message": body}


def get_pod(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    status, body = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
    return json.loads(body) if status == 200 else None


def list_pods(cp: ControlPlane, namespace: str, selector: str = "") -> list[dict[str, Any]]:
    q = f"?labelSelector={selector}" if selector else ""
    status, body = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods{q}")
    assert status == 200, body
    return json.loads(body)["items"]


def ready(pod: Mapping[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return pod.get("status", {}).get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conds)


def all_started(pod: Mapping[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return bool(statuses) and all("running" in (s.get("state") or {}) for s in statuses)


def container_log(node: RealNode, pod: Mapping[str, Any], container: str) -> str:
    meta = pod["metadata"]
    d = node.host_path(f"/var/log/pods/{meta['namespace']}_{meta['name']}_{meta['uid']}"
                       f"/{container}")
    logs = sorted(d.glob("*.log")) if d.is_dir() else []
    return "".join(p.read_text(errors="replace") for p in logs)


def report(node: RealNode, pod: Mapping[str, Any], container: str,
           timeout: float = 60) -> dict[str, Any] | None:
    """The container's SHAREGPU-REPORT (CRI log lines: ``TIME STREAM TAG MESSAGE``; a line
    longer than the runtime's limit comes in parts tagged ``P``, the last one ``F``)."""
    deadline = time.monotonic() + timeout
    while True:
        message = ""
        for line in container_log(node, pod, container).splitlines():
            parts = line.split(" ", 3)
            if len(parts) != 4:
                continue
            message += parts[3]
            if parts[2] == "P":
                continue
            if message.startswith(REPORT_TAG):
                return json.loads(message[len(REPORT_TAG):])
            message = ""
        if time.monotonic() > deadline:
            return None
        time.sleep(0.3)


def node_uuids(node: RealNode) -> list[str]:
    """The fake NVML's GPU UUIDs in index order, as the node's driver reports them."""
    code = ("import pynvml; pynvml.nvmlInit(); n = pynvml.nvmlDeviceGetCount(); "
            "print(','.join(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) "
            "for i in range(n)))")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30,
        env={"LD_LIBRARY_PATH": str(node.driver_root / "lib"), "FAKENVML_GPUS": node.gpus,
             "PATH": "/usr/bin:/bin"})
    return out.stdout.strip().split(",")


@dataclass
class Check:
    """What one container received against what its pod's decision says."""

    pod: str
    container: str
    mode: str
    mismatches: list[str] = field(default_factory=list)


def expected_backend(mode: str) -> str:
    """The chart's default isolation (auto): hami on cgpu/core_mem nodes, mps on mps nodes,
    none elsewhere."""
    return {"cgpu": "hami", "core_mem": "hami", "mps": "mps"}.get(mode, "none")


def compare(pod: Mapping[str, Any], index: int, got: Mapping[str, Any] | None, mode: str,
            uuids: Sequence[str]) -> Check:
    """Compare container ``index``'s report with the pod's recorded placement."""
    spec = pod["spec"]["containers"][index]
    check = Check(pod["metadata"]["name"], spec["name"], mode)
    bad = check.mismatches
    if got is None:
        bad.append("no report in the container's log")
        return check
    env = got["env"]
    limits = spec.get("resources", {}).get("limits", {})
    alloc = annotations.decode(pod["metadata"].get("annotations") or {})
    whole = names.RES_NVIDIA_GPU in limits or names.RES_TOPOLOGY_GPU in limits
    if alloc is None:
        bad.append("no placement recorded on the pod")
        return check
    gpus = alloc.container_gpus(index)
    if not gpus and not limits:
        return check
    want_visible = ",".join(uuids[g] for g in gpus)
    if env.get(names.ENV_VISIBLE_DEVICES) != want_visible:
        bad.append(f"{names.ENV_VISIBLE_DEVICES}={env.get(names.ENV_VISIBLE_DEVICES)!r}, "
                   f"decision GPUs {list(gpus)} -> {want_visible!r}")
    if not got["nvml"]:
        bad.append("libnvidia-ml.so.1 not at its path")
    backend = "none" if whole else expected_backend(mode)
    mem = alloc.mem.get(index, {})
    core = alloc.core.get(index, {})
    if backend == "hami":
        for j, g in enumerate(gpus):
            want = f"{int(mem[g]) * 1024}m"
            if env.get(f"CUDA_DEVICE_MEMORY_LIMIT_{j}") != want:
                bad.append(f"CUDA_DEVICE_MEMORY_LIMIT_{j}={env.get(f'CUDA_DEVICE_MEMORY_LIMIT_{j}')!r}"
                           f", want {want}")
        if env.get("LD_PRELOAD") != HAMI_CONTAINER_LIBRARY or not got["preload_file"]:
            bad.append(f"preload {env.get('LD_PRELOAD')!r} (file there: {got['preload_file']})")
        if got["preload_list"] != [HAMI_CONTAINER_LIBRARY] or not got["preload_mapped"]:
            bad.append(f"{PRELOAD_LIST} {got['preload_list']}, mapped: {got['preload_mapped']}")
        want_sm = str(min(core.values())) if core and min(core.values()) < 100 else None
        if env.get("CUDA_DEVICE_SM_LIMIT") != want_sm:
            bad.append(f"CUDA_DEVICE_SM_LIMIT={env.get('CUDA_DEVICE_SM_LIMIT')!r}, want {want_sm}")
        # HAMi-core's cache and lock directories: written by the container (the image's
        # user is not root)
        for mp in ("/tmp/sharegpu-vgpu", "/tmp/vgpulock"):
            m = (got.get("mounts") or {}).get(mp)
            if m is None or m.get("ro") or m.get("error") or not m.get("marker"):
                bad.append(f"mount {mp}: not written by the container ({m})")
    elif backend == "mps":
        want = ",".join(f"{j}={int(mem[g]) * 1024}M" for j, g in enumerate(gpus))
        if env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") != want:
            bad.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="
                       f"{env.get('CUDA_MPS_PINNED_DEVICE_MEM_LIMIT')!r}, want {want}")
        if not got["mps_control"]:
            bad.append(f"no MPS control socket in {env.get('CUDA_MPS_PIPE_DIRECTORY')!r}")
        if "LD_PRELOAD" in env:
            bad.append("LD_PRELOAD set on an MPS node")
    else:
        stray = sorted(k for k in env if k.startswith("CUDA_DEVICE_MEMORY_LIMIT")
                       or k in ("LD_PRELOAD", "CUDA_MPS_PIPE_DIRECTORY"))
        if stray:
            bad.append(f"isolation variables without isolation: {stray}")
    if not whole:
        want_mem = str(sum(int(v) for v in mem.values()))
        if env.get(names.ENV_MEM_CONTAINER) != want_mem:
            bad.append(f"{names.ENV_MEM_CONTAINER}={env.get(names.ENV_MEM_CONTAINER)!r}, "
                       f"want {want_mem}")
    return check
