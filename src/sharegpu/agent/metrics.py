"""A minimal Prometheus text endpoint for the agent (``GET /metrics``, ``GET /healthz``), and
its readiness (``GET /readyz``: 503 with the reasons until the kubelet has its devices).

With a :class:`~.usage.UsageCollector`, ``/metrics`` also tells the GPU memory in use per
container (NVML's per-process figures, by pod UID, container and GPU) and per GPU, beside
what each container was allocated (docs/metrics.md). The pod's namespace and name are added only
with ``--metrics-pod-names``: the endpoint is reachable from the pod network, and a tenant should
not learn which other tenants' pods run on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .mps import read_state
from .service import Agent
from .usage import Usage, UsageCollector

log = logging.getLogger(__name__)


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _pod(namespace: str, pod: str, uid: str, names: bool) -> str:
    """A container's pod labels: its UID, and its namespace and name when ``names``."""
    out = f'pod_uid="{_label(uid)}",'
    if names:
        out += f'namespace="{_label(namespace)}",pod="{_label(pod)}",'
    return out


def render_usage(node: str, uuids: dict[int, str], usage: Usage, *,
                 pod_names: bool = False) -> list[str]:
    lines = [
        "# HELP sharegpu_agent_gpu_memory_used_bytes GPU memory in use by every process on the "
        "GPU (NVML)",
        "# TYPE sharegpu_agent_gpu_memory_used_bytes gauge",
    ]
    for gpu, used in sorted((usage.gpus or {}).items()):
        lines.append(f'sharegpu_agent_gpu_memory_used_bytes{{node="{node}",gpu="{gpu}",'
                     f'uuid="{uuids.get(gpu, "")}"}} {used}')
    lines += [
        "# HELP sharegpu_agent_container_gpu_memory_used_bytes GPU memory in use by a "
        "container's processes on one GPU (NVML)",
        "# TYPE sharegpu_agent_container_gpu_memory_used_bytes gauge",
    ]
    for c in usage.containers:
        lines.append(
            f'sharegpu_agent_container_gpu_memory_used_bytes{{node="{node}",'
            f'{_pod(c.namespace, c.pod, c.uid, pod_names)}'
            f'container="{_label(c.container)}",gpu="{c.gpu}",uuid="{uuids.get(c.gpu, "")}"}} '
            f"{c.used_bytes}")
    lines += [
        "# HELP sharegpu_agent_container_gpu_memory_allocated_bytes GPU memory a container "
        "asked for (aliyun.com/gpu-mem, over all its GPUs)",
        "# TYPE sharegpu_agent_container_gpu_memory_allocated_bytes gauge",
    ]
    for a in usage.allocations:
        lines.append(
            f'sharegpu_agent_container_gpu_memory_allocated_bytes{{node="{node}",'
            f'{_pod(a.namespace, a.pod, a.uid, pod_names)}'
            f'container="{_label(a.container)}"}} {a.gpu_mem_gib << 30}')
    return lines


def render(agent: Agent, usage: Usage | None = None) -> str:
    node = agent.config.node_name
    r = agent.readiness
    lines = [
        "# TYPE sharegpu_agent_gpus gauge",
        f'sharegpu_agent_gpus{{node="{node}"}} {len(agent.gpus)}',
        "# TYPE sharegpu_agent_gpu_healthy gauge",
    ]
    for g in agent.gpus:
        ok = 0 if g.index in agent.unhealthy else 1
        lines.append(
            f'sharegpu_agent_gpu_healthy{{node="{node}",gpu="{g.index}",uuid="{g.uuid}"}} {ok}'
        )
    lines += [
        "# TYPE sharegpu_agent_mode_info gauge",
        f'sharegpu_agent_mode_info{{node="{node}",mode="{agent.mode.value}"}} 1',
        "# TYPE sharegpu_agent_registrations_total counter",
        f"sharegpu_agent_registrations_total {agent.registrations}",
        "# TYPE sharegpu_agent_allocations_total counter",
        f"sharegpu_agent_allocations_total {agent.allocations}",
        "# TYPE sharegpu_agent_allocation_failures_total counter",
        f"sharegpu_agent_allocation_failures_total {agent.allocation_failures}",
        "# HELP sharegpu_agent_pod_resources_promised 1 when the node names each pod of the "
        "kubelet's device-plugin calls through its pod-resources API",
        "# TYPE sharegpu_agent_pod_resources_promised gauge",
        f"sharegpu_agent_pod_resources_promised {int(agent.pods_named[0])}",
        "# TYPE sharegpu_agent_pod_resources_named_total counter",
        f"sharegpu_agent_pod_resources_named_total {agent.pods_named[1]}",
        "# HELP sharegpu_agent_isolation_ready 1 when the node's isolation back-end is usable",
        "# TYPE sharegpu_agent_isolation_ready gauge",
        f'sharegpu_agent_isolation_ready{{backend="{r.backend.value}"}} {int(r.ready)}',
        "# TYPE sharegpu_agent_isolation_refusals_total counter",
        f"sharegpu_agent_isolation_refusals_total {agent.isolation_refusals}",
        "# HELP sharegpu_agent_serving 1 while the node condition GPUAgentServing is True as "
        "last written",
        "# TYPE sharegpu_agent_serving gauge",
        f"sharegpu_agent_serving {int(bool(agent.serving and agent.serving.serving))}",
        "# HELP sharegpu_agent_marks_reconciled_total pods marked assigned by reconciliation "
        "(their mark after Allocate was lost)",
        "# TYPE sharegpu_agent_marks_reconciled_total counter",
        f"sharegpu_agent_marks_reconciled_total {agent.allocating.marks.reconciled}",
    ]
    lines.append("# TYPE sharegpu_agent_resource_conflict gauge")
    for resource, sockets in sorted(agent.conflicts.items()):
        for sock in sockets:
            lines.append(f'sharegpu_agent_resource_conflict{{resource="{resource}",'
                         f'socket="{sock}"}} 1')
    mps = read_state(agent.config.state_dir)
    if mps is not None:
        up = 1 if mps.get("state") == "running" else 0
        lines += [
            "# TYPE sharegpu_agent_mps_daemon_up gauge",
            f"sharegpu_agent_mps_daemon_up {up}",
            "# TYPE sharegpu_agent_mps_daemon_restarts_total counter",
            f"sharegpu_agent_mps_daemon_restarts_total {int(mps.get('restarts') or 0)}",
        ]
    if usage is not None:
        lines += render_usage(node, {g.index: g.uuid for g in agent.gpus}, usage,
                              pod_names=agent.config.metrics_pod_names)
    return "\n".join(lines) + "\n"


async def serve(agent: Agent, host: str, port: int,
                usage: UsageCollector | None = None) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            line = (await reader.readline()).decode("latin-1").split()
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            path = line[1] if len(line) > 1 else "/"
            if path == "/metrics":
                figures = None
                if usage is not None:
                    try:
                        figures = await usage.collect()
                    except Exception as e:  # the other metrics are still served
                        log.warning("GPU usage not read: %s", e)
                status, body = "200 OK", render(agent, figures)
            elif path == "/healthz":
                status, body = "200 OK", "ok\n"
            elif path == "/readyz":
                why = agent.unready()
                status, body = ("200 OK", "ok\n") if not why else (
                    "503 Service Unavailable", "".join(f"{w}\n" for w in why))
            else:
                status, body = "404 Not Found", "not found\n"
            data = body.encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data
            )
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, host, port)
