"""The names every part of sharegpu's DRA mode shares: the driver (``gpu.sharegpu.io``, one pool
per node, named after it), a GPU's device name (``gpu-<index>``, its NVML index), the consumable
capacities ``memory`` (bytes, in steps of 1 GiB) and ``cores`` (percent, 1 to 100), the device
taints that keep new claims off a GPU, and the CDI devices the kubelet plugin answers with.
One place, so what the agent publishes and what is read back cannot drift apart.
"""

from __future__ import annotations

import math
import re
from typing import Final

from ..core.names import CORE_STEP as _CORE_MEM_STEP

DRIVER: Final = "gpu.sharegpu.io"
DEVICE_PREFIX: Final = "gpu-"
CAPACITY_MEMORY: Final = "memory"
CAPACITY_CORES: Final = "cores"
MEMORY_STEP: Final = 1 << 30  # bytes: memory is consumed in whole GiB
CORES_PER_GPU: Final = 100  # the ``cores`` capacity of one GPU (percent)
CORE_STEP: Final = _CORE_MEM_STEP  # ``cores`` are consumed in steps of 5 %, as in core_mem
# device taints the agent puts on a GPU in its slice (keys are qualified by the driver)
TAINT_UNHEALTHY: Final = f"{DRIVER}/unhealthy"  # a critical XID
TAINT_ISOLATION: Final = f"{DRIVER}/isolation-unavailable"  # the back-end is not usable
CDI_VENDOR: Final = "sharegpu.io"
CDI_CLASS: Final = "gpu"
CDI_KIND: Final = f"{CDI_VENDOR}/{CDI_CLASS}"

_DEVICE = re.compile(r"gpu-(0|[1-9][0-9]{0,3})", re.ASCII)


def consumed_cores(asked: float) -> int:
    """The ``cores`` a request consumes: rounded up to the step, at least one step (the request
    policy's minimum and default, so at most 20 claims share a GPU)."""
    return max(CORE_STEP, math.ceil(asked / CORE_STEP) * CORE_STEP)


def device_name(index: int) -> str:
    """The DRA device name of GPU ``index``: ``gpu-0``, ``gpu-1``..."""
    return f"{DEVICE_PREFIX}{int(index)}"


def device_index(name: str) -> int | None:
    """The GPU index a device name stands for, or ``None`` when it is not ``gpu-<index>``."""
    m = _DEVICE.fullmatch(name) if isinstance(name, str) else None
    return int(m.group(1)) if m else None


def pool_name(node: str) -> str:
    """The pool a node's GPUs are published in: the node's name."""
    return node


def cdi_device_id(claim_uid: str, device: str) -> str:
    """The fully qualified CDI device ID for one device of a prepared claim."""
    return f"{CDI_KIND}={claim_uid}-{device}"
