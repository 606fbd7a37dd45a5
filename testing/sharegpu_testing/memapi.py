"""The calls the binder makes (read a pod, patch its annotations with a resourceVersion
precondition, create its binding, post an Event), answered from a dict in memory.

For unit tests of the binder and for the latency benchmark, which measure the extender alone;
end-to-end tests run against the fake API server (``sharegpu_testing.fakeapi``) instead.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

from sharegpu.extender.kube import ApiError, KubeApi


class MemoryApi(KubeApi):
    def __init__(self, pods: Iterable[Mapping[str, Any]] = ()) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.bindings: list[tuple[str, str]] = []
        self._rv = 0
        self.objects: dict[str, dict[str, Any]] = {}  # other objects (Leases) by path
        self.fail_writes = 0  # the next this many writes fail with 500 (fault injection)
        for p in pods:
            self.add_pod(p)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def add_pod(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        p = copy.deepcopy(dict(pod))
        meta = p.setdefault("metadata", {})
        meta["resourceVersion"] = self._next_rv()
        self.pods[f"{meta.get('namespace') or 'default'}/{meta['name']}"] = p
        return p

    def _pod(self, namespace: str, name: str) -> dict[str, Any]:
        p = self.pods.get(f"{namespace}/{name}")
        if p is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found')
        return p

    async def close(self) -> None:
        pass

    def _fault(self) -> None:
        if self.fail_writes > 0:
            self.fail_writes -= 1
            raise ApiError(500, "InternalError", "injected failure")

    async def get(self, path: str) -> Any:
        parts = path.strip("/").split("/")
        if len(parts) == 6 and parts[4] == "pods":
            return _fresh(self._pod(parts[3], parts[5]))
        if path in self.objects:
            return copy.deepcopy(self.objects[path])
        raise ApiError(404, "NotFound", path)

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json",
                      params: Mapping[str, str] | None = None) -> Any:
        """Create (POST to the collection) and replace (PUT, resourceVersion checked) of other
        objects, enough for Leases."""
        if method == "GET":
            return await self.get(path)
        self._fault()
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if method == "POST":
            path = f"{path}/{meta['name']}"
            if path in self.objects:
                raise ApiError(409, "AlreadyExists", path)
        elif method == "PUT":
            cur = self.objects.get(path)
            if cur is None:
                raise ApiError(404, "NotFound", path)
            if meta.get("resourceVersion") != cur["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", "the object has been modified")
        else:
            raise ApiError(405, "MethodNotAllowed", method)
        meta["resourceVersion"] = self._next_rv()
        self.objects[path] = obj
        return copy.deepcopy(obj)

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: Mapping[str, str],
                                    resource_version: str,
                                    labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        p = self._pod(namespace, name)
        self._fault()
        meta = p["metadata"]
        if resource_version and resource_version != meta["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        meta.setdefault("annotations", {}).update(annotations)
        if labels:
            meta.setdefault("labels", {}).update(labels)
        meta["resourceVersion"] = self._next_rv()
        return _fresh(p)

    async def bind(self, namespace: str, name: str, uid: str, node: str,
                   annotations: Mapping[str, str] | None = None,
                   resource_version: str = "", timeout_s: float | None = None) -> Any:
        """As kube-apiserver's Binding: uid and resourceVersion preconditions, then
        ``nodeName`` and the annotations in one update."""
        p = self._pod(namespace, name)
        self._fault()
        meta = p["metadata"]
        if uid and meta.get("uid") and uid != meta["uid"]:
            raise ApiError(409, "Conflict", "uid precondition failed")
        if resource_version and resource_version != meta["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        if p["spec"].get("nodeName"):
            raise ApiError(409, "Conflict", f"pod {name} is already assigned to a node")
        if annotations:
            meta.setdefault("annotations", {}).update(annotations)
        p["spec"]["nodeName"] = node
        p["metadata"]["resourceVersion"] = self._next_rv()
        self.bindings.append((f"{namespace}/{name}", node))
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    async def create_event(self, event: Mapping[str, Any]) -> Any:
        self.events.append(dict(event))
        return dict(event)


def _fresh(obj: Any) -> Any:
    """A copy the caller owns, made as a client makes one from the API server's answer."""
    return json.loads(json.dumps(obj))
