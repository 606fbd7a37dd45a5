"""Bind: reserve GPUs with the core, then create the binding that records them on the pod.

Read the pod (or take what filter saw), hold its GPUs, wait until no pod starting on the node
could be mistaken for it (:mod:`sharegpu.core.startingpods`), then create the binding in one
write with the pod's uid and resourceVersion as preconditions. Any failure releases the hold
and answers an ``Error``, so kube-scheduler retries. The steps, the time limits and what a
failure leaves: docs/extender.md ("Bind").
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.annotations import encode
from ..core.errors import PlacementError, ValidationError
from ..core.request import PodRequest
from ..core.state import Reservation
from .bindscope import BindScope
from .kube import ApiError, KubeApi
from .resourcepolicies import Claim, ResourcePolicies
from .view import ClusterView
from .wire import BindingArgs


class BindError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason  # short label for metrics
        super().__init__(message)


@dataclass
class BindOutcome:
    node: str
    gpus: tuple[int, ...]
    already: bool = False


@dataclass(frozen=True)
class _Seen:
    uid: str
    resource_version: str
    request: PodRequest


class Binder:
    """``hint`` remembers the pod kube-scheduler sent with filter (its resourceVersion and
    parsed request), so that bind can skip reading the pod back: the annotation write carries
    that resourceVersion, and if the pod changed since (409) the bind starts over from a fresh
    read."""

    def __init__(self, api: KubeApi, view: Callable[[], ClusterView],
                 may_bind: Callable[[], bool] = lambda: True, hints: int = 10000,
                 units: ResourcePolicies | None = None, start_wait: float = 5.0,
                 bind_timeout: float = 7.0, scope: BindScope | None = None) -> None:
        """``scope``: which pods and nodes it binds (default: pods of the chart's default
        profile, to nodes the view knows)."""
        self.api = api
        self.scope = scope or BindScope(
            node_exists=lambda name: self.view().presence.has_node(name))
        self.units = units
        self.start_wait = start_wait  # seconds a bind waits for look-alike pods to start
        # seconds a bind may take to create the binding (kube-scheduler gives up at its
        # httpTimeout and places the pod again: no binding may land after that)
        self.bind_timeout = bind_timeout
        self.view = view
        self.may_bind = may_bind
        self._seen: OrderedDict[str, _Seen] = OrderedDict()
        self._hints = hints
        self.reads = 0  # pods read back from the API server (for tests and metrics)
        self.writes = 0  # pod writes made (bindings and patches, for tests and metrics)

    def hint(self, pod: Mapping[str, Any], req: PodRequest) -> None:
        meta = pod.get("metadata") or {}
        rv, uid = str(meta.get("resourceVersion") or ""), str(meta.get("uid") or "")
        if not rv or not uid or (pod.get("spec") or {}).get("nodeName"):
            return
        self._seen[req.key] = _Seen(uid, rv, req)
        self._seen.move_to_end(req.key)
        while len(self._seen) > self._hints:
            self._seen.popitem(last=False)

    async def _read(self, args: BindingArgs) -> tuple[PodRequest, str, str] | BindOutcome:
        """(request, uid, resourceVersion) of the pod, or the outcome when it is bound."""
        path = f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}"
        self.reads += 1
        try:
            pod = await self.api.get(path)
        except ApiError as e:
            raise BindError("read-pod", f"cannot read pod {args.key}: {e}") from None
        meta = pod.get("metadata") or {}
        if args.pod_uid and meta.get("uid") and meta["uid"] != args.pod_uid:
            raise BindError("uid", f"pod {args.key} has uid {meta['uid']}, not {args.pod_uid}")
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to:
            if bound_to == args.node:
                return BindOutcome(args.node, (), already=True)
            raise BindError("bound-elsewhere", f"pod {args.key} is already bound to {bound_to}")
        self._refuse("not-ours", self.scope.pod_refusal(args.key, pod))
        try:
            req = self.view().reader.request(pod)  # with its host CPU and memory
        except ValidationError as e:
            raise BindError("invalid-request", str(e)) from None
        return req, str(meta.get("uid", "")), str(meta.get("resourceVersion", ""))

    async def bind(self, args: BindingArgs) -> BindOutcome:
        if not self.may_bind():
            raise BindError("not-leader", "this sharegpu extender replica is not the leader")
        self._refuse("no-such-node", self.scope.node_refusal(args.node))
        deadline = time.monotonic() + self.bind_timeout
        seen = self._seen.pop(args.key, None)
        if seen is not None and (not args.pod_uid or seen.uid == args.pod_uid):
            placed = self.view().placed.get(args.key)
            if placed is not None:
                if placed[1] == args.node:
                    return BindOutcome(args.node, placed[2].gpus, already=True)
                raise BindError("bound-elsewhere",
                                f"pod {args.key} is already bound to {placed[1]}")
            out = await self._bind(args, seen.request, seen.uid, seen.resource_version,
                                   hinted=True, deadline=deadline)
            if out is not None:
                return out
        got = await self._read(args)
        if isinstance(got, BindOutcome):
            return got
        out = await self._bind(args, *got, hinted=False, deadline=deadline)
        assert out is not None
        return out

    async def _bind(self, args: BindingArgs, req: PodRequest, uid: str, rv: str,
                    hinted: bool, deadline: float) -> BindOutcome | None:
        """Reserve, bind with the annotations. ``None`` when a hinted resourceVersion turned
        out stale (nothing held any more: start over from a fresh read)."""
        path = f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}"
        if not req.wants_gpu:
            return await self._bind_plain(args, req, uid, rv, path, deadline)
        return await self._bind_gpus(args, req, uid, rv, hinted, deadline, path)

    async def _bind_gpus(self, args: BindingArgs, req: PodRequest, uid: str, rv: str,
                         hinted: bool, deadline: float, path: str) -> BindOutcome | None:
        view = self.view()
        claim = self._claim(args, req)
        # the assume-time is when the GPUs were assumed: the filter's pick when the bind
        # confirms it (picks are made in scheduling order; binds land in any order), else now
        held = view.inflight.get(req.key) if view.held_pick(req.key) == args.node else None
        held_ns = view.picks.held_since_ns(req.key)
        try:
            r = view.reserve(req, args.node)
        except PlacementError as e:
            self._unclaim(args)
            raise BindError("no-fit", str(e)) from None
        # an unheld bind's GPUs are chosen now, not when its binding is written (after the
        # starting-pods wait, while other picks are made with these GPUs taken)
        chosen_ns = time.time_ns()
        assumed_ns = held_ns if held is not None and r is held else chosen_ns
        try:
            await self._wait_distinct(req, r, deadline)
            st = self.view().state
            anns = encode(r.alloc, assume_time_ns=assumed_ns or chosen_ns,
                          gpu_capacity=st.gpu_capacity(args.node))
            if claim is not None:
                anns = {**anns, **claim.annotations}
                if claim.labels:
                    rv = await self._patch_labels(args, claim, rv)
            if not self.may_bind():
                raise BindError("not-leader", "lost the leader lease before binding")
            await self._post_binding(args, args.pod_uid or uid, anns, rv, deadline)
        except BaseException as e:
            if isinstance(e, ApiError) and hinted and e.status == 409 \
                    and not await self._bound_anyway(path, args):
                # the pod changed since filter saw it: start over from a fresh read
                self.view().release_inflight(req.key)
                self._unclaim(args)
                return None
            if isinstance(e, ApiError | BindError) and await self._bound_anyway(path, args):
                self.view().bound(req.key)
                return BindOutcome(args.node, r.alloc.gpus)
            self.view().release_inflight(req.key)
            self._unclaim(args)
            if isinstance(e, BindError):
                raise
            if isinstance(e, ApiError):
                raise BindError(f"api-{e.status}", f"binding {args.key} failed: {e}") from None
            raise
        self.view().bound(req.key)
        return BindOutcome(args.node, r.alloc.gpus)

    async def _post_binding(self, args: BindingArgs, uid: str, annotations: Mapping[str, str],
                            rv: str, deadline: float) -> None:
        """The one write: the binding with the annotations, given up unanswered at
        ``deadline`` (never sent past it)."""
        left = _left(deadline)
        if left <= 0:
            raise BindError("timeout", f"{args.key}: not bound within {self.bind_timeout:g} s")
        self.writes += 1
        try:
            async with asyncio.timeout(left):
                await self.api.bind(args.pod_namespace, args.pod_name, uid, args.node,
                                    annotations=annotations, resource_version=rv)
        except TimeoutError:
            raise BindError("timeout", f"{args.key}: the binding was not answered within "
                            f"{self.bind_timeout:g} s") from None

    async def _patch_labels(self, args: BindingArgs, claim: Claim, rv: str) -> str:
        """The unit's labels (a Binding's labels reach the pod only where kube-apiserver's
        PodTopologyLabelsAdmission is on); the pod's new resourceVersion."""
        self.writes += 1
        pod = await self.api.patch_pod_annotations(args.pod_namespace, args.pod_name, {}, rv,
                                                   labels=claim.labels)
        return str(((pod or {}).get("metadata") or {}).get("resourceVersion") or "")

    async def _wait_distinct(self, req: PodRequest, r: Reservation, limit: float) -> None:
        """Return once no pod starting on the node is one the kubelet could not tell from this
        one (then this pod counts as starting), or raise ``BindError`` after ``start_wait``
        (or at ``limit``, the bind's deadline). The check and the add are one step of the
        event loop: no other bind adds a starting pod in between."""
        deadline = min(time.monotonic() + self.start_wait, limit)
        delay = 0.01
        while True:
            starting = self.view().starting
            c = starting.conflict(r.node, req, r.alloc)
            if c is None:
                starting.add(req.key, r.node, req, r.alloc)
                return
            if time.monotonic() >= deadline:
                raise BindError("starting", f"{req.key}: {c.reason(r.node)} (waited "
                                f"{self.start_wait:g} s)")
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.1)

    def _claim(self, args: BindingArgs, req: PodRequest) -> Claim | None:
        """The pod's unit under its ResourcePolicy, counted from now on (None: no policy)."""
        if self.units is None:
            return None
        try:
            return self.units.claim(args.pod_namespace, args.pod_name, req.labels, args.node)
        except ValidationError as e:
            raise BindError("resourcepolicy", f"{args.key}: {e}") from None

    def _unclaim(self, args: BindingArgs) -> None:
        if self.units is not None:
            self.units.release(args.pod_namespace, args.pod_name)

    async def _bind_plain(self, args: BindingArgs, req: PodRequest, uid: str, rv: str,
                          path: str, deadline: float) -> BindOutcome:
        """A pod without GPUs: the binding, with its ResourcePolicy's annotations (and
        labels)."""
        self._refuse("not-ours", self.scope.plain_refusal(args.key))
        claim = self._claim(args, req)
        try:
            anns: Mapping[str, str] = {}
            if claim is not None:
                anns = claim.annotations
                if claim.labels:
                    rv = await self._patch_labels(args, claim, rv)
            if not self.may_bind():
                raise BindError("not-leader", "lost the leader lease before binding")
            await self._post_binding(args, args.pod_uid or uid, anns,
                                     rv if claim is not None else "", deadline)
        except (ApiError, BindError) as e:
            if await self._bound_anyway(path, args):
                return BindOutcome(args.node, ())
            self._unclaim(args)
            if isinstance(e, BindError):
                raise
            raise BindError(f"api-{e.status}", f"binding {args.key} failed: {e}") from None
        except BaseException:
            self._unclaim(args)
            raise
        return BindOutcome(args.node, ())

    @staticmethod
    def _refuse(reason: str, refusal: str | None) -> None:
        """A check at the door (:mod:`.bindscope`) that refused: nothing is read or written."""
        if refusal is not None:
            raise BindError(reason, refusal)

    async def _bound_anyway(self, path: str, args: BindingArgs) -> bool:
        """Whether the pod ended up bound to the node with our annotations despite an error."""
        try:
            pod = await self.api.get(path)
        except ApiError:
            return False
        return (pod.get("spec") or {}).get("nodeName") == args.node


def _labels(claim: Claim | None) -> dict[str, Any]:
    """The labels argument of the patch, only when a unit sets labels."""
    return {"labels": claim.labels} if claim is not None and claim.labels else {}


def _left(deadline: float) -> float:
    return deadline - time.monotonic()
