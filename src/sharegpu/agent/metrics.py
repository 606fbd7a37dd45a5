"""A minimal Prometheus text endpoint for the agent (``GET /metrics``, ``GET /healthz``)."""

from __future__ import annotations

import asyncio
import contextlib

from .mps import read_state
from .service import Agent


def render(agent: Agent) -> str:
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
        "# HELP sharegpu_agent_isolation_ready 1 when the node's isolation back-end is usable",
        "# TYPE sharegpu_agent_isolation_ready gauge",
        f'sharegpu_agent_isolation_ready{{backend="{r.backend.value}"}} {int(r.ready)}',
        "# TYPE sharegpu_agent_isolation_refusals_total counter",
        f"sharegpu_agent_isolation_refusals_total {agent.isolation_refusals}",
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
    return "\n".join(lines) + "\n"


async def serve(agent: Agent, host: str, port: int) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            line = (await reader.readline()).decode("latin-1").split()
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            path = line[1] if len(line) > 1 else "/"
            if path == "/metrics":
                status, body = "200 OK", render(agent)
            elif path == "/healthz":
                status, body = "200 OK", "ok\n"
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
