"""``sharegpu isolation-check``: see a container's GPU isolation hold on this node."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..core.errors import ValidationError
from .argtypes import reserve_mib

NAME = "isolation-check"
HELP = "check on a GPU node that memory and compute limits hold for a request"
DESCRIPTION = (
    "Starts CUDA probe processes on this node with exactly the environment and library the node "
    "agent gives a container with --mem GiB (and --core %), and measures: the memory the probe "
    "sees, the largest allocation it gets, that the next one fails cleanly with "
    "CUDA_ERROR_OUT_OF_MEMORY, that two processes of one container share the limit, and (with "
    "--core) the share of a GPU two pods with P % and 100-P % get; with --crash, what a "
    "neighbour pod and a later pod get when a pod is killed or faults. Exit code 0 when every "
    "limit holds, 1 when one does not, 2 when the probes cannot run."
)
CORE_RULE = "must be a multiple of 5 from 5 to 100 (percent of one GPU's compute)"
INSTALLED = "/usr/local/vgpu/sharegpu/installed"  # the chart's hami-install init container
DEFAULT_LIBRARY = "/usr/local/vgpu/libvgpu.so"
BACKENDS = ("hami", "mps", "hami-mps")


def hami_library(args: argparse.Namespace) -> str:
    """The library the agent would hand out: the one given, else the chart's, else the
    default path."""
    if args.hami_library:
        return str(args.hami_library)
    try:
        named = Path(args.hami_installed).read_text().strip()
    except OSError:
        return DEFAULT_LIBRARY
    return named or DEFAULT_LIBRARY


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="hami",
                   help="isolation back-end: hami (HAMi-core's libvgpu.so), mps, or hami-mps "
                        "(HAMi-core's memory limit with MPS's compute share) (default hami)")
    p.add_argument("--mem", required=True, metavar="GIB", help="GPU memory of the request, GiB")
    p.add_argument("--core", metavar="PCT",
                   help="compute of the request, percent (5..100, multiple of 5)")
    p.add_argument("--gpu", default="0", metavar="INDEX", help="GPU index (default 0)")
    p.add_argument("--hami-library", default=None, metavar="PATH",
                   help="HAMi-core's libvgpu.so (default: the one the chart installed, named in "
                        f"{INSTALLED}, else /usr/local/vgpu/libvgpu.so)")
    p.add_argument("--hami-installed", default=INSTALLED, metavar="FILE",
                   help=f"the file the chart's init container writes (default {INSTALLED})")
    p.add_argument("--mps-pipe-dir", default="/run/nvidia/mps", metavar="DIR",
                   help="the MPS control daemon's pipe directory (default /run/nvidia/mps)")
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control", metavar="CMD",
                   help="the MPS control client, to ask the daemon (default "
                        "nvidia-cuda-mps-control)")
    p.add_argument("--compute-policy", default="5", metavar="N",
                   help="cGPU compute policy as the agent runs with it (default 5, native)")
    p.add_argument("--seconds", default="5", metavar="S",
                   help="how long the compute probes run (default 5)")
    p.add_argument("--compute-kernel", default="burn", choices=("burn", "spin"),
                   help="the compute probes' kernel: burn (default), a fixed amount of "
                        "arithmetic per launch, or spin, a busy loop on the clock")
    p.add_argument("--reserve-mib", default="0", metavar="MIB",
                   help="the agent's --reserve-mib, for the GiB --fill counts with (default 0)")
    p.add_argument("--fill", action="store_true",
                   help="also fill the GPU with as many pods of --mem GiB as the scheduler "
                        "places on it, each holding all it can get")
    p.add_argument("--compare", action="store_true",
                   help="also measure kernel launch and allocation rates without the limits")
    p.add_argument("--crash", action="store_true",
                   help="also let a pod crash (killed, then a fatal GPU fault) beside a "
                        "neighbour pod, and see what the neighbour and a later pod get")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--cuda-library", default="libcuda.so.1", metavar="NAME",
                   help="the CUDA driver library the probes load (default libcuda.so.1)")


def _int(field: str, value: object, rule: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValidationError(field, value, rule) from None


def request(args: argparse.Namespace):
    """The validated request (``ValidationError`` names the flag and its rule)."""
    from ..agent.isolation import parse_policy
    from ..isolation_check.check import Request

    if args.backend not in BACKENDS:
        raise ValidationError("--backend", args.backend, "must be hami, mps or hami-mps")
    mem_rule = "must be a whole number of GiB, 1 or more"
    mem = _int("--mem", args.mem, mem_rule)
    if mem < 1:
        raise ValidationError("--mem", args.mem, mem_rule)
    core = None
    if args.core is not None:
        core = _int("--core", args.core, CORE_RULE)
        if not (5 <= core <= 100 and core % 5 == 0):
            raise ValidationError("--core", args.core, CORE_RULE)
    gpu_rule = "must be a GPU index, 0 or more"
    gpu = _int("--gpu", args.gpu, gpu_rule)
    if gpu < 0:
        raise ValidationError("--gpu", args.gpu, gpu_rule)
    policy = parse_policy(args.compute_policy, args.backend)
    reserve = reserve_mib(args.reserve_mib)
    try:
        seconds = float(args.seconds)
    except ValueError:
        seconds = -1.0
    if not (0 < seconds <= 600):
        raise ValidationError("--seconds", args.seconds,
                              "must be a number of seconds, more than 0 and at most 600")
    # the node agent's own fail-closed checks, with its reasons and fixes
    import shlex

    from ..agent.readiness import check_hami, check_mps

    library = hami_library(args)
    uses_hami = args.backend in ("hami", "hami-mps")
    if uses_hami:
        ready = check_hami(library)
        if not ready.ready:
            raise ValidationError("--hami-library", library, f"{ready.reason}; fix: {ready.fix}")
    if args.backend in ("mps", "hami-mps"):
        control = tuple(shlex.split(args.mps_control)) or ("nvidia-cuda-mps-control",)
        ready = check_mps(args.mps_pipe_dir, control)
        if not ready.ready:
            raise ValidationError("--mps-pipe-dir", args.mps_pipe_dir,
                                  f"{ready.reason}; fix: {ready.fix}")
    if not args.cuda_library or (os.sep in args.cuda_library and not Path(
            args.cuda_library).is_file()):
        raise ValidationError("--cuda-library", args.cuda_library,
                              "no such file: pass the CUDA driver library (libcuda.so.1)")
    return Request(
        backend=args.backend, mem_gib=mem, core=core, gpu=gpu,
        hami_library=os.path.abspath(library) if uses_hami else library,
        mps_pipe_dir=os.path.abspath(args.mps_pipe_dir), compute_policy=int(policy),
        seconds=seconds, compare=bool(args.compare), cuda_library=args.cuda_library,
        fill=bool(args.fill), kernel=args.compute_kernel, reserve_mib=reserve,
        crash=bool(args.crash),
    )


def run(args: argparse.Namespace) -> int:
    import json
    from contextlib import nullcontext

    from rich.console import Console

    from ..core.errors import ShareGpuError
    from ..isolation_check.check import CheckError, run_check
    from ..isolation_check.render import table

    req = request(args)
    err = Console(stderr=True)
    show = not args.json and err.is_terminal
    with err.status("starting probes", spinner="dots") if show else nullcontext() as status:
        def say(msg: str) -> None:
            if status is not None:
                status.update(msg)

        try:
            report = run_check(req, progress=say)
        except (ShareGpuError, KeyboardInterrupt):
            raise
        except Exception as e:  # never a traceback: one line naming what failed
            raise CheckError(f"the check failed unexpectedly: {type(e).__name__}: {e}") from None
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        out = Console()
        table(report, out if out.is_terminal else Console(width=120))
    return 0 if report.ok else 1
