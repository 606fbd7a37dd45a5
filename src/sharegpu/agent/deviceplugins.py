"""The agent's device plugins, one per GPU resource, and their life with the kubelet: started
in the device-plugin directory, registered on ``kubelet.sock``, registered again (servers
restarted) whenever the kubelet re-creates its socket; ``nvidia.com/gpu`` is left to another
plugin that already serves this node's GPUs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence

from ..core import names
from .conflicts import gpu_plugins
from .devices import SOCKETS
from .kube import KubeApi
from .plugin import KUBELET_SOCKET, Backend, DevicePlugin

log = logging.getLogger(__name__)

EVENT_CONFLICT = "GPUDevicePluginConflict"  # Warning event on the node


class DevicePlugins:
    def __init__(self, directory: str, backend: Backend, *, node_name: str,
                 gpu_uuids: Sequence[str], kube: KubeApi, poll_s: float) -> None:
        self.directory = directory
        self.node_name = node_name
        self.gpu_uuids = list(gpu_uuids)
        self.kube = kube  # for the conflict event
        self.poll_s = poll_s
        self.plugins = {r: DevicePlugin(r, sock, backend) for r, sock in SOCKETS.items()}
        self.registrations = 0  # registration rounds completed (tests and metrics read it)
        self.conflicts: dict[str, list[str]] = {}  # resource -> other plugins' sockets

    async def start(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for p in self.plugins.values():
            await p.start(self.directory)
        await self.register_all()

    async def stop(self) -> None:
        for p in self.plugins.values():
            await p.stop()

    async def _foreign_gpu_plugins(self) -> list[str]:
        """Other device plugins in the directory serving this node's GPUs (see
        :mod:`.conflicts`): the agent then leaves ``nvidia.com/gpu`` to them."""
        found = await gpu_plugins(self.directory, SOCKETS.values(), self.gpu_uuids)
        names_ = sorted(f.socket for f in found)
        if names_ != self.conflicts.get(names.RES_NVIDIA_GPU, []):
            if names_:
                msg = (f"another device plugin serves this node's GPUs ({', '.join(names_)} in "
                       f"{self.directory}): sharegpu does not register "
                       f"{names.RES_NVIDIA_GPU} here (the kubelet keeps one plugin per "
                       "resource); its shared resources are unaffected. To let sharegpu serve "
                       "whole GPUs too, turn that plugin off on this node (GPU Operator: label "
                       "the node nvidia.com/gpu.deploy.device-plugin=false)")
                log.error("%s", msg)
                with contextlib.suppress(Exception):
                    await self.kube.create_node_event(
                        self.node_name, reason=EVENT_CONFLICT, message=msg)
            else:
                log.info("no other device plugin serves this node's GPUs any more")
        if names_:
            self.conflicts[names.RES_NVIDIA_GPU] = names_
        else:
            self.conflicts.pop(names.RES_NVIDIA_GPU, None)
        return names_

    async def register_all(self) -> bool:
        d = self.directory
        if not os.path.exists(os.path.join(d, KUBELET_SOCKET)):
            return False
        ok = True
        foreign = await self._foreign_gpu_plugins()
        for p in self.plugins.values():
            if foreign and p.resource == names.RES_NVIDIA_GPU:
                continue  # left to the other plugin
            try:
                await p.register(d)
            except Exception as e:  # kubelet not answering yet: the watch retries
                log.warning("register %s with the kubelet failed: %s", p.resource, e)
                ok = False
        if ok:
            self.registrations += 1
        return ok

    def unready(self) -> list[str]:
        """Why the kubelet cannot admit a pod for this node's GPU resources yet (empty: it
        can): a resource not registered, or whose device list the kubelet has not received
        since its plugin (re)started."""
        if not self.registrations:
            return ["the device plugins have not registered with the kubelet yet"]
        skipped = names.RES_NVIDIA_GPU if self.conflicts.get(names.RES_NVIDIA_GPU) else None
        return [f"the kubelet has not listed {p.resource}'s devices yet"
                for p in self.plugins.values() if p.resource != skipped and not p.listed]

    def _kubelet_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.directory, KUBELET_SOCKET))
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    async def watch_kubelet(self) -> None:
        """Register again when the kubelet re-creates its socket (a kubelet restart also wipes
        our sockets, so the servers are restarted too)."""
        d = self.directory
        seen = self._kubelet_id() if self.registrations else None
        while True:
            await asyncio.sleep(self.poll_s)
            now = self._kubelet_id()
            missing = [p for p in self.plugins.values()
                       if not os.path.exists(os.path.join(d, p.socket_name))]
            if now is None:
                seen = None
                continue
            if now == seen and not missing:
                continue
            log.info("kubelet socket (re)appeared: registering every resource again")
            for p in self.plugins.values():
                if p in missing or now != seen:
                    await p.stop()
                    await p.start(d)
                    await p.set_devices(p.devices)
            if await self.register_all():
                seen = now
