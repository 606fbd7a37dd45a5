"""What the node advertises, recomputed whenever an input changes (mode, GPU health, the
isolation back-end, the DRA pool): each device plugin's device list (none while the node is in
the DRA pool; the isolated resources' devices unhealthy while the back-end is unusable) and the
ResourceSlice the publisher should hold."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..core import names
from .devices import devices_for
from .health import HealthWatch
from .isolation import Backend
from .isolationwatch import IsolationWatch
from .nodemode import NodeMode
from .nvml import Gpu, Nvml
from .plugin import DevicePlugin
from .slicepublisher import SlicePublisher, Wanted, slice_gpus

# Resources whose containers get an isolation back-end: withheld while the back-end is unusable.
ISOLATED_RESOURCES = frozenset({names.RES_GPU_MEM, names.RES_GPU_CORE, names.RES_GPU_COUNT})


class Advertiser:
    def __init__(self, gpus: Sequence[Gpu], nvml: Nvml, plugins: Mapping[str, DevicePlugin],
                 slices: SlicePublisher | None, node_mode: NodeMode,
                 isolation: IsolationWatch, health: HealthWatch,
                 dra_active: Callable[[], bool]) -> None:
        self.gpus = gpus
        self.nvml = nvml  # for the link matrix of the slice
        self.plugins = plugins
        self.slices = slices
        self.node_mode = node_mode
        self.isolation = isolation
        self.health = health
        self.dra_active = dra_active

    async def refresh(self) -> None:
        readiness = self.isolation.readiness
        withheld = readiness.backend is not Backend.NONE and not readiness.ready
        everything = {g.index for g in self.gpus}
        unhealthy = self.health.unhealthy
        mode = self.node_mode.mode
        dra = self.dra_active()
        for r, p in self.plugins.items():
            bad = everything if withheld and r in ISOLATED_RESOURCES else unhealthy
            await p.set_devices([] if dra else devices_for(r, mode, self.gpus, bad))
        if self.slices is not None:
            self.slices.want(Wanted(active=dra, mode=mode, gpus=slice_gpus(
                self.gpus, self._links(), unhealthy, everything if withheld else set())))

    def _links(self) -> list[list[str]] | None:
        try:
            return self.nvml.links()
        except Exception:  # NVML without topology support
            return None
