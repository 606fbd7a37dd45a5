"""End to end: the fake API server, two extender replicas (Lease election, watches, binds) and a
driver playing kube-scheduler place 1,000 pods of mixed requests on 50 nodes of mixed modes.

Afterwards, computed from the API objects alone: no GPU over-committed in memory, compute or
pod count; every pod bound or carrying a reason Event; the state rebuilt from the annotations
equals each replica's live state. The second test does the same with 10 % of pod writes failing
(409 and 500, some after the write happened), watches dropped and history compacted (410), and
the leader killed mid-run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from scheduler_driver import REASONS, Driver, mixed_nodes, mixed_pods, over_commits
from sharegpu.extender.kube import KubeApi
from sharegpu.extender.replica import Replica
from sharegpu.extender.view import ClusterView

N_NODES = 50
N_PODS = 1000


def _setup(fake: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    nodes = mixed_nodes(N_NODES)
    pods = mixed_pods(N_PODS)
    for n in nodes:
        fake.create(n)
    for ns in ("team-a", "team-b"):
        fake.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    for p in pods:
        fake.create(p)
    # the driver sends pods as kube-scheduler's cache holds them: with their resourceVersion
    stored = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in fake.objects("pods")}
    return nodes, [stored[(p["metadata"]["namespace"], p["metadata"]["name"])] for p in pods]


def _bound_in(fake: Any) -> Any:
    def node_of(namespace: str, name: str) -> str | None:
        pod = fake.get("pods", name, namespace) or {}
        return (pod.get("spec") or {}).get("nodeName")

    return node_of


def _replica(fake: Any, name: str, lease_s: float = 2.0) -> Replica:
    return Replica(KubeApi.from_url(fake.url), identity=name, lease_duration=lease_s,
                   renew_deadline=lease_s * 0.7, retry_period=0.4, check_every=1.0)


async def _settle(replicas: list[Replica], fake: Any) -> None:
    """Wait until every replica's watch has seen the API server's latest resourceVersion."""
    want = int(fake.resource_version)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(int(r.informer.rv["/api/v1/pods"] or 0) >= want and not r.view.inflight
               for r in replicas):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("replicas did not catch up with the API server")


def _check(fake: Any, pods: list[dict[str, Any]], replicas: list[Replica], out: Any) -> None:
    nodes_now = fake.objects("nodes")
    pods_now = fake.objects("pods")
    # 1. no GPU over-committed, from the API objects alone
    assert over_commits(nodes_now, pods_now) == []
    # 2. every pod bound, or with a reason event; the driver's view agrees with the API
    bound = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p["spec"].get("nodeName")
             for p in pods_now}
    reasons: dict[str, set[str]] = {}
    for e in fake.objects("events"):
        io = e["involvedObject"]
        reasons.setdefault(f"{io['namespace']}/{io['name']}", set()).add(e["reason"])
    lost = []
    for p in pods:
        key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        if bound[key]:
            assert out.bound.get(key, bound[key]) == bound[key]
        elif not (reasons.get(key, set()) & REASONS):
            lost.append(key)
    assert lost == []
    assert out.failed == {}, out.failed
    for key, node in out.bound.items():
        assert bound[key] == node, key
    n_bound = sum(1 for v in bound.values() if v)
    assert n_bound > N_PODS // 2  # the cluster is full, not idle
    assert len(out.unschedulable) > 0
    # 3. the state rebuilt from annotations equals every live replica's state
    fresh = ClusterView()
    assert fresh.reset(nodes_now, pods_now) == 0
    for r in replicas:
        assert r.view.fingerprint() == fresh.fingerprint(), r.identity
        assert r.view.drift() == []


def test_thousand_pods_fifty_nodes(fake_api_factory: Any) -> None:
    fake = fake_api_factory(history_size=100000)
    nodes, pods = _setup(fake)

    async def go() -> None:
        # no fault here: a lease long enough that a loaded machine's late renewal does not
        # hand leadership over mid-run (test_faults_and_leader_loss covers that)
        replicas = [_replica(fake, "r0", lease_s=15.0), _replica(fake, "r1", lease_s=15.0)]
        for r in replicas:
            await r.start()
        try:
            driver = Driver(lambda: [f"http://127.0.0.1:{r.port}" for r in replicas],
                            [n["metadata"]["name"] for n in nodes], workers=8)
            out = await driver.run(pods)
            await _settle(replicas, fake)
            for r in replicas:
                await r.events.drain()
            assert sum(r.is_leader() for r in replicas) == 1
            _check(fake, pods, replicas, out)
            leader = next(r for r in replicas if r.is_leader())
            reg = leader.metrics.registry
            # without faults, a bind fails only when a pod in flight took the room first
            no_fit = reg.get_sample_value("sharegpu_extender_failures_total",
                                          {"verb": "bind", "reason": "no-fit"}) or 0
            assert out.bind_errors == no_fit
            assert leader.binder.reads < len(out.bound) // 10  # bind rarely reads the pod
            for r in replicas:  # the periodic consistency checks found nothing
                assert r.metrics.registry.get_sample_value(
                    "sharegpu_extender_state_drift_total") == 0
            text = leader.metrics.render().decode()
            assert "sharegpu_extender_leader 1.0" in text
            assert 'sharegpu_extender_decisions_total{result="ok",verb="bind"}' in text
        finally:
            for r in replicas:
                await r.stop()
                await r.api.close()

    asyncio.run(go())


def test_faults_and_leader_loss(fake_api_factory: Any) -> None:
    fake = fake_api_factory(history_size=100000, seed=3)
    nodes, pods = _setup(fake)

    async def go() -> None:
        replicas = [_replica(fake, "r0"), _replica(fake, "r1")]
        for r in replicas:
            await r.start()
        # 10 % of pod writes (annotation patches, bindings) fail: 409 and 500, a share of them
        # after the write happened (the answer is lost)
        rules = [
            fake.faults.fail(verbs="write", resources=["pods"], rate=0.04, code=409),
            fake.faults.fail(verbs="write", resources=["pods"], rate=0.04, code=500),
            fake.faults.fail(verbs="write", resources=["pods"], rate=0.02, code=500,
                             after_commit=True),
        ]
        killed: dict[str, float] = {}
        alive = list(replicas)

        async def chaos(done: int) -> None:
            if done % 150 == 0:
                fake.faults.drop_watches()
            if done == 500:
                fake.faults.compact()  # resuming watches now get 410 Gone: relist
                fake.faults.drop_watches()
            if done == 400 and not killed:
                leader = next(r for r in alive if r.is_leader())
                alive.remove(leader)
                killed["at"] = time.monotonic()
                killed["who"] = leader.identity  # type: ignore[assignment]
                await leader.stop(graceful=False)  # dies holding the lease

        try:
            driver = Driver(lambda: [f"http://127.0.0.1:{r.port}" for r in alive],
                            [n["metadata"]["name"] for n in nodes], workers=8,
                            bound_in_api=_bound_in(fake))
            out = await driver.run(pods, on_progress=chaos)
            fake.faults.clear()
            await _settle(alive, fake)
            for r in replicas:
                await r.events.drain()
            (survivor,) = alive
            assert survivor.is_leader() and survivor.identity != killed["who"]
            assert out.bind_errors > 0 and out.retries_after_leader_loss > 0
            assert all(rule.fired > 5 for rule in rules)
            # start, then at least the 410 after the compaction (taking over needs no relist
            # while the follower's watches stream: it binds from its warm view)
            relists = survivor.metrics.registry.get_sample_value(
                "sharegpu_extender_relists_total", {"resource": "all"})
            assert relists is not None and relists >= 2
            _check(fake, pods, alive, out)
            lease = fake.get("leases", "sharegpu-extender", "kube-system")
            assert lease["spec"]["holderIdentity"] == survivor.identity
        finally:
            for r in alive:
                await r.stop()
            for r in replicas:
                await r.api.close()

    asyncio.run(go())


def test_takeover_within_fifteen_seconds_at_default_timings(fake_api_factory: Any) -> None:
    fake = fake_api_factory()
    for n in mixed_nodes(4):
        fake.create(n)

    async def go() -> None:
        a = Replica(KubeApi.from_url(fake.url), identity="a")  # default: 10 s lease
        b = Replica(KubeApi.from_url(fake.url), identity="b")
        await a.start()
        await asyncio.sleep(0.2)
        await b.start()
        try:
            for _ in range(100):
                if a.may_bind() and b.is_ready():
                    break
                await asyncio.sleep(0.05)
            # both take traffic; only the leader binds; the follower's view is warm
            assert a.is_ready() and b.is_ready() and a.may_bind() and not b.may_bind()
            t0 = time.monotonic()
            await a.stop(graceful=False)
            while not b.may_bind():
                await asyncio.sleep(0.1)
                assert time.monotonic() - t0 < 15
        finally:
            await b.stop()
            for r in (a, b):
                await r.api.close()

    asyncio.run(go())
