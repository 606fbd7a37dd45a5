"""Unallocated GPU % at 100 % arrival: strandfill, strandlp and strand beside FGD, BestFit and
the floors.

    python bench/policy_table.py --trace ../shared/traces/openb --jobs 1
    python bench/policy_table.py --trace ../shared/traces/openb --jobs 1 \\
        --policy strandfill --reuse bench/results/policy_table.json

Runs the simulator matrix (SPEC §9 protocol: seeds 42..51, inflation 1.3, arrival only, one
try per pod) through the same core the extender uses, prints a markdown table, writes the
summaries (per-seed values, no curves) to ``bench/results/policy_table.json`` and, when every
policy ran, the default trace's allocation curves to ``bench/policy_curve_default.png``.
``--policy`` runs only the named policies and ``--reuse`` takes the others' per-seed values
from an earlier ``policy_table.json`` (the simulator is deterministic: a policy whose code did
not change gives the same values again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from sharegpu.cli import parse_seeds
from sharegpu.sim import report
from sharegpu.sim.runner import Source, run_matrix

HERE = Path(__file__).resolve().parent
SPEC_TRACES = [
    "default", "cpu050", "cpu100", "cpu200", "gpushare40", "gpushare60", "gpushare80",
    "gpuspec10", "gpuspec20", "gpuspec25", "multigpu20", "multigpu30", "multigpu40",
]
OTHER_TRACES = ["cpu0", "cpu037", "cpu072", "cpu235", "cpu300", "gpushare20", "gpuspec05"]
POLICIES = ["strandfill", "strandlp", "strand", "fgd", "bestfit"]
LABEL = {"fgd": "FGD", "bestfit": "BestFit"}
NEW = "strandfill"  # the policy the distance and win columns are about
#: the least unallocated GPU % that a scheduler placing every pod that fits when it arrives can
#: reach (a configuration LP certified by its dual, issue 16); none was given for gpuspec*
ONLINE_FLOOR = {
    "default": 3.65, "gpushare20": 2.61, "gpushare40": 4.99, "gpushare60": 7.32,
    "gpushare80": 9.09, "multigpu20": 3.15, "multigpu30": 2.74, "multigpu40": 2.41,
    **{f"cpu{c}": 3.63 for c in ("0", "037", "050", "072", "100", "200", "235", "300")},
}

Seeds = dict[tuple[str, str], list[float]]


def markdown(seeds: Seeds, workloads: list[str]) -> str:
    """The table from per-seed values keyed by (trace, policy)."""
    lines = [
        "| trace | " + " | ".join(LABEL.get(p, p) for p in POLICIES)
        + f" | online floor | {NEW} − floor | strand − floor | {NEW} − strand "
        "| wins vs strand | wins vs FGD |",
        "|---|" + "---|" * (len(POLICIES) + 6),
    ]
    for w in workloads:
        cells = []
        for p in POLICIES:
            v = seeds[(w, p)]
            cells.append(f"{statistics.fmean(v):.2f} ± {statistics.stdev(v):.2f}")
        mean = {p: statistics.fmean(seeds[(w, p)]) for p in POLICIES}
        floor = ONLINE_FLOOR.get(w)
        if floor is None:
            dist = ["—", "—", "—"]
        else:
            dist = [f"{floor:.2f}", f"{mean[NEW] - floor:.2f}", f"{mean['strand'] - floor:.2f}"]
        wins = [sum(a < b for a, b in zip(seeds[(w, NEW)], seeds[(w, o)], strict=True))
                for o in ("strand", "fgd")]
        n = len(seeds[(w, NEW)])
        lines.append(
            f"| {w} | {' | '.join(cells)} | {' | '.join(dist)} "
            f"| {mean[NEW] - mean['strand']:+.2f} | {wins[0]}/{n} | {wins[1]}/{n} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=HERE.parent.parent / "shared/traces/openb")
    ap.add_argument("--workload", action="append", help="trace NAME (default: all 20)")
    ap.add_argument("--policy", action="append", choices=POLICIES,
                    help="run only these policies (default: all); see --reuse")
    ap.add_argument("--reuse", type=Path,
                    help="an earlier policy_table.json to take the other policies' values from")
    ap.add_argument("--seeds", default="42..51")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=HERE / "results/policy_table.json")
    args = ap.parse_args(argv)
    workloads = args.workload or SPEC_TRACES + OTHER_TRACES
    policies = args.policy or POLICIES
    seed_list = parse_seeds(args.seeds)
    old: dict[tuple[str, str], dict] = {}
    if args.reuse is not None:
        old = {(r["workload"], r["policy"]): r for r in json.loads(args.reuse.read_text())}
    missing = [(w, p) for w in workloads for p in POLICIES
               if p not in policies and ((w, p) not in old or old[(w, p)]["seeds"] != seed_list)]
    if missing:
        ap.error(f"no values for {missing[:3]}...: run them (--policy) or --reuse a table "
                 "that has them for these seeds")
    summaries = run_matrix(
        Source(args.trace.resolve()), workloads, policies, seed_list, jobs=args.jobs,
        on_done=lambda r: print(f"{r.workload}/{r.policy}/{r.seed}: {r.unallocated_pct:.2f}",
                                file=sys.stderr, flush=True),
    )
    rows = {(s.workload, s.policy): {k: v for k, v in s.to_json().items() if k != "curve"}
            for s in summaries}
    for w in workloads:
        for p in POLICIES:
            rows.setdefault((w, p), old.get((w, p), {}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([rows[(w, p)] for w in workloads for p in POLICIES],
                                   indent=1) + "\n")
    if "default" in workloads and set(policies) == set(POLICIES):
        report.plot([s for s in summaries if s.workload == "default"],
                    HERE / "policy_curve_default.png")
    seeds = {k: r["per_seed_unallocated_pct"] for k, r in rows.items()}
    print(markdown(seeds, workloads))
    first = workloads[0]
    speed = {p: rows[(first, p)]["pods_per_s"] for p in POLICIES}
    print(f"\npods/s on {first} (decisions only, mean over seeds; reused values are from the "
          "run that made them): " + ", ".join(f"{p} {v:,.0f}" for p, v in speed.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
