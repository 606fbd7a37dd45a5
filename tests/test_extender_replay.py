"""The placement that wins in the simulator is the placement in the cluster: a slice of the
openb ``default`` trace, one seed, every pod with its CPU and memory, played through the
extender over HTTP against the fake API server (non-GPU pods on the nodes too) gives the
simulator's placements and unallocated %; with CPU and memory hidden from the extender (what
it saw before it tracked them) it does not. The full trace: ``bench/extender_replay.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sharegpu.sim.trace import NODE_FILE, read_nodes, read_pods, workload_path
from sharegpu.sim.workload import stream
from sharegpu_testing.replay import replay, simulate

SEED = 42
STEP = 8  # every 8th node of the trace: 152 nodes, 770 GPUs


def test_openb_replay_through_the_extender_matches_the_simulator(
        openb: Path, fake_api_factory: Any) -> None:
    nodes = read_nodes(openb / NODE_FILE)[::STEP]
    pods = read_pods(workload_path(openb, "default"))
    sim, where = simulate(nodes, pods, SEED)
    seq = stream(pods, sum(len(n.gpu_mem) for n in nodes), SEED)
    assert sum(tp.num_gpu == 0 and w is not None for tp, w in zip(seq, where, strict=True)) > 20

    got = asyncio.run(replay(fake_api_factory(kubelet_start_s=0.0), nodes, pods, SEED, where))
    assert got.placements == where
    assert got.unallocated_pct == sim.unallocated_pct

    hidden = asyncio.run(replay(fake_api_factory(kubelet_start_s=0.0), nodes, pods, SEED, where,
                               hide_host=True))
    gpu = [i for i, tp in enumerate(seq) if tp.num_gpu]
    differ = sum(hidden.placements[i] != where[i] for i in gpu)
    assert differ > len(gpu) // 10, differ
    assert hidden.unallocated_pct != sim.unallocated_pct
