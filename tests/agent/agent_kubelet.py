"""A test kubelet: the kubelet's side of the device-plugin protocol over real gRPC on unix sockets.

It serves ``Registration`` on ``kubelet.sock``; on each registration it dials the plugin's socket,
asks for its options and follows ``ListAndWatch``. ``restart()`` behaves like a kubelet restart:
the socket goes away with every plugin socket in the directory, then ``kubelet.sock`` comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import grpc

from sharegpu.agent.proto import api_pb2 as pb
from sharegpu.agent.proto import api_pb2_grpc as pb_grpc
from sharegpu.agent.proto import podresources_v1_pb2 as pr
from sharegpu.agent.proto import podresources_v1_pb2_grpc as pr_grpc


class TestKubelet(pb_grpc.RegistrationServicer):
    __test__ = False

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.devices: dict[str, list[tuple[str, str]]] = {}  # resource -> [(id, health)]
        self.registrations: list[tuple[float, str, str]] = []  # (time, resource, endpoint)
        self.endpoints: dict[str, str] = {}
        self._server: grpc.aio.Server | None = None
        self._watchers: list[asyncio.Task] = []
        self._channels: list[grpc.aio.Channel] = []

    @property
    def socket(self) -> str:
        return os.path.join(self.dir, "kubelet.sock")

    async def start(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server

    async def stop(self, wipe: bool = True) -> None:
        for t in self._watchers:
            t.cancel()
        for t in self._watchers:
            with contextlib.suppress(BaseException):
                await t
        self._watchers = []
        for ch in self._channels:
            await ch.close()
        self._channels = []
        if self._server is not None:
            await self._server.stop(grace=0)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        if wipe:  # the kubelet removes every socket in the directory when it starts
            for f in os.listdir(self.dir):
                if f.endswith(".sock"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.dir, f))
        self.devices.clear()
        self.endpoints.clear()

    async def restart(self) -> None:
        await self.stop(wipe=True)
        await asyncio.sleep(0.05)
        await self.start()

    # --- Registration service ---
    async def Register(self, request, context):  # type: ignore[no-untyped-def]
        assert request.version == "v1beta1"
        self.registrations.append((time.monotonic(), request.resource_name, request.endpoint))
        self.endpoints[request.resource_name] = request.endpoint
        self._watchers.append(
            asyncio.get_running_loop().create_task(
                self._follow(request.resource_name, request.endpoint)
            )
        )
        return pb.Empty()

    def _stub(self, endpoint: str) -> pb_grpc.DevicePluginStub:
        ch = grpc.aio.insecure_channel(f"unix://{os.path.join(self.dir, endpoint)}")
        self._channels.append(ch)
        return pb_grpc.DevicePluginStub(ch)

    async def _follow(self, resource: str, endpoint: str) -> None:
        stub = self._stub(endpoint)
        opts = await stub.GetDevicePluginOptions(pb.Empty())
        assert opts.get_preferred_allocation_available
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for resp in stub.ListAndWatch(pb.Empty()):
                self.devices[resource] = [(d.ID, d.health) for d in resp.devices]

    # --- what tests call ---
    def count(self, resource: str) -> int:
        return len(self.devices.get(resource, []))

    def healthy(self, resource: str) -> list[str]:
        return [i for i, h in self.devices.get(resource, []) if h == "Healthy"]

    def stub(self, resource: str) -> pb_grpc.DevicePluginStub:
        return self._stub(self.endpoints[resource])

    async def preferred(
        self, resource: str, available: list[str], size: int, must: list[str] | None = None
    ) -> list[str]:
        resp = await self.stub(resource).GetPreferredAllocation(
            pb.PreferredAllocationRequest(container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must or [],
                    allocation_size=size,
                )
            ])
        )
        return list(resp.container_responses[0].deviceIDs)

    async def allocate(self, resource: str, ids: list[str]) -> pb.ContainerAllocateResponse:
        resp = await self.stub(resource).Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        )
        return resp.container_responses[0]


async def wait_until(predicate, timeout: float = 5.0, step: float = 0.02) -> float:  # type: ignore[no-untyped-def]
    """Seconds it took ``predicate()`` to hold; AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(step)


class TestPodResources(pr_grpc.PodResourcesListerServicer):
    """The kubelet's pod-resources API (``v1.PodResourcesLister.List``) on a unix socket: the
    pods the test says the kubelet's pod manager holds, with each container's devices."""

    __test__ = False

    def __init__(self, socket: str) -> None:
        self.socket = socket
        # (namespace, name) -> container name -> resource -> device IDs
        self.pods: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
        self.lists = 0
        self._server: grpc.aio.Server | None = None

    def admit(self, pod: dict) -> None:
        """The kubelet adds ``pod`` to its pod manager (its containers hold no devices yet)."""
        m = pod["metadata"]
        self.pods[(m.get("namespace", "default"), m["name"])] = {
            c["name"]: {} for c in pod["spec"]["containers"]}

    def record(self, pod: dict, container: str, resource: str, ids: list[str]) -> None:
        """The device manager recorded what the plugin's Allocate answered for."""
        m = pod["metadata"]
        self.pods[(m.get("namespace", "default"), m["name"])][container][resource] = list(ids)

    async def List(self, request, context):  # type: ignore[no-untyped-def]
        self.lists += 1
        return pr.ListPodResourcesResponse(pod_resources=[
            pr.PodResources(namespace=ns, name=name, containers=[
                pr.ContainerResources(name=c, devices=[
                    pr.ContainerDevices(resource_name=r, device_ids=ids)
                    for r, ids in held.items()])
                for c, held in containers.items()])
            for (ns, name), containers in self.pods.items()])

    async def start(self) -> None:
        server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
