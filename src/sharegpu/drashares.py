"""What DRA mode's objects say about who holds which GPU (issue 21): the GPUs a node publishes in
its ResourceSlice, and the shares ResourceClaims were allocated on them. Read by
``kubectl inspect cgpu`` (beside device-plugin pods) and by the extender (which must count DRA
shares in a node's GPU state). Pure: no I/O.

- A node's GPUs: the devices ``gpu-<index>`` of its slice of driver ``gpu.sharegpu.io``
  (``spec.nodeName``; one pool per node), each with its ``memory`` capacity in bytes (GiB
  here) and the ``mode`` attribute.
- A claim's shares: the results of the driver in ``status.allocation.devices.results[]``,
  on the node named by the pool; ``consumedCapacity`` ``memory`` (rounded up to GiB) and
  ``cores`` (percent); a result without ``consumedCapacity`` holds the whole GPU. The pods
  are those of ``status.reservedFor`` (resource ``pods``).

Unlike the kubelet plugin (``agent/draclaim.py``), which refuses a claim it cannot prepare,
these readers are lenient: a result or device that cannot be read is skipped with a warning
naming the object, the field and the rule, and the rest is still counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import dra
from .errors import ValidationError
from .quantity import parse

RESULTS = "status.allocation.devices.results"


@dataclass(frozen=True)
class SliceGpus:
    """A node's GPUs as its ResourceSlice publishes them."""

    node: str
    mem_gib: dict[int, int]  # GPU index -> GiB
    mode: str  # the devices' ``mode`` attribute ('' when absent)


@dataclass(frozen=True)
class DraShare:
    """One GPU of one allocated claim."""

    namespace: str
    claim: str
    node: str
    gpu: int
    mem_gib: int | None  # None: the whole GPU
    core: int | None  # percent; None: the whole GPU, or no cores consumed
    pods: tuple[tuple[str, str], ...]  # (namespace, name) from status.reservedFor

    @property
    def whole(self) -> bool:
        return self.mem_gib is None


def _name(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    ns, name = meta.get("namespace"), meta.get("name")
    return (ns if isinstance(ns, str) else ""), (name if isinstance(name, str) else "")


def _gib(field: str, value: Any) -> int:
    q = parse(field, value)
    if q < 0:
        raise ValidationError(field, value, "must not be negative")
    return math.ceil(q / dra.MEMORY_STEP)


def slice_gpus(obj: Mapping[str, Any], driver: str = dra.DRIVER
               ) -> tuple[SliceGpus | None, list[str]]:
    """The GPUs of a ResourceSlice of ``driver`` (``None`` for another driver's slice or one
    that names no node), with a warning per device that cannot be read."""
    warnings: list[str] = []
    spec = obj.get("spec") if isinstance(obj, Mapping) else None
    if not isinstance(spec, Mapping) or spec.get("driver") != driver:
        return None, warnings
    _, sname = _name(obj)
    node = spec.get("nodeName")
    if not isinstance(node, str) or not node:
        return None, [f"ResourceSlice {sname} left out: spec.nodeName must name a node"]
    devices = spec.get("devices")
    if not isinstance(devices, list):
        return None, [f"ResourceSlice {sname} left out: spec.devices must be a list"]
    mem: dict[int, int] = {}
    mode = ""
    for i, d in enumerate(devices):
        at = f"ResourceSlice {sname}: spec.devices[{i}]"
        if not isinstance(d, Mapping):
            warnings.append(f"{at} left out: must be an object")
            continue
        gpu = dra.device_index(d.get("name"))  # type: ignore[arg-type]
        if gpu is None:
            warnings.append(f"{at}.name={d.get('name')!r} left out: must be gpu-<index>")
            continue
        cap = d.get("capacity")
        value = (cap.get(dra.CAPACITY_MEMORY) or {}).get("value") if isinstance(
            cap, Mapping) and isinstance(cap.get(dra.CAPACITY_MEMORY), Mapping) else None
        try:
            mem[gpu] = _gib(f"{at}.capacity.{dra.CAPACITY_MEMORY}.value", value)
        except ValidationError as e:
            warnings.append(f"{e}; that GPU is left out")
            continue
        attrs = d.get("attributes")
        m = (attrs.get("mode") or {}).get("string") if isinstance(attrs, Mapping) and \
            isinstance(attrs.get("mode"), Mapping) else None
        if isinstance(m, str) and not mode:
            mode = m
    return SliceGpus(node, dict(sorted(mem.items())), mode), warnings


def claim_shares(obj: Mapping[str, Any], driver: str = dra.DRIVER
                 ) -> tuple[list[DraShare], list[str]]:
    """The GPUs a ResourceClaim was allocated of ``driver``'s (none when not allocated), with a
    warning per result that cannot be read."""
    if not isinstance(obj, Mapping):
        return [], ["a ResourceClaim left out: it is not a JSON object"]
    ns, name = _name(obj)
    status = obj.get("status")
    alloc = status.get("allocation") if isinstance(status, Mapping) else None
    if not isinstance(alloc, Mapping):
        return [], []
    devices = alloc.get("devices")
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if not isinstance(results, list):
        return [], [f"ResourceClaim {ns}/{name} left out: {RESULTS} must be a list"]
    pods: list[tuple[str, str]] = []
    reserved = status.get("reservedFor") if isinstance(status, Mapping) else None
    for r in reserved if isinstance(reserved, list) else []:
        if isinstance(r, Mapping) and r.get("resource") == "pods" and r.get("apiGroup") in (
                None, "") and isinstance(r.get("name"), str):
            pods.append((ns, r["name"]))
    out: list[DraShare] = []
    warnings: list[str] = []
    for i, r in enumerate(results):
        at = f"ResourceClaim {ns}/{name}: {RESULTS}[{i}]"
        if not isinstance(r, Mapping) or r.get("driver") != driver:
            continue
        node, device = r.get("pool"), r.get("device")
        gpu = dra.device_index(device) if isinstance(device, str) else None
        if not isinstance(node, str) or not node or gpu is None:
            warnings.append(f"{at} left out: pool must name a node and device must be "
                            f"gpu-<index> (pool={node!r}, device={device!r})")
            continue
        cap = r.get("consumedCapacity")
        mem: int | None = None
        core: int | None = None
        try:
            if isinstance(cap, Mapping) and cap:
                if dra.CAPACITY_MEMORY in cap:
                    mem = _gib(f"{at}.consumedCapacity.{dra.CAPACITY_MEMORY}",
                               cap[dra.CAPACITY_MEMORY])
                else:
                    mem = 0
                if dra.CAPACITY_CORES in cap:
                    core = math.ceil(parse(f"{at}.consumedCapacity.{dra.CAPACITY_CORES}",
                                           cap[dra.CAPACITY_CORES]))
        except ValidationError as e:
            warnings.append(f"{e}; that result is left out")
            continue
        out.append(DraShare(ns, name, node, gpu, mem, core, tuple(pods)))
    return out, warnings


@dataclass(frozen=True)
class DraRequest:
    """One request of a claim for sharegpu GPUs, as the placement counts it: ``count`` GPUs,
    each with ``mem_gib`` GiB (``None``: the whole GPU, no capacity asked) and ``core`` percent."""

    claim: str
    request: str
    count: int
    mem_gib: int | None
    core: int


def claim_requests(obj: Mapping[str, Any], device_class: str = dra.DRIVER
                   ) -> tuple[list[DraRequest], list[str]]:
    """What a ResourceClaim's ``spec.devices.requests[].exactly`` asks of ``device_class``
    (sharegpu's DeviceClass, named after the driver): the GPU requests the extender would score
    with the policy. ``capacity.requests.memory`` is rounded up to GiB as the request policy's
    1 GiB step does; a request that names no capacity consumes the policy's default (1 GiB,
    5 %) on a shared GPU. ``firstAvailable`` requests and ``allocationMode: All`` are not
    translated (warning)."""
    ns, name = _name(obj) if isinstance(obj, Mapping) else ("", "")
    spec = obj.get("spec") if isinstance(obj, Mapping) else None
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    reqs = devices.get("requests") if isinstance(devices, Mapping) else None
    out: list[DraRequest] = []
    warnings: list[str] = []
    for i, r in enumerate(reqs if isinstance(reqs, list) else []):
        at = f"ResourceClaim {ns}/{name}: spec.devices.requests[{i}]"
        if not isinstance(r, Mapping):
            continue
        exact = r.get("exactly")
        if not isinstance(exact, Mapping):
            if r.get("firstAvailable"):
                warnings.append(f"{at}.firstAvailable: not translated (only exactly)")
            continue
        if exact.get("deviceClassName") != device_class:
            continue
        if exact.get("allocationMode", "ExactCount") != "ExactCount":
            warnings.append(f"{at}.exactly.allocationMode={exact.get('allocationMode')!r}: "
                            "not translated (only ExactCount)")
            continue
        count = exact.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            warnings.append(f"{at}.exactly.count={count!r}: must be a positive integer")
            continue
        cap = exact.get("capacity")
        asked = cap.get("requests") if isinstance(cap, Mapping) else None
        mem: int | None = None
        core = 0
        try:
            if isinstance(asked, Mapping) and asked:
                mem = _gib(f"{at}.exactly.capacity.requests.{dra.CAPACITY_MEMORY}",
                           asked.get(dra.CAPACITY_MEMORY, dra.MEMORY_STEP)) or 1
                if dra.CAPACITY_CORES in asked:
                    core = math.ceil(parse(f"{at}.exactly.capacity.requests."
                                           f"{dra.CAPACITY_CORES}", asked[dra.CAPACITY_CORES]))
        except ValidationError as e:
            warnings.append(str(e))
            continue
        out.append(DraRequest(name, str(r.get("name") or ""), count, mem, core))
    return out, warnings
