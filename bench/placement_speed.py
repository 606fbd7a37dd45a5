"""Placement speed: decisions per second per policy, through the same Scheduler the extender uses.

Clusters: the openb cluster (1,213 nodes, 6,212 GPUs; needs the public trace, see --trace) and a
generated 5,000-node × 8-GPU cluster. Pods: the openb default workload's stream for seed 42 (the
generated workload when the trace is missing), the first --pods of it; every decision counts,
placed or not. Also times one whole default-trace simulator run of one seed under FGD.

    python bench/placement_speed.py --json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from sharegpu.core.modes import Mode
from sharegpu.core.placement import get_policy
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.sim import generate
from sharegpu.sim.engine import run_one
from sharegpu.sim.trace import GPU_UNITS, read_nodes, read_pods, workload_path
from sharegpu.sim.workload import stream, target_workload

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "openb"
POLICIES = ["binpack", "spread", "random", "dotprod", "clustering", "packing", "bestfit", "fgd",
            "strand", "strandfill"]
TARGETS = {"binpack": 2000.0, "fgd": 300.0, "strand": 500.0, "strandfill": 500.0}
FGD_RUN_TARGET_S = 30.0


def big_cluster(nodes: int = 5000, gpus: int = 8) -> list[NodeSpec]:
    return [NodeSpec(f"big-{i:05d}", [GPU_UNITS] * gpus, Mode.CGPU, model="G2",
                     cpu_milli=128_000, mem_mib=786_432) for i in range(nodes)]


def measure(nodes: list[NodeSpec], pods, policy: str, count: int, seed: int = 42) -> dict:
    state = ClusterState(nodes)
    state.set_order(np.random.default_rng(seed).permutation(state.n))
    capacity = int(state.gpu_count[: state.n].sum())
    seq = stream(pods, capacity, seed)[:count]
    pol = get_policy(policy)
    pol.prepare(state, target_workload(pods))
    sched = Scheduler(state, pol, seed=seed)
    reqs = [p.request(f"{p.name}#{i}") for i, p in enumerate(seq)]
    placed = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for r in reqs:
        placed += sched.schedule(r) is not None
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    # pods per CPU second: the process's own time, which a busy machine inflates far less
    return {"pods": len(reqs), "placed": placed, "seconds": round(dt, 3),
            "pods_per_s": round(len(reqs) / dt, 1),
            "pods_per_cpu_s": round(len(reqs) / cpu, 1) if cpu > 0 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--pods", type=int, default=4000, help="decisions per measurement")
    ap.add_argument("--policy", action="append", help="policies (default: all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    policies = args.policy or POLICIES

    have_trace = (args.trace / "openb_node_list_gpu_node.csv").is_file()
    if have_trace:
        openb_nodes = read_nodes(args.trace / "openb_node_list_gpu_node.csv")
        pods = read_pods(workload_path(args.trace, "default"))
        clusters = {"openb (1213 nodes, 6212 GPUs)": openb_nodes}
    else:
        print(f"note: no openb trace at {args.trace}; using the generated workload",
              file=sys.stderr)
        pods = generate.pods()
        clusters = {"generated (300 nodes)": generate.nodes()}
    clusters["generated 5000 nodes x 8 GPUs"] = big_cluster()

    out: dict = {"machine": {"python": platform.python_version(), "cpu": platform.processor()
                             or platform.machine()}, "decisions": [], "targets": []}
    for cname, nodes in clusters.items():
        for pol in policies:
            r = measure(nodes, pods, pol, args.pods)
            out["decisions"].append({"cluster": cname, "policy": pol, **r})
            if not args.json:
                print(f"{cname:32s} {pol:11s} {r['pods_per_s']:>10,.0f} pods/s "
                      f"{r['pods_per_cpu_s'] or 0:>10,.0f} pods/CPU s", flush=True)
    for row in out["decisions"]:
        tgt = TARGETS.get(row["policy"])
        if tgt:
            out["targets"].append({"what": f"{row['policy']} on {row['cluster']}",
                                   "pods_per_s": row["pods_per_s"], "target": tgt,
                                   "ratio": round(row["pods_per_s"] / tgt, 2)})
    if have_trace:
        t0 = time.perf_counter()
        r = run_one(openb_nodes, pods, "fgd", 42, "default", target_workload(pods))
        dt = time.perf_counter() - t0
        out["fgd_default_one_seed"] = {"seconds": round(dt, 2), "pods": r.pods,
                                       "unallocated_pct": r.unallocated_pct}
        out["targets"].append({"what": "one default-trace FGD run (seed 42), seconds",
                               "seconds": round(dt, 2), "target": FGD_RUN_TARGET_S,
                               "ratio": round(FGD_RUN_TARGET_S / dt, 2)})
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for t in out["targets"]:
            print(f"{t['what']}: x{t['ratio']} of target {t['target']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
