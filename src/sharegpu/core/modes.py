"""Node scheduling modes (node label ``ack.node.gpu.schedule``) and the rules between them.

- One mode per node; every other mode's extended resources are advertised as 0.
- Removing the label does not switch a node back to exclusive: only the explicit value
  ``default`` does, so the last explicit mode is kept.
- ``ack.node.gpu.placement`` (binpack | spread) only applies to the shared modes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

from . import names
from .errors import ValidationError


class Mode(StrEnum):
    EXCLUSIVE = "default"
    CGPU = "cgpu"
    CORE_MEM = "core_mem"
    SHARE = "share"
    MPS = "mps"
    TOPOLOGY = "topology"

    @property
    def shared(self) -> bool:
        return self in SHARED_MODES

    @property
    def limits_compute(self) -> bool:
        """Only ``core_mem`` advertises and enforces ``gpu-core.percentage``."""
        return self is Mode.CORE_MEM


SHARED_MODES = frozenset({Mode.CGPU, Mode.CORE_MEM, Mode.SHARE, Mode.MPS})


class Placement(StrEnum):
    BINPACK = "binpack"
    SPREAD = "spread"


def parse_mode(value: str | None, previous: Mode | None = None) -> Mode:
    """Mode for a label value. ``None`` (label absent) keeps ``previous``, else exclusive."""
    if value is None or value == "":
        return previous if previous is not None else Mode.EXCLUSIVE
    try:
        return Mode(value)
    except ValueError:
        allowed = ", ".join(m.value for m in Mode)
        raise ValidationError(
            f"label {names.LABEL_SCHEDULE}", value, f"must be one of: {allowed}"
        ) from None


def node_mode(labels: Mapping[str, str], previous: Mode | None = None) -> Mode:
    return parse_mode(labels.get(names.LABEL_SCHEDULE), previous)


def parse_placement(value: str | None) -> Placement | None:
    """Placement for a label value; ``None`` when the label is absent."""
    if value is None or value == "":
        return None
    try:
        return Placement(value)
    except ValueError:
        raise ValidationError(
            f"label {names.LABEL_PLACEMENT}", value, "must be binpack or spread"
        ) from None


def node_placement(labels: Mapping[str, str], mode: Mode) -> Placement | None:
    """The node's in-node placement; it has no effect outside the shared modes."""
    if not mode.shared:
        return None
    return parse_placement(labels.get(names.LABEL_PLACEMENT))


def advertised_resources(mode: Mode, gpu_mem_gib: Sequence[int]) -> dict[str, int]:
    """Every GPU extended resource a node advertises in ``mode``; the other modes' ones are 0.

    ``gpu_mem_gib`` is the memory of each GPU on the node in GiB (GPUs may differ in size).
    ``aliyun.com/gpu-count`` stays on the node's capacity in every shared mode.
    """
    count = len(gpu_mem_gib)
    out = {r: 0 for r in names.ALL_GPU_RESOURCES}
    if mode is Mode.EXCLUSIVE:
        out[names.RES_NVIDIA_GPU] = count
    elif mode is Mode.TOPOLOGY:
        out[names.RES_TOPOLOGY_GPU] = count
    else:
        out[names.RES_GPU_MEM] = int(sum(gpu_mem_gib))
        out[names.RES_GPU_COUNT] = count
        if mode is Mode.CORE_MEM:
            out[names.RES_GPU_CORE] = names.CORE_PER_GPU * count
    return out


def card_model_labels(name: str, mem_mib: int, count: int) -> dict[str, str]:
    """Card-model labels from what the node agent finds (spaces in the name become ``-``)."""
    return {
        names.LABEL_CARD_NAME: "-".join(name.split()),
        names.LABEL_CARD_MEM: f"{int(mem_mib)}MiB",
        names.LABEL_CARD_COUNT: str(int(count)),
    }
