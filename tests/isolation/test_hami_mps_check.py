"""The hami-mps back-end measured on the fakes: ``sharegpu isolation-check --backend hami-mps``
and ``bench/isolation_gpu.py --only hami-mps`` (the run a GPU task makes) over the fake CUDA
driver acting as an MPS client (fakecuda.c), the stand-in HAMi-core interposer (standin_vgpu.c)
and the stand-in MPS control daemon. The checks hold where both limits are applied, and fail
where the MPS share is not (a driver outside MPS) or the interposer lets memory past the limit;
a crashing pod's fault reaches its MPS neighbour and not a neighbour outside MPS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_isolation_check import MPS_STANDIN, check, mps_standin, rows
from .test_isolation_check import node as node  # the fixture

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "isolation_gpu.py"


@pytest.fixture
def pipe(tmp_path) -> Path:
    p = tmp_path / "mps-pipe"
    p.mkdir()
    return p


def hami_mps(node: dict, library: str, pipe: Path, *args: str) -> subprocess.CompletedProcess:
    return check(node, "--backend", "hami-mps", "--hami-library", library,
                 "--mps-pipe-dir", str(pipe), "--mps-control", MPS_STANDIN, *args)


def test_both_limits_hold_for_the_whole_container(node, standin_vgpu, pipe):
    node["FAKECUDA_MPS"] = "1"
    with mps_standin(node, pipe):
        r = hami_mps(node, standin_vgpu, pipe, "--mem", "2", "--core", "30", "--seconds", "1",
                     "--json")
    out = json.loads(r.stdout)
    env = out["env"]
    # HAMi-core's library (host path) and container-wide limit, its own throttle off
    assert env["LD_PRELOAD"] == standin_vgpu and env["CUDA_REDIRECT"] == standin_vgpu
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"
    assert env["GPU_CORE_UTILIZATION_POLICY"] == "disable" and "CUDA_DEVICE_SM_LIMIT" not in env
    # MPS: the host's pipe directory, the share of the SMs, each process's own limit
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    c = rows(r)
    # unlike mps alone, two processes of one container share the limit
    for key in ("mem.seen", "mem.reachable", "mem.past", "mem.survives", "shared.free",
                "shared.sum", "compute.share"):
        assert c[key]["ok"] is True, c[key]
    assert 25 <= c["compute.share"]["measured"] <= 35
    assert r.returncode == 0 and out["ok"] is True


def test_the_compute_row_fails_when_mps_does_not_apply_the_share(node, standin_vgpu, pipe):
    """A driver that is no MPS client (FAKECUDA_MPS unset) ignores the thread percentage, and
    HAMi-core's own throttle is off: the 30 % pod gets half, and the check says so."""
    with mps_standin(node, pipe):
        r = hami_mps(node, standin_vgpu, pipe, "--mem", "2", "--core", "30", "--seconds", "1",
                     "--json")
    c = rows(r)
    assert c["compute.share"]["ok"] is False and c["compute.share"]["measured"] > 40
    assert c["mem.reachable"]["ok"] is True and r.returncode == 1


def test_an_interposer_that_lets_memory_past_the_limit(node, standin_vgpu, pipe):
    """HAMi-core's stand-in letting each process 512 MiB past the limit: MPS's per-process limit
    still stops one process at the limit, but two processes of the pod together get past it,
    and the two-process row says so."""
    node.update(FAKECUDA_MPS="1", STANDIN_VGPU_SLACK_MIB="512")
    with mps_standin(node, pipe):
        r = hami_mps(node, standin_vgpu, pipe, "--mem", "2", "--json")
    c = rows(r)
    assert c["mem.reachable"]["ok"] is True and c["mem.reachable"]["measured"] == 2048.0
    assert c["shared.sum"]["ok"] is False and c["shared.sum"]["measured"] == 2048.0 + 512
    assert r.returncode == 1


def test_refused_without_either_part(node, standin_vgpu, pipe, tmp_path):
    node["FAKECUDA_MPS"] = "1"
    r = hami_mps(node, standin_vgpu, pipe, "--mem", "2")
    assert r.returncode == 2
    assert f"--mps-pipe-dir='{pipe}': the MPS control daemon does not answer" in r.stderr
    assert "start the MPS control daemon" in r.stderr
    missing = str(tmp_path / "none" / "libvgpu.so")
    with mps_standin(node, pipe):
        r = hami_mps(node, missing, pipe, "--mem", "2")
    assert r.returncode == 2
    assert f"the HAMi-core library {missing} does not exist; fix: install HAMi-core" in r.stderr
    r = check(node, "--backend", "hami+mps", "--mem", "2")
    assert r.returncode == 2 and "--backend='hami+mps': must be hami, mps or hami-mps" in r.stderr


def test_a_crashing_pods_fault_reaches_its_mps_neighbour_only(node, standin_vgpu, pipe):
    node["FAKECUDA_MPS"] = "1"
    with mps_standin(node, pipe):
        r = hami_mps(node, standin_vgpu, pipe, "--mem", "2", "--core", "30", "--seconds", "1.5",
                     "--crash", "--json")
    c = rows(r)
    assert c["crash.kill.cause"]["measured"] == "SIGKILL mid-kernel" and c["crash.kill.cause"]["ok"]
    assert c["crash.kill.neighbour"]["ok"] is True
    assert c["crash.fault.cause"]["measured"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    # MPS: the fault reaches the neighbour; measured, no target
    n = c["crash.fault.neighbour"]
    assert n["ok"] is None and n["measured"].startswith("failed: ")
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in n["measured"] and "every client" in n["note"]
    assert c["crash.fault.after"]["ok"] is True and c["crash.kill.after"]["ok"] is True
    # hami alone: no MPS, the neighbour computes on after the fault, and must
    r = check(node, "--backend", "hami", "--hami-library", standin_vgpu, "--mem", "2",
              "--core", "30", "--seconds", "1.5", "--crash", "--json")
    c = rows(r)
    assert c["crash.fault.neighbour"]["ok"] is True
    assert c["crash.fault.neighbour"]["measured"].endswith(" kernels")


def bench(tmp_path: Path, node: dict, library: str, *scenarios: str) -> tuple[int, dict, str]:
    """bench/isolation_gpu.py --only hami-mps, with the stand-in daemon on the PATH."""
    out, md = tmp_path / "out.json", tmp_path / "out.md"
    path = os.path.dirname(MPS_STANDIN) + os.pathsep + node.get("PATH", "")
    args = [a for s in scenarios for a in ("--scenario", s)]
    r = subprocess.run(
        [sys.executable, str(BENCH), "--only", "hami-mps", "--hami-library", library,
         "--seconds", "1", "--json", str(out), "--markdown", str(md), *args],
        env={**node, "PATH": path}, capture_output=True, text=True, timeout=300)
    assert out.exists(), r.stderr[-3000:]
    return r.returncode, json.loads(out.read_text()), md.read_text() if md.exists() else ""


def test_the_gpu_bench_runs_hami_mps_on_the_fakes(tmp_path, node, standin_vgpu):
    node["FAKECUDA_MPS"] = "1"
    rc, doc, md = bench(tmp_path, node, standin_vgpu, "2 GiB", "2 GiB + 30 %", "2 GiB + 10 %",
                        "2 GiB + 30 %, a pod crashes")
    assert "mps_absent" not in doc["meta"]
    got = {s["name"]: {c["key"]: c for c in s["checks"]} for s in doc["scenarios"]}
    assert list(got) == ["2 GiB", "2 GiB + 30 %", "2 GiB + 10 %", "2 GiB + 30 %, a pod crashes"]
    assert {s["backend"] for s in doc["scenarios"]} == {"hami-mps"}
    assert not [s["error"] for s in doc["scenarios"] if s["error"]]
    for name, want in (("2 GiB + 30 %", 30), ("2 GiB + 10 %", 10)):
        share = got[name]["compute.share"]
        assert share["ok"] is True and abs(share["measured"] - want) <= 5, share
    for checks in got.values():  # memory: two processes of one pod hold the limit together
        assert checks["shared.sum"]["ok"] is True and checks["shared.free"]["ok"] is True
    launch = got["2 GiB"]["compare.launch"]  # launch overhead: a ratio, no target
    assert launch["ok"] is None and launch["measured"] > 0
    crash = got["2 GiB + 30 %, a pod crashes"]
    assert crash["crash.kill.neighbour"]["ok"] is True
    assert crash["crash.fault.neighbour"]["ok"] is None
    assert rc == 0
    assert "**hami-mps**" in md and "| 2 GiB + 10 % | compute share | 10 % |" in md


def test_the_gpu_bench_fails_when_a_split_does_not_hold(tmp_path, node, standin_vgpu):
    """The fake driver outside MPS ignores the thread percentage: the 10/90 split fails, and
    the bench's exit code says so."""
    rc, doc, _ = bench(tmp_path, node, standin_vgpu, "2 GiB + 10 %")
    (s,) = doc["scenarios"]
    share = next(c for c in s["checks"] if c["key"] == "compute.share")
    assert share["ok"] is False and share["measured"] > 15
    assert rc == 1


def test_the_dra_gpu_bench_runs_hami_mps_on_the_fakes(tmp_path, fake_cuda_dir, standin_vgpu):
    """bench/dra_isolation_gpu.py --backend hami-mps: claims on a core_mem node prepared by the
    agent's DRA plugin, their CDI edits carrying both limits, applied to probe processes."""
    nvml = tmp_path / "fakenvml"
    nvml.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(nvml / "libnvidia-ml.so.1"),
                    str(ROOT / "tests" / "agent" / "fakenvml" / "fakenvml.c")], check=True)
    out = tmp_path / "out.json"
    path = os.path.dirname(MPS_STANDIN) + os.pathsep + os.environ.get("PATH", "")
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dra_isolation_gpu.py"), "--backend", "hami-mps",
         "--hami-library", standin_vgpu, "--no-torch", "--json", str(out)],
        env={**os.environ, "PATH": path, "LD_LIBRARY_PATH": f"{nvml}:{fake_cuda_dir}",
             "FAKENVML_GPUS": "NVIDIA H100 80GB HBM3:81559", "FAKECUDA_MPS": "1",
             "FAKECUDA_STATE_DIR": str(tmp_path / "fakecuda-state"),
             "STANDIN_VGPU_LOCK_DIR": str(tmp_path / "vgpulock")},
        capture_output=True, text=True, timeout=240)
    assert out.exists(), r.stderr[-3000:]
    doc = json.loads(out.read_text())
    got = {c["key"]: c for s in doc["scenarios"] for c in s["checks"]}
    assert r.returncode == 0, [c for c in got.values() if c["ok"] is False]
    a = doc["claims"]["claim-a"]["env"]
    assert a["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m" and "CUDA_DEVICE_SM_LIMIT" not in a
    assert a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert a["GPU_CORE_UTILIZATION_POLICY"] == "disable"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in doc["claims"]["claim-b"]["env"]
    for key in ("claim-a.library", "claim-a.pipe", "claim-b.library", "claim-b.pipe"):
        assert got[key]["ok"] is True, got[key]
