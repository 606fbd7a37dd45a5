"""One extender replica: the API client, the cluster view fed by the informer, the leader
election, the binder and the HTTP service, started and stopped together.

Every replica keeps a warm view and answers filter/prioritize; only the leader binds and reports
ready (so a Service sends kube-scheduler to it). On becoming leader a replica relists before it
binds, so it never decides on a view older than the previous leader's last binding.

With TLS, a follower forwards binds to the leader's pod IP (the URL on the Lease) and verifies the
leader's certificate with ``forward_tls`` (the CA) under ``forward_server_name``, the Service DNS
name the replicas' certificate carries: the connection goes to the IP, the handshake names (SNI)
and checks the Service's name. Nothing is forwarded unverified. ``forward_tls`` also presents the
replica's own certificate: the leader answers no caller without one its client CA signed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Mapping
from typing import Any

import httpx2 as httpx

from ..kubeio.aio import cancel_all
from .bind import Binder
from .bindscope import BindScope
from .events import REASON_DRA_UNSCHEDULABLE, REASON_UNANNOTATED, EventRecorder
from .httpserver import HttpServer
from .informer import Informer
from .kube import KubeApi
from .leader import LeaderElector
from .metrics import Metrics
from .podgroups import PodGroupWatch
from .resourcepolicies import ResourcePolicies
from .server import ExtenderApp
from .view import ClusterView

log = logging.getLogger(__name__)

FORWARDED_HEADER = "X-Sharegpu-Forwarded-By"


def _bind_error(message: str) -> bytes:
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
                 dra: bool = False, bind_scope: BindScope | None = None) -> None:
        """``bind_scope``: the pods and nodes it binds (default: pods of the chart's default
        profile, to Nodes that exist)."""
        self.api = api
        self.identity = identity
        self.view = ClusterView(policy, graded=graded_scores)
        self.metrics = Metrics(lambda: self.view)
        # ResourcePolicy: the policies (watched) and the pods per unit (from the informer)
        self.units = ResourcePolicies()
        self.informer = Informer(api, self.view, self.metrics, check_every=check_every,
                                 on_event=self.units.on_event, on_reset=self.units.reset,
                                 dra=dra)
        self.elector: LeaderElector | None = None
        if elect:
            self.elector = LeaderElector(
                api, lease_namespace, lease_name, identity, lease_duration=lease_duration,
                renew_deadline=renew_deadline, retry_period=retry_period,
                on_change=self._leader_changed, url=advertise_url)
        self.advertise_url = advertise_url
        self.http_limits = dict(http_limits or {})
        self.forward_timeout = forward_timeout
        self.forward_tls = forward_tls  # verifies the leader (https URLs); None: system CAs
        self.forward_server_name = forward_server_name  # the name checked in its certificate
        self._http: httpx.AsyncClient | None = None
        self.forwarded = 0  # binds passed on to the leader
        self._leader_synced = not elect
        scope = bind_scope or BindScope()
        scope.node_exists = self.view.presence.has_node
        self.binder = Binder(api, lambda: self.view, self.may_bind, units=self.units,
                             start_wait=start_wait, bind_timeout=bind_timeout, scope=scope)
        self.events = EventRecorder(api, self.metrics, host=identity)
        self.view.on_unseen = self._unseen
        self.view.on_dra_unschedulable = self._dra_unschedulable
        self.view.gang_may_hold = self.may_bind  # only the binder holds a gang's GPU shares
        self.view.picks.may_hold = self.may_bind  # and the picks its filter answered with
        self.podgroups = PodGroupWatch(api, self.view)
        self.service = ExtenderApp(self.view, self.binder, self.metrics, self.events,
                                   is_ready=self.is_ready, is_synced=self.is_ready,
                                   forward_bind=self.forward_bind, units=self.units)
        self._tasks: list[asyncio.Task[None]] = []
        self._server: HttpServer | None = None
        self._probe_server: HttpServer | None = None
        self.port = 0
        self.probe_port = 0  # the plain-HTTP health/metrics port, when one is served

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
        """Every replica with a rebuilt view takes traffic: filter and prioritize are answered
        from its own (warm) view, and a follower passes binds on to the leader."""
        return self.view.synced and self.units.synced

    def _leader_changed(self, leader: bool) -> None:
        self.metrics.leader.set(1 if leader else 0)
        self._leader_synced = False
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
        log.info("%s: leader with a fresh view", self.identity)
        self.view.dra_recheck(again=True)

    async def forward_bind(self, body: bytes, forwarded: bool) -> bytes | None:
        """A bind this replica may not do, passed on to the leader: the leader's answer, or an
        ``Error`` answer when there is none to reach (kube-scheduler then retries the pod).
        ``None``: bind here (this replica leads, or the request was forwarded already)."""
        if self.may_bind() or forwarded or self.elector is None:
            return None
        holder, url = self.elector.holder, self.elector.holder_url
        if not holder or holder == self.identity or not url:
            return _bind_error("no sharegpu extender leader to bind (election in progress)")
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.forward_timeout,
                                           verify=self.forward_tls or True)
        extensions = {}
        if self.forward_server_name and url.startswith("https://"):
            # connect to the leader's IP, verify its certificate under the Service's name
            extensions["sni_hostname"] = self.forward_server_name
        try:
            r = await self._http.post(url.rstrip("/") + "/bind", content=body,
                                      headers={"Content-Type": "application/json",
                                               FORWARDED_HEADER: self.identity},
                                      extensions=extensions)
        except httpx.HTTPError as e:
            return _bind_error(f"the sharegpu extender leader {holder} at {url} did not answer "
                               f"({type(e).__name__})")
        self.forwarded += 1
        if r.status_code != 200:
            return _bind_error(f"the sharegpu extender leader {holder} answered HTTP "
                               f"{r.status_code}")
        return r.content

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
                        asyncio.create_task(self.podgroups.expire(), name="gang-expiry")]
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
