"""``bench/dra_isolation_gpu.py`` (DRA claims on a real GPU) run whole against the fakes: the
agent and its DRA plugin on NVML's real ctypes path over the fake ``libnvidia-ml.so.1``, claims
prepared over gRPC by the test kubelet, their CDI edits applied to probe processes that load the
stand-in interposer over the fake CUDA driver. Every check of the script must hold, so the
script that measures on a GPU keeps working, and its checks are shown to fail when a limit
does not hold."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "dra_isolation_gpu.py"


@pytest.fixture(scope="module")
def fake_nvml_dir(tmp_path_factory) -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed to build the fake libnvidia-ml.so.1"
    d = tmp_path_factory.mktemp("fakenvml")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libnvidia-ml.so.1"),
                    str(ROOT / "tests" / "agent" / "fakenvml" / "fakenvml.c")], check=True)
    return str(d)


def run(tmp_path: Path, fake_cuda_dir: str, fake_nvml_dir: str, library: str,
        **env: str) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--hami-library", library, "--no-torch",
         "--json", str(out)],
        env={**os.environ, "LD_LIBRARY_PATH": f"{fake_nvml_dir}:{fake_cuda_dir}",
             "FAKENVML_GPUS": "NVIDIA H100 80GB HBM3:81559", **env},
        capture_output=True, text=True, timeout=240)
    assert out.exists(), r.stderr[-3000:]
    return r.returncode, json.loads(out.read_text())


def checks(doc: dict) -> dict[str, dict]:
    return {c["key"]: c for s in doc["scenarios"] for c in s["checks"]}


def probe(doc: dict, key: str) -> list[dict]:
    """A probe check (keys shared by the claims), claim A's then claim B's."""
    return [c for s in doc["scenarios"][:2] for c in s["checks"] if c["key"] == key]


def test_the_dra_gpu_bench_holds_every_check_on_the_fakes(tmp_path, fake_cuda_dir,
                                                           fake_nvml_dir, standin_vgpu):
    rc, doc = run(tmp_path, fake_cuda_dir, fake_nvml_dir, standin_vgpu)
    got = checks(doc)
    assert rc == 0, [c for c in got.values() if c["ok"] is False]
    assert [s["name"] for s in doc["scenarios"]] == ["claim-a", "claim-b", "both at once",
                                                    "unprepare"]
    assert doc["registered"] == ["gpu.sharegpu.io"]
    # each claim's own limits, from its own CDI spec
    assert got["claim-a.CUDA_DEVICE_MEMORY_LIMIT_0"]["measured"] == "4096m"
    assert got["claim-a.CUDA_DEVICE_SM_LIMIT"]["measured"] == "30"
    assert got["claim-b.CUDA_DEVICE_MEMORY_LIMIT_0"]["measured"] == "8192m"
    assert got["claim-b.CUDA_DEVICE_SM_LIMIT"]["measured"] is None
    # ... and what the processes saw under them
    for key in ("mem.seen", "mem.reachable"):
        found = probe(doc, key)
        assert [c["measured"] for c in found] == [4096.0, 8192.0], key
        assert all(c["ok"] for c in found), key
    assert [c["ok"] for c in probe(doc, "mem.past")] == [True, True]
    assert doc["specs"] and len(doc["specs"]) == 2  # one spec per claim, gone after unprepare


def test_the_checks_fail_when_the_interposer_lets_memory_past_the_limit(
        tmp_path, fake_cuda_dir, fake_nvml_dir, standin_vgpu):
    """The stand-in letting allocations go 2 GiB past each limit: the script must say so."""
    rc, doc = run(tmp_path, fake_cuda_dir, fake_nvml_dir, standin_vgpu,
                  STANDIN_VGPU_SLACK_MIB="2048")
    assert rc == 1
    reach = probe(doc, "mem.reachable")
    assert [c["ok"] for c in reach] == [False, False]
    assert [c["measured"] for c in reach] == [4096.0 + 2048, 8192.0 + 2048]
    both = next(s for s in doc["scenarios"] if s["name"] == "both at once")
    assert not both["ok"]
