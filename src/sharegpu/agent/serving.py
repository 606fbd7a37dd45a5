"""The node condition ``GPUAgentServing`` (:mod:`sharegpu.core.agentserving`): written
``False`` at start, ``True`` once the kubelet has registered and listed every GPU resource the
agent serves, renewed every ``heartbeat_s`` while it runs, and ``False`` first thing on a
graceful stop, before the device plugins go, so the extender stops placing pods here before the
kubelet could refuse one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..core import agentserving as serving
from ..core import names
from .kube import KubeApi

log = logging.getLogger(__name__)

CHECK_S = 0.5  # while the answer may change (not serving yet), checked this often


class ServingCondition:
    def __init__(self, node_name: str, kube: KubeApi, unready: Callable[[], list[str]], *,
                 heartbeat_s: float = serving.HEARTBEAT_S,
                 wall: Callable[[], float] = time.time) -> None:
        """``unready``: why the kubelet cannot admit a GPU pod through the agent yet (empty:
        it can)."""
        self.node_name = node_name
        self.kube = kube
        self.unready = unready
        self.heartbeat_s = heartbeat_s
        self.wall = wall
        self.serving: bool | None = None  # as last written
        self.stopping = False
        self._since = 0.0  # when the status last changed
        self._sent_at = 0.0  # monotonic time of the last write

    async def publish(self, ok: bool, reason: str, message: str) -> bool:
        """Write the condition now; whether it was written."""
        now = self.wall()
        if ok != self.serving:
            self._since = now
        cond = serving.condition(ok, reason, message, now=now, since=self._since)
        try:
            await self.kube.patch_node_condition(self.node_name, cond)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("node condition %s not written: %s", names.CONDITION_AGENT_SERVING, e)
            return False
        if ok != self.serving:
            (log.info if ok else log.warning)("node %s: %s=%s (%s)", self.node_name,
                                              names.CONDITION_AGENT_SERVING, ok, message)
        self.serving = ok
        self._sent_at = time.monotonic()
        return True

    async def starting(self) -> None:
        await self.publish(False, serving.REASON_STARTING,
                           "the agent is starting: its device plugins are not registered yet")

    async def tick(self) -> None:
        """Publish the current answer when it changed or the heartbeat is due."""
        if self.stopping:
            return
        why = self.unready()
        ok = not why
        due = time.monotonic() - self._sent_at >= self.heartbeat_s
        if ok != self.serving or due:
            if ok:
                await self.publish(True, serving.REASON_SERVING,
                                   "the kubelet has registered and listed every GPU resource "
                                   "the agent serves")
            else:
                await self.publish(False, serving.REASON_STARTING, "; ".join(why))

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("node condition %s: %s", names.CONDITION_AGENT_SERVING, e)
            await asyncio.sleep(CHECK_S if not self.serving else
                                min(CHECK_S * 4, self.heartbeat_s))

    async def stop(self, timeout_s: float = 3.0) -> None:
        """Say the agent no longer serves (a graceful stop), within ``timeout_s``."""
        self.stopping = True
        try:
            await asyncio.wait_for(
                self.publish(False, serving.REASON_STOPPING,
                             "the agent is stopping (its device plugins go next)"), timeout_s)
        except TimeoutError:
            log.warning("node condition %s not written within %.0fs of the stop",
                        names.CONDITION_AGENT_SERVING, timeout_s)


__all__ = ["ServingCondition"]
