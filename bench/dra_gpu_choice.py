"""DRA mode: what kube-scheduler's in-node device choice costs against the policy's own.

    python bench/dra_gpu_choice.py --trace ../shared/traces/openb --jobs 1

In DRA mode sharegpu's extender ranks the nodes with the policy (as in device-plugin mode), but
the GPU inside the chosen node is picked by kube-scheduler's DRA allocator: the first device,
in the slice's order (``gpu-0``, ``gpu-1``...), whose remaining capacity holds the claim. This
runs the simulator (SPEC §9 protocol: seeds 42..51, inflation 1.3, arrival only, one try per
pod) twice per policy and trace — GPUs chosen by the policy, and by first fit with the node
still the policy's — prints a markdown table and writes the summaries (per-seed values, no
curves) to ``bench/results/dra_gpu_choice.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sharegpu.cli import parse_seeds
from sharegpu.sim.runner import Source, Summary, run_matrix

HERE = Path(__file__).resolve().parent
TRACES = ["default", "gpushare60", "multigpu40"]
POLICIES = ["default", "fgd"]
NAMES = {"default": "default (strand)", "fgd": "FGD"}


def markdown(policy_runs: list[Summary], alloc_runs: list[Summary]) -> str:
    alloc = {(s.workload, s.policy): s for s in alloc_runs}
    lines = [
        "| trace | policy | policy's GPU choice | allocator's first fit | cost (points) "
        "| seeds worse / equal / better |",
        "|---|---|---|---|---|---|",
    ]
    for s in policy_runs:
        a = alloc[(s.workload, s.policy)]
        m0, sd0 = s.unallocated
        m1, sd1 = a.unallocated
        pairs = list(zip((r.unallocated_pct for r in s.runs),
                         (r.unallocated_pct for r in a.runs), strict=True))
        worse = sum(y > x for x, y in pairs)
        equal = sum(y == x for x, y in pairs)
        lines.append(
            f"| {s.workload} | {NAMES.get(s.policy, s.policy)} | {m0:.2f} ± {sd0:.2f} "
            f"| {m1:.2f} ± {sd1:.2f} | {m1 - m0:+.2f} | {worse} / {equal} / "
            f"{len(pairs) - worse - equal} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True, help="the openb folder")
    ap.add_argument("--workload", action="append", help=f"(repeatable; default {TRACES})")
    ap.add_argument("--policy", action="append", help=f"(repeatable; default {POLICIES})")
    ap.add_argument("--seeds", default="42..51")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "dra_gpu_choice.json")
    args = ap.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    workloads = args.workload or TRACES
    policies = args.policy or POLICIES
    source = Source(args.trace.resolve())
    started = time.perf_counter()
    runs: dict[str, list[Summary]] = {}
    for choice in ("policy", "allocator"):
        runs[choice] = run_matrix(
            source, workloads, policies, seeds, jobs=args.jobs, gpu_choice=choice,
            on_done=lambda r: print(f"{r.gpu_choice} {r.workload}/{r.policy}/{r.seed}: "
                                    f"{r.unallocated_pct:.2f} ({r.seconds:.1f} s)",
                                    file=sys.stderr, flush=True),
        )
    table = markdown(runs["policy"], runs["allocator"])
    print(table)
    print(f"\n{time.perf_counter() - started:.0f} s", file=sys.stderr)
    out = []
    for choice, summaries in runs.items():
        for s in summaries:
            j = s.to_json()
            j.pop("curve", None)
            j["gpu_choice"] = choice
            out.append(j)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
