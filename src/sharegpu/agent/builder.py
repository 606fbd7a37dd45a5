"""The agent's composition root: builds every part from the settings, the GPUs (NVML) and the
API client, and hands each exactly the parts it uses. Nothing else wires parts together."""

from __future__ import annotations

import os
from dataclasses import replace

from .advertising import Advertiser
from .allocate import Allocator, Candidate, Grant, Guard, IsolationUnavailable
from .allocations import Allocations
from .config import AgentConfig
from .deviceplugins import DevicePlugins
from .devices import DeviceMap
from .draplugin import DraNode, DraPlugin
from .drapool import DraPool
from .freshpods import FreshPods
from .health import HealthWatch
from .isolation import PRELOAD_FILE
from .isolationwatch import IsolationWatch
from .kube import KubeApi
from .nodemode import NodeMode
from .nodewatch import NodeWatch
from .nvml import Nvml
from .podresources import PodNaming, PodResources
from .service import Agent
from .serving import ServingCondition
from .slicepublisher import SlicePublisher


def build_agent(config: AgentConfig, nvml: Nvml, kube: KubeApi,
                slices: SlicePublisher | None = None) -> Agent:
    """The node agent for ``config``, not started; ``slices`` publishes the ResourceSlice
    (``config.dra`` other than "off")."""
    node = config.node_name
    gpus = [replace(g, reserve_mib=config.reserve_mib) for g in nvml.gpus()]
    devices = DeviceMap(gpus)
    # the preload list lives in the agent's state directory (a host directory it writes)
    allocator = Allocator(node, devices, isolation=replace(
        config.isolation_paths,
        hami_preload_file=os.path.join(config.state_dir, PRELOAD_FILE)))
    node_mode = NodeMode(node, config.state_dir, config.isolation, config.core_mem_isolation)

    # isolation and health changes re-advertise; the advertiser reads both (built below)
    async def readvertise() -> None:
        await advertiser.refresh()

    isolation = IsolationWatch(config, node_mode, allocator, kube, on_change=readvertise)
    health = HealthWatch(nvml, len(gpus), poll_s=config.health_poll_s,
                         recover_after_s=config.recover_after_s, on_change=readvertise)
    naming = (PodNaming(PodResources(config.pod_resources_socket))
              if config.pod_resources_socket else None)
    allocating = Allocations(node, allocator, FreshPods(kube, node), node_mode, isolation, kube,
                             retries=config.allocate_retries, retry_s=config.allocate_retry_s,
                             naming=naming)
    plugin_set = DevicePlugins(config.device_plugin_dir, allocating, node_name=node,
                               gpu_uuids=[g.uuid for g in gpus], kube=kube,
                               poll_s=config.kubelet_poll_s)

    def grant(c: Candidate, guard: Guard) -> Grant:
        try:
            return allocator.grant(c, node_mode.backend, node_mode.labels, guard)
        except IsolationUnavailable:
            isolation.refusals += 1
            raise

    dra_node = DraNode(node_name=node, state_dir=config.state_dir, gpus=gpus,
                       read_claim=lambda ns, name: kube.get_resource_claim(ns, name),
                       isolation_guard=isolation.guard,
                       grant=grant, open_dirs=(config.isolation_paths.hami_lock_dir,))
    dra_plugin = (DraPlugin(dra_node, config.dra_plugin)
                  if config.dra != "off" and config.dra_plugin is not None else None)
    dra_pool = DraPool(config.dra, config.dra_label, lambda: node_mode.labels, dra_plugin, node)
    advertiser = Advertiser(gpus, nvml, plugin_set.plugins, slices, node_mode, isolation, health,
                            dra_active=lambda: dra_pool.active)
    node_watch = NodeWatch(node, kube, nvml, gpus, node_mode, isolation, advertiser, dra_pool,
                           naming)
    agent = Agent(config=config, nvml=nvml, gpus=gpus, devices=devices, allocator=allocator,
                  node_mode=node_mode, isolation=isolation, health=health,
                  plugin_set=plugin_set, allocating=allocating, advertiser=advertiser,
                  dra_pool=dra_pool, dra_node=dra_node, node_watch=node_watch, slices=slices)
    # the node condition GPUAgentServing follows the agent's readiness
    agent.serving = ServingCondition(node, kube, agent.unready, heartbeat_s=config.heartbeat_s)
    return agent
