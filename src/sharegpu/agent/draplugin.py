"""The agent's DRA kubelet plugin: the kubelet's ``v1.DRAPlugin`` service over gRPC on a unix
socket, announced through the kubelet's plugin registration (``pluginregistration/v1``).

``NodePrepareResources`` reads each named ResourceClaim, gives each of its requests exactly
what Allocate gives a container in device-plugin mode (through the node's fail-closed isolation
guard), writes that as the claim's CDI spec (:mod:`.claimfiles`) and answers CDI device IDs;
a prepared claim is answered again from the checkpoint. Each claim of a call gets its own
answer or its own error. It reaches the rest of the agent only through :class:`DraNode`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ..core.errors import ShareGpuError, ValidationError
from ..dra import driver as dra
from .allocate import Candidate, Grant, Guard
from .claimfiles import ClaimFiles
from .dracheckpoint import CHECKPOINT_FILE, Checkpoint
from .draclaim import Claim, check_uid, parse_claim
from .draconfig import CDI_DIR, PLUGINS_DIR, REGISTRY_DIR, DraConfig
from .isolation import ContainerEnv
from .nvml import Gpu
from .proto import dra_v1_pb2 as pb
from .proto import dra_v1_pb2_grpc as pb_grpc
from .proto import pluginregistration_v1_pb2 as reg_pb
from .proto import pluginregistration_v1_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go
SERVICE_V1 = "v1.DRAPlugin"  # k8s.io/kubelet pkg/apis/dra/v1 DRAPluginService
# kubelet 1.37 takes "v1.DRAPlugin" and "v1beta1.DRAPlugin" (pkg/kubelet/cm/dra/plugin,
# servicesSupportedByKubelet); this plugin serves v1 only.
SUPPORTED_SERVICES = (SERVICE_V1,)


@dataclass(frozen=True)
class DraNode:
    """What the plugin needs of the node agent: the node, its GPUs, a ResourceClaim reader,
    the isolation guard as it is now, the grant of one container's share (which applies
    the node's back-end and labels, and counts a refusal), and the node's shared writable
    directories."""

    node_name: str
    state_dir: str
    gpus: Sequence[Gpu]
    read_claim: Callable[[str, str], Awaitable[Mapping[str, Any]]]
    isolation_guard: Callable[[], Awaitable[Guard]]
    grant: Callable[[Candidate, Guard], Grant]
    # host directories shared by every container that writes to them (HAMi-core's lock
    # directory): kept writable by any user
    open_dirs: Sequence[str] = ()


class Refused(ShareGpuError):
    """A claim cannot be prepared; the message is the error the kubelet reports for it."""


def _response(entry: dict[str, Any]) -> pb.NodePrepareResourceResponse:
    out = []
    for d in entry["devices"]:
        dev = pb.Device(request_names=d["requestNames"], pool_name=d["poolName"],
                        device_name=d["deviceName"], cdi_device_ids=d["cdiDeviceIds"])
        if d.get("shareId"):
            dev.share_id = d["shareId"]
        out.append(dev)
    return pb.NodePrepareResourceResponse(devices=out)


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: DraPlugin) -> None:
        self.plugin = plugin

    async def GetInfo(self, request, context):  # type: ignore[no-untyped-def]
        return reg_pb.PluginInfo(type=PLUGIN_TYPE, name=dra.DRIVER,
                                 endpoint=self.plugin.config.endpoint,
                                 supported_versions=list(SUPPORTED_SERVICES))

    async def NotifyRegistrationStatus(self, request, context):  # type: ignore[no-untyped-def]
        self.plugin.registered = bool(request.plugin_registered)
        self.plugin.registration_error = request.error
        if request.plugin_registered:
            log.info("DRA plugin %s registered with the kubelet", dra.DRIVER)
        else:
            log.error("the kubelet refused DRA plugin %s: %s", dra.DRIVER, request.error)
        return reg_pb.RegistrationStatusResponse()


class DraPlugin(pb_grpc.DRAPluginServicer):
    def __init__(self, node: DraNode, config: DraConfig | None = None) -> None:
        self.node = node
        self.config = config or DraConfig()
        self.checkpoint = Checkpoint(os.path.join(node.state_dir, CHECKPOINT_FILE))
        self.files = ClaimFiles(self.config.cdi_dir, self.checkpoint, node.open_dirs)
        self.registered: bool | None = None  # what the kubelet last said
        self.registration_error = ""
        self.prepared = 0  # claims prepared (not answered from the checkpoint)
        self.refused = 0
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary())
        self._servers: list[grpc.aio.Server] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for d in (self.config.registry_dir, self.config.plugin_dir, self.config.cdi_dir):
            os.makedirs(d, exist_ok=True)
        self.files.load()
        # the endpoint serves before the kubelet can learn of it from the registration socket
        for path, add in ((self.config.endpoint, self._add_plugin),
                          (self.config.registration_socket, self._add_registration)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            server = grpc.aio.server()
            add(server)
            server.add_insecure_port(f"unix://{path}")
            await server.start()
            self._servers.append(server)
        log.info("DRA plugin %s: endpoint %s, registration %s, CDI specs in %s", dra.DRIVER,
                 self.config.endpoint, self.config.registration_socket, self.config.cdi_dir)

    def _add_plugin(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_DRAPluginServicer_to_server(self, server)

    def _add_registration(self, server: grpc.aio.Server) -> None:
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)

    async def stop(self) -> None:
        # the registration socket goes first: the kubelet's watcher then deregisters the plugin
        for server in reversed(self._servers):
            await server.stop(grace=0.2)
        self._servers = []
        for path in (self.config.registration_socket, self.config.endpoint):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _lock(self, uid: str) -> asyncio.Lock:
        lock = self._locks.get(uid)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[uid] = lock
        return lock

    # ------------------------------------------------------------------ DRAPlugin service
    async def NodePrepareResources(self, request, context):  # type: ignore[no-untyped-def]
        answers = await asyncio.gather(*(self._prepare_one(c.namespace, c.name, c.uid)
                                         for c in request.claims))
        return pb.NodePrepareResourcesResponse(claims=dict(answers))

    async def NodeUnprepareResources(self, request, context):  # type: ignore[no-untyped-def]
        answers = await asyncio.gather(*(self._unprepare_one(c.namespace, c.name, c.uid)
                                         for c in request.claims))
        return pb.NodeUnprepareResourcesResponse(claims=dict(answers))

    # ------------------------------------------------------------------ prepare
    async def _prepare_one(self, namespace: str, name: str,
                           uid: str) -> tuple[str, pb.NodePrepareResourceResponse]:
        ref = f"{namespace}/{name}"
        try:
            check_uid(uid)
        except ValidationError as e:
            return uid, self._refuse(ref, uid, str(e))
        async with self._lock(uid):
            entry = self.files.prepared(uid)
            if entry is not None:
                return uid, _response(entry)
            try:
                entry = await self._prepare(namespace, name, uid)
            except ShareGpuError as e:
                return uid, self._refuse(ref, uid, str(e))
            except Exception as e:  # a bug or the disk: this claim only
                log.exception("DRA prepare of claim %s (%s) failed", ref, uid)
                return uid, self._refuse(ref, uid, f"internal error: {e}")
            self.prepared += 1
            return uid, _response(entry)

    def _refuse(self, ref: str, uid: str, reason: str) -> pb.NodePrepareResourceResponse:
        self.refused += 1
        msg = f"{dra.DRIVER}: claim {ref} ({uid}) not prepared: {reason}"
        log.error("%s", msg)
        return pb.NodePrepareResourceResponse(error=msg)

    async def _prepare(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        try:
            obj = await self.node.read_claim(namespace, name)
        except Exception as e:
            raise Refused(f"reading ResourceClaim {namespace}/{name} failed: {e}") from None
        claim = parse_claim(obj, uid=uid, node=self.node.node_name,
                            gpu_mem=[g.mem_gib for g in self.node.gpus])
        # every answer is built before anything is written: a refusal leaves no trace
        edits = await self._edits(claim)
        entry = self.files.write(uid, f"{namespace}/{name}", edits, {
            "namespace": namespace, "name": name,
            "devices": [{"requestNames": [d.request], "poolName": d.pool,
                         "deviceName": d.device,
                         "cdiDeviceIds": [dra.cdi_device_id(uid, d.device)],
                         "shareId": d.share_id} for d in claim.devices],
        })
        log.info("DRA claim %s/%s (%s) prepared: %s", namespace, name, uid,
                 ", ".join(f"{d.device} for {d.request}" for d in claim.devices))
        return entry

    async def _edits(self, claim: Claim) -> list[tuple[str, ContainerEnv]]:
        """What each device of ``claim`` gives a container: the devices of one request are one
        container's share (numbered in GPU order, as a container's GPUs are), so each of them
        carries the same, complete edits."""
        gpus = self.node.gpus
        guard = await self.node.isolation_guard()
        out: list[tuple[str, ContainerEnv]] = []
        total = sum(d.mem_gib if d.mem_gib is not None else gpus[d.gpu].mem_gib
                    for d in claim.devices)
        for request, ds in claim.requests().items():
            whole = ds[0].whole
            c = Candidate(
                namespace=claim.namespace, name=claim.name, uid=claim.uid, container=0,
                container_name=request,
                mem={d.gpu: (gpus[d.gpu].mem_gib if whole else int(d.mem_gib or 0))
                     for d in ds},
                core={d.gpu: d.core for d in ds if d.core},
                whole=whole, pod_total_mem=total, assume_time=0,
            )
            grant = self.node.grant(c, guard)
            out.extend((d.device, grant.env) for d in ds)
        return out

    # ------------------------------------------------------------------ unprepare
    async def _unprepare_one(self, namespace: str, name: str,
                             uid: str) -> tuple[str, pb.NodeUnprepareResourceResponse]:
        try:
            check_uid(uid)
        except ValidationError as e:
            # no claim of this plugin has such a UID: nothing of it can be on the node
            log.warning("DRA unprepare of %s/%s: %s (nothing to remove)", namespace, name, e)
            return uid, pb.NodeUnprepareResourceResponse()
        async with self._lock(uid):
            try:
                had = self.files.remove(uid)
            except OSError as e:
                msg = (f"{dra.DRIVER}: claim {namespace}/{name} ({uid}) not unprepared: "
                       f"{e.strerror or e}")
                log.error("%s", msg)
                return uid, pb.NodeUnprepareResourceResponse(error=msg)
            if had:
                log.info("DRA claim %s/%s (%s) unprepared", namespace, name, uid)
        return uid, pb.NodeUnprepareResourceResponse()


__all__ = ["CDI_DIR", "CHECKPOINT_FILE", "PLUGINS_DIR", "REGISTRY_DIR", "DraConfig", "DraNode",
           "DraPlugin", "Refused"]
