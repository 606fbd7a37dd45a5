"""Ours vs the FGD paper: unallocated GPU % at 100 % arrival, mean ± sd over seeds 42..51.

    python bench/paper_table.py                       # six policies on default, FGD and
                                                      # BestFit on every trace of the paper
    python bench/paper_table.py --workload default --policy fgd --seeds 42..43

Prints a markdown table (ours, published, difference) and, with --plot, the default
workload's allocation curves.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sharegpu.cli import parse_seeds
from sharegpu.sim import report
from sharegpu.sim.runner import Source, Summary, run_matrix

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "openb"
PAPER = ["random", "dotprod", "clustering", "packing", "bestfit", "fgd"]


def markdown(summaries: list[Summary]) -> str:
    lines = ["| trace | policy | ours (mean ± sd) | published | ours − published |",
             "|---|---|---|---|---|"]
    for s in summaries:
        mean, sd = s.unallocated
        pub = report.published(s.workload, s.policy)
        diff = f"{mean - pub:+.2f}" if pub is not None else "—"
        pub_s = f"{pub:.2f}" if pub is not None else "—"
        lines.append(f"| {s.workload} | {s.policy} | {mean:.2f} ± {sd:.2f} | {pub_s} | {diff} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--workload", action="append")
    ap.add_argument("--policy", action="append")
    ap.add_argument("--seeds", default="42..51")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--plot", type=Path, help="PNG of the default workload's curves")
    args = ap.parse_args()
    seeds = parse_seeds(args.seeds)
    source = Source(args.trace.resolve())
    t0 = time.perf_counter()
    if args.workload or args.policy:
        jobs = [(args.workload or ["default"], args.policy or PAPER)]
    else:
        others = [w for w in report.PUBLISHED if w != "default"]
        jobs = [(["default"], PAPER), (others, ["bestfit", "fgd"])]
    summaries: list[Summary] = []
    for workloads, policies in jobs:
        summaries += run_matrix(source, workloads, policies, seeds, jobs=args.jobs or None)
    print(markdown(summaries))
    print(f"\n{sum(len(s.runs) for s in summaries)} runs in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    if args.plot:
        report.plot([s for s in summaries if s.workload == "default"], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
