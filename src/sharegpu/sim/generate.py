"""A generated cluster and workload, so the simulator runs anywhere without the openb data.

Shaped like a mixed GPU-sharing cluster (the proportions follow the public openb trace's broad
mix, not its rows): 300 nodes of four kinds, and pods that are 13 % CPU-only, 50 % sharing
(a fraction of one GPU), 30 % one whole GPU and 7 % multi-GPU (2, 4 or 8 whole GPUs), with a
small share pinned to a card model. Everything comes from one seeded generator, so the same
seed always gives the same files.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ..core.modes import Mode
from ..core.state import NodeSpec
from .trace import GPU_UNITS, NODE_FILE, TracePod

DEFAULT_SEED = 2023
DEFAULT_NODES = 300
DEFAULT_PODS = 2000
WORKLOAD_NAME = "generated"

# (model, GPUs, CPU milli, memory MiB, share of nodes)
NODE_KINDS = (
    ("A100", 8, 96_000, 393_216, 0.40),
    ("T4", 2, 64_000, 262_144, 0.35),
    ("V100", 4, 48_000, 196_608, 0.15),
    ("A10", 1, 32_000, 131_072, 0.10),
)
SHARE_SIZES = (100, 200, 250, 300, 400, 500, 600, 700, 800)


def nodes_rows(seed: int = DEFAULT_SEED, count: int = DEFAULT_NODES) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    shares = np.array([k[4] for k in NODE_KINDS])
    kinds = rng.choice(len(NODE_KINDS), size=count, p=shares / shares.sum())
    rows = []
    for i, k in enumerate(kinds):
        model, gpus, cpu, mem, _ = NODE_KINDS[int(k)]
        rows.append({"sn": f"gen-node-{i:04d}", "cpu_milli": cpu, "memory_mib": mem,
                     "gpu": gpus, "model": model})
    return rows


def nodes(seed: int = DEFAULT_SEED, count: int = DEFAULT_NODES) -> list[NodeSpec]:
    return [
        NodeSpec(str(r["sn"]), [GPU_UNITS] * int(r["gpu"]), Mode.CGPU,  # type: ignore[call-overload]
                 model=str(r["model"]), cpu_milli=int(r["cpu_milli"]),  # type: ignore[call-overload]
                 mem_mib=int(r["memory_mib"]))  # type: ignore[call-overload]
        for r in nodes_rows(seed, count)
    ]


def pods(seed: int = DEFAULT_SEED, count: int = DEFAULT_PODS) -> list[TracePod]:
    rng = np.random.default_rng(seed + 1)
    out = []
    for i in range(count):
        r = rng.random()
        cpu = int(rng.choice([2_000, 4_000, 8_000, 12_000, 16_000]))
        mem = cpu * 4
        spec = ""
        if r < 0.13:
            num, milli = 0, 0
        elif r < 0.63:
            num, milli = 1, int(rng.choice(SHARE_SIZES))
        elif r < 0.93:
            num, milli = 1, 1000
        else:
            num, milli = int(rng.choice([2, 4, 8], p=[0.5, 0.3, 0.2])), 1000
            cpu, mem = cpu * num, mem * num
        if num and rng.random() < 0.1:
            spec = str(rng.choice(["A100", "V100|A100", "T4"]))
        out.append(TracePod(f"gen-pod-{i:05d}", cpu, mem, num, milli, spec))
    return out


def write(directory: Path, seed: int = DEFAULT_SEED) -> tuple[Path, Path]:
    """Write the generated cluster and workload as openb-format CSVs."""
    directory.mkdir(parents=True, exist_ok=True)
    node_path = directory / NODE_FILE
    with node_path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["sn", "cpu_milli", "memory_mib", "gpu", "model"])
        w.writeheader()
        w.writerows(nodes_rows(seed))
    pod_path = directory / f"openb_pod_list_{WORKLOAD_NAME}.csv"
    with pod_path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec"])
        for p in pods(seed):
            w.writerow([p.name, p.cpu_milli, p.mem_mib, p.num_gpu, p.gpu_milli, p.gpu_spec])
    return node_path, pod_path
