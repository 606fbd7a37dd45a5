"""The pod the kubelet is admitting, read from the kubelet's pod-resources API (``List`` on
``/var/lib/kubelet/pod-resources/kubelet.sock``).

The kubelet admits one pod at a time: it adds the pod to its pod manager, then its device
manager asks the plugins (GetPreferredAllocation, Allocate) container by container, and records
a container's devices once the plugin answered. ``List`` shows the active pods (kubelet 1.34 and
later: pods rejected at admission are terminal and left out) with the devices each container
holds. So among the pods waiting for devices, the one listed with a container that needs a
resource and holds none of it yet is the pod the kubelet is asking about: the device plugins'
calls name no pod, this names it (docs/agent.md, "How Allocate finds the pod").
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
# From 1.34 the kubelet's List shows active pods only (KubeletPodResourcesListUseActivePods):
# before, a pod the kubelet had rejected stayed listed without devices.
MIN_KUBELET = (1, 34)
LIST_TIMEOUT_S = 5.0

# (namespace, name) -> container name -> resource -> device IDs
Listing = dict[tuple[str, str], dict[str, dict[str, frozenset[str]]]]


def kubelet_supported(version: str) -> bool:
    """Whether a kubelet of this ``status.nodeInfo.kubeletVersion`` lists active pods only."""
    m = re.match(r"v?(\d+)\.(\d+)", version or "")
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= MIN_KUBELET


@dataclass(frozen=True)
class Named:
    """The pod the kubelet's pod-resources listing shows being admitted."""

    key: str  # as ``Candidate.pod_key``: the UID when the API shows the pod, else namespace/name
    ref: str  # namespace/name, for messages
    held: Mapping[str, frozenset[str]] = field(default_factory=dict)  # container -> resources


def _asks(container: Mapping[str, Any], resource: str) -> bool:
    res = container.get("resources")
    if not isinstance(res, Mapping):
        return False
    for part in ("limits", "requests"):
        v = res.get(part)
        if isinstance(v, Mapping) and str(v.get(resource, "0")).strip() not in ("", "0"):
            return True
    return False


def being_admitted(listing: Listing, pods: Iterable[Mapping[str, Any]], resource: str
                   ) -> tuple[list[Named], list[Named]]:
    """The pods the kubelet may be admitting for ``resource``: (known, unknown). Known: pods of
    ``pods`` (the node's pods, listed from the API after the kubelet's call began) that the
    kubelet lists with a container that asks for ``resource`` and holds none of it yet. Unknown:
    listed pods that the API does not show (a static pod before its mirror pod exists, a pod
    deleted meanwhile), with a container holding none of ``resource``; the API holds every
    decision, so they have none."""
    known: list[Named] = []
    seen: set[tuple[str, str]] = set()
    for pod in pods:
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace") or "default"), str(meta.get("name") or ""))
        seen.add(key)
        listed = listing.get(key)
        if listed is None:
            continue  # not in the kubelet's pod manager (yet, or any more)
        specs = (pod.get("spec") or {}).get("containers") or []
        if any(isinstance(c, Mapping) and _asks(c, resource)
               and not (listed.get(str(c.get("name") or "")) or {}).get(resource)
               for c in specs):
            known.append(_named(key, str(meta.get("uid") or ""), listed))
    unknown = [_named(key, "", listed) for key, listed in listing.items()
               if key not in seen and any(not held.get(resource) for held in listed.values())]
    return known, unknown


def _named(key: tuple[str, str], uid: str,
           listed: Mapping[str, Mapping[str, frozenset[str]]]) -> Named:
    ref = f"{key[0]}/{key[1]}"
    return Named(uid or ref, ref, {c: frozenset(r for r, ids in held.items() if ids)
                                   for c, held in listed.items()})


class PodResources:
    """A client of the kubelet's pod-resources socket."""

    def __init__(self, socket: str = DEFAULT_SOCKET, timeout_s: float = LIST_TIMEOUT_S) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self.errors = 0  # listings that got no answer
        self._channel: grpc.aio.Channel | None = None

    def _stub(self):  # type: ignore[no-untyped-def]
        from .proto import podresources_v1_pb2_grpc as pr_grpc

        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        return pr_grpc.PodResourcesListerStub(self._channel)

    async def list(self) -> Listing:
        """Every active pod the kubelet lists, with each container's devices per resource.
        Raises ``grpc.aio.AioRpcError`` (or ``TimeoutError``) when the kubelet does not answer."""
        from .proto import podresources_v1_pb2 as pr

        delay = 0.02
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                resp = await self._stub().List(pr.ListPodResourcesRequest(),
                                               timeout=max(0.1, deadline - time.monotonic()))
                break
            except (TimeoutError, grpc.aio.AioRpcError) as e:
                # the kubelet limits the API's callers (100 calls/s, bursts of 10): wait for it
                busy = isinstance(e, grpc.aio.AioRpcError) and \
                    e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                if not busy or time.monotonic() + delay >= deadline:
                    self.errors += 1
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)
        out: Listing = {}
        for p in resp.pod_resources:
            containers: dict[str, dict[str, frozenset[str]]] = {}
            for c in p.containers:
                by_res: dict[str, set[str]] = {}
                for d in c.devices:
                    by_res.setdefault(d.resource_name, set()).update(d.device_ids)
                containers[c.name] = {r: frozenset(ids) for r, ids in by_res.items()}
            out[(p.namespace, p.name)] = containers
        return out

    async def probe(self) -> str:
        """Empty when ``List`` answers, else why not (for the log and the node's promise)."""
        try:
            await self.list()
            return ""
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else "timed out"
            return f"the kubelet's pod-resources API on {self.socket} did not answer: {detail}"

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class PodNaming:
    """The node's promise to the scheduler that its agent names the pod of each Allocate
    through the kubelet's pod-resources API (the node annotation
    ``sharegpu.io/pod-resources``): made at start when the kubelet is new enough and answers
    ``List``; with it the extender lets look-alike pods start together on the node."""

    def __init__(self, client: PodResources) -> None:
        self.client = client
        self.promised = False
        self.why_not = "not decided yet"

    async def decide(self, kubelet_version: str) -> bool:
        if not kubelet_supported(kubelet_version):
            self.why_not = (f"kubelet {kubelet_version or '(version unknown)'} lists pods it "
                            "rejected beside those it admits (1.34 or later does not)")
        else:
            self.why_not = await self.client.probe()
        self.promised = not self.why_not
        return self.promised


__all__ = ["DEFAULT_SOCKET", "Listing", "Named", "PodNaming", "PodResources", "being_admitted",
           "kubelet_supported"]
