"""The extender's HTTP service: POST /filter, /prioritize, /bind; GET /healthz, /readyz, /metrics.

Handlers are thin: decode with :mod:`.wire`, ask the :class:`ClusterView` (synchronous, so each
answer sees one consistent state), encode. Bad payloads get HTTP 400 with an ``Error`` naming the
field; nothing here raises a traceback at kube-scheduler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import ValidationError
from ..request import PodRequest
from . import wire
from .bind import Binder, BindError
from .events import REASON_BIND_FAILED, REASON_INVALID, REASON_UNSCHEDULABLE, EventRecorder
from .metrics import Metrics
from .view import ClusterView

log = logging.getLogger(__name__)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data, separators=(",", ":")).encode(), status=status,
                        content_type="application/json")


class ExtenderApp:
    """Everything one replica serves. ``is_ready`` says whether this replica should get traffic
    (state rebuilt and, when leader election runs, holding the lease)."""

    def __init__(self, view: ClusterView, binder: Binder | None, metrics: Metrics,
                 events: EventRecorder | None = None,
                 is_ready: Callable[[], bool] | None = None,
                 is_synced: Callable[[], bool] | None = None) -> None:
        self.view = view
        self.binder = binder
        self.metrics = metrics
        self.events = events
        self.is_synced = is_synced or (lambda: view.synced)
        self.is_ready = is_ready or self.is_synced
        # the last prioritize answer the view gave and its encoding (the view gives the very
        # same dict again while nothing it read changed)
        self._encoded: tuple[dict[str, int], bytes] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/filter", self._timed("filter", self.filter))
        app.router.add_post("/prioritize", self._timed("prioritize", self.prioritize))
        app.router.add_post("/bind", self._timed("bind", self.bind))
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_handler)
        return app

    def _timed(self, verb: str, fn: Callable[[web.Request], Awaitable[web.Response]]
               ) -> Callable[[web.Request], Awaitable[web.Response]]:
        hist = self.metrics.latency.labels(verb)

        async def handler(request: web.Request) -> web.Response:
            t0 = time.perf_counter()
            try:
                return await fn(request)
            finally:
                hist.observe(time.perf_counter() - t0)

        return handler

    async def _body(self, request: web.Request, verb: str) -> Any:
        try:
            return await request.json(loads=json.loads)
        except ValueError as e:
            raise ValidationError("body", "", f"must be JSON ({e})") from None

    def _bad(self, verb: str, e: ValidationError, result: Any) -> web.Response:
        self.metrics.failures.labels(verb, "bad-payload").inc()
        self.metrics.decisions.labels(verb, "error").inc()
        return _json(result, status=400)

    # -- verbs ---------------
    async def filter(self, request: web.Request) -> web.Response:
        try:
            args = wire.parse_args(await self._body(request, "filter"))
        except ValidationError as e:
            return self._bad("filter", e, wire.error_filter_result(str(e)))
        if not self.is_synced():
            self.metrics.failures.labels("filter", "not-synced").inc()
            return _json(wire.error_filter_result("sharegpu extender: cluster state not ready"))
        try:
            req = self.view.reader.request(args.pod)
        except ValidationError as e:
            msg = f"invalid GPU request: {e}"
            self._event(args.pod, REASON_INVALID, msg)
            self.metrics.decisions.labels("filter", "invalid").inc()
            return _json(wire.filter_result(args, [], {}, dict.fromkeys(args.names, msg)))
        passed, failed, unres = self.view.filter(req, args.names)
        if passed and req.wants_gpu:
            if self.binder is not None:
                self.binder.hint(args.pod, req)
            # kube-scheduler runs its own score plugins before it asks prioritize: score the
            # passing nodes meanwhile, once this answer is on its way
            asyncio.get_running_loop().call_soon(self._score_ahead, req, passed)
        if req.wants_gpu and not passed:
            from .events import summarize

            self._event(args.pod, REASON_UNSCHEDULABLE,
                        summarize(len(args.names), {**failed, **unres}))
            self.metrics.decisions.labels("filter", "no-fit").inc()
        else:
            self.metrics.decisions.labels("filter", "ok").inc()
        return _json(wire.filter_result(args, passed, failed, unres))

    async def prioritize(self, request: web.Request) -> web.Response:
        try:
            args = wire.parse_args(await self._body(request, "prioritize"))
        except ValidationError as e:
            self.metrics.failures.labels("prioritize", "bad-payload").inc()
            return _json({"Error": str(e)}, status=400)
        try:
            req = self.view.reader.request(args.pod)
        except ValidationError:
            self.metrics.decisions.labels("prioritize", "invalid").inc()
            return _json(wire.priority_list(dict.fromkeys(args.names, 0)))
        scores = self.view.prioritize(req, args.names)
        self.metrics.decisions.labels("prioritize", "ok").inc()
        return web.Response(body=self._encode(scores), content_type="application/json")

    def _encode(self, scores: dict[str, int]) -> bytes:
        if self._encoded is not None and self._encoded[0] is scores:
            return self._encoded[1]
        body = wire.priority_list_json(scores)
        self._encoded = (scores, body)
        return body

    def _score_ahead(self, req: PodRequest, names: list[str]) -> None:
        try:
            self._encode(self.view.prioritize(req, names))
        except Exception as e:  # the prioritize request will compute (and report) it again
            log.debug("scoring ahead failed: %s", e)

    async def bind(self, request: web.Request) -> web.Response:
        try:
            args = wire.parse_binding(await self._body(request, "bind"))
        except ValidationError as e:
            return self._bad("bind", e, wire.binding_result(str(e)))
        if self.binder is None:
            return _json(wire.binding_result("this sharegpu extender does not bind"))
        try:
            out = await self.binder.bind(args)
        except BindError as e:
            self.metrics.failures.labels("bind", e.reason).inc()
            self.metrics.decisions.labels("bind", "error").inc()
            if e.reason not in ("not-leader", "read-pod"):
                pod = {"metadata": {"name": args.pod_name, "namespace": args.pod_namespace,
                                    "uid": args.pod_uid}}
                self._event(pod, REASON_BIND_FAILED, str(e))
            return _json(wire.binding_result(str(e)))
        self.metrics.decisions.labels("bind", "already" if out.already else "ok").inc()
        return _json(wire.binding_result())

    def _event(self, pod: Any, reason: str, message: str) -> None:
        if self.events is not None:
            try:
                self.events.record(pod, reason, message)
            except Exception as e:  # never let an event break an answer
                log.warning("event not recorded: %s", e)

    # -- probes ---------------
    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(self, request: web.Request) -> web.Response:
        if self.is_ready():
            return web.Response(text="ok")
        return web.Response(text="not ready", status=503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        body = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
