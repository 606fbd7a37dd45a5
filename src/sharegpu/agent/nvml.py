"""What the node agent needs from NVML, behind a small interface.

- :class:`RealNvml` calls NVIDIA's own bindings (``nvidia-ml-py``, module ``pynvml``), which load
  ``libnvidia-ml.so.1`` through ctypes. CI exercises that path against a fake library built from
  ``tests/fakenvml/fakenvml.c``.
- :class:`FakeNvml` is an in-memory node for development (``sharegpu agent --nvml fake``) and tests:
  GPUs from a spec such as ``"Tesla-T4:15,Tesla-T4:15"`` and XID events injected by hand.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass
from typing import Protocol

from ..core.errors import ValidationError

GIB_MIB = 1024

# XIDs that an application causes (bad memory access, resets it asked for, ...): they do not say
# the GPU is broken, so they do not mark it unhealthy (the NVIDIA device plugin skips the same).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str
    name: str
    mem_mib: int
    reserve_mib: int = 0  # kept out of what is advertised (the agent's --reserve-mib)

    @property
    def mem_gib(self) -> int:
        """GiB the GPU is advertised with: total memory less the reserve, rounded to the nearest
        GiB, as ACK shows it (a 15,109 MiB T4 is a 15 GiB card), at least 1."""
        mib = max(0, self.mem_mib - self.reserve_mib)
        return max(1, (mib + GIB_MIB // 2) // GIB_MIB)


@dataclass(frozen=True, slots=True)
class XidEvent:
    gpu: int  # index
    xid: int

    @property
    def critical(self) -> bool:
        return self.xid not in APPLICATION_XIDS


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a GPU and the GPU memory it uses (NVML's per-process figure)."""

    gpu: int  # index
    pid: int  # in the host's PID namespace
    used_bytes: int


class Nvml(Protocol):
    def gpus(self) -> list[Gpu]: ...

    def driver_version(self) -> str: ...

    def links(self) -> list[list[str]] | None:
        """GPU link matrix as ``nvidia-smi topo -m`` names the kinds; ``None`` when unknown."""
        ...

    def wait_event(self, timeout_s: float) -> XidEvent | None:
        """Block up to ``timeout_s`` for the next XID event; ``None`` on timeout."""
        ...

    def responsive(self, gpu: int) -> bool:
        """Whether the GPU still answers queries (used to see a GPU recover)."""
        ...

    def processes(self, gpu: int) -> list[GpuProcess]:
        """The compute processes on the GPU with the memory each uses; empty when the GPU
        cannot tell (a process whose figure NVML does not know is left out)."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------


def parse_fake_gpus(spec: str) -> list[tuple[str, int]]:
    """``"Tesla-T4:15,Tesla-V100-SXM2-32GB:32"`` → [(name, GiB), ...]; ``"4"`` → four 16 GiB T4s."""
    rule = "must be NAME:GIB[,NAME:GIB...] (e.g. Tesla-T4:15,Tesla-T4:15) or a GPU count"
    spec = spec.strip()
    if spec.isdigit():
        n = int(spec)
        if n < 1:
            raise ValidationError("--fake-gpus", spec, rule)
        return [("Tesla-T4", 15)] * n
    out = []
    for part in spec.split(","):
        name, sep, gib = part.strip().rpartition(":")
        if not sep or not name or not gib.strip().isdigit() or int(gib) < 1:
            raise ValidationError("--fake-gpus", spec, rule)
        out.append((name.strip(), int(gib)))
    if not out:
        raise ValidationError("--fake-gpus", spec, rule)
    return out


class FakeNvml:
    """An in-memory node. ``mem`` is in GiB per GPU (stored as MiB, exactly ``GiB * 1024``)."""

    def __init__(self, gpus: list[tuple[str, int]], *, links: list[list[str]] | None = None):
        self._gpus = [
            Gpu(i, f"GPU-fake{i:04d}-0000-4000-8000-{i:012d}", name.replace("-", " "), gib * 1024)
            for i, (name, gib) in enumerate(gpus)
        ]
        self._links = links
        self._events: queue.Queue[XidEvent] = queue.Queue()
        self._lost: set[int] = set()
        self._procs: dict[tuple[int, int], int] = {}  # (gpu, pid) -> MiB
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, spec: str) -> FakeNvml:
        return cls(parse_fake_gpus(spec))

    def gpus(self) -> list[Gpu]:
        return list(self._gpus)

    def driver_version(self) -> str:
        return "fake"

    def links(self) -> list[list[str]] | None:
        return self._links

    def wait_event(self, timeout_s: float) -> XidEvent | None:
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def responsive(self, gpu: int) -> bool:
        with self._lock:
            return gpu not in self._lost

    def processes(self, gpu: int) -> list[GpuProcess]:
        with self._lock:
            return [GpuProcess(g, pid, mib << 20) for (g, pid), mib in sorted(self._procs.items())
                    if g == gpu]

    def close(self) -> None:
        pass

    # --- test and development controls ---
    def run_process(self, gpu: int, pid: int, mib: int) -> None:
        """Show process ``pid`` on ``gpu`` using ``mib`` MiB (0: it left the GPU)."""
        with self._lock:
            if mib:
                self._procs[(gpu, pid)] = mib
            else:
                self._procs.pop((gpu, pid), None)

    def inject_xid(self, gpu: int, xid: int, *, lost: bool = True) -> None:
        """Emit an XID for ``gpu``; with ``lost`` the GPU stops answering until :meth:`recover`."""
        if lost and xid not in APPLICATION_XIDS:
            with self._lock:
                self._lost.add(gpu)
        self._events.put(XidEvent(gpu, xid))

    def recover(self, gpu: int) -> None:
        with self._lock:
            self._lost.discard(gpu)


# ---------------------------------------------------------------------------------------------

_TOPO_KIND = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class RealNvml:
    """NVML through ``nvidia-ml-py`` (the library NVIDIA publishes on PyPI as ``pynvml``)."""

    def __init__(self) -> None:
        import pynvml

        self._n = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._gpus = []
        for i, h in enumerate(self._handles):
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            self._gpus.append(
                Gpu(i, _text(uuid), _text(name), int(mem.total) // (1024 * 1024))
            )
        self._events = None
        self._event_lock = threading.Lock()

    def gpus(self) -> list[Gpu]:
        return list(self._gpus)

    def driver_version(self) -> str:
        return _text(self._n.nvmlSystemGetDriverVersion())

    def links(self) -> list[list[str]] | None:
        n = self._n
        rows = []
        try:
            for i, a in enumerate(self._handles):
                row = []
                for j, b in enumerate(self._handles):
                    if i == j:
                        row.append("X")
                        continue
                    level = n.nvmlDeviceGetTopologyCommonAncestor(a, b)
                    row.append(_TOPO_KIND.get(int(level), "SYS"))
                rows.append(row)
        except n.NVMLError:
            return None
        return rows

    def _event_set(self):  # type: ignore[no-untyped-def]
        n = self._n
        with self._event_lock:
            if self._events is None:
                es = n.nvmlEventSetCreate()
                for h in self._handles:
                    # a GPU that cannot report XIDs is watched by responsiveness only
                    with contextlib.suppress(n.NVMLError):
                        n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, es)
                self._events = es
            return self._events

    def wait_event(self, timeout_s: float) -> XidEvent | None:
        n = self._n
        es = self._event_set()
        try:
            data = n.nvmlEventSetWait(es, int(timeout_s * 1000))
        except n.NVMLError as e:
            if getattr(e, "value", None) == n.NVML_ERROR_TIMEOUT:
                return None
            raise
        if data.eventType != n.nvmlEventTypeXidCriticalError:
            return None
        index = self._index_of(data.device)
        return XidEvent(index, int(data.eventData)) if index is not None else None

    def _index_of(self, handle) -> int | None:  # type: ignore[no-untyped-def]
        try:
            uuid = _text(self._n.nvmlDeviceGetUUID(handle))
        except self._n.NVMLError:
            return None
        for g in self._gpus:
            if g.uuid == uuid:
                return g.index
        return None

    def responsive(self, gpu: int) -> bool:
        n = self._n
        try:
            n.nvmlDeviceGetMemoryInfo(self._handles[gpu])
            return True
        except n.NVMLError:
            return False

    def processes(self, gpu: int) -> list[GpuProcess]:
        n = self._n
        try:
            procs = n.nvmlDeviceGetComputeRunningProcesses(self._handles[gpu])
        except n.NVMLError:  # not supported, GPU lost, a driver without the call
            return []
        return [GpuProcess(gpu, int(p.pid), int(p.usedGpuMemory)) for p in procs
                if p.usedGpuMemory is not None]

    def close(self) -> None:
        n = self._n
        with self._event_lock:
            if self._events is not None:
                with contextlib.suppress(n.NVMLError):
                    n.nvmlEventSetFree(self._events)
                self._events = None
        with contextlib.suppress(n.NVMLError):
            n.nvmlShutdown()


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
