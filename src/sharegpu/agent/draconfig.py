"""Where the DRA kubelet plugin lives on the node: the kubelet's plugin registration directory,
the plugin's endpoint directory and the container runtime's CDI spec directory."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..dra import driver as dra

REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
CDI_DIR = "/var/run/cdi"


@dataclass(frozen=True)
class DraConfig:
    registry_dir: str = REGISTRY_DIR
    plugin_dir: str = f"{PLUGINS_DIR}/{dra.DRIVER}"
    cdi_dir: str = CDI_DIR

    @property
    def registration_socket(self) -> str:
        return os.path.join(self.registry_dir, f"{dra.DRIVER}-reg.sock")

    @property
    def endpoint(self) -> str:
        return os.path.join(self.plugin_dir, "dra.sock")
