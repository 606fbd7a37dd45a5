"""Kubernetes Node and Pod objects (plain dicts, as the API server returns them) for tests,
benchmarks and examples: a node in a given GPU mode, a pod asking for GPU resources."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sharegpu.core import names
from sharegpu.core.modes import Mode, advertised_resources


def node(name: str, gpus: Sequence[int], mode: Mode | str = Mode.CGPU, *, model: str = "",
         placement: str = "", address: str = "") -> dict[str, Any]:
    """A Node whose GPUs have ``gpus`` GiB each, labelled and advertising as the agent does."""
    mode = Mode(mode)
    labels = {names.LABEL_SCHEDULE: mode.value, "kubernetes.io/hostname": name}
    if model:
        labels[names.LABEL_CARD_NAME] = model
    if placement:
        labels[names.LABEL_PLACEMENT] = placement
    res = {k: str(v) for k, v in advertised_resources(mode, list(gpus)).items()}
    res.update({"cpu": "64", "memory": "256Gi", "pods": "110"})
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name, "labels": labels,
            "annotations": {names.ANN_NODE_GPU_MEM: ",".join(str(int(g)) for g in gpus)},
        },
        "status": {"capacity": dict(res), "allocatable": dict(res),
                   "addresses": [{"type": "InternalIP", "address": address or "10.0.0.1"}]},
    }


def pod(name: str, *, namespace: str = "default", mem: int | str | None = None,
        core: int | str | None = None, cards: int | str | None = None,
        topology: int | str | None = None, gpu_count: int | str | None = None,
        containers: Sequence[Mapping[str, Any]] | None = None,
        scheduler: str = names.CO_SCHEDULER_NAME, uid: str | None = None,
        node_name: str = "", annotations: Mapping[str, str] | None = None,
        cpu: str | None = None, memory: str | None = None) -> dict[str, Any]:
    """A Pod with one container asking for the given GPU resources (limits), or with the given
    ``containers`` (each a mapping of resource name → value); ``cpu`` and ``memory``, when
    given, are the first container's requests."""
    if containers is None:
        lim: dict[str, Any] = {}
        if mem is not None:
            lim[names.RES_GPU_MEM] = str(mem)
        if core is not None:
            lim[names.RES_GPU_CORE] = str(core)
        if cards is not None:
            lim[names.RES_NVIDIA_GPU] = str(cards)
        if topology is not None:
            lim[names.RES_TOPOLOGY_GPU] = str(topology)
        containers = [lim]
    labels = {}
    if gpu_count is not None:
        labels[names.POD_LABEL_GPU_COUNT] = str(gpu_count)
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "containers": [
            {"name": f"c{i}", "image": "busybox", "resources": {"limits": dict(lim)}}
            for i, lim in enumerate(containers)
        ],
    }
    host = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    if host:
        spec["containers"][0]["resources"]["requests"] = host
    if node_name:
        spec["nodeName"] = node_name
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4()),
                     "labels": labels, "annotations": dict(annotations or {})},
        "spec": spec,
        "status": {"phase": "Pending"},
    }
