"""What a container gets besides its GPUs: the environment and mounts of the node's isolation
back-end (``hami``, ``mps``, ``hami-mps`` or ``none``; SPEC §6), and the cGPU compute policy
that decides how compute is shared. What each back-end sets and holds, and which compute
policies it can honour: docs/agent.md ("Isolation") and docs/isolation.md.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any

from ..core import names
from ..core.errors import ValidationError
from ..core.modes import Mode
from ..core.request import is_true, isolation_opted_out

# Where a container finds HAMi-core: the path HAMi mounts it at, and the one HAMi-core opens to
# find its own hooks (``CUDA_REDIRECT`` names another, for a process outside a container).
HAMI_CONTAINER_LIBRARY = "/usr/local/vgpu/libvgpu.so"
# The loader's own preload list, which a container's environment cannot change: a pod that sets
# LD_PRELOAD itself (jemalloc, say) replaces the agent's LD_PRELOAD, since the kubelet puts the
# pod's variables after the device plugin's; the library named here is loaded all the same.
PRELOAD_LIST = "/etc/ld.so.preload"
PRELOAD_FILE = "ld.so.preload"  # the host file the agent writes into its state directory


def preload_list_text() -> str:
    return HAMI_CONTAINER_LIBRARY + "\n"


class Backend(StrEnum):
    HAMI = "hami"
    MPS = "mps"
    HAMI_MPS = "hami-mps"
    NONE = "none"

    @property
    def uses_hami(self) -> bool:
        """Whether its containers preload HAMi-core's library."""
        return self in (Backend.HAMI, Backend.HAMI_MPS)

    @property
    def uses_mps(self) -> bool:
        """Whether its containers are clients of the node's MPS control daemon."""
        return self in (Backend.MPS, Backend.HAMI_MPS)


ISOLATION_CHOICES = ("auto", "hami", "mps", "hami-mps", "none")
# What ``auto`` may give a core_mem node (``--core-mem-isolation``): hami until GPU figures for
# hami-mps are in (bench/README.md, "Isolation on a real GPU").
CORE_MEM_CHOICES = ("hami", "hami-mps")


class ComputePolicy(IntEnum):
    EVEN = 0
    PREEMPTIVE = 1
    WEIGHTED = 2
    FIXED = 3
    SOFT = 4
    NATIVE = 5


POLICY_NAMES = {
    ComputePolicy.EVEN: "even time slices",
    ComputePolicy.PREEMPTIVE: "preemptive",
    ComputePolicy.WEIGHTED: "weighted preemptive",
    ComputePolicy.FIXED: "fixed share",
    ComputePolicy.SOFT: "soft (lends idle compute)",
    ComputePolicy.NATIVE: "native",
}

# What each isolating back-end can honour (``none`` isolates nothing, so no policy applies).
SUPPORTED_POLICIES: dict[Backend, frozenset[ComputePolicy]] = {
    Backend.HAMI: frozenset({ComputePolicy.FIXED, ComputePolicy.NATIVE}),
    Backend.MPS: frozenset({ComputePolicy.FIXED, ComputePolicy.NATIVE}),
    Backend.HAMI_MPS: frozenset({ComputePolicy.FIXED, ComputePolicy.NATIVE}),
}


def parse_core_mem(choice: str) -> Backend:
    """``--core-mem-isolation``: the back-end ``auto`` gives a core_mem node."""
    if choice not in CORE_MEM_CHOICES:
        raise ValidationError("--core-mem-isolation", choice, "must be hami or hami-mps")
    return Backend(choice)


def backend_for(choice: str, mode: Mode, core_mem: Backend = Backend.HAMI) -> Backend:
    """The back-end for ``--isolation`` (``auto`` follows the node's mode; a core_mem node gets
    ``core_mem``)."""
    if choice not in ISOLATION_CHOICES:
        raise ValidationError("--isolation", choice, "must be auto, hami, mps, hami-mps or none")
    if choice != "auto":
        return Backend(choice)
    if mode is Mode.CORE_MEM:
        return core_mem
    if mode is Mode.CGPU:
        return Backend.HAMI
    if mode is Mode.MPS:
        return Backend.MPS
    return Backend.NONE


def possible_backends(choice: str, core_mem: Backend = Backend.HAMI) -> list[Backend]:
    """Every back-end the agent may use with ``--isolation choice`` (the node's mode can change
    while the agent runs, so ``auto`` may use any)."""
    if choice == "auto":
        return sorted({Backend.HAMI, Backend.MPS, core_mem}, key=list(Backend).index)
    return [Backend(choice)] if choice in ISOLATION_CHOICES else []


def parse_policy(value: object, isolation: str = "auto",
                 core_mem: Backend = Backend.HAMI) -> ComputePolicy:
    """``--compute-policy``: 0-5, refused when a back-end the agent may use cannot honour it."""
    try:
        policy = ComputePolicy(int(str(value).strip()))
    except ValueError:
        raise ValidationError("--compute-policy", value, "must be one of 0, 1, 2, 3, 4, 5 "
                              "(ACK's cGPU policies; 5 = native, the default)") from None
    refusing = [b for b in possible_backends(isolation, core_mem)
                if b in SUPPORTED_POLICIES and policy not in SUPPORTED_POLICIES[b]]
    if refusing:
        which = " and ".join([", ".join(b.value for b in refusing[:-1]), refusing[-1].value]
                             if len(refusing) > 1 else [refusing[0].value])
        raise ValidationError(
            "--compute-policy", value,
            f"policy {int(policy)} ({POLICY_NAMES[policy]}) cannot be honoured by the {which} "
            "back-end: HAMi-core throttles kernel launches against a cap and MPS caps the SMs "
            "of a client, neither schedules time slices or lends idle compute; use 5 (native) "
            "or 3 (fixed share)",
        )
    return policy


@dataclass(frozen=True)
class IsolationConfig:
    hami_library: str = "/usr/local/vgpu/libvgpu.so"  # host path, mounted at HAMI_CONTAINER_LIBRARY
    hami_cache_dir: str = "/tmp/sharegpu-vgpu"  # host dir for HAMi-core's shared usage file
    hami_lock_dir: str = "/tmp/vgpulock"  # host dir shared by every container on the node
    # host file holding preload_list_text(), mounted as the container's /etc/ld.so.preload
    hami_preload_file: str = "/var/lib/sharegpu/ld.so.preload"
    mps_pipe_dir: str = "/run/nvidia/mps"  # host dir of the MPS control daemon's pipes
    mps_shm_dir: str = "/run/nvidia/mps-shm"  # host dir the daemon and clients share as /dev/shm
    mps_container_pipe_dir: str = "/tmp/nvidia-mps"
    # the user the MPS control daemon runs as (the chart's mps-control container: root); MPS
    # serves one user at a time, so its clients must run as the same user
    mps_user: int = 0
    compute_policy: ComputePolicy = ComputePolicy.NATIVE


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerEnv:
    envs: dict[str, str]
    mounts: tuple[Mount, ...] = ()


# The variables that carry a compute cap (the compute half of a core_mem container repeats them).
COMPUTE_ENVS = frozenset({"CUDA_DEVICE_SM_LIMIT", "GPU_CORE_UTILIZATION_POLICY",
                          "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"})


def compute_cap(
    policy: ComputePolicy,
    *,
    mem: Mapping[int, int],
    core: Mapping[int, int],
    gpu_mem: Mapping[int, int] | None = None,
) -> int | None:
    """The compute cap (percent) of a container under ``policy``, or ``None`` for no cap.

    Both back-ends take one value per container: the smallest share it holds on any of its GPUs.
    """
    gpus = sorted(mem)
    asked = [int(core[g]) for g in gpus if core.get(g)]
    if asked:
        return min(asked)
    if policy is ComputePolicy.FIXED and gpu_mem:
        shares = [math.ceil(100 * int(mem[g]) / int(gpu_mem[g]))
                  for g in gpus if gpu_mem.get(g)]
        if shares:
            return max(1, min(100, min(shares)))
    return None


def isolation_env(
    backend: Backend,
    *,
    mem: Mapping[int, int],
    core: Mapping[int, int],
    pod_uid: str,
    config: IsolationConfig,
    gpu_mem: Mapping[int, int] | None = None,
) -> ContainerEnv:
    """Env and mounts of ``backend`` for a container with ``mem[gpu]`` GiB and ``core[gpu]``
    percent on its GPUs (host indices); ``gpu_mem[gpu]`` is each GPU's size in GiB (for the
    fixed-share policy)."""
    gpus = sorted(mem)
    envs: dict[str, str] = {}
    mounts: list[Mount] = []
    cap = compute_cap(config.compute_policy, mem=mem, core=core, gpu_mem=gpu_mem)
    capped = cap is not None and cap < names.CORE_PER_GPU
    if backend.uses_hami:
        _hami(envs, mounts, gpus, mem, pod_uid, config,
              sm_limit=cap if capped and backend is Backend.HAMI else None)
    if backend.uses_mps:
        _mps(envs, mounts, gpus, mem, config, thread_percentage=cap if capped else None)
    return ContainerEnv(envs, tuple(mounts))


def _hami(envs: dict[str, str], mounts: list[Mount], gpus: list[int], mem: Mapping[int, int],
          pod_uid: str, config: IsolationConfig, *, sm_limit: int | None) -> None:
    """HAMi-core: the container-wide memory limit, and its launch throttle at ``sm_limit``
    (``None``: off)."""
    envs["LD_PRELOAD"] = HAMI_CONTAINER_LIBRARY
    envs["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    for i, g in enumerate(gpus):
        envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{int(mem[g]) * 1024}m"
    if sm_limit is not None:
        envs["CUDA_DEVICE_SM_LIMIT"] = str(sm_limit)
        envs["GPU_CORE_UTILIZATION_POLICY"] = "force"
    else:
        envs["GPU_CORE_UTILIZATION_POLICY"] = "disable"
    uid = pod_uid or "pod"
    envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = f"/tmp/sharegpu-vgpu/{uid}.cache"
    mounts.append(Mount(HAMI_CONTAINER_LIBRARY, config.hami_library, True))
    mounts.append(Mount(PRELOAD_LIST, config.hami_preload_file, True))
    mounts.append(Mount("/tmp/sharegpu-vgpu", f"{config.hami_cache_dir}/{uid}", False))
    # HAMi-core serialises how a starting process finds its host PID (a lock file here, around
    # its diff of NVML's process list): shared only by the containers on the same GPUs, so a
    # tenant holding the lock stalls no container on other GPUs
    mounts.append(Mount("/tmp/vgpulock", hami_lock_dir(config.hami_lock_dir, gpus), False))


def hami_lock_dir(root: str, gpus: Sequence[int]) -> str:
    """The host directory a container on ``gpus`` (host indices) gets as ``/tmp/vgpulock``:
    one per GPU set under the node's lock directory ``root``."""
    return f"{root.rstrip('/')}/gpu-{'-'.join(str(g) for g in sorted(gpus))}"


def is_lock_dir(path: str, root: str) -> bool:
    """Whether ``path`` is one of the lock directories under ``root``."""
    return os.path.dirname(path) == root.rstrip("/")


def _mps(envs: dict[str, str], mounts: list[Mount], gpus: list[int], mem: Mapping[int, int],
         config: IsolationConfig, *, thread_percentage: int | None) -> None:
    """An MPS client: the daemon's pipe directory and shared memory, each process's memory
    limit, and its share of the SMs (``None``: all)."""
    envs["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    envs["CUDA_MPS_PIPE_DIRECTORY"] = config.mps_container_pipe_dir
    envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
        f"{i}={int(mem[g]) * 1024}M" for i, g in enumerate(gpus)
    )
    if thread_percentage is not None:
        envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage)
    mounts.append(Mount(config.mps_container_pipe_dir, config.mps_pipe_dir, False))
    # the MPS server and its clients exchange buffers through shared memory
    mounts.append(Mount("/dev/shm", config.mps_shm_dir, False))


# The variables each back-end's limits live in. A container that sets one itself would replace
# the agent's (the kubelet puts the pod's variables after the device plugin's), so it is
# refused. ``LD_PRELOAD`` is not among them: the loader's preload list loads HAMi-core anyway.
HAMI_LIMIT_ENVS = ("CUDA_DEVICE_SM_LIMIT", "GPU_CORE_UTILIZATION_POLICY",
                   "CUDA_DEVICE_MEMORY_SHARED_CACHE", "CUDA_DISABLE_CONTROL")
HAMI_LIMIT_PREFIX = "CUDA_DEVICE_MEMORY_LIMIT"
MPS_LIMIT_PREFIX = "CUDA_MPS_"


def overridden_limits(backend: Backend, container: Mapping[str, Any]) -> list[str]:
    """The variables of ``backend``'s limits that ``container`` (a pod spec's container) sets
    itself, sorted."""
    out = set()
    for e in container.get("env") or []:
        name = str(e.get("name") or "") if isinstance(e, Mapping) else ""
        if backend.uses_hami and (name in HAMI_LIMIT_ENVS or name.startswith(HAMI_LIMIT_PREFIX)):
            out.add(name)
        if backend.uses_mps and name.startswith(MPS_LIMIT_PREFIX):
            out.add(name)
    return sorted(out)


LIMIT_RULE = ("a container under isolation gets its limits from the agent alone: it may not set "
              "the back-end's variables (env, or envFrom that could hold them), LD_PRELOAD, or "
              "mount anything at the back-end's paths")


def _could_name(prefix: str, backend: Backend) -> bool:
    """Whether ``prefix`` + some key can be a limit variable of ``backend`` or ``LD_PRELOAD``."""
    names_: list[str] = ["LD_PRELOAD"]
    prefixes: list[str] = []
    if backend.uses_hami:
        names_ += list(HAMI_LIMIT_ENVS)
        prefixes.append(HAMI_LIMIT_PREFIX)
    if backend.uses_mps:
        prefixes.append(MPS_LIMIT_PREFIX)
    return any(n.startswith(prefix) for n in names_ + prefixes) or \
        any(prefix.startswith(p) for p in prefixes)


def limit_paths(backend: Backend, config: IsolationConfig) -> tuple[str, ...]:
    """The container paths whose content enforces ``backend``'s limits."""
    out: list[str] = []
    if backend.uses_hami:
        out += [PRELOAD_LIST, HAMI_CONTAINER_LIBRARY]
    if backend.uses_mps:
        out.append(config.mps_container_pipe_dir)
    return tuple(out)


def own_limit_routes(backend: Backend, container: Mapping[str, Any],
                     config: IsolationConfig) -> list[str]:
    """Every route by which ``container`` (a pod spec's container) could set ``backend``'s
    limits itself, each naming its field: a limit variable or ``LD_PRELOAD`` in ``env``; an
    ``envFrom`` source whose keys (the agent reads no ConfigMap or Secret) could, with its
    ``prefix``, be one; a volume mounted at, or under, a path the back-end's limits rely on
    (the loader's preload list, HAMi-core's library, the MPS pipe directory). Empty for
    ``Backend.NONE``."""
    if backend is Backend.NONE:
        return []
    out = [f"env {n}" for n in overridden_limits(backend, container)]
    for e in container.get("env") or []:
        if isinstance(e, Mapping) and e.get("name") == "LD_PRELOAD":
            out.append("env LD_PRELOAD")
    for i, src in enumerate(container.get("envFrom") or []):
        if not isinstance(src, Mapping):
            continue
        prefix = str(src.get("prefix") or "")
        if not _could_name(prefix, backend):
            continue
        kind = next((k for k in ("configMapRef", "secretRef") if k in src), "source")
        ref = src.get(kind) if isinstance(src.get(kind), Mapping) else {}
        what = f"{kind} {ref.get('name') or '(unnamed)'}"
        how = f"prefix {prefix!r}" if prefix else "no prefix"
        out.append(f"envFrom[{i}] ({what}, {how}: its keys are not known to the agent)")
    paths = limit_paths(backend, config)
    for i, m in enumerate(container.get("volumeMounts") or []):
        if not isinstance(m, Mapping):
            continue
        at = posixpath.normpath("/" + str(m.get("mountPath") or "").strip().lstrip("/"))
        for p in paths:
            if at == p or at.startswith(p.rstrip("/") + "/"):
                out.append(f"volumeMounts[{i}] at {m.get('mountPath')} (over {p})")
    return out


def _security(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    sc = spec.get("securityContext")
    return sc if isinstance(sc, Mapping) else {}


def other_user(container: Mapping[str, Any], pod_spec: Mapping[str, Any],
               daemon_user: int) -> str | None:
    """How ``container`` (of a pod with ``pod_spec``) is known to run as another user than the
    MPS daemon's, or ``None`` (the same user, or not known: the image's own ``USER``)."""
    own, pod = _security(container), _security(pod_spec)
    uid = own.get("runAsUser", pod.get("runAsUser"))
    non_root = own.get("runAsNonRoot", pod.get("runAsNonRoot"))
    if uid is not None:
        try:
            uid = int(uid)
        except (TypeError, ValueError):
            return f"runs as runAsUser {uid!r}"
        return None if uid == daemon_user else f"runs as UID {uid}"
    if non_root is True and daemon_user == 0:
        return "must run as a non-root user (runAsNonRoot)"
    return None


def disabled(container: Mapping[str, Any], node_labels: Mapping[str, str]) -> bool:
    """``CGPU_DISABLE=true`` in the container's env, or ``cgpu.disable.isolation=true`` on the
    node."""
    return is_true(node_labels.get(names.LABEL_DISABLE_ISOLATION)) or isolation_opted_out(
        container)
