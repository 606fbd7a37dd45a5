"""``sharegpu isolation-check`` end to end: the command (a subprocess, as an operator runs it)
against the fake CUDA driver (fakecuda.c) and the stand-in HAMi-core interposer
(standin_vgpu.c), both built by conftest.py with gcc."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

H100 = "NVIDIA H100 80GB HBM3:81559"
CLEARED = ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MEMORY_SHARED_CACHE",
           "CUDA_MPS_PIPE_DIRECTORY", "FAKECUDA_MPS", "STANDIN_VGPU_SLACK_MIB",
           "STANDIN_VGPU_IGNORE_SM")


@pytest.fixture
def node(tmp_path, fake_cuda_dir):
    """The environment of a GPU node with one fake H100 (state private to the test)."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(
        LD_LIBRARY_PATH=fake_cuda_dir,
        FAKECUDA_GPUS=H100,
        FAKECUDA_STATE_DIR=str(tmp_path / "fakecuda-state"),
        STANDIN_VGPU_LOCK_DIR=str(tmp_path / "vgpulock"),
        COLUMNS="160",
    )
    return env


def check(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "sharegpu.cli", "isolation-check", *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    return r


def rows(r: subprocess.CompletedProcess) -> dict:
    out = json.loads(r.stdout)
    return {c["key"]: c for c in out["checks"]}


def table_row(text: str, name: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith(f"│ {name} ")]
    assert len(lines) == 1, text
    return lines[0]


def test_hami_memory_limit_holds_json(node, standin_vgpu):
    r = check(node, "--mem", "2", "--hami-library", standin_vgpu, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True
    assert out["request"]["backend"] == "hami" and out["request"]["mem_gib"] == 2
    assert out["request"]["core"] is None and out["request"]["limit_mib"] == 2048
    assert out["gpu"].pop("nvml").startswith("not used: ")  # no NVML beside the fake driver
    assert out["gpu"].pop("advertised_gib") == 80
    assert out["gpu"] == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_mib": 81559,
                          "total_bytes": 81559 << 20, "multiprocessors": 132,
                          "driver_version": "12.2", "used_without_limits_mib": 64.0}
    # the environment is the agent's, with container paths turned into host paths
    env = out["env"]
    assert env["LD_PRELOAD"] == standin_vgpu
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"
    assert env["GPU_CORE_UTILIZATION_POLICY"] == "disable"
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    cache = env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    assert not cache.startswith("/tmp/sharegpu-vgpu/") and cache.endswith("-mem.cache")
    c = rows(r)
    assert list(c) == ["mem.seen", "mem.reachable", "mem.past", "mem.survives", "shared.free",
                       "shared.sum"]
    assert all(x["ok"] is True for x in c.values())
    assert c["mem.seen"]["asked"] == 2048 and c["mem.seen"]["measured"] == 2048.0
    # largest allocation 1984 MiB + the 64 MiB context the stand-in counts
    assert c["mem.reachable"]["measured"] == 2048.0
    assert "1984 MiB" in c["mem.reachable"]["note"]
    assert c["mem.past"]["measured"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert c["mem.survives"]["measured"] == "1 MiB allocated"
    # A holds half of what both contexts leave, (2048 - 2 x 64) / 2 = 960 MiB (+64 context); B,
    # with its own 64, sees the rest
    assert c["shared.free"]["asked"] == c["shared.free"]["measured"] == 960.0
    assert c["shared.free"]["note"] == "limit - A's 1024 MiB - B's own 64.0 MiB"
    assert c["shared.sum"]["measured"] == 2048.0


def test_hami_20_gib_on_an_80_gib_gpu_table(node, standin_vgpu):
    r = check(node, "--mem", "20", "--hami-library", standin_vgpu)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NVIDIA H100 80GB HBM3" in r.stdout and "isolation holds" in r.stdout
    row = table_row(r.stdout, "memory seen")
    assert "20,480 MiB" in row and "20,480.0 MiB" in row and "pass" in row
    assert "pass" in table_row(r.stdout, "limit reachable")
    assert "FAIL" not in r.stdout


def test_limit_larger_than_the_gpu(node, standin_vgpu):
    """ACK advertises a 15,109 MiB T4 as 15 GiB: a 15 GiB request cannot get all of it."""
    node["FAKECUDA_GPUS"] = "Tesla T4:15109"
    r = check(node, "--mem", "15", "--hami-library", standin_vgpu, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    fits = rows(r)["mem.fits"]
    assert fits["ok"] is False and fits["asked"] == 15360 and fits["measured"] == 15109.0
    assert rows(r)["mem.seen"]["measured"] == 15360.0  # the stand-in still shows the limit


def test_hami_memory_and_compute(node, standin_vgpu):
    r = check(node, "--mem", "2", "--core", "30", "--seconds", "1",
              "--hami-library", standin_vgpu, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["env"]["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert out["env"]["GPU_CORE_UTILIZATION_POLICY"] == "force"
    share = rows(r)["compute.share"]
    assert share["ok"] is True and share["asked"] == 30
    assert 25 <= share["measured"] <= 35
    assert out["ok"] is True


def test_ignored_compute_cap_fails_the_compute_row(node, standin_vgpu):
    node["STANDIN_VGPU_IGNORE_SM"] = "1"
    r = check(node, "--mem", "2", "--core", "30", "--seconds", "1",
              "--hami-library", standin_vgpu)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL" in table_row(r.stdout, "compute share")
    assert "pass" in table_row(r.stdout, "memory seen")
    assert "isolation does not hold: compute share" in r.stdout


def test_allocations_past_the_limit_fail_the_memory_rows(node, standin_vgpu):
    node["STANDIN_VGPU_SLACK_MIB"] = "512"
    r = check(node, "--mem", "2", "--hami-library", standin_vgpu, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    c = rows(r)
    assert c["mem.reachable"]["ok"] is False and c["mem.reachable"]["measured"] == 2560.0
    assert c["shared.sum"]["ok"] is False
    assert c["mem.seen"]["ok"] is True  # it still reports the limit
    assert json.loads(r.stdout)["ok"] is False
    t = check(node, "--mem", "2", "--hami-library", standin_vgpu)
    assert t.returncode == 1
    assert "FAIL" in table_row(t.stdout, "limit reachable")


def test_compare_reports_ratios(node, standin_vgpu):
    r = check(node, "--mem", "2", "--seconds", "0.5", "--compare",
              "--hami-library", standin_vgpu, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    for key in ("launch", "alloc"):
        m = out["compare"][key]
        assert m["baseline"] > 0 and m["with_library"] > 0
        assert m["ratio"] == pytest.approx(m["with_library"] / m["baseline"])
        row = rows(r)[f"compare.{key}"]
        assert row["ok"] is None and row["tolerance"] == "no target"
    assert out["ok"] is True


def test_fill_a_gpu_that_holds_the_pods(node, standin_vgpu):
    """Four 20 GiB pods on a card with 80 GiB of real memory: each gets its limit, no more."""
    node["FAKECUDA_GPUS"] = "Fake 80 GiB:81920"
    r = check(node, "--mem", "20", "--fill", "--hami-library", standin_vgpu, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    c = rows(r)
    assert [k for k in c if k.startswith("fill.")] == [
        "fill.within", "fill.reach", "fill.past", "fill.survives"]
    assert c["fill.within"]["measured"] == c["fill.reach"]["measured"] == 20480.0
    assert "4 pods" in c["fill.within"]["note"]
    assert c["fill.past"]["measured"] == "CUDA_ERROR_OUT_OF_MEMORY (4 pods)"
    assert c["fill.survives"]["measured"] == "1 MiB allocated (4 pods)"
    assert all(c[k]["ok"] is True for k in c)


def test_fill_past_the_gpus_real_memory(node, standin_vgpu):
    """An 81,559 MiB H100 is advertised as 80 GiB: the fourth 20 GiB pod gets what is left
    (81,559 - 3 x 20,480 MiB), cleanly out of memory past it, and the check says why."""
    r = check(node, "--mem", "20", "--fill", "--hami-library", standin_vgpu, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    c = rows(r)
    assert c["fill.reach"]["ok"] is False
    assert c["fill.reach"]["measured"] == 81559 - 3 * 20480
    assert "less free memory than the limits" in c["fill.reach"]["note"]
    for key in ("fill.within", "fill.past", "fill.survives"):
        assert c[key]["ok"] is True, c[key]
    t = check(node, "--mem", "20", "--fill", "--hami-library", standin_vgpu)
    assert "FAIL" in table_row(t.stdout, "fill: limit reached")


def test_fill_with_the_agents_reserve(node, standin_vgpu):
    """With the agent's --reserve-mib 1024 an 81,559 MiB card is advertised as 79 GiB: three
    20 GiB pods fill it, and each gets its limit."""
    r = check(node, "--mem", "20", "--fill", "--reserve-mib", "1024",
              "--hami-library", standin_vgpu, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["gpu"]["advertised_gib"] == 79
    c = rows(r)
    assert "3 pods" in c["fill.within"]["note"] and c["fill.reach"]["ok"] is True
    bad = check(node, "--mem", "20", "--reserve-mib", "-5", "--hami-library", standin_vgpu)
    assert bad.returncode == 2 and "--reserve-mib='-5'" in bad.stderr


def test_fill_with_a_library_that_lets_pods_past_their_limit(node, standin_vgpu):
    node["FAKECUDA_GPUS"] = "Fake 80 GiB:81920"
    node["STANDIN_VGPU_SLACK_MIB"] = "256"
    r = check(node, "--mem", "20", "--fill", "--hami-library", standin_vgpu, "--json")
    assert r.returncode == 1
    c = rows(r)
    assert c["fill.within"]["ok"] is False and c["fill.within"]["measured"] == 20480 + 256
    # three pods took 256 MiB more each: the fourth is left 81,920 - 3 x 20,736 MiB
    assert c["fill.reach"]["ok"] is False and c["fill.reach"]["measured"] == 81920 - 3 * 20736
    assert c["fill.past"]["measured"] == "CUDA_ERROR_OUT_OF_MEMORY (4 pods)"


class FakeDriverCount:
    """The fake driver's own count of a GPU's used memory (its state file: a record of pid and
    bytes per process), standing in for NVML's."""

    available = True
    error = ""

    def __init__(self, state_dir: str, gpu: int) -> None:
        self.path = Path(state_dir) / f"gpu{gpu}.mem"

    def used_mib(self) -> float:
        data = self.path.read_bytes() if self.path.exists() else b""
        used = 0
        for off in range(0, len(data) - 15, 16):
            pid, _, nbytes = struct.unpack_from("<iiQ", data, off)
            if pid > 0 and Path(f"/proc/{pid}").exists():
                used += nbytes
        return used / (1 << 20)

    def total_mib(self) -> None:
        return None  # the agent's GiB then come from the CUDA total

    def close(self) -> None:
        pass


@pytest.fixture
def driver_count(node, monkeypatch):
    from sharegpu.isolation_check import check as check_module

    monkeypatch.setattr(check_module, "DeviceMemory",
                        lambda gpu: FakeDriverCount(node["FAKECUDA_STATE_DIR"], gpu))


def keyed(report) -> dict:
    return {c.key: c for c in report.checks}


def test_driver_count_rows(node, standin_vgpu, driver_count):
    """With the driver's count (NVML on a GPU node), what each pod takes on the GPU is measured
    without the interposer's word for it."""
    from sharegpu.isolation_check.check import Request, run_check

    node["FAKECUDA_GPUS"] = "Fake 80 GiB:81920"
    req = Request(backend="hami", mem_gib=20, hami_library=standin_vgpu, fill=True)
    c = keyed(run_check(req, base_env=node))
    assert c["mem.device"].ok is True and c["mem.device"].measured == 20480.0
    assert "largest allocation, 20416 MiB" in c["mem.device"].note
    assert c["fill.device"].ok is True and c["fill.device"].measured == 20480.0
    assert c["fill.device"].note.endswith("20480, 20480, 20480, 20480 MiB")
    # an interposer that lets a pod 256 MiB past its limit: the driver counts it
    node["STANDIN_VGPU_SLACK_MIB"] = "256"
    c = keyed(run_check(req, base_env=node))
    assert c["mem.device"].ok is False and c["mem.device"].measured == 20480.0 + 256
    assert c["fill.device"].ok is False and c["fill.device"].measured == 20480.0 + 256


def test_mps_context_from_the_driver_count(node, tmp_path, driver_count):
    """An MPS client's own memory inside its limit is taken from the driver's count (the GPU's
    used memory while it holds its largest allocation, less that allocation), not from a
    process outside MPS: the rows hold with a 32 MiB client context and a 64 MiB bare one."""
    from sharegpu.isolation_check.check import Request, run_check

    pipe = tmp_path / "mps-pipe"
    pipe.mkdir()
    node.update(FAKECUDA_MPS="1", FAKECUDA_CTX_MIB="64", FAKECUDA_MPS_CTX_MIB="32")
    with mps_standin(node, pipe):
        c = keyed(run_check(Request(backend="mps", mem_gib=2, mps_pipe_dir=str(pipe)),
                            base_env=node))
    assert c["mem.device"].ok is True and c["mem.device"].measured == 2048.0
    for key in ("mem.seen", "mem.reachable", "mem.past", "mem.survives"):
        assert c[key].ok is True, c[key]
    assert c["mem.reachable"].note == "largest allocation 2016 MiB + 32.0 MiB used at start"
    assert c["mem.seen"].measured == 2048.0


MPS_STANDIN = str(Path(__file__).resolve().parent.parent / "agent" / "standins"
                  / "nvidia-cuda-mps-control")


@contextlib.contextmanager
def mps_standin(node: dict, pipe: Path) -> Iterator[None]:
    """The stand-in MPS control daemon on ``pipe``, answering while the block runs."""
    daemon = subprocess.Popen([MPS_STANDIN, "-f"],
                              env=dict(node, CUDA_MPS_PIPE_DIRECTORY=str(pipe)))
    try:
        for _ in range(200):
            if (pipe / "control").exists():
                break
            time.sleep(0.02)
        yield
    finally:
        daemon.kill()
        daemon.wait()


def test_mps_backend(node, tmp_path):
    pipe = tmp_path / "mps-pipe"
    pipe.mkdir()
    node["FAKECUDA_MPS"] = "1"
    # the daemon not answering: refused with the agent's reason
    r = check(node, "--backend", "mps", "--mem", "2", "--mps-pipe-dir", str(pipe),
              "--mps-control", MPS_STANDIN)
    assert r.returncode == 2 and "the MPS control daemon does not answer" in r.stderr
    with mps_standin(node, pipe):
        r = check(node, "--backend", "mps", "--mem", "2", "--core", "30", "--seconds", "1",
                  "--mps-pipe-dir", str(pipe), "--mps-control", MPS_STANDIN, "--json")
    out = json.loads(r.stdout)
    assert out["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)  # the host's pipe directory
    assert out["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert out["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    c = rows(r)
    for key in ("mem.seen", "mem.reachable", "mem.past", "mem.survives", "compute.share"):
        assert c[key]["ok"] is True, c[key]
    assert 25 <= c["compute.share"]["measured"] <= 35
    # MPS holds each client process, not the container, to the limit: two processes of one
    # container get the limit each, and the check says so
    assert c["shared.free"]["ok"] is False and c["shared.sum"]["ok"] is False
    assert "each client process" in c["shared.sum"]["note"]
    assert r.returncode == 1 and out["ok"] is False


def test_no_cuda_library(node, tmp_path, standin_vgpu):
    node["LD_LIBRARY_PATH"] = str(tmp_path)
    r = check(node, "--mem", "2", "--hami-library", standin_vgpu)
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line and "cannot load libcuda.so.1" in line and "LD_LIBRARY_PATH" in line


@pytest.mark.parametrize(("args", "named"), [
    (["--core", "33"], "--core"),
    (["--core", "0"], "--core"),
    (["--core", "105"], "--core"),
    (["--compute-policy", "1"], "--compute-policy"),
    (["--compute-policy", "9"], "--compute-policy"),
    (["--mem", "0"], "--mem"),
    (["--mem", "81"], "--mem"),
    (["--gpu", "1"], "--gpu"),
    (["--seconds", "-1"], "--seconds"),
    (["--backend", "cuda"], "--backend"),
])
def test_bad_arguments(node, standin_vgpu, args, named):
    base = {"--mem": "2", "--hami-library": standin_vgpu}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v
    r = check(node, *[x for kv in base.items() for x in kv])
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"sharegpu isolation-check: error: {named}"), r.stderr
    assert r.stderr.count("\n") == 1


def test_missing_hami_library(node, tmp_path):
    lib = str(tmp_path / "libvgpu.so")
    r = check(node, "--mem", "2", "--hami-library", lib)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"sharegpu isolation-check: error: --hami-library='{lib}': "
                               f"the HAMi-core library {lib} does not exist; fix: ")


def test_library_the_chart_installed_is_the_default(node, standin_vgpu, tmp_path):
    pointer = tmp_path / "installed"
    pointer.write_text(standin_vgpu + "\n")
    r = check(node, "--mem", "2", "--hami-installed", str(pointer), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["env"]["LD_PRELOAD"] == standin_vgpu


def test_pods_do_not_share_a_limit(node, standin_vgpu, tmp_path):
    """The stand-in counts usage per shared-cache file: a process of another pod does not see a
    process of this one (what the agent's per-pod cache files are for)."""
    base = {**node, "LD_PRELOAD": standin_vgpu, "CUDA_DEVICE_MEMORY_LIMIT_0": "2048m",
            "CUDA_VISIBLE_DEVICES": "0"}
    probe = [sys.executable, "-m", "sharegpu.isolation_check.probe"]
    a = subprocess.Popen([*probe, "hold", "--mib", "1500"], text=True, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE,
                         env={**base, "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "a")})
    try:
        assert json.loads(a.stdout.readline())["ready"]
        same = subprocess.run([*probe, "mem"], capture_output=True, text=True, timeout=60,
                              env={**base, "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "a")})
        other = subprocess.run([*probe, "mem"], capture_output=True, text=True, timeout=60,
                               env={**base,
                                    "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "b")})
    finally:
        a.stdin.close()
        a.wait(timeout=30)
    assert json.loads(same.stdout)["largest_mib"] == 2048 - 1564 - 64
    assert json.loads(other.stdout)["largest_mib"] == 2048 - 64
    # once A is gone its record no longer counts
    again = subprocess.run([*probe, "mem"], capture_output=True, text=True, timeout=60,
                           env={**base, "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "a")})
    assert json.loads(again.stdout)["largest_mib"] == 2048 - 64


def test_probe_on_the_bare_fake_gpu(node):
    probe = [sys.executable, "-m", "sharegpu.isolation_check.probe"]
    env = {**node, "FAKECUDA_GPUS": "Tesla T4:15109,NVIDIA A10:22731", "CUDA_VISIBLE_DEVICES": "1"}
    info = json.loads(subprocess.run([*probe, "info"], capture_output=True, text=True,
                                     env=env, timeout=60).stdout)
    assert info["name"] == "NVIDIA A10" and info["total_mib"] == 22731
    assert info["ctx_total_bytes"] - info["ctx_free_bytes"] == 64 << 20
    mem = json.loads(subprocess.run([*probe, "mem"], capture_output=True, text=True, env=env,
                                    timeout=60).stdout)
    assert mem["largest_mib"] == 22731 - 64 and mem["past_name"] == "CUDA_ERROR_OUT_OF_MEMORY"
    spin = json.loads(subprocess.run([*probe, "spin", "--seconds", "0.3"], capture_output=True,
                                     text=True, env=env, timeout=60).stdout)
    # a launch is 8 waves of 125,000 cycles at 1 GHz: 1 ms
    assert spin["cycles"] == 125_000 and spin["blocks"] == 132 * 16 * 8
    assert 150 <= spin["kernels"] <= 310
    bad = subprocess.run([*probe, "info"], capture_output=True, text=True, timeout=60,
                         env={**env, "CUDA_VISIBLE_DEVICES": "7"})
    assert bad.returncode == 3 and "CUDA_ERROR_NO_DEVICE" in json.loads(bad.stdout)["error"]


def test_clibs_names_for_other_tests(fake_cuda_dir, standin_vgpu):
    assert (Path(fake_cuda_dir) / "libcuda.so.1").is_file()
    assert Path(standin_vgpu).name == "libvgpu.so" and Path(standin_vgpu).is_file()
