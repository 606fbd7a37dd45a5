"""Per-seed simulator figures and a fingerprint of every pod's placement, to show that a change
to a policy's code leaves its decisions exactly as they were.

    python bench/seed_fingerprint.py --out after.json
    PYTHONPATH=../before/src python bench/seed_fingerprint.py --out before.json
    python bench/seed_fingerprint.py --compare before.json after.json

Each run is one policy over one seed's openb stream (as ``sharegpu simulate`` runs it): every
field of its result (unallocated %, curve, fragmentation, pods placed, ...) but the timings,
the SHA-256 of the list of nodes the pods went to, and the CPU seconds it took (the process's
own time, which a busy machine inflates far less than wall time).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import sharegpu
from sharegpu.sim.engine import run_one
from sharegpu.sim.trace import NODE_FILE, read_nodes, read_pods, workload_path
from sharegpu.sim.workload import target_workload

ROOT = Path(__file__).resolve().parent.parent
TIMINGS = ("seconds", "decision_seconds")


def fingerprint(trace: Path, workloads: list[str], policies: list[str],
                seeds: list[int]) -> dict:
    nodes = read_nodes(trace / NODE_FILE)
    runs = []
    for wl in workloads:
        pods = read_pods(workload_path(trace, wl))
        target = target_workload(pods)
        for policy in policies:
            for seed in seeds:
                where: list[str | None] = []
                c0 = time.process_time()
                r = run_one(nodes, pods, policy, seed, wl, target, placements=where)
                cpu = time.process_time() - c0
                row = {k: v for k, v in dataclasses.asdict(r).items() if k not in TIMINGS}
                row["placements_sha256"] = hashlib.sha256(json.dumps(where).encode()).hexdigest()
                row["cpu_s"] = round(cpu, 2)
                runs.append(row)
                print(f"{wl} {policy} seed {seed}: {r.unallocated_pct} % "
                      f"{row['placements_sha256'][:16]} {cpu:.1f} CPU s", file=sys.stderr,
                      flush=True)
    return {"code": str(Path(sharegpu.__file__).parent), "runs": runs}


def compare(a: dict, b: dict) -> int:
    """Prints each run's differing fields (CPU seconds aside); 0 when none differ."""
    key = ("workload", "policy", "seed")
    bs = {tuple(r[k] for k in key): r for r in b["runs"]}
    bad = 0
    for r in a["runs"]:
        other = bs.get(tuple(r[k] for k in key))
        if other is None:
            print(f"{r['workload']} {r['policy']} {r['seed']}: missing in the second")
            bad += 1
            continue
        fields = [k for k in r if k != "cpu_s"]
        differ = [k for k in fields if r[k] != other.get(k)]
        bad += bool(differ)
        print(f"{r['workload']} {r['policy']} seed {r['seed']}: {len(fields)} fields, "
              f"differing: {differ or 'none'}; CPU s {r['cpu_s']} -> {other['cpu_s']}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "openb")
    p.add_argument("--workload", action="append", help="(repeatable; default: default, "
                   "gpuspec25)")
    p.add_argument("--policy", action="append", help="(repeatable; default: strandfill, strand)")
    p.add_argument("--seeds", default="42,43", help="comma-separated (default 42,43)")
    p.add_argument("--out", type=Path, help="write the fingerprint here (JSON)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"),
                   help="compare two fingerprints field by field")
    a = p.parse_args(argv)
    if a.compare:
        return compare(*(json.loads(f.read_text()) for f in a.compare))
    if not (a.trace / NODE_FILE).is_file():
        p.error(f"--trace: no {NODE_FILE} in {a.trace}")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds: {a.seeds!r} is not a comma-separated list of integers")
    out = fingerprint(a.trace, a.workload or ["default", "gpuspec25"],
                      a.policy or ["strandfill", "strand"], seeds)
    text = json.dumps(out, indent=1)
    if a.out:
        a.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
