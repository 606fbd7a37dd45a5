"""Cluster state: per-GPU rules, reserve/release, and rebuild from annotations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import limits, pod
from sharegpu.core.annotations import Allocation, encode
from sharegpu.core.errors import PlacementError
from sharegpu.core.modes import Mode
from sharegpu.core.placement import get_policy
from sharegpu.core.pods import placement_of
from sharegpu.core.request import parse_pod
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState, NodeSpec, rebuild


def req(name="p", labels=None, **res):
    return parse_pod(pod(name, containers=[limits(**res)], labels=labels))


def test_reserve_and_release():
    s = ClusterState([NodeSpec("n1", [15, 15])])
    r = req(mem=4)
    s.reserve(r, "n1", Allocation(mem={0: {1: 4}}))
    assert list(s.gpu_free[0, :2]) == [15, 11]
    assert s.gpu_pods[0, 1] == 1
    v = s.version[0]
    s.release(r.key)
    assert list(s.gpu_free[0, :2]) == [15, 15] and s.gpu_pods[0, 1] == 0
    assert s.version[0] > v


def test_over_commit_of_memory_refused_and_state_unchanged():
    s = ClusterState([NodeSpec("n1", [8])])
    s.reserve(req("a", mem=6), "n1", Allocation(mem={0: {0: 6}}))
    before = s.fingerprint()
    with pytest.raises(PlacementError, match="GPU 0 has 2 memory free, 3 asked"):
        s.reserve(req("b", mem=3), "n1", Allocation(mem={0: {0: 3}}))
    assert s.fingerprint() == before


def test_over_commit_of_compute_refused():
    s = ClusterState([NodeSpec("n1", [15], mode=Mode.CORE_MEM)])
    s.reserve(req("a", mem=1, core=60), "n1", Allocation(mem={0: {0: 1}}, core={0: {0: 60}}))
    with pytest.raises(PlacementError, match="40 percent compute free, 50 percent asked"):
        s.reserve(req("b", mem=1, core=50), "n1", Allocation(mem={0: {0: 1}}, core={0: {0: 50}}))


def test_twenty_pods_per_gpu():
    s = ClusterState([NodeSpec("n1", [100])])
    for i in range(20):
        s.reserve(req(f"p{i}", mem=1), "n1", Allocation(mem={0: {0: 1}}))
    assert not s.feasible(req("x", mem=1))[0]
    assert s.explain(req("x", mem=1), "n1") == (
        "GPUs with room hold 20 pods already (per-GPU limit)"
    )
    with pytest.raises(PlacementError, match="already holds 20 pods"):
        s.reserve(req("x", mem=1), "n1", Allocation(mem={0: {0: 1}}))


def test_memory_only_and_compute_pods_do_not_mix_on_a_node():
    s = ClusterState([NodeSpec("n1", [15, 15], mode=Mode.CORE_MEM)])
    s.reserve(req("a", mem=2), "n1", Allocation(mem={0: {0: 2}}))
    compute = req("b", mem=2, core=30)
    assert not s.feasible(compute)[0]
    assert "memory-only GPU pods" in s.explain(compute, "n1")
    s.release("default/a")
    assert s.feasible(compute)[0]
    s.reserve(compute, "n1", Allocation(mem={0: {0: 2}}, core={0: {0: 30}}))
    assert not s.feasible(req("c", mem=1))[0]


def test_modes_admit_their_kinds_only():
    s = ClusterState([
        NodeSpec("ex", [16], mode=Mode.EXCLUSIVE), NodeSpec("sh", [16], mode=Mode.CGPU),
        NodeSpec("cm", [16], mode=Mode.CORE_MEM), NodeSpec("tp", [16, 16], mode=Mode.TOPOLOGY),
    ])
    assert list(s.feasible(req(mem=2))) == [False, True, True, False]
    assert list(s.feasible(req(mem=2, core=10))) == [False, False, True, False]
    assert list(s.feasible(req(nvidia=1))) == [True, False, False, False]
    assert list(s.feasible(req(topo=2))) == [False, False, False, True]
    assert s.explain(req(topo=2), "sh") == (
        "node is in GPU mode 'cgpu'; a topology GPU request needs ack.node.gpu.schedule=topology"
    )


def test_gpus_of_different_sizes():
    s = ClusterState([NodeSpec("n1", [16, 32])])
    big = req(mem=20)
    assert s.feasible(big)[0]
    d = Scheduler(s, get_policy("binpack")).schedule(big)
    assert d is not None and d.alloc.mem == {0: {1: 20}}
    assert s.explain(req("x", mem=40), "n1") == (
        "asks 40 GPU memory per GPU; the largest GPU has 32"
    )


def test_insufficient_memory_in_one_device_reason():
    s = ClusterState([NodeSpec("n1", [8, 8])])
    s.reserve(req("a", mem=5), "n1", Allocation(mem={0: {0: 5}}))
    s.reserve(req("b", mem=5), "n1", Allocation(mem={0: {1: 5}}))
    assert s.explain(req("c", mem=4), "n1") == (
        "insufficient GPU memory in one device: needs 4 on 1 GPU(s), the most free on one GPU is 3"
    )


def test_whole_card_takes_the_whole_gpu():
    s = ClusterState([NodeSpec("n1", [16, 16], mode=Mode.EXCLUSIVE)])
    r = req(nvidia=1)
    s.reserve(r, "n1", Allocation(mem={0: {1: 0}}))
    assert list(s.gpu_free[0, :2]) == [16, 0] and list(s.core_free[0, :2]) == [100, 0]
    assert s.pods[r.key].alloc.mem == {0: {1: 16}}


def test_allocation_must_match_the_request():
    s = ClusterState([NodeSpec("n1", [16, 16])])
    with pytest.raises(PlacementError, match="asks 4 per GPU, allocation gives 3"):
        s.reserve(req(mem=4), "n1", Allocation(mem={0: {0: 3}}))
    with pytest.raises(PlacementError, match="needs 2 GPU"):
        s.reserve(req(mem=8, labels={"aliyun.com/gpu-count": "2"}), "n1",
                  Allocation(mem={0: {0: 4}}))
    with pytest.raises(PlacementError, match="GPU 5 does not exist"):
        s.reserve(req(mem=4), "n1", Allocation(mem={0: {5: 4}}))
    assert s.fingerprint()["n1"][0] == (16, 16)


def test_node_update_keeps_pods_or_refuses():
    s = ClusterState([NodeSpec("n1", [16, 16])])
    s.reserve(req(mem=10), "n1", Allocation(mem={0: {1: 10}}))
    s.add_node(NodeSpec("n1", [16, 16, 16]))
    assert list(s.gpu_free[0, :3]) == [16, 6, 16]
    # a mode change keeps the pods that hold GPUs; new shared pods no longer fit
    s.add_node(NodeSpec("n1", [16, 16, 16], mode=Mode.EXCLUSIVE))
    assert list(s.gpu_free[0, :3]) == [16, 6, 16] and "default/p" in s.pods
    assert not s.feasible(req("q", mem=1))[0]
    with pytest.raises(PlacementError, match="drops GPU 1 that default/p holds"):
        s.add_node(NodeSpec("n1", [16]))
    assert list(s.gpu_free[0, :3]) == [16, 6, 16]


def test_node_removal_releases_its_pods():
    s = ClusterState([NodeSpec("n1", [16]), NodeSpec("n2", [16])])
    s.reserve(req("a", mem=3), "n1", Allocation(mem={0: {0: 3}}))
    assert s.remove_node("n1") == ["default/a"]
    assert "default/a" not in s.pods
    assert list(s.feasible(req("b", mem=3))) == [False, True]


def test_state_grows_past_its_initial_capacity():
    s = ClusterState()
    for i in range(40):
        s.add_node(NodeSpec(f"n{i}", [8] * (1 + i % 9)))
    assert s.n == 40 and s.width == 9
    assert int(s.gpu_total[: s.n].sum()) == sum(8 * (1 + i % 9) for i in range(40))


node_specs = st.lists(
    st.tuples(st.sampled_from([Mode.CGPU, Mode.CORE_MEM, Mode.EXCLUSIVE, Mode.TOPOLOGY]),
              st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=4)),
    min_size=1, max_size=6,
)
pod_shapes = st.lists(
    st.one_of(
        st.builds(lambda m: {"mem": m}, st.integers(1, 24)),
        st.builds(lambda m, c: {"mem": m, "core": c}, st.integers(1, 12), st.sampled_from([5, 20, 50])),
        st.builds(lambda k: {"mem": 2 * k, "_count": k}, st.integers(1, 3)),
        st.builds(lambda k: {"nvidia": k}, st.integers(1, 2)),
        st.builds(lambda k: {"topo": k}, st.integers(1, 2)),
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node_specs, pod_shapes, st.sampled_from(["binpack", "spread", "bestfit", "random"]))
def test_rebuild_from_annotations_equals_the_live_state(nodes, shapes, policy):
    specs = [NodeSpec(f"n{i}", mem, mode=mode) for i, (mode, mem) in enumerate(nodes)]
    live = ClusterState(specs)
    sched = Scheduler(live, get_policy(policy), seed=1)
    objects = []
    for i, shape in enumerate(shapes):
        shape = dict(shape)
        count = shape.pop("_count", None)
        labels = {"aliyun.com/gpu-count": str(count)} if count else None
        obj = pod(f"p{i}", containers=[limits(**shape)], labels=labels)
        d = sched.schedule(parse_pod(obj))
        if d is None:
            continue
        obj["metadata"]["annotations"] = encode(
            live.pods[f"default/p{i}"].alloc, assume_time_ns=i, gpu_capacity=live.gpu_capacity(d.node)
        )
        obj["spec"]["nodeName"] = d.node_name
        objects.append(obj)
    # no GPU is over-committed
    n = live.n
    assert (live.gpu_free[:n] >= 0).all() and (live.core_free[:n] >= 0).all()
    assert (live.gpu_pods[:n] <= 20).all()
    placed = [p for p in (placement_of(o) for o in objects) if p is not None]
    rebuilt, problems = rebuild(specs, placed)
    assert problems == []
    assert rebuilt.fingerprint() == live.fingerprint()


def test_rebuild_reports_bad_records_without_applying_them():
    specs = [NodeSpec("n1", [8])]
    a = (req("a", mem=6), "n1", Allocation(mem={0: {0: 6}}))
    b = (req("b", mem=6), "n1", Allocation(mem={0: {0: 6}}))  # over-commits GPU 0
    c = (req("c", mem=1), "gone", Allocation(mem={0: {0: 1}}))
    s, problems = rebuild(specs, [a, b, c])
    assert [k for k, _ in problems] == ["default/b", "default/c"]
    assert "node 'gone' is unknown" in problems[1][1]
    assert int(s.gpu_free[0, 0]) == 2


def test_vectorised_feasibility_matches_explain():
    rng = np.random.default_rng(3)
    s = ClusterState([NodeSpec(f"n{i}", list(rng.choice([8, 16], size=4))) for i in range(30)])
    sched = Scheduler(s, get_policy("random"), seed=2)
    for i in range(200):
        sched.schedule(req(f"p{i}", mem=int(rng.integers(1, 9))))
    for m in (1, 4, 8, 12):
        r = req("probe", mem=m)
        mask = s.feasible(r)
        for node in range(s.n):
            assert mask[node] == (s.explain(r, node) is None)
