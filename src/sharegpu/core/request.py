"""What a pod asks for, parsed from a Kubernetes pod object, and every validation rule of SPEC §2.

A :class:`PodRequest` is the core's view of a pod: the per-container GPU requests the placement
code works with. Clusters express GPU memory in GiB; the simulator uses the same fields with
milli-GPU units (a GPU of 1000 units), so one core serves both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from . import names, quantity
from .errors import ValidationError


class Kind(StrEnum):
    """The kind of GPU a pod needs; one node mode serves each kind."""

    NONE = "none"  # no GPU
    SHARED = "shared"  # gpu-mem only
    SHARED_CORE = "shared-core"  # gpu-mem + gpu-core.percentage
    EXCLUSIVE = "exclusive"  # nvidia.com/gpu whole cards
    TOPOLOGY = "topology"  # aliyun.com/gpu whole cards, best-connected set


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """One container's GPU request.

    ``gpu_mem`` and ``gpu_core`` are per GPU (the pod asks for their totals over its GPUs);
    ``gpus`` is how many GPUs the container spans
    (``aliyun.com/gpu-count`` for shared requests, the card count for whole cards).
    """

    index: int
    name: str = ""
    gpu_mem: int = 0
    gpu_core: int = 0
    gpus: int = 1
    whole: bool = False
    # ``CGPU_DISABLE=true`` in the container's env: no isolation for it (SPEC §6)
    isolation_off: bool = False

    @property
    def total_mem(self) -> int:
        return self.gpu_mem * self.gpus


@dataclass(frozen=True, slots=True)
class PodRequest:
    """A pod's GPU request plus its host CPU (millicores) and memory (MiB). :func:`parse_pod`
    reads the GPU request alone (0 for CPU and memory); the extender adds the host request
    (:mod:`sharegpu.core.hostresources`), the simulator takes it from the trace."""

    namespace: str
    name: str
    kind: Kind
    containers: tuple[ContainerRequest, ...] = ()
    uid: str = ""
    cpu_milli: int = 0
    mem_mib: int = 0
    models: frozenset[str] | None = None
    labels: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def wants_gpu(self) -> bool:
        return self.kind is not Kind.NONE

    @property
    def total_mem(self) -> int:
        return sum(c.total_mem for c in self.containers)

    @property
    def total_gpus(self) -> int:
        return sum(c.gpus for c in self.containers)


# ---------------------------------------------------------------------------------------------
# rules (the text of each is part of the contract: tests and the admission webhook use it)

RULE_MEM = "must be a whole number of GiB, at least 1"
RULE_CORE = "must be a multiple of 5 between 5 and 100"
RULE_CORE_COUNT = (
    "with the pod label {label}={k}, must be a multiple of {step} between {step} and {top} "
    "(each of the {k} GPUs gets gpu-core.percentage / {k}, a multiple of 5)"
)
RULE_CORE_NEEDS_MEM = f"needs {names.RES_GPU_MEM} in the same container"
RULE_CARDS = "must be a whole number of GPUs, at least 1"
RULE_COUNT_LABEL = "must be a whole number of GPUs, at least 1"
RULE_COUNT_NEEDS_MEM = f"needs a container that asks for {names.RES_GPU_MEM}"
RULE_COUNT_DIVIDES = (
    f"must be divisible by the pod label {names.POD_LABEL_GPU_COUNT} "
    "(each GPU gets gpu-mem / gpu-count GiB)"
)
RULE_NO_MIX_CONTAINER = "cannot be asked for together with {other} in one container"
RULE_NO_MIX_POD = "cannot be mixed with {other} in one pod: a node runs one GPU mode"
RULE_NO_MIX_CORE = (
    f"containers that ask for {names.RES_GPU_MEM} only and containers that also ask for "
    f"{names.RES_GPU_CORE} cannot run in one pod (a node cannot mix them)"
)
RULE_REQ_EQ_LIMIT = "requests must equal limits for GPU resources"
RULE_NODE_RESOURCE = (
    f"is a node resource; set the pod label {names.POD_LABEL_GPU_COUNT} to spread gpu-mem over GPUs"
)
RULE_INIT_CONTAINER = "GPU resources are not supported in init containers"
RULE_NO_CONTAINERS = "a pod needs at least one container"


_PLAIN = re.compile(r"\+?[0-9]+", re.ASCII)


def parse_whole(field_name: str, value: Any, *, minimum: int = 1) -> int:
    """A GPU resource count: a JSON number or plain ASCII digits (the API server hands over
    quantities in canonical form, ``"4000m"`` as ``"4"``), checked with the Kubernetes quantity
    grammar and bounds (:mod:`sharegpu.core.quantity`), whitespace around it dropped as the API
    server drops it. A unit is refused: these resources count GiB, percent or cards, so
    ``4Gi`` would ask for 4,294,967,296 of them."""
    rule = RULE_MEM if minimum >= 1 else "must be a whole number, at least 0"
    if isinstance(value, str) and not _PLAIN.fullmatch(value.strip(quantity.SPACE)):
        raise ValidationError(field_name, value, rule)
    try:
        return quantity.whole(field_name, value, minimum=minimum, rule=rule)
    except ValidationError as e:
        if "largest quantity" in e.rule:
            raise
        raise ValidationError(field_name, value, rule) from None


def _resources(container: Mapping[str, Any], path: str) -> dict[str, tuple[str, Any]]:
    """GPU resources of a container: name -> (field path, raw value). Limits win; requests that
    disagree with limits are refused."""
    res = container.get("resources") or {}
    if not isinstance(res, Mapping):
        raise ValidationError(f"{path}.resources", _short(res), "must be a JSON object")
    limits = res.get("limits") or {}
    requests = res.get("requests") or {}
    if not isinstance(limits, Mapping) or not isinstance(requests, Mapping):
        raise ValidationError(f"{path}.resources", _short(res), "limits and requests must be maps")
    out: dict[str, tuple[str, Any]] = {}
    for r in names.ALL_GPU_RESOURCES:
        if r in limits:
            if r in requests and str(requests[r]) != str(limits[r]):
                raise ValidationError(
                    f'{path}.resources.requests["{r}"]', requests[r], RULE_REQ_EQ_LIMIT
                )
            out[r] = (f'{path}.resources.limits["{r}"]', limits[r])
        elif r in requests:
            out[r] = (f'{path}.resources.requests["{r}"]', requests[r])
    return out


def _short(value: Any) -> Any:
    """A value as an error message shows it: scalars as they are, containers by their type."""
    if isinstance(value, (str, int, float, bool, type(None))) or value in ([], {}):
        return value
    return type(value).__name__


def is_true(v: object) -> bool:
    """A label or environment value that switches something on: ``true``, any case."""
    return str(v or "").strip().lower() == "true"


def isolation_opted_out(container: Mapping[str, Any]) -> bool:
    """``CGPU_DISABLE=true`` among the container's environment variables (the last one
    named so counts, as in the container runtime)."""
    env = container.get("env")
    out = False
    if isinstance(env, list):
        for e in env:
            if isinstance(e, Mapping) and e.get("name") == names.ENV_CGPU_DISABLE:
                out = is_true(e.get("value"))
    return out


def _container(
    index: int, container: Mapping[str, Any], gpu_count: int | None
) -> tuple[Kind, ContainerRequest | None]:
    path = f"spec.containers[{index}]"
    name = container.get("name", "")
    if not isinstance(name, str):
        raise ValidationError(f"{path}.name", _short(name), "must be a string")
    res = _resources(container, path)

    if names.RES_GPU_COUNT in res:
        f, v = res[names.RES_GPU_COUNT]
        raise ValidationError(f, v, RULE_NODE_RESOURCE)

    values: dict[str, int] = {}
    for r, (f, v) in res.items():
        if r == names.RES_GPU_MEM:
            values[r] = parse_whole(f, v, minimum=1)
        elif r == names.RES_GPU_CORE:
            n = _parse_core(f, v, gpu_count or 1)
            values[r] = n
        else:
            n = parse_whole(f, v, minimum=0)
            if n == 0:
                continue  # zero whole cards is no request
            values[r] = n

    present = [r for r in (names.RES_NVIDIA_GPU, names.RES_TOPOLOGY_GPU) if r in values]
    shared = [r for r in (names.RES_GPU_MEM, names.RES_GPU_CORE) if r in values]
    if present and shared:
        f, v = res[shared[0]]
        raise ValidationError(f, v, RULE_NO_MIX_CONTAINER.format(other=present[0]))
    if len(present) == 2:
        f, v = res[present[1]]
        raise ValidationError(f, v, RULE_NO_MIX_CONTAINER.format(other=present[0]))
    if names.RES_GPU_CORE in values and names.RES_GPU_MEM not in values:
        f, v = res[names.RES_GPU_CORE]
        raise ValidationError(f, v, RULE_CORE_NEEDS_MEM)

    if names.RES_NVIDIA_GPU in values:
        n = values[names.RES_NVIDIA_GPU]
        return Kind.EXCLUSIVE, ContainerRequest(index, name, gpus=n, whole=True)
    if names.RES_TOPOLOGY_GPU in values:
        n = values[names.RES_TOPOLOGY_GPU]
        return Kind.TOPOLOGY, ContainerRequest(index, name, gpus=n, whole=True)
    if names.RES_GPU_MEM in values:
        mem = values[names.RES_GPU_MEM]
        k = gpu_count or 1
        if mem % k:
            f, v = res[names.RES_GPU_MEM]
            raise ValidationError(
                f, v, f"{RULE_COUNT_DIVIDES} (gpu-count={k})"
            )
        core = values.get(names.RES_GPU_CORE, 0)  # like gpu-mem, the total over the k GPUs
        kind = Kind.SHARED_CORE if core else Kind.SHARED
        return kind, ContainerRequest(index, name, gpu_mem=mem // k, gpu_core=core // k, gpus=k,
                                      isolation_off=isolation_opted_out(container))
    return Kind.NONE, None


def _parse_core(f: str, v: Any, k: int) -> int:
    """gpu-core.percentage: the total over the container's ``k`` GPUs, as the kubelet counts
    it; each GPU gets an equal share on the 5 % grid."""
    rule = RULE_CORE if k == 1 else RULE_CORE_COUNT.format(
        label=names.POD_LABEL_GPU_COUNT, k=k, step=names.CORE_STEP * k,
        top=names.CORE_PER_GPU * k)
    try:
        n = parse_whole(f, v, minimum=names.CORE_STEP * k)
    except ValidationError:
        raise ValidationError(f, v, rule) from None
    if n % (names.CORE_STEP * k) or n > names.CORE_PER_GPU * k:
        raise ValidationError(f, v, rule)
    return n


def _translated(meta: Mapping[str, Any]) -> bool:
    """The DRA webhook translated this pod (its annotation ``sharegpu.io/dra-claims``): its
    GPUs come from ResourceClaims and its ``aliyun.com/gpu-count`` label is only a note."""
    anns = meta.get("annotations")
    return isinstance(anns, Mapping) and names.ANN_DRA_CLAIMS in anns


def parse_pod(pod: Mapping[str, Any], *, dra_note: bool = True) -> PodRequest:
    """Parse and validate a Kubernetes pod object (a dict as the API server returns it).

    Raises :class:`ValidationError` naming the field, the value and the rule. With
    ``dra_note`` (the default) a pod the DRA webhook translated (annotation
    ``sharegpu.io/dra-claims``) that asks for no ``aliyun.com/gpu-mem`` is a pod without GPU
    request even with the ``aliyun.com/gpu-count`` label (it is only a note there); the
    validating webhook without DRA mode passes ``False`` and refuses the label as ever.
    """
    if not isinstance(pod, Mapping):
        raise ValidationError("pod", type(pod).__name__, "must be a JSON object")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if not isinstance(meta, Mapping):
        raise ValidationError("metadata", type(meta).__name__, "must be a JSON object")
    if not isinstance(spec, Mapping):
        raise ValidationError("spec", type(spec).__name__, "must be a JSON object")
    raw_labels = meta.get("labels") or {}
    if not isinstance(raw_labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw_labels.items()):
        raise ValidationError("metadata.labels", type(raw_labels).__name__,
                              "must be a JSON object of strings")
    labels = dict(raw_labels)
    for key in ("namespace", "name", "uid"):
        if not isinstance(meta.get(key) or "", str):
            raise ValidationError(f"metadata.{key}", meta.get(key), "must be a string")
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise ValidationError("spec.containers", _short(containers), RULE_NO_CONTAINERS)
    inits = spec.get("initContainers") or []
    if not isinstance(inits, list):
        raise ValidationError("spec.initContainers", type(inits).__name__, "must be a list")

    for i, c in enumerate(inits):
        if not isinstance(c, Mapping):
            raise ValidationError(f"spec.initContainers[{i}]", _short(c), "must be a JSON object")
        res = _resources(c, f"spec.initContainers[{i}]")
        if res:
            f, v = next(iter(res.values()))
            raise ValidationError(f, v, RULE_INIT_CONTAINER)

    gpu_count: int | None = None
    if names.POD_LABEL_GPU_COUNT in labels:
        f = f'metadata.labels["{names.POD_LABEL_GPU_COUNT}"]'
        raw = labels[names.POD_LABEL_GPU_COUNT]
        try:
            gpu_count = parse_whole(f, raw, minimum=1)
        except ValidationError:
            raise ValidationError(f, raw, RULE_COUNT_LABEL) from None

    kinds: list[tuple[Kind, int]] = []
    reqs: list[ContainerRequest] = []
    for i, c in enumerate(containers):
        if not isinstance(c, Mapping):
            raise ValidationError(f"spec.containers[{i}]", c, "must be a JSON object")
        kind, req = _container(i, c, gpu_count)
        if req is not None:
            kinds.append((kind, i))
            reqs.append(req)

    kind = Kind.NONE
    if kinds:
        kind = kinds[0][0]
        for k, i in kinds[1:]:
            if k is kind:
                continue
            pair = {k, kind}
            if pair == {Kind.SHARED, Kind.SHARED_CORE}:
                raise ValidationError(f"spec.containers[{i}].resources", k.value, RULE_NO_MIX_CORE)
            raise ValidationError(
                f"spec.containers[{i}].resources", k.value, RULE_NO_MIX_POD.format(other=kind.value)
            )
    if gpu_count is not None and kind is Kind.NONE and dra_note and _translated(meta):
        pass  # a pod the webhook turned into ResourceClaims: its gpu-count label is a note
    elif gpu_count is not None and kind not in (Kind.SHARED, Kind.SHARED_CORE):
        raise ValidationError(
            f'metadata.labels["{names.POD_LABEL_GPU_COUNT}"]', str(gpu_count), RULE_COUNT_NEEDS_MEM
        )

    return PodRequest(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        kind=kind,
        containers=tuple(reqs),
        labels=labels,
    )
