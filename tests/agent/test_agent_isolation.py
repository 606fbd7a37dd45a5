"""Isolation fails closed: the back-end checks (HAMi-core library, MPS daemon) with their exact
errors, the agent refusing Allocate with them (gRPC error, pod Event, metric, node condition,
shared resources withheld) and coming back when the back-end does, the explicit opt-outs, the
MPS daemon's supervisor, and the cGPU compute policies."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from agent_helpers import NODE, harness, make_pod, short_dir  # noqa: F401
from agent_kubelet import wait_until

from sharegpu.agent.isolation import (
    HAMI_CONTAINER_LIBRARY,
    Backend,
    ComputePolicy,
    IsolationConfig,
    compute_cap,
    isolation_env,
    parse_policy,
)
from sharegpu.agent.metrics import render
from sharegpu.agent.mps import MpsConfig, MpsSupervisor, read_state
from sharegpu.agent.readiness import (
    HAMI_FIX,
    check_hami,
    check_mps,
    elf_problem,
    write_preload_list,
)
from sharegpu.core import names
from sharegpu.core.errors import ValidationError

HERE = Path(__file__).resolve().parent
MPS_STANDIN = str(HERE / "standins" / "nvidia-cuda-mps-control")
GPUS = (("Tesla-T4", 15), ("Tesla-V100-SXM2-32GB", 32))


def cc() -> str:
    found = shutil.which("gcc") or shutil.which("cc")
    assert found, "a C compiler is needed to build the stand-in libraries"
    return found


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, str]:
    """Shared objects built from a few lines of our own C: a loadable one, one whose
    dependency is gone (like HAMi-core without libcuda.so.1), and patched copies that are not a
    shared object or are built for another architecture."""
    d = tmp_path_factory.mktemp("libs")
    (d / "ok.c").write_text("int sharegpu_standin_loaded(void) { return 1; }\n"
                            "int cuMemAlloc_v2(void *p, unsigned long n) { return 3; }\n"
                            "int cuMemGetInfo_v2(void *f, void *t) { return 3; }\n")
    # a library that loads but hides its hooks (a build with -fvisibility=hidden), and one that
    # only reaches them through a library it depends on (the driver)
    (d / "hidden.c").write_text(
        "__attribute__((visibility(\"hidden\"))) int cuMemAlloc_v2(void) { return 3; }\n"
        "int cuMemGetInfo_v2(void *f, void *t) { return 3; }\n")
    (d / "driver.c").write_text("int cuMemAlloc_v2(void) { return 0; }\n"
                                "int cuMemGetInfo_v2(void) { return 0; }\n")
    (d / "through.c").write_text("int cuMemAlloc_v2(void);\n"
                                 "int f(void) { return cuMemAlloc_v2(); }\n")
    (d / "dep.c").write_text("int sharegpu_dep(void) { return 2; }\n")
    (d / "needs.c").write_text("int sharegpu_dep(void);\nint f(void) { return sharegpu_dep(); }\n")
    run = lambda *a: subprocess.run([cc(), *a], check=True, cwd=d)  # noqa: E731
    run("-shared", "-fPIC", "-o", "libvgpu.so", "ok.c")
    run("-shared", "-fPIC", "-o", "libsharegpu-gone.so", "dep.c")
    run("-shared", "-fPIC", "-o", "needs-gone.so", "needs.c", "-L.", "-l:libsharegpu-gone.so")
    run("-shared", "-fPIC", "-o", "hidden.so", "hidden.c")
    run("-shared", "-fPIC", "-o", "libsharegpu-driver.so", "driver.c")
    run("-shared", "-fPIC", "-Wl,-rpath," + str(d), "-o", "through.so", "through.c", "-L.",
        "-l:libsharegpu-driver.so")
    (d / "libsharegpu-gone.so").unlink()
    raw = (d / "libvgpu.so").read_bytes()
    (d / "arm64.so").write_bytes(raw[:18] + struct.pack("<H", 183) + raw[20:])
    (d / "exec.so").write_bytes(raw[:16] + struct.pack("<H", 2) + raw[18:])
    (d / "text.so").write_text("not a library\n")
    return {k: str(d / f) for k, f in (("ok", "libvgpu.so"), ("gone", "needs-gone.so"),
                                          ("arm64", "arm64.so"), ("exec", "exec.so"),
                                          ("text", "text.so"), ("hidden", "hidden.so"),
                                          ("through", "through.so"))} | {"dir": str(d)}


# --- the checks, with their exact reasons ----------------------------------------------------

def test_hami_library_checks_name_what_is_wrong(libs, tmp_path):
    assert check_hami(libs["ok"]).ready
    missing = str(tmp_path / "nope" / "libvgpu.so")
    r = check_hami(missing)
    assert not r.ready and r.reason == f"the HAMi-core library {missing} does not exist"
    assert r.fix == HAMI_FIX and "agent.hami.install" in r.fix and "CGPU_DISABLE" in r.fix
    assert check_hami(str(tmp_path)).reason == (
        f"the HAMi-core library {tmp_path} is a directory, not a file")
    assert check_hami(libs["text"]).reason == f"{libs['text']} is not an ELF file"
    assert check_hami(libs["exec"]).reason == (
        f"{libs['exec']} is not an ELF shared object (e_type 2, a library has 3)")
    assert check_hami(libs["arm64"], machine=62).reason == (
        f"{libs['arm64']} is built for aarch64, but this node is x86_64")
    r = check_hami(libs["gone"])
    assert not r.ready and r.reason.startswith(f"{libs['gone']} cannot be loaded: ")
    assert "libsharegpu-gone.so: cannot open shared object file" in r.reason
    # loads, but its hooks are not its own exported symbols: it would limit nothing
    assert check_hami(libs["hidden"]).reason == (
        f"{libs['hidden']} loads but does not export HAMi-core's CUDA hooks (cuMemAlloc_v2): "
        "built with hidden symbols it would limit nothing; use the libvgpu.so HAMi's image "
        "ships (built by HAMi-core's build.sh)")
    assert "(cuMemAlloc_v2, cuMemGetInfo_v2)" in check_hami(libs["through"]).reason
    # the message the kubelet, the Event and the node condition carry
    assert r.message("n1") == (f"node n1: isolation back-end hami is not usable: {r.reason}; "
                               f"fix: {HAMI_FIX}")


def test_elf_check_on_the_machine_itself(libs):
    assert elf_problem(libs["ok"]) is None  # built here, for here
    assert elf_problem(sys.executable) is not None or True  # an executable may be PIE (ET_DYN)


async def test_mps_check_asks_the_daemon(tmp_path):
    pipe = str(tmp_path / "pipe")
    r = check_mps(pipe, (MPS_STANDIN,))
    assert r.reason == f"the MPS pipe directory {pipe} does not exist"
    os.makedirs(pipe)
    r = check_mps(pipe, (MPS_STANDIN,))
    assert r.reason == (f"the MPS control daemon does not answer on {pipe} "
                        "(Cannot find MPS control daemon process)")
    assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in r.fix
    r = check_mps(pipe, ("/nonexistent/nvidia-cuda-mps-control",))
    assert r.reason == "/nonexistent/nvidia-cuda-mps-control is not installed where the agent runs"
    daemon = subprocess.Popen([MPS_STANDIN, "-f"], env=dict(os.environ,
                                                           CUDA_MPS_PIPE_DIRECTORY=pipe))
    try:
        await wait_until(lambda: os.path.exists(os.path.join(pipe, "control")))
        assert check_mps(pipe, (MPS_STANDIN,)).ready
    finally:
        daemon.kill()
        daemon.wait()


# --- the agent fails closed ------------------------------------------------------------------

def iso_config(base: str, library: str) -> IsolationConfig:
    return IsolationConfig(hami_library=library, hami_cache_dir=f"{base}/cache",
                           hami_lock_dir=f"{base}/lock", mps_pipe_dir=f"{base}/mps",
                           mps_shm_dir=f"{base}/mps-shm")


async def allocate_error(h, ids) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.kubelet.allocate(names.RES_GPU_MEM, ids)
    return e.value


def condition(h) -> dict:  # type: ignore[no-untyped-def]
    (c,) = [c for c in h.kube.nodes[NODE]["status"]["conditions"]
            if c["type"] == "GPUIsolationReady"]
    return c


async def test_no_library_refuses_with_the_reason_then_recovers(harness, short_dir, libs):
    lib = f"{short_dir}/vgpu/libvgpu.so"
    h = await harness(GPUS, mode="cgpu", isolation_paths=iso_config(short_dir, lib),
                      isolation_check_s=0.1)
    a = h.agent
    expected = (f"node {NODE}: isolation back-end hami is not usable: the HAMi-core library "
                f"{lib} does not exist; fix: {HAMI_FIX}")
    # the node tells the scheduler: shared resources withheld (unhealthy), condition False
    assert h.kubelet.healthy(names.RES_GPU_MEM) == [] and h.kubelet.count(names.RES_GPU_MEM) == 47
    assert condition(h)["status"] == "False" and condition(h)["message"] == expected
    assert 'sharegpu_agent_isolation_ready{backend="hami"} 0' in render(a)
    # a container that needs isolation is refused with the reason; its pod gets an Event
    h.kube.add_pod(make_pod("p1", [{"mem": 3}], alloc={0: {1: 3}}))
    ids = [f"{a.gpus[1].uuid}-_-{j}" for j in range(3)]
    err = await allocate_error(h, ids)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and err.details() == expected
    (ev,) = h.kube.events
    assert ev["reason"] == "GPUIsolationUnavailable" and ev["type"] == "Warning"
    assert ev["involvedObject"]["name"] == "p1" and ev["message"] == expected
    assert a.isolation_refusals == 1
    # nothing was handed out: once the library is there, the same pod gets its GPU, isolated
    os.makedirs(os.path.dirname(lib))
    shutil.copy(libs["ok"], lib)
    await wait_until(lambda: len(h.kubelet.healthy(names.RES_GPU_MEM)) == 47)
    assert condition(h)["status"] == "True"
    assert 'sharegpu_agent_isolation_ready{backend="hami"} 1' in render(a)
    resp = await h.kubelet.allocate(names.RES_GPU_MEM, ids)
    assert resp.envs["LD_PRELOAD"] == HAMI_CONTAINER_LIBRARY
    assert resp.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3072m"
    # HAMi-core's writable host directories exist before the container starts, open to a
    # container running as any user: the pod's own cache 0777, the node's lock directory 1777
    host = {m.container_path: m.host_path for m in resp.mounts}
    assert host["/tmp/sharegpu-vgpu"].startswith(f"{short_dir}/cache/")
    assert os.stat(host["/tmp/sharegpu-vgpu"]).st_mode & 0o7777 == 0o777
    assert os.stat(host["/tmp/vgpulock"]).st_mode & 0o7777 == 0o1777
    assert os.path.basename(host["/tmp/vgpulock"]).startswith("gpu-")  # one per GPU set
    assert {m.container_path for m in resp.mounts} >= {HAMI_CONTAINER_LIBRARY, "/tmp/vgpulock"}
    # the host's library, where HAMi-core looks for its own hooks in the container
    assert [m.host_path for m in resp.mounts if m.container_path == HAMI_CONTAINER_LIBRARY] \
        == [lib]
    # and the loader's own preload list, which the pod's LD_PRELOAD cannot replace
    preload = [m for m in resp.mounts if m.container_path == "/etc/ld.so.preload"]
    assert len(preload) == 1 and preload[0].read_only
    assert preload[0].host_path == f"{h.agent.config.state_dir}/ld.so.preload"
    assert Path(preload[0].host_path).read_text() == "/usr/local/vgpu/libvgpu.so\n"


def test_preload_list_written_once_and_refused_when_it_cannot_be(tmp_path):
    path = tmp_path / "state" / "ld.so.preload"
    assert write_preload_list(str(path)) is None
    assert path.read_text() == "/usr/local/vgpu/libvgpu.so\n"
    inode = path.stat().st_ino
    assert write_preload_list(str(path)) is None and path.stat().st_ino == inode  # unchanged
    path.write_text("/somewhere/else.so\n")
    assert write_preload_list(str(path)) is None
    assert path.read_text() == "/usr/local/vgpu/libvgpu.so\n"
    # a directory where the file belongs (what a runtime makes for a missing mount source)
    d = tmp_path / "dir" / "ld.so.preload"
    d.mkdir(parents=True)
    assert write_preload_list(str(d)) == (
        f"the preload list {d} is a directory (a container runtime makes one when a mount's "
        "source is missing): remove it")


async def test_agent_refuses_when_its_preload_list_cannot_be_written(harness, short_dir, libs):
    """Without the preload list a pod's own LD_PRELOAD would switch isolation off: refused."""
    h = await harness(GPUS, mode="cgpu", isolation_paths=iso_config(short_dir, libs["ok"]),
                      isolation_check_s=0.1)
    assert h.agent.readiness.ready
    preload = f"{h.agent.config.state_dir}/ld.so.preload"
    os.unlink(preload)
    os.makedirs(preload)
    await wait_until(lambda: not h.agent.readiness.ready)
    assert h.agent.readiness.reason.startswith(f"the preload list {preload} is a directory")
    assert h.agent.config.state_dir in h.agent.readiness.fix
    h.kube.add_pod(make_pod("p1", [{"mem": 1}], alloc={0: {0: 1}}))
    err = await allocate_error(h, [f"{h.agent.gpus[0].uuid}-_-0"])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    os.rmdir(preload)
    await wait_until(lambda: h.agent.readiness.ready)  # written again, recovered


@pytest.mark.parametrize("kind", ["arm64", "gone", "exec"])
async def test_unusable_library_refuses(harness, short_dir, libs, kind):
    h = await harness(GPUS, mode="core_mem", isolation_paths=iso_config(short_dir, libs[kind]))
    h.kube.add_pod(make_pod("p1", [{"mem": 2, "core": 30}], alloc={0: {0: 2}},
                            core={0: {0: 30}}))
    err = await allocate_error(h, [f"{h.agent.gpus[0].uuid}-_-{j}" for j in range(2)])
    assert err.details() == h.agent.readiness.message(NODE)
    assert libs[kind] in err.details() and "is not usable" in err.details()


async def test_explicit_opt_outs_run_without_isolation(harness, short_dir):
    lib = f"{short_dir}/missing/libvgpu.so"
    h = await harness(GPUS, mode="cgpu", isolation_paths=iso_config(short_dir, lib))
    uuid = h.agent.gpus[0].uuid
    # CGPU_DISABLE=true on the container
    h.kube.add_pod(make_pod("free", [{"mem": 2}], alloc={0: {0: 2}},
                            env={0: {"CGPU_DISABLE": "true"}}))
    resp = await h.kubelet.allocate(names.RES_GPU_MEM, [f"{uuid}-_-0", f"{uuid}-_-1"])
    assert "LD_PRELOAD" not in resp.envs and resp.envs["NVIDIA_VISIBLE_DEVICES"] == uuid
    # the node label cgpu.disable.isolation=true
    h.kube.set_node_labels(NODE, {names.LABEL_DISABLE_ISOLATION: "true"})
    await wait_until(lambda: h.agent.labels.get(names.LABEL_DISABLE_ISOLATION) == "true")
    h.kube.add_pod(make_pod("p2", [{"mem": 1}], alloc={0: {0: 1}}))
    resp = await h.kubelet.allocate(names.RES_GPU_MEM, [f"{uuid}-_-2"])
    assert "LD_PRELOAD" not in resp.envs


async def test_isolation_none_is_explicit_and_never_refuses(harness, short_dir):
    h = await harness(GPUS, mode="cgpu", isolation="none",
                      isolation_paths=iso_config(short_dir, f"{short_dir}/missing.so"))
    assert h.agent.readiness.ready and condition(h)["reason"] == "NotIsolated"
    assert len(h.kubelet.healthy(names.RES_GPU_MEM)) == 47


async def test_installed_pointer_is_followed(harness, short_dir, libs):
    """The chart's init container records the versioned library in a file; the agent hands
    out what that file names, and refuses while it is missing."""
    pointer = f"{short_dir}/installed"
    h = await harness(GPUS, mode="cgpu", hami_installed=pointer, isolation_check_s=0.1,
                      isolation_paths=iso_config(short_dir, "/usr/local/vgpu/libvgpu.so"))
    assert h.agent.readiness.reason == (
        f"the HAMi-core library was not installed: {pointer} (written by the chart's "
        "hami-install init container) does not exist")
    versioned = f"{short_dir}/hami-v2.10.0-0123456789abcdef/libvgpu.so"
    os.makedirs(os.path.dirname(versioned))
    shutil.copy(libs["ok"], versioned)
    Path(pointer).write_text(versioned + "\n")
    await wait_until(lambda: h.agent.readiness.ready)
    h.kube.add_pod(make_pod("p1", [{"mem": 1}], alloc={0: {0: 1}}))
    resp = await h.kubelet.allocate(names.RES_GPU_MEM, [f"{h.agent.gpus[0].uuid}-_-0"])
    assert resp.envs["LD_PRELOAD"] == HAMI_CONTAINER_LIBRARY
    assert [m.host_path for m in resp.mounts if m.container_path == HAMI_CONTAINER_LIBRARY] \
        == [versioned]


# --- MPS: the daemon supervised, the agent following it --------------------------------------

async def test_mps_daemon_supervised_and_agent_follows(harness, short_dir):
    base = short_dir
    cfg = iso_config(base, f"{base}/unused.so")
    h = await harness(GPUS, mode="mps", isolation_paths=cfg, mps_control=(MPS_STANDIN,),
                      isolation_check_s=0.1)
    a = h.agent
    assert not a.readiness.ready and "does not exist" in a.readiness.reason
    h.kube.add_pod(make_pod("p1", [{"mem": 4}], alloc={0: {1: 4}}))
    ids = [f"{a.gpus[1].uuid}-_-{j}" for j in range(4)]
    err = await allocate_error(h, ids)
    assert err.details().startswith(f"node {NODE}: isolation back-end mps is not usable: ")

    sup = MpsSupervisor(MpsConfig(state_dir=f"{base}/state", pipe_dir=cfg.mps_pipe_dir,
                                  log_dir=f"{base}/mps-log", shm_dir=cfg.mps_shm_dir,
                                  control=(MPS_STANDIN,), poll_s=0.05,
                                  default_active_thread_percentage=100))
    task = asyncio.create_task(sup.run())
    try:
        # the agent's current-mode file says mps: the daemon starts, with its defaults set
        await wait_until(lambda: sup.state == "running")
        defaults = Path(cfg.mps_pipe_dir, "defaults.txt").read_text()
        assert "set_default_active_thread_percentage 100" in defaults
        await wait_until(lambda: a.readiness.ready)
        resp = await h.kubelet.allocate(names.RES_GPU_MEM, ids)
        assert resp.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        mounts = {m.container_path: m.host_path for m in resp.mounts}
        assert mounts["/tmp/nvidia-mps"] == cfg.mps_pipe_dir
        assert mounts["/dev/shm"] == cfg.mps_shm_dir
        # the daemon dies: the agent notices, the supervisor restarts it, the agent recovers
        first = sup.proc
        assert first is not None
        first.kill()
        await wait_until(lambda: not a.readiness.ready, timeout=5)
        await wait_until(lambda: sup.state == "running" and sup.proc is not first, timeout=10)
        await wait_until(lambda: a.readiness.ready, timeout=5)
        assert sup.restarts == 1 and read_state(f"{base}/state")["restarts"] == 1
        assert "sharegpu_agent_mps_daemon_up 1" in render(a)
        # the node leaves mps mode: the daemon is asked to quit
        h.kube.set_node_labels(NODE, {names.LABEL_SCHEDULE: "cgpu"})
        await wait_until(lambda: sup.state == "stopped", timeout=5)
        assert not os.path.exists(os.path.join(cfg.mps_pipe_dir, "control"))
    finally:
        sup.shutdown()
        await asyncio.wait_for(task, 10)


# --- compute policies ------------------------------------------------------------------------

def test_compute_policies():
    assert parse_policy("5") is ComputePolicy.NATIVE and parse_policy(3) is ComputePolicy.FIXED
    for bad in ("0", "1", "2", "4"):
        with pytest.raises(ValidationError, match="cannot be honoured by the hami and mps"):
            parse_policy(bad)
    with pytest.raises(ValidationError, match="cannot be honoured by the mps back-end"):
        parse_policy("1", "mps")
    assert parse_policy("1", "none") is ComputePolicy.PREEMPTIVE  # nothing to honour it with
    with pytest.raises(ValidationError, match="must be one of 0, 1, 2, 3, 4, 5"):
        parse_policy("7")
    # native: only what the container asked is capped
    assert compute_cap(ComputePolicy.NATIVE, mem={0: 4}, core={}, gpu_mem={0: 16}) is None
    assert compute_cap(ComputePolicy.NATIVE, mem={0: 4}, core={0: 30}) == 30
    # fixed share: a memory-only container is capped at its share of the GPU's memory
    assert compute_cap(ComputePolicy.FIXED, mem={0: 4}, core={}, gpu_mem={0: 16}) == 25
    assert compute_cap(ComputePolicy.FIXED, mem={0: 5}, core={}, gpu_mem={0: 15}) == 34
    assert compute_cap(ComputePolicy.FIXED, mem={0: 2, 1: 8}, core={},
                       gpu_mem={0: 16, 1: 16}) == 13
    fixed = IsolationConfig(compute_policy=ComputePolicy.FIXED)
    env = isolation_env(Backend.HAMI, mem={0: 4}, core={}, pod_uid="u", config=fixed,
                        gpu_mem={0: 16}).envs
    assert env["CUDA_DEVICE_SM_LIMIT"] == "25" and env["GPU_CORE_UTILIZATION_POLICY"] == "force"
    env = isolation_env(Backend.HAMI, mem={0: 4}, core={}, pod_uid="u",
                        config=IsolationConfig(), gpu_mem={0: 16}).envs
    assert "CUDA_DEVICE_SM_LIMIT" not in env and env["GPU_CORE_UTILIZATION_POLICY"] == "disable"
    env = isolation_env(Backend.MPS, mem={0: 4}, core={}, pod_uid="u", config=fixed,
                        gpu_mem={0: 16}).envs
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_agent_refuses_to_start_with_a_policy_no_backend_honours(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "sharegpu.cli", "agent", "--node-name", "n", "--nvml", "fake",
         "--standalone", "--compute-policy", "2", "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--compute-policy='2': policy 2 (weighted preemptive) cannot be honoured" in r.stderr


def test_hami_lock_directory_is_shared_only_on_the_same_gpus():
    """HAMi-core takes a lock in /tmp/vgpulock while a starting process finds its host PID
    (a diff of NVML's process list): containers on the same GPUs share it, so that diff stays
    serialised where it matters, and a tenant holding it stalls no container on other GPUs."""
    from sharegpu.agent.isolation import IsolationConfig, isolation_env

    cfg = IsolationConfig(hami_library="/h/libvgpu.so", hami_lock_dir="/h/lock")

    def lock(mem: dict[int, int], uid: str) -> str:
        ce = isolation_env(Backend.HAMI, mem=mem, core={}, pod_uid=uid, config=cfg)
        (path,) = [m.host_path for m in ce.mounts if m.container_path == "/tmp/vgpulock"]
        return path

    assert lock({0: 2}, "a") == lock({0: 4}, "b") == "/h/lock/gpu-0"
    assert lock({1: 2}, "c") == "/h/lock/gpu-1"
    assert lock({1: 2, 0: 2}, "d") == "/h/lock/gpu-0-1"
