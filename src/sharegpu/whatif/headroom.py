"""How many more pods of one shape fit a state: on each node the most copies its free GPUs,
CPU and memory hold together (copies on different nodes never compete, so the sum over the
nodes is the most the cluster holds, whatever the policy).

A shape is a one-container request: ``gpu-mem=8,core=30,gpus=2,cpu=4,memory=16Gi,model=A100``
(:func:`parse_shape`), or a pod's manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from ..core import names, quantity
from ..core.errors import ValidationError
from ..core.hostresources import MIB
from ..core.nodeselector import NodeSelector
from ..core.request import ContainerRequest, Kind, PodRequest
from ..core.state import ClusterState

SHAPE_KEYS = ("gpu-mem", "core", "gpus", "cards", "cpu", "memory", "model")
RULE_SHAPE = ("must be KEY=VALUE pairs separated by ',' with keys " + ", ".join(SHAPE_KEYS)
              + " (gpu-mem in GiB per GPU, or cards for whole GPUs), e.g. gpu-mem=8,core=30")


def parse_shape(text: str) -> PodRequest:
    """A shape from the command line (see the module)."""
    values: dict[str, str] = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if not sep or k not in SHAPE_KEYS or not v or k in values:
            raise ValidationError("--shape", text, RULE_SHAPE)
        values[k] = v

    def whole(key: str, minimum: int = 1) -> int:
        raw = values[key]
        if not raw.isdigit() or int(raw) < minimum:
            raise ValidationError(f"--shape {key}", raw, f"must be a whole number, at least "
                                                         f"{minimum}")
        return int(raw)

    if ("gpu-mem" in values) == ("cards" in values):
        raise ValidationError("--shape", text, "needs gpu-mem (shared) or cards (whole GPUs)")
    cpu = mem = 0
    if "cpu" in values:
        cpu = int(np.ceil(quantity.parse("--shape cpu", values["cpu"]) * 1000))
    if "memory" in values:
        mem = int(np.ceil(quantity.parse("--shape memory", values["memory"]) / Fraction(MIB)))
    models = frozenset(values["model"].split("|")) if "model" in values else None
    if "cards" in values:
        if "core" in values or "gpus" in values:
            raise ValidationError("--shape", text, "cards takes whole GPUs: no core or gpus")
        c = ContainerRequest(0, "main", gpus=whole("cards"), whole=True)
        kind = Kind.EXCLUSIVE
    else:
        core = whole("core", names.CORE_STEP) if "core" in values else 0
        if core and (core % names.CORE_STEP or core > names.CORE_PER_GPU):
            raise ValidationError("--shape core", core, "must be a multiple of 5 between 5 and "
                                                        "100 (percent of each GPU)")
        c = ContainerRequest(0, "main", gpu_mem=whole("gpu-mem"), gpu_core=core,
                             gpus=whole("gpus") if "gpus" in values else 1)
        kind = Kind.SHARED_CORE if core else Kind.SHARED
    return PodRequest("whatif", "shape", kind, (c,), cpu_milli=cpu, mem_mib=mem, models=models)


def describe(req: PodRequest) -> str:
    c = req.containers[0]
    if c.whole:
        out = f"{c.gpus} whole GPU(s)"
    else:
        out = f"{c.gpu_mem} GiB" + (f" and {c.gpu_core}% compute" if c.gpu_core else "")
        out += " on each of " + (f"{c.gpus} GPUs" if c.gpus > 1 else "1 GPU")
    if req.cpu_milli:
        out += f", {req.cpu_milli}m CPU"
    if req.mem_mib:
        out += f", {req.mem_mib} MiB"
    if req.models:
        out += f", model {'|'.join(sorted(req.models))}"
    return out


def _most(per_gpu: list[int], k: int) -> int:
    """The most copies, each on ``k`` different GPUs, that GPUs holding ``per_gpu`` copies
    each can take: the largest x with sum(min(c, x)) >= k·x."""
    lo, hi = 0, sum(per_gpu) // k
    while lo < hi:
        x = (lo + hi + 1) // 2
        if sum(min(c, x) for c in per_gpu) >= k * x:
            lo = x
        else:
            hi = x - 1
    return lo


def fits(state: ClusterState, req: PodRequest, among: np.ndarray | None = None) -> int:
    """More copies of the one-container ``req`` that fit (see the module)."""
    if len(req.containers) != 1:
        raise ValidationError("shape", req.key, "must have one container asking for GPUs")
    c = req.containers[0]
    single = PodRequest(req.namespace, req.name, req.kind, req.containers,
                        models=req.models)  # the mask without CPU: counted per copy below
    ok = state.node_mask(single)
    if req.cpu_milli:
        ok &= state.cpu_free[: state.n] >= req.cpu_milli
    if req.mem_mib:
        ok &= state.mem_free[: state.n] >= req.mem_mib
    if among is not None:
        ok &= among
    rows = np.flatnonzero(ok)
    if len(rows) == 0:
        return 0
    exists = state.gpu_exists[rows]
    if c.whole:
        per = (exists & (state.gpu_pods[rows] == 0)
               & (state.gpu_free[rows] == state.gpu_total[rows])).astype(np.int64)
    else:
        per = np.where(exists, state.gpu_free[rows] // c.gpu_mem, 0)
        if c.gpu_core:
            per = np.minimum(per, np.where(exists, state.core_free[rows] // c.gpu_core, 0))
        per = np.minimum(per, np.maximum(state.max_pods_per_gpu - state.gpu_pods[rows], 0))
    if c.gpus == 1:
        copies = per.sum(axis=1)
    else:
        copies = np.array([_most(row.tolist(), c.gpus) for row in per], dtype=np.int64)
    big = np.iinfo(np.int64).max
    if req.cpu_milli:
        copies = np.minimum(copies, state.cpu_free[rows] // req.cpu_milli)
    if req.mem_mib:
        copies = np.minimum(copies, state.mem_free[rows] // req.mem_mib)
    return int(np.minimum(copies, big).sum())


def shape_from_pod(obj: Mapping[str, Any], flag: str = "--shape"
                   ) -> tuple[PodRequest, NodeSelector]:
    """A shape from a pod's manifest (its GPU request, CPU and memory, node selector)."""
    from ..core.nodeselector import node_selector
    from ..core.podreader import PlacementReader

    if not isinstance(obj, Mapping) or obj.get("kind") != "Pod":
        raise ValidationError(flag, "file", "must hold a Pod (kind: Pod)")
    req = PlacementReader().request(obj)
    if not req.wants_gpu:
        raise ValidationError(flag, req.key, "the pod asks for no GPU")
    return req, node_selector(obj)
