"""The pure parts of ``sharegpu isolation-check``: the pass/fail decisions and tolerances, the
translation of the agent's container environment to host paths, the argument rules, the table."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console

from sharegpu.agent.isolation import Backend, IsolationConfig, Mount, isolation_env
from sharegpu.commands import isolation_check as cmd
from sharegpu.core.errors import ValidationError
from sharegpu.isolation_check import check as c
from sharegpu.isolation_check.render import table

# ---- memory ----


def test_memory_seen_within_one_percent():
    assert c.decide_seen(2048, 2048).ok
    assert c.decide_seen(2048, 2048 + 20.4).ok and c.decide_seen(2048, 2048 - 20.4).ok
    assert not c.decide_seen(2048, 2048 + 21).ok
    assert not c.decide_seen(2048, 81559).ok  # the whole GPU: no limit at all
    assert c.decide_seen(20480, 20480 - 200).ok and not c.decide_seen(20480, 20480 - 210).ok


def test_limit_must_fit_the_gpu():
    assert c.decide_fits(2048, 81559).ok
    assert c.decide_fits(15360, 15360 - 150).ok  # within 1 %
    r = c.decide_fits(15360, 15109)  # a T4 is a 15 GiB card, but has 15,109 MiB
    assert not r.ok and r.measured == 15109.0 and "less memory" in r.note


def test_reachable_counts_what_was_used_at_start():
    ok = c.decide_reachable(2048, 1984, 64.0)
    assert ok.ok and ok.measured == 2048.0
    assert not c.decide_reachable(2048, 1984 + 512, 64.0).ok  # more than the limit
    assert not c.decide_reachable(2048, 1500, 64.0).ok  # part of the limit out of reach
    assert c.decide_reachable(2048, 2000, 64.0).ok  # 16 MiB over: within ±20


def test_past_the_limit_needs_out_of_memory_both_times():
    names = {1: "CUDA_ERROR_INVALID_VALUE"}
    assert c.decide_past_limit(2, 2).ok
    r = c.decide_past_limit(2, 0)
    assert not r.ok and r.measured == "succeeded"
    r = c.decide_past_limit(1, 2, names)
    assert not r.ok and r.measured == "CUDA_ERROR_INVALID_VALUE"
    r = c.decide_past_limit(2, None)
    assert not r.ok and r.measured == "not tried"


def test_survives():
    assert c.decide_survives(0).ok
    r = c.decide_survives(2, {2: "CUDA_ERROR_OUT_OF_MEMORY"})
    assert not r.ok and r.measured == "CUDA_ERROR_OUT_OF_MEMORY"
    assert not c.decide_survives(None).ok


def test_shared_free_and_sum():
    # A uses 1088 (1024 + 64 context); B's own context is 64
    r = c.decide_shared_free(2048, 1088, 64, 896)
    assert r.ok and r.asked == 896.0
    assert not c.decide_shared_free(2048, 1088, 64, 1984).ok  # B does not see A
    assert c.decide_shared_sum(2048, 1088, 64, 896).ok
    assert c.decide_shared_sum(2048, 1088, 64, 896 + 20).ok
    r = c.decide_shared_sum(2048, 1088, 64, 1984)
    assert not r.ok and r.measured == 3136.0


# ---- compute and compare ----


def test_share_within_five_points():
    assert c.share_percent(3, 7) == pytest.approx(30.0)
    assert c.share_percent(0, 0) is None
    assert c.decide_share(30, 300, 700).ok
    assert c.decide_share(30, 350, 650).ok  # 35 %: at the edge
    assert not c.decide_share(30, 360, 640).ok
    assert not c.decide_share(30, 500, 500).ok  # no cap at all
    r = c.decide_share(30, 0, 0)
    assert not r.ok and r.measured is None
    assert c.decide_share(5, 52, 948).ok and not c.decide_share(5, 110, 890).ok


def test_ratios_have_no_target():
    r = c.decide_ratio("compare.launch", "launch rate", 900, 1000, "launches/s")
    assert r.ok is None and r.measured == 0.9
    assert c.ratio(1, 0) is None
    assert c.overall_ok([r])  # reported, never failing
    assert c.overall_ok([c.decide_seen(2048, 2048), r])
    assert not c.overall_ok([c.decide_seen(2048, 4096), r])
    assert not c.overall_ok([])


def test_mem_checks_per_backend():
    data = {"total_bytes": 2048 << 20, "free_bytes": 1984 << 20, "largest_mib": 1984,
            "past_single_code": 2, "past_code": 2, "after_code": 0,
            "past_name": "CUDA_ERROR_OUT_OF_MEMORY"}
    req = c.Request("hami", 2)
    assert [x.ok for x in c.mem_checks(req, data, None)] == [True] * 4
    # MPS: total is the device's, the limit shows in free; the context comes from the baseline
    mps = {**data, "total_bytes": 81559 << 20}
    checks = c.mem_checks(c.Request("mps", 2), mps, 64.0)
    assert [x.ok for x in checks] == [True] * 4
    assert checks[0].measured == 2048.0 and "MPS" in checks[0].note
    assert not c.mem_checks(req, mps, None)[0].ok  # read as hami: no limit seen


# ---- the environment ----


def test_host_env_translates_container_paths():
    mounts = [Mount("/usr/local/vgpu/libvgpu.so", "/opt/lib/libvgpu.so"),
              Mount("/tmp/sharegpu-vgpu", "/var/x/cache/uid1", False),
              Mount("/tmp", "/host-tmp", False)]
    envs = {
        "LD_PRELOAD": "/usr/local/vgpu/libvgpu.so",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/sharegpu-vgpu/uid1.cache",  # longest wins
        "LIST": "/tmp/a:/usr/local/vgpu/libvgpu.so /tmp",
        "NOT_A_PREFIX": "/tmp/sharegpu-vgpux/y",  # /tmp matches, the longer one does not
        "OTHER": "/tmpfoo",  # no path boundary
        "PLAIN": "2048m",
        "KV": "0=/tmp/z",
    }
    out = c.host_env(envs, mounts)
    assert out["LD_PRELOAD"] == "/opt/lib/libvgpu.so"
    assert out["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/var/x/cache/uid1/uid1.cache"
    assert out["LIST"] == "/host-tmp/a:/opt/lib/libvgpu.so /host-tmp"
    assert out["NOT_A_PREFIX"] == "/host-tmp/sharegpu-vgpux/y"
    assert out["OTHER"] == "/tmpfoo"
    assert out["PLAIN"] == "2048m"
    assert out["KV"] == "0=/host-tmp/z"


def test_host_env_of_the_agents_environments():
    cfg = IsolationConfig(hami_library="/lib/v.so", hami_cache_dir="/h/cache",
                          hami_lock_dir="/h/lock", mps_pipe_dir="/h/mps")
    hami = isolation_env(Backend.HAMI, mem={0: 2}, core={}, pod_uid="u1", config=cfg)
    out = c.host_env(hami.envs, hami.mounts)
    assert out["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/h/cache/u1/u1.cache"
    assert out["LD_PRELOAD"] == "/lib/v.so"
    mps = isolation_env(Backend.MPS, mem={0: 2}, core={0: 30}, pod_uid="u1", config=cfg)
    out = c.host_env(mps.envs, mps.mounts)
    assert out["CUDA_MPS_PIPE_DIRECTORY"] == "/h/mps"
    assert out["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"


def test_clean_env_drops_the_callers_isolation():
    env = c.clean_env({"LD_PRELOAD": "/x.so", "CUDA_VISIBLE_DEVICES": "3", "HOME": "/root",
                       "CUDA_DEVICE_MEMORY_LIMIT_0": "1g", "CUDA_MPS_PIPE_DIRECTORY": "/p"})
    assert env["HOME"] == "/root"
    assert not {"LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MEMORY_LIMIT_0",
                "CUDA_MPS_PIPE_DIRECTORY"} & set(env)
    assert env["PYTHONPATH"].endswith("src") or "sharegpu" not in env["PYTHONPATH"]


def test_probe_output_is_read_from_its_last_json_line():
    r = c._result(0, 'noise\n{"ready": true}\n{"largest_mib": 5}\n', "")
    assert r.ok and r.data == {"largest_mib": 5}
    r = c._result(3, '{"error": "cuInit failed", "kind": "cuda", "code": 100}\n', "")
    assert not r.ok and r.kind == "cuda" and r.error == "cuInit failed"
    r = c._result(-11, "", "Segmentation fault\n")
    assert not r.ok and r.kind == "crash" and "Segmentation fault" in r.error


# ---- arguments ----


MPS_STANDIN = str(Path(__file__).resolve().parent.parent / "agent" / "standins"
                  / "nvidia-cuda-mps-control")


@pytest.fixture
def node_lib(monkeypatch, fake_cuda_dir, standin_vgpu):
    """The stand-in library, loadable (its libcuda.so.1 on the path) as the checks need."""
    monkeypatch.setenv("LD_LIBRARY_PATH", fake_cuda_dir)
    return standin_vgpu


@pytest.fixture
def mps_pipe(tmp_path):
    pipe = tmp_path / "mps"
    daemon = subprocess.Popen([MPS_STANDIN, "-f"],
                              env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe)))
    for _ in range(250):
        if (pipe / "control").exists():
            break
        time.sleep(0.02)
    yield str(pipe)
    daemon.kill()
    daemon.wait()


def args(tmp_path, lib="/nope/libvgpu.so", **kw) -> argparse.Namespace:
    base = dict(backend="hami", mem="2", core=None, gpu="0", hami_library=lib,
                hami_installed=str(tmp_path / "installed"), mps_pipe_dir=str(tmp_path),
                mps_control=MPS_STANDIN, compute_policy="5", seconds="5", compare=False,
                fill=False, compute_kernel="burn", reserve_mib="0", crash=False,
                json=False, cuda_library="libcuda.so.1")
    base.update(kw)
    return argparse.Namespace(**base)


def test_request_from_arguments(tmp_path, node_lib, mps_pipe):
    req = cmd.request(args(tmp_path, node_lib, core="30", compute_policy="3", seconds="1.5"))
    assert (req.mem_gib, req.core, req.compute_policy, req.seconds) == (2, 30, 3, 1.5)
    assert req.limit_mib == 2048
    assert cmd.request(args(tmp_path, node_lib, core="100")).core == 100
    mps = cmd.request(args(tmp_path, backend="mps", mps_pipe_dir=mps_pipe))
    assert mps.backend == "mps"
    both = cmd.request(args(tmp_path, node_lib, backend="hami-mps", mps_pipe_dir=mps_pipe,
                            crash=True))
    assert (both.backend, both.hami_library, both.crash) == ("hami-mps", node_lib, True)


@pytest.mark.parametrize(("kw", "field"), [
    ({"core": "33"}, "--core"), ({"core": "0"}, "--core"), ({"core": "105"}, "--core"),
    ({"core": "x"}, "--core"), ({"mem": "1.5"}, "--mem"), ({"mem": "0"}, "--mem"),
    ({"gpu": "-1"}, "--gpu"), ({"compute_policy": "0"}, "--compute-policy"),
    ({"compute_policy": "6"}, "--compute-policy"), ({"seconds": "0"}, "--seconds"),
    ({"backend": "none"}, "--backend"), ({"hami_library": "/nope/libvgpu.so"}, "--hami-library"),
    ({"backend": "mps", "mps_pipe_dir": "/nope"}, "--mps-pipe-dir"),
    ({"cuda_library": "/nope/libcuda.so.1"}, "--cuda-library"),
])
def test_bad_arguments_name_the_flag(tmp_path, node_lib, kw, field):
    with pytest.raises(ValidationError) as e:
        cmd.request(args(tmp_path, **{"hami_library": node_lib, **kw}))
    assert e.value.field == field


def test_core_rule_is_stated():
    with pytest.raises(ValidationError) as e:
        cmd.request(argparse.Namespace(backend="hami", mem="2", core="7"))
    assert "multiple of 5 from 5 to 100" in str(e.value)


# ---- the table ----


def test_table_rows_and_verdict():
    rep = c.Report(c.Request("hami", 2, core=30),
                   gpu={"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_mib": 81559,
                        "driver_version": "12.2"},
                   checks=[c.decide_seen(2048, 2048), c.decide_share(30, 500, 500),
                           c.decide_ratio("compare.alloc", "alloc rate", 95, 100, "ops/s")])
    buf = io.StringIO()
    table(rep, Console(file=buf, width=140, color_system=None))
    text = buf.getvalue()
    assert "NVIDIA H100 80GB HBM3" in text and "hami, 2 GiB, 30 % compute" in text
    assert "2,048 MiB" in text and "2,048.0 MiB" in text and "pass" in text
    assert "50.0 %" in text and "FAIL" in text and "0.950×" in text and "info" in text
    assert "isolation does not hold: compute share" in text
    out = rep.to_json()
    assert out["ok"] is False and out["request"]["limit_mib"] == 2048
    assert [x["ok"] for x in out["checks"]] == [True, False, None]
