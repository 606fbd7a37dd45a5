"""Held picks follow kube-scheduler: a refusal at bind gives the pick back at once, and a pick
whose bind never comes expires on its timeout with no traffic at all (``/metrics`` never shows
it). Each end is logged and counted (``sharegpu_extender_picks_ended``)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from sharegpu.extender.kube import KubeApi
from sharegpu.extender.replica import Replica
from sharegpu_testing import kobjects


def _replica(fake: Any, **kw: Any) -> Replica:
    return Replica(KubeApi.from_url(fake.url), identity="only", elect=False, check_every=0,
                   **kw)


async def _wait(pred: Any, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition not met"
        await asyncio.sleep(0.05)


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_refusal_at_bind_gives_back_the_pick(fake_api_factory: Any, caplog: Any) -> None:
    fake = fake_api_factory()
    fake.create(kobjects.node("n1", [16], "cgpu"))
    fake.create(kobjects.pod("a", mem=16))
    a = fake.get("pods", "a", "default")
    caplog.set_level(logging.INFO)  # the extender's default level

    async def go() -> None:
        r = _replica(fake)
        await r.start()
        base = f"http://127.0.0.1:{r.port}"
        try:
            await _wait(r.is_ready)
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/filter", json={"Pod": a, "NodeNames": ["n1"]}) as q:
                    assert (await q.json())["NodeNames"] == ["n1"]
                assert r.view.held_pick("default/a") == "n1"
                # refused before any GPU is reserved (the uid is not the pod's)
                async with s.post(f"{base}/bind", json={
                        "PodName": "a", "PodNamespace": "default", "PodUID": "not-its-uid",
                        "Node": "n1"}) as q:
                    assert "uid" in (await q.json())["Error"]
                assert r.view.held_pick("default/a") is None
                assert "default/a" not in r.view.inflight and not r.view.state.pods
                async with s.get(f"{base}/metrics") as q:
                    text = await q.text()
            assert _value(text, 'sharegpu_extender_picks_ended_total{reason="bind-refused"}') \
                == 1.0
            assert _value(text, "sharegpu_extender_held_picks") == 0.0
            assert any("given back (bind-refused)" in m for m in caplog.messages)
            assert any("bind default/a to n1 failed (uid)" in m for m in caplog.messages)
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())


def test_held_picks_expire_with_no_traffic(fake_api_factory: Any, caplog: Any) -> None:
    fake = fake_api_factory()
    fake.create(kobjects.node("n1", [16, 16], "cgpu"))
    for name in ("a", "b"):
        fake.create(kobjects.pod(name, mem=8))
    pods = [fake.get("pods", n, "default") for n in ("a", "b")]
    caplog.set_level(logging.INFO)  # the extender's default level

    async def go() -> None:
        r = _replica(fake, hold_timeout=0.5)
        await r.start()
        base = f"http://127.0.0.1:{r.port}"
        try:
            await _wait(r.is_ready)
            async with aiohttp.ClientSession() as s:
                for p in pods:
                    async with s.post(f"{base}/filter",
                                      json={"Pod": p, "NodeNames": ["n1"]}) as q:
                        assert (await q.json())["NodeNames"] == ["n1"]
                assert len(r.view.picks) == 2 and r.view.state.pods
                # no request at all from now on: the timer gives them back
                await _wait(lambda: len(r.view.picks) == 0, timeout=10)
                assert not r.view.inflight and not r.view.state.pods
                async with s.get(f"{base}/metrics") as q:
                    text = await q.text()
            assert _value(text, "sharegpu_extender_held_picks") == 0.0
            assert _value(text, 'sharegpu_extender_picks_ended_total{reason="expired"}') == 2.0
            assert 'sharegpu_gpu_memory_allocated' not in text or all(
                line.endswith(" 0.0") for line in text.splitlines()
                if line.startswith("sharegpu_gpu_memory_allocated"))
            assert sum("given back (expired)" in m for m in caplog.messages) == 2
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())


def test_a_resourcepolicy_refusal_at_bind_gives_back_the_pick(fake_api_factory: Any) -> None:
    """The pod's policy refuses the node bind names (in none of its units): refused before
    any GPU is reserved for the bind, and the pick its filter held goes too."""
    from test_resourcepolicy_e2e import nodes, policy, replica, start, web_pods

    fake = fake_api_factory()
    names = nodes(fake)
    fake.create(kobjects.node("z0", [16, 16], "cgpu"))  # in no unit of the policy
    fake.create(policy())
    (pod,) = web_pods(fake, 0, 1, mem=16)

    async def go() -> None:
        r = await start(replica(fake, "only"))
        base = f"http://127.0.0.1:{r.port}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/filter", json={"Pod": pod, "NodeNames": names}) as q:
                    (picked,) = (await q.json())["NodeNames"]
                assert picked.startswith("a") and r.view.held_pick("default/web-000") == picked
                m = pod["metadata"]
                async with s.post(f"{base}/bind", json={
                        "PodName": m["name"], "PodNamespace": "default", "PodUID": m["uid"],
                        "Node": "z0"}) as q:
                    err = (await q.json())["Error"]
            assert "z0" in err, err
            assert r.view.held_pick("default/web-000") is None
            assert "default/web-000" not in r.view.inflight and not r.view.state.pods
            assert r.view.holds.ended["bind-refused"] == 1
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())
