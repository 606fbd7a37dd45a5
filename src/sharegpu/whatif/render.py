"""The analysis for a person (rich tables) and as per-GPU bars (``--plot``, matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .analysis import Analysis

NODES_SHOWN = 25  # nodes listed in the terminal (the most stranded first); --json has all
PENDING_SHOWN = 15


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _ms(d: dict[str, float], digits: int = 0) -> str:
    mean, sd = d["mean"], d["sd"]
    text = f"{mean:,.{digits}f}"
    return text + (f" ± {sd:,.{digits}f}" if sd else "")


def show(a: Analysis, console: Console) -> None:
    doc = a.to_json()
    t = doc["today"]["totals"]
    nodes = doc["today"]["nodes"]
    console.print(f"[bold]Today[/bold]: {len(nodes)} GPU nodes, {t['gpus']} GPUs, "
                  f"{len(a.cluster.bound)} bound GPU pods, {len(a.cluster.pending)} pending "
                  "(memory in GiB, compute in % of a GPU; stranded: free, but no pod of the "
                  "shapes this cluster asks for fits there)")
    table = Table(show_edge=False)
    for col in ("node", "mode", "model", "GPUs", "mem alloc/total", "free", "stranded",
                "core alloc", "core stranded", "free GPUs"):
        table.add_column(col, justify="left" if col in ("node", "mode", "model") else "right")
    shown = sorted(nodes, key=lambda n: (-n["mem_stranded"], n["node"]))[:NODES_SHOWN]
    for n in shown:
        table.add_row(n["node"], n["mode"], n["model"] or "-", str(n["gpus"]),
                      f"{n['mem_allocated']}/{n['mem_total']}", str(n["mem_free"]),
                      str(n["mem_stranded"]), str(n["core_allocated"]),
                      str(n["core_stranded"]), str(n["gpus_free"]))
    table.add_section()
    used = _pct(t["mem_allocated"], t["mem_total"])
    table.add_row("cluster", "", "", str(t["gpus"]),
                  f"{t['mem_allocated']}/{t['mem_total']} ({used})",
                  str(t["mem_free"]),
                  f"{t['mem_stranded']} ({_pct(t['mem_stranded'], t['mem_total'])})",
                  str(t["core_allocated"]), str(t["core_stranded"]), str(t["gpus_free"]))
    console.print(table)
    if len(nodes) > NODES_SHOWN:
        console.print(f"({NODES_SHOWN} of {len(nodes)} nodes shown, the most stranded first; "
                      "--json lists every node and GPU)")
    pending = doc["today"]["pending"]
    if pending:
        console.print(f"\n[bold]Pending GPU pods[/bold] ({len(pending)}):")
        for p in pending[:PENDING_SHOWN]:
            if p["fits_now_on_nodes"]:
                why = f"fits now on {p['fits_now_on_nodes']} node(s): waiting for something else"
            else:
                why = "; ".join(f"{r['nodes']} node(s): {r['reason']}" for r in p["reasons"][:3])
            console.print(f"  {p['pod']}: {why}")
        if len(pending) > PENDING_SHOWN:
            console.print(f"  ... and {len(pending) - PENDING_SHOWN} more (--json)")
    rp = doc["replay"]
    console.print(f"\n[bold]Replay[/bold]: the {rp['bound_gpu_pods']} bound and "
                  f"{rp['pending_gpu_pods']} pending GPU pods placed again under each policy, "
                  f"in {rp['order']}")
    table = Table(show_edge=False)
    cols = ["policy", "mem allocated", "stranded", "free GPUs", "placed", "not placed",
            "pending that fit", "GPUs held otherwise"]
    if a.shape is not None:
        cols.append("headroom")
    cols.append("CPU s")
    for col in cols:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for p in rp["policies"]:
        name = p["policy"] + (" (now)" if p["current"] else "")
        row = [name, _ms(p["mem_allocated"]), _ms(p["mem_stranded"]), _ms(p["gpus_free"]),
               _ms(p["placed"]), _ms(p["unplaced"]), _ms(p["pending_that_fit"]),
               _ms(p["gpus_held_otherwise_than_today"])]
        if a.shape is not None:
            row.append(_ms(doc["headroom"]["after_replay"][p["policy"]]))
        row.append(f"{p['cpu_seconds']:.2f}")
        table.add_row(*row, style="bold" if p["current"] else None)
    console.print(table)
    if rp["current_policy"]:
        console.print(f"(now): the policy this cluster runs, {rp['current_policy']}, from "
                      f"{rp['current_policy_from']}")
    else:
        console.print("The policy this cluster runs is not known: the dump holds no running "
                      "sharegpu extender Pod; name it with --current-policy")
    if a.shape is not None:
        h = doc["headroom"]
        console.print(f"\n[bold]Headroom[/bold] for {h['shape']}: {h['now']} more fit now")
    if "repack" in doc:
        r = doc["repack"]
        how = "exact" if r["exact"] else f"greedy, at least {r['lower_bound']} evictions needed"
        goal = (f"for {r['fit']}" if "fit" in r else
                f"to free {r['free_gpus']} GPU(s)")
        got = "" if "fit" in r else f", {r['freed']} GPU(s) freed"
        console.print(f"\n[bold]Re-pack plan[/bold] {goal} under {r['policy']}: "
                      f"{r['evictions']} eviction(s){got} ({how}; {r['note']}). sharegpu runs "
                      "none of these:")
        for e, cmd in zip(r["evict"], r["commands"], strict=True):
            console.print(f"  # {e['pod']} on {e['node']} ({e['owner']}) -> "
                          f"{e['placed_again_on']}", markup=False)
            console.print(f"  {cmd}", markup=False, soft_wrap=True)
        for why, n in r["gpus_not_targeted"].items():
            console.print(f"  ({n} GPU(s) not targeted: {why})", markup=False)
    for w in doc["warnings"][:10]:
        console.print(f"[yellow]warning[/yellow]: {w}")
    if len(doc["warnings"]) > 10:
        console.print(f"[yellow]... {len(doc['warnings']) - 10} more warnings (--json)[/yellow]")


def plot(a: Analysis, path: Path) -> None:
    """Per-GPU bars of allocated / stranded / free memory: today, then one panel per policy
    (its first ordering)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, dict[str, Any]]] = [
        ("today", {n["node"]: n["per_gpu"] for n in a.today.per_node})]
    panels += [(r.policy + (" (now)" if r.current else ""), r.runs[0].per_gpu)
               for r in a.replays if r.runs and r.runs[0].per_gpu]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 2.2 * len(panels)), squeeze=False)
    for ax, (title, per_node) in zip(axes[:, 0], panels, strict=True):
        rows = [g for node in sorted(per_node) for g in per_node[node]]
        xs = range(len(rows))
        alloc = [r[0] for r in rows]
        strand = [r[1] for r in rows]
        free = [r[2] for r in rows]
        ax.bar(xs, alloc, width=1.0, color="#4c72b0", label="allocated")
        ax.bar(xs, strand, width=1.0, bottom=alloc, color="#dd8452", label="stranded")
        ax.bar(xs, free, width=1.0, bottom=[x + y for x, y in zip(alloc, strand, strict=True)],
               color="#cccccc", label="free")
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlim(-0.5, len(rows) - 0.5)
        ax.set_ylabel("GiB")
        ax.set_xticks([])
    axes[0, 0].legend(loc="upper right", fontsize=8, ncols=3)
    axes[-1, 0].set_xlabel("GPUs, node by node")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
