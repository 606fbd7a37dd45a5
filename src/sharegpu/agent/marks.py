"""The ``assigned`` mark: set on a pod once the kubelet gave all of its GPU containers their
devices, so that the extender counts it started and the agent stops matching it.

Allocate sets the mark after answering, in the background; an agent stopped in between (killed,
restarted by ``helm upgrade``) would leave the pod unmarked for ever. So the agent also
reconciles, at start and every ``every_s``: each pod bound to this node that carries a
scheduling decision but no mark, that the kubelet has admitted (its ``status.containerStatuses``
are written, which the kubelet does for that pod's UID only after admission, when its devices
were allocated) and, where the kubelet's pod-resources API answers, whose GPU containers hold
devices there, is marked. Every mark names the pod's UID (a precondition of the patch), so a
pod recreated under the same name before its own Allocate is never marked for the old one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import grpc

from ..core import names
from ..core.annotations import assigned_patch, decode, is_assigned
from ..core.errors import ValidationError
from ..core.pods import is_terminated
from ..core.request import parse_pod
from .kube import KubeApi, PodGone
from .podresources import Listing, PodNaming

log = logging.getLogger(__name__)

RECONCILE_EVERY_S = 15.0



def admitted(pod: Mapping[str, Any]) -> bool:
    """Whether the kubelet has admitted this pod (its UID's containers have statuses): device
    allocation happens at admission, so its containers got their devices."""
    statuses = (pod.get("status") or {}).get("containerStatuses")
    return isinstance(statuses, list) and len(statuses) > 0


def holds_devices(pod: Mapping[str, Any], listing: Listing) -> bool:
    """Whether the kubelet's listing shows every GPU container of ``pod`` holding devices of
    sharegpu's resources."""
    meta = pod.get("metadata") or {}
    got = listing.get((str(meta.get("namespace") or "default"), str(meta.get("name") or "")))
    if got is None:
        return False
    try:
        req = parse_pod(pod)
    except ValidationError:
        return False
    for c in req.containers:
        held = got.get(c.name) or {}
        if not any(held.get(r) for r in names.ALL_GPU_RESOURCES):
            return False
    return True


def unmarked(pods: Iterable[Mapping[str, Any]], node: str,
             listing: Listing | None) -> list[tuple[str, str, str]]:
    """(namespace, name, uid) of each pod bound to ``node`` that carries a decision, is not
    marked assigned, was admitted by the kubelet and (``listing``: the kubelet's pod-resources
    answer, ``None`` when there is none) holds its devices."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if (pod.get("spec") or {}).get("nodeName") != node or is_terminated(pod) \
                or is_assigned(ann) or not admitted(pod):
            continue
        try:
            if decode(ann) is None:
                continue
        except ValidationError:
            continue
        if listing is not None and not holds_devices(pod, listing):
            continue
        out.append((str(meta.get("namespace") or "default"), str(meta.get("name") or ""),
                    str(meta.get("uid") or "")))
    return out


class Marks:
    """Sets the ``assigned`` mark (by UID) after an Allocate and by reconciliation."""

    def __init__(self, node_name: str, kube: KubeApi, naming: PodNaming | None = None, *,
                 every_s: float = RECONCILE_EVERY_S) -> None:
        self.node_name = node_name
        self.kube = kube
        self.naming = naming
        self.every_s = every_s
        self.marked = 0  # marks set (by Allocate and by reconciliation)
        self.reconciled = 0  # marks set by reconciliation (an Allocate's mark was lost)

    async def mark(self, namespace: str, name: str, uid: str, *, tries: int = 10) -> bool:
        """Mark the pod of ``uid`` assigned, retrying with back-off; False when it is gone
        (deleted, or another pod of that name now) or every try failed."""
        delay = 0.2
        for _ in range(tries):
            try:
                await self.kube.patch_pod_annotations(namespace, name, assigned_patch(),
                                                      uid=uid)
                self.marked += 1
                return True
            except PodGone as e:
                log.info("%s/%s not marked assigned: %s", namespace, name, e)
                return False
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("marking %s/%s assigned failed: %s", namespace, name, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        return False

    async def reconcile(self) -> int:
        """Mark every admitted pod of the node whose mark is missing; how many were marked."""
        pods = await self.kube.list_node_pods(self.node_name)
        listing: Listing | None = None
        if not unmarked(pods, self.node_name, None):
            return 0  # nothing admitted is unmarked: no listing asked for
        if self.naming is not None:
            try:
                listing = await self.naming.client.list()
            except (grpc.aio.AioRpcError, TimeoutError) as e:
                log.warning("reconciling marks without the kubelet's pod-resources API: %s", e)
        n = 0
        for ns, name, uid in unmarked(pods, self.node_name, listing):
            if await self.mark(ns, name, uid, tries=3):
                log.warning("%s/%s was admitted by the kubelet but not marked assigned: "
                            "marked now", ns, name)
                n += 1
        self.reconciled += n
        return n

    async def run(self) -> None:
        """Reconcile now and every ``every_s``."""
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("reconciling the assigned marks failed: %s", e)
            await asyncio.sleep(self.every_s)


__all__ = ["RECONCILE_EVERY_S", "Marks", "admitted", "holds_devices", "unmarked"]
