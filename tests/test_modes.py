"""Node mode rules (SPEC §1)."""

from __future__ import annotations

import pytest

from sharegpu.core import names
from sharegpu.core.errors import ValidationError
from sharegpu.core.modes import (
    Mode,
    Placement,
    advertised_resources,
    card_model_labels,
    node_mode,
    node_placement,
    parse_mode,
)


def test_absent_label_is_exclusive():
    assert parse_mode(None) is Mode.EXCLUSIVE
    assert node_mode({}) is Mode.EXCLUSIVE


def test_label_removal_keeps_the_last_explicit_mode():
    assert parse_mode(None, previous=Mode.CGPU) is Mode.CGPU
    assert parse_mode("", previous=Mode.TOPOLOGY) is Mode.TOPOLOGY


def test_only_default_switches_back_to_exclusive():
    assert parse_mode("default", previous=Mode.CGPU) is Mode.EXCLUSIVE


def test_unknown_mode_refused_with_the_allowed_values():
    with pytest.raises(ValidationError) as e:
        parse_mode("gpu-share")
    assert str(e.value) == (
        "label ack.node.gpu.schedule='gpu-share': must be one of: "
        "default, cgpu, core_mem, share, mps, topology"
    )


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (Mode.EXCLUSIVE, {names.RES_NVIDIA_GPU: 4}),
        (Mode.CGPU, {names.RES_GPU_MEM: 60, names.RES_GPU_COUNT: 4}),
        (Mode.SHARE, {names.RES_GPU_MEM: 60, names.RES_GPU_COUNT: 4}),
        (Mode.MPS, {names.RES_GPU_MEM: 60, names.RES_GPU_COUNT: 4}),
        (Mode.CORE_MEM, {names.RES_GPU_MEM: 60, names.RES_GPU_COUNT: 4, names.RES_GPU_CORE: 400}),
        (Mode.TOPOLOGY, {names.RES_TOPOLOGY_GPU: 4}),
    ],
)
def test_one_mode_per_node_other_modes_advertised_as_zero(mode, expected):
    res = advertised_resources(mode, [15, 15, 15, 15])
    assert set(res) == set(names.ALL_GPU_RESOURCES)  # every resource is advertised
    assert {k: v for k, v in res.items() if v} == expected  # only this mode's are non-zero


def test_gpus_of_different_sizes_sum():
    assert advertised_resources(Mode.CGPU, [16, 32])[names.RES_GPU_MEM] == 48


def test_placement_only_in_shared_modes():
    labels = {names.LABEL_PLACEMENT: "spread"}
    assert node_placement(labels, Mode.CGPU) is Placement.SPREAD
    assert node_placement(labels, Mode.CORE_MEM) is Placement.SPREAD
    assert node_placement(labels, Mode.EXCLUSIVE) is None
    assert node_placement(labels, Mode.TOPOLOGY) is None
    assert node_placement({}, Mode.CGPU) is None


def test_bad_placement_refused():
    with pytest.raises(ValidationError) as e:
        node_placement({names.LABEL_PLACEMENT: "pack"}, Mode.CGPU)
    assert str(e.value) == "label ack.node.gpu.placement='pack': must be binpack or spread"


def test_card_model_labels():
    assert card_model_labels("Tesla V100-SXM2-32GB", 32510, 8) == {
        "aliyun.accelerator/nvidia_name": "Tesla-V100-SXM2-32GB",
        "aliyun.accelerator/nvidia_mem": "32510MiB",
        "aliyun.accelerator/nvidia_count": "8",
    }
