"""Another device plugin serving this node's GPUs (NVIDIA's device plugin, the GPU Operator's,
a cloud's): two plugins for ``nvidia.com/gpu`` displace each other, since the kubelet keeps the
last registration for a resource. Before it registers ``nvidia.com/gpu``, the agent looks at
every other socket in the device-plugin directory, asks it for its devices (ListAndWatch, first
answer) and treats it as a GPU plugin when a device ID names one of this node's GPU UUIDs (as
NVIDIA's do: ``GPU-…``, ``GPU-…::N`` for time-slicing replicas). The agent then leaves
``nvidia.com/gpu`` to it; its shared resources have names no other plugin uses."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from .proto import api_pb2 as pb
from .proto import api_pb2_grpc as pb_grpc

KUBELET_SOCKET = "kubelet.sock"


@dataclass(frozen=True)
class ForeignPlugin:
    socket: str
    devices: int  # devices it lists that name one of this node's GPUs


def _sockets(directory: str, own: Iterable[str]) -> list[str]:
    mine = {KUBELET_SOCKET, *own}
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        if name in mine:
            continue
        try:
            if stat.S_ISSOCK(os.stat(os.path.join(directory, name)).st_mode):
                out.append(name)
        except OSError:
            continue
    return out


async def _devices(path: str, timeout_s: float) -> list[str] | None:
    """The device IDs of the plugin on ``path`` (its first ListAndWatch answer), or ``None``
    when it does not answer (a stale socket)."""
    try:
        async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
            stream = pb_grpc.DevicePluginStub(ch).ListAndWatch(pb.Empty(), timeout=timeout_s)
            async for resp in stream:
                stream.cancel()
                return [d.ID for d in resp.devices]
    except (TimeoutError, grpc.aio.AioRpcError, OSError):
        return None
    return []


async def gpu_plugins(directory: str, own: Iterable[str], uuids: Iterable[str],
                      timeout_s: float = 2.0) -> list[ForeignPlugin]:
    """Other plugins in ``directory`` that serve one of the GPUs ``uuids``."""
    wanted = [u for u in uuids if u]
    found = []
    for name in _sockets(directory, own):
        ids = await _devices(os.path.join(directory, name), timeout_s)
        if not ids:
            continue
        hits = sum(1 for i in ids if any(u in i for u in wanted))
        if hits:
            found.append(ForeignPlugin(name, hits))
    return found
