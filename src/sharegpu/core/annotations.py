"""The annotation codec: a placement decision recorded on the pod, in both ACK generations.

Annotations are the only persistent state: after any restart the scheduler rebuilds every GPU's
allocation from them. :func:`encode` writes both generations; :func:`decode` reads either
(the second generation wins when both are present, since it is per container).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import names
from .errors import ValidationError

PerContainer = Mapping[int, Mapping[int, int]]


@dataclass(frozen=True)
class Allocation:
    """Which GPUs of a node each container got: ``mem[container][gpu]`` memory units and
    ``core[container][gpu]`` compute percent (empty when the pod asks for no compute)."""

    mem: PerContainer
    core: PerContainer = field(default_factory=dict)

    @property
    def gpus(self) -> tuple[int, ...]:
        """Every GPU index used by any container, ascending."""
        return tuple(sorted({g for per in self.mem.values() for g in per}))

    @property
    def total_mem(self) -> int:
        return sum(v for per in self.mem.values() for v in per.values())

    def per_gpu_mem(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for per in self.mem.values():
            for g, v in per.items():
                out[g] = out.get(g, 0) + v
        return out

    def per_gpu_core(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for per in self.core.values():
            for g, v in per.items():
                out[g] = out.get(g, 0) + v
        return out

    def container_gpus(self, container: int) -> tuple[int, ...]:
        return tuple(sorted(self.mem.get(container, {})))


def _dump(per: PerContainer) -> str:
    return json.dumps(
        {str(c): {str(g): int(v) for g, v in sorted(gs.items())} for c, gs in sorted(per.items())},
        separators=(",", ":"),
    )


def encode(
    alloc: Allocation, *, assume_time_ns: int, gpu_capacity: Mapping[int, int] | None = None
) -> dict[str, str]:
    """Annotations of both generations for a fresh (not yet assigned) placement.

    ``gpu_capacity`` maps GPU index to its total memory; the first generation's
    ``ALIYUN_COM_GPU_MEM_DEV`` carries the capacity of the first chosen GPU. The first
    generation's placement (a GPU list and the pod's total, read as an even split) is written
    only where it reads back as the same amount on each GPU: a pod whose containers hold
    different amounts on different GPUs (4 GiB on one, 2 on another) has the second
    generation's alone, since the first would read back 3 + 3 (or not at all for 3 + 2).
    """
    gpus = alloc.gpus
    dev = (gpu_capacity or {}).get(gpus[0], 0) if gpus else 0
    out: dict[str, str] = {}
    if first_generation_holds(alloc):
        out[names.ANN_MEM_IDX] = ",".join(str(g) for g in gpus)
        out[names.ANN_MEM_POD] = str(alloc.total_mem)
        out[names.ANN_MEM_DEV] = str(dev)
    out.update({
        names.ANN_MEM_ASSIGNED: "false",
        names.ANN_MEM_ASSUME_TIME: str(int(assume_time_ns)),
        names.ANN_ALLOCATION: _dump(alloc.mem),
        names.ANN_ASSIGNED: "false",
        names.ANN_ASSUME_TIME: str(int(assume_time_ns)),
    })
    if any(alloc.core.values()):
        out[names.ANN_CORE] = _dump(alloc.core)
    return out


def first_generation_holds(alloc: Allocation) -> bool:
    """Whether the first generation (GPU list, pod total split evenly) says this placement:
    every GPU holds the same amount."""
    return len(set(alloc.per_gpu_mem().values())) <= 1


def assigned_patch() -> dict[str, str]:
    """Annotations that mark the pod's devices handed to its containers (both generations)."""
    return {names.ANN_MEM_ASSIGNED: "true", names.ANN_ASSIGNED: "true"}


def is_assigned(annotations: Mapping[str, str]) -> bool:
    return (
        annotations.get(names.ANN_ASSIGNED) == "true"
        or annotations.get(names.ANN_MEM_ASSIGNED) == "true"
    )


def assume_time(annotations: Mapping[str, str]) -> int:
    raw = annotations.get(names.ANN_ASSUME_TIME) or annotations.get(names.ANN_MEM_ASSUME_TIME)
    try:
        return int(raw) if raw else 0
    except ValueError:
        return 0


def _load(key: str, raw: str) -> dict[int, dict[int, int]]:
    rule = 'must be JSON {"<container>": {"<gpu>": <whole number>}}'
    try:
        data = json.loads(raw)
    except (TypeError, ValueError):
        raise ValidationError(f"annotation {key}", raw, rule) from None
    if not isinstance(data, dict):
        raise ValidationError(f"annotation {key}", raw, rule)
    out: dict[int, dict[int, int]] = {}
    try:
        for c, gs in data.items():
            if not isinstance(gs, dict):
                raise ValueError
            per = {}
            for g, v in gs.items():
                if isinstance(v, bool) or not isinstance(v, int) or v < 0 or int(g) < 0:
                    raise ValueError
                per[int(g)] = v
            out[int(c)] = per
    except (TypeError, ValueError):
        raise ValidationError(f"annotation {key}", raw, rule) from None
    return out


def decode(annotations: Mapping[str, str] | None) -> Allocation | None:
    """The placement recorded on a pod, from either generation; ``None`` when there is none."""
    if not annotations:
        return None
    if names.ANN_ALLOCATION in annotations:
        mem = _load(names.ANN_ALLOCATION, annotations[names.ANN_ALLOCATION])
        core = (
            _load(names.ANN_CORE, annotations[names.ANN_CORE])
            if names.ANN_CORE in annotations
            else {}
        )
        return Allocation(mem=mem, core=core)
    if names.ANN_MEM_IDX in annotations:
        raw_idx = annotations[names.ANN_MEM_IDX]
        raw_pod = annotations.get(names.ANN_MEM_POD, "")
        try:
            gpus = [int(x) for x in raw_idx.split(",") if x.strip() != ""]
            if not gpus or any(g < 0 for g in gpus):
                raise ValueError
        except ValueError:
            raise ValidationError(
                f"annotation {names.ANN_MEM_IDX}", raw_idx, "must be GPU indices separated by ','"
            ) from None
        try:
            total = int(raw_pod)
            if total < 0 or total % len(gpus):
                raise ValueError
        except ValueError:
            raise ValidationError(
                f"annotation {names.ANN_MEM_POD}",
                raw_pod,
                "must be a whole number divisible by the number of GPUs in "
                + names.ANN_MEM_IDX,
            ) from None
        each = total // len(gpus)
        return Allocation(mem={0: {g: each for g in gpus}})
    return None
