"""Every validation rule of SPEC §2, with the exact message."""

from __future__ import annotations

import pytest

from conftest import limits, pod
from sharegpu.core.errors import ValidationError
from sharegpu.core.request import Kind, parse_pod

MEM = 'spec.containers[0].resources.limits["aliyun.com/gpu-mem"]'
CORE = 'spec.containers[0].resources.limits["aliyun.com/gpu-core.percentage"]'


def refuse(obj: dict) -> str:
    with pytest.raises(ValidationError) as e:
        parse_pod(obj)
    return str(e.value)


def test_memory_only_request():
    r = parse_pod(pod(containers=[limits(mem=3)]))
    assert r.kind is Kind.SHARED
    assert r.containers[0].gpu_mem == 3 and r.containers[0].gpus == 1
    assert r.total_mem == 3


def test_memory_and_compute_request_as_strings():
    r = parse_pod(pod(containers=[limits(mem="2", core="30")]))
    assert r.kind is Kind.SHARED_CORE
    assert (r.containers[0].gpu_mem, r.containers[0].gpu_core) == (2, 30)


def test_no_gpu_pod():
    r = parse_pod(pod(containers=[{"name": "a", "resources": {"limits": {"cpu": "1"}}}]))
    assert r.kind is Kind.NONE and not r.wants_gpu


@pytest.mark.parametrize("value", [0, -1, "1.5", "500m", "two", True, 1.5])
def test_memory_must_be_a_whole_number_of_gib(value):
    assert refuse(pod(containers=[limits(mem=value)])) == (
        f"{MEM}={value!r}: must be a whole number of GiB, at least 1"
    )


@pytest.mark.parametrize("value", [3, 0, -5, 101, 105, "12", "7.5", "x"])
def test_compute_must_be_a_multiple_of_5_between_5_and_100(value):
    assert refuse(pod(containers=[limits(mem=2, core=value)])) == (
        f"{CORE}={value!r}: must be a multiple of 5 between 5 and 100"
    )


@pytest.mark.parametrize("value", [5, 30, 100])
def test_compute_accepted_values(value):
    assert parse_pod(pod(containers=[limits(mem=2, core=value)])).containers[0].gpu_core == value


def test_compute_needs_memory_in_the_same_container():
    assert refuse(pod(containers=[limits(core=30)])) == (
        f"{CORE}=30: needs aliyun.com/gpu-mem in the same container"
    )


def test_gpu_count_spreads_memory_over_gpus():
    r = parse_pod(pod(containers=[limits(mem=8)], labels={"aliyun.com/gpu-count": "2"}))
    assert r.containers[0].gpu_mem == 4 and r.containers[0].gpus == 2 and r.total_mem == 8


def test_gpu_count_spreads_compute_over_gpus_as_the_kubelet_counts_it():
    # like gpu-mem, the container's gpu-core.percentage is its total over its GPUs: the
    # kubelet hands it that many core devices, so each GPU gets an equal share of it
    r = parse_pod(pod(containers=[limits(mem=8, core=60)], labels={"aliyun.com/gpu-count": "2"}))
    c = r.containers[0]
    assert (c.gpu_mem, c.gpu_core, c.gpus, r.kind) == (4, 30, 2, Kind.SHARED_CORE)
    r = parse_pod(pod(containers=[limits(mem=8, core=200)], labels={"aliyun.com/gpu-count": "2"}))
    assert r.containers[0].gpu_core == 100


@pytest.mark.parametrize("value", [5, 15, 25, 205, 0])
def test_compute_with_gpu_count_must_split_evenly_on_the_5_percent_grid(value):
    assert refuse(pod(containers=[limits(mem=8, core=value)],
                      labels={"aliyun.com/gpu-count": "2"})) == (
        f"{CORE}={value!r}: with the pod label aliyun.com/gpu-count=2, must be a multiple of 10 "
        "between 10 and 200 (each of the 2 GPUs gets gpu-core.percentage / 2, a multiple of 5)"
    )


def test_gpu_mem_must_divide_by_gpu_count():
    assert refuse(pod(containers=[limits(mem=7)], labels={"aliyun.com/gpu-count": "2"})) == (
        f"{MEM}=7: must be divisible by the pod label aliyun.com/gpu-count "
        "(each GPU gets gpu-mem / gpu-count GiB) (gpu-count=2)"
    )


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_gpu_count_label_must_be_positive(value):
    assert refuse(pod(containers=[limits(mem=4)], labels={"aliyun.com/gpu-count": value})) == (
        f'metadata.labels["aliyun.com/gpu-count"]={value!r}: '
        "must be a whole number of GPUs, at least 1"
    )


def test_gpu_count_label_needs_a_memory_request():
    assert refuse(pod(containers=[limits(nvidia=1)], labels={"aliyun.com/gpu-count": "2"})) == (
        "metadata.labels[\"aliyun.com/gpu-count\"]='2': "
        "needs a container that asks for aliyun.com/gpu-mem"
    )


def test_exclusive_and_shared_in_one_container_refused():
    assert refuse(pod(containers=[limits(mem=2, nvidia=1)])) == (
        f"{MEM}=2: cannot be asked for together with nvidia.com/gpu in one container"
    )


def test_topology_and_exclusive_in_one_container_refused():
    msg = refuse(pod(containers=[limits(nvidia=1, topo=2)]))
    assert msg == (
        'spec.containers[0].resources.limits["aliyun.com/gpu"]=2: cannot be asked for together '
        "with nvidia.com/gpu in one container"
    )


def test_kinds_cannot_mix_across_containers():
    msg = refuse(pod(containers=[limits("a", mem=2), limits("b", nvidia=1)]))
    assert msg == (
        "spec.containers[1].resources='exclusive': cannot be mixed with shared in one pod: "
        "a node runs one GPU mode"
    )


def test_memory_only_and_memory_compute_containers_cannot_mix():
    msg = refuse(pod(containers=[limits("a", mem=2), limits("b", mem=2, core=10)]))
    assert msg == (
        "spec.containers[1].resources='shared-core': containers that ask for aliyun.com/gpu-mem "
        "only and containers that also ask for aliyun.com/gpu-core.percentage cannot run in one "
        "pod (a node cannot mix them)"
    )


def test_requests_must_equal_limits():
    c = {"name": "a", "resources": {"limits": {"aliyun.com/gpu-mem": 2},
                                    "requests": {"aliyun.com/gpu-mem": 3}}}
    assert refuse(pod(containers=[c])) == (
        'spec.containers[0].resources.requests["aliyun.com/gpu-mem"]=3: '
        "requests must equal limits for GPU resources"
    )


def test_requests_alone_are_read():
    c = {"name": "a", "resources": {"requests": {"aliyun.com/gpu-mem": "4"}}}
    assert parse_pod(pod(containers=[c])).containers[0].gpu_mem == 4


def test_gpu_count_as_container_resource_refused():
    msg = refuse(pod(containers=[limits(mem=2, count=2)]))
    assert msg.startswith('spec.containers[0].resources.limits["aliyun.com/gpu-count"]=2: '
                          "is a node resource")


def test_negative_whole_cards_refused():
    assert refuse(pod(containers=[limits(nvidia=-1)])) == (
        'spec.containers[0].resources.limits["nvidia.com/gpu"]=-1: must be a whole number, at least 0'
    )


def test_gpu_in_init_container_refused():
    obj = pod(containers=[limits(mem=1)])
    obj["spec"]["initContainers"] = [limits("init", mem=1)]
    assert refuse(obj) == (
        'spec.initContainers[0].resources.limits["aliyun.com/gpu-mem"]=1: '
        "GPU resources are not supported in init containers"
    )


def test_pod_without_containers_refused():
    obj = pod()
    obj["spec"]["containers"] = []
    assert refuse(obj) == "spec.containers=[]: a pod needs at least one container"


def test_not_an_object_refused():
    assert refuse([]) == "pod='list': must be a JSON object"  # type: ignore[arg-type]


def test_multi_container_pod_each_container_on_its_own():
    r = parse_pod(pod(containers=[limits("a", mem=1), {"name": "side"}, limits("b", mem=7)]))
    assert [(c.index, c.gpu_mem) for c in r.containers] == [(0, 1), (2, 7)]


def test_whole_cards():
    r = parse_pod(pod(containers=[limits(nvidia=2)]))
    assert r.kind is Kind.EXCLUSIVE and r.containers[0].whole and r.containers[0].gpus == 2
    r = parse_pod(pod(containers=[limits(topo=4)]))
    assert r.kind is Kind.TOPOLOGY and r.containers[0].gpus == 4


def test_zero_whole_cards_is_no_request():
    assert parse_pod(pod(containers=[limits(nvidia=0)])).kind is Kind.NONE
