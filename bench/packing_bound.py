"""How GPU shares alone pack at 100 % arrival, if every sharing pod is placed (not a bound).

    python bench/packing_bound.py --trace ../shared/traces/openb

At 100 % arrival the arrived demand equals the capacity, so the unallocated GPU is exactly the
free GPU left. Pods asking for a share of one GPU must be packed into whole GPUs; every GPU they
open and leave partly empty is lost to whole-GPU pods. For each seed's pod stream (SPEC §9, up
to 100 % arrival) this packs the sharing pods' shares into GPUs of 1000 and reports, as % of the
cluster's GPUs:

* ``L2``: Martello and Toth's lower bound on the number of GPUs the shares need, minus their
  total: the least free GPU *when every share is placed*. It is not a lower bound of the
  unallocated-GPU metric: a schedule may leave some shares out and fill their GPUs with
  whole-GPU pods, and such packings go below it (bench/README.md gives the certified floors);
* ``BFD``: best-fit decreasing, offline (all shares known and sorted in advance), a heuristic
  packing, not a bound.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
from pathlib import Path

from sharegpu.cli import parse_seeds
from sharegpu.sim.trace import GPU_UNITS, NODE_FILE, read_nodes, read_pods, workload_path
from sharegpu.sim.workload import stream

HERE = Path(__file__).resolve().parent


def l2_bins(items: list[int], size: int = GPU_UNITS) -> int:
    """Martello–Toth L2 lower bound on the number of bins of ``size`` the items need."""
    best = 0
    for k in sorted({0, *(x for x in items if x <= size // 2)}):
        j1 = [x for x in items if x > size - k]
        j2 = [x for x in items if size // 2 < x <= size - k]
        j3 = [x for x in items if k <= x <= size // 2]
        extra = sum(j3) - (len(j2) * size - sum(j2))
        best = max(best, len(j1) + len(j2) + max(0, -(-extra // size)))
    return best


def bfd_bins(items: list[int], size: int = GPU_UNITS) -> int:
    """Bins used by best-fit decreasing."""
    gaps: list[int] = []
    for it in sorted(items, reverse=True):
        i = bisect.bisect_left(gaps, it)
        if i < len(gaps):
            left = gaps.pop(i) - it
            bisect.insort(gaps, left)
        else:
            bisect.insort(gaps, size - it)
    return len(gaps)


def shares_at_full(trace: Path, workload: str, seed: int, capacity: int) -> list[int]:
    arrived, out = 0, []
    for tp in stream(read_pods(workload_path(trace, workload)), capacity, seed):
        if arrived + tp.gpu_demand > capacity * GPU_UNITS:
            break
        arrived += tp.gpu_demand
        if tp.num_gpu == 1 and 0 < tp.gpu_milli < GPU_UNITS:
            out.append(tp.gpu_milli)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=HERE.parent.parent / "shared/traces/openb")
    ap.add_argument("--workload", action="append")
    ap.add_argument("--seeds", default="42..51")
    args = ap.parse_args(argv)
    capacity = sum(len(n.gpu_mem) for n in read_nodes(args.trace / NODE_FILE))
    names = args.workload or sorted(
        p.name.removeprefix("openb_pod_list_").removesuffix(".csv")
        for p in args.trace.glob("openb_pod_list_*.csv")
    )
    print("| trace | L2, all shares placed % | offline BFD % |\n|---|---|---|")
    for w in names:
        lo, bf = [], []
        for seed in parse_seeds(args.seeds):
            items = shares_at_full(args.trace, w, seed, capacity)
            total = sum(items)
            lo.append((l2_bins(items) * GPU_UNITS - total) / (capacity * GPU_UNITS) * 100)
            bf.append((bfd_bins(items) * GPU_UNITS - total) / (capacity * GPU_UNITS) * 100)
        print(f"| {w} | {statistics.fmean(lo):.2f} | {statistics.fmean(bf):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
