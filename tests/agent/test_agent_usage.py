"""GPU memory in use per container: NVML's processes mapped to pods through their cgroups, on
/metrics beside what each container was allocated; series go with the processes and pods."""

from __future__ import annotations

import asyncio

import pytest
from agent_helpers import NODE, harness, make_pod, short_dir  # noqa: F401

from sharegpu.agent.nvml import FakeNvml, GpuProcess
from sharegpu.agent.usage import ProcCgroups, UsageCollector, attribute, cgroup_ids

UID = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
CID = "7f" * 32
CID2 = "3c" * 32


@pytest.mark.parametrize("text", [
    # cgroup v2, systemd driver, containerd
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
    f"{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
    # cgroup v1, cgroupfs driver (several hierarchies)
    f"12:pids:/kubepods/besteffort/pod{UID}/{CID}\n11:memory:/kubepods/besteffort/pod{UID}/{CID}\n",
    # Guaranteed QoS, CRI-O, systemd
    f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope",
    # nested under a node's own slice (kind, a kubelet in a container), Docker
    f"0::/system.slice/kubelet.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/"
    f"docker-{CID}.scope",
])
def test_cgroup_names_the_pod_and_the_container(text):
    assert cgroup_ids(text) == (UID, CID)


@pytest.mark.parametrize("text", [
    "0::/system.slice/nvidia-persistenced.service\n", "0::/\n", "", "garbage",
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID}.slice\n",
])
def test_a_process_outside_a_container_is_no_ones(text):
    assert cgroup_ids(text) is None


def pod_with(name: str, uid: str, containers: dict[str, str], mem: int = 4) -> dict:
    p = make_pod(name, [{"mem": mem}] * len(containers), uid=uid)
    for spec, cname in zip(p["spec"]["containers"], containers, strict=True):
        spec["name"] = cname
    p["status"] = {"phase": "Running", "containerStatuses": [
        {"name": n, "containerID": f"containerd://{cid}"} for n, cid in containers.items()]}
    return p


def cgroup_text(uid: str, cid: str) -> str:
    return (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{uid.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n")


def test_attribute_sums_per_container_and_gpu():
    pods = [pod_with("train", UID, {"main": CID, "side": CID2}),
            {**pod_with("done", "uid-done", {"x": "ab" * 32}), "status": {"phase": "Succeeded"}}]
    cgroups = {10: cgroup_text(UID, CID), 11: cgroup_text(UID, CID), 12: cgroup_text(UID, CID2),
               13: "0::/system.slice/nvidia-mps.service", 14: cgroup_text(UID, "ef" * 32),
               15: cgroup_text("uid-done", "ab" * 32)}
    procs = [GpuProcess(0, 10, 1 << 30), GpuProcess(0, 11, 512 << 20), GpuProcess(1, 12, 3 << 30),
             GpuProcess(1, 13, 100 << 20), GpuProcess(1, 14, 1 << 20), GpuProcess(0, 15, 7),
             GpuProcess(0, 99, 5 << 20)]  # pid 99: ended before its cgroup was read
    u = attribute(procs, cgroups.get, pods)
    assert [(c.pod, c.container, c.gpu, c.used_bytes) for c in u.containers] == [
        ("train", "", 1, 1 << 20),  # its status does not name this container yet
        ("train", "main", 0, (1 << 30) + (512 << 20)),
        ("train", "side", 1, 3 << 30),
    ]
    assert u.gpus == {0: (1 << 30) + (512 << 20) + 7 + (5 << 20),
                      1: (3 << 30) + (100 << 20) + (1 << 20)}
    assert [(a.pod, a.container, a.gpu_mem_gib) for a in u.allocations] == [
        ("train", "main", 4), ("train", "side", 4)]


def test_proc_cgroups_reads_a_proc_tree(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(cgroup_text(UID, CID))
    read = ProcCgroups(str(tmp_path))
    assert read(42) == cgroup_text(UID, CID) and read(43) is None


async def scrape(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    body = (await reader.read()).decode()
    writer.close()
    return body


async def test_usage_metrics_follow_the_processes_and_the_pods(harness, tmp_path):
    """The agent's /metrics on the in-memory NVML: a pod's two containers on two GPUs, a
    process outside any pod; then a process ends and the pod goes, and their series go."""
    from sharegpu.agent.metrics import serve

    h = await harness(mode="cgpu")
    nvml: FakeNvml = h.nvml
    h.kube.add_pod(pod_with("train", UID, {"main": CID, "side": CID2}))
    proc = tmp_path / "proc"
    for pid, cid in ((100, CID), (101, CID2), (102, None)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(
            cgroup_text(UID, cid) if cid else "0::/system.slice/nvidia-mps.service\n")
    nvml.run_process(0, 100, 3000)
    nvml.run_process(1, 101, 1500)
    nvml.run_process(1, 102, 200)
    usage = UsageCollector(nvml, [0, 1], lambda: h.kube.list_node_pods(NODE),
                           ProcCgroups(str(proc)), pods_ttl=0)
    server = await serve(h.agent, "127.0.0.1", 0, usage)
    port = server.sockets[0].getsockname()[1]
    uuid0, uuid1 = (g.uuid for g in h.agent.gpus)
    try:
        body = await scrape(port)
        assert (f'sharegpu_agent_container_gpu_memory_used_bytes{{node="{NODE}",'
                f'pod_uid="{UID}",container="main",gpu="0",uuid="{uuid0}"}} '
                f"{3000 << 20}") in body
        assert (f'sharegpu_agent_container_gpu_memory_used_bytes{{node="{NODE}",'
                f'pod_uid="{UID}",container="side",gpu="1",uuid="{uuid1}"}} '
                f"{1500 << 20}") in body
        assert (f'sharegpu_agent_gpu_memory_used_bytes{{node="{NODE}",gpu="1",uuid="{uuid1}"}} '
                f"{1700 << 20}") in body
        assert (f'sharegpu_agent_container_gpu_memory_allocated_bytes{{node="{NODE}",'
                f'pod_uid="{UID}",container="main"}} {4 << 30}') in body
        # names only with --metrics-pod-names: the endpoint is reachable from the pod network
        assert 'namespace="default"' not in body and 'pod="train"' not in body
        assert body.count("sharegpu_agent_container_gpu_memory_used_bytes{") == 2
        h.agent.config.metrics_pod_names = True
        named = await scrape(port)
        assert (f'sharegpu_agent_container_gpu_memory_allocated_bytes{{node="{NODE}",'
                f'pod_uid="{UID}",namespace="default",pod="train",container="main"}} '
                f"{4 << 30}") in named
        h.agent.config.metrics_pod_names = False
        assert "sharegpu_agent_mode_info" in body  # beside the other metrics

        nvml.run_process(1, 101, 0)  # the side container's process ends
        body = await scrape(port)
        assert body.count("sharegpu_agent_container_gpu_memory_used_bytes{") == 1
        assert 'container="side",gpu=' not in body

        del h.kube.pods[("default", "train")]  # the pod goes (its process may linger)
        body = await scrape(port)
        assert "sharegpu_agent_container_gpu_memory_used_bytes{" not in body
        assert "sharegpu_agent_container_gpu_memory_allocated_bytes{" not in body
        assert f'sharegpu_agent_gpu_memory_used_bytes{{node="{NODE}",gpu="0"' in body
    finally:
        server.close()


async def test_a_failing_usage_read_leaves_the_other_metrics(harness):
    from sharegpu.agent.metrics import serve

    h = await harness(mode="cgpu")

    async def broken() -> list[dict]:
        raise OSError("API server unreachable")

    usage = UsageCollector(h.nvml, [0], broken, ProcCgroups("/nonexistent"))
    server = await serve(h.agent, "127.0.0.1", 0, usage)
    try:
        body = await scrape(server.sockets[0].getsockname()[1])
    finally:
        server.close()
    assert body.startswith("HTTP/1.1 200") and "sharegpu_agent_mode_info" in body
    assert "sharegpu_agent_container_gpu_memory_used_bytes{" not in body

