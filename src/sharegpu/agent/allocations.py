"""The device plugins' answers: which devices to prefer and what a container gets on Allocate.
The kubelet names devices only; the pod they are for is found among the node's pending pods
(matched by the scheduler's annotations, :mod:`.allocate`), granted through the fail-closed
isolation guard, and marked assigned once all of its containers got theirs."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence

import grpc

from .allocate import (
    AllocationError,
    Allocator,
    Candidate,
    Grant,
    IsolationUnavailable,
    pending_candidates,
)
from .freshpods import FreshPods
from .hostdirs import open_dirs
from .isolation import is_lock_dir
from .isolationwatch import IsolationWatch
from .kube import KubeApi
from .marks import Marks
from .nodemode import NodeMode
from .podresources import Named, PodNaming, being_admitted

log = logging.getLogger(__name__)

EVENT_ISOLATION = "GPUIsolationUnavailable"  # Warning event on a pod refused for it


class Allocations:
    def __init__(self, node_name: str, allocator: Allocator, pods: FreshPods,
                 node_mode: NodeMode, isolation: IsolationWatch, kube: KubeApi, *,
                 retries: int, retry_s: float,
                 naming: PodNaming | None = None, marks: Marks | None = None) -> None:
        self.node_name = node_name
        self.allocator = allocator
        self.pods = pods
        self.node_mode = node_mode
        self.isolation = isolation
        self.kube = kube
        self.retries = retries  # re-list pods this often when a request matches no pod yet
        self.retry_s = retry_s
        self.allocations = 0
        self.failures = 0
        self.naming = naming  # the kubelet's pod-resources API, and the node's promise
        # sets the assigned mark (by UID) once a pod's containers all got theirs
        self.marks = marks if marks is not None else Marks(node_name, kube, naming)
        # preference and Allocate calls answered for the pod the kubelet's listing named
        self.named = 0
        # resource -> (devices the last preference returned, the pod it named): the kubelet's
        # Allocate of exactly those devices follows it for the same container
        self._steered: dict[str, tuple[frozenset[str], Named]] = {}
        self._background: set[asyncio.Task] = set()

    async def _candidates(self, resource: str, steered: frozenset[str] = frozenset()
                          ) -> tuple[list[Candidate], Named | None, bool]:
        """The pending GPU containers of the node; the pod the kubelet is admitting, when its
        pod-resources listing names one (with or without a decision; its containers are among
        the candidates even when it is marked assigned: the kubelet admits it again); and
        whether matching is sure without it (the node made no promise to name pods, so the
        scheduler kept look-alike pods apart). ``steered``: the devices of an Allocate; when the
        preference just before returned exactly those, the pod it named is this one's (one
        listing per container, not two)."""
        pods = await self.pods.get()
        cands = pending_candidates(pods, self.node_name)
        if self.naming is None:
            return cands, None, True
        decided = pending_candidates(pods, self.node_name, assigned=True)
        last = self._steered.pop(resource, None)
        if last is not None and steered and last[0] == steered:
            return _with(cands, decided, last[1]), last[1], True
        try:
            listing = await self.naming.client.list()
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            log.warning("%s: the kubelet's pod-resources API did not answer: %s", resource, e)
            return cands, None, not self.naming.promised
        # The listing answered: it is the truth about which pod is being admitted.
        known, unknown = being_admitted(listing, pods, resource)
        if len(known) == 1:
            return _with(cands, decided, known[0]), known[0], True
        if not known and unknown:  # pods the API does not show carry no decision
            refs = ", ".join(sorted(n.ref for n in unknown))
            return cands, Named(key=f"(not in the API: {refs})", ref=refs), True
        if known:  # several (one kubelet admits one pod at a time): one of them, no other
            keys = {n.key for n in known}
            decided_keys = {c.pod_key for c in decided}
            if not keys <= decided_keys:  # one of them has no decision: no decision is served
                refs = ", ".join(sorted(n.ref for n in known))
                return cands, Named(key=f"(one of: {refs})", ref=f"one of {refs}"), True
            cands = [c for c in decided if c.pod_key in keys]
        return cands, None, not self.naming.promised

    async def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        cands, named, _ = await self._candidates(resource)
        ids = self.allocator.preferred(resource, cands, available, must_include, size,
                                       named=named)
        if named is not None:
            self.named += 1
            self._steered[resource] = (frozenset(ids), named)
        return ids

    async def allocate(self, resource: str, device_ids: Sequence[str]) -> Grant:
        attempt = 0
        while True:
            cands, named, sure = await self._candidates(resource, frozenset(device_ids))
            readiness = await self.isolation.current()
            try:
                grant, done = self.allocator.allocate(
                    resource, device_ids, cands, backend=self.node_mode.backend,
                    node_labels=self.node_mode.labels,
                    guard=self.isolation.guard_for(readiness), named=named, sure=sure,
                )
                break
            except IsolationUnavailable as e:
                self.failures += 1
                self.isolation.refusals += 1
                log.error("%s: %s refused: %s", resource, e.candidate.ref, e)
                await self._pod_event(e.candidate, str(e))
                raise
            except AllocationError:
                attempt += 1
                if attempt > self.retries:
                    self.failures += 1
                    raise
                await asyncio.sleep(self.retry_s)
        self._open_dirs(resource, grant)
        self.allocations += 1
        self.named += named is not None
        c = grant.candidate
        if c is not None:
            log.info("%s: %s -> GPU %s", resource, c.ref, ",".join(map(str, grant.gpus)))
        if done and c is not None:
            t = asyncio.get_running_loop().create_task(
                self.marks.mark(c.namespace, c.name, c.uid))
            self._background.add(t)
            t.add_done_callback(self._background.discard)
        return grant

    def _open_dirs(self, resource: str, grant: Grant) -> None:
        """Make the grant's writable HAMi-core directories on the host open to the container's
        user (:mod:`.hostdirs`); refuse the container when they cannot be made."""
        iso = self.allocator.isolation
        writable = {m.host_path for m in grant.env.mounts if not m.read_only}
        own = [d for d in writable if os.path.dirname(d) == iso.hami_cache_dir.rstrip("/")]
        try:
            open_dirs(own, {d for d in writable if is_lock_dir(d, iso.hami_lock_dir)})
        except OSError as e:
            self.failures += 1
            raise AllocationError(
                f"{resource}: cannot make HAMi-core's host directories writable for the "
                f"container: {e}; fix: make {iso.hami_cache_dir} and {iso.hami_lock_dir} "
                "writable by the agent (the chart mounts both)") from None

    def cancel(self) -> None:
        for t in list(self._background):
            t.cancel()
        self.pods.cancel()

    async def _pod_event(self, c: Candidate, message: str) -> None:
        try:
            await self.kube.create_event(
                namespace=c.namespace, pod=c.name, uid=c.uid, reason=EVENT_ISOLATION,
                message=message[:1024], node=self.node_name,
            )
        except Exception as e:
            log.warning("event for %s/%s not written: %s", c.namespace, c.name, e)


def _with(cands: list[Candidate], decided: list[Candidate], named: Named) -> list[Candidate]:
    """The pending containers, and those of the named pod when it is marked assigned."""
    have = {c.key for c in cands}
    return cands + [c for c in decided if c.pod_key == named.key and c.key not in have]
