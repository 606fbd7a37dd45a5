"""The agent's side of the Node object: read at start (waiting for the API server), labelled
with the card model, sizes, link matrix and remembered mode, then watched: a new
``ack.node.gpu.schedule`` switches the mode live, a new DRA pool label moves the GPUs between
the device plugins and DRA."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence

from ..core import names
from ..core.modes import card_model_labels
from .advertising import Advertiser
from .drapool import DraPool
from .isolationwatch import IsolationWatch
from .kube import KubeApi
from .nodemode import NodeMode
from .nvml import Gpu, Nvml
from .podresources import PodNaming

log = logging.getLogger(__name__)


class NodeWatch:
    def __init__(self, node_name: str, kube: KubeApi, nvml: Nvml, gpus: Sequence[Gpu],
                 node_mode: NodeMode, isolation: IsolationWatch, advertiser: Advertiser,
                 dra_pool: DraPool, naming: PodNaming | None = None) -> None:
        self.node_name = node_name
        self.kube = kube
        self.nvml = nvml
        self.gpus = gpus
        self.node_mode = node_mode
        self.isolation = isolation
        self.advertiser = advertiser
        self.dra_pool = dra_pool
        self.naming = naming

    async def start(self) -> None:
        """Read the node, settle the mode, and publish what the agent knows of the GPUs."""
        node = await self._get_node()
        nm = self.node_mode
        nm.labels = dict((node.get("metadata") or {}).get("labels") or {})
        nm.mode = nm.initial(node)
        nm.write_current()
        await self._decide_naming(node)
        await self._publish_node(explicit=nm.label_mode() is not None)

    async def _decide_naming(self, node: Mapping) -> None:
        if self.naming is None:
            return
        version = str(((node.get("status") or {}).get("nodeInfo") or {})
                      .get("kubeletVersion") or "")
        if await self.naming.decide(version):
            log.info("node %s: the kubelet's pod-resources API names each pod it admits; "
                     "look-alike pods may start together", self.node_name)
        else:
            log.warning("node %s: pods are not named through the kubelet's pod-resources API "
                        "(%s); look-alike pods start one placement at a time",
                        self.node_name, self.naming.why_not)

    async def _get_node(self) -> dict:
        """The node object, waiting for the API server (an agent that crashes while the API is
        away would only restart into the same wait)."""
        delay = 0.5
        while True:
            try:
                return await self.kube.get_node(self.node_name)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("reading node %s failed (%s); retrying in %.1fs",
                            self.node_name, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def _publish_node(self, *, explicit: bool) -> None:
        """Card-model labels, per-GPU sizes, link matrix and the remembered mode on the node."""
        nm = self.node_mode
        if explicit:
            nm.remember(nm.mode)
        labels: dict[str, str | None] = {}
        annotations: dict[str, str | None] = {
            names.ANN_NODE_GPU_MEM: ",".join(str(g.mem_gib) for g in self.gpus),
        }
        if explicit or nm.remembered:
            annotations[names.ANN_NODE_LAST_MODE] = nm.mode.value
        promised = self.naming is not None and self.naming.promised
        annotations[names.ANN_NODE_POD_RESOURCES] = "v1" if promised else None
        if self.gpus:
            first = self.gpus[0]
            labels.update(card_model_labels(first.name, first.mem_mib, len(self.gpus)))
            try:
                links = self.nvml.links()
            except Exception:  # NVML without topology support
                links = None
            if links:
                annotations[names.ANN_NODE_GPU_TOPOLOGY] = json.dumps(links)
        await self.kube.patch_node_metadata(self.node_name, labels=labels,
                                            annotations=annotations)

    async def set_labels(self, labels: Mapping[str, str]) -> None:
        """React to the node's labels (from the watch)."""
        nm, pool = self.node_mode, self.dra_pool
        dra_before = pool.active
        nm.labels = dict(labels)
        if pool.active != dra_before:
            log.info("node %s: GPUs served through %s", self.node_name,
                     "DRA (ResourceSlice)" if pool.active else "device plugins")
            await self.advertiser.refresh()
            try:
                await pool.sync()
            except Exception as e:  # directories not writable: logged, the label may move again
                log.error("node %s: the DRA kubelet plugin could not be %s: %s",
                          self.node_name, "started" if pool.active else "stopped", e)
        explicit = nm.label_mode()
        if explicit is None or explicit == nm.mode:
            if explicit is not None and not nm.remembered:
                nm.remember(explicit)
            return
        log.info("node %s: mode %s -> %s", self.node_name, nm.mode, explicit)
        nm.mode = explicit
        nm.remember(explicit)
        nm.write_current()
        await self.kube.patch_node_metadata(
            self.node_name, annotations={names.ANN_NODE_LAST_MODE: explicit.value}
        )
        await self.isolation.check(publish=False)
        await self.advertiser.refresh()
        await self.isolation.publish_condition()

    async def keep_naming(self, every_s: float = 15.0) -> None:
        """Until the node promised to name pods, try again (the kubelet's pod-resources socket
        may come up after the agent), and publish the promise once made."""
        while self.naming is not None and not self.naming.promised:
            await asyncio.sleep(every_s)
            try:
                node = await self.kube.get_node(self.node_name)
                await self._decide_naming(node)
                if self.naming.promised:
                    await self.kube.patch_node_metadata(
                        self.node_name, annotations={names.ANN_NODE_POD_RESOURCES: "v1"})
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("node %s: deciding on pod naming failed: %s", self.node_name, e)

    async def run(self) -> None:
        """Follow the node's labels, re-watching with back-off when the watch breaks."""
        backoff = 0.5
        while True:
            try:
                async for node in self.kube.watch_node(self.node_name):
                    backoff = 0.5
                    await self.set_labels((node.get("metadata") or {}).get("labels") or {})
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("node watch failed (%s); retrying in %.1fs", e, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
