"""``sharegpu simulate``: replay a workload through the placement policies."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ValidationError
from .argtypes import parse_seeds, positive_float

NAME = "simulate"
HELP = "replay a workload through the placement policies and measure stranded GPU"
DESCRIPTION = (
    "Replays pods through the same core that schedules a cluster, following the FGD paper's "
    "protocol (shuffle per seed, inflate to 1.3x capacity, arrival only, one try per pod). "
    "Without --trace it runs on a generated cluster and workload."
)
PAPER_POLICIES = ["random", "dotprod", "clustering", "packing", "bestfit", "fgd"]
DEFAULT_POLICIES = [*PAPER_POLICIES, "strand"]  # the paper's six, then sharegpu's own


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--trace", type=Path, help="folder with openb_node_list_gpu_node.csv and "
                   "openb_pod_list_<NAME>.csv (e.g. ../shared/traces/openb)")
    s.add_argument("--workload", action="append", help="workload NAME (repeatable; default: "
                   "'default' with --trace, 'generated' without)")
    s.add_argument("--policy", action="append", help="placement policy (repeatable; default: "
                   "the six paper policies and strand); see 'sharegpu policies'")
    s.add_argument("--seeds", default="42..51", help="seeds: 42..51, 42,43 or 42 (default 42..51)")
    s.add_argument("--inflation", type=positive_float, default=1.3,
                   help="inflate the workload to this × GPU capacity (default 1.3)")
    s.add_argument("--jobs", type=int, default=0, help="worker processes (default: CPU count)")
    s.add_argument("--json", action="store_true", help="print JSON results to stdout")
    s.add_argument("--plot", type=Path, help="write the allocation-curve plot to this PNG")
    s.add_argument("--gpu-choice", choices=["policy", "allocator"], default="policy",
                   help="GPUs inside the chosen node: the policy's own (default), or what "
                   "kube-scheduler's DRA allocator takes (the first that fit, in device order; "
                   "DRA mode, docs/dra.md)")
    s.add_argument("--gen-seed", type=int, default=None,
                   help="seed of the generated cluster and workload (without --trace)")


def check_plot_path(path: Path) -> None:
    """Before a run: the plot can be drawn (matplotlib, the ``plot`` extra) and written there."""
    import os
    import tempfile

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValidationError("--plot", str(path), "needs matplotlib: pip install "
                              "'sharegpu[plot]' (or pip install matplotlib)") from None
    parent = path.expanduser().resolve().parent
    if not parent.is_dir():
        raise ValidationError("--plot", str(path), f"directory {parent} does not exist")
    try:  # a real write: permissions alone do not tell (root, /proc, read-only mounts)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".sharegpu-plot-"):
            pass
    except OSError as e:
        raise ValidationError("--plot", str(path),
                              f"cannot write in {parent} ({e.strerror or e})") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ValidationError("--plot", str(path), "the file is not writable")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from ..placement.base import get_policy
    from ..sim import generate, report
    from ..sim.runner import Source, run_matrix

    seeds = parse_seeds(args.seeds)
    if args.plot:
        check_plot_path(args.plot)
    if args.trace is not None and not args.trace.is_dir():
        raise ValidationError("--trace", str(args.trace), "must be a folder")
    if args.trace is None:
        source = Source(None, args.gen_seed if args.gen_seed is not None else generate.DEFAULT_SEED)
    else:
        source = Source(args.trace.resolve())
    workloads = args.workload or (["default"] if args.trace else [generate.WORKLOAD_NAME])
    policies = args.policy or DEFAULT_POLICIES
    for pol in policies:
        get_policy(pol)  # validates the name
    if args.jobs < 0:
        raise ValidationError("--jobs", args.jobs, "must be 0 (CPU count) or more")

    err = Console(stderr=True)
    total = len(workloads) * len(policies) * len(seeds)
    with Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=err, transient=True, disable=total < 2,
    ) as progress:
        task = progress.add_task("simulating", total=total)
        summaries = run_matrix(
            source, workloads, policies, seeds, inflation=args.inflation, jobs=args.jobs or None,
            gpu_choice=args.gpu_choice,
            on_done=lambda r: progress.update(
                task, advance=1, description=f"{r.workload}/{r.policy}/{r.seed}"
            ),
        )
    if args.json:
        print(report.to_json(summaries))
    else:
        report.table(summaries, Console())
    if args.plot:
        report.plot(summaries, args.plot)
        err.print(f"plot written to {args.plot}")
    return 0
