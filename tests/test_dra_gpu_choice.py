"""DRA mode's in-node GPU choice: the policy picks the node, kube-scheduler's DRA allocator the
GPU — the first device in the slice's order whose remaining capacity holds the claim."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import limits, pod
from sharegpu.cli import main
from sharegpu.core.annotations import Allocation
from sharegpu.core.gpuchoice import FIRSTFIT, assign
from sharegpu.core.modes import Mode
from sharegpu.core.placement import get_policy
from sharegpu.core.placement.fragmentation import TargetWorkload
from sharegpu.core.request import ContainerRequest, Kind, PodRequest, parse_pod
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.core.topology import matrix_from_kinds
from sharegpu.sim import generate
from sharegpu.sim.engine import run_one
from sharegpu.sim.workload import target_workload


def req(name="p", containers=None, **res):
    return parse_pod(pod(name, containers=containers or [limits(**res)]))


def used(state, node=0):
    g = int(state.gpu_count[node])
    return [int(t - f) for t, f in zip(state.gpu_total[node, :g], state.gpu_free[node, :g],
                                       strict=True)]


def fill(state, node, per_gpu):
    for g, m in enumerate(per_gpu):
        if m:
            state.reserve(req(f"fill-{node}-{g}", mem=m), node, Allocation(mem={0: {g: m}}))


def test_first_fit_takes_the_lowest_index_gpu_that_holds_the_request():
    s = ClusterState([NodeSpec("n", [16, 16, 16, 16])])
    fill(s, 0, [12, 8, 14, 0])  # free 4, 8, 2, 16
    r = req(mem=6)
    # 6 GiB: gpu 1 for both (gpu 0 has only 4 free); 2 GiB: best fit takes the tightest (gpu 2,
    # 0 left), the allocator the first (gpu 0)
    assert assign(s, r, 0, FIRSTFIT).mem == {0: {1: 6}}
    assert assign(s, req(mem=2), 0, "bestfit").mem == {0: {2: 2}}
    assert assign(s, req(mem=2), 0, FIRSTFIT).mem == {0: {0: 2}}
    assert assign(s, req(mem=10), 0, FIRSTFIT).mem == {0: {3: 10}}
    assert assign(s, req(mem=17), 0, FIRSTFIT) is None


def test_first_fit_counts_compute_and_the_per_gpu_pod_limit():
    s = ClusterState([NodeSpec("n", [16, 16], mode=Mode.CORE_MEM)], max_pods_per_gpu=2)
    s.reserve(req("a", mem=1, core=60), 0, Allocation(mem={0: {0: 1}}, core={0: {0: 60}}))
    # gpu 0 has memory but not 50 % of compute left: the allocator's capacity check skips it
    assert assign(s, req(mem=2, core=50), 0, FIRSTFIT).mem == {0: {1: 2}}
    s.reserve(req("b", mem=1, core=5), 0, Allocation(mem={0: {0: 1}}, core={0: {0: 5}}))
    # two claims on gpu 0 already (the per-GPU limit; in DRA each claim consumes at least the
    # 5 % step of cores, so at most 20 share a GPU)
    assert assign(s, req(mem=1, core=5), 0, FIRSTFIT).mem == {0: {1: 1}}


def test_first_fit_whole_gpus_in_device_order_ignoring_links():
    links = matrix_from_kinds([["X", "SYS", "SYS", "SYS"], ["SYS", "X", "SYS", "SYS"],
                               ["SYS", "SYS", "X", "NV4"], ["SYS", "SYS", "NV4", "X"]])
    s = ClusterState([NodeSpec("n", [16] * 4, links=links)])
    r = PodRequest("d", "w", Kind.SHARED, (ContainerRequest(0, "main", gpu_mem=16, gpus=2, whole=True),))
    assert sorted(assign(s, r, 0, "topology").mem[0]) == [2, 3]
    assert sorted(assign(s, r, 0, FIRSTFIT).mem[0]) == [0, 1]
    fill(s, 0, [0, 1, 0, 0])
    assert sorted(assign(s, r, 0, FIRSTFIT).mem[0]) == [0, 2]


def test_first_fit_backtracks_over_containers_in_device_order():
    # 10 then 6 on GPUs with 10 and 16 free: first fit puts 10 on gpu 0 and 6 on gpu 1; with
    # 12 first, gpu 0 is too small, gpu 1 takes it, and 6 goes back to gpu 0
    s = ClusterState([NodeSpec("n", [16, 16])])
    fill(s, 0, [6, 0])
    two = req(containers=[limits("a", mem=12), limits("b", mem=6)])
    assert assign(s, two, 0, FIRSTFIT).mem == {0: {1: 12}, 1: {0: 6}}
    # 4 + 10 + 10 on free 10 / 16: greedy first fit dead-ends (4 on gpu 0, 10 on gpu 1, the
    # last 10 nowhere); the allocator backtracks in device order, as the search does: 4 on
    # gpu 1, 10 on gpu 0, 10 on gpu 1
    three = req(containers=[limits("a", mem=4), limits("b", mem=10), limits("c", mem=10)])
    assert assign(s, three, 0, FIRSTFIT).mem == {0: {1: 4}, 1: {0: 10}, 2: {1: 10}}


@pytest.mark.parametrize("policy", ["default", "fgd", "bestfit", "binpack", "spread", "packing"])
def test_allocator_choice_keeps_the_policys_node(policy):
    rng = np.random.default_rng(7)
    nodes = [NodeSpec(f"n{i}", [16] * 4) for i in range(6)]
    s = ClusterState(nodes)
    for i in range(6):
        fill(s, i, [int(x) for x in rng.integers(0, 14, size=4)])
    target = TargetWorkload(cpu=np.zeros(3, np.int64), gpu=np.array([2, 5, 8]),
                            k=np.ones(3, np.int64), p=np.array([0.5, 0.3, 0.2]),
                            models=(None, None, None))
    p0, p1 = get_policy(policy), get_policy(policy)
    p0.prepare(s, target)
    p1.prepare(s, target)
    pol = Scheduler(s, p0)
    dra = Scheduler(s, p1, gpu_choice="allocator")
    differ = 0
    for m in (1, 2, 3, 5):
        a, b = pol.decide(req(mem=m)), dra.decide(req(mem=m))
        assert a is not None and b is not None and a.node == b.node
        assert b.alloc == assign(s, req(mem=m), b.node, FIRSTFIT)
        differ += a.alloc != b.alloc
    assert differ > 0 or policy == "spread"


def test_a_scheduler_refuses_an_unknown_gpu_choice():
    with pytest.raises(ValueError, match="gpu_choice"):
        Scheduler(ClusterState([]), get_policy("bestfit"), gpu_choice="kube")


def test_simulator_runs_with_the_allocators_choice():
    nodes, pods = generate.nodes(), generate.pods()
    own = run_one(nodes, pods, "default", 42, "generated", target_workload(pods))
    dra = run_one(nodes, pods, "default", 42, "generated", target_workload(pods),
                  gpu_choice="allocator")
    assert dra.gpu_choice == "allocator" and own.gpu_choice == "policy"
    assert dra.pods == own.pods and 0 < dra.unallocated_pct < 30
    assert dra.curve != own.curve  # the GPUs differ, and with them what fits later


def test_cli_gpu_choice(capsys):
    assert main(["simulate", "--seeds", "42", "--policy", "bestfit", "--json", "--jobs", "1",
                 "--gpu-choice", "allocator"]) == 0
    r = json.loads(capsys.readouterr().out)["results"][0]
    assert r["gpu_choice"] == "allocator"
