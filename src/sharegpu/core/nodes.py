"""A Kubernetes Node object, as the API server returns it, turned into the core's NodeSpec.

- Mode: the ``ack.node.gpu.schedule`` label when present. When it is absent the node keeps its
  last explicit mode (SPEC §1): the node agent records it in ``sharegpu.io/last-mode`` and keeps
  advertising that mode's resources, so without the annotation the mode is read back from what
  the node advertises (``gpu-core.percentage`` → core_mem, ``gpu-mem`` → cgpu, ``aliyun.com/gpu``
  → topology, otherwise exclusive).
- GPUs: ``sharegpu.io/gpu-mem`` lists each GPU's GiB (GPUs of one node may differ); without it
  ``aliyun.com/gpu-mem`` is split evenly over ``aliyun.com/gpu-count`` GPUs.
- Card model: the ``aliyun.accelerator/nvidia_name`` label.
- CPU and memory: ``status.allocatable`` (:func:`sharegpu.core.hostresources.node_allocatable`;
  unknown when absent or malformed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from . import names
from .errors import ValidationError
from .hostresources import node_allocatable
from .modes import Mode, node_placement, parse_mode
from .quantity import lenient_whole
from .state import NodeSpec
from .topology import matrix_from_kinds


def quantity(v: Any) -> int:
    """A whole-number resource quantity from a node's status (0 when absent or not whole),
    read with the Kubernetes grammar (:mod:`sharegpu.core.quantity`)."""
    return lenient_whole(v)


def infer_mode(allocatable: Mapping[str, Any]) -> Mode:
    if quantity(allocatable.get(names.RES_GPU_CORE)) > 0:
        return Mode.CORE_MEM
    if quantity(allocatable.get(names.RES_GPU_MEM)) > 0:
        return Mode.CGPU
    if quantity(allocatable.get(names.RES_TOPOLOGY_GPU)) > 0:
        return Mode.TOPOLOGY
    return Mode.EXCLUSIVE


def node_mode_of(node: Mapping[str, Any]) -> Mode:
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    status = node.get("status") or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    if labels.get(names.LABEL_SCHEDULE):
        return parse_mode(labels[names.LABEL_SCHEDULE])
    last = annotations.get(names.ANN_NODE_LAST_MODE)
    if last:
        return parse_mode(last)
    return infer_mode(alloc)


def gpu_memory(node: Mapping[str, Any]) -> list[int]:
    """GiB of each GPU on the node, in index order."""
    meta = node.get("metadata") or {}
    name = meta.get("name", "")
    annotations = meta.get("annotations") or {}
    status = node.get("status") or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    raw = annotations.get(names.ANN_NODE_GPU_MEM)
    if raw:
        try:
            mem = [int(x) for x in str(raw).split(",") if x.strip()]
            if any(m <= 0 for m in mem):
                raise ValueError
            return mem
        except ValueError:
            raise ValidationError(
                f"node {name}: annotation {names.ANN_NODE_GPU_MEM}", raw,
                "must be positive whole GiB per GPU separated by ','",
            ) from None
    count = quantity(alloc.get(names.RES_GPU_COUNT))
    total = quantity(alloc.get(names.RES_GPU_MEM))
    if count <= 0:
        count = max(quantity(alloc.get(names.RES_NVIDIA_GPU)),
                    quantity(alloc.get(names.RES_TOPOLOGY_GPU)),
                    quantity((meta.get("labels") or {}).get(names.LABEL_CARD_COUNT)))
    if count <= 0:
        return []
    if total <= 0:
        card = str((meta.get("labels") or {}).get(names.LABEL_CARD_MEM, ""))
        mib = quantity(card.removesuffix("MiB"))
        per = max(mib // 1024, 1) if mib else 1
        return [per] * count
    base, extra = divmod(total, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def spec_from_node(node: Mapping[str, Any]) -> NodeSpec | None:
    """The core's view of a node; ``None`` for a node without GPUs."""
    meta = node.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise ValidationError("node.metadata.name", name, "must be set")
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    mem = gpu_memory(node)
    if not mem:
        return None
    mode = node_mode_of(node)
    links = None
    raw = annotations.get(names.ANN_NODE_GPU_TOPOLOGY)
    if raw:
        try:
            links = matrix_from_kinds(json.loads(raw))
            if links.shape[0] != len(mem):
                raise ValueError
        except (ValueError, TypeError):
            raise ValidationError(
                f"node {name}: annotation {names.ANN_NODE_GPU_TOPOLOGY}", raw,
                "must be a JSON square matrix of link kinds (X, SYS, NODE, PHB, PXB, PIX, NV<n>), "
                "one row per GPU",
            ) from None
    address = ""
    for a in (node.get("status") or {}).get("addresses") or []:
        if isinstance(a, Mapping) and a.get("type") == "InternalIP":
            found = a.get("address", "")
            address = found if isinstance(found, str) else ""
            break
    cpu, mem_mib, _problems = node_allocatable(node)
    return NodeSpec(
        name=str(name),
        gpu_mem=mem,
        mode=mode,
        placement=node_placement(labels, mode),
        model=str(labels.get(names.LABEL_CARD_NAME, "")),
        links=links,
        address=address,
        cpu_milli=cpu,
        mem_mib=mem_mib,
    )
