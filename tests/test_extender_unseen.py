"""GPU pods the extender did not place — bound by another scheduler, ``nodeName`` set by hand, or
bound by kube-scheduler while the extender was down — are counted conservatively against their
node (nothing is over-committed), reported by an Event and a metric, and do not look like
drift to the consistency check."""

from __future__ import annotations

import asyncio
from typing import Any

from sharegpu.core.annotations import Allocation, encode
from sharegpu.core.request import parse_pod
from sharegpu.extender.informer import Informer
from sharegpu.extender.metrics import Metrics
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects
from sharegpu_testing.memapi import MemoryApi


def by_hand(name: str, node: str, **res: Any) -> dict[str, Any]:
    """A pod bound without the extender: nodeName set, no decision recorded."""
    return kobjects.pod(name, node_name=node, scheduler="default-scheduler", **res)


def reasons(view: ClusterView, pod: dict[str, Any], names: list[str]) -> dict[str, str]:
    req = parse_pod(pod)
    ok = view.feasible(req)
    out = {}
    for n in names:
        i = view.state.index[n]
        if not ok[i]:
            out[n] = view.state.explain(req, i) or "?"
    return out


def test_the_issue_case_a_7_gib_pod_where_12_are_in_use():
    view = ClusterView()
    view.reset([kobjects.node("a", [16], "cgpu")], [by_hand("hand", "a", mem=12)])
    assert list(view.state.gpu_free[0, :1]) == [4]
    assert view.unseen == {"default/hand": "a"}
    assert reasons(view, kobjects.pod("new", mem=7), ["a"]) == {
        "a": "insufficient GPU memory in one device: needs 7 on 1 GPU(s), the most free on "
             "one GPU is 4"}
    assert reasons(view, kobjects.pod("small", mem=4), ["a"]) == {}
    assert view.drift() == []
    assert "carries no scheduling decision" in view.problems["default/hand"]
    # the pod ends: its charge goes
    view.delete_pod(by_hand("hand", "a", mem=12))
    assert list(view.state.gpu_free[0, :1]) == [16] and view.unseen == {}


def test_charged_on_every_gpu_of_its_node():
    """Its GPU is unknown, so each GPU keeps room only as if it held the pod."""
    view = ClusterView()
    view.reset([kobjects.node("a", [16, 16], "cgpu")], [by_hand("hand", "a", mem=7)])
    assert list(view.state.gpu_free[0, :2]) == [9, 9]
    assert list(view.state.gpu_pods[0, :2]) == [1, 1]
    assert reasons(view, kobjects.pod("ten", mem=10), ["a"]) != {}
    assert reasons(view, kobjects.pod("nine", mem=9), ["a"]) == {}
    # compute too, on a core_mem node; and a node with memory-only pods refuses compute pods
    view.reset([kobjects.node("b", [16, 16], "core_mem")],
               [by_hand("hc", "b", mem=2, core=60)])
    assert list(view.state.core_free[0, :2]) == [40, 40]
    # whole cards: charged as that many free cards
    view.reset([kobjects.node("c", [32] * 4, "default")], [by_hand("w", "c", cards=3)])
    assert int((view.state.gpu_free[0, :4] == 0).sum()) == 3


def test_watch_path_and_the_decision_arriving_later():
    view = ClusterView()
    view.reset([kobjects.node("a", [16, 16], "cgpu")], [])
    seen: list[str] = []
    view.on_unseen = lambda obj: seen.append(obj["metadata"]["name"])
    hand = by_hand("hand", "a", mem=6)
    view.upsert_pod(hand)
    view.upsert_pod(hand)  # a later event of the same pod: charged once, reported once
    assert list(view.state.gpu_free[0, :2]) == [10, 10] and seen == ["hand"]
    # annotations appear (e.g. written late): the recorded decision replaces the charge
    ann = encode(Allocation(mem={0: {1: 6}}), assume_time_ns=1)
    hand["metadata"]["annotations"] = ann
    view.upsert_pod(hand)
    assert list(view.state.gpu_free[0, :2]) == [16, 10] and view.unseen == {}
    assert view.drift() == []


def test_consistency_check_sees_no_drift_and_rebuild_keeps_the_charge():
    nodes = [kobjects.node("a", [16, 16], "cgpu")]
    placed = kobjects.pod("placed", mem=4, node_name="a",
                          annotations=encode(Allocation(mem={0: {0: 4}}), assume_time_ns=1))
    pods = [placed, by_hand("hand", "a", mem=8)]
    view = ClusterView()
    view.reset(nodes, pods)
    informer = Informer(MemoryApi(pods), view, Metrics(lambda: view), check_every=0)
    assert informer.compare(pods) == []
    before = view.fingerprint()
    view.reset(nodes, pods)
    assert view.fingerprint() == before


def test_event_and_metric_from_a_replica():
    from sharegpu.extender.replica import Replica

    pods = [by_hand("hand", "a", mem=8)]

    class Api(MemoryApi):
        async def list(self, path: str) -> tuple[list[dict[str, Any]], str]:
            if path.endswith("/nodes"):
                return [kobjects.node("a", [16], "cgpu")], "1"
            return [dict(p) for p in self.pods.values()], "1"

        async def watch(self, path: str, rv: str):  # type: ignore[no-untyped-def]
            await asyncio.sleep(3600)
            yield "", {}

    async def go() -> None:
        api = Api(pods)
        rep = Replica(api, identity="r1", elect=False, check_every=0)
        await rep.start()
        try:
            await rep.events.drain()
            (ev,) = [e for e in api.events if e["reason"] == "GPUSharingNoDecision"]
            assert ev["involvedObject"]["name"] == "hand"
            assert "not placed by the sharegpu extender" in ev["message"]
            assert b"sharegpu_extender_unannotated_gpu_pods 1.0" in rep.metrics.render()
        finally:
            await rep.stop()

    asyncio.run(go())
