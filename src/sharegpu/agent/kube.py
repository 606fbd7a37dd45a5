"""The Kubernetes API calls the node agent makes, behind a small interface.

:class:`KubeApi` is what the agent needs (its node, the pods bound to it, three patches);
:class:`MemoryKube` is an in-memory implementation for tests and ``--nvml fake`` development
without a cluster; :mod:`sharegpu.agent.lightkube_api` is the production one.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

Obj = dict[str, Any]
EVENT_COMPONENT = "sharegpu-agent"


class KubeApi(Protocol):
    async def get_node(self, name: str) -> Obj: ...

    def watch_node(self, name: str) -> AsyncIterator[Obj]:
        """Yields the node object each time it changes (the first value is the current one)."""
        ...

    async def patch_node_metadata(
        self,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> None:
        """Merge-patch labels and annotations (a ``None`` value removes the key)."""
        ...

    async def list_node_pods(self, node: str) -> list[Obj]:
        """Every pod bound to ``node`` (``spec.nodeName``)."""
        ...

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str], *, uid: str = ""
    ) -> None:
        """Merge-patch the pod's annotations; with ``uid``, only the pod of that UID (the patch
        carries ``metadata.uid``: the API server refuses it for a same-name pod recreated
        since, raising :class:`PodGone` here)."""
        ...

    async def patch_node_condition(self, name: str, condition: Mapping[str, str]) -> None:
        """Set one condition (by ``type``) in the node's status; the others are kept."""
        ...

    async def create_event(
        self, *, namespace: str, pod: str, uid: str, reason: str, message: str, node: str
    ) -> None:
        """A Warning Event on the pod, from the agent of ``node``."""
        ...

    async def create_node_event(self, node: str, *, reason: str, message: str) -> None:
        """A Warning Event on the node (namespace ``default``, as the kubelet posts them)."""
        ...

    async def get_resource_claim(self, namespace: str, name: str) -> Obj:
        """A ``resource.k8s.io/v1`` ResourceClaim, as the API server returns it (DRA mode's
        kubelet plugin reads its allocation)."""
        ...


class PodGone(LookupError):
    """The pod named is gone, or is another pod of the same name now (a UID precondition)."""


def _merge(target: dict[str, str], patch: Mapping[str, str | None] | None) -> None:
    for k, v in (patch or {}).items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v


class MemoryKube:
    """Nodes and pods held in memory, with the same semantics as the API server's merge patch."""

    def __init__(self) -> None:
        self.nodes: dict[str, Obj] = {}
        self.pods: dict[tuple[str, str], Obj] = {}
        self._watchers: dict[str, list[asyncio.Queue[Obj]]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.events: list[Obj] = []
        self.latency_s = 0.0  # added to every pod list, to stand in for an API round trip
        self.lists = 0
        self.claims: dict[tuple[str, str], Obj] = {}  # resource.k8s.io/v1 ResourceClaims
        self.claim_latency_s = 0.0  # added to every claim read
        self.claim_reads = 0

    # --- test controls ---
    def add_node(self, name: str, labels: Mapping[str, str] | None = None) -> Obj:
        node = {"metadata": {"name": name, "labels": dict(labels or {}), "annotations": {}},
                "status": {}}
        self.nodes[name] = node
        return node

    def set_node_labels(self, name: str, labels: Mapping[str, str | None]) -> None:
        _merge(self.nodes[name]["metadata"].setdefault("labels", {}), labels)
        self._notify(name)

    def add_pod(self, pod: Obj) -> None:
        meta = pod["metadata"]
        self.pods[(meta.get("namespace", "default"), meta["name"])] = pod

    def add_claim(self, claim: Obj) -> None:
        meta = claim["metadata"]
        self.claims[(meta.get("namespace", "default"), meta["name"])] = claim

    def _notify(self, name: str) -> None:
        for q in self._watchers.get(name, []):
            q.put_nowait(copy.deepcopy(self.nodes[name]))

    # --- KubeApi ---
    async def get_node(self, name: str) -> Obj:
        return copy.deepcopy(self.nodes[name])

    async def watch_node(self, name: str) -> AsyncIterator[Obj]:
        q: asyncio.Queue[Obj] = asyncio.Queue()
        self._watchers.setdefault(name, []).append(q)
        try:
            yield copy.deepcopy(self.nodes[name])
            while True:
                yield await q.get()
        finally:
            self._watchers[name].remove(q)

    async def patch_node_metadata(self, name, *, labels=None, annotations=None) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("patch_node", (name, labels, annotations)))
        meta = self.nodes[name]["metadata"]
        _merge(meta.setdefault("labels", {}), labels)
        _merge(meta.setdefault("annotations", {}), annotations)
        if labels:
            self._notify(name)

    async def list_node_pods(self, node: str) -> list[Obj]:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        self.lists += 1
        return json.loads(json.dumps([
            p for p in self.pods.values() if (p.get("spec") or {}).get("nodeName") == node
        ]))

    async def patch_pod_annotations(self, namespace, name, annotations, *, uid="") -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("patch_pod", (namespace, name, dict(annotations))))
        pod = self.pods.get((namespace, name))
        if pod is None or (uid and (pod["metadata"].get("uid") or "") != uid):
            raise PodGone(f"pod {namespace}/{name} (uid {uid or 'any'}) not found")
        _merge(pod["metadata"].setdefault("annotations", {}), annotations)

    async def patch_node_condition(self, name, condition) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("patch_node_condition", (name, dict(condition))))
        conds = self.nodes[name].setdefault("status", {}).setdefault("conditions", [])
        conds[:] = [c for c in conds if c.get("type") != condition["type"]] + [dict(condition)]

    async def create_event(self, *, namespace, pod, uid, reason, message, node) -> None:  # type: ignore[no-untyped-def]
        from ..kubeio.kevents import pod_event

        self.events.append(pod_event(namespace=namespace, name=pod, uid=uid, reason=reason,
                                     message=message, component=EVENT_COMPONENT, host=node))

    async def create_node_event(self, node, *, reason, message) -> None:  # type: ignore[no-untyped-def]
        from ..kubeio.kevents import node_event

        self.events.append(node_event(node, reason=reason, message=message,
                                      component=EVENT_COMPONENT))

    async def get_resource_claim(self, namespace: str, name: str) -> Obj:
        if self.claim_latency_s:
            await asyncio.sleep(self.claim_latency_s)
        self.claim_reads += 1
        try:
            return copy.deepcopy(self.claims[(namespace, name)])
        except KeyError:
            raise LookupError(f'resourceclaims.resource.k8s.io "{name}" not found in '
                              f"namespace {namespace}") from None
