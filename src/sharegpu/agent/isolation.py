"""What a container gets besides its GPUs: the environment and mounts of the node's isolation
back-end (SPEC §6).

- ``hami`` (modes ``cgpu`` and ``core_mem``): HAMi-core's ``libvgpu.so`` preloaded with
  ``LD_PRELOAD``; ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` per visible GPU and, when the pod asks for
  compute, ``CUDA_DEVICE_SM_LIMIT``.
- ``mps`` (mode ``mps``): the MPS client limits ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, with the control daemon's pipe directory mounted.
- ``none`` (mode ``share``, ``CGPU_DISABLE=true`` on the container, node label
  ``cgpu.disable.isolation=true``): only the GPUs.

Inside the container the visible GPUs are numbered 0..k-1 in ascending host index order
(``CUDA_DEVICE_ORDER=PCI_BUS_ID`` keeps CUDA's numbering the same as NVML's), so limit ``<i>``
belongs to the i-th GPU of the container.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from .. import names
from ..errors import ValidationError
from ..modes import Mode


class Backend(StrEnum):
    HAMI = "hami"
    MPS = "mps"
    NONE = "none"


ISOLATION_CHOICES = ("auto", "hami", "mps", "none")


def backend_for(choice: str, mode: Mode) -> Backend:
    """The back-end for ``--isolation`` (``auto`` follows the node's mode)."""
    if choice not in ISOLATION_CHOICES:
        raise ValidationError("--isolation", choice, "must be auto, hami, mps or none")
    if choice != "auto":
        return Backend(choice)
    if mode in (Mode.CGPU, Mode.CORE_MEM):
        return Backend.HAMI
    if mode is Mode.MPS:
        return Backend.MPS
    return Backend.NONE


@dataclass(frozen=True)
class IsolationConfig:
    hami_library: str = "/usr/local/vgpu/libvgpu.so"  # host path, mounted at the same path
    hami_cache_dir: str = "/tmp/sharegpu-vgpu"  # host dir for HAMi-core's shared usage file
    hami_lock_dir: str = "/tmp/vgpulock"  # host dir shared by every container on the node
    mps_pipe_dir: str = "/run/nvidia/mps"  # host dir of the MPS control daemon's pipes
    mps_container_pipe_dir: str = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerEnv:
    envs: dict[str, str]
    mounts: tuple[Mount, ...] = ()


def is_true(v: str | None) -> bool:
    return str(v or "").strip().lower() == "true"


def isolation_env(
    backend: Backend,
    *,
    mem: Mapping[int, int],
    core: Mapping[int, int],
    pod_uid: str,
    config: IsolationConfig,
) -> ContainerEnv:
    """Env and mounts of ``backend`` for a container with ``mem[gpu]`` GiB and ``core[gpu]``
    percent on its GPUs (host indices)."""
    gpus = sorted(mem)
    envs: dict[str, str] = {}
    mounts: list[Mount] = []
    if backend is Backend.HAMI:
        envs["LD_PRELOAD"] = config.hami_library
        envs["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        for i, g in enumerate(gpus):
            envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{int(mem[g]) * 1024}m"
        sm = _compute(core, gpus)
        if sm is not None:
            envs["CUDA_DEVICE_SM_LIMIT"] = str(sm)
        uid = pod_uid or "pod"
        envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = f"/tmp/sharegpu-vgpu/{uid}.cache"
        mounts.append(Mount(config.hami_library, config.hami_library, True))
        mounts.append(Mount("/tmp/sharegpu-vgpu", f"{config.hami_cache_dir}/{uid}", False))
        # HAMi-core serialises its per-GPU bookkeeping across containers with lock files here
        mounts.append(Mount("/tmp/vgpulock", config.hami_lock_dir, False))
    elif backend is Backend.MPS:
        envs["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        envs["CUDA_MPS_PIPE_DIRECTORY"] = config.mps_container_pipe_dir
        envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
            f"{i}={int(mem[g]) * 1024}M" for i, g in enumerate(gpus)
        )
        sm = _compute(core, gpus)
        if sm is not None:
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(sm)
        mounts.append(Mount(config.mps_container_pipe_dir, config.mps_pipe_dir, False))
    return ContainerEnv(envs, tuple(mounts))


def _compute(core: Mapping[int, int], gpus: list[int]) -> int | None:
    """One compute percentage for the container (both back-ends take a single value): the
    smallest share it holds on any of its GPUs."""
    values = [int(core[g]) for g in gpus if core.get(g)]
    return min(values) if values else None


def disabled(container: Mapping[str, object], node_labels: Mapping[str, str]) -> bool:
    """``CGPU_DISABLE=true`` in the container's env, or ``cgpu.disable.isolation=true`` on the
    node."""
    if is_true(node_labels.get(names.LABEL_DISABLE_ISOLATION)):
        return True
    for e in container.get("env") or []:  # type: ignore[union-attr]
        if isinstance(e, Mapping) and e.get("name") == names.ENV_CGPU_DISABLE:
            return is_true(e.get("value"))  # type: ignore[arg-type]
    return False
