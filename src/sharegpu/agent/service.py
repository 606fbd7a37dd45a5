"""The node agent: one per GPU node.

It finds the GPUs (NVML), labels the node with its card model, serves every GPU resource to the
kubelet (the active mode's with devices, the others with none), follows the node label
``ack.node.gpu.schedule`` live, hands each container the GPUs the scheduler chose, marks GPUs
unhealthy on critical XID events, and registers again whenever the kubelet restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .. import names
from ..aio import cancel_all
from ..errors import ValidationError
from ..modes import Mode, card_model_labels, parse_mode
from .allocate import AllocationError, Allocator, Grant, pending_candidates
from .devices import SOCKETS, DeviceMap, devices_for
from .isolation import Backend, IsolationConfig, backend_for
from .kube import KubeApi
from .nvml import Nvml
from .plugin import KUBELET_SOCKET, DevicePlugin

log = logging.getLogger(__name__)

MODE_FILE = "last-mode"


@dataclass
class AgentConfig:
    node_name: str
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    state_dir: str = "/var/lib/sharegpu"
    isolation: str = "auto"
    isolation_paths: IsolationConfig = field(default_factory=IsolationConfig)
    kubelet_poll_s: float = 0.2
    recover_after_s: float = 300.0  # a GPU is healthy again after this long without XIDs
    health_poll_s: float = 1.0
    allocate_retries: int = 3  # re-list pods this often when a request matches no pod yet
    allocate_retry_s: float = 0.3


class Agent:
    def __init__(self, config: AgentConfig, nvml: Nvml, kube: KubeApi) -> None:
        self.config = config
        self.nvml = nvml
        self.kube = kube
        self.gpus = nvml.gpus()
        self.devices = DeviceMap(self.gpus)
        self.allocator = Allocator(config.node_name, self.devices,
                                   isolation=config.isolation_paths)
        self.mode: Mode = Mode.EXCLUSIVE
        self.labels: dict[str, str] = {}
        self.unhealthy: set[int] = set()
        self.plugins = {r: DevicePlugin(r, sock, self) for r, sock in SOCKETS.items()}
        self.registrations = 0  # registration rounds completed (tests and metrics read it)
        self.allocations = 0
        self.allocation_failures = 0
        self._background: set[asyncio.Task] = set()
        self._next_list: asyncio.Future[list[dict]] | None = None
        self._list_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mode_changed = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        os.makedirs(self.config.state_dir, exist_ok=True)
        node = await self._get_node()
        self.labels = dict((node.get("metadata") or {}).get("labels") or {})
        self.mode = self._initial_mode(node)
        await self._publish_node(explicit=self._label_mode() is not None)
        await self._refresh_devices()
        await self._start_plugins()
        self._tasks = [
            asyncio.create_task(self._watch_node(), name="watch-node"),
            asyncio.create_task(self._watch_kubelet(), name="watch-kubelet"),
            asyncio.create_task(self._watch_health(), name="watch-health"),
        ]
        log.info("agent on %s: %d GPU(s) %s, mode %s", self.config.node_name, len(self.gpus),
                 [g.mem_gib for g in self.gpus], self.mode)

    async def _get_node(self) -> dict:
        """The node object, waiting for the API server (an agent that crashes while the API is
        away would only restart into the same wait)."""
        delay = 0.5
        while True:
            try:
                return await self.kube.get_node(self.config.node_name)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("reading node %s failed (%s); retrying in %.1fs",
                            self.config.node_name, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def stop(self) -> None:
        self._stop.set()
        await cancel_all(self._tasks)
        self._tasks = []
        for t in list(self._background):
            t.cancel()
        for p in self.plugins.values():
            await p.stop()

    async def run_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    # ------------------------------------------------------------------ mode
    def _label_mode(self) -> Mode | None:
        raw = self.labels.get(names.LABEL_SCHEDULE)
        if not raw:
            return None
        try:
            return parse_mode(raw)
        except ValidationError as e:
            log.error("node %s: %s; keeping mode %s", self.config.node_name, e, self.mode)
            return None

    def _mode_path(self) -> str:
        return os.path.join(self.config.state_dir, MODE_FILE)

    def _initial_mode(self, node: Mapping) -> Mode:
        explicit = self._label_mode()
        if explicit is not None:
            return explicit
        try:
            with open(self._mode_path()) as f:
                return parse_mode(f.read().strip())
        except (OSError, ValidationError):
            pass
        raw = ((node.get("metadata") or {}).get("annotations") or {}).get(
            names.ANN_NODE_LAST_MODE
        )
        try:
            return parse_mode(raw) if raw else Mode.EXCLUSIVE
        except ValidationError:
            return Mode.EXCLUSIVE

    def _remember(self, mode: Mode) -> None:
        tmp = self._mode_path() + ".tmp"
        with open(tmp, "w") as f:
            f.write(mode.value + "\n")
        os.replace(tmp, self._mode_path())

    async def _publish_node(self, *, explicit: bool) -> None:
        """Card-model labels, per-GPU sizes, link matrix and the remembered mode on the node."""
        if explicit:
            self._remember(self.mode)
        labels: dict[str, str | None] = {}
        annotations: dict[str, str | None] = {
            names.ANN_NODE_GPU_MEM: ",".join(str(g.mem_gib) for g in self.gpus),
        }
        if explicit or os.path.exists(self._mode_path()):
            annotations[names.ANN_NODE_LAST_MODE] = self.mode.value
        if self.gpus:
            first = self.gpus[0]
            labels.update(card_model_labels(first.name, first.mem_mib, len(self.gpus)))
            try:
                links = self.nvml.links()
            except Exception:  # NVML without topology support
                links = None
            if links:
                annotations[names.ANN_NODE_GPU_TOPOLOGY] = json.dumps(links)
        await self.kube.patch_node_metadata(
            self.config.node_name, labels=labels, annotations=annotations
        )

    async def set_labels(self, labels: Mapping[str, str]) -> None:
        """React to the node's labels (from the watch)."""
        self.labels = dict(labels)
        explicit = self._label_mode()
        if explicit is None or explicit == self.mode:
            if explicit is not None and not os.path.exists(self._mode_path()):
                self._remember(explicit)
            return
        log.info("node %s: mode %s -> %s", self.config.node_name, self.mode, explicit)
        self.mode = explicit
        self._remember(explicit)
        await self.kube.patch_node_metadata(
            self.config.node_name, annotations={names.ANN_NODE_LAST_MODE: explicit.value}
        )
        await self._refresh_devices()
        self._mode_changed.set()

    @property
    def backend(self) -> Backend:
        return backend_for(self.config.isolation, self.mode)

    # ------------------------------------------------------------------ devices
    async def _refresh_devices(self) -> None:
        for r, p in self.plugins.items():
            await p.set_devices(devices_for(r, self.mode, self.gpus, self.unhealthy))

    async def _start_plugins(self) -> None:
        d = self.config.device_plugin_dir
        os.makedirs(d, exist_ok=True)
        for p in self.plugins.values():
            await p.start(d)
        await self._register_all()

    async def _register_all(self) -> bool:
        d = self.config.device_plugin_dir
        if not os.path.exists(os.path.join(d, KUBELET_SOCKET)):
            return False
        ok = True
        for p in self.plugins.values():
            try:
                await p.register(d)
            except Exception as e:  # kubelet not answering yet: the watch retries
                log.warning("register %s with the kubelet failed: %s", p.resource, e)
                ok = False
        if ok:
            self.registrations += 1
        return ok

    def _kubelet_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.config.device_plugin_dir, KUBELET_SOCKET))
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    async def _watch_kubelet(self) -> None:
        """Register again when the kubelet re-creates its socket (a kubelet restart also wipes
        our sockets, so the servers are restarted too)."""
        d = self.config.device_plugin_dir
        seen = self._kubelet_id() if self.registrations else None
        while True:
            await asyncio.sleep(self.config.kubelet_poll_s)
            now = self._kubelet_id()
            missing = [p for p in self.plugins.values()
                       if not os.path.exists(os.path.join(d, p.socket_name))]
            if now is None:
                seen = None
                continue
            if now == seen and not missing:
                continue
            log.info("kubelet socket (re)appeared: registering every resource again")
            for p in self.plugins.values():
                if p in missing or now != seen:
                    await p.stop()
                    await p.start(d)
                    await p.set_devices(p.devices)
            if await self._register_all():
                seen = now

    async def _watch_node(self) -> None:
        backoff = 0.5
        while True:
            try:
                async for node in self.kube.watch_node(self.config.node_name):
                    backoff = 0.5
                    await self.set_labels((node.get("metadata") or {}).get("labels") or {})
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("node watch failed (%s); retrying in %.1fs", e, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    # ------------------------------------------------------------------ health
    async def _watch_health(self) -> None:
        await asyncio.to_thread(self._health_loop)

    def _health_loop(self) -> None:
        last_xid: dict[int, float] = {}
        while not self._stop.is_set():
            try:
                ev = self.nvml.wait_event(self.config.health_poll_s)
            except Exception as e:
                log.warning("NVML event wait failed: %s", e)
                time.sleep(self.config.health_poll_s)
                ev = None
            changed = False
            if ev is not None and ev.critical and 0 <= ev.gpu < len(self.gpus):
                log.error("GPU %d: critical XID %d: marking its devices unhealthy", ev.gpu, ev.xid)
                last_xid[ev.gpu] = time.monotonic()
                if ev.gpu not in self.unhealthy:
                    self.unhealthy = self.unhealthy | {ev.gpu}
                    changed = True
            for g in sorted(self.unhealthy):
                quiet = time.monotonic() - last_xid.get(g, 0.0) >= self.config.recover_after_s
                if quiet and self.nvml.responsive(g):
                    log.info("GPU %d answers again and had no XID for %.0fs: healthy", g,
                             self.config.recover_after_s)
                    self.unhealthy = self.unhealthy - {g}
                    changed = True
            if changed and self._loop is not None and not self._stop.is_set():
                fut = asyncio.run_coroutine_threadsafe(self._refresh_devices(), self._loop)
                with contextlib.suppress(Exception):
                    fut.result(timeout=5)

    # ------------------------------------------------------------------ allocation
    async def _fresh_pods(self) -> list[dict]:
        """The node's pods as listed *after* this call began. Concurrent callers share one list:
        each joins the next list that has not started yet, so a burst of Allocate calls costs a
        few API lists, not one each, and no caller sees a list older than its request."""
        if self._next_list is None:
            fut: asyncio.Future[list[dict]] = asyncio.get_running_loop().create_future()
            self._next_list = fut
            t = asyncio.get_running_loop().create_task(self._run_list(fut))
            self._background.add(t)
            t.add_done_callback(self._background.discard)
        return await asyncio.shield(self._next_list)

    async def _run_list(self, fut: asyncio.Future[list[dict]]) -> None:
        async with self._list_lock:
            if self._next_list is fut:
                self._next_list = None  # later callers wait for a list that starts after them
            try:
                fut.set_result(await self.kube.list_node_pods(self.config.node_name))
            except Exception as e:
                fut.set_exception(e)

    async def _candidates(self):  # type: ignore[no-untyped-def]
        return pending_candidates(await self._fresh_pods(), self.config.node_name)

    async def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        cands = await self._candidates()
        return self.allocator.preferred(resource, cands, available, must_include, size)

    async def allocate(self, resource: str, device_ids: Sequence[str]) -> Grant:
        attempt = 0
        while True:
            cands = await self._candidates()
            try:
                grant, done = self.allocator.allocate(
                    resource, device_ids, cands, backend=self.backend, node_labels=self.labels
                )
                break
            except AllocationError:
                attempt += 1
                if attempt > self.config.allocate_retries:
                    self.allocation_failures += 1
                    raise
                await asyncio.sleep(self.config.allocate_retry_s)
        self.allocations += 1
        c = grant.candidate
        if c is not None:
            log.info("%s: %s -> GPU %s", resource, c.ref, ",".join(map(str, grant.gpus)))
        if done and c is not None:
            t = asyncio.get_running_loop().create_task(self._mark_assigned(c.namespace, c.name))
            self._background.add(t)
            t.add_done_callback(self._background.discard)
        return grant

    async def _mark_assigned(self, namespace: str, name: str) -> None:
        from ..annotations import assigned_patch

        delay = 0.2
        for _ in range(10):
            try:
                await self.kube.patch_pod_annotations(namespace, name, assigned_patch())
                return
            except Exception as e:
                log.warning("marking %s/%s assigned failed: %s", namespace, name, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)


__all__ = ["Agent", "AgentConfig", "AllocationError"]
