"""Node and pod objects to the core's view."""

from __future__ import annotations

import json

import pytest

from conftest import limits, pod
from sharegpu.core import names
from sharegpu.core.annotations import Allocation, encode
from sharegpu.core.errors import ValidationError
from sharegpu.core.modes import Mode, Placement
from sharegpu.core.nodes import spec_from_node
from sharegpu.core.pods import placement_of


def node(name="n1", labels=None, annotations=None, allocatable=None):
    return {
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "status": {"allocatable": allocatable or {},
                   "addresses": [{"type": "InternalIP", "address": "192.0.2.109"}]},
    }


def test_shared_node_from_labels_and_allocatable():
    s = spec_from_node(node(
        labels={names.LABEL_SCHEDULE: "cgpu", names.LABEL_PLACEMENT: "spread",
                names.LABEL_CARD_NAME: "Tesla-T4"},
        allocatable={names.RES_GPU_MEM: "60", names.RES_GPU_COUNT: "4"},
    ))
    assert s is not None
    assert (s.mode, list(s.gpu_mem), s.placement, s.model, s.address) == (
        Mode.CGPU, [15, 15, 15, 15], Placement.SPREAD, "Tesla-T4", "192.0.2.109")


def test_gpus_of_different_sizes_from_the_agent_annotation():
    s = spec_from_node(node(labels={names.LABEL_SCHEDULE: "cgpu"},
                            annotations={names.ANN_NODE_GPU_MEM: "16,32"},
                            allocatable={names.RES_GPU_MEM: "48", names.RES_GPU_COUNT: "2"}))
    assert list(s.gpu_mem) == [16, 32]


def test_label_removed_keeps_the_mode_the_node_still_advertises():
    s = spec_from_node(node(allocatable={names.RES_GPU_MEM: "30", names.RES_GPU_COUNT: "2",
                                         names.RES_GPU_CORE: "200", names.RES_NVIDIA_GPU: "0"}))
    assert s.mode is Mode.CORE_MEM
    s = spec_from_node(node(annotations={names.ANN_NODE_LAST_MODE: "mps"},
                            allocatable={names.RES_GPU_MEM: "30", names.RES_GPU_COUNT: "2"}))
    assert s.mode is Mode.MPS


def test_exclusive_node_and_node_without_gpus():
    s = spec_from_node(node(allocatable={names.RES_NVIDIA_GPU: "2"},
                            labels={names.LABEL_CARD_MEM: "32510MiB"}))
    assert s.mode is Mode.EXCLUSIVE and list(s.gpu_mem) == [31, 31]
    assert spec_from_node(node(allocatable={"cpu": "8"})) is None


def test_topology_annotation():
    kinds = [["X", "NV1"], ["NV1", "X"]]
    s = spec_from_node(node(labels={names.LABEL_SCHEDULE: "topology"},
                            annotations={names.ANN_NODE_GPU_TOPOLOGY: json.dumps(kinds)},
                            allocatable={names.RES_TOPOLOGY_GPU: "2"}))
    assert s.links is not None and s.links[0, 1] == 10


@pytest.mark.parametrize(("annotations", "labels", "message"), [
    ({names.ANN_NODE_GPU_MEM: "16,x"}, {}, "must be positive whole GiB per GPU"),
    ({names.ANN_NODE_GPU_TOPOLOGY: "[[1]]"}, {names.LABEL_SCHEDULE: "topology"}, "square matrix"),
    ({}, {names.LABEL_SCHEDULE: "turbo"}, "must be one of"),
])
def test_bad_node_metadata_named(annotations, labels, message):
    with pytest.raises(ValidationError, match=message):
        spec_from_node(node(labels=labels, annotations=annotations,
                            allocatable={names.RES_GPU_MEM: "32", names.RES_GPU_COUNT: "2",
                                         names.RES_TOPOLOGY_GPU: "2"}))


def test_placement_of_a_bound_pod():
    ann = encode(Allocation(mem={0: {1: 3}}), assume_time_ns=5)
    obj = pod("a", containers=[limits(mem=3)], annotations=ann, node="n1", phase="Running")
    r, node_name, alloc = placement_of(obj)
    assert (r.key, node_name, alloc.mem) == ("default/a", "n1", {0: {1: 3}})


def test_pods_that_hold_nothing():
    ann = encode(Allocation(mem={0: {1: 3}}), assume_time_ns=5)
    assert placement_of(pod("a", containers=[limits(mem=3)], annotations=ann)) is None  # unbound
    assert placement_of(pod("a", containers=[limits(mem=3)], annotations=ann, node="n1",
                            phase="Succeeded")) is None
    assert placement_of(pod("a", containers=[limits(mem=3)], node="n1")) is None
