"""ResourcePolicy (``scheduling.alibabacloud.com/v1alpha1``, SPEC §8): the model, its validation,
and the pure decisions of custom priority-based scheduling — which pods a policy selects, which
unit a node belongs to, which units a pod may use now. No I/O: the extender counts pods per unit
(:mod:`sharegpu.extender.resourcepolicies`) and asks these functions.

A policy selects pods of its namespace by labels and lists ordered *units* (a set of nodes chosen
by ``nodeSelector``, at most ``max`` of the policy's pods). Pods fill units in order; when a pod
may try the next unit is ``whenTryNextUnits.policy``:

- ``LackResourceOrExceedMax`` (default): the unit is full (``max``) or no node of it fits;
- ``ExceedMax``: only when the unit is full (a pod that does not fit waits);
- ``TimeoutOrExceedMax``: the unit is full, or the pod has waited ``timeout`` for each unit
  before (waiting counted from the pod's creationTimestamp);
- ``LackResourceAndNoTerminating``: as the default, but never past a unit where a pod of the
  policy is terminating (its resources are about to be freed).

docs/resourcepolicy.md describes every field as implemented.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from .errors import ValidationError

GROUP: Final = "scheduling.alibabacloud.com"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "ResourcePolicy"
PLURAL: Final = "resourcepolicies"

# written on a pod at bind: the policy and the unit it was bound into ("<policy>/<index>"); the
# unit counts are rebuilt from it after a restart or a leader change
ANN_UNIT: Final = "resourcepolicy.sharegpu.io/unit"
# the ReplicaSet controller deletes pods of lower cost first: later units cost less
ANN_DELETION_COST: Final = "controller.kubernetes.io/pod-deletion-cost"
DELETION_COST_STEP: Final = 100

STRATEGIES: Final = ("prefer",)
RESOURCES: Final = ("ecs", "eci")
PREEMPT_POLICIES: Final = ("AfterAllUnits", "BeforeNextUnit")
LACK_OR_MAX: Final = "LackResourceOrExceedMax"
EXCEED_MAX: Final = "ExceedMax"
TIMEOUT_OR_MAX: Final = "TimeoutOrExceedMax"
LACK_NO_TERMINATING: Final = "LackResourceAndNoTerminating"
WHEN_POLICIES: Final = (LACK_OR_MAX, EXCEED_MAX, TIMEOUT_OR_MAX, LACK_NO_TERMINATING)
DEFAULT_TIMEOUT_S: Final = 15 * 60.0
# nodes of an ``eci`` unit: virtual-kubelet nodes (ACK's virtual node label)
ECI_NODE_LABELS: Final = {"type": "virtual-kubelet"}

_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Unit:
    resource: str = "ecs"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    max: int | None = None
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    pod_annotations: Mapping[str, str] = field(default_factory=dict)

    def has_node(self, labels: Mapping[str, str]) -> bool:
        """Whether a node with ``labels`` belongs to this unit."""
        want = self.node_selector
        if self.resource == "eci":
            want = {**ECI_NODE_LABELS, **want}
        return all(labels.get(k) == v for k, v in want.items())


@dataclass(frozen=True)
class ResourcePolicy:
    namespace: str
    name: str
    selector: Mapping[str, str]
    units: tuple[Unit, ...]
    strategy: str = "prefer"
    preempt_policy: str = "AfterAllUnits"
    ignore_previous_pod: bool = False
    ignore_terminating_pod: bool = True
    match_label_keys: tuple[str, ...] = ()
    when: str = LACK_OR_MAX
    timeout_s: float = DEFAULT_TIMEOUT_S
    created: float = 0.0  # creationTimestamp, seconds since the epoch (0: unknown)
    uid: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.selector.items())

    def group(self, labels: Mapping[str, str]) -> tuple[str | None, ...]:
        """The pods counted together: equal values of ``matchLabelKeys`` (e.g. one revision's
        ``pod-template-hash``)."""
        return tuple(labels.get(k) for k in self.match_label_keys)

    def unit_of_node(self, labels: Mapping[str, str], among: Sequence[int] | None = None
                     ) -> int | None:
        """The first unit (of ``among``, in that order; default all) the node belongs to."""
        for i in range(len(self.units)) if among is None else among:
            if self.units[i].has_node(labels):
                return i
        return None

    def deletion_cost(self, unit: int) -> int:
        """``pod-deletion-cost`` of a pod in ``unit``: lower in later units, so a ReplicaSet
        scaled in removes the pods of the last unit first."""
        return (len(self.units) - unit) * DELETION_COST_STEP

    def unit_annotation(self, unit: int) -> str:
        return f"{self.name}/{unit}"


class Usage:
    """How many of a policy's pods each unit holds (for the pod's group) and whether a pod of
    the policy is terminating there: what the decisions read. The extender's counter
    implements it; tests give their own."""

    def count(self, unit: int) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def terminating(self, unit: int) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


def reachable_units(policy: ResourcePolicy, usage: Usage, waited_s: float) -> list[int]:
    """The units a pod may use now, in the order it must try them, before resources are
    considered: full units (``max`` reached) are passed over under every policy; the list
    stops where ``whenTryNextUnits`` does not let the pod go further yet."""
    out: list[int] = []
    for i, unit in enumerate(policy.units):
        if unit.max is not None and usage.count(i) >= unit.max:
            continue
        out.append(i)
        if policy.when == EXCEED_MAX:
            break
        if policy.when == TIMEOUT_OR_MAX and len(out) > max(waited_s, 0.0) // policy.timeout_s:
            break
        if policy.when == LACK_NO_TERMINATING and usage.terminating(i):
            break
    return out


def choose_unit(reachable: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """The first reachable unit where the pod fits on some node (``fits``), or None."""
    for i in reachable:
        if fits(i):
            return i
    return None


def why_not(policy: ResourcePolicy, usage: Usage, reachable: Sequence[int]) -> str:
    """The reason a pod of ``policy`` finds no node: which units are full, which it may not
    try yet."""
    full = [i for i, u in enumerate(policy.units)
            if u.max is not None and usage.count(i) >= u.max]
    parts = []
    if reachable:
        parts.append(f"no node of unit {', '.join(map(str, reachable))} fits")
        nxt = max(reachable) + 1
        if nxt < len(policy.units) and policy.when != LACK_OR_MAX:
            parts.append(f"whenTryNextUnits {policy.when} does not allow unit {nxt} yet")
    if full:
        parts.append(f"unit {', '.join(map(str, full))} full (max)")
    if not reachable and not full:
        parts.append("no unit")
    return f"ResourcePolicy {policy.key}: " + "; ".join(parts)


def waited(created: float, now: float) -> float:
    return max(0.0, now - created) if created else 0.0


# ----------------------------------------------------------------- parsing and validation

def parse_time(text: Any) -> float:
    """An RFC 3339 timestamp (``metadata.creationTimestamp``) as seconds; 0.0 when absent or
    unreadable."""
    if not isinstance(text, str) or not text:
        return 0.0
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def parse_duration(text: Any, path: str) -> float:
    """A Go duration (``15m``, ``1h30m``, ``90s``) in seconds, > 0."""
    if not isinstance(text, str) or not text:
        raise ValidationError(path, text, "must be a duration such as 30s, 15m or 1h")
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if m is None:
            raise ValidationError(path, text, "must be a duration such as 30s, 15m or 1h "
                                  "(a number and a unit: ns, us, ms, s, m, h)")
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if total <= 0:
        raise ValidationError(path, text, "must be longer than 0")
    return total


def _label_key(key: Any, path: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValidationError(path, key, "must be a non-empty label key")
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _PREFIX.match(prefix)):
        raise ValidationError(path, key, "prefix must be a DNS subdomain (lowercase, dots)")
    if len(name) > 63 or not _NAME.match(name):
        raise ValidationError(path, key, "name must be 63 characters or less, alphanumeric, "
                              "'-', '_' or '.', starting and ending alphanumeric")
    return key


def _string_map(obj: Any, path: str, *, label_values: bool, keys: str = "label") -> dict[str, str]:
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise ValidationError(path, obj, "must be a map of strings")
    out: dict[str, str] = {}
    for k, v in obj.items():
        _label_key(k, f"{path}[{k!r}]" if isinstance(k, str) else path)
        if not isinstance(v, str):
            raise ValidationError(f"{path}.{k}", v, "must be a string")
        if label_values and (len(v) > 63 or not _VALUE.match(v)):
            raise ValidationError(f"{path}.{k}", v, f"must be a valid {keys} value (63 "
                                  "characters or less, alphanumeric, '-', '_' or '.')")
        out[k] = v
    return out


def _bool(obj: Mapping[str, Any], key: str, default: bool) -> bool:
    v = obj.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValidationError(f"spec.{key}", v, "must be true or false")
    return v


def _choice(value: Any, path: str, allowed: Sequence[str], default: str) -> str:
    if value is None or value == "":
        return default
    if value not in allowed:
        raise ValidationError(path, value, f"must be one of {', '.join(allowed)}")
    return str(value)


def _unit(obj: Any, path: str, selector: Mapping[str, str],
          match_keys: Sequence[str]) -> Unit:
    if not isinstance(obj, Mapping):
        raise ValidationError(path, obj, "must be an object")
    known = {"resource", "nodeSelector", "max", "podLabels", "podAnnotations"}
    extra = sorted(set(obj) - known)
    if extra:
        raise ValidationError(f"{path}.{extra[0]}", obj[extra[0]],
                              f"unknown field (a unit has {', '.join(sorted(known))})")
    resource = obj.get("resource")
    if resource == "elastic":
        raise ValidationError(f"{path}.resource", resource, "elastic (ACK auto-scaling node "
                              "pools) is not supported by sharegpu: use ecs with the pool's "
                              "nodeSelector")
    resource = _choice(resource, f"{path}.resource", RESOURCES, "ecs")
    node_selector = _string_map(obj.get("nodeSelector"), f"{path}.nodeSelector",
                                label_values=True)
    mx = obj.get("max")
    if mx is not None and (isinstance(mx, bool) or not isinstance(mx, int) or mx < 0
                           or mx > 2**31 - 1):
        raise ValidationError(f"{path}.max", mx, "must be an integer from 0 to 2147483647 "
                              "(leave it out for no limit)")
    labels = _string_map(obj.get("podLabels"), f"{path}.podLabels", label_values=True)
    for k, v in labels.items():
        if k in selector and selector[k] != v:
            raise ValidationError(f"{path}.podLabels.{k}", v, f"must not change a label the "
                                  f"policy selects on (spec.selector.{k}={selector[k]!r}): the "
                                  "pod would leave its own policy")
        if k in match_keys:
            raise ValidationError(f"{path}.podLabels.{k}", v, "must not set a label of "
                                  "spec.matchLabelKeys: the pod would change its group")
    anns = _string_map(obj.get("podAnnotations"), f"{path}.podAnnotations",
                       label_values=False)
    for k in anns:
        if k in (ANN_UNIT, ANN_DELETION_COST):
            raise ValidationError(f"{path}.podAnnotations.{k}", anns[k],
                                  "is written by the scheduler itself")
    return Unit(resource, node_selector, mx, labels, anns)


def parse_policy(obj: Any) -> ResourcePolicy:
    """A ResourcePolicy object → :class:`ResourcePolicy`; ValidationError naming the field and
    the rule for anything the CRD's schema or sharegpu does not accept."""
    if not isinstance(obj, Mapping):
        raise ValidationError("ResourcePolicy", obj, "must be an object")
    if obj.get("apiVersion", API_VERSION) != API_VERSION:
        raise ValidationError("apiVersion", obj.get("apiVersion"), f"must be {API_VERSION}")
    meta = obj.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise ValidationError("metadata", meta, "must be an object")
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise ValidationError("spec", spec, "must be an object with selector and units")
    known = {"selector", "strategy", "units", "preemptPolicy", "ignorePreviousPod",
             "ignoreTerminatingPod", "matchLabelKeys", "whenTryNextUnits"}
    extra = sorted(set(spec) - known)
    if extra:
        raise ValidationError(f"spec.{extra[0]}", spec[extra[0]], "unknown field")
    selector = _string_map(spec.get("selector"), "spec.selector", label_values=True)
    if not selector:
        raise ValidationError("spec.selector", spec.get("selector"),
                              "must name at least one label (key: value) of the pods")
    strategy = _choice(spec.get("strategy"), "spec.strategy", STRATEGIES, "prefer")
    keys_raw = spec.get("matchLabelKeys") or []
    if not isinstance(keys_raw, list):
        raise ValidationError("spec.matchLabelKeys", keys_raw, "must be a list of label keys")
    keys = tuple(_label_key(k, f"spec.matchLabelKeys[{i}]") for i, k in enumerate(keys_raw))
    if len(set(keys)) != len(keys):
        raise ValidationError("spec.matchLabelKeys", keys_raw, "must not repeat a key")
    units_raw = spec.get("units")
    if not isinstance(units_raw, list) or not units_raw:
        raise ValidationError("spec.units", units_raw, "must be a non-empty list of units")
    if len(units_raw) > 100:
        raise ValidationError("spec.units", f"{len(units_raw)} units", "must be 100 or fewer")
    units = tuple(_unit(u, f"spec.units[{i}]", selector, keys) for i, u in enumerate(units_raw))
    preempt = _choice(spec.get("preemptPolicy"), "spec.preemptPolicy", PREEMPT_POLICIES,
                      "AfterAllUnits")
    when_raw = spec.get("whenTryNextUnits") or {}
    if not isinstance(when_raw, Mapping):
        raise ValidationError("spec.whenTryNextUnits", when_raw,
                              "must be an object {policy, timeout}")
    extra = sorted(set(when_raw) - {"policy", "timeout"})
    if extra:
        raise ValidationError(f"spec.whenTryNextUnits.{extra[0]}", when_raw[extra[0]],
                              "unknown field (policy, timeout)")
    when = _choice(when_raw.get("policy"), "spec.whenTryNextUnits.policy", WHEN_POLICIES,
                   LACK_OR_MAX)
    timeout = DEFAULT_TIMEOUT_S
    if when_raw.get("timeout") not in (None, ""):
        timeout = parse_duration(when_raw["timeout"], "spec.whenTryNextUnits.timeout")
    name, ns = meta.get("name") or "", meta.get("namespace") or "default"
    if not isinstance(name, str) or not isinstance(ns, str):
        raise ValidationError("metadata.name", name, "must be a string")
    return ResourcePolicy(
        namespace=ns, name=name, selector=selector, units=units, strategy=strategy,
        preempt_policy=preempt,
        ignore_previous_pod=_bool(spec, "ignorePreviousPod", False),
        ignore_terminating_pod=_bool(spec, "ignoreTerminatingPod", True),
        match_label_keys=keys, when=when, timeout_s=timeout,
        created=parse_time(meta.get("creationTimestamp")), uid=str(meta.get("uid") or ""))


def parse_unit_annotation(value: Any) -> tuple[str, int] | None:
    """``"<policy>/<index>"`` → (policy name, unit index); None when absent or malformed."""
    if not isinstance(value, str):
        return None
    name, sep, idx = value.rpartition("/")
    if not sep or not name or not idx.isdigit() or len(idx) > 4:
        return None
    return name, int(idx)


def pick_policy(policies: Sequence[ResourcePolicy], labels: Mapping[str, str]
                ) -> ResourcePolicy | None:
    """The policy that governs a pod with ``labels`` among its namespace's: the oldest that
    selects it (then by name), so the answer never depends on the order they were seen."""
    best: ResourcePolicy | None = None
    for p in policies:
        if p.selects(labels) and (best is None or (p.created, p.name) < (best.created,
                                                                           best.name)):
            best = p
    return best
