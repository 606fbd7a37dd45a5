"""The extender tells a DRA pod that kube-scheduler cannot place why no node of the DRA pool can
take it (docs/dra.md, "Not refused at admission"): from the pod watch, incrementally, in a
Warning Event posted by the leader only; other pods are untouched."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from sharegpu.core.modes import Mode
from sharegpu.dra import driver as dra
from sharegpu.dra.resourceslices import SliceGpu, build_slice
from sharegpu.extender.events import REASON_DRA_UNSCHEDULABLE
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects
from test_extender_dra import NODES, claim, cluster, pod
from test_inspect_dra import dra_node, dra_slice

UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/5 nodes are available: 4 cannot allocate all claims."}


def waiting(name: str, claims: dict[str, str], **spec: Any) -> dict[str, Any]:
    """``pod`` once kube-scheduler found it unschedulable (``spec`` added to its spec)."""
    p = pod(name, claims)
    p["spec"].update(spec)
    p["status"]["conditions"] = [dict(UNSCHEDULABLE)]
    return p


def watched(v: ClusterView) -> list[tuple[str, str]]:
    told: list[tuple[str, str]] = []
    v.on_dra_unschedulable = lambda p, m: told.append((p["metadata"]["name"], m))
    return told


def tainted_slice(name: str, mem: tuple[int, ...]) -> dict[str, Any]:
    gpus = [SliceGpu(i, f"GPU-{name}-{i}", "Tesla T4", 15109, m, isolation_unavailable=True)
            for i, m in enumerate(mem)]
    return build_slice(name, gpus, Mode.CGPU)


def test_a_pod_larger_than_every_gpu_is_told_once_and_forgotten_when_it_goes():
    v = cluster()
    told = watched(v)
    v.upsert_claim(claim("big-gpu", 48))
    p = waiting("big", {"gpu": "big-gpu"})
    v.upsert_pod(pod("big", {"gpu": "big-gpu"}))  # not yet refused: nothing
    assert told == [] and not v.dra_waiting
    v.upsert_pod(p)
    ((who, msg),) = told
    assert who == "big" and msg == (
        f"no node of the DRA pool (driver {dra.DRIVER}) can take this pod as it is: "
        "ResourceClaim default/big-gpu spec.devices.requests[0].exactly.capacity.requests."
        "memory=48Gi: larger than every GPU of the DRA pool (largest: 40Gi, node d4 gpu-0)")
    assert v.problems["default/big"] == msg
    v.upsert_pod(copy.deepcopy(p))  # the same again: told once
    assert len(told) == 1
    # bound (e.g. after the claim was changed): no longer waiting; deleted: gone
    q = copy.deepcopy(p)
    q["spec"]["nodeName"] = "d4"
    v.upsert_pod(q)
    assert not v.dra_waiting and not v._waiting_on
    v.upsert_pod(p)
    v.delete_pod(p)
    assert not v.dra_waiting and not v._waiting_on


def test_a_pod_that_fits_an_empty_pool_is_never_told():
    v = cluster()
    told = watched(v)
    for name, gib in (("a", 4), ("b", 40), ("c", 16)):
        v.upsert_claim(claim(f"{name}-gpu", gib, 30))
        v.upsert_pod(waiting(name, {"gpu": f"{name}-gpu"}))
    assert told == [] and len(v.dra_waiting) == 3


def test_the_claim_seen_after_the_pod_and_a_claim_that_changes():
    v = cluster()
    told = watched(v)
    v.upsert_pod(waiting("late", {"gpu": "late-gpu"}))
    assert told == [] and "default/late" in v.dra_waiting  # its claim is not known yet
    v.upsert_claim(claim("late-gpu", 64))
    assert [m for _, m in told] and "memory=64Gi" in told[0][1]
    v.upsert_claim(claim("late-gpu", 4))  # fits now (a claim is immutable; still: no word)
    v.upsert_claim(claim("late-gpu", 50))
    assert len(told) == 2 and "memory=50Gi" in told[1][1]


def test_a_dra_pod_aimed_at_a_device_plugin_node_names_it():
    v = cluster()
    told = watched(v)
    v.upsert_claim(claim("g", 4))
    v.upsert_pod(waiting("aimed", {"gpu": "g"}, nodeSelector={
        "sharegpu.io/dra": "true", "kubernetes.io/hostname": "dp"}))
    ((_, msg),) = told
    assert msg.endswith("spec.nodeSelector[kubernetes.io/hostname]=dp: selects no node of the "
                        "DRA pool (nodes with a ResourceSlice of gpu.sharegpu.io: d1, d2, d3, "
                        "d4); dp serves its GPUs through the device plugins")


def test_slices_tainted_and_back_and_the_agents_own_words():
    v = cluster()
    told = watched(v)
    v.upsert_claim(claim("g", 4))
    v.upsert_pod(waiting("p", {"gpu": "g"}))
    assert told == []
    # the agent says why on its node condition
    for n in NODES:
        node = dra_node(n)
        node["status"]["conditions"] = [{
            "type": "GPUIsolationReady", "status": "False", "reason": "BackendUnusable",
            "message": f"node {n}: isolation back-end hami is not usable: the HAMi-core library "
                       "/usr/local/vgpu/libvgpu.so does not exist; fix: install HAMi-core"}]
        v.upsert_node(node)
    for n, mem in NODES.items():
        v.upsert_slice(tainted_slice(n, mem))
    assert len(told) == 1  # only when the last clean GPU went
    msg = told[0][1]
    assert "gpu.sharegpu.io/isolation-unavailable on d1 (gpu-0, gpu-1), d2 (gpu-0, gpu-1), " \
           "d3 (gpu-0) and 1 more" in msg
    assert msg.endswith("GPUIsolationReady on d1, d2 and 2 more: isolation back-end hami is not "
                        "usable: the HAMi-core library /usr/local/vgpu/libvgpu.so does not "
                        "exist; fix: install HAMi-core")
    v.upsert_slice(dra_slice("d4", NODES["d4"]))  # one node back: fits again, nothing said
    assert len(told) == 1 and v.dra_waiting["default/p"][1] == ""
    v.upsert_slice(tainted_slice("d4", NODES["d4"]))
    assert len(told) == 2
    v.upsert_slice(tainted_slice("d4", NODES["d4"]))  # written again, the same: not told
    assert len(told) == 2
    v.delete_slice(tainted_slice("d4", NODES["d4"]))  # d4 gone: the list of nodes changes
    assert len(told) == 3 and "d3 (gpu-0): " in told[2][1]
    v.dra_recheck(again=True)  # a new leader tells what it knows
    assert len(told) == 4 and told[3] == told[2]


def test_other_pods_are_untouched_and_malformed_ones_change_nothing():
    v = cluster()
    told = watched(v)
    before = v.fingerprint()
    # a GPU pod of the device plugins, a plain pod, a pod with another driver's claim
    dp = kobjects.pod("dp-pod", mem=48)
    dp["status"] = {"phase": "Pending", "conditions": [dict(UNSCHEDULABLE)]}
    v.upsert_pod(dp)
    plain = {"metadata": {"name": "plain", "namespace": "default"}, "spec": {},
             "status": {"conditions": [dict(UNSCHEDULABLE)]}}
    v.upsert_pod(plain)
    nic = claim("nic", 4)
    nic["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "nic.example.com"
    v.upsert_claim(nic)
    v.upsert_pod(waiting("nic-pod", {"nic": "nic"}))
    assert told == [] and set(v.dra_waiting) == {"default/nic-pod"}
    for bad in ([1], "x", [{"name": ["x"], "resourceClaimTemplateName": "t"}]):
        p = waiting("bad", {"gpu": "g"})
        p["spec"]["resourceClaims"] = bad
        p["status"]["resourceClaimStatuses"] = [{"name": ["x"]}, 3]
        p["spec"]["affinity"] = {"nodeAffinity": "x"}
        v.upsert_pod(p)
    p = waiting("bad2", {"gpu": "g"})
    p["status"]["conditions"] = "x"
    v.upsert_pod(p)
    assert told == [] and v.fingerprint() == before
    # a claim the view cannot read: said, naming the field
    v.upsert_claim(claim("lots", 4) | {"spec": {"devices": {"requests": [{
        "name": "gpu", "exactly": {"deviceClassName": dra.DRIVER,
                                   "capacity": {"requests": {"memory": "lots"}}}}]}}})
    v.upsert_pod(waiting("unreadable", {"gpu": "lots"}))
    ((_, msg),) = told
    assert "spec.resourceClaims[0] (ResourceClaim default/lots): sharegpu cannot read its " \
           "request: ResourceClaim default/lots: spec.devices.requests[0].exactly.capacity." \
           "requests.memory='lots'" in msg


def test_a_rebuild_finds_the_pods_already_refused():
    v = ClusterView()
    told = watched(v)
    nodes = [kobjects.node("dp", [16, 16], "cgpu")] + [dra_node(n) for n in NODES]
    slices = [dra_slice(n, mem) for n, mem in NODES.items()]
    pods = [waiting("big", {"gpu": "big-gpu"}), waiting("ok", {"gpu": "ok-gpu"}),
            kobjects.pod("other", mem=4)]
    v.reset(nodes, pods, (slices, [claim("big-gpu", 48), claim("ok-gpu", 4)]))
    assert [w for w, _ in told] == ["big"] and set(v.dra_waiting) == {"default/big",
                                                                      "default/ok"}
    v.reset(nodes, pods, (slices, [claim("big-gpu", 48), claim("ok-gpu", 4)]))
    assert len(told) == 1  # the same message is not told again by a relist


def test_the_leader_posts_the_event_through_the_api(fake_api: Any) -> None:
    from sharegpu.extender.kube import KubeApi
    from sharegpu.extender.replica import Replica
    from test_extender_informer import until

    fake_api.create(kobjects.node("dp", [16, 16], "cgpu"))
    for n, mem in NODES.items():
        fake_api.create(dra_node(n))
        fake_api.create(dra_slice(n, mem))
    fake_api.create(claim("big-gpu", 48))
    fake_api.create(claim("ok-gpu", 4))
    for name in ("big", "ok"):
        p = pod(name, {"gpu": f"{name}-gpu"})
        del p["metadata"]["resourceVersion"]
        fake_api.create(p)

    async def go() -> None:
        api = KubeApi.from_url(fake_api.url)
        rep = Replica(api, identity="r1", elect=False, check_every=0, dra=True)
        await rep.start()
        try:
            for name in ("big", "ok"):  # kube-scheduler's verdict arrives through the watch
                fake_api.patch("pods", name, {"status": {"conditions": [dict(UNSCHEDULABLE)]}})
            await until(lambda: any(e["reason"] == REASON_DRA_UNSCHEDULABLE
                                    for e in fake_api.objects("events")))
            await until(lambda: "default/ok" in rep.view.dra_waiting)
            await rep.events.drain()
            (ev,) = [e for e in fake_api.objects("events")
                     if e["reason"] == REASON_DRA_UNSCHEDULABLE]
            assert ev["type"] == "Warning" and ev["involvedObject"]["name"] == "big"
            assert ev["source"]["component"] == "sharegpu-extender"
            assert "capacity.requests.memory=48Gi: larger than every GPU of the DRA pool " \
                   "(largest: 40Gi, node d4 gpu-0)" in ev["message"]
        finally:
            await rep.stop()
            await api.close()

    asyncio.run(go())


def test_a_follower_posts_nothing(fake_api: Any) -> None:
    from sharegpu.extender.kube import KubeApi
    from sharegpu.extender.replica import Replica

    async def go() -> None:
        api = KubeApi.from_url(fake_api.url)
        rep = Replica(api, identity="r2", elect=False, check_every=0, dra=True)
        rep.is_leader = lambda: False  # type: ignore[method-assign]
        rep.view.reset([dra_node("d4")], [waiting("big", {"gpu": "big-gpu"})],
                       ([dra_slice("d4", (40, 40))], [claim("big-gpu", 48)]))
        assert "default/big" in rep.view.dra_waiting and rep.view.dra_waiting["default/big"][1]
        await rep.events.drain()
        await api.close()

    asyncio.run(go())
    assert not [e for e in fake_api.objects("events")
                if e["reason"] == REASON_DRA_UNSCHEDULABLE]
