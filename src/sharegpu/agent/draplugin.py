"""The agent's DRA kubelet plugin (issue 21, DRA mode): the kubelet's ``v1.DRAPlugin`` service
over gRPC on a unix socket, announced through the kubelet's plugin registration
(``pluginregistration/v1``).

- **Registration.** A socket ``<registry>/gpu.sharegpu.io-reg.sock`` in the kubelet's
  ``plugins_registry`` directory serves ``Registration``: the kubelet's plugin watcher asks
  ``GetInfo`` (type ``DRAPlugin``, the driver's name, the plugin's endpoint, the services it
  serves: ``v1.DRAPlugin``) and reports the outcome with ``NotifyRegistrationStatus``.
- **Prepare.** ``NodePrepareResources`` names claims (namespace, name, UID) and nothing else:
  the plugin reads each ResourceClaim from the API server and takes the results of its driver
  from ``status.allocation.devices.results`` (:mod:`.draclaim`: device, ``consumedCapacity``,
  ``shareID``). Each request of the claim is a container's share, given exactly what
  Allocate gives one in device-plugin mode (:meth:`.allocate.Allocator.grant`: the GPU by
  ``NVIDIA_VISIBLE_DEVICES``, and HAMi-core's or MPS's limits, library and mounts); it is
  written as a CDI spec (:mod:`.cdi`) and answered as CDI device IDs
  ``sharegpu.io/gpu=<claim uid>-gpu-<index>``.
- **Fails closed** as Allocate does: the node's isolation back-end is checked the same way
  (:meth:`.service.Agent.isolation_guard`); when it is not usable the claim gets that error
  and nothing is written.
- **Idempotent and checkpointed.** Prepared claims are recorded in ``dra-claims.json`` in the
  agent's state directory (written whole), so preparing a claim again — also after the agent
  restarted — answers the same devices without reading the API; ``NodeUnprepareResources``
  removes the spec, the claim's writable directories and the record, and succeeds for a claim
  it does not know.
- **Claims are independent.** One call may name several claims; each gets its own answer or its
  own error (the field and the rule that refused it), and a refused claim leaves the others,
  and the files of every other claim, as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from .. import dra
from ..errors import ShareGpuError, ValidationError
from . import cdi
from .allocate import Candidate, IsolationUnavailable
from .draclaim import Claim, check_uid, parse_claim
from .proto import dra_v1_pb2 as pb
from .proto import dra_v1_pb2_grpc as pb_grpc
from .proto import pluginregistration_v1_pb2 as reg_pb
from .proto import pluginregistration_v1_pb2_grpc as reg_grpc

if TYPE_CHECKING:
    from .service import Agent

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go
SERVICE_V1 = "v1.DRAPlugin"  # k8s.io/kubelet pkg/apis/dra/v1 DRAPluginService
# kubelet 1.37 takes "v1.DRAPlugin" and "v1beta1.DRAPlugin" (pkg/kubelet/cm/dra/plugin,
# servicesSupportedByKubelet); this plugin serves v1 only.
SUPPORTED_SERVICES = (SERVICE_V1,)
REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
CDI_DIR = "/var/run/cdi"
CHECKPOINT_FILE = "dra-claims.json"
CHECKPOINT_VERSION = 1


@dataclass(frozen=True)
class DraConfig:
    registry_dir: str = REGISTRY_DIR
    plugin_dir: str = f"{PLUGINS_DIR}/{dra.DRIVER}"
    cdi_dir: str = CDI_DIR

    @property
    def registration_socket(self) -> str:
        return os.path.join(self.registry_dir, f"{dra.DRIVER}-reg.sock")

    @property
    def endpoint(self) -> str:
        return os.path.join(self.plugin_dir, "dra.sock")


class Refused(ShareGpuError):
    """A claim cannot be prepared; the message is the error the kubelet reports for it."""


class Checkpoint:
    """The prepared claims: UID -> {namespace, name, devices (as answered), dirs (writable
    host directories made for the claim)}, kept in one JSON file written whole."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.claims: dict[str, dict[str, Any]] = {}
        self.loaded = False  # a checkpoint file was read (not absent, not unreadable)

    def load(self) -> None:
        self.claims, self.loaded = {}, False
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            aside = f"{self.path}.unreadable"
            log.error("DRA checkpoint %s cannot be read (%s): moved to %s; claims are prepared "
                      "again from the API", self.path, e, aside)
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            return
        claims = data.get("claims") if isinstance(data, dict) else None
        if not isinstance(claims, dict) or data.get("version") != CHECKPOINT_VERSION:
            log.error("DRA checkpoint %s is not version %d: ignored", self.path,
                      CHECKPOINT_VERSION)
            return
        self.claims, self.loaded = claims, True

    def save(self) -> None:
        cdi.write_json(self.path, {"version": CHECKPOINT_VERSION, "claims": self.claims},
                       mode=0o600)


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
    def __init__(self, agent: Agent, config: DraConfig | None = None) -> None:
        self.agent = agent
        self.config = config or DraConfig()
        self.checkpoint = Checkpoint(os.path.join(agent.config.state_dir, CHECKPOINT_FILE))
        self.registered: bool | None = None  # what the kubelet last said
        self.registration_error = ""
        self.prepared = 0  # claims prepared (not answered from the checkpoint)
        self.refused = 0
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary())
        self._servers: list[grpc.aio.Server] = []

    @property
    def node(self) -> str:
        return self.agent.config.node_name

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for d in (self.config.registry_dir, self.config.plugin_dir, self.config.cdi_dir):
            os.makedirs(d, exist_ok=True)
        self.checkpoint.load()
        self._remove_orphans()
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

    def _remove_orphans(self) -> None:
        """Specs of claims that are not in the checkpoint: written by a prepare that never
        answered (the agent stopped in between), so no container uses them; the kubelet
        prepares such a claim again. Only when the checkpoint was read: without it, every spec
        is kept (a running container's restart needs its spec)."""
        if not self.checkpoint.loaded:
            return
        for uid in sorted(cdi.spec_uids(self.config.cdi_dir) - set(self.checkpoint.claims)):
            log.info("removing the CDI spec of claim %s: prepared by no answered call", uid)
            cdi.remove_spec(self.config.cdi_dir, uid)

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
            entry = self.checkpoint.claims.get(uid)
            if entry is not None and os.path.exists(cdi.spec_path(self.config.cdi_dir, uid)):
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
            obj = await self.agent.kube.get_resource_claim(namespace, name)
        except Exception as e:
            raise Refused(f"reading ResourceClaim {namespace}/{name} failed: {e}") from None
        claim = parse_claim(obj, uid=uid, node=self.node,
                            gpu_mem=[g.mem_gib for g in self.agent.gpus])
        # every answer is built before anything is written: a refusal leaves no trace
        edits = await self._edits(claim)
        dirs = sorted({m.host_path for _, e in edits for m in e.mounts
                       if not m.read_only and m.host_path.endswith(f"/{uid}")})
        for d in dirs:  # the claim's own writable directories (HAMi-core's shared cache)
            os.makedirs(d, exist_ok=True)
        try:
            spec = cdi.build_spec(uid, f"{namespace}/{name}", edits)
            cdi.write_spec(self.config.cdi_dir, uid, spec)
            entry = {
                "namespace": namespace, "name": name, "dirs": dirs,
                "devices": [{"requestNames": [d.request], "poolName": d.pool,
                             "deviceName": d.device,
                             "cdiDeviceIds": [dra.cdi_device_id(uid, d.device)],
                             "shareId": d.share_id} for d in claim.devices],
            }
            self.checkpoint.claims[uid] = entry
            self.checkpoint.save()
        except BaseException:
            self.checkpoint.claims.pop(uid, None)
            cdi.remove_spec(self.config.cdi_dir, uid)
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
            raise
        log.info("DRA claim %s/%s (%s) prepared: %s", namespace, name, uid,
                 ", ".join(f"{d.device} for {d.request}" for d in claim.devices))
        return entry

    async def _edits(self, claim: Claim) -> list[tuple[str, Any]]:
        """What each device of ``claim`` gives a container: the devices of one request are one
        container's share (numbered in GPU order, as a container's GPUs are), so each of them
        carries the same, complete edits."""
        agent = self.agent
        guard = await agent.isolation_guard()
        out: list[tuple[str, Any]] = []
        total = sum(d.mem_gib if d.mem_gib is not None else agent.gpus[d.gpu].mem_gib
                    for d in claim.devices)
        for request, ds in claim.requests().items():
            whole = ds[0].whole
            c = Candidate(
                namespace=claim.namespace, name=claim.name, uid=claim.uid, container=0,
                container_name=request,
                mem={d.gpu: (agent.gpus[d.gpu].mem_gib if whole else int(d.mem_gib or 0))
                     for d in ds},
                core={d.gpu: d.core for d in ds if d.core},
                whole=whole, pod_total_mem=total, assume_time=0,
            )
            try:
                grant = agent.allocator.grant(c, agent.backend, agent.labels, guard)
            except IsolationUnavailable:
                agent.isolation_refusals += 1
                raise
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
            entry = self.checkpoint.claims.get(uid)
            try:
                had_spec = cdi.remove_spec(self.config.cdi_dir, uid)
                if entry is not None:
                    for d in entry.get("dirs") or []:
                        shutil.rmtree(d, ignore_errors=True)
                    del self.checkpoint.claims[uid]
                    self.checkpoint.save()
            except OSError as e:
                msg = (f"{dra.DRIVER}: claim {namespace}/{name} ({uid}) not unprepared: "
                       f"{e.strerror or e}")
                log.error("%s", msg)
                return uid, pb.NodeUnprepareResourceResponse(error=msg)
            if entry is not None or had_spec:
                log.info("DRA claim %s/%s (%s) unprepared", namespace, name, uid)
        return uid, pb.NodeUnprepareResourceResponse()
