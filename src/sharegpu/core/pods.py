"""A Kubernetes Pod object's placement, read back from its annotations (for state rebuilds, the
node agent and the inspect CLI)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .annotations import Allocation, decode
from .request import PodRequest, parse_pod

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def is_terminated(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    phase = status.get("phase") if isinstance(status, Mapping) else None
    return isinstance(phase, str) and phase in TERMINAL_PHASES


def node_of(pod: Mapping[str, Any]) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def placement_of(pod: Mapping[str, Any]) -> tuple[PodRequest, str, Allocation] | None:
    """(request, node, allocation) of a live pod that holds GPUs by annotation; ``None`` for a
    pod that holds none (no annotation, not on a node, or finished). Raises ValidationError on a
    malformed request or annotation."""
    if is_terminated(pod):
        return None
    alloc = decode((pod.get("metadata") or {}).get("annotations") or {})
    if alloc is None:
        return None
    node = node_of(pod)
    if not node:  # annotated but never bound: holds nothing
        return None
    return parse_pod(pod), node, alloc


def unannotated_gpu_pod(pod: Mapping[str, Any]) -> tuple[PodRequest, str] | None:
    """(request, node) of a live pod bound to a node that asks for GPU resources but carries no
    scheduling decision (bound by another scheduler, ``nodeName`` set by hand, or bound by
    kube-scheduler while the extender was down): it holds GPUs nobody recorded. ``None``
    otherwise. Raises ValidationError on a malformed request."""
    if is_terminated(pod) or not node_of(pod):
        return None
    if decode((pod.get("metadata") or {}).get("annotations") or {}) is not None:
        return None
    req = parse_pod(pod)
    if not req.wants_gpu:
        return None
    return req, node_of(pod)
