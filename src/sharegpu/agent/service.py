"""The node agent, one per GPU node: the parts :mod:`.builder` made, started and stopped in
order, and the figures the metrics endpoint reads from them.

It finds the GPUs (NVML), labels the node with its card model, serves every GPU resource to the
kubelet (the active mode's with devices, the others with none), follows the node label
``ack.node.gpu.schedule`` live, hands each container the GPUs the scheduler chose, marks GPUs
unhealthy on critical XID events, and registers again whenever the kubelet restarts.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field

from ..core.modes import Mode
from ..kubeio.aio import cancel_all
from .advertising import Advertiser
from .allocate import AllocationError, Allocator
from .allocations import Allocations
from .config import AgentConfig
from .deviceplugins import DevicePlugins
from .devices import DeviceMap
from .draplugin import DraNode, DraPlugin
from .drapool import DraPool
from .health import HealthWatch
from .isolation import Backend
from .isolationwatch import IsolationWatch
from .nodemode import NodeMode
from .nodewatch import NodeWatch
from .nvml import Gpu, Nvml
from .plugin import DevicePlugin
from .readiness import Readiness
from .serving import ServingCondition
from .slicepublisher import SlicePublisher

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Agent:
    """The agent's parts; each was handed what it uses when it was built."""

    config: AgentConfig
    nvml: Nvml
    gpus: list[Gpu]
    devices: DeviceMap
    allocator: Allocator
    node_mode: NodeMode
    isolation: IsolationWatch
    health: HealthWatch
    plugin_set: DevicePlugins
    allocating: Allocations
    advertiser: Advertiser
    dra_pool: DraPool
    dra_node: DraNode
    node_watch: NodeWatch
    slices: SlicePublisher | None = None  # the ResourceSlice publisher (config.dra != "off")
    # the node condition GPUAgentServing (None: not published, as in --standalone tests)
    serving: ServingCondition | None = None
    _tasks: list[asyncio.Task] = field(default_factory=list, init=False, repr=False)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        os.makedirs(self.config.state_dir, exist_ok=True)
        await self.node_watch.start()
        if self.serving is not None:
            await self.serving.starting()
        await self.isolation.check(publish=False)
        await self.advertiser.refresh()
        await self.isolation.publish_condition()
        await self.plugin_set.start()
        if self.slices is not None:
            await self.slices.start()
        await self.dra_pool.sync()
        self._tasks = [
            asyncio.create_task(self.node_watch.run(), name="watch-node"),
            asyncio.create_task(self.plugin_set.watch_kubelet(), name="watch-kubelet"),
            asyncio.create_task(self.health.run(), name="watch-health"),
            asyncio.create_task(self.isolation.run(), name="watch-isolation"),
            asyncio.create_task(self.node_watch.keep_naming(), name="pod-naming"),
            asyncio.create_task(self.allocating.marks.run(), name="reconcile-marks"),
        ]
        if self.serving is not None:
            self._tasks.append(asyncio.create_task(self.serving.run(), name="serving"))
        log.info("agent on %s: %d GPU(s) %s, mode %s", self.config.node_name, len(self.gpus),
                 [g.mem_gib for g in self.gpus], self.mode)

    async def stop(self) -> None:
        """Stop serving: first say so on the node (the extender then places no more GPU pods
        here), let the pods already bound here be admitted (up to ``config.stop_drain_s``),
        then unregister the device plugins."""
        if self.serving is not None:
            await self.serving.stop()
            await self.drain(self.config.stop_drain_s)
        self.health.stop()
        await cancel_all(self._tasks)
        self._tasks = []
        self.allocating.cancel()
        await self.plugin_set.stop()
        await self.dra_pool.stop()
        if self.slices is not None:
            await self.slices.stop()
        if self.allocating.naming is not None:
            await self.allocating.naming.client.close()

    async def drain(self, timeout_s: float, every_s: float = 0.2) -> int:
        """Wait until no pod bound to this node awaits its devices (a decision, no mark), at
        most ``timeout_s``; how many still wait."""
        from .allocate import pending_candidates

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                pods = await self.allocating.pods.get()
                waiting = {c.pod_key for c in pending_candidates(pods, self.config.node_name)}
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the API is away: nothing to wait for that we can see
                log.warning("listing the node's pods before stopping failed: %s", e)
                return 0
            if not waiting or loop.time() + every_s > deadline:
                if waiting:
                    log.warning("stopping with %d pod(s) bound here not admitted yet",
                                len(waiting))
                return len(waiting)
            await asyncio.sleep(every_s)

    async def run_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    def unready(self) -> list[str]:
        """Why the kubelet cannot yet admit a GPU pod on this node through the agent (empty:
        it can). The pod's readiness probe reads it (``/readyz``), so the agent pod is Ready
        only once the kubelet has every resource's devices (and, in the DRA pool, has
        registered the DRA plugin)."""
        why = self.plugin_set.unready()
        if self.dra_active:
            p = self.dra_plugin
            if p is None or not self.dra_serving or p.registered is not True:
                why.append("the kubelet has not registered the DRA plugin yet")
        return why

    # ------------------------------------------------------------------ what the parts know
    @property
    def mode(self) -> Mode:
        return self.node_mode.mode

    @property
    def labels(self) -> dict[str, str]:
        return self.node_mode.labels

    @property
    def backend(self) -> Backend:
        return self.node_mode.backend

    @property
    def readiness(self) -> Readiness:
        return self.isolation.readiness

    @property
    def isolation_refusals(self) -> int:
        return self.isolation.refusals

    @property
    def unhealthy(self) -> set[int]:
        return self.health.unhealthy

    @property
    def plugins(self) -> dict[str, DevicePlugin]:
        return self.plugin_set.plugins

    @property
    def registrations(self) -> int:
        return self.plugin_set.registrations

    @property
    def conflicts(self) -> dict[str, list[str]]:
        return self.plugin_set.conflicts

    @property
    def allocations(self) -> int:
        return self.allocating.allocations

    @property
    def allocation_failures(self) -> int:
        return self.allocating.failures

    @property
    def pods_named(self) -> tuple[bool, int]:
        """Whether the node promised to name pods through the kubelet's pod-resources API, and
        how many Allocate and preference calls it named."""
        naming = self.allocating.naming
        return (naming is not None and naming.promised, self.allocating.named)

    @property
    def dra_plugin(self) -> DraPlugin | None:
        return self.dra_pool.plugin

    @property
    def dra_active(self) -> bool:
        """Whether this node's GPUs are served through DRA (then never by the device plugins)."""
        return self.dra_pool.active

    @property
    def dra_serving(self) -> bool:
        """Whether the DRA kubelet plugin is serving now."""
        return self.dra_pool.serving


__all__ = ["Agent", "AgentConfig", "AllocationError"]
