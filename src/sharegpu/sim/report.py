"""Presenting simulator results: a terminal table, JSON, and a PNG like the paper's Figure 9(a)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .runner import Summary

# Published unallocated GPU % at arrived = 100 % (FGD paper, mean of seeds 42..51)
PUBLISHED: dict[str, dict[str, float]] = {
    "default": {"random": 13.70, "dotprod": 9.38, "clustering": 8.35, "packing": 8.22,
                "bestfit": 7.14, "fgd": 4.77},
    "cpu050": {"random": 10.98, "dotprod": 6.97, "clustering": 6.48, "packing": 6.54,
               "bestfit": 6.44, "fgd": 5.00},
    "cpu100": {"random": 12.57, "dotprod": 8.27, "clustering": 7.58, "packing": 7.50,
               "bestfit": 6.74, "fgd": 4.79},
    "cpu200": {"random": 16.97, "dotprod": 12.55, "clustering": 10.33, "packing": 10.02,
               "bestfit": 7.85, "fgd": 5.18},
    "gpushare40": {"random": 15.14, "dotprod": 10.70, "clustering": 10.24, "packing": 10.23,
                   "bestfit": 8.56, "fgd": 6.04},
    "gpushare60": {"random": 17.19, "dotprod": 13.18, "clustering": 13.10, "packing": 12.85,
                   "bestfit": 10.94, "fgd": 8.75},
    "gpushare80": {"random": 19.38, "dotprod": 15.86, "clustering": 15.50, "packing": 15.35,
                   "bestfit": 13.34, "fgd": 10.92},
    "gpuspec10": {"random": 13.74, "dotprod": 9.83, "clustering": 8.04, "packing": 7.76,
                  "bestfit": 6.90, "fgd": 5.34},
    "gpuspec20": {"random": 14.10, "dotprod": 11.71, "clustering": 10.89, "packing": 10.72,
                  "bestfit": 11.54, "fgd": 5.34},
    "gpuspec25": {"random": 14.58, "dotprod": 14.56, "clustering": 13.59, "packing": 13.23,
                  "bestfit": 14.33, "fgd": 6.09},
    "multigpu20": {"random": 13.08, "dotprod": 8.15, "clustering": 6.66, "packing": 6.50,
                   "bestfit": 6.27, "fgd": 4.47},
    "multigpu30": {"random": 13.37, "dotprod": 6.89, "clustering": 5.45, "packing": 5.30,
                   "bestfit": 5.43, "fgd": 3.64},
    "multigpu40": {"random": 14.62, "dotprod": 5.96, "clustering": 4.65, "packing": 4.41,
                   "bestfit": 4.90, "fgd": 3.09},
}


def published(workload: str, policy: str) -> float | None:
    return PUBLISHED.get(workload, {}).get(policy)


def table(summaries: Sequence[Summary], console: Console) -> None:
    t = Table(title="Unallocated GPU % at 100 % arrived (lower is better)")
    for col in ("workload", "policy", "seeds", "unallocated %", "published", "frag %", "pods/s"):
        t.add_column(col, justify="right" if col not in ("workload", "policy") else "left")
    for s in summaries:
        mean, sd = s.unallocated
        pub = published(s.workload, s.policy)
        t.add_row(
            s.workload, s.policy, str(len(s.seeds)),
            f"{mean:.2f} ± {sd:.2f}" if len(s.seeds) > 1 else f"{mean:.2f} ± —",
            f"{pub:.2f}" if pub is not None else "—", f"{s.frag:.2f}", f"{s.pods_per_s:,.0f}",
        )
    console.print(t)


def to_json(summaries: Sequence[Summary]) -> str:
    return json.dumps({"results": [s.to_json() for s in summaries]}, indent=2)


def plot(summaries: Sequence[Summary], path: Path) -> None:
    """Allocation % against arrived % per policy (one panel per workload), ideal line dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(s.workload for s in summaries))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        ax.plot([0, 100, 130], [0, 100, 100], "k--", lw=0.8, label="ideal")
        for s in (x for x in summaries if x.workload == w):
            pts = [(x, y) for x, y in enumerate(s.curve) if y is not None]
            mean, _ = s.unallocated
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.5,
                    label=f"{s.policy} ({mean:.2f} % unalloc.)")
        ax.axvline(100, color="grey", lw=0.6)
        ax.set_xlim(0, 130)
        ax.set_ylim(0, 102)
        ax.set_xlabel("arrived GPU demand (% of capacity)")
        ax.set_ylabel("GPU allocation ratio (%)")
        ax.set_title(f"workload {w}")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        inset = ax.inset_axes([0.08, 0.55, 0.4, 0.38])
        for s in (x for x in summaries if x.workload == w):
            pts = [(x, y) for x, y in enumerate(s.curve) if y is not None and 80 <= x <= 130]
            inset.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        inset.set_title("80–130 %", fontsize=7)
        inset.tick_params(labelsize=6)
        inset.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
