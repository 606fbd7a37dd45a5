"""The node agent's ResourceSlice: published, kept current and withdrawn through the API server.

:class:`SlicePublisher` holds what the slice should say (:mod:`sharegpu.dra.resourceslices` builds
it from the GPUs, the node's mode and their health) and reconciles the API server to it: one
slice per node and driver under a fixed name, created when missing (also after the kubelet, which
deletes every ResourceSlice of its node when it starts, wiped it), replaced with the pool
generation + 1 when its content differs, left alone when it says the same (a restarted agent
writes nothing), other slices of the driver on the node deleted, and all of them deleted when the
node is not served through DRA. It reconciles on every change the agent reports, on every watch
event of its node's slices, and every ``resync_s``.

The slice's only ownerReference is the chart's DeviceClass: uninstalling the chart (or turning
DRA off in it) deletes the DeviceClass and the garbage collector deletes every slice with it.

:class:`SliceApi` is what the publisher needs from the API server; :class:`MemorySlices` is an
in-memory one (tests, ``--standalone``), :class:`LightkubeSlices` the production one.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.errors import ValidationError
from ..core.modes import Mode
from ..dra.resourceslices import (
    API_VERSION,
    DEVICE_CLASS,
    DRIVER,
    SliceGpu,
    build_slice,
    same_content,
    slice_name,
)

log = logging.getLogger(__name__)
Obj = dict[str, Any]


class SliceApiError(Exception):
    """The API server refused a call: ``code`` is its HTTP status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"HTTP {code}: {message}")
        self.code = code
        self.message = message


class SliceApi(Protocol):
    async def list_slices(self, node: str, driver: str) -> list[Obj]:
        """The ResourceSlices with ``spec.nodeName`` ``node`` and ``spec.driver`` ``driver``."""
        ...

    async def create_slice(self, obj: Obj) -> Obj: ...

    async def replace_slice(self, obj: Obj) -> Obj:
        """PUT with ``metadata.resourceVersion`` as precondition (409 when stale)."""
        ...

    async def delete_slice(self, name: str) -> None:
        """Deletes it; a missing one is not an error."""
        ...

    async def get_device_class(self, name: str) -> Obj | None: ...

    def watch_slices(self, node: str, driver: str) -> AsyncIterator[tuple[str, Obj]]:
        """(event type, object) for the node's slices of ``driver``, from now on."""
        ...


@dataclass(frozen=True)
class Wanted:
    """What the agent wants: ``gpus`` in ``mode`` through DRA, or (``active`` False) nothing."""

    active: bool
    gpus: tuple[SliceGpu, ...] = ()
    mode: Mode = Mode.EXCLUSIVE


class SlicePublisher:
    def __init__(self, api: SliceApi, node: str, *, driver: str = DRIVER,
                 device_class: str | None = DEVICE_CLASS, resync_s: float = 60.0,
                 retry_s: float = 1.0) -> None:
        self.api = api
        self.node = node
        self.driver = driver
        self.device_class = device_class  # None: no ownerReference (standalone)
        self.resync_s = resync_s
        self.retry_s = retry_s
        self.name = slice_name(node, driver)
        self.wanted: Wanted | None = None  # nothing reconciled before the agent says
        self.problem: str | None = None  # why the slice is not what is wanted, else None
        self.generation = 0  # the pool generation last written or seen
        self.writes = 0  # creates, replaces and deletes (tests read it)
        self.reconciles = 0
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._last: tuple[Any, Any] | None = None  # (sent spec, stored spec) of the last write

    # ------------------------------------------------------------ what the agent says
    def want(self, wanted: Wanted) -> None:
        """Record what the slice should say and wake the loop (does no I/O: callable from the
        agent's health thread through the event loop without waiting)."""
        if wanted != self.wanted:
            self.wanted = wanted
            self._kick.set()

    # ------------------------------------------------------------ one pass
    async def _owner(self) -> dict[str, str] | None:
        if self.device_class is None:
            return None
        dc = await self.api.get_device_class(self.device_class)
        if dc is None:
            raise ValidationError(
                "DeviceClass", self.device_class,
                "must exist before the agent publishes ResourceSlices (it owns them, so that "
                "uninstalling deletes them): install the chart with agent.dra.enabled=true")
        meta = dc.get("metadata") or {}
        return {"apiVersion": API_VERSION, "kind": "DeviceClass", "name": meta["name"],
                "uid": meta["uid"]}

    async def reconcile(self) -> str:
        """Make the API server say what is wanted; returns what it did: ``created``,
        ``updated``, ``unchanged``, ``deleted`` or ``absent``. Bad GPU data, a missing
        DeviceClass or a refusal by the API server raise; the slice is then withdrawn or left as
        it was, never half-written."""
        self.reconciles += 1
        wanted = self.wanted
        if wanted is None:
            return "unchanged"
        existing = await self.api.list_slices(self.node, self.driver)
        ours = next((s for s in existing if s["metadata"]["name"] == self.name), None)
        extra = [s for s in existing if s is not ours]
        deleted = False
        for s in extra:  # a leftover of another naming, or someone else's: one pool, one slice
            log.warning("deleting ResourceSlice %s: %s has one slice of %s per node (%s)",
                        s["metadata"]["name"], self.node, self.driver, self.name)
            await self.api.delete_slice(s["metadata"]["name"])
            self.writes += 1
            deleted = True
        if not wanted.active:
            if ours is not None:
                await self.api.delete_slice(self.name)
                self.writes += 1
                log.info("ResourceSlice %s deleted: %s is not served through DRA",
                         self.name, self.node)
            self.problem = None
            return "deleted" if ours is not None or deleted else "absent"
        if ours is not None:
            self.generation = max(self.generation, int(ours["spec"]["pool"].get("generation", 0)))
        try:
            owner = await self._owner()
            desired = build_slice(self.node, wanted.gpus, wanted.mode,
                                  generation=self.generation + 1, driver=self.driver, owner=owner)
        except ValidationError as e:
            self.problem = str(e)
            if ours is not None:  # what it says is no longer known to be true
                await self.api.delete_slice(self.name)
                self.writes += 1
            raise
        if ours is not None:
            if self._says(ours, desired):
                self.problem = None
                if self.reconciles == 1:  # a restarted agent: say it found its slice
                    log.info("ResourceSlice %s is current (pool generation %d): nothing written",
                             self.name, self.generation)
                return "deleted" if deleted else "unchanged"
            body = copy.deepcopy(desired)
            body["metadata"]["resourceVersion"] = ours["metadata"]["resourceVersion"]
            stored = await self.api.replace_slice(body)
            verb = "updated"
        else:
            stored = await self.api.create_slice(desired)
            verb = "created"
        self.writes += 1
        self.generation = int(desired["spec"]["pool"]["generation"])
        self._last = (desired["spec"], stored.get("spec") or {})
        if not same_content(stored.get("spec") or {}, desired["spec"]):
            self.problem = (
                f"the API server stored ResourceSlice {self.name} with other content than sent "
                "(fields dropped: is the feature gate DRAConsumableCapacity on? it is on by "
                "default from Kubernetes 1.36)")
            log.error("%s", self.problem)
        else:
            self.problem = None
        log.info("ResourceSlice %s %s: %d device(s), mode %s, pool generation %d", self.name,
                 verb, len(wanted.gpus), wanted.mode.value, self.generation)
        return verb

    def _says(self, stored: Obj, desired: Obj) -> bool:
        """Whether the stored slice already says what ``desired`` says (its owner included)."""
        if (stored["metadata"].get("ownerReferences") or []) != (
                desired["metadata"].get("ownerReferences") or []):
            stripped = [{k: r.get(k) for k in ("apiVersion", "kind", "name", "uid")}
                        for r in stored["metadata"].get("ownerReferences") or []]
            if stripped != (desired["metadata"].get("ownerReferences") or []):
                return False
        if same_content(stored["spec"], desired["spec"]):
            return True
        # the server rewrote what was last sent (a dropped field): writing again changes nothing
        return self._last is not None and same_content(self._last[0], desired["spec"]) and \
            same_content(self._last[1], stored["spec"])

    # ------------------------------------------------------------ the loop
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name="resourceslice"),
                       asyncio.create_task(self._watch(), name="resourceslice-watch")]

    async def stop(self) -> None:
        """Stops reconciling; the slice stays (a restarting agent finds it; see docs/dra.md for
        when it goes)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    async def _run(self) -> None:
        delay = self.retry_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.resync_s)
            self._kick.clear()
            try:
                await self.reconcile()
                delay = self.retry_s
            except asyncio.CancelledError:
                raise
            except ValidationError as e:
                log.error("ResourceSlice %s not published: %s", self.name, e)
                await self._backoff(delay)
                delay = min(delay * 2, 60.0)
            except Exception as e:  # API server away, conflict, refusal: try again
                self.problem = f"ResourceSlice {self.name}: {e}"
                log.warning("ResourceSlice %s: %s; retrying in %.1fs", self.name, e, delay)
                await self._backoff(delay)
                delay = min(delay * 2, 60.0)

    async def _backoff(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._kick.set()

    async def _watch(self) -> None:
        """Any change to the node's slices by someone else (the kubelet wiping them, a user
        editing one) makes the loop look again."""
        delay = self.retry_s
        while True:
            try:
                async for _kind, _obj in self.api.watch_slices(self.node, self.driver):
                    delay = self.retry_s
                    self._kick.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("ResourceSlice watch ended (%s); again in %.1fs", e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
            self._kick.set()


def slice_gpus(gpus: Sequence[Any], links: Sequence[Sequence[str]] | None,
               unhealthy: set[int], withheld: set[int]) -> tuple[SliceGpu, ...]:
    """The agent's GPUs (:class:`sharegpu.agent.nvml.Gpu`) as the slice describes them."""
    from ..dra.resourceslices import nvlink_peers

    return tuple(SliceGpu(index=g.index, uuid=g.uuid, model=g.name, mem_mib=g.mem_mib,
                          mem_gib=g.mem_gib, nvlink_peers=nvlink_peers(links, g.index),
                          unhealthy=g.index in unhealthy, isolation_unavailable=g.index in withheld)
                 for g in gpus)


# ---------------------------------------------------------------- in memory


class MemorySlices:
    """ResourceSlices and DeviceClasses held in memory with the API server's write semantics
    that the publisher meets: 409 on an existing name or a stale resourceVersion, 404 on a
    missing one, resourceVersion and uid set by the server, watch events."""

    def __init__(self) -> None:
        self.slices: dict[str, Obj] = {}
        self.classes: dict[str, Obj] = {}
        self.calls: list[tuple[str, str]] = []
        self._rv = itertools.count(1)
        self._watchers: list[asyncio.Queue[tuple[str, Obj]]] = []

    def add_device_class(self, name: str, uid: str = "dc-uid-1") -> None:
        self.classes[name] = {"metadata": {"name": name, "uid": uid}}

    def _event(self, kind: str, obj: Obj) -> None:
        for q in self._watchers:
            q.put_nowait((kind, copy.deepcopy(obj)))

    def remove(self, name: str) -> None:
        """Delete a slice as someone else would (the kubelet at its start)."""
        obj = self.slices.pop(name)
        self._event("DELETED", obj)

    async def list_slices(self, node: str, driver: str) -> list[Obj]:
        self.calls.append(("list", node))
        return [copy.deepcopy(s) for s in self.slices.values()
                if s["spec"].get("nodeName") == node and s["spec"].get("driver") == driver]

    async def create_slice(self, obj: Obj) -> Obj:
        name = obj["metadata"]["name"]
        self.calls.append(("create", name))
        if name in self.slices:
            raise SliceApiError(409, f'resourceslices "{name}" already exists')
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(next(self._rv))
        stored["metadata"]["uid"] = f"uid-{name}-{stored['metadata']['resourceVersion']}"
        self.slices[name] = stored
        self._event("ADDED", stored)
        return copy.deepcopy(stored)

    async def replace_slice(self, obj: Obj) -> Obj:
        name = obj["metadata"]["name"]
        self.calls.append(("replace", name))
        old = self.slices.get(name)
        if old is None:
            raise SliceApiError(404, f'resourceslices "{name}" not found')
        if obj["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
            raise SliceApiError(409, "the object has been modified")
        for immutable in ("driver", "nodeName"):
            if obj["spec"].get(immutable) != old["spec"].get(immutable):
                raise SliceApiError(422, f"spec.{immutable}: field is immutable")
        stored = copy.deepcopy(obj)
        stored["metadata"]["uid"] = old["metadata"]["uid"]
        stored["metadata"]["resourceVersion"] = str(next(self._rv))
        self.slices[name] = stored
        self._event("MODIFIED", stored)
        return copy.deepcopy(stored)

    async def delete_slice(self, name: str) -> None:
        self.calls.append(("delete", name))
        obj = self.slices.pop(name, None)
        if obj is not None:
            self._event("DELETED", obj)

    async def get_device_class(self, name: str) -> Obj | None:
        dc = self.classes.get(name)
        return copy.deepcopy(dc) if dc is not None else None

    async def watch_slices(self, node: str, driver: str) -> AsyncIterator[tuple[str, Obj]]:
        q: asyncio.Queue[tuple[str, Obj]] = asyncio.Queue()
        self._watchers.append(q)
        try:
            while True:
                kind, obj = await q.get()
                if obj["spec"].get("nodeName") == node and obj["spec"].get("driver") == driver:
                    yield kind, obj
        finally:
            self._watchers.remove(q)


# ---------------------------------------------------------------- lightkube


class LightkubeSlices:
    """:class:`SliceApi` through lightkube's async client, with generic resources (plain dicts:
    no typed model drops a field the publisher wrote)."""

    def __init__(self, client: Any) -> None:
        from lightkube.generic_resource import create_global_resource

        self.client = client
        self.rs = create_global_resource("resource.k8s.io", "v1", "ResourceSlice",
                                         "resourceslices")
        self.dc = create_global_resource("resource.k8s.io", "v1", "DeviceClass", "deviceclasses")

    @staticmethod
    def _plain(obj: Any) -> Obj:
        return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)

    async def _call(self, coro: Any) -> Any:
        from lightkube import ApiError

        try:
            return await coro
        except ApiError as e:
            raise SliceApiError(int(e.status.code or 0), e.status.message or str(e)) from None

    async def list_slices(self, node: str, driver: str) -> list[Obj]:
        async def run() -> list[Obj]:
            return [self._plain(s) async for s in self.client.list(
                self.rs, fields={"spec.nodeName": node, "spec.driver": driver})]

        return list(await self._call(run()))

    async def create_slice(self, obj: Obj) -> Obj:
        return self._plain(await self._call(self.client.create(self.rs.from_dict(obj))))

    async def replace_slice(self, obj: Obj) -> Obj:
        return self._plain(await self._call(self.client.replace(self.rs.from_dict(obj))))

    async def delete_slice(self, name: str) -> None:
        try:
            await self._call(self.client.delete(self.rs, name))
        except SliceApiError as e:
            if e.code != 404:
                raise

    async def get_device_class(self, name: str) -> Obj | None:
        try:
            return self._plain(await self._call(self.client.get(self.dc, name)))
        except SliceApiError as e:
            if e.code == 404:
                return None
            raise

    async def watch_slices(self, node: str, driver: str) -> AsyncIterator[tuple[str, Obj]]:
        async for kind, obj in self.client.watch(
                self.rs, fields={"spec.nodeName": node, "spec.driver": driver}):
            yield kind, self._plain(obj)
