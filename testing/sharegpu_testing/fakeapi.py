"""A fake Kubernetes API server for tests: a real HTTP/1.1 server on 127.0.0.1 (aiohttp).

It serves core/v1 pods (with ``pods/binding`` and ``pods/status``), nodes (with
``nodes/status``), namespaces, events and configmaps, coordination.k8s.io/v1 leases and
events.k8s.io/v1 events (one storage with core/v1 events, as upstream), plus the discovery
documents (``/api``, ``/apis``, ``/version``). The parts: :mod:`~sharegpu_testing.routing`
(paths to API calls), :mod:`~sharegpu_testing.store` (resourceVersion, conflicts,
finalizers, history, watches), :mod:`~sharegpu_testing.validation`,
:mod:`~sharegpu_testing.patches`, :mod:`~sharegpu_testing.selectors`,
:mod:`~sharegpu_testing.watchstream`, :mod:`~sharegpu_testing.faults`,
:mod:`~sharegpu_testing.tls`.

It is not a kube-apiserver: no authorization, one optional bearer token for authentication,
no admission webhooks (the real kube-apiserver calls sharegpu's webhook in
``tests/e2e/test_webhook_real.py``), no schema validation beyond the rules in ``validation``, no
server-side apply field ownership (an apply patch merges like a strategic merge patch and
creates missing objects), no controllers or garbage collection.

Use it from sync tests (``with FakeApiServer() as api:`` runs it in a background thread with
its own event loop) or from async tests (``async with FakeApiServer() as api:`` runs it in the
running loop). ``api.kubeconfig_path`` is a kubeconfig for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import ssl
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

from sharegpu.core import names
from sharegpu.core.annotations import assigned_patch, is_assigned

from . import resources as res
from . import status as st
from .faults import Faults
from .patches import PatchError, json_patch, merge_patch, strategic_merge_patch
from .resources import ResourceType
from .routing import PUBLIC_PATHS, Call, discovery, route
from .selectors import SelectorError, parse_field_selector, parse_label_selector
from .store import Obj, Store
from .tls import make_certificates
from .watchstream import serve_watch

_log = logging.getLogger(__name__)

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = (MERGE_PATCH, STRATEGIC_PATCH, JSON_PATCH, APPLY_PATCH)


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
    user_agent: str = ""
    authorization: str = ""


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


class FakeApiServer:
    """A fake kube-apiserver on 127.0.0.1. See the module docstring for what it covers.

    Parameters: ``port`` (0: any free port), ``history_size`` (changes kept for watch resume;
    older resourceVersions get 410), ``seed`` (uids, generated names, fault draws),
    ``bookmark_interval`` (seconds between BOOKMARK events on watches that allow them),
    ``watch_timeout`` (server-side cap on a watch in seconds, None: none unless the client sets
    ``timeoutSeconds``), ``graceful_pod_deletion`` (DELETE of a bound pod only marks it, like
    a real cluster waiting for the kubelet), ``strict_namespaces`` (namespaced writes need an
    existing Namespace; default, kube-system, kube-public and kube-node-lease exist), ``tls``
    (serve HTTPS with a throwaway CA, ``ca_cert_path``, named in the kubeconfig), ``token``
    (answer 401 to requests without ``Authorization: Bearer <token>``, except health and
    version; the kubeconfig carries it).
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
        tls: bool = False,
        token: str | None = None,
        kubelet_start_s: float | None = None,
    ) -> None:
        """``kubelet_start_s``: play each node's kubelet and sharegpu agent: that long after a
        pod's binding, a pod carrying a sharegpu decision is marked ``assigned``, as the agent
        marks it once the kubelet has allocated its devices. ``None``: no kubelet runs, so
        bound pods stay starting (sharegpu.core.startingpods)."""
        self.host = host
        self.kubelet_start_s = kubelet_start_s
        self.port = port
        self.tls = tls
        self.token = token
        self.ca_cert_path: Path | None = None
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

    def _kubelet_starts(self, namespace: str, name: str) -> None:
        """The node's kubelet admitted the pod and the agent marked it assigned."""
        cur = self.store.find(res.POD, namespace, name)
        ann = ((cur or {}).get("metadata") or {}).get("annotations") or {}
        if not ann.get(names.ANN_ALLOCATION) or is_assigned(ann):
            return  # no sharegpu decision, or already marked

        def mutate(pod: Obj | None) -> Obj:
            assert pod is not None
            pod.setdefault("metadata", {}).setdefault("annotations", {}).update(
                assigned_patch())
            return pod

        with contextlib.suppress(st.StatusError):  # deleted meanwhile
            self.store.update(res.POD, namespace, name, mutate)

    # ================================================================== lifecycle

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def start_async(self) -> FakeApiServer:
        """Start serving in the running event loop."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self._runner.setup()
        ssl_context = None
        if self.tls:
            certs = make_certificates(self._workdir() / "tls", (self.host, "localhost"))
            self.ca_cert_path = certs.ca_cert
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(certs.cert, certs.key)
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=ssl_context)
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

    def _workdir(self) -> Path:
        if self._tmpdir is None:
            self._tmpdir = Path(tempfile.mkdtemp(prefix="fake-kube-"))
        return self._tmpdir

    def _write_kubeconfig(self) -> None:
        cluster: dict[str, Any] = {"server": self.url}
        if self.ca_cert_path is not None:
            cluster["certificate-authority"] = str(self.ca_cert_path)
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": cluster}],
            "users": [{"name": "fake", "user": {"token": self.token or "fake-token"}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": "default"},
                }
            ],
            "current-context": "fake",
        }
        self.kubeconfig_path = self._workdir() / "kubeconfig"
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
        self, request: web.Request, verb: str, call: Call | None, status: int, body: Any
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
                request.headers.get("User-Agent", ""),
                request.headers.get("Authorization", ""),
            )
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        call: Call | None = None
        body: Any = None
        try:
            if self.faults.is_down:
                raise st.unavailable()
            segs = [s for s in request.path.split("/") if s]
            public = len(segs) == 1 and segs[0] in PUBLIC_PATHS
            if (
                self.token is not None
                and not public
                and request.headers.get("Authorization") != f"Bearer {self.token}"
            ):
                raise st.StatusError(401, "Unauthorized", "Unauthorized")
            doc = discovery(segs, f"{self.host}:{self.port}")
            if doc is not None:
                self._record(request, "discovery", None, 200, None)
                if isinstance(doc, str):
                    return web.Response(text=doc, content_type="text/plain")
                return _json_response(doc)
            call = route(request.method, segs, request.query)
            decision = self.faults.decide(
                call.verb, call.resource, call.name or "", call.rtype.group
            )
            if decision.latency and decision.lands and call.verb != "watch":
                # carried out even if the client leaves meanwhile (the handler is cancelled then)
                return await asyncio.shield(asyncio.ensure_future(
                    self._after(request, call, decision)))
            if decision.latency:
                await asyncio.sleep(decision.latency)
            if decision.error is not None and not decision.after_commit:
                raise decision.error
            if call.verb == "watch":
                return await serve_watch(
                    request, call, self.store, self.faults,
                    bookmark_interval=self.bookmark_interval, watch_timeout=self.watch_timeout,
                    on_open=lambda: self._record(request, "watch", call, 200, None),
                )  # fmt: skip
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
        except (ValueError, yaml.YAMLError) as e:  # JSON/YAML decoding, bad numbers
            self._record(request, call.verb if call else "unknown", call, 400, body)
            return _error_response(st.bad_request(f"error decoding the request: {e}"))
        except Exception as e:  # a bug in the fake: answer like the real server would
            _log.exception("fake API server: %s %s failed", request.method, request.path)
            self._record(request, call.verb if call else "unknown", call, 500, body)
            return _error_response(st.internal(repr(e)))

    async def _after(self, request: web.Request, call: Call, decision: Any) -> web.StreamResponse:
        """A request that lands: its body read at once, then the latency, then the rest."""
        body: Any = None
        try:
            if request.method in ("POST", "PUT", "PATCH"):
                body = await self._read_body(request, call)
            await asyncio.sleep(decision.latency)
            if decision.error is not None and not decision.after_commit:
                raise decision.error
            resp = self._dispatch(request, call, body)
            if decision.error is not None:
                raise decision.error
            self._record(request, call.verb, call, resp.status, body)
            return resp
        except st.StatusError as e:
            self._record(request, call.verb, call, e.code, body)
            return _error_response(e)

    async def _read_body(self, request: web.Request, call: Call) -> Any:
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

    # ------------------------------------------------------------------ verbs

    def _dispatch(
        self, request: web.Request, call: Call, body: Any, *, force_dry_run: bool = False
    ) -> web.Response:
        q = request.query
        store = self.store
        rtype = call.rtype
        dry_run = force_dry_run or "All" in q.getall("dryRun", [])
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
                if self.kubelet_start_s is not None and not dry_run:
                    asyncio.get_running_loop().call_later(
                        self.kubelet_start_s, self._kubelet_starts, call.namespace, name)
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

    def _patch(self, request: web.Request, call: Call, patch: Any, dry_run: bool) -> web.Response:
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
