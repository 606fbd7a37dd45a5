"""List + watch of Nodes and Pods feeding the :class:`ClusterView` incrementally.

- Start: list both, rebuild every GPU's allocation from pod annotations (``view.reset``), and
  only then report ready.
- Watches resume from the last resourceVersion after a dropped connection; ``410 Gone``
  (too old) means a relist and a rebuild.
- DRA mode: ResourceSlices and ResourceClaims (``resource.k8s.io/v1``) are listed
  and watched too, so that DRA nodes have GPUs and allocated claims hold their shares. An API
  server without ``resource.k8s.io/v1`` (404) or an extender without the rights (403) is told
  once, at the first list, and the extender goes on without DRA, as before.
- A periodic consistency check relists pods and compares the state rebuilt from their
  annotations with the live one; a difference is counted in a metric and repaired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..core.state import ClusterState
from ..kubeio.aio import cancel_all
from .kube import CLAIMS, NODES, PODS, SLICES, ApiError, Gone, KubeApi
from .metrics import Metrics
from .view import ClusterView

log = logging.getLogger(__name__)

CHECK_CHUNK = 500  # pods a consistency check reads between two turns of the event loop


def _rv(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _rv_int(rv: str) -> int | None:
    return int(rv) if rv.isdigit() else None


class Informer:
    def __init__(self, api: KubeApi, view: ClusterView, metrics: Metrics | None = None, *,
                 check_every: float = 300.0, backoff: float = 0.5,
                 on_event: Callable[[str, str, dict[str, Any]], None] | None = None,
                 on_reset: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None]
                 | None = None, dra: bool = True) -> None:
        """``dra``: list and watch ResourceSlices and ResourceClaims (DRA mode); when False
        they are never asked for."""
        self.api = api
        self.view = view
        self.metrics = metrics
        self.check_every = check_every
        self.backoff = backoff
        self.on_event = on_event
        self.on_reset = on_reset  # told of each rebuild's lists (before held events replay)
        self.rv = {PODS: "", NODES: "", SLICES: "", CLAIMS: ""}
        # whether each watch is streaming now (not resuming after a drop, not relisting)
        self.live = {PODS: False, NODES: False, SLICES: False, CLAIMS: False}
        # whether DRA objects are listed and watched: None until the first list tells
        self.dra: bool | None = None if dra else False
        self.ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._relist_lock = asyncio.Lock()
        self._held: list[tuple[str, str, dict[str, Any]]] | None = None

    async def start(self) -> None:
        await self.relist()
        self.ready.set()
        self._tasks = [
            asyncio.create_task(self._watch(NODES), name="watch-nodes"),
            asyncio.create_task(self._watch(PODS), name="watch-pods"),
        ]
        if self.dra:
            self._tasks += [
                asyncio.create_task(self._watch(SLICES), name="watch-resourceslices"),
                asyncio.create_task(self._watch(CLAIMS), name="watch-resourceclaims"),
            ]
        if self.check_every > 0:
            self._tasks.append(asyncio.create_task(self._checks(), name="consistency-check"))

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        self._tasks = []

    def current(self) -> bool:
        """Whether the view follows the API server right now: rebuilt, both watches streaming,
        no relist under way. Events older than a few seconds have then been applied."""
        return (self.view.synced and self.live[PODS] and self.live[NODES]
                and (not self.dra or (self.live[SLICES] and self.live[CLAIMS]))
                and not self._relist_lock.locked())

    async def _list_dra(self) -> tuple[tuple[list[dict[str, Any]], str],
                                       tuple[list[dict[str, Any]], str]] | None:
        """ResourceSlices and ResourceClaims, or ``None`` when DRA is off here (decided at
        the first list: no ``resource.k8s.io/v1`` or no right to list them)."""
        if self.dra is False:
            return None
        try:
            slices = await self.api.list(SLICES)
            claims = await self.api.list(CLAIMS)
        except ApiError as e:
            if self.dra is None and e.status in (403, 404):
                self.dra = False
                log.warning("DRA mode off: cannot list resource.k8s.io/v1 resourceslices and "
                            "resourceclaims (%s); DRA pods are not ranked", e)
                return None
            raise
        self.dra = True
        return slices, claims

    async def relist(self) -> None:
        """List nodes and pods and rebuild the view from them."""
        async with self._relist_lock:
            # events that arrive while listing are held back, then replayed over the rebuilt
            # view when they are newer than the list (older ones are in it already)
            self._held = []
            try:
                nodes, nrv = await self.api.list(NODES)
                pods, prv = await self.api.list(PODS)
                dra = await self._list_dra()
            except BaseException:
                held, self._held = self._held, None
                for path, kind, obj in held:
                    self.apply(path, kind, obj)
                raise
            t0 = time.perf_counter()
            bad = self.view.reset(nodes, pods, None if dra is None else (dra[0][0], dra[1][0]))
            if self.on_reset is not None:
                self.on_reset(nodes, pods)
            held, self._held = self._held, None
            at = {NODES: nrv, PODS: prv}
            if dra is not None:
                at |= {SLICES: dra[0][1], CLAIMS: dra[1][1]}
            listed = {path: _rv_int(rv) for path, rv in at.items()}
            for path, kind, obj in held:
                was, rv = listed.get(path), _rv_int(_rv(obj))
                if was is None or rv is None or rv > was:
                    self.apply(path, kind, obj)
            if self.metrics is not None:
                self.metrics.rebuild_seconds.set(time.perf_counter() - t0)
                self.metrics.relists.labels("all").inc()
            for path, at_rv in at.items():
                if (_rv_int(self.rv[path]) or 0) < (_rv_int(at_rv) or 0):
                    self.rv[path] = at_rv
            if bad:
                log.warning("rebuild: %d pod(s) with annotations that could not be applied", bad)

    def apply(self, path: str, kind: str, obj: dict[str, Any]) -> None:
        if self._held is not None:
            self._held.append((path, kind, obj))
            return
        if path == SLICES:
            (self.view.delete_slice if kind == "DELETED" else self.view.upsert_slice)(obj)
        elif path == CLAIMS:
            (self.view.delete_claim if kind == "DELETED" else self.view.upsert_claim)(obj)
        elif path == NODES:
            if kind == "DELETED":
                self.view.delete_node(str((obj.get("metadata") or {}).get("name") or ""))
            else:
                self.view.upsert_node(obj)
        elif kind == "DELETED":
            self.view.delete_pod(obj)
        else:
            self.view.upsert_pod(obj)
        if self.on_event is not None:
            self.on_event(path, kind, obj)

    async def _watch(self, path: str) -> None:
        failures = 0
        while True:
            try:
                self.live[path] = True
                async for kind, obj in self.api.watch(path, self.rv[path]):
                    failures = 0
                    rv = _rv(obj)
                    if rv:
                        self.rv[path] = rv
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self.apply(path, kind, obj)
            except asyncio.CancelledError:
                self.live[path] = False
                raise
            except Gone:
                self.live[path] = False
                log.info("watch %s: resourceVersion %s is gone; relisting", path, self.rv[path])
                await self._relist_retrying()
                continue
            except Exception as e:  # dropped connection, server error, bad line
                self.live[path] = False
                failures += 1
                log.info("watch %s dropped (%s); resuming from %s", path, e, self.rv[path])
                await asyncio.sleep(min(self.backoff * failures, 5.0))
                continue
            # the server ended the watch (timeout): resume from the last resourceVersion

    async def _relist_retrying(self) -> None:
        delay = self.backoff
        while True:
            try:
                await self.relist()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("relist failed: %s", e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _checks(self) -> None:
        while True:
            await asyncio.sleep(self.check_every)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("consistency check failed to run: %s", e)

    async def check(self, settle_s: float = 5.0) -> list[str]:
        """Relist pods, rebuild a state from their annotations and compare it with the live one
        (in-flight reservations added). Returns the pods that differ; a difference is counted
        and repaired by a rebuild. Pods the view changed or learnt about while the check ran
        (bound by this replica, or newer watch events) are compared by the view's own record:
        the list may show them as they were before."""
        changed = self.view.track_changes()
        try:
            pods, prv = await self.api.list(PODS)
            want = _rv_int(prv)
            deadline = time.monotonic() + settle_s
            # let the watch catch up with the list before comparing
            while want is not None and time.monotonic() < deadline:
                have = _rv_int(self.rv[PODS])
                if have is not None and have >= want:
                    break
                await asyncio.sleep(0.05)
            diff = await self.compare_async(pods, changed)
        finally:
            self.view.untrack_changes(changed)
        if diff:
            log.warning("consistency check: %d pod(s) differ from their annotations: %s",
                        len(diff), ", ".join(diff[:5]))
            if self.metrics is not None:
                self.metrics.drift.inc()
                self.metrics.drifted_pods.set(len(diff))
            await self.relist()
        elif self.metrics is not None:
            self.metrics.drifted_pods.set(0)
        return diff

    def compare(self, pods: list[dict[str, Any]],
                changed: Collection[str] = ()) -> list[str]:
        """The pods whose GPUs differ between the live view and a state rebuilt from ``pods``
        (a list). ``changed``: pods the view changed since the list began; they are taken
        from the view's own record (the list may predate them: created, bound or deleted
        since)."""
        read = _Read()
        for obj in pods:
            self._read_pod(obj, changed, read)
        return self._diff(read, changed)

    async def compare_async(self, pods: list[dict[str, Any]],
                            changed: Collection[str] = ()) -> list[str]:
        """:meth:`compare`, reading the pods ``CHECK_CHUNK`` at a time and letting the event
        loop run between chunks (requests are answered meanwhile); a pod the view changes
        meanwhile joins ``changed`` and is taken from the view's record."""
        read = _Read()
        for i in range(0, len(pods), CHECK_CHUNK):
            for obj in pods[i:i + CHECK_CHUNK]:
                self._read_pod(obj, changed, read)
            await asyncio.sleep(0)
        return self._diff(read, changed)

    def _read_pod(self, obj: Mapping[str, Any], changed: Collection[str], read: _Read) -> None:
        from ..core.errors import ValidationError
        from ..core.hostresources import charges_node

        view = self.view
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        if key in view.inflight or key in changed:
            return
        node = charges_node(obj)
        if node:
            read.host.append((key, node, *view.reader.host(obj)))
        try:
            p = view.reader.placement(obj) or view.known_bound(obj)
            u = None if p is not None else view.reader.unannotated(obj)
        except ValidationError:
            return
        if p is not None:
            read.placed.append((key, p))
        elif u is not None:
            read.unseen.append((key, u))

    def _diff(self, read: _Read, changed: Collection[str]) -> list[str]:
        from ..core.errors import PlacementError

        view = self.view
        specs = [s for s in view.state.specs if s is not None]
        # a pod read before the view changed it (or took it in flight) is taken from the view
        skip = set(changed) | set(view.inflight)
        placed = [p for k, p in read.placed if k not in skip]
        unseen = [u for k, u in read.unseen if k not in skip]
        host = [h for h in read.host if h[0] not in skip]
        for key in changed:
            if key in view.inflight:
                continue
            held = view.state.pods.get(key)
            if key in view.placed:
                placed.append(view.placed[key])
            elif key in view.unseen and held is not None:
                unseen.append((held.request, held.node))
            if key in view.host:
                host.append((key, *view.host[key]))
        fresh = ClusterState(specs)
        fresh.restore(placed)
        for req, node in unseen:  # charged after every recorded decision, as a rebuild does
            if node in fresh.index:
                with contextlib.suppress(PlacementError):
                    fresh.charge_unseen(req, node)
        for req, node, alloc in view.dra_holds():  # allocated DRA claims, as a rebuild does
            with contextlib.suppress(PlacementError, KeyError):
                fresh.hold(req, node, alloc)
        for r in view.inflight.values():
            with contextlib.suppress(PlacementError, KeyError):
                fresh.reserve(r.request, r.node, r.alloc, check_host=False)
        for key, node, cpu, mem in host:
            if key not in fresh.pods and node in fresh.index:
                fresh.charge_host(node, cpu, mem)
        a, b = fresh.fingerprint(), view.state.fingerprint()
        diff: set[str] = set()
        for node in set(a) | set(b):
            if a.get(node) != b.get(node):
                pa = set(a[node][-1]) if node in a else set()  # type: ignore[index]
                pb = set(b[node][-1]) if node in b else set()  # type: ignore[index]
                diff |= (pa ^ pb) or {f"node/{node}"}
        return sorted(diff)


class _Read:
    """What a consistency check read from the listed pods, by pod key."""

    def __init__(self) -> None:
        self.placed: list[tuple[str, Any]] = []
        self.unseen: list[tuple[str, Any]] = []
        # bound, live pods with their host CPU and memory (charged unless held with GPUs)
        self.host: list[tuple[str, str, int, int]] = []


__all__ = ["ApiError", "Informer"]
