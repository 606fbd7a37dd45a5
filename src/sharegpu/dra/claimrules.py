"""What a user's own ResourceClaim or ResourceClaimTemplate may ask of sharegpu's DeviceClass.
Refused, naming the JSON path and the rule: memory off the 1 GiB step, cores off the 5 % step,
a capacity the GPUs do not publish, two requests of the class that no ``distinctAttribute``
keeps on distinct GPUs, a malformed structure. Warned (admitted; works as written, maybe not as
meant): ``count`` > 1 without such a constraint, a capacity request that may take a whole
exclusive GPU, ``allocationMode: All``, a toleration of sharegpu's own device taints. Only the
requests of sharegpu's DeviceClass are read. Pure: the validating webhook
(:mod:`sharegpu.webhook`) is the adapter; docs/dra.md says why each rule is what it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Final

from ..core.errors import ValidationError
from ..core.quantity import parse as parse_quantity
from . import driver as dra
from .draclaims import SHAREABLE

GROUP: Final = "resource.k8s.io"
VERSION: Final = "v1"
CLAIM: Final = "ResourceClaim"
TEMPLATE: Final = "ResourceClaimTemplate"
KINDS: Final = (CLAIM, TEMPLATE)
CAPACITIES: Final = (dra.CAPACITY_MEMORY, dra.CAPACITY_CORES)


def distinct_attributes(device_class: str = dra.DRIVER) -> tuple[str, str]:
    """Attributes that differ between any two GPUs of one node (a claim's devices are on one
    node), qualified by the driver's name, which the chart's DeviceClass bears."""
    return (f"{device_class}/uuid", f"{device_class}/index")

GIB: Final = dra.MEMORY_STEP

RULE_MEMORY_STEP = ("must be a whole number of GiB: the driver's memory is consumed in steps of "
                    "1Gi, so {asked} would consume {consumed}Gi; ask for {ask}")
RULE_MEMORY_MIN = "must be at least 1Gi (the driver's smallest share of memory{why})"
RULE_CORES = ("must be a whole multiple of 5 from 5 to 100 (percent of the GPU; the driver's "
              "cores are consumed in steps of 5, so {asked} {consumes})")
RULE_CAPACITY_NAME = ("is not a capacity of DeviceClass {cls}: its GPUs publish only memory "
                      "(bytes, in steps of 1Gi) and cores (percent, in steps of 5); a request "
                      "for another name is never allocated")
RULE_TWO_REQUESTS = ("requests {names} of DeviceClass {cls} in one claim must be kept on "
                     "distinct GPUs: add constraints: [{{requests: {names}, distinctAttribute: "
                     "{attr}}}] (the allocator gives each request the first GPU that fits, and "
                     "a GPU twice in one claim cannot be prepared)")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the webhook answers: refusals (the object is not admitted) and warnings."""

    refusals: tuple[ValidationError, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def allowed(self) -> bool:
        return not self.refusals

    @property
    def message(self) -> str:
        return "; ".join(str(e) for e in self.refusals)


@dataclass
class _Found:
    refusals: list[ValidationError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check(kind: str, obj: Mapping[str, Any], device_class: str = dra.DRIVER) -> Verdict:
    """The verdict on a ``resource.k8s.io/v1`` ResourceClaim (``spec.devices``) or
    ResourceClaimTemplate (``spec.spec.devices``)."""
    if kind not in KINDS:
        raise ValueError(f"not a claim kind: {kind!r}")
    spec = obj.get("spec") if isinstance(obj, Mapping) else None
    at = "spec"
    if spec is not None and not isinstance(spec, Mapping):
        return Verdict((ValidationError(at, spec, "must be an object"),))
    if kind == TEMPLATE:
        at = "spec.spec"
        spec = spec.get("spec") if isinstance(spec, Mapping) else None
        if spec is not None and not isinstance(spec, Mapping):
            return Verdict((ValidationError(at, spec, "must be an object"),))
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    if devices is None:
        return Verdict()
    if not isinstance(devices, Mapping):
        return Verdict((ValidationError(f"{at}.devices", devices, "must be an object"),))
    return check_devices(devices, f"{at}.devices", device_class)


def check_claim(obj: Mapping[str, Any], device_class: str = dra.DRIVER) -> Verdict:
    return check(CLAIM, obj, device_class)


def check_template(obj: Mapping[str, Any], device_class: str = dra.DRIVER) -> Verdict:
    return check(TEMPLATE, obj, device_class)


def check_devices(devices: Mapping[str, Any], at: str,
                  device_class: str = dra.DRIVER) -> Verdict:
    """The verdict on a claim spec's ``devices`` found at ``at`` (the JSON path named in
    messages)."""
    found = _Found()
    reqs = devices.get("requests")
    if reqs is None:
        return Verdict()
    if not isinstance(reqs, list):
        return Verdict((ValidationError(f"{at}.requests", reqs, "must be a list"),))
    distinct = _distinct_sets(devices.get("constraints"), device_class)
    ours: list[str] = []  # names of the requests of the class
    for i, r in enumerate(reqs):
        where = f"{at}.requests[{i}]"
        if not isinstance(r, Mapping):
            found.refusals.append(ValidationError(where, r, "must be an object"))
            continue
        name = r.get("name") if isinstance(r.get("name"), str) else f"#{i}"
        exactly = r.get("exactly")
        subs = r.get("firstAvailable")
        mine = False
        if isinstance(exactly, Mapping) and exactly.get("deviceClassName") == device_class:
            mine = True
            _check_request(exactly, f"{where}.exactly", name, distinct, device_class, found)
        elif exactly is not None and not isinstance(exactly, Mapping):
            found.refusals.append(ValidationError(f"{where}.exactly", exactly,
                                                  "must be an object"))
        if subs is not None and not isinstance(subs, list):
            found.refusals.append(ValidationError(f"{where}.firstAvailable", subs,
                                                  "must be a list"))
            subs = None
        for j, s in enumerate(subs or []):
            if not isinstance(s, Mapping):
                found.refusals.append(ValidationError(f"{where}.firstAvailable[{j}]", s,
                                                      "must be an object"))
                continue
            if s.get("deviceClassName") != device_class:
                continue
            mine = True
            sub = s.get("name") if isinstance(s.get("name"), str) else f"#{j}"
            _check_request(s, f"{where}.firstAvailable[{j}]", f"{name}/{sub}", distinct,
                           device_class, found, parent=name)
        if mine:
            ours.append(name)
    for a, b in _pairs(ours):
        if not any(_covers(d, a) and _covers(d, b) for d in distinct):
            names = sorted({a, b})
            found.refusals.append(ValidationError(
                f"{at}.constraints", devices.get("constraints") or [],
                RULE_TWO_REQUESTS.format(names="[" + ", ".join(names) + "]", cls=device_class,
                                         attr=distinct_attributes(device_class)[0])))
            break
    return Verdict(tuple(found.refusals), tuple(found.warnings))


def _pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]


def _distinct_sets(constraints: Any, device_class: str) -> list[frozenset[str] | None]:
    """The request sets kept on distinct GPUs by a ``distinctAttribute`` of a per-GPU attribute
    (``None``: the constraint names no requests, so it applies to all). Malformed entries keep
    nothing apart (a refusal or warning follows, never a pass)."""
    out: list[frozenset[str] | None] = []
    for c in constraints if isinstance(constraints, list) else []:
        if not isinstance(c, Mapping) or c.get("distinctAttribute") not in distinct_attributes(
                device_class):
            continue
        names = c.get("requests")
        if not names:
            out.append(None)
        elif isinstance(names, list) and all(isinstance(n, str) for n in names):
            out.append(frozenset(names))
    return out


def _covers(names: frozenset[str] | None, request: str, parent: str | None = None) -> bool:
    """Whether a constraint over ``names`` applies to ``request`` (``req`` or ``req/sub``; a
    constraint naming ``req`` applies to all its subrequests)."""
    return names is None or request in names or (parent is not None and parent in names)


def _gib(q: Fraction) -> str:
    x = q / GIB
    return f"{x.numerator}Gi" if x.denominator == 1 else f"{round(float(x), 3):g} GiB"


def _check_request(body: Mapping[str, Any], at: str, name: str,
                   distinct: list[frozenset[str] | None], device_class: str, found: _Found,
                   parent: str | None = None) -> None:
    """One request (``exactly``) or subrequest (``firstAvailable[j]``) of the class."""
    mode = body.get("allocationMode", "ExactCount")
    count = body.get("count", 1)
    if mode == "ExactCount" and (not isinstance(count, int) or isinstance(count, bool)
                                 or count < 1):
        found.refusals.append(ValidationError(f"{at}.count", count,
                                              "must be a positive whole number of GPUs"))
    elif mode == "ExactCount" and count > 1 and not any(
            _covers(d, name, parent) for d in distinct):
        found.warnings.append(
            f"{at}.count={count}: add constraints: [{{requests: [{parent or name}], "
            f"distinctAttribute: {distinct_attributes(device_class)[0]}}}] to be sure of "
            f"{count} distinct GPUs (kube-scheduler 1.37 gives them; the API does not promise it)")
    elif mode == "All":
        found.warnings.append(
            f"{at}.allocationMode='All': takes a share of every GPU of DeviceClass "
            f"{device_class} on the node, and a node where one GPU lacks the room does not fit; "
            "sharegpu's extender does not rank it")
    cap = body.get("capacity")
    asked: Any = cap.get("requests") if isinstance(cap, Mapping) else None
    if cap is not None and not isinstance(cap, Mapping):
        found.refusals.append(ValidationError(f"{at}.capacity", cap, "must be an object"))
    elif asked is not None and not isinstance(asked, Mapping):
        found.refusals.append(ValidationError(f"{at}.capacity.requests", asked,
                                              "must be a map of capacity name to quantity"))
        asked = None
    for cname, value in (asked or {}).items():
        where = (f"{at}.capacity.requests.{cname}" if cname in CAPACITIES
                 else f'{at}.capacity.requests["{cname}"]')
        try:
            if cname == dra.CAPACITY_MEMORY:
                _memory(where, value)
            elif cname == dra.CAPACITY_CORES:
                _cores(where, value)
            else:
                raise ValidationError(where, value, RULE_CAPACITY_NAME.format(cls=device_class))
        except ValidationError as e:
            found.refusals.append(e)
    selectors = body.get("selectors")
    shareable = any(isinstance(s, Mapping) and isinstance(s.get("cel"), Mapping)
                    and "allowMultipleAllocations" in str(s["cel"].get("expression", ""))
                    for s in (selectors if isinstance(selectors, list) else []))
    if asked and not shareable:
        found.warnings.append(
            f"{at}.selectors: without {{cel: {{expression: '{SHAREABLE}'}}}} the request may "
            "be given a whole GPU of an exclusive node (mode default or topology)")
    tolerations = body.get("tolerations")
    for k, t in enumerate(tolerations if isinstance(tolerations, list) else []):
        if not isinstance(t, Mapping):
            continue
        key = t.get("key")
        for taint, why in ((dra.TAINT_UNHEALTHY, "a GPU with a critical XID"),
                           (dra.TAINT_ISOLATION, "a GPU whose isolation back-end is not usable "
                                                 "(the kubelet plugin still refuses a shared "
                                                 "claim there)")):
            if key == taint or (not key and t.get("operator") == "Exists"):
                found.warnings.append(f"{at}.tolerations[{k}]: lets the claim onto {why}")


def _memory(field: str, value: Any) -> None:
    q = parse_quantity(field, value)
    asked = value if isinstance(value, str) else str(value)
    if q < GIB:
        why = f"; {asked} would consume 1Gi" if q >= 0 else ""
        raise ValidationError(field, value, RULE_MEMORY_MIN.format(why=why))
    if q % GIB:
        up = math.ceil(q / GIB)
        down = up - 1
        shown = asked if asked.endswith("Gi") else f"{asked} ({_gib(q)})"
        raise ValidationError(field, value, RULE_MEMORY_STEP.format(
            asked=shown, consumed=up, ask=f"{down}Gi or {up}Gi"))


def _cores(field: str, value: Any) -> None:
    q = parse_quantity(field, value)
    step = dra.CORE_STEP
    if q.denominator == 1 and q % step == 0 and step <= q <= dra.CORES_PER_GPU:
        return
    asked = value if isinstance(value, str) else str(value)
    if q > dra.CORES_PER_GPU:
        consumes = f"fits no GPU, which has {dra.CORES_PER_GPU}"
    elif q < 0:
        consumes = "is no share"
    else:
        consumes = f"would consume {dra.consumed_cores(q)}"
    raise ValidationError(field, value, RULE_CORES.format(asked=asked, consumes=consumes))
