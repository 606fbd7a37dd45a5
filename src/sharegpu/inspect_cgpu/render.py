"""Text and JSON for ``kubectl inspect cgpu``. Pure: a :class:`ClusterUsage` in, a string out.

The layout is that of ACK's tool (SPEC §7, seeds 000/002/003): left-aligned columns, each as wide
as its widest cell plus two spaces, in column blocks the way Go's ``text/tabwriter`` forms them
(consecutive lines that have a cell in a column share its width); trailing blanks are dropped.

Summary::

    NAME                       IPADDRESS      GPU0(Allocated/Total)  GPU Memory(GiB)
    cn-shanghai.192.168.6.104  192.168.6.104  0/15                   0/15
    ----------------------------------------------------------------------
    Allocated/Total GPU Memory In Cluster:
    0/15 (0%)

The dashed line is as long as the first node's row written with two spaces between cells, plus
18 (70 dashes above; seed 000's four-GPU sample has 86, seed 003's 75). Percentages are
truncated. ``PENDING(Allocated)`` appears when a pod on a shown node has no GPU index yet. When
a ``core_mem`` node is shown, ``GPU<i>(Core%)`` columns give each GPU's allocated/total compute
(``-`` on nodes that do not limit compute) and the cluster's compute follows the memory line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .model import ClusterUsage, NodeUsage

PAD = 2
MEM_UNIT = "GiB"
CLUSTER_LINE = "Allocated/Total GPU Memory In Cluster:"
CLUSTER_CORE_LINE = "Allocated/Total GPU Core In Cluster:"
PENDING = "PENDING(Allocated)"
PENDING_CORE = "PENDING(Core%)"

Line = Sequence[str]  # cells; every cell but the last is tab-terminated (padded to its column)


def tabwrite(lines: Sequence[Line]) -> list[str]:
    """Align cells the way Go's tabwriter does (minwidth 0, padding 2, pad with spaces).

    Each line is a list of cells; all but the last are terminated cells that take part in
    column alignment; the last is trailing text written as is. A column's width is computed over
    each maximal run of consecutive lines having a terminated cell in that column.
    """
    out: list[str] = []
    widths: list[int] = []

    def write(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            parts = []
            for j, cell in enumerate(lines[i]):
                parts.append(cell.ljust(widths[j]) if j < len(widths) else cell)
            out.append("".join(parts).rstrip())

    # Go's tabwriter formats column by column, recursing into each block of lines that has a
    # cell in the next column. The same, with an explicit stack: a node with thousands of GPUs
    # (thousands of columns) needs no thousands of Python frames.
    frames: list[list[int]] = [[0, len(lines), 0, 0]]  # lo, hi, this, returning from a block
    while frames:
        f = frames[-1]
        lo, hi, this, returning = f
        column = len(frames) - 1  # == len(widths)
        if returning:
            widths.pop()
            lo = this
        descended = False
        while this < hi:
            if column >= len(lines[this]) - 1:
                this += 1
                continue
            write(lo, this)
            lo = this
            width = 0
            while this < hi and column < len(lines[this]) - 1:
                width = max(width, len(lines[this][column]) + PAD)
                this += 1
            widths.append(width)
            f[0], f[1], f[2], f[3] = lo, hi, this, 1
            frames.append([lo, this, lo, 0])
            descended = True
            break
        if descended:
            continue
        write(lo, hi)
        frames.pop()
    return out


def percent(part: int, whole: int) -> int:
    """Truncated integer percent; 0 of nothing is 0 %."""
    return part * 100 // whole if whole > 0 else 0


def _gpu_cells(node: NodeUsage, count: int) -> list[str]:
    cells = []
    for i in range(count):
        if i < len(node.gpus):
            g = node.gpus[i]
            cells.append(f"{g.mem_allocated}/{g.mem_total}")
        else:
            cells.append("0/0")
    return cells


def _core_cells(node: NodeUsage, count: int) -> list[str]:
    cells = []
    for i in range(count):
        if node.shows_core and i < len(node.gpus):
            g = node.gpus[i]
            cells.append(f"{g.core_allocated}/{g.core_total}")
        else:
            cells.append("-")
    return cells


def _header(first: list[str], count: int, memory: str, pending: bool, core: bool) -> list[str]:
    """Leading columns, one memory column per GPU, then PENDING and compute when shown."""
    header = first + [f"GPU{i}({memory})" for i in range(count)]
    if pending:
        header.append(PENDING)
    if core:
        header += [f"GPU{i}(Core%)" for i in range(count)]
    return header


def summary(view: ClusterUsage) -> str:
    count = view.max_gpus
    pending = any(n.has_pending for n in view.nodes)
    core = view.shows_core
    header = _header(["NAME", "IPADDRESS"], count, "Allocated/Total", pending, core)
    header.append(f"GPU Memory({MEM_UNIT})")

    rows: list[list[str]] = []
    for n in view.nodes:
        row = [n.name, n.address, *_gpu_cells(n, count)]
        if pending:
            row.append(str(n.pending_mem) if n.has_pending else "")
        if core:
            row += _core_cells(n, count)
        row.append(f"{n.mem_allocated}/{n.mem_total}")
        rows.append(row)

    first = rows[0] if rows else header
    dashes = "-" * (len("  ".join(first)) + 18)
    lines = tabwrite([header, *rows])
    lines += [dashes, CLUSTER_LINE, _ratio(view.mem_allocated, view.mem_total)]
    if core:
        lines += [CLUSTER_CORE_LINE, _ratio(view.core_allocated, view.core_total)]
    return "\n".join(lines) + "\n"


def _ratio(part: int, whole: int) -> str:
    return f"{part}/{whole} ({percent(part, whole)}%)"


def details(view: ClusterUsage) -> str:
    """``-d``: per node a block (``NAME:``, ``IPADDRESS:``, the pods on each GPU, the node's
    allocated and total memory, a dashed line), then the cluster line."""
    out: list[str] = []
    for n in view.nodes:
        out += tabwrite([[""], ["NAME:", n.name], ["IPADDRESS:", n.address], [""]])
        count = len(n.gpus)
        pending = n.has_pending
        core = n.shows_core
        header = _header(["NAME", "NAMESPACE"], count, "Allocated", pending, core)
        # compute asked by pods with no GPU yet: counted in "Allocated Core", so shown too
        pending_core = core and any(p.pending_core for p in n.pods)
        if pending_core:
            header.append(PENDING_CORE)
        table: list[list[str]] = [[*header, ""]]
        for p in n.pods:
            row = [p.name, p.namespace] + [str(p.mem.get(i, 0)) for i in range(count)]
            if pending:
                row.append(str(p.pending_mem))
            if core:
                row += [str(p.core.get(i, 0)) for i in range(count)]
            if pending_core:
                row.append(str(p.pending_core))
            table.append([*row, ""])
        table.append(["Allocated :", _ratio_short(n.mem_allocated, n.mem_total), ""])
        table.append(["Total :", str(n.mem_total), ""])
        if core:
            table.append(["Allocated Core :", _ratio_short(n.core_allocated, n.core_total), ""])
            table.append(["Total Core :", str(n.core_total), ""])
        block = tabwrite(table)
        out += block
        out.append("-" * max(len(line) for line in block))
    cluster = [[""], [""], [CLUSTER_LINE, _ratio(view.mem_allocated, view.mem_total), ""]]
    if view.shows_core:
        cluster.append([CLUSTER_CORE_LINE, _ratio(view.core_allocated, view.core_total), ""])
    out += tabwrite(cluster)
    return "\n".join(out) + "\n"


def _ratio_short(part: int, whole: int) -> str:
    return f"{part} ({percent(part, whole)}%)"


def to_json(view: ClusterUsage) -> str:
    """Machine-readable view (``-o json``); stable keys, camelCase like Kubernetes objects."""
    doc = {
        "nodes": [
            {
                "name": n.name,
                "address": n.address,
                "mode": n.mode.value,
                "placement": n.placement or None,
                "dra": n.dra,
                "gpuMemAllocated": n.mem_allocated,
                "gpuMemTotal": n.mem_total,
                "pendingGpuMem": n.pending_mem,
                **(
                    {"gpuCoreAllocated": n.core_allocated, "gpuCoreTotal": n.core_total}
                    if n.shows_core else {}
                ),
                "gpus": [
                    {
                        "index": g.index,
                        "memAllocated": g.mem_allocated,
                        "memTotal": g.mem_total,
                        "pods": g.pods,
                        **(
                            {"coreAllocated": g.core_allocated, "coreTotal": g.core_total}
                            if n.shows_core else {}
                        ),
                    }
                    for g in n.gpus
                ],
                "pods": [
                    {
                        "namespace": p.namespace,
                        "name": p.name,
                        "pending": not p.mem,
                        "gpuMem": {str(k): v for k, v in p.mem.items()},
                        "gpuCore": {str(k): v for k, v in p.core.items()},
                        "pendingGpuMem": p.pending_mem,
                        "claims": list(p.claims),
                    }
                    for p in n.pods
                ],
            }
            for n in view.nodes
        ],
        "gpuMemAllocated": view.mem_allocated,
        "gpuMemTotal": view.mem_total,
        "gpuMemAllocatedPercent": percent(view.mem_allocated, view.mem_total),
        "warnings": list(view.warnings),
    }
    return json.dumps(doc, indent=2) + "\n"
