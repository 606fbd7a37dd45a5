"""``sharegpu simulate --trace`` on broken or unusual trace folders: one line naming the file,
the line, the column and the rule (exit 2) — never a traceback, a silently merged node, or a
NaN that is not JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

NODES = "sn,cpu_milli,memory_mib,gpu,model\n"
PODS = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"


def trace(tmp_path: Path, nodes: str, pods: str, name: str = "t") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "openb_node_list_gpu_node.csv").write_bytes(nodes.encode("utf-8", "surrogateescape"))
    (d / "openb_pod_list_default.csv").write_bytes(pods.encode("utf-8", "surrogateescape"))
    return d


def simulate(d: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sharegpu.cli", "simulate", "--trace", str(d), "--workload",
         "default", "--policy", "bestfit", "--seeds", "42", *extra],
        capture_output=True, text=True, timeout=120)


def refused(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def small_nodes(n: int = 4) -> str:
    return NODES + "".join(f"node-{i},64000,262144,2,V100\n" for i in range(n))


def pods(n: int, gpus: int = 1, milli: int = 500) -> str:
    return PODS + "".join(f"pod-{i},1000,1024,{gpus},{milli}\n" for i in range(n))


@pytest.mark.parametrize(("case", "nodes", "expect"), [
    ("not UTF-8", NODES + "node-\udcff,64000,262144,2,V100\n", "must be UTF-8 text"),
    ("a field over the csv limit", NODES + "n," + "9" * 140000 + ",1,2,V100\n",
     "is not a readable CSV file"),
    ("a value of 2^63", NODES + f"n,{2**63},1,2,V100\n", "must be at most 1000000000"),
    ("100,000 GPUs", NODES + "n,64000,262144,100000,V100\n", "gpu='100000': must be at most 64"),
    ("duplicate names", NODES + "n,64000,262144,8,V100\nn,64000,262144,8,V100\n"
     "n,64000,262144,4,V100\n", "names a node already listed on line 2"),
])
def test_broken_node_lists_are_refused(tmp_path, case, nodes, expect):
    line = refused(simulate(trace(tmp_path, nodes, pods(10))))
    assert expect in line, line


def test_a_pod_larger_than_the_window_gives_a_number_not_nan(tmp_path):
    """4 nodes × 2 GPUs; 1-GPU pods of 1 GPU each are 12.5 % of the cluster: arrival jumps over
    the ±1 % window around 100 %. The figure is interpolated at the crossing, and --json is
    JSON (no bare NaN)."""
    r = simulate(trace(tmp_path, small_nodes(), pods(40, milli=1000)), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    value = out["results"][0]["unallocated_pct"]["mean"]
    assert isinstance(value, float) and 0.0 <= value <= 100.0
    assert "NaN" not in r.stdout
