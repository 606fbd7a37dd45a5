"""What a node's ResourceSlice says (sharegpu.dra.resourceslices): devices, attributes, capacities
with their request policies per mode, taints, and the API server's rules checked before anything
is published (bad GPU data is refused naming the field and the rule)."""

from __future__ import annotations

import copy
from dataclasses import replace

import kubernetes_validate
import pytest

from sharegpu.core.errors import ValidationError
from sharegpu.core.modes import Mode
from sharegpu.dra.resourceslices import (
    DRIVER,
    SliceGpu,
    build_slice,
    nvlink_peers,
    same_content,
    slice_name,
    validate_slice,
)

T4 = SliceGpu(index=0, uuid="GPU-aaaa", model="Tesla T4", mem_mib=15109, mem_gib=15,
              nvlink_peers=())
V100 = SliceGpu(index=1, uuid="GPU-bbbb", model="Tesla V100-SXM2-32GB", mem_mib=32510,
                mem_gib=32, nvlink_peers=(3, 2))
OWNER = {"kind": "DeviceClass", "name": DRIVER, "uid": "0f4c1d7e-1111-4222-8333-944455556666"}


def test_one_device_per_gpu_with_capacities_and_attributes():
    s = build_slice("node-a", [V100, T4], Mode.CGPU, generation=3, owner=OWNER)
    assert s["apiVersion"] == "resource.k8s.io/v1" and s["kind"] == "ResourceSlice"
    assert s["metadata"]["name"] == slice_name("node-a") == "node-a-gpu.sharegpu.io"
    assert s["metadata"]["ownerReferences"] == [{"apiVersion": "resource.k8s.io/v1", **OWNER}]
    spec = s["spec"]
    assert spec["driver"] == DRIVER and spec["nodeName"] == "node-a"
    assert spec["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    assert "perDeviceNodeSelection" not in spec and "allNodes" not in spec
    t4, v100 = spec["devices"]  # ordered by index
    assert t4["name"] == "gpu-0" and v100["name"] == "gpu-1"
    assert t4["allowMultipleAllocations"] is True
    assert t4["attributes"] == {
        "model": {"string": "Tesla T4"}, "uuid": {"string": "GPU-aaaa"}, "index": {"int": 0},
        "memoryMiB": {"int": 15109}, "nvlinkPeers": {"string": ""}, "mode": {"string": "cgpu"}}
    assert v100["attributes"]["nvlinkPeers"] == {"string": "2,3"}
    # memory in bytes, whole GiB (the unit of aliyun.com/gpu-mem); cores in percent, step 5
    assert t4["capacity"] == {
        "memory": {"value": "15Gi", "requestPolicy": {
            "default": "1Gi", "validRange": {"min": "1Gi", "max": "15Gi", "step": "1Gi"}}},
        "cores": {"value": "100", "requestPolicy": {
            "default": "5", "validRange": {"min": "5", "max": "100", "step": "5"}}},
    }
    assert v100["capacity"]["memory"]["value"] == "32Gi"
    assert "taints" not in t4


@pytest.mark.parametrize("mode", list(Mode))
def test_every_mode_gives_a_slice_the_schema_accepts(mode):
    s = build_slice("node-a", [T4, replace(V100, unhealthy=True)], mode, owner=OWNER)
    kubernetes_validate.validate(s, "1.37.0", strict=True)
    for d in s["spec"]["devices"]:
        assert d["attributes"]["mode"] == {"string": mode.value}
        if mode.shared:
            assert d["allowMultipleAllocations"] is True
            assert all("requestPolicy" in c for c in d["capacity"].values())
        else:  # exclusive and topology nodes hand out whole GPUs
            assert "allowMultipleAllocations" not in d
            assert all("requestPolicy" not in c for c in d["capacity"].values())


def test_health_and_isolation_are_device_taints():
    s = build_slice("n", [replace(T4, unhealthy=True), replace(V100, isolation_unavailable=True)],
                    Mode.CORE_MEM)
    a, b = s["spec"]["devices"]
    assert a["taints"] == [{"key": "gpu.sharegpu.io/unhealthy", "effect": "NoSchedule"}]
    assert b["taints"] == [{"key": "gpu.sharegpu.io/isolation-unavailable",
                            "effect": "NoSchedule"}]


def test_nvlink_peers_from_the_link_matrix():
    links = [["X", "NV2", "PHB"], ["NV2", "X", "NV1"], ["PHB", "NV1", "X"]]
    assert [nvlink_peers(links, i) for i in range(3)] == [(1,), (0, 2), (1,)]
    assert nvlink_peers(None, 0) == () and nvlink_peers(links, 7) == ()


@pytest.mark.parametrize(("gpu", "field", "rule"), [
    (replace(T4, uuid=""), "gpus[0].uuid", "non-empty"),
    (replace(T4, model="x" * 65), "gpus[0].model", "at most 64"),
    (replace(T4, mem_mib=0), "gpus[0].mem_mib", "positive"),
    (replace(T4, mem_gib=0), "gpus[0].mem_gib", "at least 1 GiB"),
    (replace(T4, index=-1), "gpus[0].index", ">= 0"),
    (replace(T4, nvlink_peers=(0,)), "gpus[0].nvlink_peers", "other GPUs"),
])
def test_bad_gpu_data_is_refused_naming_the_field(gpu, field, rule):
    with pytest.raises(ValidationError) as e:
        build_slice("n", [gpu], Mode.CGPU)
    assert e.value.field == field and rule in e.value.rule


def test_duplicate_gpus_are_refused():
    with pytest.raises(ValidationError, match=r"gpus\[1\].index=0: must be unique"):
        build_slice("n", [T4, replace(V100, index=0)], Mode.CGPU)
    with pytest.raises(ValidationError, match=r"gpus\[1\].uuid='GPU-aaaa': must be unique"):
        build_slice("n", [T4, replace(V100, uuid="GPU-aaaa")], Mode.CGPU)


def test_bad_names_are_refused():
    with pytest.raises(ValidationError, match=r"spec\.driver"):
        build_slice("n", [T4], Mode.CGPU, driver="Not_A.Domain")
    with pytest.raises(ValidationError, match=r"metadata\.name"):
        build_slice("Node_A", [T4], Mode.CGPU)
    with pytest.raises(ValidationError, match=r"spec\.devices=65: must have at most 64 devices"):
        build_slice("n", [SliceGpu(i, f"GPU-{i}", "m", 1024, 1, unhealthy=True)
                          for i in range(65)], Mode.CGPU)
    # 128 without taints is allowed, 129 not
    build_slice("n", [SliceGpu(i, f"GPU-{i}", "m", 1024, 1) for i in range(128)], Mode.CGPU)
    with pytest.raises(ValidationError, match="at most 128"):
        build_slice("n", [SliceGpu(i, f"GPU-{i}", "m", 1024, 1) for i in range(129)], Mode.CGPU)


def test_a_long_node_name_still_gives_a_valid_slice_name():
    node = ".".join(["n" * 60] * 4)  # 243 characters, a valid node name
    name = slice_name(node)
    assert len(name) <= 253 and name.endswith("-gpu.sharegpu.io")
    assert name != slice_name(node[:-1] + "m")
    build_slice(node, [T4], Mode.CGPU)


def test_a_one_gib_gpu_gets_a_range_of_one_value():
    # the API server wants min + step <= value: a 1 GiB GPU (after --reserve-mib) has no step
    s = build_slice("n", [SliceGpu(0, "GPU-x", "tiny", 1024, 1)], Mode.CGPU)
    assert s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"] == {
        "default": "1Gi", "validRange": {"min": "1Gi", "max": "1Gi"}}


@pytest.mark.parametrize(("path", "value", "field", "rule"), [
    (("capacity", "memory", "requestPolicy", "validRange", "max"), "16Gi",
     "requestPolicy.validRange.max", "larger than capacity"),
    (("capacity", "memory", "requestPolicy", "validRange", "step"), "0",
     "validRange.step", "greater than zero"),
    (("capacity", "memory", "requestPolicy", "default"), "1536Mi",
     "validRange.step", "default 1610612736 is not min"),
    (("capacity", "cores", "requestPolicy", "validRange", "min"), "200",
     "validRange.min", "larger than capacity"),
    (("capacity", "cores", "value"), "1.5", "capacity[cores].value", "whole number"),
    (("attributes", "index"), {"int": 1, "string": "x"}, "attributes[index]",
     "exactly one value"),
    (("attributes", "bad name"), {"int": 1}, "attributes[bad name]", "C identifier"),
    (("name",), "GPU_0", "spec.devices[0].name", "DNS label"),
    (("allowMultipleAllocations",), None, "requestPolicy", "allowMultipleAllocations must be"),
])
def test_the_api_servers_rules_are_checked(path, value, field, rule):
    s = build_slice("n", [T4], Mode.CGPU)
    bad = copy.deepcopy(s)
    target = bad["spec"]["devices"][0]
    for k in path[:-1]:
        target = target[k]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    with pytest.raises(ValidationError) as e:
        validate_slice(bad)
    assert field in e.value.field and rule in e.value.rule, str(e.value)


def test_same_content_ignores_generation_spelling_and_taint_time():
    a = build_slice("n", [replace(T4, unhealthy=True)], Mode.CGPU, generation=1)["spec"]
    b = copy.deepcopy(a)
    b["pool"]["generation"] = 9
    b["devices"][0]["capacity"]["memory"]["value"] = str(15 << 30)  # same quantity
    b["devices"][0]["taints"][0]["timeAdded"] = "2026-01-01T00:00:00Z"  # set by the server
    assert same_content(a, b)
    b["devices"][0]["attributes"]["mode"] = {"string": "share"}
    assert not same_content(a, b)
