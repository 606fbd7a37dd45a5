"""Bind: reserve GPUs with the core, then create the binding that records them on the pod.

Read the pod (or take what filter saw), hold its GPUs, wait until no pod starting on the node
could be mistaken for it (:mod:`sharegpu.core.startingpods`), then create the binding in one
write with the pod's uid and resourceVersion as preconditions. The bind's deadline counts from
its request's first byte (the caller's clock), and the Binding carries what is left of it as
the API server's ``timeout``. A refusal releases the hold (and the filter's pick) and answers
an ``Error``, so kube-scheduler retries; a Binding whose outcome is unknown keeps its GPUs until
it settles (:mod:`.unsettled`). The steps, the time limits and what a failure leaves:
docs/extender.md ("Bind").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx2 as httpx

from ..core.annotations import encode
from ..core.errors import PlacementError, ValidationError
from ..core.request import PodRequest
from ..core.state import Reservation
from .bindscope import BindScope
from .kube import ApiError, KubeApi
from .resourcepolicies import Claim, ResourcePolicies
from .unsettled import DEFAULT_GRACE_S, UnsettledBinds
from .view import ClusterView
from .wire import BindingArgs

if TYPE_CHECKING:
    from .metrics import Metrics

log = logging.getLogger(__name__)

# errors the API server answers without having written (anything else may follow a commit)
_NOT_WRITTEN = frozenset({400, 401, 403, 404, 405, 409, 410, 413, 415, 422, 429})
# transport errors raised before the request was sent
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


class BindError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason  # short label for metrics
        super().__init__(message)


class _Unknown(Exception):
    """The Binding was (maybe) sent and its outcome is not known; ``server_timeout``: seconds
    from now after which the API server no longer writes it."""

    def __init__(self, message: str, server_timeout: float) -> None:
        super().__init__(message)
        self.server_timeout = server_timeout


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
                 bind_timeout: float = 7.0, settle_grace: float = DEFAULT_GRACE_S,
                 metrics: Metrics | None = None, scope: BindScope | None = None) -> None:
        """``scope``: which pods and nodes it binds (default: pods of the chart's default
        profile, to nodes the view knows)."""
        self.api = api
        self.metrics = metrics
        self.scope = scope or BindScope(
            node_exists=lambda name: self.view().presence.has_node(name))
        self.units = units
        self.start_wait = start_wait  # seconds a bind waits for look-alike pods to start
        # seconds a bind may take to create the binding (kube-scheduler gives up at its
        # httpTimeout and places the pod again: no binding may land after that)
        self.bind_timeout = bind_timeout
        self.view = view
        self.may_bind = may_bind
        self.unsettled = UnsettledBinds(settle_grace)
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

    async def _read(self, args: BindingArgs, deadline: float
                    ) -> tuple[PodRequest, str, str] | BindOutcome:
        """(request, uid, resourceVersion) of the pod, or the outcome when it is bound."""
        path = f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}"
        self.reads += 1
        try:
            async with asyncio.timeout(max(0.0, _left(deadline))):
                pod = await self.api.get(path)
        except TimeoutError:
            raise BindError("timeout", f"{args.key}: no time left to read the pod within the "
                            "caller's deadline") from None
        except (ApiError, httpx.HTTPError) as e:
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

    async def bind(self, args: BindingArgs, deadline: float | None = None) -> BindOutcome:
        """Bind, or raise BindError. ``deadline`` (``time.monotonic()``): when the caller's
        patience ends less a margin, counted from its request's first byte; default: now plus
        ``bind_timeout``. A refusal gives back the pick its filter held."""
        if deadline is None:
            deadline = time.monotonic() + self.bind_timeout
        try:
            return await self._bind_entry(args, deadline)
        except BindError as e:
            if e.reason != "unsettled" and args.key not in self.unsettled:
                self._release_pick(args.key, e.reason)
            raise

    def _release_pick(self, key: str, reason: str) -> None:
        """A bind refused before its GPUs were reserved: what its filter held goes."""
        view = self.view()
        if view.held_pick(key) is not None:
            view.holds.drop_one(key, "bind-refused", reason)

    async def _bind_entry(self, args: BindingArgs, deadline: float) -> BindOutcome:
        if args.key in self.unsettled:
            return await self._rebind_unsettled(args)
        if not self.may_bind():
            raise BindError("not-leader", "this sharegpu extender replica is not the leader")
        self._refuse("no-such-node", self.scope.node_refusal(args.node))
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
        got = await self._read(args, deadline)
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
                    rv = await self._patch_labels(args, claim, rv, deadline)
            if not self.may_bind():
                raise BindError("not-leader", "lost the leader lease before binding")
            await self._post_binding(args, args.pod_uid or uid, anns, rv, deadline)
        except _Unknown as e:
            if await self._bound_now(path, args, deadline):
                self.view().bound(req.key)
                return BindOutcome(args.node, r.alloc.gpus)
            raise self._keep(args, e) from None
        except BaseException as e:
            if isinstance(e, ApiError) and hinted and e.status == 409 \
                    and not await self._bound_now(path, args, deadline):
                # the pod changed since filter saw it: start over from a fresh read
                self.view().release_inflight(req.key)
                self._unclaim(args)
                return None
            if isinstance(e, ApiError | BindError) and await self._bound_now(path, args,
                                                                             deadline):
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
        """The one write: the binding with the annotations, never sent past ``deadline``, with
        what is left as the API server's own ``timeout``. Raises ``_Unknown`` when it may
        have been written (no answer by the deadline, the connection lost, a server error)."""
        left = _left(deadline)
        if left <= 0.01:
            raise BindError("timeout", f"{args.key}: no time left to bind within the caller's "
                            "deadline (counted from its request's arrival)")
        self.writes += 1
        try:
            async with asyncio.timeout(left):
                await self.api.bind(args.pod_namespace, args.pod_name, uid, args.node,
                                    annotations=annotations, resource_version=rv,
                                    timeout_s=left)
        except TimeoutError:
            raise _Unknown(f"{args.key}: the binding was not answered within the caller's "
                           f"deadline ({left:.2f} s left when sent)", left) from None
        except ApiError as e:
            if e.status in _NOT_WRITTEN:
                raise
            # answered: the API server is done with it (a commit it started lands within grace)
            raise _Unknown(f"binding {args.key} failed: {e}", 0.0) from None
        except _NOT_SENT as e:
            raise BindError("api-unreachable", f"binding {args.key}: the API server was not "
                            f"reached ({type(e).__name__})") from None
        except httpx.HTTPError as e:
            raise _Unknown(f"binding {args.key}: {type(e).__name__} {e}", left) from None

    def _keep(self, args: BindingArgs, e: _Unknown) -> BindError:
        """The Binding may still land: its reservation and unit stay until it settles."""
        self.unsettled.add(args.key, args.node, e.server_timeout, str(e))
        self._count("kept")
        log.warning("bind %s to %s: outcome unknown (%s): its GPUs stay reserved until the "
                    "pod is seen bound or the API server's timeout has passed", args.key,
                    args.node, e)
        return BindError("unknown-outcome", f"{e}; the GPUs stay reserved until the outcome "
                         "is known (kube-scheduler retries the pod)")

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.unsettled.counts[(outcome,)] += 1

    async def _bound_now(self, path: str, args: BindingArgs, deadline: float) -> bool:
        """Whether a read made while time is left shows the pod bound to the node."""
        left = _left(deadline)
        if left <= 0.05:
            return False
        try:
            async with asyncio.timeout(left):
                pod = await self.api.get(path)
        except (TimeoutError, ApiError, httpx.HTTPError):
            return False
        return (pod.get("spec") or {}).get("nodeName") == args.node

    async def _rebind_unsettled(self, args: BindingArgs) -> BindOutcome:
        """A bind of a pod whose earlier Binding has no known outcome: bound there already, or
        refused until it settles (nothing it holds is given back meanwhile)."""
        u = self.unsettled.get(args.key)
        assert u is not None
        path = f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}"
        try:
            pod = await self.api.get(path)
        except (ApiError, httpx.HTTPError):
            pod = {}
        node = (pod.get("spec") or {}).get("nodeName")
        if node and node == u.node == args.node:
            self._settle(args.key, pod)
            return BindOutcome(args.node, (), already=True)
        raise BindError("unsettled", f"{args.key}: an earlier binding to {u.node} has no known "
                        "outcome yet; its GPUs stay reserved until it settles")

    # -- unsettled binds ---------------
    def on_pod(self, kind: str, obj: Mapping[str, Any]) -> None:
        """A pod's watch event: settles its unsettled bind when it shows the outcome."""
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        if key not in self.unsettled:
            return
        if kind == "DELETED":
            self.unsettled.pop(key)
            self._unclaim_key(key)
            self._count("deleted")
            log.info("unsettled bind %s: the pod was deleted", key)
            return
        if (obj.get("spec") or {}).get("nodeName"):
            self._settle(key, obj)

    def _settle(self, key: str, pod: Mapping[str, Any]) -> None:
        """The pod is bound (here: confirmed; elsewhere: our reservation goes)."""
        u = self.unsettled.pop(key)
        if u is None:
            return
        node = (pod.get("spec") or {}).get("nodeName")
        if node == u.node:
            self.view().bound(key)
            self._count("confirmed")
            log.info("unsettled bind %s: the binding to %s landed; its GPUs are the pod's",
                     key, node)
            return
        self.view().release_inflight(key)
        self._unclaim_key(key)
        self._count("released")
        log.warning("unsettled bind %s: the pod is bound to %s, not %s; reservation released",
                    key, node, u.node)

    async def settle(self) -> None:
        """Decide the unsettled binds whose API server timeout (and grace) passed: a read
        shows the pod bound (confirmed) or not (the write never landed: released)."""
        for key in self.unsettled.due():
            ns, _, name = key.partition("/")
            try:
                pod = await self.api.get(f"/api/v1/namespaces/{ns}/pods/{name}")
            except ApiError as e:
                if e.status != 404:
                    self.unsettled.postpone(key, 1.0)
                    continue
                pod = None
            except httpx.HTTPError:
                self.unsettled.postpone(key, 1.0)
                continue
            if key not in self.unsettled:
                continue  # settled by the watch meanwhile
            if pod is not None and (pod.get("spec") or {}).get("nodeName"):
                self._settle(key, pod)
                continue
            u = self.unsettled.pop(key)
            self.view().release_inflight(key)
            self._unclaim_key(key)
            self._count("released")
            log.warning("unsettled bind %s to %s: the API server's timeout passed and the pod "
                        "is %s; its GPUs are released", key, u.node if u else "?",
                        "unbound" if pod is not None else "gone")

    def _unclaim_key(self, key: str) -> None:
        if self.units is not None:
            ns, _, name = key.partition("/")
            self.units.release(ns, name)

    async def _patch_labels(self, args: BindingArgs, claim: Claim, rv: str,
                            deadline: float) -> str:
        """The unit's labels (a Binding's labels reach the pod only where kube-apiserver's
        PodTopologyLabelsAdmission is on); the pod's new resourceVersion."""
        self.writes += 1
        try:
            async with asyncio.timeout(max(0.0, _left(deadline))):
                pod = await self.api.patch_pod_annotations(args.pod_namespace, args.pod_name,
                                                           {}, rv, labels=claim.labels)
        except TimeoutError:
            raise BindError("timeout", f"{args.key}: the unit's labels were not written within "
                            "the caller's deadline") from None
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
                    rv = await self._patch_labels(args, claim, rv, deadline)
            if not self.may_bind():
                raise BindError("not-leader", "lost the leader lease before binding")
            await self._post_binding(args, args.pod_uid or uid, anns,
                                     rv if claim is not None else "", deadline)
        except _Unknown as e:
            if await self._bound_now(path, args, deadline):
                return BindOutcome(args.node, ())
            raise self._keep(args, e) from None
        except (ApiError, BindError) as e:
            if await self._bound_now(path, args, deadline):
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


def _labels(claim: Claim | None) -> dict[str, Any]:
    """The labels argument of the patch, only when a unit sets labels."""
    return {"labels": claim.labels} if claim is not None and claim.labels else {}


def _left(deadline: float) -> float:
    return deadline - time.monotonic()
