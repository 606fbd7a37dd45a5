"""A fake Kubernetes API server for tests: a real HTTP/1.1 server on 127.0.0.1 (aiohttp).

It serves core/v1 pods (with ``pods/binding`` and ``pods/status``), nodes (with
``nodes/status``), namespaces, events and configmaps, coordination.k8s.io/v1 leases and
events.k8s.io/v1 events, plus the discovery documents (``/api``, ``/apis``, ``/version``).
Storage semantics (resourceVersion, conflicts, finalizers, history) live in
:mod:`sharegpu.testing.store`; patch formats in :mod:`sharegpu.testing.patches`; selectors in
:mod:`sharegpu.testing.selectors`; fault injection in :mod:`sharegpu.testing.faults`.

It is not a kube-apiserver: no authentication or authorization (any bearer token works), no
admission, no OpenAPI schema validation beyond the few rules listed in ``store``, no
server-side apply field ownership (an apply patch merges like a strategic merge patch and
creates missing objects). As upstream, core/v1 and events.k8s.io/v1 events share one storage,
each API converting to its own form.

Use it from sync tests (``with FakeApiServer() as api:`` runs it in a background thread with
its own event loop) or from async tests (``async with FakeApiServer() as api:`` runs it in the
running loop). ``api.kubeconfig_path`` is a kubeconfig for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from . import resources as res
from . import status as st
from .faults import Faults
from .patches import PatchError, json_patch, merge_patch, strategic_merge_patch
from .resources import ResourceType
from .selectors import SelectorError, parse_field_selector, parse_label_selector
from .store import CLOSE, INITIAL_EVENTS_END, Obj, Store, Watcher

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = (MERGE_PATCH, STRATEGIC_PATCH, JSON_PATCH, APPLY_PATCH)
BOOKMARK = "__BOOKMARK__"

SERVER_VERSION = {
    "major": "1",
    "minor": "31",
    "gitVersion": "v1.31.0-sharegpu-fake",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "none",
    "compiler": "none",
    "platform": "linux/amd64",
}


@dataclass(frozen=True)
class RequestRecord:
    """One request the server answered (``server.requests``), for assertions in tests."""

    method: str
    path: str
    query: dict[str, str]
    verb: str  # API verb (get, list, watch, create, update, patch, delete, ...) or "discovery"
    resource: str  # "pods", "pods/binding", "leases", ... ("" for discovery)
    namespace: str | None
    name: str | None
    status: int
    body: Any


@dataclass
class _Call:
    verb: str
    rtype: ResourceType
    namespace: str | None
    name: str | None
    sub: str | None

    @property
    def resource(self) -> str:
        return f"{self.rtype.plural}/{self.sub}" if self.sub else self.rtype.plural


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    # Exactly "application/json" (no charset), as the real server answers; some clients
    # compare the header verbatim.
    resp = web.Response(body=_dumps(obj), status=status, headers=headers)
    resp.content_type = JSON
    return resp


def _error_response(err: st.StatusError) -> web.Response:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after else None
    return _json_response(err.body(), err.code, headers)


def _truthy(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.lower() in ("1", "true", "yes")


class FakeApiServer:
    """A fake kube-apiserver on 127.0.0.1. See the module docstring for what it covers.

    Parameters: ``port`` (0: any free port), ``history_size`` (changes kept for watch resume;
    older resourceVersions get 410), ``seed`` (uids, generated names, fault draws),
    ``bookmark_interval`` (seconds between BOOKMARK events on watches that allow them),
    ``watch_timeout`` (server-side cap on a watch in seconds, None: none unless the client sets
    ``timeoutSeconds``), ``graceful_pod_deletion`` (DELETE of a bound pod only marks it, like
    a real cluster waiting for the kubelet), ``strict_namespaces`` (namespaced writes need an
    existing Namespace; default, kube-system, kube-public and kube-node-lease exist).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        history_size: int = 1000,
        seed: int = 0,
        bookmark_interval: float = 1.0,
        watch_timeout: float | None = None,
        graceful_pod_deletion: bool = False,
        strict_namespaces: bool = False,
        max_request_log: int = 10000,
    ) -> None:
        self.host = host
        self.port = port
        self.store = Store(
            history_size=history_size,
            seed=seed,
            graceful_pod_deletion=graceful_pod_deletion,
            strict_namespaces=strict_namespaces,
        )
        self.faults = Faults(self.store, seed)
        self.bookmark_interval = bookmark_interval
        self.watch_timeout = watch_timeout
        self.requests: deque[RequestRecord] = deque(maxlen=max_request_log)
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tmpdir: Path | None = None
        self.kubeconfig_path: Path | None = None

    # ================================================================== lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start_async(self) -> FakeApiServer:
        """Start serving in the running event loop."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._loop = asyncio.get_running_loop()
        self._write_kubeconfig()
        return self

    async def stop_async(self) -> None:
        self.store.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def start(self) -> FakeApiServer:
        """Start serving from a background thread with its own event loop."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as e:  # report to the starting thread
                failure.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-kube-apiserver", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        loop = self._loop
        fut = asyncio.run_coroutine_threadsafe(self.stop_async(), loop)
        with contextlib.suppress(Exception):
            fut.result(15)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(15)
        self._thread = None

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> FakeApiServer:
        return await self.start_async()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_async()

    def _write_kubeconfig(self) -> None:
        if self._tmpdir is None:
            self._tmpdir = Path(tempfile.mkdtemp(prefix="fake-kube-"))
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": "default"},
                }
            ],
            "current-context": "fake",
        }
        self.kubeconfig_path = self._tmpdir / "kubeconfig"
        self.kubeconfig_path.write_text(yaml.safe_dump(cfg))

    # ================================================================== state helpers

    @staticmethod
    def _rtype(resource: str | ResourceType, api_version: str | None = None) -> ResourceType:
        if isinstance(resource, ResourceType):
            return resource
        return res.resolve(resource, api_version)

    def _rtype_of(self, obj: Obj) -> ResourceType:
        kind = obj.get("kind")
        if not kind:
            raise ValueError("the object needs a 'kind' (and 'apiVersion' outside core/v1)")
        return res.resolve(kind, obj.get("apiVersion") or None)

    def create(self, obj: Obj) -> Obj:
        """Store a new object as given (no API defaulting: a pod may be created Running on a
        node); raises StatusError 409 if it exists. Watches see ADDED. Returns the stored copy."""
        rtype = self._rtype_of(obj)
        m = obj.get("metadata") or {}
        ns = (m.get("namespace") or "default") if rtype.namespaced else None
        if self.store.find(rtype, ns, m.get("name", "")) is not None:
            raise st.already_exists(rtype.plural, m.get("name", ""), rtype.group)
        return self.store.seed(rtype, obj)

    def put(self, obj: Obj) -> Obj:
        """Create or replace an object as given (watches see ADDED or MODIFIED)."""
        return self.store.seed(self._rtype_of(obj), obj)

    def get(
        self, resource: str | ResourceType, name: str, namespace: str | None = None
    ) -> Obj | None:
        """The stored object (a copy) or None. ``namespace`` defaults to "default"."""
        rtype = self._rtype(resource)
        return self.store.find(rtype, (namespace or "default") if rtype.namespaced else None, name)

    def objects(self, resource: str | ResourceType, namespace: str | None = None) -> list[Obj]:
        """Copies of the stored objects of a resource (all namespaces unless one is given),
        sorted by namespace and name. ``resource``: ``pods``, ``Node``, ``leases``,
        ``events`` (core/v1), ``events.events.k8s.io``..."""
        return self.store.all(self._rtype(resource), namespace)

    def patch(
        self, resource: str | ResourceType, name: str, patch: Obj, namespace: str | None = None
    ) -> Obj:
        """Merge-patch a stored object directly (no API rules: spec.nodeName and status may
        change); watches see MODIFIED."""
        rtype = self._rtype(resource)
        ns = (namespace or "default") if rtype.namespaced else None
        cur = self.store.find(rtype, ns, name)
        if cur is None:
            raise st.not_found(rtype.plural, name, rtype.group)
        return self.store.seed(rtype, merge_patch(cur, patch))

    def delete(self, resource: str | ResourceType, name: str, namespace: str | None = None) -> Obj:
        """Delete a stored object at once (no finalizers, no grace); watches see DELETED."""
        rtype = self._rtype(resource)
        return self.store.remove(
            rtype, (namespace or "default") if rtype.namespaced else None, name
        )

    @property
    def resource_version(self) -> str:
        return str(self.store.resource_version)

    def wait_for(
        self, predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01
    ) -> Any:
        """Poll ``predicate`` until it returns something truthy; raise TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout}s")
            time.sleep(interval)

    def requests_for(
        self, verb: str | None = None, resource: str | None = None
    ) -> list[RequestRecord]:
        return [
            r
            for r in list(self.requests)
            if (verb is None or r.verb == verb) and (resource is None or r.resource == resource)
        ]

    # ================================================================== HTTP

    def _record(
        self, request: web.Request, verb: str, call: _Call | None, status: int, body: Any
    ) -> None:
        self.requests.append(
            RequestRecord(
                request.method,
                request.path,
                dict(request.query),
                verb,
                call.resource if call else "",
                call.namespace if call else None,
                call.name if call else None,
                status,
                body,
            )
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        call: _Call | None = None
        body: Any = None
        try:
            if self.faults.is_down:
                raise st.unavailable()
            segs = [s for s in request.path.split("/") if s]
            disco = self._discovery(segs)
            if disco is not None:
                self._record(request, "discovery", None, disco.status, None)
                return disco
            call = self._route(request.method, segs, request.query)
            decision = self.faults.decide(
                call.verb, call.resource, call.name or "", call.rtype.group
            )
            if decision.latency:
                await asyncio.sleep(decision.latency)
            if decision.error is not None and not decision.after_commit:
                raise decision.error
            if call.verb == "watch":
                self._record(request, "watch", call, 200, None)
                return await self._watch(request, call)
            if request.method in ("POST", "PUT", "PATCH"):
                body = await self._read_body(request, call)
            elif request.method == "DELETE" and request.can_read_body:
                raw = await request.read()
                body = json.loads(raw) if raw.strip() else None
            resp = self._dispatch(request, call, body)
            if decision.error is not None:
                raise decision.error
            self._record(request, call.verb, call, resp.status, body)
            return resp
        except st.StatusError as e:
            self._record(request, call.verb if call else "unknown", call, e.code, body)
            return _error_response(e)
        except SelectorError as e:
            self._record(request, call.verb if call else "unknown", call, 400, body)
            return _error_response(st.bad_request(str(e)))
        except json.JSONDecodeError as e:
            self._record(request, call.verb if call else "unknown", call, 400, body)
            return _error_response(st.bad_request(f"error decoding the request body: {e}"))

    async def _read_body(self, request: web.Request, call: _Call) -> Any:
        raw = await request.read()
        ctype = request.content_type
        if request.method == "PATCH":
            if ctype not in PATCH_TYPES:
                raise st.unsupported_media_type(ctype)
            if ctype == APPLY_PATCH:
                try:
                    return yaml.safe_load(raw)
                except yaml.YAMLError as e:
                    raise st.bad_request(f"error decoding YAML: {e}") from None
        elif ctype not in (JSON, "", "application/octet-stream", "text/plain"):
            if ctype in ("application/yaml", "application/x-yaml"):
                return yaml.safe_load(raw)
            raise st.unsupported_media_type(ctype)
        return json.loads(raw) if raw.strip() else None

    # ------------------------------------------------------------------ discovery

    def _discovery(self, segs: list[str]) -> web.Response | None:
        if not segs:
            paths = ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/readyz", "/version"]
            paths += [f"/apis/{g}" for g in res.group_versions()]
            paths += [f"/apis/{g}/{v}" for g, vs in res.group_versions().items() for v in vs]
            return _json_response({"paths": sorted(paths)})
        if segs[0] in ("healthz", "livez", "readyz") and len(segs) == 1:
            return web.Response(text="ok", content_type="text/plain")
        if segs == ["version"]:
            return _json_response(SERVER_VERSION)
        if segs == ["api"]:
            return _json_response(
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.host}:{self.port}"}
                    ],
                }
            )
        if segs == ["api", "v1"]:
            return _json_response(self._resource_list("", "v1"))
        if segs == ["apis"]:
            return _json_response(
                {
                    "kind": "APIGroupList",
                    "apiVersion": "v1",
                    "groups": [self._group(g, vs) for g, vs in res.group_versions().items()],
                }
            )
        if len(segs) == 2 and segs[0] == "apis":
            vs = res.group_versions().get(segs[1])
            if vs is None:
                raise StatusNotFoundPath()
            return _json_response(
                {"kind": "APIGroup", "apiVersion": "v1", **self._group(segs[1], vs)}
            )
        if len(segs) == 3 and segs[0] == "apis":
            if segs[2] not in res.group_versions().get(segs[1], []):
                raise StatusNotFoundPath()
            return _json_response(self._resource_list(segs[1], segs[2]))
        return None

    @staticmethod
    def _group(group: str, versions: list[str]) -> dict[str, Any]:
        gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}

    @staticmethod
    def _resource_list(group: str, version: str) -> dict[str, Any]:
        out = []
        for r in res.by_group_version(group, version).values():
            entry: dict[str, Any] = {
                "name": r.plural,
                "singularName": r.singular,
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": list(r.verbs),
            }
            if r.short_names:
                entry["shortNames"] = list(r.short_names)
            out.append(entry)
            for sub in r.subresources:
                out.append(
                    {
                        "name": f"{r.plural}/{sub}",
                        "singularName": "",
                        "namespaced": r.namespaced,
                        "kind": "Binding" if sub == "binding" else r.kind,
                        "verbs": ["create"] if sub == "binding" else ["get", "patch", "update"],
                    }
                )
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": out}

    # ------------------------------------------------------------------ routing

    def _route(self, method: str, segs: list[str], query: Any) -> _Call:
        if segs[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", segs[2:]
        elif len(segs) >= 3 and segs[0] == "apis":
            group, version, rest = segs[1], segs[2], segs[3:]
        else:
            raise StatusNotFoundPath()
        table = res.by_group_version(group, version)
        if not table or not rest:
            raise StatusNotFoundPath()
        legacy_watch = rest[0] == "watch"
        if legacy_watch:
            rest = rest[1:]
        ns: str | None = None
        if (
            len(rest) >= 3
            and rest[0] == "namespaces"
            and rest[2] in table
            and table[rest[2]].namespaced
        ):
            ns, rtype, tail = rest[1], table[rest[2]], rest[3:]
        else:
            if not rest or rest[0] not in table:
                raise StatusNotFoundPath()
            rtype, tail = table[rest[0]], rest[1:]
            if rtype.namespaced and tail:
                raise StatusNotFoundPath()
        if len(tail) > 2:
            raise StatusNotFoundPath()
        name = tail[0] if tail else None
        sub = tail[1] if len(tail) == 2 else None
        if sub is not None and sub not in rtype.subresources:
            raise StatusNotFoundPath()
        watch = legacy_watch or _truthy(query.get("watch")) is True
        if method == "GET":
            if name is None:
                verb = "watch" if watch else "list"
            elif legacy_watch:
                verb = "watch"
            else:
                verb = "get"
            if sub == "binding":
                raise st.method_not_allowed()
        elif method == "POST":
            if (name is None and (ns is not None or not rtype.namespaced)) or sub == "binding":
                verb = "create"
            else:
                raise st.method_not_allowed()
        elif method in ("PUT", "PATCH"):
            if name is None or sub == "binding":
                raise st.method_not_allowed()
            verb = "update" if method == "PUT" else "patch"
        elif method == "DELETE":
            if sub is not None:
                raise st.method_not_allowed()
            verb = "delete" if name is not None else "deletecollection"
        else:
            raise st.method_not_allowed()
        if verb not in rtype.verbs:
            raise st.method_not_allowed()
        if not rtype.namespaced:
            ns = None
        return _Call(verb, rtype, ns, name, sub)

    # ------------------------------------------------------------------ verbs

    def _dispatch(self, request: web.Request, call: _Call, body: Any) -> web.Response:
        q = request.query
        store = self.store
        rtype = call.rtype
        dry_run = "All" in q.getall("dryRun", [])
        if call.verb == "get":
            return _json_response(store.get(rtype, call.namespace, call.name or ""))
        if call.verb == "list":
            labels = parse_label_selector(q.get("labelSelector"))
            fields = parse_field_selector(q.get("fieldSelector"), rtype.supported_fields)
            limit = q.get("limit")
            try:
                n = int(limit) if limit else None
            except ValueError:
                raise st.bad_request(f"invalid limit {limit!r}") from None
            return _json_response(
                store.list(
                    rtype,
                    call.namespace,
                    labels,
                    fields,
                    limit=n,
                    continue_token=q.get("continue"),
                    resource_version=q.get("resourceVersion"),
                    resource_version_match=q.get("resourceVersionMatch"),
                )
            )
        if call.verb == "create":
            if rtype is res.BINDING or call.sub == "binding":
                name = call.name or ((body or {}).get("metadata") or {}).get("name") or ""
                if not call.namespace:
                    raise st.method_not_allowed()
                store.bind(call.namespace, name, body, dry_run=dry_run)
                return _json_response(st.status_object(201, success=True), 201)
            if not isinstance(body, dict):
                raise st.bad_request("the request body must be a JSON object")
            return _json_response(store.create(rtype, call.namespace, body, dry_run=dry_run), 201)
        if call.verb == "update":
            if not isinstance(body, dict):
                raise st.bad_request("the request body must be a JSON object")
            body_name = (body.get("metadata") or {}).get("name")
            if body_name != call.name:
                raise st.name_mismatch(body_name or "", call.name or "")
            obj, created = store.update(
                rtype,
                call.namespace,
                call.name or "",
                lambda _cur: body,
                subresource=call.sub,
                dry_run=dry_run,
            )
            return _json_response(obj, 201 if created else 200)
        if call.verb == "patch":
            return self._patch(request, call, body, dry_run)
        if call.verb == "delete":
            opts = body if isinstance(body, dict) else {}
            grace = q.get("gracePeriodSeconds", opts.get("gracePeriodSeconds"))
            obj, gone = store.delete(
                rtype,
                call.namespace,
                call.name or "",
                preconditions=opts.get("preconditions"),
                grace_period=int(grace) if grace is not None else None,
                dry_run=dry_run,
            )
            if not gone:
                return _json_response(obj, 202)
            if rtype.return_deleted_object:
                return _json_response(obj)
            details = {"name": call.name, "kind": rtype.plural, "uid": obj["metadata"].get("uid")}
            if rtype.group:
                details["group"] = rtype.group
            return _json_response(st.status_object(200, success=True, details=details))
        if call.verb == "deletecollection":
            labels = parse_label_selector(q.get("labelSelector"))
            fields = parse_field_selector(q.get("fieldSelector"), rtype.supported_fields)
            items = []
            for ns, name in store.matching(rtype, call.namespace, labels, fields):
                with contextlib.suppress(st.StatusError):
                    obj, _ = store.delete(rtype, ns or None, name, dry_run=dry_run)
                    items.append(obj)
            return _json_response(
                {
                    "kind": f"{rtype.kind}List",
                    "apiVersion": rtype.api_version,
                    "metadata": {"resourceVersion": str(store.resource_version)},
                    "items": items,
                }
            )
        raise st.method_not_allowed()

    def _patch(self, request: web.Request, call: _Call, patch: Any, dry_run: bool) -> web.Response:
        ctype = request.content_type
        if ctype == APPLY_PATCH and not request.query.get("fieldManager"):
            raise st.bad_request(
                "PATCH, application/apply-patch+yaml: fieldManager is required for apply requests"
            )
        if ctype != JSON_PATCH and not isinstance(patch, dict):
            raise st.bad_request("the patch must be a JSON object")

        def mutate(cur: Obj | None) -> Obj:
            try:
                if cur is None:  # apply to a missing object creates it
                    return dict(patch)
                if ctype == MERGE_PATCH:
                    return merge_patch(cur, patch)
                if ctype == JSON_PATCH:
                    return json_patch(cur, patch)
                return strategic_merge_patch(cur, patch)
            except PatchError as e:
                if e.malformed:
                    raise st.bad_request(str(e)) from None
                raise st.unprocessable(str(e)) from None

        if ctype == APPLY_PATCH and call.sub is None and call.rtype.namespaced:
            pm = patch.setdefault("metadata", {})
            pm.setdefault("namespace", call.namespace)
        obj, created = self.store.update(
            call.rtype,
            call.namespace,
            call.name or "",
            mutate,
            subresource=call.sub,
            dry_run=dry_run,
            create_missing=ctype == APPLY_PATCH,
        )
        return _json_response(obj, 201 if created else 200)

    # ------------------------------------------------------------------ watch

    async def _watch(self, request: web.Request, call: _Call) -> web.StreamResponse:
        q = request.query
        rtype = call.rtype
        labels = parse_label_selector(q.get("labelSelector"))
        fields = parse_field_selector(q.get("fieldSelector"), rtype.supported_fields)
        bookmarks = _truthy(q.get("allowWatchBookmarks")) is True
        timeout: float | None = self.watch_timeout
        if q.get("timeoutSeconds"):
            try:
                asked = float(q["timeoutSeconds"])
            except ValueError:
                raise st.bad_request(f"invalid timeoutSeconds {q['timeoutSeconds']!r}") from None
            timeout = asked if timeout is None else min(asked, timeout)
        loop = asyncio.get_running_loop()
        resp = web.StreamResponse(status=200)
        resp.content_type = JSON
        resp.enable_chunked_encoding()
        try:
            watcher, backlog, initial_end = self.store.watch(
                rtype,
                call.namespace if rtype.namespaced else None,
                labels,
                fields,
                loop,
                resource_version=q.get("resourceVersion"),
                send_initial_events=_truthy(q.get("sendInitialEvents")),
            )
        except st.StatusError as e:
            if e.code != 410:
                raise
            # The real server opens the stream, then sends the 410 as an ERROR event.
            await resp.prepare(request)
            await resp.write(_dumps({"type": "ERROR", "object": e.body()}) + b"\n")
            await resp.write_eof()
            return resp
        start_rv = self.store.resource_version
        await resp.prepare(request)

        async def send(kind: str, obj: Obj) -> None:
            await resp.write(_dumps({"type": kind, "object": obj}) + b"\n")

        def bookmark(rv: int, initial_events_end: bool = False) -> Obj:
            m: dict[str, Any] = {"resourceVersion": str(rv)}
            if initial_events_end:
                m["annotations"] = {INITIAL_EVENTS_END: "true"}
            return {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": m}

        abrupt = False
        try:
            for kind, obj in backlog:
                await send(kind, obj)
            if initial_end and bookmarks:
                await send("BOOKMARK", bookmark(start_rv, True))
            deadline = loop.time() + timeout if timeout is not None else None
            next_bookmark = loop.time() + self.bookmark_interval
            closing = False
            while True:
                now = loop.time()
                waits = []
                if deadline is not None and not closing:
                    waits.append(deadline - now)
                if bookmarks and not closing:
                    waits.append(next_bookmark - now)
                wait = max(0.0, min(waits)) if waits else None
                try:
                    kind, obj = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    now = loop.time()
                    if deadline is not None and now >= deadline:
                        if not bookmarks:
                            break
                        closing = True  # send a last bookmark, then end the stream
                        self._request_bookmark(watcher)
                    elif bookmarks and now >= next_bookmark:
                        next_bookmark = now + self.bookmark_interval
                        self._request_bookmark(watcher)
                    continue
                if kind == CLOSE:
                    abrupt = bool(obj)
                    break
                if kind == BOOKMARK:
                    await send("BOOKMARK", bookmark(int(obj)))
                    if closing:
                        break
                    continue
                await send(kind, obj)
        except (ConnectionResetError, asyncio.CancelledError):
            self.store.unwatch(watcher)
            raise
        finally:
            self.store.unwatch(watcher)
        if abrupt:
            if request.transport is not None:
                request.transport.abort()
            return resp
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    def _request_bookmark(self, watcher: Watcher) -> None:
        # Queued behind every event already pushed to this watch, so a client that resumes
        # from the bookmark's resourceVersion misses nothing.
        self.store.push_progress(watcher, BOOKMARK)


class StatusNotFoundPath(st.StatusError):
    def __init__(self) -> None:
        super().__init__(404, "NotFound", "the server could not find the requested resource")
