"""The few Kubernetes API calls the extender makes, on lightkube's async HTTP client.

lightkube loads the configuration (``--kubeconfig``, ``$KUBECONFIG``, ``~/.kube/config`` or
the in-cluster service account, in that order) and gives a configured async HTTP client;
requests are plain JSON so that objects stay dicts (what the core reads), the binding can be
a raw POST (the API server answers it with a ``Status``), and watches can be resumed exactly
(``410 Gone`` → relist).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx2 as httpx
from lightkube.config.client_adapter import AsyncClient as _adapter
from lightkube.config.client_adapter import ConnectionParams

PODS = "/api/v1/pods"
NODES = "/api/v1/nodes"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"  # DRA mode
CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"


class ApiError(Exception):
    def __init__(self, status: int, reason: str = "", message: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{status} {reason}: {message}".strip())


class Gone(ApiError):
    """The watch's resourceVersion is too old (410): relist."""


def _error(resp: httpx.Response) -> ApiError:
    reason, message = resp.reason_phrase, resp.text[:500]
    try:
        body = resp.json()
        if isinstance(body, dict):
            reason = str(body.get("reason") or reason)
            message = str(body.get("message") or message)
    except ValueError:
        pass
    cls = Gone if resp.status_code == 410 else ApiError
    return cls(resp.status_code, reason, message)


class KubeApi:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    @classmethod
    def from_config(cls, kubeconfig: str | None = None) -> KubeApi:
        """From ``kubeconfig``, else ``$KUBECONFIG``, else ``~/.kube/config``, else
        in-cluster (:data:`sharegpu.kubeio.kubeconfig.ORDER`)."""
        import ssl

        from ..core.errors import ValidationError
        from ..kubeio import kubeconfig as kc

        cfg = kc.load(kubeconfig, field="--kubeconfig" if kubeconfig else "kubeconfig")
        single = cfg.get()
        if single is None:
            raise ValidationError("kubeconfig", kubeconfig or "", "names no context to use")
        timeout = httpx.Timeout(10.0, read=None)
        try:
            return cls(_adapter(single, ConnectionParams(timeout=timeout)))
        except (OSError, ssl.SSLError, ValueError) as e:
            raise ValidationError("kubeconfig", kubeconfig or "",
                                  f"credentials do not load: {e}") from None

    @classmethod
    def from_url(cls, url: str) -> KubeApi:
        """A plain-HTTP API server (tests, ``kubectl proxy``)."""
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        return cls(httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(10.0, read=None),
                                     limits=limits, trust_env=False))

    async def close(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json",
                      params: Mapping[str, str] | None = None) -> Any:
        content = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if content is not None else {}
        resp = await self.http.request(method, path, content=content, headers=headers,
                                       params=params)
        if resp.status_code >= 400:
            raise _error(resp)
        return resp.json() if resp.content else None

    async def get(self, path: str) -> Any:
        return await self.request("GET", path)

    async def list(self, path: str, limit: int = 500) -> tuple[list[dict[str, Any]], str]:
        """Every item (paginated) and the list's resourceVersion."""
        items: list[dict[str, Any]] = []
        cont = ""
        while True:
            params = {"limit": str(limit)}
            if cont:
                params["continue"] = cont
            body = await self.request("GET", path, params=params)
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            cont = meta.get("continue") or ""
            if not cont:
                return items, str(meta.get("resourceVersion") or "")

    async def watch(self, path: str, resource_version: str,
                    timeout_s: int = 300) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) events from ``resource_version`` on. Raises :class:`Gone` on 410."""
        params = {"watch": "1", "resourceVersion": resource_version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        async with self.http.stream("GET", path, params=params) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                raise _error(resp)
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                ev = json.loads(line)
                kind, obj = ev.get("type", ""), ev.get("object") or {}
                if kind == "ERROR":
                    code = int(obj.get("code") or 500)
                    cls = Gone if code == 410 else ApiError
                    raise cls(code, str(obj.get("reason", "")), str(obj.get("message", "")))
                yield kind, obj

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: Mapping[str, str],
                                    resource_version: str,
                                    labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Merge-patch annotations (and ``labels``), refused with 409 unless the pod is still
        at ``resource_version``."""
        body: dict[str, Any] = {"metadata": {"annotations": dict(annotations),
                                             "resourceVersion": resource_version}}
        if labels:
            body["metadata"]["labels"] = dict(labels)
        return await self.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}", body,
                                  content_type="application/merge-patch+json")

    async def bind(self, namespace: str, name: str, uid: str, node: str,
                   annotations: Mapping[str, str] | None = None,
                   resource_version: str = "", timeout_s: float | None = None) -> Any:
        """Create the pod's Binding. kube-apiserver sets ``nodeName`` and merges the Binding's
        ``annotations`` into the pod in one update, refused with 409 unless the pod still has
        ``uid`` and, when given, ``resource_version``. ``timeout_s``: the API server's own
        ``timeout`` for the request (it gives the write up then; whole milliseconds)."""
        meta: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        if resource_version:
            meta["resourceVersion"] = resource_version
        if annotations:
            meta["annotations"] = dict(annotations)
        body = {
            "apiVersion": "v1", "kind": "Binding", "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        params = {"timeout": f"{max(1, int(timeout_s * 1000))}ms"} if timeout_s else None
        return await self.request("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/binding",
                                  body, params=params)

    async def create_event(self, event: Mapping[str, Any]) -> Any:
        ns = (event.get("metadata") or {}).get("namespace") or "default"
        return await self.request("POST", f"/api/v1/namespaces/{ns}/events", event)
