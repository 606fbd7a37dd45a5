"""Host CPU and memory: what a pod asks for as kube-scheduler counts it, what a node offers.

kube-scheduler's NodeResourcesFit counts a pod (``k8s.io/component-helpers/resource``,
``PodRequests``), for CPU and for memory each:

    max(sum over app containers and restartable init containers (sidecars),
        max over init containers of (its request + the sidecars started before it))
    + spec.overhead

where a container's request defaults to its limit when only the limit is set (the API server
does that defaulting; objects that did not pass through it are read the same way), and pod-level
``spec.resources.requests``, when set for a resource, replace the containers' sum. A node offers
``status.allocatable``. Only pods bound to a node (``spec.nodeName``) and not finished (phase
``Succeeded`` or ``Failed``) use a node's resources; :func:`charges_node` says which.

Units are the core's (:class:`sharegpu.core.state.NodeSpec`,
:class:`sharegpu.core.request.PodRequest`):
CPU in millicores, memory in MiB. A pod's request is rounded up (kube-scheduler's
``MilliValue`` rounds CPU up too), a node's allocatable down, so neither rounding can make a
pod look as if it fits where kube-scheduler says it does not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from . import quantity
from .errors import ValidationError
from .pods import is_terminated, node_of

CPU = "cpu"
MEMORY = "memory"
MIB = 1 << 20


def _amounts(res: Any, path: str) -> tuple[Fraction, Fraction]:
    """(CPU cores, memory bytes) a ``resources`` block asks for (requests, else limits)."""
    if res is None:
        return Fraction(0), Fraction(0)
    if not isinstance(res, Mapping):
        raise ValidationError(path, type(res).__name__, "must be a JSON object")
    req = res.get("requests") or {}
    lim = res.get("limits") or {}
    if not isinstance(req, Mapping) or not isinstance(lim, Mapping):
        raise ValidationError(path, type(res).__name__, "limits and requests must be maps")
    out = []
    for r in (CPU, MEMORY):
        if r in req or r in lim:
            where, raw = (("requests", req[r]) if r in req else ("limits", lim[r]))
            field = f'{path}.{where}["{r}"]'
            v = quantity.parse(field, raw)
            if v < 0:
                raise ValidationError(field, raw, "must not be negative")
        else:
            v = Fraction(0)
        out.append(v)
    return out[0], out[1]


def _containers(spec: Mapping[str, Any], field: str) -> list[Mapping[str, Any]]:
    cs = spec.get(field) or []
    if not isinstance(cs, list):
        raise ValidationError(f"spec.{field}", type(cs).__name__, "must be a list")
    for i, c in enumerate(cs):
        if not isinstance(c, Mapping):
            raise ValidationError(f"spec.{field}[{i}]", type(c).__name__, "must be a JSON object")
    return cs


def pod_request(pod: Mapping[str, Any]) -> tuple[int, int]:
    """(CPU millicores, memory MiB) the pod asks for, as kube-scheduler counts it. Raises
    :class:`ValidationError` naming the field of a malformed quantity."""
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise ValidationError("spec", type(spec).__name__, "must be a JSON object")
    cpu, mem = Fraction(0), Fraction(0)
    for i, c in enumerate(_containers(spec, "containers")):
        a, b = _amounts(c.get("resources"), f"spec.containers[{i}].resources")
        cpu, mem = cpu + a, mem + b
    side_cpu, side_mem = Fraction(0), Fraction(0)  # restartable init containers so far
    init_cpu, init_mem = Fraction(0), Fraction(0)
    for i, c in enumerate(_containers(spec, "initContainers")):
        a, b = _amounts(c.get("resources"), f"spec.initContainers[{i}].resources")
        if c.get("restartPolicy") == "Always":  # a sidecar: runs beside the app containers
            cpu, mem = cpu + a, mem + b
            side_cpu, side_mem = side_cpu + a, side_mem + b
            a, b = side_cpu, side_mem
        else:
            a, b = a + side_cpu, b + side_mem
        init_cpu, init_mem = max(init_cpu, a), max(init_mem, b)
    cpu, mem = max(cpu, init_cpu), max(mem, init_mem)
    level = spec.get("resources")
    if isinstance(level, Mapping) and isinstance(level.get("requests"), Mapping):
        reqs = level["requests"]
        if CPU in reqs:
            cpu = quantity.parse(f'spec.resources.requests["{CPU}"]', reqs[CPU])
        if MEMORY in reqs:
            mem = quantity.parse(f'spec.resources.requests["{MEMORY}"]', reqs[MEMORY])
    overhead = spec.get("overhead")
    if overhead is not None:
        if not isinstance(overhead, Mapping):
            raise ValidationError("spec.overhead", type(overhead).__name__,
                                  "must be a JSON object")
        if CPU in overhead:
            cpu += quantity.parse(f'spec.overhead["{CPU}"]', overhead[CPU])
        if MEMORY in overhead:
            mem += quantity.parse(f'spec.overhead["{MEMORY}"]', overhead[MEMORY])
    return max(math.ceil(cpu * 1000), 0), max(math.ceil(mem / MIB), 0)


def pod_request_key(pod: Mapping[str, Any]) -> tuple[Any, ...]:
    """A hashable key that is equal for pods :func:`pod_request` counts alike (made from one
    template); raises TypeError or AttributeError on a spec it cannot key (then parse it)."""
    spec = pod["spec"]
    parts: list[Any] = []
    for field in ("containers", "initContainers"):
        for c in spec.get(field) or ():
            res = c.get("resources") or {}
            parts.append((c.get("restartPolicy"), tuple((res.get("requests") or {}).items()),
                          tuple((res.get("limits") or {}).items())))
        parts.append(field)
    for field in ("overhead", "resources"):
        v = spec.get(field)
        if v:
            parts.append((field, tuple((k, tuple(x.items()) if isinstance(x, Mapping) else x)
                                       for k, x in v.items())))
    key = tuple(parts)
    hash(key)
    return key


def charges_node(pod: Mapping[str, Any]) -> str:
    """The node whose CPU and memory the pod uses: its ``nodeName`` unless it finished; ""
    when it uses none (not bound, or finished)."""
    if is_terminated(pod):
        return ""
    return node_of(pod)


def node_allocatable(node: Mapping[str, Any]) -> tuple[int | None, int | None, list[str]]:
    """(CPU millicores, memory MiB) of ``status.allocatable``, each ``None`` (unknown: the
    core then never refuses a pod for it) when absent or malformed; the problems found, one
    sentence each."""
    status = node.get("status") or {}
    alloc = status.get("allocatable") if isinstance(status, Mapping) else None
    if not isinstance(alloc, Mapping):
        return None, None, []
    out: list[int | None] = []
    problems: list[str] = []
    for r, scale in ((CPU, Fraction(1000)), (MEMORY, Fraction(1, MIB))):
        if r not in alloc:
            out.append(None)
            continue
        try:
            v = quantity.parse(f'status.allocatable["{r}"]', alloc[r])
        except ValidationError as e:
            problems.append(f"{e}; its {r} is taken as unknown")
            out.append(None)
            continue
        if v < 0:
            problems.append(f'status.allocatable["{r}"]={alloc[r]!r}: must not be negative; '
                            f"its {r} is taken as unknown")
            out.append(None)
            continue
        out.append(math.floor(v * scale))
    return out[0], out[1], problems


__all__ = ["charges_node", "node_allocatable", "pod_request", "pod_request_key"]
