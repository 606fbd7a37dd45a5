"""One extender replica: the API client, the cluster view fed by the informer, the leader
election, the binder and the HTTP service, started and stopped together.

Every replica keeps a warm view and answers filter/prioritize; only the leader binds and reports
ready (so a Service sends kube-scheduler to it). On becoming leader a replica relists before it
binds, so it never decides on a view older than the previous leader's last binding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Mapping
from typing import Any

from ..aio import cancel_all
from .bind import Binder
from .events import REASON_UNANNOTATED, EventRecorder
from .httpserver import HttpServer
from .informer import Informer
from .kube import KubeApi
from .leader import LeaderElector
from .metrics import Metrics
from .server import ExtenderApp
from .view import ClusterView

log = logging.getLogger(__name__)


class Replica:
    def __init__(self, api: KubeApi, *, identity: str, policy: str = "default",
                 lease_namespace: str = "kube-system", lease_name: str = "sharegpu-extender",
                 elect: bool = True, lease_duration: float = 10.0, renew_deadline: float = 7.0,
                 retry_period: float = 2.0, check_every: float = 300.0,
                 graded_scores: bool = False) -> None:
        self.api = api
        self.identity = identity
        self.view = ClusterView(policy, graded=graded_scores)
        self.metrics = Metrics(lambda: self.view)
        self.informer = Informer(api, self.view, self.metrics, check_every=check_every)
        self.elector: LeaderElector | None = None
        if elect:
            self.elector = LeaderElector(
                api, lease_namespace, lease_name, identity, lease_duration=lease_duration,
                renew_deadline=renew_deadline, retry_period=retry_period,
                on_change=self._leader_changed)
        self._leader_synced = not elect
        self.binder = Binder(api, lambda: self.view, self.may_bind)
        self.events = EventRecorder(api, self.metrics, host=identity)
        self.view.on_unseen = self._unseen
        self.service = ExtenderApp(self.view, self.binder, self.metrics, self.events,
                                   is_ready=self.is_ready)
        self._tasks: list[asyncio.Task[None]] = []
        self._server: HttpServer | None = None
        self.port = 0

    def _unseen(self, pod: Mapping[str, Any]) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        with contextlib.suppress(RuntimeError):  # no running loop: a rebuild outside the server
            self.events.record(pod, REASON_UNANNOTATED, (
                f"holds GPU resources on node {node} but was not placed by the sharegpu "
                "extender (no scheduling decision recorded): counted against every GPU of the "
                "node until it ends; schedule GPU pods with schedulerName ack-co-scheduler"))

    # -- leadership ---------------
    def is_leader(self) -> bool:
        return self.elector is None or self.elector.is_leader()

    def may_bind(self) -> bool:
        return self.is_leader() and self._leader_synced

    def is_ready(self) -> bool:
        return self.view.synced and self.may_bind()

    def _leader_changed(self, leader: bool) -> None:
        self.metrics.leader.set(1 if leader else 0)
        self._leader_synced = False
        if leader:
            self._tasks.append(asyncio.get_running_loop().create_task(self._take_over()))

    async def _take_over(self) -> None:
        while True:
            try:
                await self.informer.relist()
                break
            except Exception as e:
                log.warning("%s: relist on taking over failed: %s", self.identity, e)
                await asyncio.sleep(0.5)
        self._leader_synced = self.is_leader()
        log.info("%s: leader with a fresh view", self.identity)

    # -- life cycle ---------------
    async def start(self, host: str = "127.0.0.1", port: int = 0,
                    ssl_context: ssl.SSLContext | None = None) -> None:
        await self.informer.start()
        if self.elector is not None:
            self._tasks.append(asyncio.create_task(self.elector.run(), name="leader-election"))
        self._server = self.service.server()
        self.port = await self._server.start(host, port, ssl_context)

    async def stop(self, graceful: bool = True) -> None:
        """``graceful=False`` stops without giving up the lease (a crash, for tests)."""
        await cancel_all(self._tasks)
        self._tasks = []
        if graceful and self.elector is not None:
            await self.elector.release()
        await self.informer.stop()
        if self._server is not None:
            await self._server.close()
            self._server = None
        await self.events.drain()
