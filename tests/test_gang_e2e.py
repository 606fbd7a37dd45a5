"""Gang scheduling end to end: the fake API server, two extender replicas (one leader) and a
driver playing kube-scheduler (filter → prioritize → bind over HTTP, retrying a pod the filter
refused, as kube-scheduler's queue does).

Two gangs of 8 GPU pods compete for capacity that fits one: one runs complete, the other holds
no GPU share, and runs completely once the first one's pods are deleted; a gang that can never
fit leaves nothing reserved. Afterwards, from the API objects alone, no GPU is over-committed,
and the state rebuilt from the pods' annotations equals each replica's live state.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from scheduler_driver import over_commits
from sharegpu.core.gang import LABEL_GROUP, LABEL_MIN_AVAILABLE
from sharegpu.extender.kube import KubeApi
from sharegpu.extender.replica import Replica
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects

NODES = [kobjects.node(f"gpu-{i}", [16] * 4, "cgpu") for i in range(2)]  # 8 GPUs in all


def gang_pod(group: str, i: int, mem: int = 16, min_available: int = 8) -> dict[str, Any]:
    p = kobjects.pod(f"{group}-{i}", mem=mem)
    p["metadata"].setdefault("labels", {}).update(
        {LABEL_GROUP: group, LABEL_MIN_AVAILABLE: str(min_available)})
    return p


def _key(p: dict[str, Any]) -> str:
    return f"{p['metadata']['namespace']}/{p['metadata']['name']}"


class KubeScheduler:
    """One pod at a time, as kube-scheduler's scheduling cycle: filter, prioritize, bind."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.s = session
        self.url = url
        self.reasons: dict[str, str] = {}

    async def _post(self, verb: str, body: Any) -> Any:
        async with self.s.post(f"{self.url}/{verb}", json=body) as r:
            assert r.status == 200, (verb, r.status)
            return await r.json()

    async def attempt(self, pod: dict[str, Any], names: list[str]) -> str | None:
        """The node the pod was bound to, or None (the filter's reason kept)."""
        f = await self._post("filter", {"Pod": pod, "NodeNames": names})
        passed = f.get("NodeNames") or []
        if not passed:
            failed = {**(f.get("FailedNodes") or {}), **(f.get("FailedAndUnresolvableNodes") or {})}
            self.reasons[_key(pod)] = next(iter(failed.values()), f.get("Error", ""))
            return None
        pr = await self._post("prioritize", {"Pod": pod, "NodeNames": passed})
        top = max(pr, key=lambda h: h["Score"])["Host"] if pr else passed[0]
        m = pod["metadata"]
        b = await self._post("bind", {"PodName": m["name"], "PodNamespace": m["namespace"],
                                      "PodUID": m["uid"], "Node": top})
        if b.get("Error"):
            self.reasons[_key(pod)] = b["Error"]
            return None
        return top

    async def rounds(self, pods: list[dict[str, Any]], names: list[str], n: int = 3
                     ) -> dict[str, str]:
        """Up to ``n`` passes over the pods still pending, interleaving the gangs' pods as a
        shared queue does; the bound ones."""
        bound: dict[str, str] = {}
        for _ in range(n):
            for p in pods:
                if _key(p) in bound:
                    continue
                node = await self.attempt(p, names)
                if node is not None:
                    bound[_key(p)] = node
        return bound


def _stored(fake: Any, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [fake.get("pods", p["metadata"]["name"], p["metadata"]["namespace"]) for p in pods]


async def _settle(replicas: list[Replica], fake: Any) -> None:
    want = int(fake.resource_version)
    for _ in range(400):
        if all(int(r.informer.rv["/api/v1/pods"] or 0) >= want for r in replicas):
            return
        await asyncio.sleep(0.025)
    raise AssertionError("replicas did not catch up with the API server")


def _no_over_commit(fake: Any, replicas: list[Replica]) -> None:
    nodes, pods = fake.objects("nodes"), fake.objects("pods")
    assert over_commits(nodes, pods) == []
    fresh = ClusterView()
    assert fresh.reset(nodes, pods) == 0
    for r in replicas:
        assert r.view.fingerprint() == fresh.fingerprint(), r.identity
        assert r.view.drift() == []


def test_two_gangs_one_fits_then_the_other(fake_api_factory: Any) -> None:
    fake = fake_api_factory()
    for n in NODES:
        fake.create(n)
    a = [gang_pod("train-a", i) for i in range(8)]
    b = [gang_pod("train-b", i) for i in range(8)]
    never = [gang_pod("huge", i, mem=16, min_available=9) for i in range(9)]
    for p in (*a, *b, *never):
        fake.create(p)
    names = [n["metadata"]["name"] for n in NODES]

    async def go() -> None:
        replicas = [Replica(KubeApi.from_url(fake.url), identity=f"r{i}", lease_duration=2.0,
                            renew_deadline=1.4, retry_period=0.4, check_every=0)
                    for i in range(2)]
        for r in replicas:
            await r.start()
        try:
            for _ in range(100):
                if any(r.may_bind() for r in replicas):
                    break
                await asyncio.sleep(0.05)
            leader = next(r for r in replicas if r.may_bind())
            follower = next(r for r in replicas if r is not leader)
            url = f"http://127.0.0.1:{leader.port}"
            async with aiohttp.ClientSession() as s:
                ks = KubeScheduler(s, url)
                # the queue interleaves the two gangs: B's first pod comes right after A's
                queue = [x for pair in zip(a, b, strict=True) for x in pair]
                bound = await ks.rounds(_stored(fake, queue), names)
                await _settle(replicas, fake)
                # A runs complete; B got nothing and holds nothing
                assert sorted(bound) == sorted(_key(p) for p in a)
                assert leader.view.gang_holds("default/train-b") == {}
                assert leader.view.inflight == {}
                assert "gang default/train-b: 0 of 8 pods fit" in ks.reasons["default/train-b-0"]
                assert "min-available 8" in ks.reasons["default/train-b-0"]
                _no_over_commit(fake, replicas)

                # a gang that can never fit (9 pods of a whole GPU each, 8 GPUs): nothing held,
                # on the leader and on the follower (a dry run there)
                for r in (leader, follower):
                    st = r.view.state.fingerprint()
                    ks_r = KubeScheduler(s, f"http://127.0.0.1:{r.port}")
                    for p in _stored(fake, never):
                        assert await ks_r.attempt(p, names) is None
                    assert r.view.inflight == {}
                    assert r.view.state.fingerprint() == st
                    assert "gang default/huge" in ks_r.reasons["default/huge-0"]
                for p in never:
                    fake.delete("pods", p["metadata"]["name"], "default")

                # gang A ends: gang B runs complete
                for p in a:
                    fake.delete("pods", p["metadata"]["name"], "default")
                await _settle(replicas, fake)
                bound_b = await ks.rounds(_stored(fake, b), names, n=1)
                assert sorted(bound_b) == sorted(_key(p) for p in b)
                await _settle(replicas, fake)
                assert leader.view.inflight == {}
                _no_over_commit(fake, replicas)
                for r in replicas:
                    await r.events.drain()
        finally:
            for r in replicas:
                await r.stop()
                await r.api.close()

    asyncio.run(go())


def test_podgroup_object_through_the_watch(fake_api_factory: Any) -> None:
    """A PodGroup (scheduling.sigs.k8s.io/v1alpha1) created after its pods gives the group its
    minMember: before it the filter names the missing min-available, after it the group is held
    and bound."""
    from sharegpu.core.gang import LABEL_GROUP_SHORT

    fake = fake_api_factory()
    for n in NODES:
        fake.create(n)
    pods = []
    for i in range(3):
        p = kobjects.pod(f"w-{i}", mem=8)
        p["metadata"]["labels"] = {LABEL_GROUP_SHORT: "job"}
        pods.append(p)
        fake.create(p)
    names = [n["metadata"]["name"] for n in NODES]

    async def go() -> None:
        r = Replica(KubeApi.from_url(fake.url), identity="r0", elect=False, check_every=0)
        await r.start()
        try:
            async with aiohttp.ClientSession() as s:
                ks = KubeScheduler(s, f"http://127.0.0.1:{r.port}")
                assert await ks.attempt(_stored(fake, pods)[0], names) is None
                assert "no min-available" in ks.reasons["default/w-0"]
                fake.create({"apiVersion": "scheduling.sigs.k8s.io/v1alpha1", "kind": "PodGroup",
                             "metadata": {"name": "job", "namespace": "default"},
                             "spec": {"minMember": 3, "scheduleTimeoutSeconds": 30}})
                for _ in range(200):
                    if ("default", "job") in r.view.podgroups:
                        break
                    await asyncio.sleep(0.025)
                assert r.view.podgroups[("default", "job")].timeout_s == 30
                bound = await ks.rounds(_stored(fake, pods), names, n=1)
                assert len(bound) == 3
                await _settle([r], fake)
                assert r.view.inflight == {}
                _no_over_commit(fake, [r])
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())
