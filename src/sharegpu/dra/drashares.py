"""Who holds which GPU in DRA mode: the GPUs a node publishes in its ResourceSlice, the shares
allocated claims hold on them (each result read by :mod:`sharegpu.dra.allocation`), and what a
claim's requests ask. Read by ``kubectl inspect cgpu`` and the extender, leniently: what cannot
be read is left out with a warning naming the object, the field and the rule, and the rest is
still counted. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import ValidationError
from ..core.quantity import parse
from . import driver as dra
from .allocation import RESULTS, allocated_results, read_result
from .draclaims import SHAREABLE


@dataclass(frozen=True)
class DeviceTaint:
    """A taint on one device of a slice (``spec.devices[].taints[]``)."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class Toleration:
    """A claim request's toleration of device taints (``exactly.tolerations[]``)."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: DeviceTaint) -> bool:
        """As the API defines it: an empty key with ``Exists`` tolerates every taint; an empty
        effect every effect; ``Equal`` also needs the same value."""
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.key
        return self.key == taint.key and self.value == taint.value


@dataclass(frozen=True)
class SliceGpus:
    """A node's GPUs as its ResourceSlice publishes them."""

    node: str
    mem_gib: dict[int, int]  # GPU index -> GiB
    mode: str  # the devices' ``mode`` attribute ('' when absent)
    # per GPU index, for those who need more than the memory (the extender's diagnosis of DRA
    # pods that cannot be placed): the ``cores`` capacity (percent), whether the device allows
    # multiple allocations (a shared GPU), and its taints
    cores: dict[int, int] = field(default_factory=dict, compare=False)
    shared: dict[int, bool] = field(default_factory=dict, compare=False)
    taints: dict[int, tuple[DeviceTaint, ...]] = field(default_factory=dict, compare=False)


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
    cores: dict[int, int] = {}
    shared: dict[int, bool] = {}
    taints: dict[int, tuple[DeviceTaint, ...]] = {}
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
        cc = cap.get(dra.CAPACITY_CORES) if isinstance(cap, Mapping) else None
        core = cc.get("value") if isinstance(cc, Mapping) else None
        try:
            cores[gpu] = dra.CORES_PER_GPU if core is None else math.floor(
                parse(f"{at}.capacity.{dra.CAPACITY_CORES}.value", core))
        except ValidationError as e:
            warnings.append(f"{e}; taken as {dra.CORES_PER_GPU}")
            cores[gpu] = dra.CORES_PER_GPU
        shared[gpu] = d.get("allowMultipleAllocations") is True
        taints[gpu], bad = _taints(d.get("taints"), f"{at}.taints")
        warnings += bad
        attrs = d.get("attributes")
        m = (attrs.get("mode") or {}).get("string") if isinstance(attrs, Mapping) and \
            isinstance(attrs.get("mode"), Mapping) else None
        if isinstance(m, str) and not mode:
            mode = m
    return SliceGpus(node, dict(sorted(mem.items())), mode, cores, shared,
                     {g: t for g, t in taints.items() if t}), warnings


def _taints(value: Any, at: str) -> tuple[tuple[DeviceTaint, ...], list[str]]:
    """A device's taints; one that cannot be read is kept as a taint of key '?' (it may keep
    claims off the device: never read as none) with a warning."""
    if value is None:
        return (), []
    if not isinstance(value, list):
        return (DeviceTaint("?"),), [f"{at}: must be a list; read as one unknown taint"]
    out: list[DeviceTaint] = []
    warnings: list[str] = []
    for j, t in enumerate(value):
        key = t.get("key") if isinstance(t, Mapping) else None
        if not isinstance(key, str) or not key:
            warnings.append(f"{at}[{j}].key={key!r}: must be a taint key; read as an unknown "
                            "taint")
            out.append(DeviceTaint("?"))
            continue
        val, effect = t.get("value"), t.get("effect")
        out.append(DeviceTaint(key, val if isinstance(val, str) else "",
                               effect if isinstance(effect, str) else "NoSchedule"))
    return tuple(out), warnings


def _tolerations(value: Any) -> tuple[Toleration, ...]:
    out = []
    for t in value if isinstance(value, list) else []:
        if not isinstance(t, Mapping):
            continue
        key, op, val, effect = (t.get(k) for k in ("key", "operator", "value", "effect"))
        out.append(Toleration(key if isinstance(key, str) else "",
                              op if op in ("Exists", "Equal") else "Equal",
                              val if isinstance(val, str) else "",
                              effect if isinstance(effect, str) else ""))
    return tuple(out)


def claim_shares(obj: Mapping[str, Any], driver: str = dra.DRIVER
                 ) -> tuple[list[DraShare], list[str]]:
    """The GPUs a ResourceClaim was allocated of ``driver``'s (none when not allocated), with a
    warning per result that cannot be read (:func:`~sharegpu.dra.allocation.read_result`)."""
    if not isinstance(obj, Mapping):
        return [], ["a ResourceClaim left out: it is not a JSON object"]
    ns, name = _name(obj)
    try:
        results = allocated_results(obj)
    except ValidationError:
        return [], [f"ResourceClaim {ns}/{name} left out: {RESULTS} must be a list"]
    if results is None:
        return [], []
    pods: list[tuple[str, str]] = []
    reserved = obj["status"].get("reservedFor")
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
        try:
            got = read_result(r, at, i)
        except ValidationError as e:
            if e.field in (f"{at}.pool", f"{at}.device"):  # the result names no GPU of a node
                warnings.append(f"{at} left out: pool must name a node and device must be "
                                f"gpu-<index> (pool={r.get('pool')!r}, "
                                f"device={r.get('device')!r})")
            else:
                warnings.append(f"{e}; that result is left out")
            continue
        mem = None if got.whole else math.ceil((got.memory or 0) / dra.MEMORY_STEP)
        core = None if got.cores is None else math.ceil(got.cores)
        out.append(DraShare(ns, name, got.pool, got.gpu, mem, core, tuple(pods)))
    return out, warnings


@dataclass(frozen=True)
class DraRequest:
    """One request of a claim for sharegpu GPUs, as the placement counts it: ``count`` GPUs,
    each with ``mem_gib`` GiB (``None``: the whole GPU, no capacity asked) and ``core`` percent.

    The rest says where it is written and what else narrows the GPUs it may take (the
    extender's diagnosis of DRA pods that cannot be placed, :mod:`sharegpu.dra.dradiagnosis`):
    ``index`` in ``spec.devices.requests``, ``memory`` as written, ``distinct`` (a constraint
    with ``distinctAttribute`` covers it: its ``count`` devices are different GPUs),
    ``shared_only`` (the webhook's selector ``device.allowMultipleAllocations == true``) and
    its tolerations of device taints. ``ranked=False``: a request the policy does not score
    (``firstAvailable`` naming the class in a subrequest, ``allocationMode: All``): legal DRA,
    left to kube-scheduler's allocator; ``count`` 1 and ``mem_gib`` ``None`` then."""

    claim: str
    request: str
    count: int
    mem_gib: int | None
    core: int
    index: int = field(default=0, compare=False)
    memory: str = field(default="", compare=False)
    distinct: bool = field(default=False, compare=False)
    shared_only: bool = field(default=False, compare=False)
    tolerations: tuple[Toleration, ...] = field(default=(), compare=False)
    ranked: bool = True


def claim_requests(obj: Mapping[str, Any], device_class: str = dra.DRIVER
                   ) -> tuple[list[DraRequest], list[str]]:
    """What a ResourceClaim's ``spec.devices.requests[].exactly`` asks of ``device_class``
    (sharegpu's DeviceClass, named after the driver): the GPU requests the extender would score
    with the policy. ``capacity.requests.memory`` is rounded up to GiB as the request policy's
    1 GiB step does; a request that names no capacity consumes the policy's default (1 GiB,
    5 %) on a shared GPU. ``firstAvailable`` requests with a subrequest of the class and
    ``allocationMode: All`` are legal DRA that the policy does not score: they come back as
    ``ranked=False`` requests, with no warning (other classes' requests are not looked at).
    Warnings are for requests that cannot be read."""
    ns, name = _name(obj) if isinstance(obj, Mapping) else ("", "")
    spec = obj.get("spec") if isinstance(obj, Mapping) else None
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    reqs = devices.get("requests") if isinstance(devices, Mapping) else None
    distinct = _distinct_requests(devices.get("constraints") if isinstance(devices, Mapping)
                                  else None)
    out: list[DraRequest] = []
    warnings: list[str] = []
    for i, r in enumerate(reqs if isinstance(reqs, list) else []):
        at = f"ResourceClaim {ns}/{name}: spec.devices.requests[{i}]"
        if not isinstance(r, Mapping):
            continue
        exact = r.get("exactly")
        rname = str(r.get("name") or "")
        if not isinstance(exact, Mapping):
            subs = r.get("firstAvailable")
            if isinstance(subs, list) and any(
                    isinstance(x, Mapping) and x.get("deviceClassName") == device_class
                    for x in subs):
                out.append(DraRequest(name, rname, 1, None, 0, index=i, ranked=False))
            continue
        if exact.get("deviceClassName") != device_class:
            continue
        if exact.get("allocationMode", "ExactCount") != "ExactCount":
            out.append(DraRequest(name, rname, 1, None, 0, index=i, ranked=False))
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
        selectors = exact.get("selectors")
        shared_only = any(isinstance(x, Mapping) and isinstance(x.get("cel"), Mapping)
                          and str(x["cel"].get("expression", "")).strip() == SHAREABLE
                          for x in (selectors if isinstance(selectors, list) else []))
        written = asked.get(dra.CAPACITY_MEMORY) if isinstance(asked, Mapping) else None
        out.append(DraRequest(name, rname, count, mem, core, index=i,
                              memory=str(written) if written is not None else "",
                              distinct=distinct is True or rname in (distinct or ()),
                              shared_only=shared_only,
                              tolerations=_tolerations(exact.get("tolerations"))))
    return out, warnings


def _distinct_requests(constraints: Any) -> bool | set[str]:
    """The requests a ``distinctAttribute`` constraint covers: ``True`` for all (a constraint
    that names no requests), else their names."""
    names: set[str] = set()
    for c in constraints if isinstance(constraints, list) else []:
        if not isinstance(c, Mapping) or not c.get("distinctAttribute"):
            continue
        reqs = c.get("requests")
        if not reqs:
            return True
        if isinstance(reqs, list):
            names |= {r for r in reqs if isinstance(r, str)}
    return names
