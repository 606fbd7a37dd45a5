"""The hami-mps back-end (core_mem's opt-in): what a container gets through the device plugins'
Allocate and through DRA's CDI edits (HAMi-core's container-wide memory limit and preload, MPS's
compute share, pipe directory and shared memory), every refusal with the part that is missing and
its fix, and the MPS daemon's supervisor following the agent's back-end. Stand-ins: a loadable
library for HAMi-core and the stand-in nvidia-cuda-mps-control."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import grpc
import pytest
from agent_helpers import (  # noqa: F401
    MPS_STANDIN,
    NODE,
    harness,
    make_pod,
    mps_daemon,
    short_dir,
    standin_library,
)
from agent_kubelet import wait_until
from test_agent_dra import DRIVER, claim, make_dra, result  # noqa: F401

from sharegpu.agent.allocate import ANN_GRANT
from sharegpu.agent.isolation import (
    HAMI_CONTAINER_LIBRARY,
    PRELOAD_LIST,
    Backend,
    ComputePolicy,
    IsolationConfig,
    backend_for,
    isolation_env,
    other_user,
    overridden_limits,
    own_limit_routes,
    parse_core_mem,
    parse_policy,
)
from sharegpu.agent.mps import CURRENT_BACKEND_FILE, MpsConfig, MpsSupervisor
from sharegpu.agent.readiness import HAMI_FIX, MPS_FIX, Readiness, check_hami_mps
from sharegpu.core import names
from sharegpu.core.errors import ValidationError
from sharegpu.core.modes import Mode

GPUS = (("Tesla-T4", 15), ("Tesla-V100-SXM2-32GB", 32))
HAMI_MPS = {"core_mem_isolation": Backend.HAMI_MPS, "mps_control": (MPS_STANDIN,)}


def paths(base: str, library: str) -> IsolationConfig:
    return IsolationConfig(hami_library=library, hami_cache_dir=f"{base}/vgpu-cache",
                           hami_lock_dir=f"{base}/vgpulock", mps_pipe_dir=f"{base}/mps",
                           mps_shm_dir=f"{base}/mps-shm")


def core_ids(h, gpu: int, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    ids = [i for i, _ in h.kubelet.devices[names.RES_GPU_CORE] if h.agent.devices.gpu_of(i) == gpu]
    return ids[:n]


def mem_ids(h, gpu: int, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    return [f"{h.agent.gpus[gpu].uuid}-_-{j}" for j in range(n)]


# --- what a container gets -------------------------------------------------------------------

def test_env_holds_memory_per_container_and_compute_through_mps():
    cfg = paths("/h", "/h/libvgpu.so")
    ce = isolation_env(Backend.HAMI_MPS, mem={3: 4, 1: 2}, core={1: 30, 3: 30}, pod_uid="u",
                       config=cfg)
    assert ce.envs == {
        # HAMi-core: the container-wide memory limit, its launch throttle off
        "LD_PRELOAD": HAMI_CONTAINER_LIBRARY,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "2048m",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "4096m",
        "GPU_CORE_UTILIZATION_POLICY": "disable",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/sharegpu-vgpu/u.cache",
        # MPS: the client's share of the SMs, its pipe directory, each process's own limit
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M,1=4096M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
    }
    assert "CUDA_DEVICE_SM_LIMIT" not in ce.envs
    mounts = {m.container_path: (m.host_path, m.read_only) for m in ce.mounts}
    assert mounts == {
        HAMI_CONTAINER_LIBRARY: ("/h/libvgpu.so", True),
        PRELOAD_LIST: ("/var/lib/sharegpu/ld.so.preload", True),
        "/tmp/sharegpu-vgpu": ("/h/vgpu-cache/u", False),
        "/tmp/vgpulock": ("/h/vgpulock/gpu-1-3", False),
        "/tmp/nvidia-mps": ("/h/mps", False),
        "/dev/shm": ("/h/mps-shm", False),
    }
    # a container that asked no compute is still an MPS client (all the SMs), memory-limited
    ce = isolation_env(Backend.HAMI_MPS, mem={0: 4}, core={}, pod_uid="u", config=cfg)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in ce.envs
    assert ce.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert ce.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
    # fixed share: capped at its share of the GPU's memory, by MPS
    fixed = IsolationConfig(compute_policy=ComputePolicy.FIXED)
    env = isolation_env(Backend.HAMI_MPS, mem={0: 4}, core={}, pod_uid="u", config=fixed,
                        gpu_mem={0: 16}).envs
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["GPU_CORE_UTILIZATION_POLICY"] == "disable" and "CUDA_DEVICE_SM_LIMIT" not in env


def test_backend_choice_is_opt_in_for_core_mem():
    assert backend_for("auto", Mode.CORE_MEM) is Backend.HAMI  # the default, until measured
    assert backend_for("auto", Mode.CORE_MEM, Backend.HAMI_MPS) is Backend.HAMI_MPS
    assert backend_for("auto", Mode.CGPU, Backend.HAMI_MPS) is Backend.HAMI
    assert backend_for("auto", Mode.MPS, Backend.HAMI_MPS) is Backend.MPS
    assert backend_for("hami-mps", Mode.CGPU) is Backend.HAMI_MPS
    assert parse_core_mem("hami-mps") is Backend.HAMI_MPS
    with pytest.raises(ValidationError, match=r"--core-mem-isolation.*must be hami or hami-mps"):
        parse_core_mem("mps")
    with pytest.raises(ValidationError, match=r"must be auto, hami, mps, hami-mps or none"):
        backend_for("kvm", Mode.CORE_MEM)
    with pytest.raises(ValidationError, match="cannot be honoured by the hami-mps back-end"):
        parse_policy("4", "hami-mps")
    with pytest.raises(ValidationError, match="by the hami, mps and hami-mps back-end"):
        parse_policy("0", "auto", Backend.HAMI_MPS)
    assert parse_policy("3", "hami-mps") is ComputePolicy.FIXED


def test_a_container_setting_the_limits_itself_is_named():
    spec = {"env": [{"name": "LD_PRELOAD", "value": "/usr/lib/libjemalloc.so"},
                    {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100"},
                    {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "80g"},
                    {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/elsewhere"}]}
    assert overridden_limits(Backend.HAMI_MPS, spec) == [
        "CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PIPE_DIRECTORY"]
    assert overridden_limits(Backend.HAMI, spec) == ["CUDA_DEVICE_MEMORY_LIMIT_0"]
    assert overridden_limits(Backend.MPS, spec) == ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                                                    "CUDA_MPS_PIPE_DIRECTORY"]
    assert overridden_limits(Backend.NONE, spec) == []
    # LD_PRELOAD is no limit variable; own_limit_routes refuses it (below)
    assert overridden_limits(Backend.HAMI_MPS, {"env": spec["env"][:1]}) == []


def test_every_route_to_its_own_limits_is_named():
    """Issue 40, attack 5: env, envFrom (ConfigMap or Secret, with or without a prefix that
    could begin a limit variable), LD_PRELOAD, and mounts over the back-end's paths."""
    cfg = IsolationConfig()
    spec = {
        "env": [{"name": "LD_PRELOAD", "value": "/x.so"}, {"name": "HOME", "value": "/"}],
        "envFrom": [{"configMapRef": {"name": "app"}},
                    {"secretRef": {"name": "s"}, "prefix": "CUDA_MPS_"},
                    {"configMapRef": {"name": "safe"}, "prefix": "APP_"},
                    {"configMapRef": {"name": "c"}, "prefix": "CUDA_"},
                    {"secretRef": {"name": "l"}, "prefix": "LD_"}],
        "volumeMounts": [{"name": "v", "mountPath": "/etc/ld.so.preload"},
                         {"name": "t", "mountPath": "/tmp"},
                         {"name": "p", "mountPath": "/tmp/nvidia-mps/control"},
                         {"name": "l", "mountPath": "/usr/local/vgpu//libvgpu.so/"},
                         {"name": "e", "mountPath": "/etc"}],
    }
    assert own_limit_routes(Backend.HAMI, spec, cfg) == [
        "env LD_PRELOAD",
        "envFrom[0] (configMapRef app, no prefix: its keys are not known to the agent)",
        "envFrom[3] (configMapRef c, prefix 'CUDA_': its keys are not known to the agent)",
        "envFrom[4] (secretRef l, prefix 'LD_': its keys are not known to the agent)",
        "volumeMounts[0] at /etc/ld.so.preload (over /etc/ld.so.preload)",
        "volumeMounts[3] at /usr/local/vgpu//libvgpu.so/ (over /usr/local/vgpu/libvgpu.so)"]
    mps = own_limit_routes(Backend.MPS, spec, cfg)
    assert "envFrom[1] (secretRef s, prefix 'CUDA_MPS_': its keys are not known to the agent)" \
        in mps
    assert "volumeMounts[2] at /tmp/nvidia-mps/control (over /tmp/nvidia-mps)" in mps
    assert not any("/etc/ld.so.preload" in r for r in mps)  # MPS alone preloads nothing
    # a parent directory is fine: the runtime mounts the deeper path on top
    assert not any(r.startswith(("volumeMounts[1]", "volumeMounts[4]")) for r in mps)
    assert own_limit_routes(Backend.NONE, spec, cfg) == []
    assert own_limit_routes(Backend.HAMI, {"envFrom": [{"configMapRef": {"name": "a"},
                                                        "prefix": "APP_"}]}, cfg) == []


def test_a_container_of_another_user_than_the_mps_daemons_is_named():
    assert other_user({}, {}, 0) is None  # the image's own USER: not known here
    assert other_user({}, {"securityContext": {"runAsUser": 1000}}, 0) == "runs as UID 1000"
    # the container's own setting wins over the pod's
    assert other_user({"securityContext": {"runAsUser": 0}},
                      {"securityContext": {"runAsUser": 1000}}, 0) is None
    assert other_user({"securityContext": {"runAsNonRoot": True}}, {}, 0) == \
        "must run as a non-root user (runAsNonRoot)"
    assert other_user({"securityContext": {"runAsUser": 1000, "runAsNonRoot": True}}, {},
                      1000) is None
    assert other_user({"securityContext": {"runAsUser": "x"}}, {}, 0) == "runs as runAsUser 'x'"


def test_readiness_names_the_missing_part_and_its_fix(tmp_path):
    pipe = str(tmp_path / "mps")
    lib = Readiness(Backend.HAMI, False, "the HAMi-core library /x/libvgpu.so does not exist",
                    HAMI_FIX)
    r = check_hami_mps(lib, pipe, (MPS_STANDIN,))
    assert (r.backend, r.ready, r.fix) == (Backend.HAMI_MPS, False, HAMI_FIX)
    assert r.message(NODE) == (
        f"node {NODE}: isolation back-end hami-mps is not usable: memory limit (HAMi-core): "
        f"the HAMi-core library /x/libvgpu.so does not exist; fix: {HAMI_FIX}")
    r = check_hami_mps(Readiness(Backend.HAMI, True), pipe, (MPS_STANDIN,))
    assert r.message(NODE) == (
        f"node {NODE}: isolation back-end hami-mps is not usable: compute limit (MPS): the MPS "
        f"pipe directory {pipe} does not exist; fix: {MPS_FIX.format(pipe=pipe)}")
    assert "mps and hami-mps nodes" in r.fix
    os.makedirs(pipe)
    r = check_hami_mps(Readiness(Backend.HAMI, True), pipe, (MPS_STANDIN,))
    assert not r.ready and r.reason.startswith(
        f"compute limit (MPS): the MPS control daemon does not answer on {pipe} (")


# --- device plugins: Allocate ----------------------------------------------------------------

async def allocate_error(h, resource: str, ids) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.kubelet.allocate(resource, ids)
    return e.value


async def test_allocate_refuses_until_both_parts_are_there(harness, short_dir):
    lib = f"{short_dir}/hami/libvgpu.so"
    h = await harness(GPUS, mode="core_mem", isolation_paths=paths(short_dir, lib),
                      isolation_check_s=0.1, **HAMI_MPS)
    a = h.agent
    assert a.backend is Backend.HAMI_MPS
    h.kube.add_pod(make_pod("p", [{"mem": 4, "core": 30}], alloc={0: {1: 4}}, core={0: {1: 30}}))
    # no library: refused for memory and for compute, naming the back-end, the part and the fix
    no_lib = (f"node {NODE}: isolation back-end hami-mps is not usable: memory limit "
              f"(HAMi-core): the HAMi-core library {lib} does not exist; fix: {HAMI_FIX}")
    err = await allocate_error(h, names.RES_GPU_MEM, mem_ids(h, 1, 4))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and err.details() == no_lib
    err = await allocate_error(h, names.RES_GPU_CORE, core_ids(h, 1, 30))
    assert err.details() == no_lib
    (c,) = [c for c in h.kube.nodes[NODE]["status"]["conditions"]
            if c["type"] == "GPUIsolationReady"]
    assert c["status"] == "False" and c["message"] == no_lib
    assert [e["reason"] for e in h.kube.events] == ["GPUIsolationUnavailable"] * 2
    # the library arrives, the MPS daemon does not: refused for the daemon
    os.makedirs(os.path.dirname(lib))
    shutil.copy(standin_library(), lib)
    pipe = f"{short_dir}/mps"
    await wait_until(lambda: "compute limit (MPS)" in a.readiness.reason)
    err = await allocate_error(h, names.RES_GPU_MEM, mem_ids(h, 1, 4))
    assert err.details() == (
        f"node {NODE}: isolation back-end hami-mps is not usable: compute limit (MPS): the MPS "
        f"pipe directory {pipe} does not exist; fix: {MPS_FIX.format(pipe=pipe)}")
    assert h.kubelet.healthy(names.RES_GPU_MEM) == []  # withheld while unusable
    assert a.isolation_refusals == 3


async def test_allocate_gives_both_limits(harness, short_dir, mps_daemon):
    h = await harness(GPUS, mode="core_mem", isolation_check_s=0.1, **HAMI_MPS)
    a = h.agent
    await wait_until(lambda: a.readiness.ready)
    assert a.readiness.backend is Backend.HAMI_MPS
    h.kube.add_pod(make_pod("p", [{"mem": 4, "core": 30}], alloc={0: {1: 4}}, core={0: {1: 30}},
                            uid="uid-p"))
    mem = await h.kubelet.allocate(names.RES_GPU_MEM, mem_ids(h, 1, 4))
    core = await h.kubelet.allocate(names.RES_GPU_CORE, core_ids(h, 1, 30))
    assert mem.annotations[ANN_GRANT] == core.annotations[ANN_GRANT] == "default/p/c0"
    env = dict(mem.envs)
    assert env["NVIDIA_VISIBLE_DEVICES"] == a.gpus[1].uuid
    assert env["LD_PRELOAD"] == HAMI_CONTAINER_LIBRARY
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
    assert env["GPU_CORE_UTILIZATION_POLICY"] == "disable" and "CUDA_DEVICE_SM_LIMIT" not in env
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    mounts = {m.container_path: m for m in mem.mounts}
    assert mounts["/tmp/nvidia-mps"].host_path == mps_daemon
    assert mounts["/dev/shm"].host_path == f"{short_dir}/mps-shm"
    assert mounts[PRELOAD_LIST].host_path == f"{short_dir}/state/ld.so.preload"
    assert mounts[PRELOAD_LIST].read_only and mounts[HAMI_CONTAINER_LIBRARY].read_only
    assert Path(f"{short_dir}/state/ld.so.preload").read_text() == HAMI_CONTAINER_LIBRARY + "\n"
    # the compute half repeats only the compute limits, which agree with the memory half's
    assert dict(core.envs) == {"NVIDIA_VISIBLE_DEVICES": a.gpus[1].uuid,
                               "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
                               "GPU_CORE_UTILIZATION_POLICY": "disable"}
    # the daemon goes away: the next container is refused, naming the MPS part
    os.unlink(f"{mps_daemon}/control")
    h.kube.add_pod(make_pod("q", [{"mem": 2, "core": 20}], alloc={0: {0: 2}}, core={0: {0: 20}}))
    await wait_until(lambda: not a.readiness.ready)
    err = await allocate_error(h, names.RES_GPU_MEM, mem_ids(h, 0, 2))
    assert "isolation back-end hami-mps is not usable: compute limit (MPS): the MPS control " \
           "daemon does not answer" in err.details()


async def test_a_container_that_sets_the_limits_itself_is_refused(harness, mps_daemon):
    h = await harness(GPUS, mode="core_mem", isolation_check_s=0.1, **HAMI_MPS)
    await wait_until(lambda: h.agent.readiness.ready)
    h.kube.add_pod(make_pod("own", [{"mem": 4, "core": 30}], alloc={0: {1: 4}},
                            core={0: {1: 30}},
                            env={0: {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
                                     "LD_PRELOAD": "/usr/lib/libjemalloc.so"}}))
    err = await allocate_error(h, names.RES_GPU_MEM, mem_ids(h, 1, 4))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == (
        f"node {NODE}: isolation back-end hami-mps refuses default/own/c0: the container could "
        "set its own limits, replacing those the agent gives it: env "
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; env LD_PRELOAD. Rule: a container under isolation "
        "gets its limits from the agent alone: it may not set the back-end's variables (env, or "
        "envFrom that could hold them), LD_PRELOAD, or mount anything at the back-end's paths; "
        "fix: remove them (its limits come from its gpu-mem and gpu-core.percentage; an "
        "envFrom prefix that cannot begin those variables is fine), or opt it out of isolation "
        "with CGPU_DISABLE=true")
    (ev,) = h.kube.events
    assert ev["reason"] == "GPUIsolationUnavailable" and ev["involvedObject"]["name"] == "own"
    # opted out, it gets only its GPU
    h.kube.add_pod(make_pod("out", [{"mem": 2, "core": 20}], alloc={0: {0: 2}},
                            core={0: {0: 20}}, env={0: {"CGPU_DISABLE": "true",
                                                        "CUDA_MPS_PIPE_DIRECTORY": "/x"}}))
    r = await h.kubelet.allocate(names.RES_GPU_MEM, mem_ids(h, 0, 2))
    assert "LD_PRELOAD" not in r.envs and "CUDA_MPS_PIPE_DIRECTORY" not in r.envs


async def test_a_container_of_another_user_is_refused(harness, mps_daemon):
    h = await harness(GPUS, mode="core_mem", isolation_check_s=0.1, **HAMI_MPS)
    await wait_until(lambda: h.agent.readiness.ready)
    pod = make_pod("u", [{"mem": 4, "core": 30}], alloc={0: {1: 4}}, core={0: {1: 30}})
    pod["spec"]["securityContext"] = {"runAsUser": 1000}
    h.kube.add_pod(pod)
    err = await allocate_error(h, names.RES_GPU_MEM, mem_ids(h, 1, 4))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == (
        f"node {NODE}: isolation back-end hami-mps refuses default/u/c0: the container runs as "
        "UID 1000, but the MPS control daemon serves UID 0 and MPS serves one user at a time: "
        "its CUDA calls would wait until the daemon's server exits; fix: run it as UID 0 "
        "(securityContext.runAsUser), or opt it out of isolation with CGPU_DISABLE=true")
    # as root (the container's own setting), the same pod is served
    pod["spec"]["containers"][0]["securityContext"] = {"runAsUser": 0}
    h.kube.add_pod(pod)
    r = await h.kubelet.allocate(names.RES_GPU_MEM, mem_ids(h, 1, 4))
    assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"


async def test_the_mps_daemon_follows_the_agents_backend(harness, short_dir):
    h = await harness(GPUS, mode="core_mem", isolation_check_s=0.1, **HAMI_MPS)
    a = h.agent
    state = f"{short_dir}/state"
    assert Path(state, CURRENT_BACKEND_FILE).read_text() == "hami-mps\n"
    sup = MpsSupervisor(MpsConfig(state_dir=state, pipe_dir=f"{short_dir}/mps",
                                  log_dir=f"{short_dir}/mps-log", shm_dir=f"{short_dir}/mps-shm",
                                  control=(MPS_STANDIN,), poll_s=0.05))
    task = asyncio.create_task(sup.run())
    try:
        # a core_mem node on hami-mps: the daemon runs, and the agent's back-end becomes usable
        await wait_until(lambda: sup.state == "running")
        await wait_until(lambda: a.readiness.ready, timeout=5)
        assert a.readiness.backend is Backend.HAMI_MPS
        # the node turns cgpu (hami): the daemon is asked to quit
        h.kube.set_node_labels(NODE, {names.LABEL_SCHEDULE: "cgpu"})
        await wait_until(lambda: sup.state == "stopped", timeout=5)
        assert Path(state, CURRENT_BACKEND_FILE).read_text() == "hami\n"
        assert not os.path.exists(f"{short_dir}/mps/control")
    finally:
        sup.shutdown()
        await asyncio.wait_for(task, 10)


# --- DRA: prepare ----------------------------------------------------------------------------

async def test_dra_claims_get_both_limits_as_cdi_edits(make_dra, mps_daemon):
    x = await make_dra(mode="core_mem", **HAMI_MPS)
    c = claim("hm", [result("gpu-2", "6Gi", "30")])
    x.kube.add_claim(c)
    a = (await x.prepare(c))["uid-hm"]
    assert not a.error, a.error
    env, mounts = x.view(a.devices[0].cdi_device_ids)
    assert env["NVIDIA_VISIBLE_DEVICES"] == x.uuid(2)
    assert env["LD_PRELOAD"] == HAMI_CONTAINER_LIBRARY
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "6144m"
    assert env["GPU_CORE_UTILIZATION_POLICY"] == "disable" and "CUDA_DEVICE_SM_LIMIT" not in env
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert mounts["/tmp/nvidia-mps"][0] == mps_daemon
    assert mounts["/dev/shm"][0] == f"{x.h.dir}/mps-shm"
    assert mounts[PRELOAD_LIST][0] == f"{x.h.dir}/state/ld.so.preload"
    assert mounts[HAMI_CONTAINER_LIBRARY][0] == x.h.agent.allocator.isolation.hami_library
    assert mounts["/tmp/sharegpu-vgpu"][0] == f"{x.h.dir}/vgpu-cache/uid-hm"


async def test_dra_prepare_refuses_without_the_mps_daemon(make_dra, short_dir):
    x = await make_dra(mode="core_mem", **HAMI_MPS)
    c = claim("nod", [result("gpu-1", "4Gi", "20")])
    x.kube.add_claim(c)
    refusals = x.h.agent.isolation_refusals
    a = (await x.prepare(c))["uid-nod"]
    pipe = f"{short_dir}/mps"
    assert a.error == (
        f"{DRIVER}: claim default/nod (uid-nod) not prepared: node {NODE}: isolation back-end "
        f"hami-mps is not usable: compute limit (MPS): the MPS pipe directory {pipe} does not "
        f"exist; fix: {MPS_FIX.format(pipe=pipe)}")
    assert x.h.agent.isolation_refusals == refusals + 1
    assert os.listdir(x.config.cdi_dir) == []
