"""GPU memory in use per container: NVML's per-process figures, each process mapped to its pod
and container through its cgroup (``/proc/PID/cgroup``: the pod's UID and the container's ID,
as the kubelet names its cgroups), matched to the pods bound to this node.

- :func:`cgroup_ids` and :func:`attribute` are pure: cgroup text in, pods in, figures out.
- :class:`ProcCgroups` reads ``/proc``. NVML reports the processes of the caller's PID
  namespace only, by their PID there, so the agent runs in the host's (the chart's
  ``hostPID``) and its ``/proc`` shows them.
- :class:`UsageCollector` puts them together for a scrape: NVML in a thread, the node's pods
  listed at most every ``pods_ttl`` seconds.

Only processes that run now are reported, so a container's series goes with its last GPU
process and a pod's with the pod (the series are rendered afresh at each scrape): the number
of series is bounded by the processes on the node's GPUs. Processes outside any pod (the MPS
control daemon, a host process) count in the GPU's total only.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ValidationError
from ..core.pods import is_terminated
from ..core.request import parse_pod
from .nvml import GpuProcess, Nvml

# pod<uid>: with dashes (cgroupfs driver) or underscores (systemd driver)
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
                  r"(?:\.slice)?/(?:[a-z-]*-)?([0-9a-f]{64})(?:\.scope)?(?:/|$)")


def cgroup_ids(text: str) -> tuple[str, str] | None:
    """``(pod UID, container ID)`` from the text of ``/proc/PID/cgroup`` (v1 or v2, the
    cgroupfs or the systemd driver, containerd, CRI-O or Docker names); ``None`` for a process
    outside a pod."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        m = _POD.search(path)
        if m is not None:
            return m[1].replace("_", "-"), m[2]
    return None


@dataclass(frozen=True, slots=True)
class ContainerUsage:
    namespace: str
    pod: str
    container: str  # "" while the pod's status does not name the container's ID yet
    gpu: int
    used_bytes: int
    uid: str = ""  # the pod's UID


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    namespace: str
    pod: str
    container: str
    gpu_mem_gib: int  # over all its GPUs
    uid: str = ""  # the pod's UID


@dataclass(frozen=True, slots=True)
class Usage:
    """One scrape's figures: per container and GPU, per GPU (every process), allocations."""

    containers: tuple[ContainerUsage, ...] = ()
    gpus: Mapping[int, int] | None = None  # index -> bytes used by every process
    allocations: tuple[ContainerAllocation, ...] = ()


def _container_ids(pod: Mapping[str, Any]) -> dict[str, str]:
    """Container ID (without the ``containerd://`` scheme) -> container name."""
    out: dict[str, str] = {}
    status = pod.get("status") or {}
    for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
        for cs in status.get(key) or ():
            if isinstance(cs, Mapping) and isinstance(cs.get("containerID"), str):
                out[cs["containerID"].rpartition("://")[2]] = str(cs.get("name", ""))
    return out


def attribute(procs: Iterable[GpuProcess], cgroup_of: Callable[[int], str | None],
              pods: Iterable[Mapping[str, Any]]) -> Usage:
    """Each process's memory to its pod's container (summed per container and GPU), and every
    process's to its GPU's total."""
    by_uid: dict[str, Mapping[str, Any]] = {}
    allocations: list[ContainerAllocation] = []
    for p in pods:
        meta = p.get("metadata") or {}
        if is_terminated(p):
            continue
        uid = meta.get("uid")
        if isinstance(uid, str) and uid:
            by_uid[uid] = p
        try:
            req = parse_pod(p, dra_note=False)
        except ValidationError:
            continue
        for c in req.containers:
            if c.gpu_mem:
                allocations.append(ContainerAllocation(
                    req.namespace, req.name, c.name, c.total_mem, str(uid or "")))
    sums: dict[tuple[str, str, str, int, str], int] = {}
    gpus: dict[int, int] = {}
    names: dict[str, dict[str, str]] = {}
    for proc in procs:
        gpus[proc.gpu] = gpus.get(proc.gpu, 0) + proc.used_bytes
        text = cgroup_of(proc.pid)
        ids = cgroup_ids(text) if text else None
        if ids is None or ids[0] not in by_uid:
            continue
        pod = by_uid[ids[0]]
        if ids[0] not in names:
            names[ids[0]] = _container_ids(pod)
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace", "default")), str(meta.get("name", "")),
               names[ids[0]].get(ids[1], ""), proc.gpu, ids[0])
        sums[key] = sums.get(key, 0) + proc.used_bytes
    return Usage(tuple(ContainerUsage(ns, name, ctr, gpu, v, uid)
                       for (ns, name, ctr, gpu, uid), v in sorted(sums.items())), gpus,
                 tuple(allocations))


class ProcCgroups:
    """``cgroup_of(pid)``: the text of ``<root>/<pid>/cgroup``, ``None`` when it cannot be read
    (the process ended, or its PID is not in this PID namespace)."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = Path(root)

    def __call__(self, pid: int) -> str | None:
        try:
            return (self.root / str(pid) / "cgroup").read_text(encoding="utf-8",
                                                               errors="replace")
        except OSError:
            return None


class UsageCollector:
    """What a scrape reports, read when asked: NVML's processes of every GPU (in a thread:
    NVML blocks), their cgroups, and the node's pods (listed again after ``pods_ttl``)."""

    def __init__(self, nvml: Nvml, gpus: Iterable[int],
                 list_pods: Callable[[], Awaitable[list[dict[str, Any]]]],
                 cgroup_of: Callable[[int], str | None], *, pods_ttl: float = 10.0) -> None:
        self.nvml = nvml
        self.gpus = tuple(gpus)
        self.list_pods = list_pods
        self.cgroup_of = cgroup_of
        self.pods_ttl = pods_ttl
        self._pods: list[dict[str, Any]] = []
        self._listed_at: float | None = None

    async def collect(self) -> Usage:
        def read() -> list[GpuProcess]:
            return [p for g in self.gpus for p in self.nvml.processes(g)]

        procs = await asyncio.to_thread(read)
        now = asyncio.get_running_loop().time()
        if self._listed_at is None or now - self._listed_at > self.pods_ttl:
            self._pods = await self.list_pods()
            self._listed_at = now
        return await asyncio.to_thread(attribute, procs, self.cgroup_of, self._pods)
