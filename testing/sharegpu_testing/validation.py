"""The object validation rules of the real API server that sharegpu's writes can run into:
label and annotation syntax, resource quantities (extended resources such as
``aliyun.com/gpu-mem`` are whole numbers, and in pods their request must equal their limit),
the defaulting of container requests from limits, the pod fields an update may change, the
fields events.k8s.io/v1 requires.

Each check returns ``(field, message)`` causes; the store turns them into 422 Invalid.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from .jsonobj import clone

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED = re.compile(rf"^({_PREFIX}/)?{_NAME}$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUANTITY = re.compile(
    r"^(?P<num>[+-]?(\d+(\.\d*)?|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$"
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
}  # fmt: skip
_NATIVE_PREFIXES = ("kubernetes.io/", "requests.")
_MAX_ANNOTATIONS = 256 * 1024

Causes = list[tuple[str, str]]

LABEL_VALUE_RULE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character"
)
KEY_RULE = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
    "with an alphanumeric character, with an optional DNS subdomain prefix and '/'"
)


def parse_quantity(text: Any) -> Decimal | None:
    """The value of a Kubernetes quantity ("1", "500m", "15Gi", "1e3"), or None if invalid."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        return None
    m = _QUANTITY.match(str(text).strip()) if isinstance(text, str) else None
    if isinstance(text, (int, float)):
        return Decimal(str(text))
    if m is None:
        return None
    try:
        num = Decimal(m["num"])
    except InvalidOperation:
        return None
    suffix = m["suffix"] or ""
    if suffix in _BINARY:
        return num * _BINARY[suffix]
    if suffix in _DECIMAL:
        return num * _DECIMAL[suffix]
    return num * (Decimal(10) ** int(suffix[1:]))


def is_extended_resource(name: str) -> bool:
    """Extended resources (``vendor.com/thing``) outside the kubernetes.io namespace."""
    return (
        "/" in name
        and not any(name.startswith(p) for p in _NATIVE_PREFIXES)
        and not (name.split("/", 1)[0].endswith(".kubernetes.io"))
    )


def check_key(key: Any) -> bool:
    return isinstance(key, str) and bool(_QUALIFIED.match(key)) and len(key.split("/")[-1]) <= 63


def validate_metadata(meta: dict[str, Any]) -> Causes:
    causes: Causes = []
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        return [("metadata.labels", "Invalid value: must be a map of strings")]
    for key, value in labels.items():
        if not check_key(key):
            causes.append(("metadata.labels", f'Invalid value: "{key}": {KEY_RULE}'))
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(("metadata.labels", f'Invalid value: "{value}": {LABEL_VALUE_RULE}'))
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict):
        return [*causes, ("metadata.annotations", "Invalid value: must be a map of strings")]
    size = 0
    for key, value in annotations.items():
        if not check_key(key):
            causes.append(("metadata.annotations", f'Invalid value: "{key}": {KEY_RULE}'))
        if not isinstance(value, str):
            causes.append(("metadata.annotations", f"Invalid value: {key}: values must be strings"))
            continue
        size += len(key) + len(value)
    if size > _MAX_ANNOTATIONS:
        causes.append(
            ("metadata.annotations", f"Too long: must have at most {_MAX_ANNOTATIONS} bytes")
        )
    return causes


def _check_quantity(path: str, name: str, value: Any) -> Causes:
    q = parse_quantity(value)
    if q is None:
        return [(f"{path}[{name}]", f'Invalid value: "{value}": must be a valid quantity')]
    if q < 0:
        return [
            (f"{path}[{name}]", f'Invalid value: "{value}": must be greater than or equal to 0')
        ]
    if is_extended_resource(name) and q != q.to_integral_value():
        return [(f"{path}[{name}]", f'Invalid value: "{value}": must be an integer')]
    return []


def default_pod_resources(pod: dict[str, Any]) -> None:
    """Requests default to limits for every resource that has only a limit (upstream defaulting)."""
    spec = pod.get("spec") or {}
    for group in ("containers", "initContainers"):
        for c in spec.get(group) or []:
            res = c.get("resources") if isinstance(c, dict) else None
            if not isinstance(res, dict) or not isinstance(res.get("limits"), dict):
                continue
            requests = res.setdefault("requests", {})
            if isinstance(requests, dict):
                for name, value in res["limits"].items():
                    requests.setdefault(name, value)


def validate_pod_resources(pod: dict[str, Any]) -> Causes:
    causes: Causes = []
    spec = pod.get("spec") or {}
    for group in ("containers", "initContainers"):
        for i, c in enumerate(spec.get(group) or []):
            res = (c.get("resources") if isinstance(c, dict) else None) or {}
            path = f"spec.{group}[{i}].resources"
            limits = res.get("limits") or {}
            requests = res.get("requests") or {}
            for kind, table in (("limits", limits), ("requests", requests)):
                for name, value in table.items():
                    causes += _check_quantity(f"{path}.{kind}", name, value)
            for name, value in requests.items():
                if not is_extended_resource(name):
                    continue
                if name not in limits:
                    why = "Required value: Limit must be set for non overcommitable resources"
                    why += f" ({name})"
                    causes.append((f"{path}.limits", why))
                elif parse_quantity(value) != parse_quantity(limits[name]):
                    why = (
                        f'Invalid value: "{value}": must be equal to {name} limit of {limits[name]}'
                    )
                    causes.append((f"{path}.requests[{name}]", why))
    return causes


def validate_node_resources(node: dict[str, Any]) -> Causes:
    causes: Causes = []
    status = node.get("status") or {}
    for kind in ("capacity", "allocatable"):
        table = status.get(kind) or {}
        if isinstance(table, dict):
            for name, value in table.items():
                causes += _check_quantity(f"status.{kind}", name, value)
    return causes


_POD_UPDATE_FORBIDDEN = (
    "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
    "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only "
    "additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be "
    "set to 1 if it was previously negative)"
)
_POD_MUTABLE = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds",
                "schedulingGates")  # fmt: skip


def validate_pod_containers(pod: dict[str, Any]) -> Causes:
    spec = pod.get("spec")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not containers:
        return [("spec.containers", "Required value")]
    causes: Causes = []
    for i, c in enumerate(containers):
        if not isinstance(c, dict) or not c.get("name"):
            causes.append((f"spec.containers[{i}].name", "Required value"))
        elif not c.get("image"):
            causes.append((f"spec.containers[{i}].image", "Required value"))
    return causes


def _frozen_pod_spec(spec: Any) -> Any:
    s = clone(spec) if isinstance(spec, dict) else {}
    for field in _POD_MUTABLE:
        s.pop(field, None)
    for group in ("containers", "initContainers"):
        for c in s.get(group) or []:
            if isinstance(c, dict):
                c.pop("image", None)
    return s


def pod_spec_update_causes(old: Any, new: Any) -> Causes:
    """A pod's spec may only change in a few fields (spec.nodeName only through binding)."""
    if _frozen_pod_spec(old) != _frozen_pod_spec(new):
        return [("spec", _POD_UPDATE_FORBIDDEN)]
    return []


def qos_class(pod: dict[str, Any]) -> str:
    """BestEffort, Burstable or Guaranteed, from the containers' cpu and memory."""
    any_set = False
    guaranteed = True
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if req or lim:
            any_set = True
        for r in ("cpu", "memory"):
            if r not in lim or req.get(r, lim[r]) != lim[r]:
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def validate_event(event: dict[str, Any]) -> Causes:
    """core/v1: an event about a namespaced object lives in that object's namespace."""
    ns = (event.get("involvedObject") or {}).get("namespace")
    if ns and ns != (event.get("metadata") or {}).get("namespace"):
        return [
            ("involvedObject.namespace", f'Invalid value: "{ns}": does not match event.namespace')
        ]
    return []


def validate_event_v1_create(event: dict[str, Any]) -> Causes:
    """The rules events.k8s.io/v1 adds for new events (series rules left out)."""
    required = ("eventTime", "reportingController", "reportingInstance", "action", "reason")
    causes: Causes = [(f, "Required value") for f in required if not event.get(f)]
    if event.get("type") not in ("Normal", "Warning"):
        causes.append(("type", f"Invalid value: {event.get('type')!r}: has invalid value"))
    for f in ("deprecatedFirstTimestamp", "deprecatedLastTimestamp", "deprecatedCount"):
        if event.get(f):
            causes.append((f, "Invalid value: needs to be unset"))
    src = event.get("deprecatedSource") or {}
    if src.get("component") or src.get("host"):
        causes.append(("deprecatedSource", "Invalid value: needs to be unset"))
    return causes


def validate_lease(lease: dict[str, Any]) -> Causes:
    """coordination.k8s.io/v1: durations positive, transitions not negative."""
    spec = lease.get("spec") or {}
    causes: Causes = []
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        causes.append(
            ("spec.leaseDurationSeconds", f"Invalid value: {duration!r}: must be greater than 0")
        )
    transitions = spec.get("leaseTransitions")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        causes.append(
            (
                "spec.leaseTransitions",
                f"Invalid value: {transitions!r}: must be greater than or equal to 0",
            )
        )
    return causes
