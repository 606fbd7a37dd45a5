"""The extender's cluster view: reasons per node, scores that let the core policy decide,
reservations in flight, events applied incrementally, rebuild from annotations."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sharegpu.core.annotations import encode
from sharegpu.core.nodes import spec_from_node
from sharegpu.core.placement.base import get_policy
from sharegpu.core.request import parse_pod
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState
from sharegpu.extender.view import UNKNOWN_NODE, ClusterView, default_workload
from sharegpu_testing import kobjects


def nodes() -> list[dict]:
    return [
        kobjects.node("shared-a", [16, 16], "cgpu"),
        kobjects.node("shared-b", [32, 32, 32, 32], "cgpu"),
        kobjects.node("core", [16, 16], "core_mem"),
        kobjects.node("whole", [24] * 4, "default"),
        kobjects.node("topo", [80] * 8, "topology"),
    ]


def view(policy: str = "default") -> ClusterView:
    v = ClusterView(policy)
    v.reset(nodes(), [])
    return v


def bound_pod(name: str, node: str, alloc, **kw) -> dict:
    p = kobjects.pod(name, node_name=node, **kw)
    p["metadata"]["annotations"] = encode(alloc, assume_time_ns=1)
    return p


ALL = ["shared-a", "shared-b", "core", "whole", "topo", "cpu-only"]


def test_filter_gives_one_reason_per_rejected_node() -> None:
    v = view()
    req = parse_pod(kobjects.pod("p", mem=20))
    passed, failed, unres = v.filter(req, ALL)
    assert passed == ["shared-b"]
    assert failed == {}
    assert unres == {
        "shared-a": "asks 20 GPU memory per GPU; the largest GPU has 16",
        "core": "asks 20 GPU memory per GPU; the largest GPU has 16",
        "whole": "node is in GPU mode 'default'; a shared GPU request needs "
                 "ack.node.gpu.schedule=cgpu/core_mem/mps/share",
        "topo": "node is in GPU mode 'topology'; a shared GPU request needs "
                "ack.node.gpu.schedule=cgpu/core_mem/mps/share",
        "cpu-only": UNKNOWN_NODE,
    }


def test_filter_resolvable_failures_are_separate() -> None:
    v = view()
    for i in range(2):
        r = v.reserve(parse_pod(kobjects.pod(f"f{i}", mem=12)), "shared-a")
        v.bound(r.request.key)
    passed, failed, unres = v.filter(parse_pod(kobjects.pod("p", mem=8)), ["shared-a"])
    assert passed == []
    # the node could take the pod once others leave: preemption may help, so not unresolvable
    assert failed == {"shared-a": "insufficient GPU memory in one device: needs 8 on 1 GPU(s), "
                                  "the most free on one GPU is 4"}
    assert unres == {}


def test_pods_without_gpu_pass_everywhere() -> None:
    v = view()
    req = parse_pod(kobjects.pod("p", containers=[{}]))
    assert v.filter(req, ALL) == (ALL, {}, {})
    assert set(v.prioritize(req, ALL).values()) == {0}


@pytest.mark.parametrize("graded", [False, True])
def test_prioritize_gives_ten_to_the_core_pick_only(graded: bool) -> None:
    v = view()
    v.graded = graded
    req = parse_pod(kobjects.pod("p", mem=4))
    scores = v.prioritize(req, ALL)
    tens = [n for n, s in scores.items() if s == 10]
    assert len(tens) == 1
    d = v.scheduler.decide(req)
    assert d is not None and tens == [d.node_name]
    others = [s for n, s in scores.items() if n != tens[0]]
    if graded:  # the other feasible nodes in the policy's order
        assert all(0 <= s <= 9 for s in others) and any(others)
    else:
        assert set(others) == {0}
    assert scores["whole"] == scores["topo"] == scores["cpu-only"] == 0


def _simulate(policy: str, node_objs: list[dict], pods: list[dict]) -> list[str | None]:
    """The simulator's way: the core Scheduler over a ClusterState of the same nodes."""
    state = ClusterState([spec_from_node(n) for n in node_objs])
    pol = get_policy(policy)
    pol.prepare(state, default_workload(state))
    sched = Scheduler(state, pol, tie_break="order")
    out = []
    for p in pods:
        d = sched.schedule(parse_pod(p))
        out.append(d.node_name if d else None)
    return out


def _extender(policy: str, node_objs: list[dict], pods: list[dict]) -> list[str | None]:
    """kube-scheduler's way: prioritize, take the best total (extender weight dominates), bind."""
    v = ClusterView(policy, workload_refresh=10**9)  # keep the default workload, as above
    v.reset(node_objs, [])
    names = [n["metadata"]["name"] for n in node_objs]
    out: list[str | None] = []
    for p in pods:
        req = parse_pod(p)
        passed, _, _ = v.filter(req, names)
        if not passed:
            out.append(None)
            continue
        scores = v.prioritize(req, passed)
        # kube-scheduler adds its own scores (0..100 per plugin); weight 100000 × 10 wins anyway
        own = {n: random.Random(n).randint(0, 400) for n in passed}
        best = max(passed, key=lambda n: scores[n] * 100_000 + own[n])
        r = v.reserve(req, best)
        v.bound(r.request.key)
        out.append(best)
    return out


def test_placement_matches_the_simulator() -> None:
    rng = random.Random(7)
    node_objs = [kobjects.node(f"n{i:02d}", [rng.choice([16, 32])] * rng.choice([1, 2, 4, 8]),
                               rng.choice(["cgpu", "cgpu", "core_mem", "default"]))
                 for i in range(30)]
    pods = []
    for i in range(200):
        k = rng.random()
        if k < 0.5:
            pods.append(kobjects.pod(f"p{i}", mem=rng.choice([1, 2, 4, 8, 16])))
        elif k < 0.7:
            pods.append(kobjects.pod(f"p{i}", mem=rng.choice([2, 4]), core=rng.choice([20, 50])))
        elif k < 0.85:
            pods.append(kobjects.pod(f"p{i}", mem=8, gpu_count=2))
        else:
            pods.append(kobjects.pod(f"p{i}", cards=rng.choice([1, 2])))
    for policy in ("default", "bestfit", "spread"):
        sim = _simulate(policy, node_objs, pods)
        ext = _extender(policy, node_objs, pods)
        assert ext == sim, policy
        assert sum(x is not None for x in sim) > 100


def test_reserve_explains_and_release_restores() -> None:
    v = view()
    before = v.fingerprint()
    req = parse_pod(kobjects.pod("p", mem=8, core=50))
    r = v.reserve(req, "core")
    assert r.alloc.per_gpu_core() and "default/p" in v.inflight
    v.release_inflight("default/p")
    assert v.fingerprint() == before and not v.inflight
    try:
        v.reserve(parse_pod(kobjects.pod("q", mem=8, core=50)), "shared-a")
    except Exception as e:
        assert "shared-core GPU request needs ack.node.gpu.schedule=core_mem" in str(e)
    else:
        raise AssertionError("reserve on a cgpu node must fail for a compute request")


def test_watch_events_apply_incrementally_and_stale_ones_are_ignored() -> None:
    from sharegpu.core.annotations import Allocation

    v = view()
    alloc = Allocation(mem={0: {1: 6}})
    p = bound_pod("a", "shared-a", alloc, mem=6)
    v.upsert_pod(p)
    assert v.state.pods["default/a"].alloc.per_gpu_mem() == {1: 6}
    i = v.state.index["shared-a"]
    assert int(v.state.gpu_free[i, 1]) == 10
    # an older event (annotations written, not yet bound) arriving late changes nothing
    stale = bound_pod("a", "", alloc, mem=6)
    stale["spec"].pop("nodeName", None)
    v.upsert_pod(stale)
    assert "default/a" in v.state.pods
    # the pod finishes: its GPUs are free again
    done = bound_pod("a", "shared-a", alloc, mem=6)
    done["status"]["phase"] = "Succeeded"
    v.upsert_pod(done)
    assert "default/a" not in v.state.pods and int(v.state.gpu_free[i, 1]) == 16
    v.upsert_pod(p)
    v.delete_pod(p)
    assert "default/a" not in v.state.pods
    assert v.drift() == []


def test_events_for_a_pod_in_flight_do_not_touch_its_reservation() -> None:
    v = view()
    r = v.reserve(parse_pod(kobjects.pod("a", mem=4)), "shared-a")
    unbound = kobjects.pod("a", mem=4)
    v.upsert_pod(unbound)  # the watch shows the pod before our annotations land
    assert v.state.pods["default/a"] is r
    v.bound("default/a")
    assert v.state.pods["default/a"].bound and v.drift() == []


def test_reset_rebuilds_from_annotations_and_counts_over_commits() -> None:
    """A bound pod whose annotations over-commit its GPU is counted as they say (the GPU is
    overfull: nothing more lands there) and reported (a problem, the over-commit gauge), not
    left out of the books, which would show the GPU emptier than it is; the same when its
    record arrives by a watch event, and until it ends."""
    from sharegpu.core.annotations import Allocation
    from sharegpu.extender.metrics import Metrics

    v = ClusterView()
    pods = [bound_pod("a", "shared-a", Allocation(mem={0: {0: 10}}), mem=10),
            bound_pod("b", "shared-a", Allocation(mem={0: {0: 10}}), mem=10),  # over-commit
            bound_pod("c", "core", Allocation(mem={0: {1: 4}}, core={0: {1: 40}}), mem=4,
                      core=40),
            bound_pod("d", "gone-node", Allocation(mem={0: {0: 1}}), mem=1),
            bound_pod("e", "shared-a", Allocation(mem={0: {7: 1}}), mem=1)]  # no GPU 7
    bad = v.reset(nodes(), pods)
    assert bad == 1  # e: its GPU does not exist, nothing to count
    assert set(v.state.pods) == {"default/a", "default/b", "default/c"}
    assert "default/b" in v.problems and "over-commit" in v.problems["default/b"]
    assert "counted as they say" in v.problems["default/b"]
    assert "GPUs the node does not have" in v.problems["default/e"]
    i = v.state.index["shared-a"]
    assert int(v.state.gpu_free[i, 0]) == 16 - 20  # overfull
    assert v.overcommitted == {"default/b": "shared-a"}
    assert b"sharegpu_extender_overcommitted_pods 1.0" in Metrics(lambda: v).render()
    assert v.drift() == []  # the books say what the annotations say: nothing to repair
    i = v.state.index["core"]
    assert int(v.state.core_free[i, 1]) == 60
    # nothing more lands on the overfull GPU; the node's other GPU still takes pods
    st = v.state
    probe = parse_pod(kobjects.pod("p", mem=1))
    r = v.reserve(probe, "shared-a")
    assert set(r.alloc.per_gpu_mem()) == {1}
    v.release_inflight(probe.key)
    # with GPU 1 full too, the node takes nothing, and the filter says why
    v.upsert_pod(bound_pod("g", "shared-a", Allocation(mem={0: {1: 16}}), mem=16))
    passed, failed, _ = v.filter(probe, ["shared-a", "shared-b"])
    assert passed == ["shared-b"] and "shared-a" in failed
    v.delete_pod(bound_pod("g", "shared-a", Allocation(mem={0: {1: 16}}), mem=16))
    # the node of pod d appears later: the pod holds its GPU from then on
    v.upsert_node(kobjects.node("gone-node", [8], "cgpu"))
    assert "default/d" in v.state.pods
    # by a watch event: another over-commit on GPU 0 is counted too
    v.upsert_pod(bound_pod("f", "shared-a", Allocation(mem={0: {0: 4}}), mem=4))
    assert int(st.gpu_free[st.index["shared-a"], 0]) == 16 - 24
    assert set(v.overcommitted) == {"default/b", "default/f"}
    # pods ending give back what they held; the GPU is full, then has room again
    for name in ("b", "f"):
        v.delete_pod(bound_pod(name, "shared-a", Allocation(mem={0: {0: 10}}), mem=10))
    assert v.overcommitted == {} and int(st.gpu_free[st.index["shared-a"], 0]) == 6
    assert v.drift() == []


def test_node_update_and_bad_node_keep_pods() -> None:
    from sharegpu.core.annotations import Allocation

    v = view()
    v.upsert_pod(bound_pod("a", "shared-a", Allocation(mem={0: {0: 10}}), mem=10))
    bad = kobjects.node("shared-a", [16, 16], "cgpu")
    bad["metadata"]["annotations"]["sharegpu.io/gpu-mem"] = "16,zero"
    v.upsert_node(bad)  # unreadable: the last good view of the node is kept
    assert "default/a" in v.state.pods and "node/shared-a" in v.problems
    v.upsert_pod(bound_pod("b", "shared-a", Allocation(mem={0: {1: 2}}), mem=2))
    v.upsert_node(kobjects.node("shared-a", [16], "cgpu"))  # drops GPU 1 that b holds
    assert "refused" in v.problems["node/shared-a"]
    assert int(v.state.gpu_count[v.state.index["shared-a"]]) == 2
    assert {"default/a", "default/b"} <= set(v.state.pods)
    v.delete_node("shared-a")
    assert "default/a" not in v.state.pods
    v.upsert_node(kobjects.node("shared-a", [16, 16], "cgpu"))
    assert "default/a" in v.state.pods  # its annotations still say so


def test_workload_is_learnt_from_pods() -> None:
    v = ClusterView(workload_refresh=5)
    v.reset(nodes(), [])
    assert v.workload is not None and len(v.shapes) == 0
    for i in range(6):
        r = v.reserve(parse_pod(kobjects.pod(f"p{i}", mem=2)), "shared-b")
        v.bound(r.request.key)
    v.maybe_refresh_workload()
    assert list(v.workload.gpu) == [2] and np.isclose(v.workload.p.sum(), 1.0)


def test_workload_is_handed_over_again_only_when_it_moved() -> None:
    v = ClusterView(workload_refresh=5)
    v.reset([kobjects.node(f"n{i}", [32] * 8, "cgpu") for i in range(10)], [])
    n = 0

    def place(mem: int, count: int) -> None:
        nonlocal n
        for _ in range(count):
            req = parse_pod(kobjects.pod(f"p{n}", mem=mem))
            n += 1
            d = v.scheduler.decide(req)
            assert d is not None
            v.bound(v.reserve(req, d.node_name).request.key)
            v.maybe_refresh_workload()

    place(2, 6)
    learnt = v.workload
    assert learnt is not None and list(learnt.gpu) == [2]
    place(2, 20)  # same shapes, more of them: the policy keeps its caches
    assert v.workload is learnt
    place(8, 40)  # the mix moved: re-learnt
    assert v.workload is not learnt and set(v.workload.gpu.tolist()) == {2, 8}


def test_topology_pods_get_the_best_connected_gpus() -> None:
    import json

    from sharegpu.core import names

    links = [["X", "SYS", "SYS", "SYS"], ["SYS", "X", "NV2", "SYS"],
             ["SYS", "NV2", "X", "SYS"], ["SYS", "SYS", "SYS", "X"]]
    node = kobjects.node("t", [80] * 4, "topology")
    node["metadata"]["annotations"][names.ANN_NODE_GPU_TOPOLOGY] = json.dumps(links)
    v = ClusterView()
    v.reset([node], [])
    r = v.reserve(parse_pod(kobjects.pod("p", topology=2)), "t")
    assert r.alloc.gpus == (1, 2)  # the NVLink pair, not the lowest indices
