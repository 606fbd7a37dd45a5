"""``sharegpu simulate``: replay a workload through the placement policies."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..core.errors import ValidationError
from .argtypes import parse_seeds, positive_float

NAME = "simulate"
HELP = "replay a workload through the placement policies and measure stranded GPU"
DESCRIPTION = (
    "Replays pods through the same core that schedules a cluster, following the FGD paper's "
    "protocol (shuffle per seed, inflate to 1.3x capacity, arrival only, one try per pod). "
    "Without --trace it runs a quick look on a generated cluster and workload: four policies, "
    "three seeds. With --trace it runs the paper's comparison: its six policies and "
    "sharegpu's default (strandfill), "
    "seeds 42..51."
)
PAPER_POLICIES = ["random", "dotprod", "clustering", "packing", "bestfit", "fgd"]
DEFAULT_POLICIES = [*PAPER_POLICIES, "strandfill"]  # the paper's six, then sharegpu's default
PAPER_SEEDS = "42..51"
# the quick look without a trace: the floor (random), the best of the paper's baselines, the
# paper's policy and sharegpu's default, on three seeds: about a fifth of the CPU of all seven
# policies on ten seeds (docs/simulator.md)
QUICK_POLICIES = ["random", "bestfit", "fgd", "strandfill"]
QUICK_SEEDS = "42..44"


def defaults(trace: bool) -> tuple[list[str], str]:
    """The policies and seeds of a run that names none: the paper's with a trace, the quick
    look without."""
    return (DEFAULT_POLICIES, PAPER_SEEDS) if trace else (QUICK_POLICIES, QUICK_SEEDS)


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--trace", type=Path, metavar="DIR", help="folder with "
                   "openb_node_list_gpu_node.csv and openb_pod_list_<NAME>.csv: Alibaba's "
                   "openb trace, or what 'sharegpu generate' writes")
    s.add_argument("--workload", action="append", help="workload NAME (repeatable; default: "
                   "'default' with --trace, 'generated' without)")
    s.add_argument("--policy", action="append", help="placement policy (repeatable; default: "
                   f"{', '.join(DEFAULT_POLICIES)} with --trace, {', '.join(QUICK_POLICIES)} "
                   "without); see 'sharegpu policies'")
    s.add_argument("--seeds", help=f"seeds: 42..51, 42,43 or 42 (default: {PAPER_SEEDS} with "
                   f"--trace, {QUICK_SEEDS} without)")
    s.add_argument("--inflation", type=positive_float, default=1.3,
                   help="inflate the workload to this × GPU capacity (default 1.3)")
    s.add_argument("--jobs", type=int, default=0,
                   help="worker processes (default: 0, one per CPU, at most one per run)")
    s.add_argument("--json", action="store_true", help="print JSON results to stdout")
    s.add_argument("--plot", type=Path, metavar="PNG",
                   help="write the allocation-curve plot to this PNG (needs matplotlib, in "
                   "sharegpu's environment: python -m pip install matplotlib)")
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
        # the interpreter running sharegpu names its own environment, however it was installed
        raise ValidationError("--plot", str(path), "needs matplotlib, which is not installed: "
                              f"{shlex.quote(sys.executable)} -m pip install matplotlib"
                              ) from None
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
    import sys

    from rich.console import Console

    from ..core.placement.base import get_policy
    from ..sim import generate, report
    from ..sim.progress import for_stream
    from ..sim.runner import Source, run_matrix, stream_lengths

    default_policies, default_seeds = defaults(args.trace is not None)
    seeds = parse_seeds(args.seeds or default_seeds)
    if args.plot:
        check_plot_path(args.plot)
    if args.trace is not None and not args.trace.is_dir():
        raise ValidationError("--trace", str(args.trace), "must be a folder")
    if args.trace is None:
        source = Source(None, args.gen_seed if args.gen_seed is not None else generate.DEFAULT_SEED)
    else:
        source = Source(args.trace.resolve())
    workloads = args.workload or (["default"] if args.trace else [generate.WORKLOAD_NAME])
    policies = args.policy or default_policies
    for pol in policies:
        get_policy(pol)  # validates the name
    if args.jobs < 0:
        raise ValidationError("--jobs", args.jobs, "must be 0 (CPU count) or more")

    err = Console(stderr=True)
    # the table reports the figures at 100 % arrival: without --json and --plot (the curve to
    # 130 %) each run stops once they are known, and they are what the whole run would give
    headline_only = not args.json and not args.plot
    lengths = stream_lengths(source, workloads, seeds, args.inflation, headline_only)
    runs = len(workloads) * len(policies) * len(seeds)
    pods = len(policies) * sum(lengths.values())
    progress = for_stream(err, sys.stderr, pods, runs)
    try:
        summaries = run_matrix(
            source, workloads, policies, seeds, inflation=args.inflation, jobs=args.jobs or None,
            gpu_choice=args.gpu_choice, on_done=progress.finished, on_pods=progress.pods,
            headline_only=headline_only,
        )
    finally:
        progress.close()
    if args.json:
        print(report.to_json(summaries))
    else:
        report.table(summaries, Console())
        if args.trace is None and not args.policy and not args.seeds:
            print(f"A quick look: {len(policies)} policies × seeds {default_seeds} on the "
                  "generated cluster. The paper's comparison: --trace DIR (its six policies and "
                  f"{DEFAULT_POLICIES[-1]}, seeds {PAPER_SEEDS}); docs/simulator.md.")
    if args.plot:
        report.plot(summaries, args.plot)
        err.print(f"plot written to {args.plot}")
    return 0
