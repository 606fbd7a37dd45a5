"""ResourcePolicy end to end on the fake API server: extender replicas (watches, Lease, binds)
driven over HTTP as kube-scheduler drives them (tests/scheduler_driver.py).

- a Deployment-like set of 30 pods over three units (max 10 / 10 / unlimited) lands 10/10/10 in
  order, with the extender replica restarted in the middle (the new one counts from the pods'
  annotations);
- scaled to 12 by the ReplicaSet controller's deletion order (pod-deletion-cost first), the pods
  of the last unit go first, and the counts follow; scaled up again, new pods fill unit 1;
- ``whenTryNextUnits: TimeoutOrExceedMax`` lets a pod go to the next unit only after the
  timeout (an injected clock);
- pods without GPUs in the co-scheduler profile obey a policy too, and are bound by the
  extender's bind verb;
- a malformed policy that got into the API server is ignored and disturbs no pod.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import aiohttp

from scheduler_driver import Driver, over_commits
from sharegpu.core.resourcepolicy import ANN_DELETION_COST, ANN_UNIT, API_VERSION
from sharegpu.extender.kube import KubeApi
from sharegpu.extender.replica import Replica
from sharegpu_testing import kobjects
from test_extender_ha import schedule_once, stored, wait

POOLS = ("a", "b", "c")


def nodes(fake: Any, gpus: dict[str, list[int]] | None = None) -> list[str]:
    out = []
    for pool in POOLS:
        for i in range(2):
            n = kobjects.node(f"{pool}{i}", (gpus or {}).get(pool, [16, 16]), "cgpu")
            n["metadata"]["labels"]["pool"] = pool
            fake.create(n)
            out.append(n["metadata"]["name"])
    return out


def policy(name: str = "web", app: str = "web", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": {"app": app},
        "strategy": "prefer",
        "units": [
            {"resource": "ecs", "nodeSelector": {"pool": "a"}, "max": 10,
             "podLabels": {"unit": "first"}, "podAnnotations": {"note": "on-demand"}},
            {"resource": "ecs", "nodeSelector": {"pool": "b"}, "max": 10,
             "podLabels": {"unit": "second"}},
            {"resource": "ecs", "nodeSelector": {"pool": "c"},
             "podLabels": {"unit": "third"}},
        ],
    }
    body.update(spec)
    return {"apiVersion": API_VERSION, "kind": "ResourcePolicy",
            "metadata": {"name": name, "namespace": "default"}, "spec": body}


def web_pods(fake: Any, first: int, n: int, *, app: str = "web", gpu: bool = True,
             mem: int = 1) -> list[dict[str, Any]]:
    """Pods as a ReplicaSet makes them (one template: app and pod-template-hash labels)."""
    out = []
    for i in range(first, first + n):
        p = kobjects.pod(f"{app}-{i:03d}", mem=mem if gpu else None, cpu="100m")
        if not gpu:
            p["spec"]["containers"][0]["resources"].pop("limits", None)
        p["metadata"]["labels"].update({"app": app, "pod-template-hash": "5d8f"})
        fake.create(p)
        out.append(p)
    return stored(fake, out)


def pool_of(pod: dict[str, Any]) -> str:
    return pod["spec"]["nodeName"][0]


def live(fake: Any, app: str = "web") -> list[dict[str, Any]]:
    """The set's pods bound to a node."""
    return [p for p in fake.objects("pods")
            if p["metadata"]["labels"].get("app") == app and p["spec"].get("nodeName")]


def replica(fake: Any, name: str) -> Replica:
    return Replica(KubeApi.from_url(fake.url), identity=name, check_every=0,
                   lease_duration=2.0, renew_deadline=1.4, retry_period=0.4)


async def start(r: Replica) -> Replica:
    await r.start()
    await wait(r.is_leader)
    await wait(lambda: r.may_bind() and r.units.synced)
    return r


async def settle(r: Replica, fake: Any) -> None:
    want = int(fake.resource_version)
    await wait(lambda: int(r.informer.rv["/api/v1/pods"] or 0) >= want and not r.units.claims)


def url(r: Replica) -> str:
    return f"http://127.0.0.1:{r.port}"


def replica_set_deletion_order(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ReplicaSet controller's order for removing pods (kube-controller-manager
    ``controller.ActivePodsWithRanks``): unassigned before assigned; Pending before Unknown
    before Running; not ready before ready; lower ``controller.kubernetes.io/pod-deletion-cost``
    first; more pods of the set on the same node first; newer first. (Readiness times and
    restarts are equal here: no kubelet runs.)"""
    on_node = Counter(p["spec"].get("nodeName") for p in pods)
    phase = {"Pending": 0, "Unknown": 1, "Running": 2}

    def rank(p: dict[str, Any]) -> tuple[Any, ...]:
        node = p["spec"].get("nodeName")
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (p.get("status") or {}).get("conditions") or [])
        cost = int((p["metadata"].get("annotations") or {}).get(ANN_DELETION_COST, "0"))
        created = p["metadata"]["creationTimestamp"]
        return (bool(node), phase.get((p.get("status") or {}).get("phase"), 0), ready, cost,
                -on_node[node], _neg(created))

    return sorted(pods, key=rank)


def _neg(stamp: str) -> tuple[int, ...]:
    # newer first: compare the timestamp's characters negated
    return tuple(-ord(ch) for ch in stamp)


def test_thirty_pods_fill_three_units_in_order_across_a_restart_then_scale_in_reverse(
        fake_api_factory: Any) -> None:
    fake = fake_api_factory(history_size=100000)
    names = nodes(fake)
    fake.create(policy())
    pods = web_pods(fake, 0, 30)

    async def go() -> None:
        a = await start(replica(fake, "a"))
        driver = Driver(lambda: [url(a)], names, workers=4)
        out = await driver.run(pods[:15])
        assert out.failed == {} and not out.unschedulable
        await settle(a, fake)
        assert Counter(pool_of(p) for p in live(fake)) == {"a": 10, "b": 5}
        assert a.units.unit_counts("default/web") == {0: 10, 1: 5}
        # the replica restarts (a new process: nothing kept but what the pods say)
        await a.stop()
        await a.api.close()
        b = await start(replica(fake, "b"))
        try:
            assert b.units.unit_counts("default/web") == {0: 10, 1: 5}
            driver = Driver(lambda: [url(b)], names, workers=4)
            out = await driver.run(pods[15:])
            assert out.failed == {} and not out.unschedulable
            await settle(b, fake)
            now = live(fake)
            assert Counter(pool_of(p) for p in now) == {"a": 10, "b": 10, "c": 10}
            assert over_commits(fake.objects("nodes"), fake.objects("pods")) == []
            # in order: every pod of unit 0 was bound before any of unit 1, and so on
            for p in now:
                unit = "abc".index(pool_of(p))
                anns, labels = p["metadata"]["annotations"], p["metadata"]["labels"]
                assert anns[ANN_UNIT] == f"web/{unit}"
                assert labels["unit"] == ("first", "second", "third")[unit]
                assert labels["app"] == "web"  # the ReplicaSet still owns it
                assert (anns.get("note") == "on-demand") == (unit == 0)
                assert int(anns[ANN_DELETION_COST]) == (3 - unit) * 100

            # scale to 12: the ReplicaSet controller removes 18 pods in its order
            doomed = replica_set_deletion_order(now)[:18]
            assert Counter(pool_of(p) for p in doomed) == {"c": 10, "b": 8}
            for p in doomed:
                fake.delete("pods", p["metadata"]["name"], "default")
            await settle(b, fake)
            assert Counter(pool_of(p) for p in live(fake)) == {"a": 10, "b": 2}
            assert b.units.unit_counts("default/web") == {0: 10, 1: 2}
            # scale to 22: unit 1 fills before unit 2
            more = web_pods(fake, 30, 10)
            out = await Driver(lambda: [url(b)], names, workers=4).run(more)
            assert out.failed == {}
            await settle(b, fake)
            assert Counter(pool_of(p) for p in live(fake)) == {"a": 10, "b": 10, "c": 2}
        finally:
            await b.stop()
            await b.api.close()

    asyncio.run(go())


def test_timeout_or_exceed_max_waits_the_timeout_before_the_next_unit(
        fake_api_factory: Any) -> None:
    fake = fake_api_factory()
    # unit a's GPUs are too small for the pod: it may go to b only after 60 s
    names = nodes(fake, {"a": [4]})
    fake.create(policy(whenTryNextUnits={"policy": "TimeoutOrExceedMax", "timeout": "60s"}))
    (p,) = web_pods(fake, 0, 1, mem=8)
    offset = [0.0]

    async def go() -> None:
        r = replica(fake, "r")
        r.units.clock = lambda: time.time() + offset[0]
        await start(r)
        try:
            async with aiohttp.ClientSession() as s:
                body = {"Pod": p, "NodeNames": names}
                async with s.post(f"{url(r)}/filter", json=body) as resp:
                    f = await resp.json()
                assert f["NodeNames"] == []
                reasons = {**(f.get("FailedNodes") or {}),
                           **(f.get("FailedAndUnresolvableNodes") or {})}
                assert "ResourcePolicy default/web" in reasons["b0"]
                assert "does not allow unit 1 yet" in reasons["b0"]
                offset[0] = 61.0
                assert await schedule_once(s, url(r), p, names) == ""
            assert pool_of(fake.get("pods", p["metadata"]["name"])) == "b"
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())


def test_pods_without_gpus_obey_the_policy_and_are_bound_by_the_extender(
        fake_api_factory: Any) -> None:
    fake = fake_api_factory()
    names = nodes(fake)
    fake.create(policy(name="plain", app="plain",
                       units=[{"nodeSelector": {"pool": "c"}, "max": 2,
                               "podLabels": {"unit": "first"}},
                              {"nodeSelector": {"pool": "b"}}]))
    pods = web_pods(fake, 0, 4, app="plain", gpu=False)
    (free,) = web_pods(fake, 0, 1, app="other", gpu=False)

    async def go() -> None:
        r = await start(replica(fake, "r"))
        try:
            out = await Driver(lambda: [url(r)], names, workers=2).run([*pods, free])
            assert out.failed == {} and not out.unschedulable
            await settle(r, fake)
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())
    got = live(fake, "plain")
    assert Counter(pool_of(p) for p in got) == {"c": 2, "b": 2}
    for p in got:
        assert ("unit" in p["metadata"]["labels"]) == (pool_of(p) == "c")
        assert p["metadata"]["annotations"][ANN_UNIT].startswith("plain/")
    other = fake.get("pods", free["metadata"]["name"])
    assert other["spec"]["nodeName"]  # no policy: bound where kube-scheduler chose
    assert ANN_UNIT not in (other["metadata"].get("annotations") or {})


def test_a_malformed_policy_is_ignored_and_disturbs_no_pod(fake_api_factory: Any) -> None:
    fake = fake_api_factory()
    names = nodes(fake)
    fake.create(policy(units="not a list"))  # the webhook and the schema were bypassed
    (p,) = web_pods(fake, 0, 1)

    async def go() -> None:
        r = await start(replica(fake, "r"))
        try:
            assert "spec.units" in r.units.problems["default/web"]
            async with aiohttp.ClientSession() as s:
                assert await schedule_once(s, url(r), p, names) == ""
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())
    assert fake.get("pods", p["metadata"]["name"])["spec"]["nodeName"]
