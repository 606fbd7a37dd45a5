"""The agent against a test kubelet over real gRPC on unix sockets: registration, device counts
per mode, live mode switches, the remembered mode, kubelet restarts, health, node labels."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from agent_helpers import NODE, harness, short_dir  # noqa: F401
from agent_kubelet import wait_until

from sharegpu.core import names
from sharegpu.core.modes import Mode, advertised_resources

MEM = [15, 32]  # the harness node: a 15 GiB T4 and a 32 GiB V100


async def test_every_resource_registers(harness):
    h = await harness()
    resources = {r for _, r, _ in h.kubelet.registrations}
    assert resources == set(names.ALL_GPU_RESOURCES)
    # each on its own socket in the device-plugin directory
    endpoints = set(h.kubelet.endpoints.values())
    assert len(endpoints) == 5
    for e in endpoints:
        assert os.path.exists(os.path.join(h.kubelet.dir, e))


@pytest.mark.parametrize("mode", [m.value for m in Mode])
async def test_device_counts_per_mode(harness, mode):
    h = await harness(mode=mode)
    expected = advertised_resources(Mode(mode), MEM)
    await wait_until(lambda: h.counts() == expected)
    if mode in ("cgpu", "core_mem", "share", "mps"):
        # one fake device per GiB, per GPU: 15 on the T4, 32 on the V100
        ids = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        per_gpu = {}
        for i in ids:
            per_gpu[h.agent.devices.gpu_of(i)] = per_gpu.get(h.agent.devices.gpu_of(i), 0) + 1
        assert per_gpu == {0: 15, 1: 32}
        assert all(len(i) <= 63 for i in ids)


async def test_live_switch_cgpu_core_mem_default(harness):
    h = await harness(mode="cgpu")
    await wait_until(lambda: h.counts() == advertised_resources(Mode.CGPU, MEM))
    assert h.counts()[names.RES_GPU_MEM] == 47 and h.counts()[names.RES_NVIDIA_GPU] == 0

    h.kube.set_node_labels(NODE, {names.LABEL_SCHEDULE: "core_mem"})
    await wait_until(lambda: h.counts() == advertised_resources(Mode.CORE_MEM, MEM))
    assert h.counts()[names.RES_GPU_CORE] == 200

    h.kube.set_node_labels(NODE, {names.LABEL_SCHEDULE: "default"})
    await wait_until(lambda: h.counts() == advertised_resources(Mode.EXCLUSIVE, MEM))
    c = h.counts()
    assert c[names.RES_NVIDIA_GPU] == 2
    assert c[names.RES_GPU_MEM] == c[names.RES_GPU_CORE] == c[names.RES_GPU_COUNT] == 0
    assert h.kube.nodes[NODE]["metadata"]["annotations"][names.ANN_NODE_LAST_MODE] == "default"


async def test_label_removal_keeps_mode_also_after_agent_restart(harness):
    h = await harness(mode="core_mem")
    want = advertised_resources(Mode.CORE_MEM, MEM)
    await wait_until(lambda: h.counts() == want)

    h.kube.set_node_labels(NODE, {names.LABEL_SCHEDULE: None})
    await asyncio.sleep(0.3)
    assert h.agent.mode is Mode.CORE_MEM
    assert h.counts() == want

    await h.restart_agent()  # the label is still absent
    assert h.agent.mode is Mode.CORE_MEM
    await wait_until(lambda: h.counts() == want)

    # without the local state (a new disk), the node annotation still remembers it
    os.unlink(os.path.join(h.dir, "state", "last-mode"))
    await h.restart_agent()
    assert h.agent.mode is Mode.CORE_MEM

    # an explicit `default` does switch back
    h.kube.set_node_labels(NODE, {names.LABEL_SCHEDULE: "default"})
    await wait_until(lambda: h.counts() == advertised_resources(Mode.EXCLUSIVE, MEM))


async def test_bad_label_value_keeps_mode(harness):
    h = await harness(mode="cgpu")
    h.kube.set_node_labels(NODE, {names.LABEL_SCHEDULE: "turbo"})
    await asyncio.sleep(0.2)
    assert h.agent.mode is Mode.CGPU
    assert h.counts() == advertised_resources(Mode.CGPU, MEM)


async def test_kubelet_restart_reregisters_within_2s(harness):
    h = await harness(mode="cgpu")
    before = len(h.kubelet.registrations)
    await h.kubelet.restart()
    took = await wait_until(
        lambda: len({r for t, r, _ in h.kubelet.registrations[before:]}) == 5
        and len(h.kubelet.devices) == 5,
        timeout=2.0,
    )
    assert took < 2.0
    assert h.counts() == advertised_resources(Mode.CGPU, MEM)
    # and the plugins answer on their re-created sockets
    ids = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
    assert await h.kubelet.preferred(names.RES_GPU_MEM, ids, 2)


async def test_critical_xid_marks_gpu_unhealthy_and_back(harness):
    h = await harness(mode="cgpu", recover_after_s=0.3)
    h.nvml.inject_xid(1, 43)  # an application XID: not the GPU's fault
    await asyncio.sleep(0.2)
    assert len(h.kubelet.healthy(names.RES_GPU_MEM)) == 47

    h.nvml.inject_xid(1, 79)  # fallen off the bus
    await wait_until(lambda: len(h.kubelet.healthy(names.RES_GPU_MEM)) == 15)
    unhealthy = [i for i, s in h.kubelet.devices[names.RES_GPU_MEM] if s == "Unhealthy"]
    assert {h.agent.devices.gpu_of(i) for i in unhealthy} == {1}
    await asyncio.sleep(0.5)  # still lost: stays unhealthy
    assert len(h.kubelet.healthy(names.RES_GPU_MEM)) == 15

    h.nvml.recover(1)
    await wait_until(lambda: len(h.kubelet.healthy(names.RES_GPU_MEM)) == 47)


async def test_node_labels_and_annotations(harness):
    h = await harness(gpus=[("Tesla-V100-SXM2-32GB", 32)] * 2 + [("Tesla-V100-SXM2-32GB", 16)],
                      mode="cgpu")
    meta = h.kube.nodes[NODE]["metadata"]
    assert meta["labels"][names.LABEL_CARD_NAME] == "Tesla-V100-SXM2-32GB"
    assert meta["labels"][names.LABEL_CARD_MEM] == f"{32 * 1024}MiB"
    assert meta["labels"][names.LABEL_CARD_COUNT] == "3"
    assert meta["annotations"][names.ANN_NODE_GPU_MEM] == "32,32,16"
    assert meta["annotations"][names.ANN_NODE_LAST_MODE] == "cgpu"
    # the scheduler reads this node back with GPUs of their own sizes
    from sharegpu.core.nodes import spec_from_node

    spec = spec_from_node(h.kube.nodes[NODE])
    assert list(spec.gpu_mem) == [32, 32, 16] and spec.mode is Mode.CGPU
    assert names.ANN_NODE_GPU_TOPOLOGY not in meta["annotations"]  # fake NVML: no links


async def test_reserve_keeps_memory_out_of_what_is_advertised(harness):
    """--reserve-mib: an 80 GiB card with 1 GiB reserved is advertised (annotation, devices, what
    the scheduler reads) as 79 GiB; its model label still says what the card is."""
    h = await harness(gpus=[("NVIDIA-H100-80GB-HBM3", 80)] * 2, mode="cgpu", reserve_mib=1024)
    meta = h.kube.nodes[NODE]["metadata"]
    assert meta["annotations"][names.ANN_NODE_GPU_MEM] == "79,79"
    assert meta["labels"][names.LABEL_CARD_MEM] == f"{80 * 1024}MiB"
    assert h.kubelet.count(names.RES_GPU_MEM) == 158
    from sharegpu.core.nodes import spec_from_node

    assert list(spec_from_node(h.kube.nodes[NODE]).gpu_mem) == [79, 79]


async def test_topology_annotation_from_links(short_dir):
    from agent_helpers import Harness

    from sharegpu.agent.nvml import FakeNvml

    h = Harness(short_dir, [("A100", 40)] * 2, "topology")
    h.nvml = FakeNvml([("A100", 40)] * 2, links=[["X", "NV12"], ["NV12", "X"]])
    await h.start()
    try:
        ann = h.kube.nodes[NODE]["metadata"]["annotations"]
        assert json.loads(ann[names.ANN_NODE_GPU_TOPOLOGY]) == [["X", "NV12"], ["NV12", "X"]]
        assert h.counts()[names.RES_TOPOLOGY_GPU] == 2
    finally:
        await h.close()


async def test_metrics_endpoint(harness):
    from sharegpu.agent.metrics import serve

    h = await harness(mode="cgpu")
    server = await serve(h.agent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        body = (await reader.read()).decode()
        writer.close()
    finally:
        server.close()
    assert body.startswith("HTTP/1.1 200")
    assert f'sharegpu_agent_mode_info{{node="{NODE}",mode="cgpu"}} 1' in body
    assert "sharegpu_agent_registrations_total 1" in body
    assert body.count("sharegpu_agent_gpu_healthy{") == 2


async def test_agent_waits_for_its_node_to_appear(short_dir):
    from agent_helpers import Harness

    from sharegpu.agent.builder import build_agent

    h = Harness(short_dir, [("Tesla-T4", 15)], "cgpu")
    node = h.kube.nodes.pop(NODE)
    await h.kubelet.start()
    agent = build_agent(h.config(), h.nvml, h.kube)
    started = asyncio.ensure_future(agent.start())
    await asyncio.sleep(0.3)
    assert not started.done()  # the API has no such node yet: it keeps asking
    h.kube.nodes[NODE] = node
    await asyncio.wait_for(started, 5)
    h.agent = agent
    try:
        await wait_until(lambda: h.counts() == advertised_resources(Mode.CGPU, [15]))
    finally:
        await h.close()


async def test_another_gpu_plugin_keeps_nvidia_gpu(short_dir):
    """NVIDIA's device plugin (or the GPU Operator's) already serves this node's GPUs: the agent
    does not register nvidia.com/gpu beside it (the kubelet would keep only the last one), says
    so in its log, a node Event and a metric, and still serves its shared resources."""
    from agent_helpers import Harness

    from sharegpu.agent.builder import build_agent
    from sharegpu.agent.devices import Device
    from sharegpu.agent.metrics import render
    from sharegpu.agent.plugin import DevicePlugin

    h = Harness(short_dir, [("Tesla-T4", 15), ("Tesla-T4", 15)], "cgpu")
    await h.kubelet.start()
    other = DevicePlugin(names.RES_NVIDIA_GPU, "nvidia-gpu.sock", backend=None)  # type: ignore[arg-type]
    uuids = [g.uuid for g in h.nvml.gpus()]
    await other.start(f"{short_dir}/dp")
    await other.set_devices([Device(f"{u}::0", i) for i, u in enumerate(uuids)])
    try:
        h.agent = build_agent(h.config(), h.nvml, h.kube)
        await h.agent.start()
        await wait_until(lambda: len(h.kubelet.endpoints) == 4)
        await asyncio.sleep(0.3)
        assert names.RES_NVIDIA_GPU not in h.kubelet.endpoints
        assert names.RES_GPU_MEM in h.kubelet.endpoints
        assert h.agent.conflicts == {names.RES_NVIDIA_GPU: ["nvidia-gpu.sock"]}
        (ev,) = [e for e in h.kube.events if e["reason"] == "GPUDevicePluginConflict"]
        assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": h.agent.config.node_name, "uid": h.agent.config.node_name}
        assert "nvidia.com/gpu.deploy.device-plugin=false" in ev["message"]
        assert ('sharegpu_agent_resource_conflict{resource="nvidia.com/gpu",'
                'socket="nvidia-gpu.sock"} 1') in render(h.agent)
    finally:
        await other.stop()
        await h.close()


async def test_a_stale_foreign_socket_is_no_conflict(harness, short_dir):
    """A socket file nobody answers on (a plugin that died) does not keep nvidia.com/gpu away."""
    import os
    import socket as so
    os.makedirs(f"{short_dir}/dp", exist_ok=True)
    dead = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    dead.bind(f"{short_dir}/dp/nvidia-gpu.sock")
    dead.close()
    h = await harness(mode="default")
    assert names.RES_NVIDIA_GPU in h.kubelet.endpoints and h.agent.conflicts == {}


@pytest.mark.parametrize("bad", ["-1", "1.5", "65536", "lots"])
def test_agent_refuses_a_bad_reserve(tmp_path, bad):
    r = subprocess.run(
        [sys.executable, "-m", "sharegpu.cli", "agent", "--node-name", "n", "--nvml", "fake",
         "--standalone", "--reserve-mib", bad, "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (f"--reserve-mib='{bad}': must be a whole number of MiB, 0 or more, below 65536"
            in r.stderr)


async def _get(port: int, path: str) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    body = (await reader.read()).decode()
    writer.close()
    return body


async def test_readyz_waits_until_the_kubelet_has_every_resources_devices(harness):
    # the agent pod's readiness probe: a pod the kubelet admits before it has a resource's
    # devices is rejected by the kubelet, so the agent is Ready only once it has them all
    from sharegpu.agent.metrics import serve

    h = await harness(mode="cgpu")
    server = await serve(h.agent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await wait_until(lambda: h.agent.unready() == [], timeout=2.0)
        assert (await _get(port, "/readyz")).startswith("HTTP/1.1 200")
        # a plugin server restarted without the kubelet following it again: not ready, and why
        p = h.agent.plugins[names.RES_GPU_MEM]
        await p.stop()
        await p.start(h.kubelet.dir)
        got = await _get(port, "/readyz")
        assert got.startswith("HTTP/1.1 503")
        assert f"the kubelet has not listed {names.RES_GPU_MEM}'s devices yet" in got
        assert (await _get(port, "/healthz")).startswith("HTTP/1.1 200")  # alive all along
        # the kubelet restarts: every plugin registers again, is listed, ready again
        await h.kubelet.restart()
        await wait_until(lambda: h.agent.unready() == [], timeout=3.0)
        assert (await _get(port, "/readyz")).startswith("HTTP/1.1 200")
    finally:
        server.close()


async def test_not_ready_before_the_first_registration(short_dir):
    from sharegpu.agent.deviceplugins import DevicePlugins

    class NoKube:
        async def create_node_event(self, *a, **kw):  # type: ignore[no-untyped-def]
            raise AssertionError("no event expected")

    plugins = DevicePlugins(short_dir, backend=None, node_name=NODE,  # type: ignore[arg-type]
                            gpu_uuids=[], kube=NoKube(), poll_s=0.1)  # type: ignore[arg-type]
    assert plugins.unready() == ["the device plugins have not registered with the kubelet yet"]
