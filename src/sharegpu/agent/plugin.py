"""One kubelet device plugin per extended resource: an async gRPC server on a unix socket in the
kubelet's device-plugin directory, registered with the kubelet on ``kubelet.sock``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc

from .allocate import AllocationError, Grant
from .devices import HEALTHY, UNHEALTHY, Device
from .proto import api_pb2 as pb
from .proto import api_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


class Backend(Protocol):
    """What a plugin asks the agent for."""

    async def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]: ...

    async def allocate(self, resource: str, device_ids: Sequence[str]) -> Grant: ...


class DevicePlugin(pb_grpc.DevicePluginServicer):
    def __init__(self, resource: str, socket_name: str, backend: Backend) -> None:
        self.resource = resource
        self.socket_name = socket_name
        self.backend = backend
        self._devices: list[Device] = []
        self._version = 0
        self._changed = asyncio.Condition()
        self._server: grpc.aio.Server | None = None
        self._closing = False
        # whether the kubelet has this server's device list: a ListAndWatch answer was written
        # since the server (re)started
        self.listed = False

    # --- device list ---
    @property
    def devices(self) -> list[Device]:
        return list(self._devices)

    async def set_devices(self, devices: Sequence[Device]) -> None:
        devices = list(devices)
        if devices == self._devices:
            return
        async with self._changed:
            self._devices = devices
            self._version += 1
            self._changed.notify_all()

    # --- gRPC service ---
    async def GetDevicePluginOptions(self, request, context):  # type: ignore[no-untyped-def]
        return pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    async def ListAndWatch(self, request, context) -> AsyncIterator[pb.ListAndWatchResponse]:  # type: ignore[no-untyped-def]
        seen = -1
        while not self._closing:
            async with self._changed:
                if seen == self._version:
                    await self._changed.wait()
                if self._closing:
                    return
                seen = self._version
                devices = list(self._devices)
            yield pb.ListAndWatchResponse(
                devices=[pb.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY)
                         for d in devices]
            )
            self.listed = True  # resumed once the answer is written

    async def GetPreferredAllocation(self, request, context):  # type: ignore[no-untyped-def]
        out = []
        for r in request.container_requests:
            ids = await self.backend.preferred(
                self.resource, list(r.available_deviceIDs), list(r.must_include_deviceIDs),
                int(r.allocation_size),
            )
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=out)

    async def Allocate(self, request, context):  # type: ignore[no-untyped-def]
        out = []
        for r in request.container_requests:
            try:
                g = await self.backend.allocate(self.resource, list(r.devices_ids))
            except AllocationError as e:
                log.error("%s: Allocate refused: %s", self.resource, e)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
                raise  # unreachable: abort raises
            out.append(
                pb.ContainerAllocateResponse(
                    envs=g.env.envs,
                    mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path,
                                     read_only=m.read_only) for m in g.env.mounts],
                    annotations=g.annotations,
                )
            )
        return pb.AllocateResponse(container_responses=out)

    async def PreStartContainer(self, request, context):  # type: ignore[no-untyped-def]
        return pb.PreStartContainerResponse()

    # --- lifecycle ---
    async def start(self, directory: str) -> None:
        path = os.path.join(directory, self.socket_name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._closing = False
        self.listed = False
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        self._closing = True
        async with self._changed:
            self._changed.notify_all()
        if self._server is not None:
            await self._server.stop(grace=0.2)
            self._server = None

    async def register(self, directory: str, timeout_s: float = 5.0) -> None:
        path = os.path.join(directory, KUBELET_SOCKET)
        async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
            stub = pb_grpc.RegistrationStub(ch)
            await stub.Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket_name,
                    resource_name=self.resource,
                    options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
                ),
                timeout=timeout_s,
            )
