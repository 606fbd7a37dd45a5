"""Reading Pod objects into what a cluster's state holds: a pod's GPU request, its host CPU
and memory, and its placement from its annotations, with the pure steps memoised
(:class:`PlacementReader`). The extender's view reads its cluster with it, and so does
``sharegpu whatif``, so both read a cluster alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import hostresources, names
from .annotations import Allocation, decode
from .errors import ValidationError
from .pods import is_terminated, node_of
from .request import PodRequest, parse_pod

Placed = tuple[PodRequest, str, Allocation]


class PlacementReader:
    """:func:`sharegpu.core.pods.placement_of` with its pure steps memoised: pods made from one
    template (equal labels' GPU count and equal containers, init containers, overhead and
    pod-level resources) share one parsed GPU request and one host CPU and memory request,
    and equal annotation values share a decoded allocation (a rebuild reads 200,000 pods). The
    core functions (:func:`sharegpu.core.request.parse_pod`,
    :func:`sharegpu.core.hostresources.pod_request`) stay the only place of the rules.

    Requests carry the pod's host CPU and memory; a malformed CPU or memory quantity (an API
    server never stores one) counts as none, and ``on_problem`` is told."""

    _ANNS = (names.ANN_ALLOCATION, names.ANN_CORE, names.ANN_MEM_IDX, names.ANN_MEM_POD)

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        # template key -> (GPU request or why it is refused, (CPU millicores, memory MiB))
        self._tmpl: dict[tuple[Any, ...], tuple[PodRequest | ValidationError, tuple[int, int]]]
        self._tmpl = {}
        self._alloc: dict[tuple[Any, ...], Allocation | None] = {}
        self._last: tuple[Any, tuple[PodRequest | ValidationError, tuple[int, int]]] | None
        self._last = None
        self.on_problem: Callable[[str, str], None] | None = None

    @staticmethod
    def _template_key(obj: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """Equal for pods whose GPU and host requests are equal; ``None`` for a pod that
        cannot be keyed (then it is parsed, and refused where it breaks a rule)."""
        try:
            spec = obj["spec"]
            labels = obj["metadata"].get("labels") or {}
            anns = obj["metadata"].get("annotations") or {}
            # a translated DRA pod's gpu-count label is a note (request._translated)
            parts: list[Any] = [labels.get(names.POD_LABEL_GPU_COUNT),
                                names.ANN_DRA_CLAIMS in anns]
            for c in spec["containers"]:
                res = c.get("resources") or {}
                lim, req = res.get("limits") or {}, res.get("requests") or {}
                "".join((*lim.values(), *req.values()))  # str only: 1 == 1.0 == True
                parts.append((c.get("name"), tuple(lim.items()), tuple(req.items())))
            inits = spec.get("initContainers")
            if inits:
                parts.append(hostresources.pod_request_key(obj))
                for c in inits:  # their GPU resources are refused: key them as well
                    res = c.get("resources") or {}
                    "".join((res.get("limits") or {}).values())
                    "".join((res.get("requests") or {}).values())
            elif spec.get("overhead") or spec.get("resources"):
                parts.append(hostresources.pod_request_key(obj))
            key = tuple(parts)
            hash(key)
            return key
        except (AttributeError, KeyError, TypeError, ValueError):
            return None

    def _template(
        self, obj: Mapping[str, Any]
    ) -> tuple[PodRequest | ValidationError, tuple[int, int]]:
        last = self._last
        if last is not None and last[0] is obj:
            return last[1]
        key = self._template_key(obj)
        hit = self._tmpl.get(key) if key is not None else None
        if hit is None:
            base: PodRequest | ValidationError
            try:
                base = parse_pod(obj)
            except ValidationError as e:
                base = e
            try:
                host = hostresources.pod_request(obj)
            except ValidationError as e:
                if self.on_problem is not None:
                    self.on_problem(pod_key(obj), f"CPU/memory request not counted: {e}")
                host = (0, 0)
            hit = (base, host)
            if key is not None:
                if len(self._tmpl) >= self.size:
                    self._tmpl.clear()
                self._tmpl[key] = hit
        self._last = (obj, hit)
        return hit

    def host(self, obj: Mapping[str, Any]) -> tuple[int, int]:
        """(CPU millicores, memory MiB) the pod uses where it is bound."""
        return self._template(obj)[1]

    def wants_gpu(self, obj: Mapping[str, Any]) -> bool:
        """Whether the pod asks for GPU resources (ValidationError when its request is
        refused)."""
        base = self._template(obj)[0]
        if isinstance(base, ValidationError):
            raise base
        return base.wants_gpu

    def request(self, obj: Mapping[str, Any]) -> PodRequest:
        spec = obj.get("spec") or {}
        meta = obj.get("metadata") or {}
        if not isinstance(spec, Mapping) or not isinstance(meta, Mapping):
            return parse_pod(obj)  # refuses it, naming the field
        labels = meta.get("labels") or {}
        ns, name, uid = meta.get("namespace") or "default", meta.get("name") or "", meta.get(
            "uid") or ""
        if (not isinstance(labels, Mapping) or type(ns) is not str or type(name) is not str
                or type(uid) is not str):
            return parse_pod(obj)  # refuses it, naming the field
        base, (cpu, mem) = self._template(obj)
        if isinstance(base, ValidationError):
            raise base
        return PodRequest(ns, name, base.kind, base.containers, uid, cpu, mem,
                          labels=dict(labels))

    def unannotated(self, obj: Mapping[str, Any]) -> tuple[PodRequest, str] | None:
        """Same answer as :func:`sharegpu.core.pods.unannotated_gpu_pod` (with the host request)."""
        node = hostresources.charges_node(obj)
        anns = (obj.get("metadata") or {}).get("annotations") or {}
        if not node or self.allocation(anns) is not None:
            return None
        if not self.wants_gpu(obj):
            return None
        return self.request(obj), node

    def allocation(self, annotations: Mapping[str, str]) -> Allocation | None:
        get = annotations.get
        a, b, c, d = self._ANNS
        key = (get(a), get(b), get(c), get(d))
        try:
            return self._alloc[key]
        except KeyError:
            pass
        alloc = decode(annotations)
        if len(self._alloc) >= self.size:
            self._alloc.clear()
        self._alloc[key] = alloc
        return alloc

    def placement(self, obj: Mapping[str, Any]) -> Placed | None:
        """Same answer as ``placement_of(obj)``."""
        if is_terminated(obj):
            return None
        alloc = self.allocation((obj.get("metadata") or {}).get("annotations") or {})
        if alloc is None:
            return None
        node = node_of(obj)
        if not node:
            return None
        return self.request(obj), node, alloc


def pod_key(obj: Mapping[str, Any]) -> str:
    """``namespace/name`` of a Pod object (the state's key)."""
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"

