"""The real NVML path — nvidia-ml-py's ctypes loading of libnvidia-ml.so.1 — against a fake
library compiled from tests/agent/fakenvml/fakenvml.c by this test setup (gcc)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import short_dir, standin_library  # noqa: F401
from agent_kubelet import TestKubelet, wait_until

from sharegpu.core import names

HERE = Path(__file__).resolve().parent
GPUS = "Tesla T4:15109,Tesla V100-SXM2-32GB:32510"


@pytest.fixture(scope="module")
def fake_libdir(tmp_path_factory) -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed to build the fake libnvidia-ml.so.1"
    d = tmp_path_factory.mktemp("fakenvml")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libnvidia-ml.so.1"),
         str(HERE / "fakenvml" / "fakenvml.c")],
        check=True,
    )
    return str(d)


def nvml_env(libdir: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = libdir + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    env["FAKENVML_GPUS"] = GPUS
    env.update(extra)
    return env


PROBE = """
import json
from sharegpu.agent.nvml import RealNvml
n = RealNvml()
out = {"gpus": [[g.index, g.uuid, g.name, g.mem_mib, g.mem_gib] for g in n.gpus()],
       "driver": n.driver_version(), "links": n.links()}
out["quiet"] = n.wait_event(0.05) is None
ev = n.wait_event(2.0)
out["event"] = [ev.gpu, ev.xid, ev.critical] if ev else None
out["lost"] = not n.responsive(1)
out["other_fine"] = n.responsive(0)
n.close()
print(json.dumps(out))
"""


def test_real_nvml_through_pynvml_ctypes(fake_libdir):
    r = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
        env=nvml_env(fake_libdir, FAKENVML_XID="1:79:200:60000"),
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [g[2] for g in out["gpus"]] == ["Tesla T4", "Tesla V100-SXM2-32GB"]
    assert [g[3] for g in out["gpus"]] == [15109, 32510]
    assert [g[4] for g in out["gpus"]] == [15, 32]  # GiB as ACK shows them
    assert len({g[1] for g in out["gpus"]}) == 2 and out["gpus"][0][1].startswith("GPU-")
    assert out["driver"] == "535.104.05"
    assert out["links"] == [["X", "PIX"], ["PIX", "X"]]
    assert out["quiet"] and out["event"] == [1, 79, True]
    assert out["lost"] and out["other_fine"]


def test_without_library_the_agent_says_why(tmp_path):
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path), NODE_NAME="n1")
    r = subprocess.run(
        [sys.executable, "-m", "sharegpu.cli", "agent", "--nvml", "real", "--standalone",
         "--state-dir", str(tmp_path / "s"), "--device-plugin-dir", str(tmp_path / "dp")],
        capture_output=True, text=True, timeout=60, env=env,
    )
    if r.returncode == 0 or "NVML could not be initialised" not in r.stderr:
        # a machine with a real NVIDIA driver finds the real library: nothing to check here
        assert Path("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").exists(), r.stderr
        return
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


async def test_agent_process_on_fake_library(fake_libdir, short_dir):
    """`sharegpu agent --nvml real` in its own process: the kubelet sees the GPUs NVML reports
    (one device per GiB, per GPU) and the XID the library emits marks one GPU unhealthy."""
    kubelet = TestKubelet(f"{short_dir}/dp")
    await kubelet.start()
    env = nvml_env(fake_libdir, FAKENVML_XID="1:48:1500:600000", NODE_NAME="gpu-node-1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sharegpu.cli", "agent", "--nvml", "real", "--standalone",
        "--mode", "cgpu", "--device-plugin-dir", f"{short_dir}/dp",
        "--state-dir", f"{short_dir}/state", "--metrics-listen", "", "--log-level", "WARNING",
        "--hami-library", standin_library(),
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_until(lambda: len(kubelet.devices) == 5, timeout=20)
        assert kubelet.count(names.RES_GPU_MEM) == 15 + 32
        assert kubelet.count(names.RES_GPU_COUNT) == 2
        assert kubelet.count(names.RES_NVIDIA_GPU) == 0
        await wait_until(lambda: len(kubelet.healthy(names.RES_GPU_MEM)) == 15, timeout=10)
        assert all(i.startswith("GPU-fa4e0000") for i in kubelet.healthy(names.RES_GPU_MEM))
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
        await kubelet.stop()


USAGE_PROBE = """
import asyncio, json, sys
from sharegpu.agent.nvml import RealNvml
from sharegpu.agent.usage import ProcCgroups, UsageCollector
from sharegpu.agent.metrics import render_usage
n = RealNvml()
pods = json.loads(sys.argv[2])
async def list_pods():
    return pods
c = UsageCollector(n, [g.index for g in n.gpus()], list_pods, ProcCgroups(sys.argv[1]))
usage = asyncio.run(c.collect())
print(json.dumps({"procs": [[p.gpu, p.pid, p.used_bytes] for g in (0, 1)
                            for p in n.processes(g)],
                  "lines": render_usage("n1", {g.index: g.uuid for g in n.gpus()}, usage,
                                       pod_names=True)}))
n.close()
"""


def test_usage_through_pynvml_on_the_fake_library(fake_libdir, tmp_path):
    """RealNvml's per-process query (nvmlDeviceGetComputeRunningProcesses_v3 through
    nvidia-ml-py) and the pod mapping, on the fake library: two processes of one container
    on GPU 1, one of another pod's container on GPU 0, one host process."""
    uid_a, uid_b = "11111111-2222-4333-8444-555555555555", "66666666-7777-4888-9999-000000000000"
    cid_a, cid_b = "a1" * 32, "b2" * 32
    cgroups = {501: (uid_a, cid_a), 502: (uid_a, cid_a), 503: (uid_b, cid_b), 504: None}
    for pid, ids in cgroups.items():
        (tmp_path / "proc" / str(pid)).mkdir(parents=True)
        (tmp_path / "proc" / str(pid) / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-pod{ids[0].replace('-', '_')}.slice/"
            f"cri-containerd-{ids[1]}.scope\n" if ids else "0::/init.scope\n")
    (tmp_path / "procs").write_text("1 501 1000\n1 502 24\n0 503 4096\n1 504 300\n")

    def pod(name, uid, cid):
        return {"metadata": {"name": name, "namespace": "ml", "uid": uid},
                "spec": {"nodeName": "n1", "containers": [{"name": "main", "resources": {
                    "limits": {names.RES_GPU_MEM: "8"}}}]},
                "status": {"phase": "Running", "containerStatuses": [
                    {"name": "main", "containerID": f"containerd://{cid}"}]}}

    pods = [pod("a", uid_a, cid_a), pod("b", uid_b, cid_b)]
    r = subprocess.run(
        [sys.executable, "-c", USAGE_PROBE, str(tmp_path / "proc"), json.dumps(pods)],
        capture_output=True, text=True, timeout=60,
        env=nvml_env(fake_libdir, FAKENVML_PROCS_FILE=str(tmp_path / "procs")))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    mib = 1 << 20
    assert out["procs"] == [[0, 503, 4096 * mib], [1, 501, 1000 * mib], [1, 502, 24 * mib],
                            [1, 504, 300 * mib]]
    uuid1 = "GPU-fa4e0001-fa4e-4000-8000-000000000001"
    assert (f'sharegpu_agent_container_gpu_memory_used_bytes{{node="n1",pod_uid="{uid_a}",'
            'namespace="ml",pod="a",'
            f'container="main",gpu="1",uuid="{uuid1}"}} {1024 * mib}') in out["lines"]
    assert any(line.startswith('sharegpu_agent_container_gpu_memory_used_bytes{node="n1",'
                               f'pod_uid="{uid_b}",namespace="ml",pod="b",container="main",'
                               'gpu="0"')
               and line.endswith(f" {4096 * mib}") for line in out["lines"])
    assert f'sharegpu_agent_gpu_memory_used_bytes{{node="n1",gpu="1",uuid="{uuid1}"}} ' \
           f"{1324 * mib}" in out["lines"]
