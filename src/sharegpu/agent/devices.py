"""The devices each resource advertises to the kubelet, and how a device ID names its GPU.

- Whole cards (``nvidia.com/gpu``, ``aliyun.com/gpu``) and ``aliyun.com/gpu-count``: one device per
  GPU, its ID the GPU's UUID.
- ``aliyun.com/gpu-mem``: one fake device per GiB of each GPU, ``<uuid>-_-<j>``; GPUs of different
  sizes get different numbers of devices.
- ``aliyun.com/gpu-core.percentage``: one fake device per percent of each GPU, ``<uuid>-_-<j>``.

A resource that the node's mode does not serve has no devices (the kubelet then reports 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..core import names
from ..core.errors import ValidationError
from ..core.modes import Mode, advertised_resources
from .nvml import Gpu

SEP = "-_-"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# Socket file name per resource, inside the kubelet's device-plugin directory.
SOCKETS: dict[str, str] = {
    names.RES_NVIDIA_GPU: "sharegpu-nvidia-gpu.sock",
    names.RES_GPU_MEM: "sharegpu-gpu-mem.sock",
    names.RES_GPU_CORE: "sharegpu-gpu-core.sock",
    names.RES_GPU_COUNT: "sharegpu-gpu-count.sock",
    names.RES_TOPOLOGY_GPU: "sharegpu-gpu.sock",
}

FAKE_RESOURCES = frozenset({names.RES_GPU_MEM, names.RES_GPU_CORE})


@dataclass(frozen=True, slots=True)
class Device:
    id: str
    gpu: int
    healthy: bool = True


def device_ids(resource: str, gpus: Sequence[Gpu]) -> list[tuple[str, int]]:
    """(device ID, GPU index) for every device ``resource`` has on these GPUs in a mode that
    serves it."""
    out: list[tuple[str, int]] = []
    for g in gpus:
        if resource == names.RES_GPU_MEM:
            out.extend((f"{g.uuid}{SEP}{j}", g.index) for j in range(g.mem_gib))
        elif resource == names.RES_GPU_CORE:
            out.extend((f"{g.uuid}{SEP}{j}", g.index) for j in range(names.CORE_PER_GPU))
        else:
            out.append((g.uuid, g.index))
    return out


def devices_for(
    resource: str, mode: Mode, gpus: Sequence[Gpu], unhealthy: Iterable[int] = ()
) -> list[Device]:
    """The devices ``resource`` advertises in ``mode``: none when the mode does not serve it."""
    if advertised_resources(mode, [g.mem_gib for g in gpus]).get(resource, 0) <= 0:
        return []
    bad = set(unhealthy)
    return [Device(i, gpu, gpu not in bad) for i, gpu in device_ids(resource, gpus)]


class DeviceMap:
    """Device ID → GPU index for one node's GPUs."""

    def __init__(self, gpus: Sequence[Gpu]) -> None:
        self.gpus = list(gpus)
        self._by_uuid = {g.uuid: g.index for g in gpus}

    def gpu_of(self, device_id: str) -> int:
        uuid = device_id.split(SEP, 1)[0]
        try:
            return self._by_uuid[uuid]
        except KeyError:
            raise ValidationError(
                "device ID", device_id, "names no GPU of this node (stale kubelet checkpoint?)"
            ) from None

    def per_gpu(self, device_ids: Iterable[str]) -> dict[int, int]:
        """How many of these devices sit on each GPU: ``{gpu index: count}``."""
        out: dict[int, int] = {}
        for d in device_ids:
            g = self.gpu_of(d)
            out[g] = out.get(g, 0) + 1
        return out

    def uuid(self, gpu: int) -> str:
        return self.gpus[gpu].uuid

    def pick(
        self,
        available: Sequence[str],
        must_include: Sequence[str],
        want: Mapping[int, int],
    ) -> list[str] | None:
        """Devices from ``available`` with exactly ``want[g]`` on each GPU ``g`` (including every
        ``must_include`` device); ``None`` when that is impossible."""
        chosen: list[str] = []
        left = dict(want)
        for d in must_include:
            g = self.gpu_of(d)
            if left.get(g, 0) <= 0:
                return None
            left[g] -= 1
            chosen.append(d)
        taken = set(chosen)
        for d in available:
            if d in taken:
                continue
            g = self.gpu_of(d)
            if left.get(g, 0) > 0:
                left[g] -= 1
                chosen.append(d)
        if any(v > 0 for v in left.values()):
            return None
        return chosen
