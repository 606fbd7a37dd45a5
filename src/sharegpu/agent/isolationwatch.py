"""Whether the node's isolation back-end is usable, kept current: checked at start, on a mode
change, every few seconds and before an allocation when it was unusable; published as the node
condition ``GPUIsolationReady``; and turned into the fail-closed guard every grant passes."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from ..core import names
from .allocate import Allocator, Candidate, Guard, IsolationUnavailable
from .config import AgentConfig
from .isolation import Backend
from .kube import KubeApi
from .nodemode import NodeMode
from .readiness import (
    HAMI_FIX,
    READY_NONE,
    Readiness,
    check_hami,
    check_hami_mps,
    check_mps,
    write_preload_list,
)

log = logging.getLogger(__name__)

CONDITION_ISOLATION = names.CONDITION_ISOLATION


class IsolationWatch:
    def __init__(self, config: AgentConfig, node_mode: NodeMode, allocator: Allocator,
                 kube: KubeApi, on_change: Callable[[], Awaitable[None]]) -> None:
        self.config = config
        self.node_mode = node_mode
        self.allocator = allocator  # its isolation settings follow the installed library
        self.kube = kube
        self.on_change = on_change  # the advertised devices follow the answer
        self.readiness: Readiness = READY_NONE
        self.refusals = 0  # containers refused for want of a usable back-end
        self._checked_at = 0.0
        self._lock = asyncio.Lock()
        self._condition_sent: tuple[str, str] | None = None

    def hami_library(self) -> tuple[str, str | None]:
        """The HAMi-core library the agent hands out, or why there is none: the path the chart's
        init container recorded (``hami_installed``), else the configured path."""
        pointer = self.config.hami_installed
        if not pointer:
            return self.config.isolation_paths.hami_library, None
        try:
            with open(pointer) as f:
                path = f.read().strip()
        except OSError:
            return "", (f"the HAMi-core library was not installed: {pointer} (written by the "
                        "chart's hami-install init container) does not exist")
        if not os.path.isabs(path):
            return "", f"{pointer} does not name an absolute path to the library ({path!r})"
        return path, None

    def _check_now(self, backend: Backend) -> Readiness:
        if backend is Backend.HAMI:
            return self._check_hami()
        if backend is Backend.MPS:
            return check_mps(self.config.isolation_paths.mps_pipe_dir, self.config.mps_control)
        if backend is Backend.HAMI_MPS:
            return check_hami_mps(self._check_hami(), self.config.isolation_paths.mps_pipe_dir,
                                  self.config.mps_control)
        return READY_NONE

    def _check_hami(self) -> Readiness:
        """HAMi-core's part: the library (where the chart installed it), the preload list."""
        path, problem = self.hami_library()
        if problem:
            return Readiness(Backend.HAMI, False, problem, HAMI_FIX)
        if path != self.allocator.isolation.hami_library:
            self.allocator.isolation = replace(self.allocator.isolation, hami_library=path)
        problem = write_preload_list(self.allocator.isolation.hami_preload_file)
        if problem:
            return Readiness(Backend.HAMI, False, problem,
                             f"make {self.config.state_dir} (--state-dir, the chart's "
                             "agent.stateDir) a writable host directory")
        return check_hami(path, load=self.config.load_check)

    async def check(self, *, publish: bool = True) -> Readiness:
        """Check the node's back-end now; on a change, withhold or restore the isolated
        resources and update the node condition."""
        async with self._lock:
            backend = self.node_mode.backend
            r = await asyncio.to_thread(self._check_now, backend)
            self._checked_at = time.monotonic()
            changed = r != self.readiness
            if changed:
                (log.info if r.ready else log.error)("%s", r.message(self.config.node_name))
            self.readiness = r
        if changed and publish:
            await self.on_change()
            await self.publish_condition()
        return r

    async def run(self) -> None:
        """Check again every ``isolation_check_s``."""
        while True:
            await asyncio.sleep(self.config.isolation_check_s)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the check itself broke: keep the last answer
                log.warning("isolation check failed: %s", e)

    async def current(self) -> Readiness:
        """The back-end's state for an allocation: checked again when it was unusable (it may
        be back) or when the node's back-end changed, at most once a second."""
        r = self.readiness
        stale = time.monotonic() - self._checked_at > 1.0
        if r.backend != self.node_mode.backend or (not r.ready and stale):
            r = await self.check()
        return r

    async def guard(self) -> Guard:
        """The fail-closed check of the node's back-end as it is now (checked again when it
        was unusable): call it with the back-end a container is about to get."""
        return self.guard_for(await self.current())

    def guard_for(self, readiness: Readiness) -> Guard:
        """Refuses a container the back-end ``readiness`` describes cannot isolate (also one
        for another back-end: :meth:`current` checked the node's own)."""
        def guard(backend: Backend, c: Candidate) -> None:
            if not (readiness.backend is backend and readiness.ready):
                raise IsolationUnavailable(readiness.message(self.config.node_name), c)

        return guard

    async def publish_condition(self) -> None:
        r = self.readiness
        if r.backend is Backend.NONE:
            status, reason = "True", "NotIsolated"
            msg = f"mode {self.node_mode.mode.value}: no isolation back-end (scheduling only)"
        elif r.ready:
            status, reason, msg = "True", "BackendReady", r.message(self.config.node_name)
        else:
            status, reason, msg = "False", "BackendUnusable", r.message(self.config.node_name)
        if self._condition_sent == (status, msg):
            return
        cond = {"type": CONDITION_ISOLATION, "status": status, "reason": reason,
                "message": msg[:1024]}
        try:
            await self.kube.patch_node_condition(self.config.node_name, cond)
            self._condition_sent = (status, msg)
        except Exception as e:
            log.warning("node condition %s not written: %s", CONDITION_ISOLATION, e)
