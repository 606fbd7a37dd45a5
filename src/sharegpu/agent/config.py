"""The node agent's settings (what ``sharegpu agent``'s flags become)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .draconfig import DraConfig
from .isolation import Backend, IsolationConfig


@dataclass
class AgentConfig:
    node_name: str
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    # the kubelet's pod-resources socket, through which the agent names the pod of each
    # Allocate ("": not used; look-alike pods then start one placement at a time)
    pod_resources_socket: str = ""
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
    # how often the node condition GPUAgentServing is renewed (sharegpu.core.agentserving)
    heartbeat_s: float = 10.0
    # on a graceful stop, how long the pods already bound here may take to be admitted before
    # the device plugins go
    stop_drain_s: float = 5.0
    # /metrics labels each container's figures with its pod's namespace and name too (not only
    # its UID): opt-in, the endpoint is reachable from the pod network
    metrics_pod_names: bool = False
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
    # while the node is in the DRA pool; None: no kubelet plugin
    dra_plugin: DraConfig | None = None
