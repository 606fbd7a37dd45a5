"""The agent in DRA mode against an in-memory API (MemorySlices) and a test kubelet over real
gRPC: it publishes its node's ResourceSlice and the device plugins advertise nothing (never
both), keeps the slice current on mode changes, health changes, restarts (no write when nothing
changed, no second slice) and a GPU removed, re-creates it when the kubelet wipes it, withdraws
it when the node leaves the DRA pool, and publishes nothing from bad GPU data."""

from __future__ import annotations

import asyncio

import pytest
from agent_helpers import NODE, harness, short_dir  # noqa: F401
from agent_kubelet import wait_until

from sharegpu.agent.nvml import FakeNvml
from sharegpu.agent.slicepublisher import MemorySlices, SlicePublisher
from sharegpu.core import names
from sharegpu.core.modes import Mode, advertised_resources

NAME = f"{NODE}-gpu.sharegpu.io"
NOTHING = dict.fromkeys(names.ALL_GPU_RESOURCES, 0)


def publisher(api: MemorySlices, **kw) -> SlicePublisher:  # type: ignore[no-untyped-def]
    return SlicePublisher(api, NODE, retry_s=0.05, **kw)


@pytest.fixture
def api() -> MemorySlices:
    a = MemorySlices()
    a.add_device_class("gpu.sharegpu.io", uid="dc-1")
    return a


def devices(api: MemorySlices) -> list[dict]:
    return api.slices[NAME]["spec"]["devices"]


def writes(api: MemorySlices) -> list[tuple[str, str]]:
    return [c for c in api.calls if c[0] != "list"]


async def test_dra_node_publishes_its_slice_and_no_device_plugin_devices(harness, api):
    h = await harness(mode="cgpu", dra="on", slices=publisher(api))
    await wait_until(lambda: NAME in api.slices)
    s = api.slices[NAME]
    assert s["metadata"]["ownerReferences"] == [{"apiVersion": "resource.k8s.io/v1",
                                                 "kind": "DeviceClass",
                                                 "name": "gpu.sharegpu.io", "uid": "dc-1"}]
    assert s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert [d["capacity"]["memory"]["value"] for d in devices(api)] == ["15Gi", "32Gi"]
    assert [d["attributes"]["model"]["string"] for d in devices(api)] == [
        "Tesla T4", "Tesla V100 SXM2 32GB"]
    assert all(d["allowMultipleAllocations"] for d in devices(api))
    # never both: every device-plugin resource is registered with no device
    assert h.counts() == NOTHING
    assert h.agent.slices.problem is None


async def test_mode_and_health_changes_update_the_slice(harness, api):
    h = await harness(mode="cgpu", dra="on", slices=publisher(api), recover_after_s=0.3)
    await wait_until(lambda: NAME in api.slices)
    h.kube.set_node_labels(NODE, {names.LABEL_SCHEDULE: "default"})
    await wait_until(lambda: api.slices[NAME]["spec"]["pool"]["generation"] == 2)
    assert all("allowMultipleAllocations" not in d for d in devices(api))
    assert {d["attributes"]["mode"]["string"] for d in devices(api)} == {"default"}
    assert h.counts() == NOTHING  # still DRA: the new mode brings no plugin devices

    h.nvml.inject_xid(1, 79)  # GPU 1 falls off the bus
    await wait_until(lambda: "taints" in devices(api)[1])
    assert devices(api)[1]["taints"] == [{"key": "gpu.sharegpu.io/unhealthy",
                                          "effect": "NoSchedule"}]
    assert "taints" not in devices(api)[0]
    assert api.slices[NAME]["spec"]["pool"]["generation"] == 3
    h.nvml.recover(1)
    await wait_until(lambda: "taints" not in devices(api)[1])
    assert api.slices[NAME]["spec"]["pool"]["generation"] == 4
    assert len(api.slices) == 1


async def test_restart_writes_nothing_and_a_removed_gpu_is_dropped(harness, api):
    h = await harness(mode="core_mem", dra="on", slices=publisher(api))
    await wait_until(lambda: NAME in api.slices)
    uid = api.slices[NAME]["metadata"]["uid"]
    before = list(writes(api))

    h.slices = publisher(api)  # a new agent process: nothing remembered but the API's slice
    await h.restart_agent()
    await wait_until(lambda: h.slices.reconciles >= 1)
    await asyncio.sleep(0.2)
    assert writes(api) == before and api.slices[NAME]["metadata"]["uid"] == uid

    # restarted on a node that lost its V100
    h.nvml = FakeNvml([("Tesla-T4", 15)])
    h.slices = publisher(api)
    await h.restart_agent()
    await wait_until(lambda: len(devices(api)) == 1)
    assert devices(api)[0]["attributes"]["uuid"]["string"] == h.nvml.gpus()[0].uuid
    assert api.slices[NAME]["spec"]["pool"]["generation"] == 2
    assert api.slices[NAME]["metadata"]["uid"] == uid  # updated in place, not a second slice
    assert list(api.slices) == [NAME]


async def test_a_wiped_slice_comes_back_and_strays_go(harness, api):
    # a leftover slice of this driver and node under another name (e.g. a generateName'd one)
    await api.create_slice({"metadata": {"name": "stray"}, "spec": {
        "driver": "gpu.sharegpu.io", "nodeName": NODE,
        "pool": {"name": NODE, "generation": 7, "resourceSliceCount": 1}}})
    other = await api.create_slice({"metadata": {"name": "other-node"}, "spec": {
        "driver": "gpu.sharegpu.io", "nodeName": "gpu-node-2",
        "pool": {"name": "gpu-node-2", "generation": 1, "resourceSliceCount": 1}}})
    h = await harness(mode="cgpu", dra="on", slices=publisher(api))
    await wait_until(lambda: NAME in api.slices and "stray" not in api.slices)
    assert api.slices["other-node"] == other  # another node's slice is not ours to touch

    api.remove(NAME)  # what the kubelet does when it starts
    t = await wait_until(lambda: NAME in api.slices)
    assert t < 1.0
    assert api.slices[NAME]["spec"]["pool"]["generation"] == 2
    assert h.agent.slices.writes == 3  # stray deleted, created, re-created


async def test_label_moves_the_node_between_dra_and_device_plugins(harness, api):
    h = await harness(mode="cgpu", dra="label", slices=publisher(api))
    await asyncio.sleep(0.2)
    assert api.slices == {}
    assert h.counts() == advertised_resources(Mode.CGPU, [15, 32])

    h.kube.set_node_labels(NODE, {"sharegpu.io/dra": "true"})
    await wait_until(lambda: NAME in api.slices and h.counts() == NOTHING)

    h.kube.set_node_labels(NODE, {"sharegpu.io/dra": None})
    await wait_until(lambda: NAME not in api.slices
                     and h.counts() == advertised_resources(Mode.CGPU, [15, 32]))


async def test_a_node_outside_the_pool_withdraws_a_leftover_slice(harness, api):
    await api.create_slice({"metadata": {"name": NAME}, "spec": {
        "driver": "gpu.sharegpu.io", "nodeName": NODE,
        "pool": {"name": NODE, "generation": 4, "resourceSliceCount": 1}}})
    await harness(mode="cgpu", dra="label", slices=publisher(api))
    await wait_until(lambda: NAME not in api.slices)


async def test_bad_gpu_data_publishes_nothing(harness, api, caplog):
    await api.create_slice({"metadata": {"name": NAME}, "spec": {
        "driver": "gpu.sharegpu.io", "nodeName": NODE,
        "pool": {"name": NODE, "generation": 4, "resourceSliceCount": 1}}})
    h = await harness(gpus=[("Tesla-T4", 15), ("Tesla-T4", 0)], mode="cgpu", dra="on",
                      slices=publisher(api))
    await wait_until(lambda: h.agent.slices.problem is not None and NAME not in api.slices)
    assert h.agent.slices.problem.startswith("gpus[1].mem_mib=0: must be a positive")
    assert "gpus[1].mem_mib=0" in caplog.text
    assert [c for c in writes(api) if c[0] in ("create", "replace")] == [("create", NAME)]
    assert h.counts() == NOTHING  # a DRA node: the plugins do not step in


async def test_no_device_class_no_slice_until_it_exists(harness):
    api = MemorySlices()
    h = await harness(mode="cgpu", dra="on", slices=publisher(api))
    await wait_until(lambda: h.agent.slices.problem is not None)
    assert "DeviceClass='gpu.sharegpu.io': must exist" in h.agent.slices.problem
    assert api.slices == {}
    api.add_device_class("gpu.sharegpu.io", uid="dc-9")
    await wait_until(lambda: NAME in api.slices, timeout=10)
    assert api.slices[NAME]["metadata"]["ownerReferences"][0]["uid"] == "dc-9"


async def test_stopping_the_agent_keeps_the_slice(harness, api):
    h = await harness(mode="cgpu", dra="on", slices=publisher(api))
    await wait_until(lambda: NAME in api.slices)
    await h.agent.stop()
    h.agent = None
    assert NAME in api.slices  # a restart or a rolling update must not empty the node


@pytest.mark.parametrize(("flags", "message"), [
    (["--dra", "label", "--dra-label", "no-equals"],
     "--dra-label='no-equals': must be KEY=VALUE"),
    (["--dra", "on", "--dra-driver", "Bad_Driver"],
     "--dra-driver='Bad_Driver': must be a lowercase DNS subdomain"),
])
def test_agent_refuses_bad_dra_flags(tmp_path, flags, message):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "sharegpu.cli", "agent", "--node-name", "n", "--nvml", "fake",
         "--standalone", "--state-dir", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert message in r.stderr, r.stderr
