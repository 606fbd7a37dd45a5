"""Choosing GPUs inside a node, the policies' key decisions, and the scheduler's tie-break."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import limits, pod
from sharegpu.core.annotations import Allocation
from sharegpu.core.errors import ValidationError
from sharegpu.core.modes import Mode, Placement
from sharegpu.core.placement import available, get_policy
from sharegpu.core.placement.fragmentation import TargetWorkload, fragmentation
from sharegpu.core.placement.gpus import assign
from sharegpu.core.request import ContainerRequest, Kind, PodRequest, parse_pod
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.core.topology import best_set, matrix_from_kinds


def req(name="p", labels=None, containers=None, **res):
    return parse_pod(pod(name, containers=containers or [limits(**res)], labels=labels))


def fill(state, node, per_gpu):
    for g, used in enumerate(per_gpu):
        if used:
            state.reserve(req(f"fill-{node}-{g}", mem=used), node, Allocation(mem={0: {g: used}}))


def test_binpack_fills_one_gpu_before_the_next():
    # seed 000: 4 GPUs x 15 GiB under binpack end up 15/15 9/15 0/15 0/15
    s = ClusterState([NodeSpec("n", [15] * 4, placement=Placement.BINPACK)])
    sched = Scheduler(s, get_policy("binpack"))
    for i, m in enumerate([5, 5, 5, 4, 5]):
        assert sched.schedule(req(f"p{i}", mem=m)) is not None
    assert [15 - int(x) for x in s.gpu_free[0, :4]] == [15, 9, 0, 0]


def test_spread_puts_pods_on_different_gpus():
    s = ClusterState([NodeSpec("n", [15] * 4, placement=Placement.SPREAD)])
    sched = Scheduler(s, get_policy("binpack"))  # the node label decides inside the node
    for i in range(3):
        sched.schedule(req(f"p{i}", mem=4))
    assert sorted(15 - int(x) for x in s.gpu_free[0, :4]) == [0, 4, 4, 4]


def test_policy_preference_applies_without_a_node_label():
    s = ClusterState([NodeSpec("n", [15] * 4)])
    sched = Scheduler(s, get_policy("spread"))
    for i in range(4):
        sched.schedule(req(f"p{i}", mem=4))
    assert [15 - int(x) for x in s.gpu_free[0, :4]] == [4, 4, 4, 4]


def test_binpack_prefers_the_fuller_node_and_spread_the_emptier():
    s = ClusterState([NodeSpec("a", [16, 16]), NodeSpec("b", [16, 16])])
    fill(s, "b", [8, 0])
    assert Scheduler(s, get_policy("binpack")).decide(req(mem=2)).node_name == "b"
    assert Scheduler(s, get_policy("spread")).decide(req(mem=2)).node_name == "a"


def test_multi_gpu_shared_request_takes_k_gpus():
    s = ClusterState([NodeSpec("n", [16] * 4)])
    fill(s, "n", [10, 0, 12, 0])
    r = req(mem=8, labels={"aliyun.com/gpu-count": "2"})
    a = assign(s, r, 0, "bestfit")
    assert a is not None and a.mem == {0: {0: 4, 2: 4}}  # the two tightest that fit: 6 and 4 free


def test_multi_container_pod_shares_a_gpu_and_respects_the_sum():
    s = ClusterState([NodeSpec("n", [8, 8])])
    r = req(containers=[limits("a", mem=3), limits("b", mem=5)])
    a = assign(s, r, 0, "bestfit")
    assert a is not None and a.mem == {0: {0: 3}, 1: {0: 5}}
    s.reserve(r, 0, a)
    assert int(s.gpu_pods[0, 0]) == 1  # one pod, counted once on its GPU
    too_big = req("q", containers=[limits("a", mem=6), limits("b", mem=6), limits("c", mem=6)])
    assert not s.feasible(too_big)[0]
    assert s.explain(too_big, "n") is not None


def test_whole_cards_pick_free_gpus():
    s = ClusterState([NodeSpec("n", [16] * 4, mode=Mode.EXCLUSIVE)])
    s.reserve(req("a", nvidia=1), "n", Allocation(mem={0: {0: 16}}))
    a = assign(s, req("b", nvidia=2), 0, "bestfit")
    assert a is not None and sorted(a.mem[0]) == [1, 2]


def test_topology_picks_the_best_connected_set():
    kinds = [
        ["X", "NV2", "SYS", "SYS"],
        ["NV2", "X", "SYS", "SYS"],
        ["SYS", "SYS", "X", "NV1"],
        ["SYS", "SYS", "NV1", "X"],
    ]
    links = matrix_from_kinds(kinds)
    assert best_set(links, [0, 1, 2, 3], 2) == (0, 1)
    assert best_set(links, [1, 2, 3], 2) == (2, 3)
    s = ClusterState([NodeSpec("n", [16] * 4, mode=Mode.TOPOLOGY, links=links)])
    s.reserve(req("a", topo=1), "n", Allocation(mem={0: {0: 16}}))
    a = Scheduler(s, get_policy("binpack")).decide(req("b", topo=2)).alloc
    assert sorted(a.mem[0]) == [2, 3]


def test_unknown_link_kind_refused():
    with pytest.raises(ValueError, match="unknown GPU link kind"):
        matrix_from_kinds([["X", "QPI"], ["QPI", "X"]])


def test_registry_lists_every_policy_and_refuses_unknown_names():
    assert {"random", "dotprod", "clustering", "packing", "bestfit", "fgd", "binpack",
            "spread"} <= set(available())
    with pytest.raises(ValidationError, match="policy='nope': must be one of: default"):
        get_policy("nope")


def test_ties_go_to_the_first_node_in_order():
    s = ClusterState([NodeSpec(f"n{i}", [16]) for i in range(5)])
    s.set_order([3, 1, 4, 0, 2])
    d = Scheduler(s, get_policy("bestfit")).decide(req(mem=2))
    assert d.node_name == "n3"  # rank 0
    seen = {Scheduler(s, get_policy("bestfit"), seed=k, tie_break="random").decide(
        req(mem=2)).node_name for k in range(40)}
    assert len(seen) > 1


def sim_pod(cpu, milli, k=1):
    c = ContainerRequest(0, "main", gpu_mem=milli, gpus=k)
    return PodRequest("t", f"p{cpu}-{milli}", Kind.SHARED, (c,), cpu_milli=cpu)


def test_fragmentation_of_a_node():
    wl = TargetWorkload.from_shapes([(1000, 500, 1, "")] * 3 + [(1000, 0, 0, "")])
    assert np.allclose(wl.p, [0.75, 0.25])
    access = wl.access({"": 0})
    free = np.array([[1000, 300, 0, 0]])
    f = fragmentation(free, np.array([8000]), np.array([0]), wl, access)
    # the 500 shape fits (GPU 0) so only GPU 1's 300 is fragment; the CPU-only shape: all 1300
    assert f[0] == pytest.approx(0.75 * 300 + 0.25 * 1300)
    f = fragmentation(free, np.array([500]), np.array([0]), wl, access)  # CPU does not fit
    assert f[0] == pytest.approx(1300)


def test_fgd_places_a_small_pod_where_it_fills_a_hole():
    # shapes: mostly 500-milli pods. Node a has a GPU with 300 free (a hole no 500 pod can use);
    # a 300 pod should go there and close it, not open a new GPU on node b.
    wl = TargetWorkload.from_shapes([(1000, 500, 1, "")] * 9 + [(1000, 300, 1, "")])
    s = ClusterState([NodeSpec(n, [1000, 1000], cpu_milli=32000, mem_mib=64000) for n in "ab"])
    s.reserve(sim_pod(1000, 700), "a", Allocation(mem={0: {0: 700}}))
    pol = get_policy("fgd")
    pol.prepare(s, wl)
    d = Scheduler(s, pol).decide(sim_pod(1000, 300))
    assert d.node_name == "a" and d.alloc.mem == {0: {0: 300}}
    # a 500 pod must not go into the 300 hole (it cannot) and should not split a fresh GPU of a
    # node that... takes the other GPU of node a or a GPU of b; either way F grows the same
    d = Scheduler(s, pol).decide(sim_pod(1000, 500))
    assert d.alloc.mem[0] != {0: 500}


def test_fgd_scores_match_a_direct_computation():
    wl = TargetWorkload.from_shapes(
        [(2000, 500, 1, "")] * 5 + [(4000, 1000, 1, "")] * 3 + [(8000, 0, 0, "")] * 2
    )
    rng = np.random.default_rng(0)
    s = ClusterState([NodeSpec(f"n{i}", [1000] * int(rng.choice([2, 4, 8])), cpu_milli=32000,
                               mem_mib=10**6) for i in range(12)])
    pol = get_policy("fgd")
    pol.prepare(s, wl)
    sched = Scheduler(s, pol, seed=0)
    for _ in range(30):
        sched.schedule(sim_pod(int(rng.choice([1000, 2000])), int(rng.choice([200, 500, 1000]))))
    p = sim_pod(1500, 400)
    nodes = sched.candidates(p)
    got = pol.score(s, p, nodes)
    access = wl.access(s.models)
    for j, n in enumerate(nodes):
        free = s.gpu_free[n : n + 1].copy()
        before = fragmentation(free, s.cpu_free[n : n + 1], s.model[n : n + 1], wl, access)[0]
        best = -1.0
        for g in range(int(s.gpu_count[n])):
            if free[0, g] >= 400:
                after_free = free.copy()
                after_free[0, g] -= 400
                after = fragmentation(after_free, s.cpu_free[n : n + 1] - 1500,
                                      s.model[n : n + 1], wl, access)[0]
                best = max(best, np.floor(100 / (1 + np.exp(-(before - after) / 1000))))
        assert got[j] == best


def test_fgd_in_gib_units_scores_like_in_milli_units():
    # the same decision as test_fgd_places_a_small_pod_where_it_fills_a_hole, with 16 GiB GPUs:
    # scores are scaled by one GPU, so they do not all collapse to 50
    wl = TargetWorkload.from_shapes([(0, 8, 1, "")] * 9 + [(0, 4, 1, "")])
    s = ClusterState([NodeSpec(n, [16, 16]) for n in "ab"])
    s.reserve(req("hole", mem=12), "a", Allocation(mem={0: {0: 12}}))
    pol = get_policy("fgd")
    pol.prepare(s, wl)
    scores = pol.score(s, req("small", mem=4), np.array([0, 1]))
    assert scores[0] > scores[1]
    d = Scheduler(s, pol).decide(req("small", mem=4))
    assert d.node_name == "a" and d.alloc.mem == {0: {0: 4}}
