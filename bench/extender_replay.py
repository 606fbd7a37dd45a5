"""The openb trace through the scheduler extender over HTTP, against the fake API server,
compared with ``sharegpu simulate`` for the same seed and policy (the default policy unless
``--policy``): the same placements and unallocated %, and what the extender gives when CPU and
memory are hidden from it.

    python bench/extender_replay.py --trace ../shared/traces/openb --seed 42 --json

The replay (:mod:`sharegpu_testing.replay`): every trace node a Node with its CPU and memory
allocatable, the seed's pod stream one pod at a time, GPU pods through filter → prioritize →
bind (kube-scheduler's own CPU/memory filter applied first), pods without GPUs bound by
"kube-scheduler" where the simulator put them, and pods that must change nothing on the nodes
from the start. ``tests/test_extender_replay.py`` runs the same on every 8th node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import devpath  # noqa: F401  (testing/ on sys.path)
from sharegpu.sim.trace import NODE_FILE, read_nodes, read_pods, workload_path
from sharegpu_testing.fakeapi import FakeApiServer
from sharegpu_testing.replay import replay, simulate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=Path("../shared/traces/openb"))
    p.add_argument("--workload", default="default")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--policy", default="default",
                   help="placement policy (default: the default, strandfill)")
    p.add_argument("--step", type=int, default=1, help="every STEP-th node of the trace")
    p.add_argument("--no-hidden", action="store_true",
                   help="skip the replay with CPU and memory hidden from the extender")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    nodes = read_nodes(a.trace / NODE_FILE)[:: a.step]
    pods = read_pods(workload_path(a.trace, a.workload))
    t0 = time.perf_counter()
    sim, where = simulate(nodes, pods, a.seed, a.policy, a.workload)
    out: dict[str, Any] = {
        "trace": a.workload, "seed": a.seed, "policy": a.policy, "nodes": len(nodes),
        "pods": len(where),
        "simulator": {"unallocated_pct": sim.unallocated_pct, "placed": sim.placed,
                      "seconds": round(time.perf_counter() - t0, 1)},
    }
    for hidden in (False, True) if not a.no_hidden else (False,):
        fake = FakeApiServer(kubelet_start_s=0.0).start()  # kubelets start bound pods at once
        try:
            got = asyncio.run(replay(fake, nodes, pods, a.seed, where, policy=a.policy,
                                     hide_host=hidden))
        finally:
            fake.stop()
        differ = sum(x != y for x, y in zip(got.placements, where, strict=True))
        out["extender, CPU/memory hidden" if hidden else "extender"] = {
            "unallocated_pct": got.unallocated_pct,
            "placed": sum(x is not None for x in got.placements),
            "placements_differing_from_simulator": differ,
            "pods_per_s": round(got.pods / got.seconds, 1), "seconds": round(got.seconds, 1),
        }
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    same = out["extender"]["placements_differing_from_simulator"] == 0 and (
        out["extender"]["unallocated_pct"] == sim.unallocated_pct)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
