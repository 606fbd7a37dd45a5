"""One extender replica: the API client, the cluster view fed by the informer, the leader
election, the binder and the HTTP service, started and stopped together.

Every replica keeps a warm view and is Ready once it is rebuilt (so rollouts and drains go on);
only the leader serves the verbs: it holds the filter's picks and binds, and it carries the pod
label ``sharegpu.io/extender-serving=true`` that the chart's Service selects on, so the Service
sends kube-scheduler to it alone. A follower that still gets a verb (a keep-alive connection
opened before the leader changed) passes filter and bind on to the leader with what is left of
the request's deadline and closes the connection after the answer, so kube-scheduler reconnects
through the Service. On becoming leader a replica relists before it binds, so it never decides
on a view older than the previous leader's last binding.

With TLS, a follower forwards to the leader's pod IP (the URL on the Lease) and verifies the
leader's certificate with ``forward_tls`` (the CA) under ``forward_server_name``, the Service DNS
name the replicas' certificate carries: the connection goes to the IP, the handshake names (SNI)
and checks the Service's name. Nothing is forwarded unverified. The forwarding client is built
in one place (``_forward_client``); ``forward_tls`` also presents the replica's own certificate:
the leader answers no caller without one its client CA signed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Mapping
from typing import Any

import httpx2 as httpx

from ..kubeio.aio import cancel_all
from .bind import Binder
from .bindscope import BindScope
from .events import REASON_DRA_UNSCHEDULABLE, REASON_UNANNOTATED, EventRecorder
from .httpserver import HttpServer
from .informer import Informer
from .kube import PODS, ApiError, KubeApi
from .leader import LeaderElector
from .metrics import Metrics
from .picks import DEFAULT_TIMEOUT_S as DEFAULT_HOLD_S
from .podgroups import PodGroupWatch
from .resourcepolicies import ResourcePolicies
from .server import ExtenderApp
from .view import ClusterView

log = logging.getLogger(__name__)

FORWARDED_HEADER = "X-Sharegpu-Forwarded-By"
BUDGET_HEADER = "X-Sharegpu-Budget-Ms"  # milliseconds left of the caller's deadline
SERVING_LABEL = "sharegpu.io/extender-serving"  # "true" on the replica serving the verbs
FORWARD_MARGIN_S = 0.1  # the leader answers this much before the follower must
FORWARD_CONNECTIONS = 64  # open to the leader at most; a request waits no longer than its deadline
HOUSEKEEPING_S = 1.0  # between expiring held picks and settling unknown Binding outcomes


def _error_answer(message: str) -> bytes:
    return json.dumps({"Error": message}).encode()


class Replica:
    def __init__(self, api: KubeApi, *, identity: str, policy: str = "default",
                 lease_namespace: str = "kube-system", lease_name: str = "sharegpu-extender",
                 elect: bool = True, lease_duration: float = 10.0, renew_deadline: float = 7.0,
                 retry_period: float = 2.0, check_every: float = 300.0,
                 graded_scores: bool = False, advertise_url: str = "",
                 forward_timeout: float = 8.0, http_limits: dict[str, Any] | None = None,
                 forward_tls: ssl.SSLContext | None = None, forward_server_name: str = "",
                 start_wait: float = 5.0, bind_timeout: float = 7.0,
                 hold_timeout: float = DEFAULT_HOLD_S, own_pod: str = "",
                 dra: bool = False, bind_scope: BindScope | None = None) -> None:
        """``bind_timeout``: seconds from a verb's first byte to its deadline (below
        kube-scheduler's httpTimeout); ``hold_timeout``: seconds a filter's pick stays held
        without its bind; ``own_pod``: ``namespace/name`` of this replica's pod, labelled
        while it serves the verbs (empty: no label); ``bind_scope``: the pods and nodes it
        binds (default: pods of the chart's default profile, to Nodes that exist)."""
        self.api = api
        self.identity = identity
        self.own_pod = own_pod
        self.view = ClusterView(policy, graded=graded_scores, hold_timeout=hold_timeout)
        self.metrics = Metrics(lambda: self.view)
        # ResourcePolicy: the policies (watched) and the pods per unit (from the informer)
        self.units = ResourcePolicies()
        self.informer = Informer(api, self.view, self.metrics, check_every=check_every,
                                 on_event=self._on_event, on_reset=self.units.reset,
                                 dra=dra)
        self.elector: LeaderElector | None = None
        if elect:
            self.elector = LeaderElector(
                api, lease_namespace, lease_name, identity, lease_duration=lease_duration,
                renew_deadline=renew_deadline, retry_period=retry_period,
                on_change=self._leader_changed, url=advertise_url)
        self.advertise_url = advertise_url
        self.http_limits = dict(http_limits or {})
        self.forward_timeout = forward_timeout  # for a forward without a deadline, at most
        self.forward_tls = forward_tls  # verifies the leader (https URLs); None: system CAs
        self.forward_server_name = forward_server_name  # the name checked in its certificate
        self._http: httpx.AsyncClient | None = None
        self.forwarded = 0  # verbs passed on to the leader
        self._leader_synced = not elect
        self._labelled: bool | None = None  # the serving label as last written
        self._label_task: asyncio.Task[None] | None = None
        scope = bind_scope or BindScope()
        scope.node_exists = self.view.presence.has_node
        self.binder = Binder(api, lambda: self.view, self.may_bind, units=self.units,
                             start_wait=start_wait, bind_timeout=bind_timeout,
                             metrics=self.metrics, scope=scope)
        self.events = EventRecorder(api, self.metrics, host=identity)
        self.view.on_unseen = self._unseen
        self.view.on_dra_unschedulable = self._dra_unschedulable
        self.view.gang_may_hold = self.may_bind  # only the binder holds a gang's GPU shares
        self.view.picks.may_hold = self.may_bind  # and the picks its filter answered with
        self.podgroups = PodGroupWatch(api, self.view)
        self.service = ExtenderApp(self.view, self.binder, self.metrics, self.events,
                                   is_ready=self.is_ready, is_synced=self.is_ready,
                                   forward=self.forward, units=self.units,
                                   verb_timeout=bind_timeout, serves=self.serves_verbs)
        self._tasks: list[asyncio.Task[None]] = []
        self._server: HttpServer | None = None
        self._probe_server: HttpServer | None = None
        self.port = 0
        self.probe_port = 0  # the plain-HTTP health/metrics port, when one is served

    def _on_event(self, path: str, kind: str, obj: dict[str, Any]) -> None:
        self.units.on_event(path, kind, obj)
        if path == PODS:
            self.binder.on_pod(kind, obj)

    def _unseen(self, pod: Mapping[str, Any]) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        with contextlib.suppress(RuntimeError):  # no running loop: a rebuild outside the server
            self.events.record(pod, REASON_UNANNOTATED, (
                f"holds GPU resources on node {node} but was not placed by the sharegpu "
                "extender (no scheduling decision recorded): counted against every GPU of the "
                "node until it ends; schedule GPU pods with schedulerName ack-co-scheduler"))

    def _dra_unschedulable(self, pod: Mapping[str, Any], message: str) -> None:
        """A DRA pod no node of the pool can take (the view's diagnosis): the leader tells it
        in a Warning Event, so that replicas do not post it twice; a replica that becomes the
        leader tells what it knows again (``_take_over``)."""
        if not self.is_leader():
            return
        with contextlib.suppress(RuntimeError):  # no running loop: a rebuild outside the server
            self.events.record(pod, REASON_DRA_UNSCHEDULABLE, message)

    # -- leadership ---------------
    def is_leader(self) -> bool:
        return self.elector is None or self.elector.is_leader()

    def may_bind(self) -> bool:
        return self.is_leader() and self._leader_synced

    def is_ready(self) -> bool:
        """The pod is Ready once its view is rebuilt (a follower stands by warm; rollouts and
        PodDisruptionBudgets count it). Which replica serves the verbs: ``serves_verbs``."""
        return self.view.synced and self.units.synced

    def serves_verbs(self) -> bool:
        """Whether this replica answers filter and bind itself (the leader, synced); the
        others forward them to it."""
        return self.may_bind() and self.is_ready()

    def _leader_changed(self, leader: bool) -> None:
        self.metrics.leader.set(1 if leader else 0)
        self._leader_synced = False
        self._label(False)
        if not leader:
            self.view.drop_gang_holds()
            self.view.drop_picks()
        if leader:
            self._tasks.append(asyncio.get_running_loop().create_task(self._take_over()))

    async def _take_over(self) -> None:
        """Start binding. A follower's view follows the API server through its watches; the
        old leader stopped binding ``renew_deadline`` after its last renewal, at least
        ``lease_duration - renew_deadline`` (3 s by default) before this replica could take the
        Lease, so its last writes are in a view whose watches stream. Then the new leader binds
        at once, and a consistency check runs in the background; otherwise it relists first."""
        if self.informer.current():
            self._leader_synced = self.is_leader()
            self._label(self._leader_synced)
            log.info("%s: leader, binding from its warm view", self.identity)
            self.view.dra_recheck(again=True)
            try:
                await self.informer.check(settle_s=1.0)
            except Exception as e:
                log.warning("%s: consistency check after taking over failed: %s",
                            self.identity, e)
            return
        while True:
            try:
                await self.informer.relist()
                break
            except Exception as e:
                log.warning("%s: relist on taking over failed: %s", self.identity, e)
                await asyncio.sleep(0.5)
        self._leader_synced = self.is_leader()
        self._label(self._leader_synced)
        log.info("%s: leader with a fresh view", self.identity)
        self.view.dra_recheck(again=True)

    # -- the serving label ---------------
    def _label(self, serving: bool) -> None:
        """Mark this replica's pod as serving the verbs (or not): the Service selects on it."""
        if not self.own_pod or self._labelled is serving:
            return
        self._labelled = serving
        if self._label_task is None or self._label_task.done():
            self._label_task = asyncio.get_running_loop().create_task(self._write_label())
            self._tasks.append(self._label_task)

    async def _write_label(self) -> None:
        ns, _, name = self.own_pod.partition("/")
        written: bool | None = None
        delay = 0.2
        while written is not self._labelled:
            want = bool(self._labelled)
            try:
                await self.api.request(
                    "PATCH", f"/api/v1/namespaces/{ns}/pods/{name}",
                    {"metadata": {"labels": {SERVING_LABEL: "true" if want else "false"}}},
                    content_type="application/merge-patch+json")
                written = want
                log.info("%s: pod %s labelled %s=%s", self.identity, self.own_pod,
                         SERVING_LABEL, "true" if want else "false")
            except (ApiError, httpx.HTTPError) as e:
                log.warning("%s: cannot label pod %s %s (%s); retrying", self.identity,
                            self.own_pod, SERVING_LABEL, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # -- forwarding to the leader ---------------
    def _forward_client(self) -> httpx.AsyncClient:
        """The one client that forwards verbs to the leader: verifies it with ``forward_tls``
        (a client certificate for the leader's verb port goes in that context too). Bounded
        pool; each request bounds its own wait by its deadline."""
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=self.forward_timeout, verify=self.forward_tls or True,
                limits=httpx.Limits(max_connections=FORWARD_CONNECTIONS,
                                    max_keepalive_connections=FORWARD_CONNECTIONS))
        return self._http

    async def forward(self, verb: str, body: bytes, forwarded: bool,
                      deadline: float) -> bytes | None:
        """A verb this replica does not serve, passed on to the leader within ``deadline``
        (``time.monotonic()``): the leader's answer, or an ``Error`` answer when there is none
        in time (kube-scheduler then retries the pod). ``None``: answer here (this replica
        serves the verbs, or the request was forwarded already)."""
        if self.serves_verbs() or forwarded or self.elector is None:
            return None
        holder, url = self.elector.holder, self.elector.holder_url
        if not holder or holder == self.identity or not url:
            return _error_answer("no sharegpu extender leader to answer (election in progress)")
        left = min(deadline - time.monotonic(), self.forward_timeout)
        if left <= FORWARD_MARGIN_S:
            return _error_answer(f"no time left to pass {verb} on to the sharegpu extender leader")
        extensions = {}
        if self.forward_server_name and url.startswith("https://"):
            # connect to the leader's IP, verify its certificate under the Service's name
            extensions["sni_hostname"] = self.forward_server_name
        budget_ms = int((left - FORWARD_MARGIN_S) * 1000)
        try:
            async with asyncio.timeout(left):
                r = await self._forward_client().post(
                    url.rstrip("/") + "/" + verb, content=body, timeout=httpx.Timeout(left),
                    headers={"Content-Type": "application/json",
                             FORWARDED_HEADER: self.identity, BUDGET_HEADER: str(budget_ms)},
                    extensions=extensions)
        except (httpx.HTTPError, TimeoutError) as e:
            log.warning("%s: %s forwarded to the leader %s at %s got no answer in time (%s)",
                        self.identity, verb, holder, url, type(e).__name__)
            return _error_answer(f"the sharegpu extender leader {holder} at {url} did not answer "
                                 f"({type(e).__name__})")
        self.forwarded += 1
        if r.status_code != 200:
            return _error_answer(f"the sharegpu extender leader {holder} answered HTTP "
                               f"{r.status_code}")
        return r.content

    async def _housekeeping(self) -> None:
        """Held picks expire by time, and unknown Binding outcomes settle, with no traffic."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            try:
                self.view.expire_picks()
                await self.binder.settle()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("%s: expiring picks / settling binds failed: %s", self.identity, e)

    # -- life cycle ---------------
    async def start(self, host: str = "127.0.0.1", port: int = 0,
                    ssl_context: ssl.SSLContext | None = None,
                    probe: tuple[str, int] | None = None) -> None:
        """Serve everything on ``host:port`` (TLS with ``ssl_context``) and, with ``probe``, the
        health and metrics GETs (no verb) on that plain-HTTP address too."""
        if probe is not None and self._probe_server is None:
            # up first, so kubelet's liveness probe passes while the first list runs
            self._probe_server = self.service.probe_server()
            self.probe_port = await self._probe_server.start(*probe)
        self._tasks.append(asyncio.create_task(self.units.run(self.api), name="resourcepolicies"))
        await self.informer.start()
        self._tasks += [asyncio.create_task(self.podgroups.run(), name="podgroups"),
                        asyncio.create_task(self.podgroups.expire(), name="gang-expiry"),
                        asyncio.create_task(self._housekeeping(), name="housekeeping")]
        self._label(self.serves_verbs())
        self._server = self.service.server(**self.http_limits)
        self.port = await self._server.start(host, port, ssl_context)
        if self.elector is not None:
            if not self.elector.url and host not in ("", "0.0.0.0", "::"):
                scheme = "https" if ssl_context is not None else "http"
                self.elector.url = f"{scheme}://{host}:{self.port}"
            self._tasks.append(asyncio.create_task(self.elector.run(), name="leader-election"))

    async def stop(self, graceful: bool = True) -> None:
        """``graceful=False`` stops without giving up the lease (a crash, for tests)."""
        await cancel_all(self._tasks)
        self._tasks = []
        if graceful and self.elector is not None:
            await self.elector.release()
        await self.informer.stop()
        for server in (self._server, self._probe_server):
            if server is not None:
                await server.close()
        self._server = self._probe_server = None
        await self.events.drain()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
