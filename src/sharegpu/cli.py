"""The ``sharegpu`` command line. Bad arguments get a message naming the argument and the rule
(exit code 2), never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import ShareGpuError, ValidationError


def parse_seeds(text: str) -> list[int]:
    """``42..51`` (inclusive), ``42,43,47`` or ``42``."""
    rule = "must be N, N..M (inclusive) or a comma-separated list of whole numbers"
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if ".." in part:
                a, b = part.split("..", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValidationError("--seeds", text, "a range N..M needs M >= N")
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise ValidationError("--seeds", text, rule) from None
    if not out:
        raise ValidationError("--seeds", text, rule)
    return out


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return v


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sharegpu", description="GPU sharing for Kubernetes")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser(
        "simulate",
        help="replay a workload through the placement policies and measure stranded GPU",
        description="Replays pods through the same core that schedules a cluster, following the "
        "FGD paper's protocol (shuffle per seed, inflate to 1.3x capacity, arrival only, one "
        "try per pod). Without --trace it runs on a generated cluster and workload.",
    )
    s.add_argument("--trace", type=Path, help="folder with openb_node_list_gpu_node.csv and "
                   "openb_pod_list_<NAME>.csv (e.g. ../shared/traces/openb)")
    s.add_argument("--workload", action="append", help="workload NAME (repeatable; default: "
                   "'default' with --trace, 'generated' without)")
    s.add_argument("--policy", action="append", help="placement policy (repeatable; default: "
                   "the six paper policies)")
    s.add_argument("--seeds", default="42..51", help="seeds: 42..51, 42,43 or 42 (default 42..51)")
    s.add_argument("--inflation", type=_positive_float, default=1.3,
                   help="inflate the workload to this × GPU capacity (default 1.3)")
    s.add_argument("--jobs", type=int, default=0, help="worker processes (default: CPU count)")
    s.add_argument("--json", action="store_true", help="print JSON results to stdout")
    s.add_argument("--plot", type=Path, help="write the allocation-curve plot to this PNG")
    s.add_argument("--gen-seed", type=int, default=None, help="seed of the generated cluster "
                   "and workload (without --trace)")

    g = sub.add_parser("generate", help="write the generated cluster and workload as openb CSVs")
    g.add_argument("--out", type=Path, required=True, help="folder to write into")
    g.add_argument("--seed", type=int, default=None, help="generator seed")

    sub.add_parser("policies", help="list the placement policies")
    return p


PAPER_POLICIES = ["random", "dotprod", "clustering", "packing", "bestfit", "fgd"]


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from .placement.base import get_policy
    from .sim import generate, report
    from .sim.runner import Source, run_matrix

    seeds = parse_seeds(args.seeds)
    if args.trace is not None and not args.trace.is_dir():
        raise ValidationError("--trace", str(args.trace), "must be a folder")
    if args.trace is None:
        source = Source(None, args.gen_seed if args.gen_seed is not None else generate.DEFAULT_SEED)
    else:
        source = Source(args.trace.resolve())
    workloads = args.workload or (["default"] if args.trace else [generate.WORKLOAD_NAME])
    policies = args.policy or PAPER_POLICIES
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


def cmd_generate(args: argparse.Namespace) -> int:
    from .sim import generate

    seed = args.seed if args.seed is not None else generate.DEFAULT_SEED
    nodes, pods = generate.write(args.out, seed)
    print(f"wrote {nodes} and {pods}")
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from .placement.base import ALIASES, available

    for name in available():
        print(name)
    for alias, real in ALIASES.items():
        print(f"{alias} -> {real}")
    return 0


COMMANDS = {"simulate": cmd_simulate, "generate": cmd_generate, "policies": cmd_policies}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ShareGpuError as e:
        print(f"sharegpu {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
