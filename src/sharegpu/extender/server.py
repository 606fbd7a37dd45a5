"""The extender's HTTP service: POST /filter, /prioritize, /bind; GET /healthz, /readyz,
/servingz, /metrics.

:meth:`ExtenderApp.server` serves all of them (over TLS in a cluster);
:meth:`ExtenderApp.probe_server` serves only the three GETs, for kubelet probes and Prometheus on
a plain-HTTP port that never answers a verb.

Handlers are thin: decode with :mod:`.wire`, ask the :class:`ClusterView` (synchronous, so each
answer sees one consistent state), encode. Bad payloads get HTTP 400 with an ``Error`` naming the
field; nothing here raises a traceback at kube-scheduler. Filter and prioritize are plain
functions, answered by :mod:`.httpserver` as soon as their request is read; bind awaits the API
server.

A verb's deadline counts from its request's first byte (``Request.started``, the caller's clock
starts then): ``verb_timeout`` seconds, below kube-scheduler's ``httpTimeout`` by a margin. A
replica that does not serve the verbs (a follower) passes filter and bind on to the one that
does with what is left of that deadline (``forward``), and closes the connection after its
answer, so that kube-scheduler's next request is sent through the Service again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from ..core.errors import ValidationError
from ..core.request import PodRequest
from . import wire
from .bind import Binder, BindError
from .events import REASON_BIND_FAILED, REASON_INVALID, REASON_UNSCHEDULABLE, EventRecorder
from .httpserver import Handler, HttpServer, Request, Response, json_response, text_response
from .metrics import Metrics
from .resourcepolicies import ResourcePolicies
from .view import ClusterView

log = logging.getLogger(__name__)

ANSWER_MARGIN_S = 0.05  # a bind gives up this long before its deadline, to answer by then
# the deadline a forwarded request carries: milliseconds left when the follower sent it
BUDGET_HEADER = "x-sharegpu-budget-ms"
FORWARDED = "x-sharegpu-forwarded-by"

# (verb, body, forwarded already, deadline) -> the serving replica's answer, or None: answer here
Forward = Callable[[str, bytes, bool, float], Awaitable["bytes | None"]]


class ExtenderApp:
    """Everything one replica serves. ``is_ready`` says whether this replica should get traffic
    (state rebuilt and, when leader election runs, holding the lease)."""

    def __init__(self, view: ClusterView, binder: Binder | None, metrics: Metrics,
                 events: EventRecorder | None = None,
                 is_ready: Callable[[], bool] | None = None,
                 is_synced: Callable[[], bool] | None = None,
                 forward: Forward | None = None,
                 units: ResourcePolicies | None = None,
                 verb_timeout: float | None = None,
                 serves: Callable[[], bool] | None = None) -> None:
        self.view = view
        self.units = units  # ResourcePolicy: only the nodes of the pod's unit pass filter
        self.binder = binder
        self.metrics = metrics
        self.events = events
        self.is_synced = is_synced or (lambda: view.synced)
        self.is_ready = is_ready or self.is_synced
        # a follower passes filter and bind on to the leader (replica.forward)
        self.forward = forward
        # whether this replica serves the verbs itself (the leader; else it forwards them)
        self.serves = serves or (lambda: True)
        # seconds from a request's first byte to its deadline (below the caller's timeout)
        self.verb_timeout = verb_timeout if verb_timeout is not None else (
            binder.bind_timeout if binder is not None else 7.0)
        # the last prioritize answer the view gave and its encoding (the view gives the very
        # same dict again while nothing it read changed)
        self._encoded: tuple[dict[str, int], bytes] | None = None
        # the prioritize request expected after the last filter, and the scores made for it
        self._ahead: tuple[bytes, dict[str, int]] | None = None

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("POST", "/filter"): self._forwarding("filter", self._timed("filter", self.filter)),
            ("POST", "/prioritize"): self._timed("prioritize", self.prioritize),
            ("POST", "/bind"): self._timed_async("bind", self.bind),
            ("GET", "/healthz"): self.healthz,
            ("GET", "/readyz"): self.readyz,
            ("GET", "/servingz"): self.servingz,
            ("GET", "/metrics"): self.metrics_handler,
        }

    def probe_routes(self) -> dict[tuple[str, str], Handler]:
        """Health and metrics only: no verb (/filter, /prioritize, /bind get 404 there)."""
        return {k: v for k, v in self.routes().items() if k[0] == "GET"}

    def server(self, **limits: Any) -> HttpServer:
        """``limits``: HttpServer's (max_body, idle_timeout, request_timeout, ...)."""
        return HttpServer(self.routes(), **limits)

    def probe_server(self) -> HttpServer:
        return HttpServer(self.probe_routes(), max_body=64 * 1024)

    def deadline(self, request: Request) -> float:
        """The request's deadline (``time.monotonic()``): ``verb_timeout`` after its first
        byte, or sooner when a forwarding replica says less is left."""
        age = asyncio.get_running_loop().time() - request.started if request.started else 0.0
        left = self.verb_timeout - max(0.0, age)
        budget = request.headers.get(BUDGET_HEADER, "")
        if FORWARDED in request.headers and budget.isascii() and budget.isdigit():
            left = min(left, int(budget) / 1000 - max(0.0, age))
        return time.monotonic() + left

    def _forwarding(self, verb: str, local: Callable[[Request], Response]
                    ) -> Callable[[Request], Response | Awaitable[Response]]:
        """``local`` where this replica serves the verb, else passed on to the one that does."""

        def handler(request: Request) -> Response | Awaitable[Response]:
            if self.forward is None or self.serves():
                return local(request)
            return self._forwarded(verb, request, local)

        return handler

    async def _forwarded(self, verb: str, request: Request,
                         local: Callable[[Request], Response]) -> Response:
        assert self.forward is not None
        deadline = self.deadline(request)
        got = await self.forward(verb, request.body, FORWARDED in request.headers, deadline)
        if got is None:
            return local(request)
        self.metrics.decided(verb, "forwarded")
        self._late(verb, deadline, request)
        return Response(200, got, close=True)

    def _late(self, verb: str, deadline: float, request: Request) -> None:
        """Count (and log) an answer given after its deadline."""
        over = time.monotonic() - deadline
        if over > 0:
            self.metrics.late.counts[(verb,)] += 1
            log.warning("late answer: %s %s %.3f s past its deadline (%.3f s after its first "
                        "byte)", verb, request.path, over,
                        asyncio.get_running_loop().time() - request.started)

    def _timed(self, verb: str, fn: Callable[[Request], Response]
               ) -> Callable[[Request], Response]:
        hist = self.metrics.latency.labels(verb)

        def handler(request: Request) -> Response:
            t0 = time.perf_counter()
            try:
                return fn(request)
            finally:
                hist.observe(time.perf_counter() - t0)

        return handler

    def _timed_async(self, verb: str, fn: Callable[[Request], Awaitable[Response]]
                     ) -> Callable[[Request], Awaitable[Response]]:
        hist = self.metrics.latency.labels(verb)

        async def handler(request: Request) -> Response:
            t0 = time.perf_counter()
            try:
                return await fn(request)
            finally:
                hist.observe(time.perf_counter() - t0)

        return handler

    def _body(self, request: Request) -> Any:
        try:
            return json.loads(request.body)
        except RecursionError:
            raise ValidationError("body", "", "JSON nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ValidationError("body", "", f"must be JSON ({e})") from None

    def _bad(self, verb: str, e: ValidationError, result: Any) -> Response:
        self.metrics.failed(verb, "bad-payload")
        self.metrics.decided(verb, "error")
        return json_response(result, status=400)

    # -- verbs ---------------
    def filter(self, request: Request) -> Response:
        body: Any = None
        parts = wire.split_names(request.body)
        if parts is not None:  # kube-scheduler's form: the pod first, the names apart
            try:
                head = json.loads(parts[0])
                quick = self._nothing_applies(head, parts[1]) if isinstance(head, dict) \
                    else None
                if quick is not None:
                    return quick  # the names never decoded
                body = {**head, "NodeNames": json.loads(parts[1])}
            except (ValueError, RecursionError, TypeError):
                body = None  # the whole body is decoded (and refused) below
        try:
            args = wire.parse_args(body if body is not None else self._body(request))
        except ValidationError as e:
            return self._bad("filter", e, wire.error_filter_result(str(e)))
        if not self.is_synced():
            self.metrics.failed("filter", "not-synced")
            return json_response(
                wire.error_filter_result("sharegpu extender: cluster state not ready"))
        try:
            req = self.view.reader.request(args.pod)
            # a DRA pod: its claims' capacity requests, scored on DRA nodes (bound plainly)
            scored = self._dra(args.pod, req)
        except ValidationError as e:
            msg = f"invalid GPU request: {e}"
            self._event(args.pod, REASON_INVALID, msg)
            self.metrics.decided("filter", "invalid")
            return json_response(wire.filter_result(args, [], {}, dict.fromkeys(args.names, msg)))
        passed, failed, unres = self.view.filter(scored, args.names)
        if self.units is not None:
            passed = self.units.restrict(args.pod, passed, unres)
        if passed and scored.wants_gpu and not self.view.graded:
            # the score is authoritative: answer with the policy's pick alone, so that
            # kube-scheduler skips prioritize and its own scores; held until the bind (a DRA
            # pod's devices are kube-scheduler's to allocate: nothing held for it)
            pick = self.view.pick(scored, passed,
                                  hold=self.binder is not None and scored is req)
            if pick is not None:
                passed = [pick]
        passed_json = wire.names_json(passed) if args.nodes is None else None
        if passed and scored.wants_gpu:
            if self.binder is not None:
                self.binder.hint(args.pod, req)
            # kube-scheduler runs its own score plugins before it asks prioritize: score the
            # passing nodes meanwhile, once this answer is on its way
            if self.view.graded:
                expected = (wire.prioritize_body(request.body, passed_json)
                            if passed_json is not None else None)
                asyncio.get_running_loop().call_soon(self._score_ahead, scored, passed,
                                                     expected)
        if scored.wants_gpu and not passed:
            from .events import summarize

            self._event(args.pod, REASON_UNSCHEDULABLE,
                        summarize(len(args.names), {**failed, **unres}))
            self.metrics.decided("filter", "no-fit")
        else:
            self.metrics.decided("filter", "ok")
        return Response(200, wire.filter_result_json(args, passed, failed, unres, passed_json))

    def _nothing_applies(self, args: dict[str, Any], names: bytes) -> Response | None:
        """The answer for a pod nothing of sharegpu applies to (no GPU, no ResourceClaim, no
        ResourcePolicy selecting it: kube-scheduler sends every pod when the extender lists no
        ``managedResources``): every node passes, answered with ``names``, the names' JSON
        array as sent. None for any other pod."""
        pod = args.get("Pod")
        if not isinstance(pod, dict) or args.get("Nodes") is not None or not self.is_synced():
            return None
        spec, meta = pod.get("spec"), pod.get("metadata")
        if not isinstance(spec, dict) or not isinstance(meta, dict) or spec.get("resourceClaims"):
            return None
        try:
            wire.check_pod_names(meta)
        except ValidationError:
            return None  # refused by the full reading
        try:
            req = self.view.reader.request(pod)
        except ValidationError:
            return None
        if req.wants_gpu:
            return None
        if self.units is not None:
            labels = meta.get("labels") or {}
            if not isinstance(labels, dict) or self.units.policy_for(
                    str(meta.get("namespace") or "default"), labels) is not None:
                return None
        if self.binder is not None:
            self.binder.hint(pod, req)  # its bind needs no read back
        self.metrics.decided("filter", "ok")
        return Response(200, wire.pass_all_json(names))

    def prioritize(self, request: Request) -> Response:
        ahead = self._ahead
        if ahead is not None and request.body == ahead[0] and self.view.still_current(ahead[1]):
            # byte for byte the request the scores ahead were made for, on an unchanged state
            self.metrics.decided("prioritize", "ok")
            return Response(200, self._encode(ahead[1]))
        try:
            args = wire.parse_args(self._body(request))
        except ValidationError as e:
            self.metrics.failed("prioritize", "bad-payload")
            return json_response({"Error": str(e)}, status=400)
        try:
            req = self._dra(args.pod, self.view.reader.request(args.pod))
        except ValidationError:
            self.metrics.decided("prioritize", "invalid")
            return json_response(wire.priority_list(dict.fromkeys(args.names, 0)))
        scores = self.view.prioritize(req, args.names)
        self.metrics.decided("prioritize", "ok")
        return Response(200, self._encode(scores))

    def _dra(self, pod: Any, req: PodRequest) -> PodRequest:
        """The request to place: a DRA pod's claims (:meth:`ClusterView.dra_request`), else
        the pod's own."""
        if req.wants_gpu:
            return req
        return self.view.dra_request(pod, req) or req

    def _encode(self, scores: dict[str, int]) -> bytes:
        if self._encoded is not None and self._encoded[0] is scores:
            return self._encoded[1]
        body = wire.priority_list_json(scores)
        self._encoded = (scores, body)
        return body

    def _score_ahead(self, req: PodRequest, names: list[str], expected: bytes | None) -> None:
        """Score ``names`` for the pod; ``expected`` is the prioritize request kube-scheduler
        will send for them (:func:`wire.prioritize_body`), when it could be worked out."""
        self._ahead = None
        try:
            scores = self.view.prioritize(req, names)
            self._encode(scores)
        except Exception as e:  # the prioritize request will compute (and report) it again
            log.debug("scoring ahead failed: %s", e)
            return
        if expected is not None:
            self._ahead = (expected, scores)

    async def bind(self, request: Request) -> Response:
        try:
            args = wire.parse_binding(self._body(request))
        except ValidationError as e:
            return self._bad("bind", e, wire.binding_result(str(e)))
        if self.binder is None:
            return json_response(wire.binding_result("this sharegpu extender does not bind"))
        deadline = self.deadline(request)
        if self.forward is not None:
            forwarded = await self.forward("bind", request.body, FORWARDED in request.headers,
                                           deadline)
            if forwarded is not None:
                self.metrics.decided("bind", "forwarded")
                self._late("bind", deadline, request)
                return Response(200, forwarded, close=True)
        try:
            out = await self.binder.bind(args, deadline - ANSWER_MARGIN_S)
        except BindError as e:
            self._late("bind", deadline, request)
            self.metrics.failed("bind", e.reason)
            self.metrics.decided("bind", "error")
            log.warning("bind %s to %s failed (%s): %s", args.key, args.node, e.reason, e)
            if e.reason not in ("not-leader", "read-pod"):
                pod = {"metadata": {"name": args.pod_name, "namespace": args.pod_namespace,
                                    "uid": args.pod_uid}}
                self._event(pod, REASON_BIND_FAILED, str(e))
            return json_response(wire.binding_result(str(e)))
        self._late("bind", deadline, request)
        self.metrics.decided("bind", "already" if out.already else "ok")
        return json_response(wire.binding_result())

    def _event(self, pod: Any, reason: str, message: str) -> None:
        if self.events is not None:
            try:
                self.events.record(pod, reason, message)
            except Exception as e:  # never let an event break an answer
                log.warning("event not recorded: %s", e)

    # -- probes ---------------
    def healthz(self, request: Request) -> Response:
        return text_response("ok")

    def readyz(self, request: Request) -> Response:
        if self.is_ready():
            return text_response("ok")
        return text_response("not ready", status=503)

    def servingz(self, request: Request) -> Response:
        """200 on the replica that serves the verbs (the one the Service sends them to)."""
        if self.is_ready() and self.serves():
            return text_response("serving")
        return text_response("not serving (a follower forwards the verbs)", status=503)

    def metrics_handler(self, request: Request) -> Response:
        return Response(200, self.metrics.render(), CONTENT_TYPE_LATEST)
