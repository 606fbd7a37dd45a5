"""Lease-based leader election: one leader at a time, takeover after the lease runs out on the
follower's own clock, the leader stops binding before anyone may take over."""

from __future__ import annotations

import asyncio

from sharegpu.extender.leader import LeaderElector
from sharegpu_testing.memapi import MemoryApi


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def electors(api: MemoryApi, clock: Clock, n: int = 2) -> list[LeaderElector]:
    return [LeaderElector(api, "kube-system", "sharegpu-extender", f"r{i}", lease_duration=10,
                          renew_deadline=7, retry_period=2, clock=clock) for i in range(n)]


def test_one_leader_and_takeover_within_the_lease() -> None:
    async def go() -> None:
        api, clock = MemoryApi(), Clock()
        a, b = electors(api, clock)
        await a.step()
        await b.step()
        assert a.is_leader() and not b.is_leader() and b.holder == "r0"
        # the leader keeps renewing; the follower never takes over
        for _ in range(20):
            clock.t += 2
            await a.step()
            await b.step()
            assert a.is_leader() and not b.is_leader()
        # the leader dies (no more renewals): it stops counting itself leader after 7 s ...
        died = clock.t
        took_over = None
        while took_over is None:
            clock.t += 2
            await b.step()
            assert not (a.is_leader() and b.is_leader())
            if b.is_leader():
                took_over = clock.t
        assert not a.is_leader()
        assert took_over - died <= 15
        lease = api.objects["/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/"
                            "sharegpu-extender"]
        assert lease["spec"]["holderIdentity"] == "r1"
        assert lease["spec"]["leaseTransitions"] == 1

    asyncio.run(go())


def test_conflicting_writes_never_make_two_leaders() -> None:
    async def go() -> None:
        api, clock = MemoryApi(), Clock()
        replicas = electors(api, clock, 3)
        await replicas[0].step()
        clock.t += 30  # the holder is gone; all followers see the lease expire together
        for r in replicas[1:]:
            await r.step()  # first observation
        clock.t += 11
        await asyncio.gather(*(r.step() for r in replicas[1:]))
        leaders = [r.identity for r in replicas if r.is_leader()]
        assert len(leaders) == 1 and leaders[0] != "r0"

    asyncio.run(go())


def test_failing_api_means_no_leadership() -> None:
    async def go() -> None:
        api, clock = MemoryApi(), Clock()
        (a,) = electors(api, clock, 1)
        await a.step()
        assert a.is_leader()
        api.fail_writes = 100
        for _ in range(4):
            clock.t += 2
            await a.step()  # renewals fail: errors are logged, not raised
        assert not a.is_leader()
        api.fail_writes = 0
        clock.t += 2
        await a.step()
        assert a.is_leader()

    asyncio.run(go())


def test_release_hands_over_at_once() -> None:
    async def go() -> None:
        api, clock = MemoryApi(), Clock()
        a, b = electors(api, clock)
        changes: list[bool] = []
        a.on_change = changes.append
        await a.step()
        await a.release()
        assert not a.is_leader() and changes == [True, False]
        await b.step()
        assert b.is_leader()

    asyncio.run(go())
