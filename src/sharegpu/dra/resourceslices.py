"""What a node's ResourceSlice says (``resource.k8s.io/v1``, DRA with consumable capacity).

Pure: GPUs in, one ResourceSlice object out, checked against the rules the API server applies
(``k8s.io/kubernetes`` v1.37 ``pkg/apis/resource/validation``), so that bad GPU data is refused
here with the field and the rule, and nothing is published. The agent's adapter
(:mod:`sharegpu.agent.slicepublisher`) writes it. The devices, attributes, capacities, request
policies and taints: docs/dra.md ("The ResourceSlice").
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import ValidationError
from ..core.modes import Mode
from ..core.quantity import parse as parse_quantity
from .driver import CAPACITY_CORES as CORES
from .driver import CAPACITY_MEMORY as MEMORY
from .driver import CORE_STEP, DRIVER, TAINT_ISOLATION, TAINT_UNHEALTHY, device_name
from .driver import CORES_PER_GPU as CORES_TOTAL
from .driver import MEMORY_STEP as GIB

API_VERSION = "resource.k8s.io/v1"
DEVICE_CLASS = DRIVER

# The API server's limits (k8s.io/api resource/v1 types.go)
MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64  # when any device has taints
MAX_ATTRS_AND_CAPS = 32
MAX_STRING = 64
MAX_ID = 32
MAX_DRIVER = 63
MAX_NAME = 253

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_C_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class SliceGpu:
    """One GPU as the slice describes it."""

    index: int
    uuid: str
    model: str
    mem_mib: int  # NVML's total
    mem_gib: int  # advertised (the agent's GiB, after --reserve-mib)
    nvlink_peers: tuple[int, ...] = ()
    unhealthy: bool = False
    isolation_unavailable: bool = False


def slice_name(node: str, driver: str = DRIVER) -> str:
    """The one slice of ``driver`` for ``node``: a fixed name, so that a restarted agent finds
    and updates it instead of adding a second one."""
    name = f"{node}-{driver}"
    if len(name) <= MAX_NAME:
        return name
    import hashlib

    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    head = node[:MAX_NAME - len(driver) - len(digest) - 2].rstrip(".-")
    return f"{head}-{digest}-{driver}"


def nvlink_peers(links: Sequence[Sequence[str]] | None, index: int) -> tuple[int, ...]:
    """The GPUs ``index`` has NVLink to, from a link matrix as ``nvidia-smi topo -m`` names the
    kinds (``NV<n>``)."""
    if not links or not 0 <= index < len(links):
        return ()
    return tuple(j for j, kind in enumerate(links[index])
                 if j != index and str(kind).startswith("NV"))


# ------------------------------------------------------------------ names


def _dns_subdomain(field: str, value: str, limit: int = MAX_NAME) -> None:
    if not value:
        raise ValidationError(field, value, "must not be empty")
    if len(value) > limit:
        raise ValidationError(field, value, f"must be at most {limit} characters")
    for part in value.split("."):
        if not _LABEL.fullmatch(part):
            raise ValidationError(
                field, value, "must be a lowercase DNS subdomain (RFC 1123): labels of a-z, 0-9 "
                "and '-', starting and ending with a letter or digit, joined by '.'")


def check_driver_name(field: str, value: str) -> None:
    """A DRA driver name: a lowercase DNS subdomain of at most 63 characters."""
    _dns_subdomain(field, value, MAX_DRIVER)


def _dns_label(field: str, value: str) -> None:
    if not value or len(value) > 63 or not _LABEL.fullmatch(value):
        raise ValidationError(field, value, "must be a DNS label (RFC 1123): at most 63 "
                              "characters of a-z, 0-9 and '-', starting and ending with a letter "
                              "or digit")


_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def _label_key(field: str, key: str) -> None:
    """A label key (``[prefix/]name``), as device taint keys are."""
    prefix, slash, name = key.rpartition("/")
    if slash:
        _dns_subdomain(field, prefix)
    if not name or len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        raise ValidationError(field, key, "must be a label key: an optional DNS subdomain and "
                              "'/', then at most 63 characters of letters, digits, '-', '_' "
                              "and '.', starting and ending with a letter or digit")


def _qualified(field: str, name: str) -> None:
    domain, slash, ident = name.rpartition("/")
    if slash:
        _dns_subdomain(field, domain, MAX_DRIVER)
    if not _C_ID.fullmatch(ident) or len(ident) > MAX_ID:
        raise ValidationError(field, name, f"must be a C identifier of at most {MAX_ID} "
                              "characters, optionally after a DNS subdomain and '/'")


# ------------------------------------------------------------------ quantities


def _bytes_quantity(n: int) -> str:
    """A byte count as the API server writes it back (canonical: ``15Gi``, else plain)."""
    return f"{n // GIB}Gi" if n % GIB == 0 and n else str(n)


def quantity_value(field: str, q: Any) -> int:
    """An integral quantity's value (the slice uses whole bytes and percents only)."""
    v = parse_quantity(field, q)
    if v.denominator != 1:
        raise ValidationError(field, q, "must be a whole number")
    return int(v)


# ------------------------------------------------------------------ the slice


def _check_gpus(gpus: Sequence[SliceGpu]) -> None:
    seen_index: set[int] = set()
    seen_uuid: set[str] = set()
    for i, g in enumerate(gpus):
        f = f"gpus[{i}]"
        if isinstance(g.index, bool) or not isinstance(g.index, int) or g.index < 0:
            raise ValidationError(f"{f}.index", g.index, "must be an integer >= 0")
        if g.index in seen_index:
            raise ValidationError(f"{f}.index", g.index, "must be unique on the node")
        seen_index.add(g.index)
        if not isinstance(g.uuid, str) or not g.uuid.strip():
            raise ValidationError(f"{f}.uuid", g.uuid, "must be a non-empty string")
        if g.uuid in seen_uuid:
            raise ValidationError(f"{f}.uuid", g.uuid, "must be unique on the node")
        seen_uuid.add(g.uuid)
        for name, value in (("uuid", g.uuid), ("model", g.model)):
            if not isinstance(value, str) or not value.strip():
                raise ValidationError(f"{f}.{name}", value, "must be a non-empty string")
            if len(value) > MAX_STRING:
                raise ValidationError(f"{f}.{name}", value, f"must be at most {MAX_STRING} "
                                      "characters (a device attribute string)")
        if isinstance(g.mem_mib, bool) or not isinstance(g.mem_mib, int) or g.mem_mib <= 0:
            raise ValidationError(f"{f}.mem_mib", g.mem_mib, "must be a positive number of MiB")
        if isinstance(g.mem_gib, bool) or not isinstance(g.mem_gib, int) or g.mem_gib < 1:
            raise ValidationError(f"{f}.mem_gib", g.mem_gib, "must be at least 1 GiB")
        for p in g.nvlink_peers:
            if p == g.index or p < 0:
                raise ValidationError(f"{f}.nvlink_peers", g.nvlink_peers,
                                      "must name other GPUs' indices")


def _capacity(total: int, step: int, shared: bool, quantity: Any) -> dict[str, Any]:
    cap: dict[str, Any] = {"value": quantity(total)}
    if shared:
        rng = {"min": quantity(step), "max": quantity(total), "step": quantity(step)}
        if step + step > total:  # the API server wants min + step <= value: one value only
            del rng["step"]
        cap["requestPolicy"] = {"default": quantity(step), "validRange": rng}
    return cap


def _device(g: SliceGpu, mode: Mode) -> dict[str, Any]:
    shared = mode.shared
    attrs: dict[str, Any] = {
        "model": {"string": g.model},
        "uuid": {"string": g.uuid},
        "index": {"int": g.index},
        "memoryMiB": {"int": g.mem_mib},
        "nvlinkPeers": {"string": ",".join(str(p) for p in sorted(set(g.nvlink_peers)))},
        "mode": {"string": mode.value},
    }
    dev: dict[str, Any] = {
        "name": device_name(g.index),
        "attributes": attrs,
        "capacity": {
            MEMORY: _capacity(g.mem_gib * GIB, GIB, shared, _bytes_quantity),
            CORES: _capacity(CORES_TOTAL, CORE_STEP, shared, str),
        },
    }
    if shared:
        dev["allowMultipleAllocations"] = True
    taints = []
    if g.unhealthy:
        taints.append({"key": TAINT_UNHEALTHY, "effect": "NoSchedule"})
    if g.isolation_unavailable:
        taints.append({"key": TAINT_ISOLATION, "effect": "NoSchedule"})
    if taints:
        dev["taints"] = taints
    return dev


def build_slice(
    node: str,
    gpus: Sequence[SliceGpu],
    mode: Mode,
    *,
    generation: int = 1,
    driver: str = DRIVER,
    owner: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ResourceSlice of ``node``: one device per GPU. ``owner`` (``kind``, ``name``,
    ``uid``, ``apiVersion``) becomes its only ownerReference. Raises :class:`ValidationError`
    naming the field and the rule when the GPUs or names would make a slice the API server
    refuses."""
    _check_gpus(gpus)
    obj: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node, driver),
                     "labels": {"app.kubernetes.io/managed-by": "sharegpu-agent"}},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [_device(g, mode) for g in sorted(gpus, key=lambda g: g.index)],
        },
    }
    if owner is not None:
        obj["metadata"]["ownerReferences"] = [{
            "apiVersion": owner.get("apiVersion", API_VERSION), "kind": owner["kind"],
            "name": owner["name"], "uid": owner["uid"]}]
    validate_slice(obj)
    return obj


# ------------------------------------------------------------------ validation


def validate_slice(obj: Mapping[str, Any]) -> None:
    """The API server's rules for a ResourceSlice, the ones this slice can meet: names, pool,
    node, device count, attributes, capacities and their request policies, taints."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    driver = str(spec.get("driver", ""))
    _dns_subdomain("spec.driver", driver, MAX_DRIVER)
    _dns_subdomain("metadata.name", str(meta.get("name", "")))
    node = spec.get("nodeName")
    if node is not None:
        _dns_subdomain("spec.nodeName", str(node))
    pool = spec.get("pool") or {}
    pool_name = str(pool.get("name", ""))
    if not pool_name or len(pool_name) > MAX_NAME:
        raise ValidationError("spec.pool.name", pool_name, f"must be 1 to {MAX_NAME} characters")
    for part in pool_name.split("/"):
        _dns_subdomain("spec.pool.name", part)
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        raise ValidationError("spec.pool.generation", pool.get("generation"),
                              "must be an integer >= 0")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        raise ValidationError("spec.pool.resourceSliceCount", pool.get("resourceSliceCount"),
                              "must be greater than zero")
    if node is None:
        raise ValidationError("spec.nodeName", None, "must be set (a node-local pool)")
    devices = spec.get("devices") or []
    tainted = any(d.get("taints") for d in devices)
    limit = MAX_DEVICES_ADVANCED if tainted else MAX_DEVICES
    if len(devices) > limit:
        raise ValidationError("spec.devices", len(devices),
                              f"must have at most {limit} devices"
                              + (" when any device has taints" if tainted else ""))
    names: set[str] = set()
    for i, d in enumerate(devices):
        _validate_device(f"spec.devices[{i}]", d)
        if d["name"] in names:
            raise ValidationError(f"spec.devices[{i}].name", d["name"], "must be unique")
        names.add(d["name"])


def _validate_device(f: str, d: Mapping[str, Any]) -> None:
    _dns_label(f"{f}.name", str(d.get("name", "")))
    attrs = d.get("attributes") or {}
    caps = d.get("capacity") or {}
    if len(attrs) + len(caps) > MAX_ATTRS_AND_CAPS:
        raise ValidationError(f, len(attrs) + len(caps),
                              f"the attributes and capacities together must be at most "
                              f"{MAX_ATTRS_AND_CAPS}")
    for name, a in attrs.items():
        af = f"{f}.attributes[{name}]"
        _qualified(af, name)
        kinds = [k for k in ("int", "bool", "string", "version") if k in a]
        if len(kinds) != 1 or set(a) - set(kinds):
            raise ValidationError(af, a, "exactly one value must be specified (int, bool, "
                                  "string or version; list values need the alpha gate "
                                  "DRAListTypeAttributes)")
        v = a[kinds[0]]
        if kinds[0] == "int" and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValidationError(f"{af}.int", v, "must be an integer")
        if kinds[0] in ("string", "version") and (not isinstance(v, str) or len(v) > MAX_STRING):
            raise ValidationError(f"{af}.{kinds[0]}", v,
                                  f"must be a string of at most {MAX_STRING} characters")
    multi = d.get("allowMultipleAllocations") is True
    for name, c in caps.items():
        cf = f"{f}.capacity[{name}]"
        _qualified(cf, name)
        value = quantity_value(f"{cf}.value", c.get("value"))
        if value < 0:
            raise ValidationError(f"{cf}.value", c.get("value"), "must not be negative")
        policy = c.get("requestPolicy")
        if policy is None:
            continue
        if not multi:
            raise ValidationError(f"{cf}.requestPolicy", policy,
                                  "forbidden: allowMultipleAllocations must be true")
        _validate_policy(f"{cf}.requestPolicy", value, policy)
    for j, t in enumerate(d.get("taints") or []):
        tf = f"{f}.taints[{j}]"
        _label_key(f"{tf}.key", str(t.get("key", "")))
        if t.get("effect") not in ("NoSchedule", "NoExecute", "None"):
            raise ValidationError(f"{tf}.effect", t.get("effect"),
                                  "must be NoSchedule, NoExecute or None")


def _validate_policy(f: str, total: int, policy: Mapping[str, Any]) -> None:
    if "validValues" in policy and "validRange" in policy:
        raise ValidationError(f, policy, 'exactly one of "validValues" and "validRange"')
    rng = policy.get("validRange")
    if rng is None:
        return
    if policy.get("default") is None:
        raise ValidationError(f"{f}.default", None, "required when validRange is defined")
    default = quantity_value(f"{f}.default", policy["default"])
    if rng.get("min") is None:
        raise ValidationError(f"{f}.validRange.min", None, "required when validRange is defined")
    lo = quantity_value(f"{f}.validRange.min", rng["min"])
    if lo > total:
        raise ValidationError(f"{f}.validRange.min", rng["min"],
                              f"min is larger than capacity value {total}")
    if default < lo:
        raise ValidationError(f"{f}.default", policy["default"], f"default is less than min {lo}")
    hi = None
    if rng.get("max") is not None:
        hi = quantity_value(f"{f}.validRange.max", rng["max"])
        if lo > hi:
            raise ValidationError(f"{f}.validRange.max", rng["max"], "min is larger than max")
        if hi > total:
            raise ValidationError(f"{f}.validRange.max", rng["max"],
                                  f"max is larger than capacity value {total}")
        if default > hi:
            raise ValidationError(f"{f}.default", policy["default"], "default is more than max")
    if rng.get("step") is not None:
        step = quantity_value(f"{f}.validRange.step", rng["step"])
        if step <= 0:
            raise ValidationError(f"{f}.validRange.step", rng["step"], "must be greater than zero")
        if lo + step > total:
            raise ValidationError(f"{f}.validRange.step", rng["step"],
                                  f"one step from min is larger than capacity value {total}")
        for what, v in (("default", default), ("max", hi)):
            if v is not None and (v - lo) % step:
                raise ValidationError(f"{f}.validRange.step", rng["step"],
                                      f"{what} {v} is not min {lo} plus a multiple of the step")


# ------------------------------------------------------------------ comparing


def _canonical(spec: Mapping[str, Any]) -> Any:
    """A spec without what the API server adds or rewrites (taints' ``timeAdded``; quantity
    spellings) and without the pool generation, for "does the stored slice say this?"."""
    def walk(x: Any, key: str = "") -> Any:
        if isinstance(x, Mapping):
            return {k: walk(v, k) for k, v in x.items() if k != "timeAdded"}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if key in ("value", "default", "min", "max", "step") and isinstance(x, str | int):
            try:
                return quantity_value(key, x)
            except ValidationError:
                return x
        return x

    out = walk(dict(spec))
    pool = dict(out.get("pool") or {})
    pool.pop("generation", None)
    out["pool"] = pool
    return out


def same_content(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two slice specs say the same, generation aside."""
    return bool(_canonical(a) == _canonical(b))
