"""The extender's filter handler alone: milliseconds per pod, no HTTP, one process.

    python bench/filter_cost.py --nodes 1000 --names 420 [--profile]

``--nodes`` mixed-mode nodes as bench/extender_latency.py makes them (their agents naming pods),
pods of 1, 2, 4 or 8 GiB, each filtered with ``--names`` candidate names of the shared modes (as
kube-scheduler sends them: 420 is its adaptive share at 1,000 nodes) through
``ExtenderApp.filter``: decode, the feasibility check, the policy's pick and its hold. Pods are
not bound, so each filter sees the cluster with the picks before it held. ``--profile``: where
the time goes (cProfile, cumulative).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "testing"))

import extender_latency as el
from sharegpu.core import names as n


async def measure(n_nodes: int, n_names: int, n_pods: int, profile: bool) -> dict[str, float]:
    from sharegpu.extender.bind import Binder
    from sharegpu.extender.httpserver import Request
    from sharegpu.extender.metrics import Metrics
    from sharegpu.extender.server import ExtenderApp
    from sharegpu.extender.view import ClusterView
    from sharegpu_testing import kobjects
    from sharegpu_testing.memapi import MemoryApi

    view = ClusterView("default")
    nodes = el.cluster(n_nodes, naming=True)
    view.reset(nodes, [])
    work = [kobjects.pod(f"p-{i:05d}", mem=[1, 2, 4, 8][i % 4], uid=f"u{i}")
            for i in range(2 * n_pods)]
    app = ExtenderApp(view, Binder(MemoryApi(work), lambda: view), Metrics(lambda: view))
    shared = {"cgpu", "share", "core_mem"}
    cand = [x["metadata"]["name"] for x in nodes
            if x["metadata"]["labels"].get(n.LABEL_SCHEDULE) in shared][:n_names]
    bodies = [json.dumps({"Pod": p, "NodeNames": cand}).encode() for p in work]
    for b in bodies[:n_pods // 5]:  # warm-up
        app.filter(Request("POST", "/filter", body=b))
    timed = bodies[n_pods // 5:n_pods // 5 + n_pods]
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    for b in timed:
        app.filter(Request("POST", "/filter", body=b))
    if prof is not None:
        prof.disable()
    ms = (time.perf_counter() - t0) * 1000 / len(timed)
    if prof is not None:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    return {"nodes": n_nodes, "names": len(cand), "pods": len(timed),
            "filter_ms_per_pod": round(ms, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--names", type=int, default=420, help="candidate names per filter")
    p.add_argument("--pods", type=int, default=1000, help="filters timed")
    p.add_argument("--profile", action="store_true", help="cProfile the timed filters")
    a = p.parse_args(argv)
    print(json.dumps(asyncio.run(measure(a.nodes, a.names, a.pods, a.profile)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
