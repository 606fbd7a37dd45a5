"""GPU health: a GPU is unhealthy from its first critical XID event until it answers NVML again
after ``recover_after_s`` without one. Watched on a thread (NVML's event wait blocks)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from .nvml import Nvml

log = logging.getLogger(__name__)


class HealthWatch:
    def __init__(self, nvml: Nvml, gpu_count: int, *, poll_s: float, recover_after_s: float,
                 on_change: Callable[[], Awaitable[None]]) -> None:
        self.nvml = nvml
        self.gpu_count = gpu_count
        self.poll_s = poll_s
        self.recover_after_s = recover_after_s
        self.on_change = on_change  # run on the agent's loop when the set changes
        self.unhealthy: set[int] = set()  # GPU indexes; replaced, never mutated in place
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._loop_thread)

    def stop(self) -> None:
        self._stop.set()

    def _loop_thread(self) -> None:
        last_xid: dict[int, float] = {}
        while not self._stop.is_set():
            try:
                ev = self.nvml.wait_event(self.poll_s)
            except Exception as e:
                log.warning("NVML event wait failed: %s", e)
                time.sleep(self.poll_s)
                ev = None
            changed = False
            if ev is not None and ev.critical and 0 <= ev.gpu < self.gpu_count:
                log.error("GPU %d: critical XID %d: marking its devices unhealthy", ev.gpu, ev.xid)
                last_xid[ev.gpu] = time.monotonic()
                if ev.gpu not in self.unhealthy:
                    self.unhealthy = self.unhealthy | {ev.gpu}
                    changed = True
            for g in sorted(self.unhealthy):
                quiet = time.monotonic() - last_xid.get(g, 0.0) >= self.recover_after_s
                if quiet and self.nvml.responsive(g):
                    log.info("GPU %d answers again and had no XID for %.0fs: healthy", g,
                             self.recover_after_s)
                    self.unhealthy = self.unhealthy - {g}
                    changed = True
            if changed and self._loop is not None and not self._stop.is_set():
                fut = asyncio.run_coroutine_threadsafe(self.on_change(), self._loop)
                with contextlib.suppress(Exception):
                    fut.result(timeout=5)
