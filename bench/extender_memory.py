"""The extender's memory after a rebuild from annotations: the resident set of a process that
lists ``--pods`` annotated GPU pods on ``--nodes`` nodes (the compact pod objects of
extender_latency.py) and rebuilds a ClusterView from them once, as a replica does at start.

    python bench/extender_memory.py --nodes 5000 --pods 100000
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import extender_latency as bench


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--pods", type=int, default=100_000)
    a = p.parse_args(argv)
    from sharegpu.extender.view import ClusterView

    out = {"nodes": a.nodes, "pods": a.pods, "start_mib": rss_mib()}
    nodes = bench.cluster(a.nodes)
    pods = bench.annotated_pods(nodes, a.pods)
    out["listed_mib"] = rss_mib()  # the lists, as a relist holds them
    view = ClusterView("default")
    out["unapplied"] = view.reset(nodes, pods)
    out["rebuilt_mib"] = rss_mib()  # the lists and the view
    del pods
    out["view_only_mib"] = rss_mib()  # the view (and the nodes) once the list is dropped
    out["peak_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["held"] = len(view.state.pods)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
