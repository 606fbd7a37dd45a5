"""Helpers of the node-agent tests: pods as the scheduler leaves them, and a harness of
agent + test kubelet + in-memory API."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping

import pytest
from agent_kubelet import TestKubelet, wait_until

from sharegpu.agent.builder import build_agent
from sharegpu.agent.config import AgentConfig
from sharegpu.agent.isolation import IsolationConfig
from sharegpu.agent.kube import MemoryKube
from sharegpu.agent.nvml import FakeNvml
from sharegpu.agent.service import Agent
from sharegpu.core import names
from sharegpu.core.annotations import Allocation, encode

NODE = "gpu-node-1"


def make_pod(
    name: str,
    containers: list[Mapping[str, int]],
    *,
    alloc: Mapping[int, Mapping[int, int]] | None = None,
    core: Mapping[int, Mapping[int, int]] | None = None,
    assume: int = 1,
    gpu_count: int | None = None,
    node: str = NODE,
    env: Mapping[int, Mapping[str, str]] | None = None,
    uid: str | None = None,
    whole: str | None = None,
    first_gen_only: bool = False,
) -> dict:
    """A pod bound to ``node``; ``containers`` lists each container's {"mem": GiB, "core": %}
    (or {"cards": K} with ``whole`` the resource); ``alloc`` is the scheduler's decision."""
    specs = []
    for i, c in enumerate(containers):
        limits: dict[str, str] = {}
        if "mem" in c:
            limits[names.RES_GPU_MEM] = str(c["mem"])
        if "core" in c:
            limits[names.RES_GPU_CORE] = str(c["core"])
        if "cards" in c:
            limits[whole or names.RES_NVIDIA_GPU] = str(c["cards"])
        spec = {"name": f"c{i}", "image": "x", "resources": {"limits": limits}}
        if env and i in env:
            spec["env"] = [{"name": k, "value": v} for k, v in env[i].items()]
        specs.append(spec)
    labels = {}
    if gpu_count:
        labels[names.POD_LABEL_GPU_COUNT] = str(gpu_count)
    ann = {}
    if alloc is not None:
        ann = encode(Allocation(mem=alloc, core=core or {}), assume_time_ns=assume)
        if first_gen_only:
            ann = {k: v for k, v in ann.items() if k.startswith("ALIYUN")}
    return {
        "metadata": {"name": name, "namespace": "default", "uid": uid or f"uid-{name}",
                     "labels": labels, "annotations": ann},
        "spec": {"nodeName": node, "containers": specs},
        "status": {"phase": "Pending"},
    }


@functools.cache
def standin_library() -> str:
    """A loadable shared object (a few lines of our own C) standing in for HAMi-core, so the
    agent's fail-closed check passes in tests about something else."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed to build the stand-in library"
    d = tempfile.mkdtemp(prefix="sg-vgpu-")
    src = os.path.join(d, "standin.c")
    with open(src, "w") as f:
        # exports the two hooks the agent looks for, as HAMi-core's build does
        f.write("int sharegpu_standin_loaded(void) { return 1; }\n"
                "int cuMemAlloc_v2(void *p, unsigned long n) { return 3; }\n"
                "int cuMemGetInfo_v2(void *f, void *t) { return 3; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", os.path.join(d, "libvgpu.so"), src],
                   check=True)
    return os.path.join(d, "libvgpu.so")


class Harness:
    def __init__(self, directory: str, gpus, mode: str | None = "default", **cfg) -> None:  # type: ignore[no-untyped-def]
        self.dir = directory
        self.slices = cfg.pop("slices", None)  # a SlicePublisher (DRA), or None
        self.kube = MemoryKube()
        labels = {names.LABEL_SCHEDULE: mode} if mode else {}
        self.kube.add_node(NODE, labels)
        self.nvml = FakeNvml(gpus)
        self.kubelet = TestKubelet(f"{directory}/dp")
        self.cfg = cfg
        self.agent: Agent | None = None

    def config(self) -> AgentConfig:
        cfg = dict(self.cfg)
        # a stop waits for bound pods to be admitted: tests that leave pods pending do not
        cfg.setdefault("stop_drain_s", 0.2)
        cfg.setdefault("isolation_paths", IsolationConfig(
            hami_library=standin_library(), hami_cache_dir=f"{self.dir}/vgpu-cache",
            hami_lock_dir=f"{self.dir}/vgpulock", mps_pipe_dir=f"{self.dir}/mps",
            mps_shm_dir=f"{self.dir}/mps-shm"))
        return AgentConfig(node_name=NODE, device_plugin_dir=f"{self.dir}/dp",
                           state_dir=f"{self.dir}/state", kubelet_poll_s=0.05,
                           health_poll_s=0.05, allocate_retries=1, allocate_retry_s=0.05,
                           **cfg)

    async def start(self) -> Agent:
        await self.kubelet.start()
        self.agent = build_agent(self.config(), self.nvml, self.kube, self.slices)
        await self.agent.start()
        await wait_until(lambda: len(self.kubelet.endpoints) == 5
                         and len(self.kubelet.devices) == 5)
        return self.agent

    async def restart_agent(self) -> Agent:
        assert self.agent is not None
        await self.agent.stop()
        self.agent = build_agent(self.config(), self.nvml, self.kube, self.slices)
        await self.agent.start()
        return self.agent

    async def close(self) -> None:
        if self.agent is not None:
            await self.agent.stop()
        await self.kubelet.stop()

    def counts(self) -> dict[str, int]:
        return {r: self.kubelet.count(r) for r in names.ALL_GPU_RESOURCES}


# --- fixtures (imported by the test modules: tests/conftest.py belongs to the core suite) ---

@pytest.fixture
def short_dir():
    """Unix socket paths must stay under ~100 characters: a short directory under /tmp."""
    d = tempfile.mkdtemp(prefix="sg-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


MPS_STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standins",
                           "nvidia-cuda-mps-control")


@pytest.fixture
async def mps_daemon(short_dir):
    """The stand-in MPS control daemon answering on the harness's pipe directory."""
    pipe = f"{short_dir}/mps"
    p = subprocess.Popen([MPS_STANDIN, "-f"],
                         env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe))
    try:
        await wait_until(lambda: os.path.exists(f"{pipe}/control"))
        yield pipe
    finally:
        p.kill()
        p.wait()


@pytest.fixture
async def harness(short_dir):
    made: list[Harness] = []

    async def make(gpus=(("Tesla-T4", 15), ("Tesla-V100-SXM2-32GB", 32)), mode="default", **cfg):  # type: ignore[no-untyped-def]
        h = Harness(short_dir, list(gpus), mode, **cfg)
        made.append(h)
        await h.start()
        return h

    yield make
    for h in made:
        await h.close()
