"""A test kubelet for DRA: the kubelet's side of plugin registration and of ``v1.DRAPlugin``, over
real gRPC on unix sockets, as kubelet 1.37 does it.

- Its plugin watcher: a socket in the ``plugins_registry`` directory is a plugin; the kubelet
  calls ``GetInfo``, checks the type (``DRAPlugin``) and picks the first service the plugin
  lists that it supports (``v1.DRAPlugin``, ``v1beta1.DRAPlugin``), then tells the plugin with
  ``NotifyRegistrationStatus``; it dials the endpoint as ``unix:<endpoint>``.
- Its DRA manager: ``NodePrepareResources`` / ``NodeUnprepareResources`` with the claims'
  namespace, name and UID only, one call per pod.
- The container runtime's CDI: :func:`cdi_registry` reads every spec in the CDI directory and
  resolves fully qualified device IDs to their container edits, refusing a name defined twice
  (as the CDI library does).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from sharegpu.agent.proto import dra_v1_pb2 as pb
from sharegpu.agent.proto import dra_v1_pb2_grpc as pb_grpc
from sharegpu.agent.proto import pluginregistration_v1_pb2 as reg_pb
from sharegpu.agent.proto import pluginregistration_v1_pb2_grpc as reg_grpc

# the CDI library's rules (pkg/parser): vendor and class names, device names
_CDI_KIND = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?/[A-Za-z0-9]([A-Za-z0-9_-]*"
                       r"[A-Za-z0-9])?")
_CDI_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
# pkg/kubelet/cm/dra/plugin: servicesSupportedByKubelet, most recent first
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


@dataclass
class Registered:
    name: str
    endpoint: str
    service: str
    versions: list[str]


class TestDraKubelet:
    __test__ = False

    def __init__(self, registry_dir: str) -> None:
        self.registry_dir = registry_dir
        self.plugins: dict[str, Registered] = {}
        self.refused: dict[str, str] = {}  # socket -> why the kubelet refused it
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def discover(self) -> list[Registered]:
        """What the plugin watcher does on start and on each new socket in the registry."""
        out = []
        for f in sorted(os.listdir(self.registry_dir)):
            if f.endswith(".sock"):
                r = await self.register(os.path.join(self.registry_dir, f))
                if r is not None:
                    out.append(r)
        return out

    async def register(self, socket: str) -> Registered | None:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as ch:
            stub = reg_grpc.RegistrationStub(ch)
            info = await stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
            error = ""
            service = next((s for s in info.supported_versions if s in KUBELET_SERVICES), "")
            if info.type != "DRAPlugin":
                error = f"plugin type {info.type!r} is not DRAPlugin"
            elif not service:
                error = (f"none of services supported by the plugin ({list(info.supported_versions)}"
                         f") are supported by the kubelet ({list(KUBELET_SERVICES)})")
            elif not os.path.isabs(info.endpoint):
                error = f"endpoint {info.endpoint!r} is not an absolute path"
            await stub.NotifyRegistrationStatus(
                reg_pb.RegistrationStatus(plugin_registered=not error, error=error), timeout=5)
        if error:
            self.refused[socket] = error
            return None
        reg = Registered(info.name, info.endpoint, service, list(info.supported_versions))
        old = self._channels.pop(info.name, None)
        if old is not None:
            await old.close()
        self.plugins[info.name] = reg
        return reg

    def _stub(self, driver: str) -> pb_grpc.DRAPluginStub:
        if driver not in self._channels:
            self._channels[driver] = grpc.aio.insecure_channel(
                f"unix:{self.plugins[driver].endpoint}")
        return pb_grpc.DRAPluginStub(self._channels[driver])

    async def prepare(self, driver: str, claims: Iterable[tuple[str, str, str]],
                      timeout: float = 20) -> dict[str, pb.NodePrepareResourceResponse]:
        """(namespace, name, uid) per claim -> the answer per UID."""
        req = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims])
        resp = await _call(self._stub(driver).NodePrepareResources(req, timeout=timeout))
        return dict(resp.claims)

    async def unprepare(self, driver: str, claims: Iterable[tuple[str, str, str]],
                        timeout: float = 20) -> dict[str, pb.NodeUnprepareResourceResponse]:
        req = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims])
        resp = await _call(self._stub(driver).NodeUnprepareResources(req, timeout=timeout))
        return dict(resp.claims)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


async def _call(call: Any) -> Any:
    """The call's answer. A call cut because the kubelet closed the connection it was made on
    (a plugin that registers again gets a new one) fails as the Go kubelet's does, with
    ``CANCELLED``; grpc's asyncio client would instead cancel the caller's task."""
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(),
                                   details="the kubelet closed the connection") from None


def cdi_registry(directory: str) -> dict[str, dict[str, Any]]:
    """Fully qualified CDI device ID -> containerEdits, from every spec in ``directory``."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(os.listdir(directory)):
        if not f.endswith(".json"):
            continue
        with open(os.path.join(directory, f)) as fh:
            spec = json.load(fh)
        assert spec["cdiVersion"] and _CDI_KIND.fullmatch(spec["kind"]), f
        for d in spec["devices"]:
            assert _CDI_NAME.fullmatch(d["name"]), (f, d["name"])
            qid = f"{spec['kind']}={d['name']}"
            assert qid not in out, f"CDI device {qid} defined twice"
            out[qid] = d["containerEdits"]
    return out


def container_view(registry: Mapping[str, Mapping[str, Any]],
                   ids: Iterable[str]) -> tuple[dict[str, str], dict[str, tuple[str, list[str]]]]:
    """What a container given CDI devices ``ids`` gets: its variables and its mounts
    (container path -> (host path, options)), edits applied in order."""
    env: dict[str, str] = {}
    mounts: dict[str, tuple[str, list[str]]] = {}
    for i in ids:
        edits = registry[i]  # an unknown ID fails the container, as the runtime does
        for kv in edits.get("env", []):
            k, _, v = kv.partition("=")
            env[k] = v
        for m in edits.get("mounts", []):
            mounts[m["containerPath"]] = (m["hostPath"], list(m.get("options", [])))
    return env, mounts
