"""Gang scheduling: the pure planner (sharegpu.core.gang) and the extender view's groups, holds and
timeouts (sharegpu.extender.gangs), driven directly with an injected clock."""

from __future__ import annotations

from typing import Any

import pytest

from sharegpu.core.errors import PlacementError, ValidationError
from sharegpu.core.gang import (
    LABEL_GROUP,
    LABEL_GROUP_SHORT,
    LABEL_MIN_AVAILABLE,
    gang_labels,
    plan,
)
from sharegpu.core.placement.base import get_policy
from sharegpu.core.request import parse_pod
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects

NODES = [kobjects.node(f"gpu-{i}", [16] * 4, "cgpu") for i in range(2)]  # 8 GPUs of 16 GiB
NAMES = ["gpu-0", "gpu-1"]


def gpod(name: str, group: str | None = "g", min_available: str | None = "4", mem: int = 16,
         **labels: str) -> dict[str, Any]:
    p = kobjects.pod(name, mem=mem)
    lab = p["metadata"].setdefault("labels", {})
    if group is not None:
        lab[LABEL_GROUP] = group
    if min_available is not None:
        lab[LABEL_MIN_AVAILABLE] = min_available
    lab.update(labels)
    return p


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_view(pods: list[dict[str, Any]]) -> tuple[ClusterView, Clock]:
    v = ClusterView()
    clock = Clock()
    v.gang_clock = clock
    assert v.reset(NODES, pods) == 0
    return v, clock


def req(v: ClusterView, pod: dict[str, Any]) -> Any:
    return v.reader.request(pod)


# -- the pure part ---------------
def test_plan_places_all_or_nothing() -> None:
    st = ClusterState([NodeSpec(f"n{i}", [16] * 4) for i in range(2)])
    sch = Scheduler(st, get_policy("binpack"))
    pods = [parse_pod(gpod(f"p{i}")) for i in range(9)]
    before = st.fingerprint()
    out = plan(sch, pods, 9)
    assert not out.ok and out.placed == [] and out.fit == 8
    assert st.fingerprint() == before and st.pods == {}
    out = plan(sch, pods, 8)
    assert out.ok and len(out.placed) == 8
    assert sorted(st.pods) == sorted(r.key for r, _ in out.placed)
    for i in range(2):  # every GPU full, none over-committed
        assert st.gpu_free[i, :4].tolist() == [0, 0, 0, 0]


def test_plan_stops_when_need_is_out_of_reach() -> None:
    st = ClusterState([NodeSpec("n0", [16])])
    sch = Scheduler(st, get_policy("binpack"))
    pods = [parse_pod(gpod(f"p{i}", mem=20)) for i in range(50)]  # never fits
    out = plan(sch, pods, 50)
    assert out.tried == 1 and not out.ok


@pytest.mark.parametrize(("labels", "field"), [
    ({LABEL_GROUP: "g", LABEL_MIN_AVAILABLE: "abc"}, LABEL_MIN_AVAILABLE),
    ({LABEL_GROUP: "g", LABEL_MIN_AVAILABLE: "0"}, LABEL_MIN_AVAILABLE),
    ({LABEL_GROUP: "g", LABEL_MIN_AVAILABLE: "-3"}, LABEL_MIN_AVAILABLE),
    ({LABEL_MIN_AVAILABLE: "3"}, LABEL_MIN_AVAILABLE),
    ({LABEL_GROUP: "Not_A_Name"}, LABEL_GROUP),
])
def test_bad_labels_name_the_label(labels: dict[str, str], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        gang_labels(labels)
    assert field in str(e.value)


def test_labels() -> None:
    assert gang_labels({}) is None
    assert gang_labels({"app": "x"}) is None
    g = gang_labels({LABEL_GROUP: "train", LABEL_MIN_AVAILABLE: " 3"})
    assert g is not None and (g.name, g.min_available) == ("train", 3)
    g = gang_labels({LABEL_GROUP_SHORT: "train"})
    assert g is not None and (g.name, g.min_available) == ("train", None)


# -- the extender's view ---------------
def test_filter_holds_the_group_and_passes_each_pod_its_node() -> None:
    pods = [gpod(f"a{i}", min_available="6") for i in range(6)]
    v, _ = make_view(pods)
    passed, failed, unres = v.filter(req(v, pods[0]), NAMES)
    holds = v.gang_holds("default/g")
    assert len(holds) == 6 and set(v.inflight) == set(holds)
    assert passed == [holds["default/a0"]] and not unres
    # each pod passes on its held node only, and prioritize gives it 10 there
    for p in pods:
        r = req(v, p)
        passed, failed, _ = v.filter(r, NAMES)
        assert passed == [holds[r.key]]
        assert all("held on node" in why for why in failed.values())
        assert v.prioritize(r, NAMES)[holds[r.key]] == 10
    # a pod outside the group sees the held GPUs as taken: 2 GPUs left
    other = [kobjects.pod(f"o{i}", mem=16) for i in range(3)]
    for o in other:
        v.upsert_pod(o)
    fits = [bool(v.filter(req(v, o), NAMES)[0]) for o in other]
    assert fits == [True, True, True]  # the filter alone reserves nothing
    r0 = v.reserve(req(v, other[0]), v.filter(req(v, other[0]), NAMES)[0][0])
    r1 = v.reserve(req(v, other[1]), v.filter(req(v, other[1]), NAMES)[0][0])
    assert r0 and r1
    assert v.filter(req(v, other[2]), NAMES)[0] == []


def test_group_that_does_not_fit_holds_nothing_and_names_the_group() -> None:
    pods = [gpod(f"a{i}", min_available="8") for i in range(8)]
    big = [gpod(f"b{i}", group="big", min_available="9") for i in range(9)]
    v, _ = make_view([*pods, *big])
    before = v.state.fingerprint()
    passed, failed, _ = v.filter(req(v, big[0]), NAMES)
    assert passed == [] and set(failed) == set(NAMES)
    assert failed["gpu-0"].startswith("gang default/big: 8 of 9 pods fit")
    assert "min-available 9" in failed["gpu-0"]
    assert v.inflight == {} and v.state.fingerprint() == before
    # too few pods exist yet: said without planning
    few = [gpod(f"c{i}", group="few", min_available="5") for i in range(2)]
    for p in few:
        v.upsert_pod(p)
    _, failed, _ = v.filter(req(v, few[0]), NAMES)
    assert "2 of 5 pods can take part" in failed["gpu-0"]


def test_bind_takes_the_hold_and_bound_pods_count_towards_min() -> None:
    pods = [gpod(f"a{i}", min_available="3") for i in range(3)]
    v, _ = make_view(pods)
    v.filter(req(v, pods[0]), NAMES)
    holds = v.gang_holds("default/g")
    for p in pods:
        r = req(v, p)
        got = v.reserve(r, holds[r.key])
        assert got is v.inflight[r.key]
        v.bound(r.key)
    assert v.gang_holds("default/g") == {} and v.inflight == {}
    assert set(v.placed) == {f"default/a{i}" for i in range(3)}
    # a late pod of the satisfied group is placed on its own
    late = gpod("a3", min_available="3")
    v.upsert_pod(late)
    passed, _, _ = v.filter(req(v, late), NAMES)
    assert passed and v.inflight == {}


def test_failed_bind_keeps_the_hold_until_the_timeout() -> None:
    pods = [gpod(f"a{i}", min_available="2") for i in range(2)]
    v, clock = make_view(pods)
    before = v.state.fingerprint()
    v.filter(req(v, pods[0]), NAMES)
    holds = v.gang_holds("default/g")
    r = req(v, pods[0])
    v.reserve(r, holds[r.key])
    v.release_inflight(r.key)  # the API server refused the binding
    assert v.gang_holds("default/g") == holds
    clock.t += 299
    assert v.gang_expire() == []
    clock.t += 2
    assert v.gang_expire() == sorted(holds)
    assert v.inflight == {} and v.state.fingerprint() == before
    # planned again on the next filter, with a fresh deadline
    assert v.filter(req(v, pods[1]), NAMES)[0]
    assert len(v.gang_holds("default/g")) == 2


def test_podgroup_gives_min_member_and_timeout() -> None:
    pods = [gpod(f"a{i}", group=None, min_available=None, **{LABEL_GROUP_SHORT: "pg"})
            for i in range(3)]
    v, clock = make_view(pods)
    _, _, unres = v.filter(req(v, pods[0]), NAMES)
    assert "no min-available" in unres["gpu-0"] and "PodGroup pg" in unres["gpu-0"]
    assert v.inflight == {}
    pg = {"apiVersion": "scheduling.sigs.k8s.io/v1alpha1", "kind": "PodGroup",
          "metadata": {"name": "pg", "namespace": "default"},
          "spec": {"minMember": 3, "scheduleTimeoutSeconds": 10}}
    v.upsert_podgroup(pg)
    assert v.filter(req(v, pods[0]), NAMES)[0]
    assert len(v.gang_holds("default/pg")) == 3
    clock.t += 11
    assert len(v.gang_expire()) == 3 and v.inflight == {}
    v.upsert_podgroup({**pg, "spec": {"minMember": "many"}})
    _, _, unres = v.filter(req(v, pods[0]), NAMES)
    assert "PodGroup spec.minMember" in unres["gpu-0"] and v.inflight == {}
    v.delete_podgroup(pg)
    assert "no min-available" in v.filter(req(v, pods[0]), NAMES)[2]["gpu-0"]


def test_invalid_label_is_a_reason_and_disturbs_no_one() -> None:
    bad = gpod("bad", min_available="lots")
    ok = kobjects.pod("plain", mem=4)
    v, _ = make_view([bad, ok])
    passed, failed, unres = v.filter(req(v, bad), NAMES)
    assert passed == [] and failed == {}
    assert unres["gpu-0"].startswith("invalid pod group: label " + LABEL_MIN_AVAILABLE)
    assert v.inflight == {}
    assert v.filter(req(v, ok), NAMES)[0] == NAMES
    with pytest.raises(PlacementError, match="invalid pod group"):
        v.reserve(req(v, bad), "gpu-0")


def test_deleted_held_pod_releases_its_hold() -> None:
    pods = [gpod(f"a{i}", min_available="2") for i in range(3)]
    v, _ = make_view(pods)
    v.filter(req(v, pods[0]), NAMES)
    held = v.gang_holds("default/g")
    assert len(held) == 3
    v.delete_pod(pods[1])
    assert "default/a1" not in v.gang_holds("default/g") and "default/a1" not in v.state.pods
    assert len(v.state.pods) == 2


def test_follower_dry_run_then_leader_bind_plans_pinned() -> None:
    pods = [gpod(f"a{i}", min_available="8") for i in range(8)]
    follower, _ = make_view(pods)
    follower.gang_may_hold = lambda: False
    before = follower.state.fingerprint()
    passed, _, _ = follower.filter(req(follower, pods[0]), NAMES)
    assert passed and follower.inflight == {} and follower.state.fingerprint() == before
    leader, _ = make_view(pods)
    r = leader.reserve(req(leader, pods[0]), "gpu-1")  # the bind kube-scheduler sends
    assert r.node == "gpu-1"
    assert len(leader.gang_holds("default/g")) == 8


def test_bind_on_another_node_moves_the_hold_or_refuses() -> None:
    pods = [gpod(f"a{i}", min_available="2") for i in range(2)]
    full = [gpod(f"f{i}", group=None, min_available=None) for i in range(4)]
    v, _ = make_view([*pods, *full])
    v.filter(req(v, pods[0]), NAMES)
    holds = v.gang_holds("default/g")
    r = req(v, pods[0])
    here = holds[r.key]
    other = "gpu-1" if here == "gpu-0" else "gpu-0"
    for p in full:  # the other node fills up with pods outside the group
        v.reserve(req(v, p), other)
    with pytest.raises(PlacementError, match="holds this pod's GPU share on node " + here):
        v.reserve(r, other)
    assert v.gang_holds("default/g")[r.key] == here  # the hold stays where it was
    v.delete_pod(full[0])
    moved = v.reserve(r, other)  # room there now: the hold moves
    assert moved.node == other and v.gang_holds("default/g")[r.key] == other
    assert len(v.state.node_pods(here)) == 1


def test_leadership_loss_drops_holds_and_rebuild_keeps_them() -> None:
    pods = [gpod(f"a{i}", min_available="3") for i in range(3)]
    v, _ = make_view(pods)
    before = v.state.fingerprint()
    v.filter(req(v, pods[0]), NAMES)
    assert len(v.gang_holds("default/g")) == 3
    v.reset(NODES, pods)  # a relist keeps in-flight holds
    assert len(v.gang_holds("default/g")) == 3
    assert v.drop_gang_holds() == 3
    assert v.inflight == {} and v.state.fingerprint() == before
    # a restarted replica knows no holds: nothing bound, nothing held, planned afresh
    fresh, _ = make_view(pods)
    assert fresh.inflight == {} and fresh.state.fingerprint() == before


def test_hold_dropped_when_another_replica_binds_the_pod() -> None:
    pods = [gpod(f"a{i}", min_available="2") for i in range(2)]
    v, _ = make_view(pods)
    v.filter(req(v, pods[0]), NAMES)
    held = v.gang_holds("default/g")["default/a0"]
    bound = kobjects.pod("a0", mem=16)
    bound["metadata"]["labels"] = pods[0]["metadata"]["labels"]
    bound["spec"]["nodeName"] = held
    v.upsert_pod(bound)  # no annotations: charged as a pod without a decision
    assert "default/a0" not in v.gang_holds("default/g")
    assert "default/a0" not in v.inflight
