"""Whether the node is in the DRA pool (then its GPUs are served through a ResourceSlice and
never by the device plugins), and the DRA kubelet plugin served while it is, and only then."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from .draplugin import DraPlugin

log = logging.getLogger(__name__)


class DraPool:
    def __init__(self, dra: str, label: tuple[str, str], labels: Callable[[], Mapping[str, str]],
                 plugin: DraPlugin | None, node_name: str) -> None:
        self.dra = dra  # "off", "on" or "label"
        self.label = label
        self.labels = labels  # the node's labels as they are now
        self.plugin = plugin  # the DRA kubelet plugin, or None
        self.node_name = node_name
        self.serving = False
        self._lock = asyncio.Lock()

    @property
    def active(self) -> bool:
        """Whether this node's GPUs are served through DRA."""
        if self.dra == "label":
            key, value = self.label
            return self.labels().get(key) == value
        return self.dra == "on"

    async def sync(self) -> None:
        """Serve the DRA kubelet plugin while the node is in the DRA pool, and only then: its
        registration socket appears in (and leaves) the kubelet's plugins_registry with the pool
        label. Prepared claims stay recorded while it is stopped (drain before moving a node)."""
        p = self.plugin
        if p is None:
            return
        async with self._lock:
            if self.active and not self.serving:
                await p.start()
                self.serving = True
            elif not self.active and self.serving:
                await p.stop()
                self.serving = False
                log.info("DRA plugin %s stopped: node %s left the DRA pool", p.config.endpoint,
                         self.node_name)

    async def stop(self) -> None:
        if self.plugin is not None and self.serving:
            await self.plugin.stop()
            self.serving = False
