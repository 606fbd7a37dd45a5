"""``sharegpu agent``: the node agent (one per GPU node, a DaemonSet)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from ..agent.draconfig import CDI_DIR, PLUGINS_DIR, REGISTRY_DIR
from ..core.errors import ValidationError
from ..dra.driver import DRIVER as DRA_DRIVER
from .argtypes import reserve_mib

NAME = "agent"
HELP = "run the node agent: device plugins, mode switching, card-model labels, isolation"
DESCRIPTION = (
    "Serve every GPU resource to the kubelet (the node mode's with devices, the others with 0), "
    "follow the node label ack.node.gpu.schedule, label the node with its card model, hand each "
    "container the GPUs the scheduler chose, and watch GPU health. Without a GPU, "
    "--nvml fake --fake-gpus SPEC runs against a fake node; --standalone needs no API server."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""),
                   help="this node's name (default: $NODE_NAME)")
    p.add_argument("--device-plugin-dir", default="/var/lib/kubelet/device-plugins",
                   help="the kubelet's device-plugin directory (kubelet.sock)")
    p.add_argument("--pod-resources-socket", default="", metavar="PATH",
                   help="the kubelet's pod-resources socket (the chart: /var/lib/kubelet/"
                        "pod-resources/kubelet.sock): the agent names the pod of each Allocate "
                        "through it, so look-alike pods start together (default: not used)")
    p.add_argument("--state-dir", default="/var/lib/sharegpu",
                   help="where the last explicit mode is remembered")
    p.add_argument("--isolation", default="auto",
                   choices=("auto", "hami", "mps", "hami-mps", "none"),
                   help="isolation back-end (auto: hami for cgpu, --core-mem-isolation for "
                        "core_mem, mps for mps, else none)")
    p.add_argument("--core-mem-isolation", default="hami", choices=("hami", "hami-mps"),
                   help="the back-end auto gives core_mem nodes: hami (default) or hami-mps "
                        "(HAMi-core's memory limit with MPS's compute share; docs/isolation.md)")
    p.add_argument("--nvml", default="real", choices=("real", "fake"),
                   help="real: the GPUs through NVML; fake: --fake-gpus (development)")
    p.add_argument("--fake-gpus", default="Tesla-T4:15,Tesla-T4:15",
                   help='GPUs of --nvml fake: "NAME:GIB,..." (e.g. Tesla-T4:15,Tesla-T4:15)')
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else "
                   "in-cluster)")
    p.add_argument("--metrics-listen", default="0.0.0.0:9400", help="HOST:PORT, or '' for none")
    p.add_argument("--metrics-pod-names", action="store_true",
                   help="label each container's figures on /metrics with its pod's namespace "
                        "and name (default: the pod's UID only; /metrics is reachable from the "
                        "pod network, and names would tell every tenant which pods run here)")
    p.add_argument("--host-proc", default="/proc",
                   help="/proc of the host's PID namespace (NVML reports only the GPU processes "
                        "of the agent's PID namespace: run it in the host's, as the chart does "
                        "with hostPID): GPU memory in use per container is read through each "
                        "process's cgroup ('' turns the usage metrics off; default /proc)")
    p.add_argument("--hami-library", default="/usr/local/vgpu/libvgpu.so",
                   help="host path of HAMi-core's libvgpu.so (containers see it at "
                        "/usr/local/vgpu/libvgpu.so)")
    p.add_argument("--hami-installed", default="",
                   help="file naming the library the chart's init container installed (wins "
                        "over --hami-library; default: none, --hami-library is used)")
    p.add_argument("--reserve-mib", default="0", metavar="MIB",
                   help="MiB of each GPU kept out of the GiB it is advertised with (default 0, "
                        "as ACK; 1024 leaves room for what CUDA cannot use of a full card)")
    p.add_argument("--compute-policy", default="5",
                   help="cGPU compute policy: 5 native (default) or 3 fixed share; 0, 1, 2 and "
                        "4 are refused (no back-end can honour them)")
    p.add_argument("--isolation-check-every", type=float, default=10.0,
                   help="seconds between checks of the isolation back-end")
    p.add_argument("--heartbeat-every", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between renewals of the node condition GPUAgentServing (the "
                        "extender counts it stale after 40 s: keep this well below)")
    p.add_argument("--stop-drain", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGTERM, after GPUAgentServing=False is written, how long pods "
                        "already bound to the node may take to get their devices before the "
                        "device plugins go (default 5)")
    p.add_argument("--mps-pipe-dir", default="/run/nvidia/mps",
                   help="host directory of the MPS control daemon's pipes")
    p.add_argument("--mps-shm-dir", default="/run/nvidia/mps-shm",
                   help="host directory the MPS daemon and its clients share as /dev/shm")
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control",
                   help="the MPS control client used to check that the daemon answers")
    p.add_argument("--recover-after", type=float, default=300.0,
                   help="seconds without XID after which a responsive GPU is healthy again")
    p.add_argument("--standalone", action="store_true",
                   help="no API server: an in-memory node (for development with --nvml fake)")
    p.add_argument("--mode", default="default",
                   help="with --standalone: the node's ack.node.gpu.schedule label")
    p.add_argument("--dra", default="off", choices=("off", "on", "label"),
                   help="serve the GPUs through DRA (a ResourceSlice; docs/dra.md) instead of "
                        "the device plugins: off, on, or label (while the node carries "
                        "--dra-label; elsewhere this node's slice is withdrawn)")
    p.add_argument("--dra-label", default="sharegpu.io/dra=true", metavar="KEY=VALUE",
                   help="with --dra label: the node label of the DRA node pool")
    p.add_argument("--dra-driver", default=DRA_DRIVER,
                   help="the DRA driver name the ResourceSlice is published for")
    p.add_argument("--dra-device-class", default="gpu.sharegpu.io",
                   help="the DeviceClass that owns the slice (the chart's); '' for none")
    p.add_argument("--dra-kubelet-plugin", default="on", choices=("on", "off"),
                   help="with --dra on/label: serve the DRA kubelet plugin while the node is in "
                        "the DRA pool (off: ResourceSlices only)")
    p.add_argument("--dra-plugins-registry", default=REGISTRY_DIR,
                   help="the kubelet's plugin registration directory (the plugin's "
                        "registration socket goes here)")
    p.add_argument("--dra-plugin-dir", default=f"{PLUGINS_DIR}/{DRA_DRIVER}",
                   help="directory of the DRA plugin's endpoint socket (dra.sock)")
    p.add_argument("--cdi-dir", default=CDI_DIR,
                   help="the container runtime's CDI spec directory (one spec per claim)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def _listen(text: str) -> tuple[str, int] | None:
    if not text:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValidationError("--metrics-listen", text, "must be HOST:PORT (e.g. 0.0.0.0:9400)")
    return host or "0.0.0.0", int(port)


def run(args: argparse.Namespace) -> int:
    import shlex

    from ..agent.builder import build_agent
    from ..agent.config import AgentConfig
    from ..agent.isolation import IsolationConfig, parse_core_mem, parse_policy
    from ..agent.kube import MemoryKube
    from ..agent.nvml import FakeNvml, RealNvml
    from ..core.modes import parse_mode
    from ..kubeio.logs import configure as configure_logging

    configure_logging(args.log_level)
    if not args.node_name:
        raise ValidationError("--node-name", "", "must be set (or the env var NODE_NAME)")
    listen = _listen(args.metrics_listen)
    if args.recover_after < 0:
        raise ValidationError("--recover-after", args.recover_after, "must be at least 0")
    core_mem = parse_core_mem(args.core_mem_isolation)
    policy = parse_policy(args.compute_policy, args.isolation, core_mem)
    if not args.isolation_check_every > 0:
        raise ValidationError("--isolation-check-every", args.isolation_check_every,
                              "must be a positive number of seconds")
    if not 0 < args.heartbeat_every <= 30:
        raise ValidationError("--heartbeat-every", args.heartbeat_every,
                              "must be more than 0 and at most 30 seconds (the extender counts "
                              "the condition stale after 40)")
    if not 0 <= args.stop_drain <= 20:
        raise ValidationError("--stop-drain", args.stop_drain,
                              "must be 0 to 20 seconds (within the pod's termination grace)")
    reserve = reserve_mib(args.reserve_mib)
    mps_control = tuple(shlex.split(args.mps_control))
    if not mps_control:
        raise ValidationError("--mps-control", args.mps_control, "must name a command")
    dra_label = _dra_label(args.dra_label)
    if args.dra != "off":
        from ..dra.resourceslices import check_driver_name

        check_driver_name("--dra-driver", args.dra_driver)
    dra_plugin = None
    if args.dra != "off" and args.dra_kubelet_plugin == "on":
        from ..agent.draconfig import DraConfig

        if args.dra_driver != DRA_DRIVER:
            raise ValidationError("--dra-driver", args.dra_driver,
                                  f"the DRA kubelet plugin serves driver {DRA_DRIVER} only "
                                  "(use --dra-kubelet-plugin=off for slices of another name)")
        for flag, value in (("--dra-plugins-registry", args.dra_plugins_registry),
                            ("--dra-plugin-dir", args.dra_plugin_dir),
                            ("--cdi-dir", args.cdi_dir)):
            if not os.path.isabs(value):
                raise ValidationError(flag, value, "must be an absolute path")
        dra_plugin = DraConfig(registry_dir=args.dra_plugins_registry,
                               plugin_dir=args.dra_plugin_dir, cdi_dir=args.cdi_dir)
        # a unix socket path has at most 107 bytes
        for flag, sock in (("--dra-plugins-registry", dra_plugin.registration_socket),
                           ("--dra-plugin-dir", dra_plugin.endpoint)):
            if len(sock.encode()) > 107:
                raise ValidationError(flag, sock, "socket path must be at most 107 bytes")
    nvml = FakeNvml.from_spec(args.fake_gpus) if args.nvml == "fake" else _real_nvml(RealNvml)
    if args.standalone:
        kube = MemoryKube()
        kube.add_node(args.node_name, {"ack.node.gpu.schedule": parse_mode(args.mode).value})
    else:
        from ..agent.lightkube_api import LightkubeApi, make_client

        client = make_client(args.kubeconfig)
        kube = LightkubeApi(client)
    slices = None
    if args.dra != "off":
        from ..agent.slicepublisher import LightkubeSlices, MemorySlices, SlicePublisher

        api = MemorySlices() if args.standalone else LightkubeSlices(client)
        slices = SlicePublisher(api, args.node_name, driver=args.dra_driver,
                                device_class=(args.dra_device_class or None)
                                if not args.standalone else None)
    config = AgentConfig(
        node_name=args.node_name,
        device_plugin_dir=args.device_plugin_dir,
        pod_resources_socket=args.pod_resources_socket,
        state_dir=args.state_dir,
        isolation=args.isolation,
        core_mem_isolation=core_mem,
        isolation_paths=IsolationConfig(hami_library=args.hami_library,
                                        mps_pipe_dir=args.mps_pipe_dir,
                                        mps_shm_dir=args.mps_shm_dir,
                                        compute_policy=policy),
        recover_after_s=args.recover_after,
        hami_installed=args.hami_installed,
        isolation_check_s=args.isolation_check_every,
        heartbeat_s=args.heartbeat_every,
        stop_drain_s=args.stop_drain,
        metrics_pod_names=args.metrics_pod_names,
        mps_control=mps_control,
        reserve_mib=reserve,
        dra=args.dra,
        dra_label=dra_label,
        dra_plugin=dra_plugin,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        agent = build_agent(config, nvml, kube, slices)
        server = None
        if listen is not None:
            from ..agent.metrics import serve
            from ..agent.usage import ProcCgroups, UsageCollector

            usage = None
            if args.host_proc:
                usage = UsageCollector(
                    nvml, [g.index for g in agent.gpus],
                    lambda: kube.list_node_pods(config.node_name), ProcCgroups(args.host_proc))
            server = await serve(agent, *listen, usage)
        try:
            await agent.start()
            await stop.wait()
        finally:
            await agent.stop()
            if server is not None:
                server.close()
            nvml.close()

    asyncio.run(main())
    return 0


def _dra_label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key or "=" in value:
        raise ValidationError("--dra-label", text, "must be KEY=VALUE (e.g. sharegpu.io/dra=true)")
    return key, value


def _real_nvml(cls):  # type: ignore[no-untyped-def]
    try:
        return cls()
    except Exception as e:  # library missing, driver not loaded
        raise ValidationError(
            "--nvml", "real",
            f"NVML could not be initialised ({e}); is the NVIDIA driver installed? "
            "(use --nvml fake for development)",
        ) from None
