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
from dataclasses import dataclass, field, replace

from .. import names
from ..aio import cancel_all
from ..errors import ValidationError
from ..modes import Mode, card_model_labels, parse_mode
from .allocate import (
    AllocationError,
    Allocator,
    Candidate,
    Grant,
    IsolationUnavailable,
    pending_candidates,
)
from .conflicts import gpu_plugins
from .devices import SOCKETS, DeviceMap, devices_for
from .draplugin import DraConfig, DraPlugin
from .isolation import PRELOAD_FILE, Backend, IsolationConfig, backend_for
from .kube import KubeApi
from .mps import CURRENT_BACKEND_FILE, CURRENT_MODE_FILE
from .nvml import Nvml
from .plugin import KUBELET_SOCKET, DevicePlugin
from .readiness import (
    READY_NONE,
    Readiness,
    check_hami,
    check_hami_mps,
    check_mps,
    write_preload_list,
)
from .slicepublisher import SlicePublisher, Wanted, slice_gpus

log = logging.getLogger(__name__)

MODE_FILE = "last-mode"
CONDITION_ISOLATION = names.CONDITION_ISOLATION
EVENT_ISOLATION = "GPUIsolationUnavailable"  # Warning event on a pod refused for it
EVENT_CONFLICT = "GPUDevicePluginConflict"  # Warning event on the node
# Resources whose containers get an isolation back-end: withheld while the back-end is unusable.
ISOLATED_RESOURCES = frozenset({names.RES_GPU_MEM, names.RES_GPU_CORE, names.RES_GPU_COUNT})


@dataclass
class AgentConfig:
    node_name: str
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    state_dir: str = "/var/lib/sharegpu"
    isolation: str = "auto"
    # the back-end "auto" gives a core_mem node: hami, or hami-mps (opt-in, docs/isolation.md)
    core_mem_isolation: Backend = Backend.HAMI
    isolation_paths: IsolationConfig = field(default_factory=IsolationConfig)
    kubelet_poll_s: float = 0.2
    recover_after_s: float = 300.0  # a GPU is healthy again after this long without XIDs
    health_poll_s: float = 1.0
    allocate_retries: int = 3  # re-list pods this often when a request matches no pod yet
    allocate_retry_s: float = 0.3
    # the file the chart's init container writes with the path of the HAMi-core library it
    # installed; when set it wins over isolation_paths.hami_library
    hami_installed: str = ""
    isolation_check_s: float = 10.0  # how often the back-end is checked again
    mps_control: tuple[str, ...] = ("nvidia-cuda-mps-control",)
    load_check: bool = True  # load the HAMi-core library in a child process as part of the check
    # MiB of each GPU kept out of what is advertised: CUDA can use less than NVML's total (480 MiB
    # less on an H100, 616 on an H200), so a card filled to its advertised GiB leaves the last
    # pod short (bench/README.md, "Isolation on a real GPU")
    reserve_mib: int = 0
    # DRA (docs/dra.md): "off" (device plugins only, no ResourceSlice calls), "on" (every GPU
    # through a ResourceSlice, the device plugins advertise none), "label" ("on" while the node
    # carries dra_label, else "off" with this node's slice withdrawn)
    dra: str = "off"
    dra_label: tuple[str, str] = ("sharegpu.io/dra", "true")
    # the DRA kubelet plugin's directories (registration socket, endpoint, CDI specs): served
    # while the node is in the DRA pool (dra_active); None: no kubelet plugin
    dra_plugin: DraConfig | None = None


class Agent:
    def __init__(self, config: AgentConfig, nvml: Nvml, kube: KubeApi,
                 slices: SlicePublisher | None = None) -> None:
        self.config = config
        self.slices = slices  # the ResourceSlice publisher (config.dra != "off")
        self.nvml = nvml
        self.kube = kube
        self.gpus = [replace(g, reserve_mib=config.reserve_mib) for g in nvml.gpus()]
        self.devices = DeviceMap(self.gpus)
        # the preload list lives in the agent's state directory (a host directory it writes)
        self.allocator = Allocator(config.node_name, self.devices, isolation=replace(
            config.isolation_paths,
            hami_preload_file=os.path.join(config.state_dir, PRELOAD_FILE)))
        self.mode: Mode = Mode.EXCLUSIVE
        self.labels: dict[str, str] = {}
        self.unhealthy: set[int] = set()
        self.plugins = {r: DevicePlugin(r, sock, self) for r, sock in SOCKETS.items()}
        self.registrations = 0  # registration rounds completed (tests and metrics read it)
        self.allocations = 0
        self.allocation_failures = 0
        self.isolation_refusals = 0
        self.conflicts: dict[str, list[str]] = {}  # resource -> other plugins' sockets
        self.readiness: Readiness = READY_NONE
        self._checked_at = 0.0
        self._check_lock = asyncio.Lock()
        self._condition_sent: tuple[str, str] | None = None
        self._background: set[asyncio.Task] = set()
        self._next_list: asyncio.Future[list[dict]] | None = None
        self._list_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mode_changed = asyncio.Event()
        # the DRA kubelet plugin (docs/dra.md): serving while the node is in the DRA pool
        self.dra_plugin: DraPlugin | None = (
            DraPlugin(self, config.dra_plugin)
            if config.dra != "off" and config.dra_plugin is not None else None)
        self._dra_serving = False
        self._dra_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        os.makedirs(self.config.state_dir, exist_ok=True)
        node = await self._get_node()
        self.labels = dict((node.get("metadata") or {}).get("labels") or {})
        self.mode = self._initial_mode(node)
        self._write_current_mode()
        await self._publish_node(explicit=self._label_mode() is not None)
        await self.check_isolation(publish=False)
        await self._refresh_devices()
        await self._publish_condition()
        await self._start_plugins()
        if self.slices is not None:
            await self.slices.start()
        await self._sync_dra_plugin()
        self._tasks = [
            asyncio.create_task(self._watch_node(), name="watch-node"),
            asyncio.create_task(self._watch_kubelet(), name="watch-kubelet"),
            asyncio.create_task(self._watch_health(), name="watch-health"),
            asyncio.create_task(self._watch_isolation(), name="watch-isolation"),
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
        if self.dra_plugin is not None and self._dra_serving:
            await self.dra_plugin.stop()
            self._dra_serving = False
        if self.slices is not None:
            await self.slices.stop()

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

    def _write_current_mode(self) -> None:
        """The mode and the back-end in force, for the MPS daemon's supervisor beside the
        agent (it runs the daemon while the back-end uses MPS)."""
        for name, value in ((CURRENT_MODE_FILE, self.mode.value),
                            (CURRENT_BACKEND_FILE, self.backend.value)):
            path = os.path.join(self.config.state_dir, name)
            try:
                with open(path + ".tmp", "w") as f:
                    f.write(value + "\n")
                os.replace(path + ".tmp", path)
            except OSError as e:
                log.warning("could not write %s: %s", path, e)

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
        dra_before = self.dra_active
        self.labels = dict(labels)
        if self.dra_active != dra_before:
            log.info("node %s: GPUs served through %s", self.config.node_name,
                     "DRA (ResourceSlice)" if self.dra_active else "device plugins")
            await self._refresh_devices()
            try:
                await self._sync_dra_plugin()
            except Exception as e:  # directories not writable: logged, the label may move again
                log.error("node %s: the DRA kubelet plugin could not be %s: %s",
                          self.config.node_name, "started" if self.dra_active else "stopped", e)
        explicit = self._label_mode()
        if explicit is None or explicit == self.mode:
            if explicit is not None and not os.path.exists(self._mode_path()):
                self._remember(explicit)
            return
        log.info("node %s: mode %s -> %s", self.config.node_name, self.mode, explicit)
        self.mode = explicit
        self._remember(explicit)
        self._write_current_mode()
        await self.kube.patch_node_metadata(
            self.config.node_name, annotations={names.ANN_NODE_LAST_MODE: explicit.value}
        )
        await self.check_isolation(publish=False)
        await self._refresh_devices()
        await self._publish_condition()
        self._mode_changed.set()

    @property
    def backend(self) -> Backend:
        return backend_for(self.config.isolation, self.mode, self.config.core_mem_isolation)

    # ------------------------------------------------------------------ isolation
    def hami_library(self) -> tuple[str, str | None]:
        """The HAMi-core library the agent hands out, or why there is none: the path the chart's
        init container recorded (``hami_installed``), else the configured path."""
        pointer = self.config.hami_installed
        if not pointer:
            return self.config.isolation_paths.hami_library, None
        try:
            with open(pointer) as f:
                path = f.read().strip()
        except OSError:
            return "", (f"the HAMi-core library was not installed: {pointer} (written by the "
                        "chart's hami-install init container) does not exist")
        if not os.path.isabs(path):
            return "", f"{pointer} does not name an absolute path to the library ({path!r})"
        return path, None

    def _check_now(self, backend: Backend) -> Readiness:
        if backend is Backend.HAMI:
            return self._check_hami()
        if backend is Backend.MPS:
            return check_mps(self.config.isolation_paths.mps_pipe_dir, self.config.mps_control)
        if backend is Backend.HAMI_MPS:
            return check_hami_mps(self._check_hami(), self.config.isolation_paths.mps_pipe_dir,
                                  self.config.mps_control)
        return READY_NONE

    def _check_hami(self) -> Readiness:
        """HAMi-core's part: the library (where the chart installed it), the preload list."""
        from .readiness import HAMI_FIX

        path, problem = self.hami_library()
        if problem:
            return Readiness(Backend.HAMI, False, problem, HAMI_FIX)
        if path != self.allocator.isolation.hami_library:
            self.allocator.isolation = replace(self.allocator.isolation, hami_library=path)
        problem = write_preload_list(self.allocator.isolation.hami_preload_file)
        if problem:
            return Readiness(Backend.HAMI, False, problem,
                             f"make {self.config.state_dir} (--state-dir, the chart's "
                             "agent.stateDir) a writable host directory")
        return check_hami(path, load=self.config.load_check)

    async def check_isolation(self, *, publish: bool = True) -> Readiness:
        """Check the node's back-end now; on a change, withhold or restore the isolated
        resources and update the node condition."""
        async with self._check_lock:
            backend = self.backend
            r = await asyncio.to_thread(self._check_now, backend)
            self._checked_at = time.monotonic()
            changed = r != self.readiness
            if changed:
                (log.info if r.ready else log.error)("%s", r.message(self.config.node_name))
            self.readiness = r
        if changed and publish:
            await self._refresh_devices()
            await self._publish_condition()
        return r

    async def _watch_isolation(self) -> None:
        while True:
            await asyncio.sleep(self.config.isolation_check_s)
            try:
                await self.check_isolation()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the check itself broke: keep the last answer
                log.warning("isolation check failed: %s", e)

    async def _current_readiness(self) -> Readiness:
        """The back-end's state for an Allocate: checked again when it was unusable (it may be
        back) or when the node's back-end changed, at most once a second."""
        r = self.readiness
        stale = time.monotonic() - self._checked_at > 1.0
        if r.backend != self.backend or (not r.ready and stale):
            r = await self.check_isolation()
        return r

    async def isolation_guard(self):  # type: ignore[no-untyped-def]
        """The fail-closed check Allocate makes (the node's back-end, checked again when it was
        unusable), for the DRA kubelet plugin: call the result with the back-end a container
        is about to get."""
        return self._guard(await self._current_readiness())

    def _guard(self, readiness: Readiness):  # type: ignore[no-untyped-def]
        """Refuses a container the back-end ``readiness`` describes cannot isolate (also one
        for another back-end: ``_current_readiness`` checked the node's own)."""
        def guard(backend: Backend, c: Candidate) -> None:
            if not (readiness.backend is backend and readiness.ready):
                raise IsolationUnavailable(readiness.message(self.config.node_name), c)

        return guard

    async def _publish_condition(self) -> None:
        r = self.readiness
        if r.backend is Backend.NONE:
            status, reason = "True", "NotIsolated"
            msg = f"mode {self.mode.value}: no isolation back-end (scheduling only)"
        elif r.ready:
            status, reason, msg = "True", "BackendReady", r.message(self.config.node_name)
        else:
            status, reason, msg = "False", "BackendUnusable", r.message(self.config.node_name)
        if self._condition_sent == (status, msg):
            return
        cond = {"type": CONDITION_ISOLATION, "status": status, "reason": reason,
                "message": msg[:1024]}
        try:
            await self.kube.patch_node_condition(self.config.node_name, cond)
            self._condition_sent = (status, msg)
        except Exception as e:
            log.warning("node condition %s not written: %s", CONDITION_ISOLATION, e)

    async def _pod_event(self, c: Candidate, message: str) -> None:
        try:
            await self.kube.create_event(
                namespace=c.namespace, pod=c.name, uid=c.uid, reason=EVENT_ISOLATION,
                message=message[:1024], node=self.config.node_name,
            )
        except Exception as e:
            log.warning("event for %s/%s not written: %s", c.namespace, c.name, e)

    # ------------------------------------------------------------------ devices
    @property
    def dra_active(self) -> bool:
        """Whether this node's GPUs are served through DRA (then never by the device plugins)."""
        if self.config.dra == "label":
            key, value = self.config.dra_label
            return self.labels.get(key) == value
        return self.config.dra == "on"

    async def _sync_dra_plugin(self) -> None:
        """Serve the DRA kubelet plugin while the node is in the DRA pool, and only then: its
        registration socket appears in (and leaves) the kubelet's plugins_registry with the pool
        label. Prepared claims stay recorded while it is stopped (drain before moving a node)."""
        p = self.dra_plugin
        if p is None:
            return
        async with self._dra_lock:
            if self.dra_active and not self._dra_serving:
                await p.start()
                self._dra_serving = True
            elif not self.dra_active and self._dra_serving:
                await p.stop()
                self._dra_serving = False
                log.info("DRA plugin %s stopped: node %s left the DRA pool", p.config.endpoint,
                         self.config.node_name)

    @property
    def dra_serving(self) -> bool:
        """Whether the DRA kubelet plugin is serving now."""
        return self._dra_serving

    async def _refresh_devices(self) -> None:
        withheld = (self.readiness.backend is not Backend.NONE and not self.readiness.ready)
        everything = {g.index for g in self.gpus}
        dra = self.dra_active
        for r, p in self.plugins.items():
            bad = everything if withheld and r in ISOLATED_RESOURCES else self.unhealthy
            await p.set_devices([] if dra else devices_for(r, self.mode, self.gpus, bad))
        if self.slices is not None:
            self.slices.want(Wanted(active=dra, mode=self.mode, gpus=slice_gpus(
                self.gpus, self._links(), self.unhealthy, everything if withheld else set())))

    def _links(self) -> list[list[str]] | None:
        try:
            return self.nvml.links()
        except Exception:  # NVML without topology support
            return None

    async def _start_plugins(self) -> None:
        d = self.config.device_plugin_dir
        os.makedirs(d, exist_ok=True)
        for p in self.plugins.values():
            await p.start(d)
        await self._register_all()

    async def _foreign_gpu_plugins(self) -> list[str]:
        """Other device plugins in the directory serving this node's GPUs (see
        :mod:`.conflicts`): the agent then leaves ``nvidia.com/gpu`` to them."""
        found = await gpu_plugins(self.config.device_plugin_dir, SOCKETS.values(),
                                  [g.uuid for g in self.gpus])
        names_ = sorted(f.socket for f in found)
        if names_ != self.conflicts.get(names.RES_NVIDIA_GPU, []):
            if names_:
                msg = (f"another device plugin serves this node's GPUs ({', '.join(names_)} in "
                       f"{self.config.device_plugin_dir}): sharegpu does not register "
                       f"{names.RES_NVIDIA_GPU} here (the kubelet keeps one plugin per "
                       "resource); its shared resources are unaffected. To let sharegpu serve "
                       "whole GPUs too, turn that plugin off on this node (GPU Operator: label "
                       "the node nvidia.com/gpu.deploy.device-plugin=false)")
                log.error("%s", msg)
                with contextlib.suppress(Exception):
                    await self.kube.create_node_event(
                        self.config.node_name, reason=EVENT_CONFLICT, message=msg)
            else:
                log.info("no other device plugin serves this node's GPUs any more")
        if names_:
            self.conflicts[names.RES_NVIDIA_GPU] = names_
        else:
            self.conflicts.pop(names.RES_NVIDIA_GPU, None)
        return names_

    async def _register_all(self) -> bool:
        d = self.config.device_plugin_dir
        if not os.path.exists(os.path.join(d, KUBELET_SOCKET)):
            return False
        ok = True
        foreign = await self._foreign_gpu_plugins()
        for p in self.plugins.values():
            if foreign and p.resource == names.RES_NVIDIA_GPU:
                continue  # left to the other plugin
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
            readiness = await self._current_readiness()
            try:
                grant, done = self.allocator.allocate(
                    resource, device_ids, cands, backend=self.backend, node_labels=self.labels,
                    guard=self._guard(readiness),
                )
                break
            except IsolationUnavailable as e:
                self.allocation_failures += 1
                self.isolation_refusals += 1
                log.error("%s: %s refused: %s", resource, e.candidate.ref, e)
                await self._pod_event(e.candidate, str(e))
                raise
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
