"""``sharegpu whatif`` on a large dump: Today, and each policy's Replay, in CPU seconds.

    python bench/whatif_speed.py                       # 5,000 nodes × 8 GPUs, ~40,000 pods
    python bench/whatif_speed.py --policy fgd --policy strandfill --json

The dump: 5,000 nodes of 8 GPUs (a third each A100, V100, T4), a pod stream generated as
``sharegpu generate``'s (sharing pods, whole GPUs, 2 to 8 GPUs, a tenth pinned to models),
placed by the simulator under ``--placing`` (binpack by default: the quickest to make) and
written as the extender leaves pods (``testing/sharegpu_testing/dumps.py``). Timed: reading the
JSON, Today (reading the objects, the state, per-GPU figures, why pending pods wait), and one
Replay per policy (one ordering: the dump records the extender's decision order).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import devpath  # noqa: F401  (puts sharegpu_testing on the path)
from sharegpu.core.modes import Mode
from sharegpu.core.placement.base import Policy, available
from sharegpu.core.state import NodeSpec
from sharegpu.kubeio.gcpause import gc_paused
from sharegpu.sim import generate
from sharegpu.sim.workload import stream
from sharegpu.whatif.cluster import read
from sharegpu.whatif.policyreplay import holders, orderings, replay_one
from sharegpu.whatif.today import today
from sharegpu_testing.dumps import gpu_target, synthesise
from sharegpu_testing.replay import GPU_UNITS

MODELS = ("A100", "V100", "T4")


def cluster_nodes(count: int) -> list[NodeSpec]:
    return [NodeSpec(f"n{i:05d}", [GPU_UNITS] * 8, Mode.CGPU, model=MODELS[i % 3],
                     cpu_milli=128_000, mem_mib=1 << 20) for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--pods", type=int, default=40000, help="pods in the stream (about)")
    ap.add_argument("--placing", default="binpack")
    ap.add_argument("--policy", action="append", help="default: every policy")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    nodes = cluster_nodes(args.nodes)
    pods = generate.pods(7, count=args.pods)
    capacity = 8 * args.nodes
    demand = sum(p.gpu_demand for p in pods) / GPU_UNITS
    inflation = demand / capacity  # the stream is the pods, shuffled
    t0 = time.perf_counter()
    target = gpu_target(stream(pods, capacity, 0, inflation))
    dump = synthesise(nodes, pods, policy=args.placing, seed=0, inflation=inflation,
                      target=target)
    raw = json.dumps(dump.doc)
    made = time.perf_counter() - t0

    with gc_paused():  # as the command runs
        c0, w0 = time.process_time(), time.perf_counter()
        doc = json.loads(raw)
        c1 = time.process_time()
        items = doc["items"]
        cluster = read([o for o in items if o["kind"] == "Node"],
                       [o for o in items if o["kind"] == "Pod"])
        now = today(cluster, Policy())
        c2, w2 = time.process_time(), time.perf_counter()
    out = {
        "nodes": len(cluster.specs), "pods": len(cluster.pods),
        "bound": len(cluster.bound), "pending": len(cluster.pending),
        "dump_mib": round(len(raw) / 2**20, 1), "made_s": round(made, 1),
        "json_cpu_s": round(c1 - c0, 3), "today_cpu_s": round(c2 - c1, 3),
        "read_and_today_wall_s": round(w2 - w0, 3), "replay_cpu_s": {},
        "load": os.getloadavg()[0],
    }
    _, orders = orderings(cluster, 1)
    held = holders(now.state)
    for name in args.policy or available():
        with gc_paused():
            run = replay_one(cluster, name, orders[0], held)
        out["replay_cpu_s"][name] = round(run.seconds, 2)
        if not args.json:
            print(f"{name:<12} replay {run.seconds:6.2f} s CPU, placed {run.placed}, "
                  f"GPUs held otherwise {run.differences}", flush=True)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print({k: v for k, v in out.items() if k != "replay_cpu_s"})


if __name__ == "__main__":
    main()
