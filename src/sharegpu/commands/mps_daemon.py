"""``sharegpu mps-daemon``: run and supervise the MPS control daemon of an ``mps`` node."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal

from ..core.errors import ValidationError

NAME = "mps-daemon"
HELP = "start, supervise and stop nvidia-cuda-mps-control as the node's mode asks (mps nodes)"
DESCRIPTION = (
    "Runs beside the node agent (the chart's mps-control container). While the agent's node is "
    "in mps mode it keeps nvidia-cuda-mps-control running in the foreground with its pipe, log "
    "and shared-memory directories on the host, restarts it with back-off when it exits, and "
    "sets its defaults; when the node leaves mps mode it asks the daemon to quit."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", default="/var/lib/sharegpu",
                   help="the agent's state directory (its current-mode file is followed)")
    p.add_argument("--pipe-dir", default="/run/nvidia/mps",
                   help="CUDA_MPS_PIPE_DIRECTORY on the host (client containers mount it)")
    p.add_argument("--log-dir", default="/var/log/nvidia-mps", help="CUDA_MPS_LOG_DIRECTORY")
    p.add_argument("--shm-dir", default="/run/nvidia/mps-shm",
                   help="shared memory of the daemon and its clients (mounted as /dev/shm)")
    p.add_argument("--control", default="nvidia-cuda-mps-control",
                   help="the control daemon's command (words split as a shell would)")
    p.add_argument("--default-active-thread-percentage", type=int, default=None,
                   help="set_default_active_thread_percentage once the daemon answers (1-100)")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between rounds")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def run(args: argparse.Namespace) -> int:
    from ..agent.mps import MpsConfig, MpsSupervisor
    from ..kubeio.logs import configure as configure_logging

    configure_logging(args.log_level)
    pct = args.default_active_thread_percentage
    if pct is not None and not 1 <= pct <= 100:
        raise ValidationError("--default-active-thread-percentage", pct, "must be 1..100")
    if args.poll <= 0:
        raise ValidationError("--poll", args.poll, "must be positive")
    control = shlex.split(args.control)
    if not control:
        raise ValidationError("--control", args.control, "must name a command")
    sup = MpsSupervisor(MpsConfig(
        state_dir=args.state_dir, pipe_dir=args.pipe_dir, log_dir=args.log_dir,
        shm_dir=args.shm_dir, control=control, poll_s=args.poll,
        default_active_thread_percentage=pct,
    ))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, sup.shutdown)
        await sup.run()

    asyncio.run(main())
    return 0
