"""The extender in DRA mode (issue 21 item 4): DRA nodes' GPUs from their ResourceSlices,
allocated ResourceClaims held on them, and DRA pods filtered and scored with the policy on
those GPUs (docs/dra.md, "The extender and DRA pods")."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import numpy as np
import pytest

from sharegpu.core.annotations import Allocation, encode
from sharegpu.core.errors import ValidationError
from sharegpu.core.placement.base import get_policy
from sharegpu.core.request import ContainerRequest, Kind, PodRequest
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.dra import driver as dra
from sharegpu.extender.drastate import NOT_IN_POOL, DraPodRequest
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects
from test_inspect_dra import dra_node, dra_slice, result


def claim(name: str, mem: int, cores: int | None = None, count: int = 1,
          results: list[dict] | None = None, ns: str = "default") -> dict[str, Any]:
    """A claim as the webhook's template makes it; allocated with ``results``."""
    cap: dict[str, Any] = {"memory": f"{mem}Gi"}
    if cores is not None:
        cap["cores"] = str(cores)
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                     "resourceVersion": "1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": dra.DRIVER, "allocationMode": "ExactCount", "count": count,
            "capacity": {"requests": cap}}}]}}}
    if results is not None:
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


def pod(name: str, claims: dict[str, str], ns: str = "default") -> dict[str, Any]:
    """A translated DRA pod before scheduling: claims from templates ({pod claim: generated
    claim})."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                         "resourceVersion": "5", "labels": {}, "annotations": {}},
            "spec": {"schedulerName": "ack-co-scheduler",
                     "nodeSelector": {"sharegpu.io/dra": "true"},
                     "containers": [{"name": "main", "resources": {
                         "claims": [{"name": c} for c in claims]}}],
                     "resourceClaims": [{"name": c, "resourceClaimTemplateName": f"t-{c}"}
                                        for c in claims]},
            "status": {"phase": "Pending", "resourceClaimStatuses": [
                {"name": c, "resourceClaimName": g} for c, g in claims.items()]}}


def bare_node(name: str) -> dict[str, Any]:
    """A DRA node without the agent's GPU labels: nothing says it has GPUs but its slice."""
    n = dra_node(name)
    for k in ("aliyun.accelerator/nvidia_mem", "aliyun.accelerator/nvidia_count"):
        del n["metadata"]["labels"][k]
    return n


NODES = {"d1": (15, 15), "d2": (16, 16), "d3": (24,), "d4": (40, 40)}


def cluster(policy: str = "default") -> ClusterView:
    v = ClusterView(policy)
    nodes = [kobjects.node("dp", [16, 16], "cgpu")] + [dra_node(n) for n in NODES]
    slices = [dra_slice(n, mem) for n, mem in NODES.items()]
    v.reset(nodes, [], (slices, []))
    return v


def test_dra_nodes_get_gpu_rows_from_their_slices_and_claims_hold_shares():
    v = cluster()
    assert set(v.state.index) == {"dp", *NODES}
    assert v.state.gpu_capacity("d4") == {0: 40, 1: 40}
    assert v.specs["d1"].cpu_milli == 16000  # the Node's allocatable
    # an allocated claim holds its consumedCapacity on its GPU, incrementally
    v.upsert_claim(claim("a", 10, 50, results=[result("gpu-1", "10Gi", "50", node="d1")]))
    i = v.state.index["d1"]
    assert v.state.gpu_free[i, :2].tolist() == [15, 5]
    assert v.state.core_free[i, :2].tolist() == [100, 50]
    assert v.state.gpu_pods[i, :2].tolist() == [0, 1]
    assert v.drift() == []
    # reallocated elsewhere, deallocated, deleted: released each time
    v.upsert_claim(claim("a", 10, 50, results=[result("gpu-0", "10Gi", "50", node="d1")]))
    assert v.state.gpu_free[i, :2].tolist() == [5, 15]
    v.upsert_claim(claim("a", 10, 50))
    assert v.state.gpu_free[i, :2].tolist() == [15, 15] and not v.claim_held
    v.upsert_claim(claim("a", 10, 50, results=[result("gpu-0", "10Gi", None, node="d1")]))
    assert v.state.core_free[i, 0] == 100  # no cores consumed: none held
    v.delete_claim(claim("a", 10))
    assert v.state.gpu_free[i, :2].tolist() == [15, 15] and "default/claim:a" not in v.state.pods
    # a whole-GPU result holds the whole GPU
    v.upsert_claim(claim("w", 1, results=[result("gpu-1", None, node="d2")]))
    j = v.state.index["d2"]
    assert v.state.gpu_free[j, :2].tolist() == [16, 0] and v.state.core_free[j, 1] == 0


def test_slice_and_node_events_in_any_order():
    v = ClusterView()
    v.reset([], [], ([], []))
    c = claim("a", 4, results=[result("gpu-0", "4Gi", node="late")])
    v.upsert_claim(c)  # before its node is known: recorded, held later
    v.upsert_slice(dra_slice("late", (32,)))
    assert "late" not in v.state.index  # no Node yet
    v.upsert_node(bare_node("late"))
    i = v.state.index["late"]
    assert v.state.gpu_free[i, 0] == 28 and "default/claim:a" in v.state.pods
    # the slice goes: the node has no GPUs (no device-plugin resources), its claim is released
    v.delete_slice(dra_slice("late", (32,)))
    assert "late" not in v.state.index and "default/claim:a" not in v.state.pods
    # back: held again
    v.upsert_slice(dra_slice("late", (32,)))
    assert v.state.gpu_free[v.state.index["late"], 0] == 28
    # the Node deleted and back
    v.delete_node("late")
    assert "default/claim:a" not in v.state.pods
    v.upsert_node(bare_node("late"))
    assert v.state.gpu_free[v.state.index["late"], 0] == 28
    # another driver's slice is ignored
    other = copy.deepcopy(dra_slice("x", (16,)))
    other["spec"]["driver"] = "nic.example.com"
    v.upsert_slice(other)
    v.upsert_node(bare_node("x"))
    assert "x" not in v.state.index


def test_relist_rebuilds_the_same_state_as_the_events():
    v = cluster()
    claims = [claim(f"c{k}", 1 + k % 4, 5 * (1 + k % 3),
                    results=[result(f"gpu-{k % 2}", f"{1 + k % 4}Gi", str(5 * (1 + k % 3)),
                                    node="d4")]) for k in range(12)]
    claims.append(claim("p", 3))  # pending: nothing held
    for c in claims:
        v.upsert_claim(c)
    fresh = ClusterView()
    nodes = [kobjects.node("dp", [16, 16], "cgpu")] + [dra_node(n) for n in NODES]
    fresh.reset(nodes, [], ([dra_slice(n, m) for n, m in NODES.items()], claims))
    assert fresh.fingerprint() == v.fingerprint()
    # a relist without DRA lists keeps what is known
    v.reset(nodes, [])
    assert v.fingerprint() == fresh.fingerprint()
    i = v.state.index["d4"]
    assert int(v.state.gpu_pods[i, :2].sum()) == 12


@pytest.mark.parametrize("policy", ["default", "bestfit", "fgd", "spread"])
def test_a_dra_pod_is_filtered_and_scored_with_the_policy_on_dra_nodes(policy):
    v = cluster(policy)
    # fill d1 and d3 so that 12 GiB fits only on d2 and d4
    held = (("x", "d1", 0, 10), ("y", "d1", 1, 6), ("z", "d3", 0, 20), ("w", "d4", 1, 30))
    for name, node, gpu, mem in held:
        v.upsert_claim(claim(name, mem, results=[result(f"gpu-{gpu}", f"{mem}Gi", "5",
                                                        node=node)]))
    v.upsert_claim(claim("new-gpu", 12, 30))
    p = pod("new", {"gpu": "new-gpu"})
    req = v.dra_request(p, v.reader.request(p))
    assert isinstance(req, DraPodRequest)
    c = req.containers[0]
    assert (c.gpu_mem, c.gpu_core, c.gpus) == (12, 30, 1)
    names = ["dp", *NODES]
    passed, failed, unres = v.filter(req, names)
    assert passed == ["d2", "d4"]
    assert unres["dp"] == NOT_IN_POOL  # a device-plugin node
    assert "insufficient GPU memory" in failed["d1"] and "d3" in failed
    # the same policy code as the simulator: a state built independently from the same facts,
    # scored by the simulator's Scheduler, picks the node the extender gives 10
    st = ClusterState([NodeSpec(n, list(m), cpu_milli=16000, mem_mib=65536)
                       for n, m in NODES.items()])
    for name, node, gpu, mem in held:
        st.hold(PodRequest("default", name, Kind.SHARED,
                           (ContainerRequest(0, gpu_mem=mem, gpu_core=5),)), node,
                Allocation(mem={0: {gpu: mem}}, core={0: {gpu: 5}}))
    pol = get_policy(policy)
    pol.prepare(st, v.workload)
    sched = Scheduler(st, pol, tie_break="order")
    sim = PodRequest("default", "new", Kind.SHARED, (ContainerRequest(0, gpu_mem=12,
                                                                      gpu_core=30),))
    nodes = np.array([st.index[n] for n in ("d2", "d4")])
    want = st.specs[int(sched.pick(nodes, sched.scores(sim, nodes)))].name
    scores = v.prioritize(req, passed)
    assert scores[want] == 10 and sum(scores.values()) == 10, scores
    # a pod whose claims fit nowhere: every DRA node fails with its reason
    v.upsert_claim(claim("huge-gpu", 48))
    big = pod("huge", {"gpu": "huge-gpu"})
    breq = v.dra_request(big, v.reader.request(big))
    passed, failed, unres = v.filter(breq, names)
    assert passed == [] and failed == {}  # no preemption helps: unresolvable
    assert all("asks 48 GPU memory per GPU; the largest GPU has" in unres[n] for n in NODES)


def test_two_gpu_claims_and_the_20_share_limit():
    v = cluster()
    v.upsert_claim(claim("two-gpu", 4, count=2))
    p = pod("two", {"gpu": "two-gpu"})
    req = v.dra_request(p, v.reader.request(p))
    assert req.containers[0].gpus == 2
    passed, _, unres = v.filter(req, ["d1", "d3", "d4"])
    assert passed == ["d1", "d4"] and "asks for 2 GPUs; node has 1" in unres["d3"]
    # 20 claims of 5 % on d3's GPU: no 21st, whatever memory is left
    for k in range(20):
        v.upsert_claim(claim(f"s{k}", 1, results=[result("gpu-0", "1Gi", "5", node="d3")]))
    v.upsert_claim(claim("one-gpu", 1))
    q = pod("one", {"gpu": "one-gpu"})
    passed, failed, _ = v.filter(v.dra_request(q, v.reader.request(q)), ["d3"])
    assert passed == [] and "d3" in failed


def test_pods_not_ranked_pass_as_before():
    v = cluster()
    base = pod("p", {"gpu": "p-gpu"})
    req = v.reader.request(base)
    assert v.dra_request(base, req) is None  # claim not seen yet
    v.upsert_claim(claim("p-gpu", 4, results=[result("gpu-0", "4Gi", "5", node="d1")]))
    assert v.dra_request(base, req) is None  # already allocated: its node is decided
    made = copy.deepcopy(base)
    made["status"]["resourceClaimStatuses"] = []
    assert v.dra_request(made, req) is None  # the claim controller has not made it yet
    assert v.filter(req, ["dp", "d1"]) == (["dp", "d1"], {}, {})


def test_legal_claims_the_policy_does_not_score_pass_unranked_and_disturb_nothing():
    """firstAvailable (sharegpu's class in a subrequest, or only another driver's) and
    allocationMode All are legal DRA: the pod passes every node unscored (kube-scheduler's
    allocator decides), never a refusal, and no problem is logged."""
    v = cluster()
    names = ["dp", "d1", "d2", "d3", "d4"]
    first = claim("fa-gpu", 4)
    first["spec"]["devices"]["requests"] = [{"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": dra.DRIVER,
         "capacity": {"requests": {"memory": "20Gi"}}},
        {"name": "small", "deviceClassName": dra.DRIVER,
         "capacity": {"requests": {"memory": "4Gi"}}}]}]
    nic = claim("nic", 1)
    nic["spec"]["devices"]["requests"] = [{"name": "port", "firstAvailable": [
        {"name": "fast", "deviceClassName": "nic.example.com"}]}]
    every = claim("all-gpu", 1)
    every["spec"]["devices"]["requests"][0]["exactly"] = {
        "deviceClassName": dra.DRIVER, "allocationMode": "All"}
    for c in (first, nic, every):
        v.upsert_claim(c)
    assert not v.problems
    for name, claims in (("fa", {"gpu": "fa-gpu"}), ("n", {"port": "nic"}),
                         ("al", {"gpu": "all-gpu"}), ("mix", {"gpu": "fa-gpu", "port": "nic"})):
        p = pod(name, claims)
        req = v.reader.request(p)
        assert v.dra_request(p, req) is None, name
        assert v.filter(req, names) == (names, {}, {}), name


def test_malformed_claims_are_a_reason_naming_the_field():
    v = cluster()
    bad = claim("bad-gpu", 4)
    bad["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = "lots"
    v.upsert_claim(bad)
    p = pod("bad", {"gpu": "bad-gpu"})
    with pytest.raises(ValidationError) as e:
        v.dra_request(p, v.reader.request(p))
    assert "spec.devices.requests[0].exactly.capacity.requests.memory" in str(e.value)
    # a malformed allocation is left out with a problem, nothing else disturbed
    v.upsert_claim(claim("ok", 2, results=[result("gpu-0", "2Gi", "5", node="d2")]))
    odd = claim("odd", 2, results=[{"driver": dra.DRIVER, "pool": "d2", "device": "gpu-x"},
                                   result("gpu-7", "2Gi", node="d2")])
    v.upsert_claim(odd)
    assert "default/claim:odd" not in v.state.pods and "default/claim:ok" in v.state.pods
    assert "gpu-7, which the node's ResourceSlice does not list" in v.problems[
        "resourceclaim/default/odd"]
    # a pod with a non-list resourceClaims
    weird = copy.deepcopy(p)
    weird["spec"]["resourceClaims"] = "x"
    with pytest.raises(ValidationError, match=r"spec\.resourceClaims="):
        v.dra_request(weird, v.reader.request(p))


def test_device_plugin_pods_keep_off_dra_nodes_and_are_held_beside_claims():
    v = cluster()
    dp = v.reader.request(kobjects.pod("dp-pod", mem=4))
    passed, _, unres = v.filter(dp, ["dp", "d1"])
    assert passed == ["dp"] and "through DRA" in unres["d1"]
    # a device-plugin pod bound on a DRA node before it joined the pool counts with claims
    p = kobjects.pod("old", mem=4, node_name="d1")
    p["metadata"]["annotations"] = encode(Allocation(mem={0: {0: 4}}), assume_time_ns=1)
    v.upsert_pod(p)
    v.upsert_claim(claim("c", 10, results=[result("gpu-0", "10Gi", "5", node="d1")]))
    assert v.state.gpu_free[v.state.index["d1"], 0] == 1


def test_informer_lists_and_watches_slices_and_claims(fake_api: Any) -> None:
    from sharegpu.extender.informer import Informer
    from sharegpu.extender.kube import KubeApi
    from test_extender_informer import until

    fake_api.create(dra_node("d1"))
    fake_api.create(dra_slice("d1", (15, 15)))
    fake_api.create(claim("a", 4, results=[result("gpu-0", "4Gi", "5", node="d1")]))

    async def go() -> None:
        view = ClusterView()
        api = KubeApi.from_url(fake_api.url)
        inf = Informer(api, view, check_every=0, backoff=0.05)
        await inf.start()
        try:
            assert inf.dra is True and "default/claim:a" in view.state.pods
            fake_api.create(claim("b", 6, results=[result("gpu-1", "6Gi", "5", node="d1")]))
            await until(lambda: "default/claim:b" in view.state.pods)
            fake_api.delete("resourceclaims", "a")
            await until(lambda: "default/claim:a" not in view.state.pods)
            i = view.state.index["d1"]
            assert view.state.gpu_free[i, :2].tolist() == [15, 9]
            assert await inf.check() == []  # the consistency check counts claims too
        finally:
            await inf.stop()
            await api.close()

    asyncio.run(go())


def test_without_dra_rights_the_extender_works_as_before(fake_api: Any, caplog) -> None:
    from sharegpu.extender.informer import Informer
    from sharegpu.extender.kube import CLAIMS, ApiError, KubeApi

    fake_api.create(kobjects.node("n1", [16], "cgpu"))

    class Forbidden(KubeApi):
        async def list(self, path: str, limit: int = 500):
            if path == CLAIMS:
                raise ApiError(403, "Forbidden", "resourceclaims is forbidden")
            return await super().list(path, limit)

    async def go() -> None:
        view = ClusterView()
        api = Forbidden(KubeApi.from_url(fake_api.url).http)
        inf = Informer(api, view, check_every=0, backoff=0.05)
        await inf.start()
        try:
            assert inf.dra is False and "n1" in view.state.index and view.synced
            await inf.relist()
        finally:
            await inf.stop()
            await api.close()

    asyncio.run(go())
    assert sum("DRA mode off" in r.message for r in caplog.records) == 1


def test_the_http_filter_answers_dra_pods_and_never_fails_on_bad_ones():
    import json

    from sharegpu.extender.httpserver import Request
    from sharegpu.extender.metrics import Metrics
    from sharegpu.extender.server import ExtenderApp

    v = cluster()
    v.upsert_claim(claim("new-gpu", 20, 30))
    app = ExtenderApp(v, None, Metrics())
    names = ["dp", *NODES]

    def ask(p: Any) -> dict[str, Any]:
        body = json.dumps({"Pod": p, "NodeNames": names}).encode()

        async def go() -> Any:
            return app.filter(Request("POST", "/filter", body=body))

        resp = asyncio.run(go())
        assert resp.status == 200
        return json.loads(resp.body)

    got = ask(pod("new", {"gpu": "new-gpu"}))
    # d3 and d4 fit: the answer is the policy's pick alone
    assert len(got["NodeNames"]) == 1 and got["NodeNames"][0] in ("d3", "d4")
    assert not v.inflight and len(v.picks) == 0
    assert "the largest GPU has 15" in got["FailedAndUnresolvableNodes"]["d1"]
    v.graded = True  # graded scores: every passing node
    assert ask(pod("new", {"gpu": "new-gpu"}))["NodeNames"] == ["d3", "d4"]
    v.graded = False
    assert got["FailedAndUnresolvableNodes"]["dp"] == NOT_IN_POOL
    for bad in ([1], [{"name": ["x"], "resourceClaimTemplateName": "t"}], "x"):
        p = pod("new", {"gpu": "new-gpu"})
        p["spec"]["resourceClaims"] = bad
        p["status"]["resourceClaimStatuses"] = [{"name": ["x"]}, 3]
        got = ask(p)
        assert "Error" not in got or not got["Error"], got



def test_not_in_dra_mode_the_extender_never_asks_for_dra_objects(fake_api: Any, caplog) -> None:
    from sharegpu.extender.informer import Informer
    from sharegpu.extender.kube import CLAIMS, SLICES, KubeApi

    fake_api.create(kobjects.node("n1", [16], "cgpu"))
    asked: list[str] = []

    class Recording(KubeApi):
        async def list(self, path: str, limit: int = 500):
            asked.append(path)
            return await super().list(path, limit)

    async def go() -> None:
        view = ClusterView()
        api = Recording(KubeApi.from_url(fake_api.url).http)
        inf = Informer(api, view, check_every=0, backoff=0.05, dra=False)
        await inf.start()
        try:
            await inf.relist()
            assert inf.dra is False and "n1" in view.state.index and view.synced
        finally:
            await inf.stop()
            await api.close()

    asyncio.run(go())
    assert asked and SLICES not in asked and CLAIMS not in asked
    assert not [r for r in caplog.records if "DRA" in r.message]
