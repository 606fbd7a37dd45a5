"""High availability as a cluster runs it: every replica with a warm view is Ready (so a rolling
update of the Deployment and a drain of the leader's node can proceed), followers pass binds on
to the leader, binds happen only on the leader, and after the leader dies binds resume within
2 s of its lease's expiry — against the fake API server, through HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from typing import Any

import aiohttp

from scheduler_driver import Driver, mixed_nodes, mixed_pods, over_commits
from sharegpu.extender.kube import KubeApi
from sharegpu.extender.replica import Replica
from sharegpu_testing import kobjects


def replica(fake: Any, name: str, **timing: float) -> Replica:
    return Replica(KubeApi.from_url(fake.url), identity=name, check_every=0, **timing)


async def ready(url: str, s: aiohttp.ClientSession) -> bool:
    try:
        async with s.get(f"{url}/readyz") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


def url(r: Replica) -> str:
    return f"http://127.0.0.1:{r.port}"


async def wait(pred, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition not met"
        await asyncio.sleep(0.02)


async def schedule_once(s: aiohttp.ClientSession, base: str, pod: dict[str, Any],
                        names: list[str]) -> str:
    """filter, prioritize, bind through one replica; the bind's Error ('' on success)."""
    async with s.post(f"{base}/filter", json={"Pod": pod, "NodeNames": names}) as r:
        f = await r.json()
    passed = f.get("NodeNames") or []
    if f.get("Error") or not passed:
        return f.get("Error") or "unschedulable"
    async with s.post(f"{base}/prioritize", json={"Pod": pod, "NodeNames": passed}) as r:
        pr = await r.json()
    node = max(pr, key=lambda h: h["Score"])["Host"] if pr else passed[0]
    m = pod["metadata"]
    async with s.post(f"{base}/bind", json={"PodName": m["name"], "PodNamespace": m["namespace"],
                                            "PodUID": m["uid"], "Node": node}) as r:
        return (await r.json())["Error"]


def stored(fake: Any, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in fake.objects("pods")}
    return [by[(p["metadata"]["namespace"], p["metadata"]["name"])] for p in pods]


def test_followers_are_ready_and_forward_filter_and_bind_to_the_leader(
        fake_api_factory: Any) -> None:
    """Both replicas are Ready; only the leader serves the verbs (/servingz). A follower
    reached anyway passes filter and bind on to the leader (so the leader holds the pick) and
    closes the connection after each answer (the caller reconnects through the Service)."""
    fake = fake_api_factory()
    fake.create(kobjects.node("n1", [16, 16], "cgpu"))
    pods = [kobjects.pod(f"p{i}", mem=4) for i in range(3)]
    for p in pods:
        fake.create(p)
    pods = stored(fake, pods)

    async def go() -> None:
        a, b = replica(fake, "a"), replica(fake, "b")
        await a.start()
        await wait(a.is_leader)
        await b.start()
        async with aiohttp.ClientSession() as s:
            try:
                await wait(lambda: b.elector is not None and b.elector.holder_url == url(a))
                assert await ready(url(a), s) and await ready(url(b), s)  # both are Ready
                assert not b.is_leader() and not b.may_bind()
                async with s.get(f"{url(a)}/servingz") as r:
                    assert r.status == 200
                async with s.get(f"{url(b)}/servingz") as r:
                    assert r.status == 503
                m0 = pods[0]["metadata"]
                async with s.post(f"{url(b)}/filter",
                                  json={"Pod": pods[0], "NodeNames": ["n1"]}) as r:
                    assert (await r.json())["NodeNames"] == ["n1"]
                    assert r.headers.get("Connection", "").lower() == "close"
                assert a.view.held_pick("default/p0") == "n1"  # held where binds happen
                assert b.forwarded == 1
                async with s.post(f"{url(b)}/bind", json={
                        "PodName": "p0", "PodNamespace": "default", "PodUID": m0["uid"],
                        "Node": "n1"}) as r:
                    assert (await r.json())["Error"] == ""
                assert b.forwarded == 2  # the follower passed filter and bind on
                assert fake.get("pods", "p0", "default")["spec"]["nodeName"] == "n1"
                # a forwarded bind that reaches a follower is refused there, not sent on again
                m = pods[1]["metadata"]
                async with s.post(f"{url(b)}/bind", headers={"X-Sharegpu-Forwarded-By": "x"},
                                  json={"PodName": m["name"], "PodNamespace": "default",
                                        "PodUID": m["uid"], "Node": "n1"}) as r:
                    assert "not the leader" in (await r.json())["Error"]
                assert b.forwarded == 2
                lease = fake.get("leases", "sharegpu-extender", "kube-system")
                assert lease["metadata"]["annotations"]["sharegpu.io/leader-url"] == url(a)
            finally:
                for r in (a, b):
                    await r.stop()
                    await r.api.close()

    asyncio.run(go())


def test_binds_resume_within_two_seconds_of_the_lease_expiry(fake_api_factory: Any) -> None:
    """Default timings (10 s lease). The leader dies holding the Lease; kube-scheduler keeps
    sending to the follower, which forwards while there is a leader and binds itself once it
    takes over. The gap is measured from the lease's expiry: the dead leader's last renewTime
    plus leaseDurationSeconds."""
    fake = fake_api_factory()
    for n in mixed_nodes(8):
        fake.create(n)
    pods = [kobjects.pod(f"q{i:03d}", mem=1) for i in range(400)]
    for p in pods:
        fake.create(p)
    pods = stored(fake, pods)
    names = [n["metadata"]["name"] for n in fake.objects("nodes")]

    async def go() -> None:
        a, b = replica(fake, "a"), replica(fake, "b")
        await a.start()
        await wait(a.is_leader)
        await b.start()
        log: list[tuple[float, bool]] = []
        at_kill: dict[str, Any] = {}
        async with aiohttp.ClientSession() as s:
            try:
                await wait(lambda: b.view.synced and b.elector is not None
                           and b.elector.holder_url == url(a))
                queue = list(pods)
                killed_at = 0.0
                while queue:
                    pod = queue[0]
                    err = await schedule_once(s, url(b), pod, names)
                    log.append((time.time(), not err))
                    if not err or err == "unschedulable":
                        queue.pop(0)
                    else:
                        await asyncio.sleep(0.05)  # kube-scheduler backs off and retries
                    if not killed_at and len(log) == 20:
                        await a.stop(graceful=False)  # dies holding the lease
                        killed_at = time.time()
                        at_kill = fake.get("leases", "sharegpu-extender", "kube-system")
                    if killed_at and b.is_leader() and len(queue) < 300:
                        break
                lease = fake.get("leases", "sharegpu-extender", "kube-system")
            finally:
                await b.stop()
                for r in (a, b):
                    await r.api.close()
        assert lease["spec"]["holderIdentity"] == "b"
        # the dead leader's last renewal: the lease as it stood when it died
        assert at_kill["spec"]["holderIdentity"] == "a"
        renewed = datetime.fromisoformat(at_kill["spec"]["renewTime"].replace("Z", "+00:00"))
        expiry = renewed.timestamp() + at_kill["spec"]["leaseDurationSeconds"]
        first_ok = min(t for t, ok in log if ok and t > killed_at)
        gap = first_ok - expiry
        print(json.dumps({"bind_gap_after_lease_expiry_s": round(gap, 3),
                          "outage_s": round(first_ok - killed_at, 3)}))
        assert gap < 2.0, gap
        assert over_commits(fake.objects("nodes"), fake.objects("pods")) == []

    asyncio.run(go())


def test_rolling_update_of_two_replicas_loses_no_bind(fake_api_factory: Any) -> None:
    """The Deployment controller's rules for 2 replicas (maxSurge 1, maxUnavailable 0): a new
    pod starts, the controller waits until it is Ready, then stops an old one; twice. Pods are
    scheduled through "the Service" (any Ready replica) all along."""
    fake = fake_api_factory(history_size=100000)
    nodes = mixed_nodes(20)
    for n in nodes:
        fake.create(n)
    for ns in ("team-a", "team-b"):
        fake.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    pods = mixed_pods(300)
    for p in pods:
        fake.create(p)
    pods = stored(fake, pods)
    timing = {"lease_duration": 2.0, "renew_deadline": 1.4, "retry_period": 0.4}

    async def go() -> None:
        old = [replica(fake, "old-0", **timing), replica(fake, "old-1", **timing)]
        for r in old:
            await r.start()
        serving = list(old)
        steps: list[str] = []

        async def rollout(s: aiohttp.ClientSession) -> None:
            for i in range(2):
                new = replica(fake, f"new-{i}", **timing)
                await new.start()
                serving.append(new)
                t0 = time.monotonic()
                while not await ready(url(new), s):  # the controller waits for Ready
                    assert time.monotonic() - t0 < 20, "new replica never became Ready"
                    await asyncio.sleep(0.05)
                gone = serving.pop(0)
                steps.append(f"{new.identity} ready, {gone.identity} stopped")
                await gone.stop()  # SIGTERM: gives the lease up
                await asyncio.sleep(0.5)

        try:
            driver = Driver(lambda: [url(r) for r in serving],
                            [n["metadata"]["name"] for n in nodes], workers=4,
                            bound_in_api=lambda ns, n: (fake.get("pods", n, ns) or {}).get(
                                "spec", {}).get("nodeName"))
            async with aiohttp.ClientSession() as s:
                out, _ = await asyncio.gather(driver.run(pods), rollout(s))
            assert len(steps) == 2 and [r.identity for r in serving] == ["new-0", "new-1"]
            assert out.failed == {}, out.failed  # no bind lost
            assert sum(r.is_leader() for r in serving) == 1
            assert over_commits(fake.objects("nodes"), fake.objects("pods")) == []
            bound = [p for p in fake.objects("pods") if p["spec"].get("nodeName")]
            assert len(bound) == len(out.bound) > 100
        finally:
            for r in serving:
                await r.stop()
            for r in [*old]:
                await r.api.close()

    asyncio.run(go())


def test_a_forwarded_bind_ends_within_the_callers_deadline(fake_api_factory: Any) -> None:
    """The follower passes the bind on with what is left of its caller's deadline; the leader
    binds within that, not within a deadline of its own counted from the forward's arrival:
    with the API server answering the Binding in 3 s, the caller (1 s of bind timeout) has
    its answer in time and no Binding lands afterwards."""
    fake = fake_api_factory()
    fake.create(kobjects.node("n1", [16], "cgpu"))
    fake.create(kobjects.pod("p0", mem=4))
    pod = stored(fake, [fake.get("pods", "p0", "default")])[0]
    fake.faults.delay(3.0, verbs="create", resources="pods/binding")

    async def go() -> None:
        a, b = replica(fake, "a", bind_timeout=1.0), replica(fake, "b", bind_timeout=1.0)
        await a.start()
        await wait(a.is_leader)
        await b.start()
        try:
            await wait(lambda: b.elector is not None and b.elector.holder_url == url(a)
                       and b.view.synced and a.serves_verbs())
            async with aiohttp.ClientSession() as s:
                t0 = time.monotonic()
                m = pod["metadata"]
                async with s.post(f"{url(b)}/bind", json={
                        "PodName": "p0", "PodNamespace": "default", "PodUID": m["uid"],
                        "Node": "n1"}) as r:
                    err = (await r.json())["Error"]
                    took = time.monotonic() - t0
                    assert r.headers.get("Connection", "").lower() == "close"
            assert err and b.forwarded == 1
            assert took < 2.5, took  # 1 s of deadline; 8 s before, and the leader's 7 s after
            await asyncio.sleep(3.0)  # a Binding still on its way would have landed
            assert not fake.get("pods", "p0", "default")["spec"].get("nodeName")
        finally:
            for r in (a, b):
                await r.stop()
                await r.api.close()

    asyncio.run(go())


def test_the_leader_labels_its_pod_for_the_service(fake_api_factory: Any) -> None:
    """The Service selects sharegpu.io/extender-serving=true: the leader's pod carries it, the
    follower's says false, and it moves with the lease."""
    fake = fake_api_factory()
    fake.create(kobjects.node("n1", [16], "cgpu"))
    for name in ("ext-a", "ext-b"):
        fake.create({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": name, "namespace": "kube-system"},
                     "spec": {"containers": [{"name": "c", "image": "x"}]}})
    timing = {"lease_duration": 2.0, "renew_deadline": 1.4, "retry_period": 0.4}

    def label(name: str) -> str | None:
        pod = fake.get("pods", name, "kube-system")
        return ((pod["metadata"].get("labels") or {}).get("sharegpu.io/extender-serving"))

    async def go() -> None:
        a = Replica(KubeApi.from_url(fake.url), identity="a", check_every=0,
                    own_pod="kube-system/ext-a", **timing)
        b = Replica(KubeApi.from_url(fake.url), identity="b", check_every=0,
                    own_pod="kube-system/ext-b", **timing)
        await a.start()
        await wait(a.serves_verbs)
        await b.start()
        try:
            await wait(lambda: label("ext-a") == "true" and label("ext-b") == "false")
            await a.stop()  # gives the lease up
            await wait(lambda: b.serves_verbs() and label("ext-b") == "true")
        finally:
            await b.stop()
            for r in (a, b):
                await r.api.close()

    asyncio.run(go())
