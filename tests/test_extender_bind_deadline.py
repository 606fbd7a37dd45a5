"""Every bind ends inside kube-scheduler's patience, and a Binding the API server may still
commit keeps its GPUs: against the fake API server with injected latency, through HTTP.

kube-scheduler gives up on a bind ``httpTimeout`` after it sent the request (Go's client
deadline over the whole exchange) and places the pod again. The extender counts its own bind
deadline from the request's first byte, so a stall of its event loop between the request's
arrival and its handler does not push the Binding past that; and a Binding that was sent but
not answered in time may still be committed, so its GPUs stay taken until the pod is seen bound
(confirmed) or the API server's own timeout for the write has passed with the pod unbound.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from scheduler_driver import over_commits
from sharegpu.extender.kube import KubeApi
from sharegpu.extender.replica import Replica
from sharegpu_testing import kobjects


def _replica(fake: Any, **kw: Any) -> Replica:
    return Replica(KubeApi.from_url(fake.url), identity="only", elect=False, check_every=0,
                   start_wait=0.2, **kw)


def _binding(pod: dict[str, Any], node: str) -> dict[str, Any]:
    m = pod["metadata"]
    return {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"],
            "Node": node}


def _node_of(fake: Any, name: str) -> str:
    return str((fake.get("pods", name, "default") or {}).get("spec", {}).get("nodeName") or "")


async def _wait(pred: Any, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition not met"
        await asyncio.sleep(0.02)


def test_a_loop_stall_before_the_handler_does_not_push_the_binding_past_the_caller(
        fake_api_factory: Any) -> None:
    """The caller (kube-scheduler) gives up ``PATIENCE`` s after its request's first byte. The
    extender's event loop stalls ``STALL`` s between that byte and the handler (what a
    consistency check or a relist does at scale), and the API server takes ``API`` s to answer
    the Binding. Counted from the handler, the Binding lands after the caller gave up; counted
    from the first byte, the bind gives up unwritten in time."""
    BIND, PATIENCE, STALL, API = 3.0, 4.0, 2.0, 2.5
    fake = fake_api_factory()
    fake.create(kobjects.node("n1", [16], "cgpu"))
    fake.create(kobjects.pod("a", mem=4))
    pod = fake.get("pods", "a", "default")
    fake.faults.delay(API, verbs="create", resources="pods/binding", times=1)

    async def go() -> None:
        r = _replica(fake, bind_timeout=BIND)
        await r.start()
        try:
            await _wait(r.is_ready)
            body = json.dumps(_binding(pod, "n1")).encode()
            head = (f"POST /bind HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            t0 = time.monotonic()
            writer.write(head + body[:-1])
            await writer.drain()
            await asyncio.sleep(0.2)  # the server has read the request's start
            time.sleep(STALL)  # the event loop stalls (nothing else runs)
            writer.write(body[-1:])
            await writer.drain()
            raw = await asyncio.wait_for(reader.read(65536), 15)
            answered = time.monotonic() - t0
            writer.close()
            answer = json.loads(raw.split(b"\r\n\r\n", 1)[1])
            await asyncio.sleep(API)  # a Binding still on its way would have landed by now
            bound = _node_of(fake, "a")
            print(json.dumps({"answered_s": round(answered, 3), "error": answer.get("Error"),
                              "bound": bound}))
            assert answered < PATIENCE, f"answered {answered:.2f} s after the first byte"
            if answer.get("Error"):
                assert bound == "", "an error was answered but the Binding landed"
            else:
                assert bound == "n1"
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())


def test_a_binding_committed_after_the_bind_gave_up_keeps_its_gpus(
        fake_api_factory: Any) -> None:
    """The API server commits pod a's Binding ``API`` s after it was sent, past the extender's
    bind deadline (the extender gave up waiting and answered an error). Its GPU must not be
    handed to pod b meanwhile: once a's Binding lands, both would hold the one GPU."""
    BIND, API = 0.6, 1.5
    fake = fake_api_factory()
    fake.create(kobjects.node("n1", [16], "cgpu"))
    for name in ("a", "b"):
        fake.create(kobjects.pod(name, mem=16))
    a, b = (fake.get("pods", n, "default") for n in ("a", "b"))
    fake.faults.delay(API, verbs="create", resources="pods/binding", times=1, lands=True)

    async def go() -> None:
        r = _replica(fake, bind_timeout=BIND)
        await r.start()
        base = f"http://127.0.0.1:{r.port}"
        try:
            await _wait(r.is_ready)
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/filter", json={"Pod": a, "NodeNames": ["n1"]}) as q:
                    assert (await q.json())["NodeNames"] == ["n1"]
                t0 = time.monotonic()
                async with s.post(f"{base}/bind", json=_binding(a, "n1")) as q:
                    err_a = (await q.json())["Error"]
                assert err_a, "the delayed Binding was answered in time?"
                assert time.monotonic() - t0 < API
                # kube-scheduler goes on with the next pod
                async with s.post(f"{base}/filter", json={"Pod": b, "NodeNames": ["n1"]}) as q:
                    passed = (await q.json()).get("NodeNames") or []
                err_b = "unschedulable"
                if passed:
                    async with s.post(f"{base}/bind", json=_binding(b, "n1")) as q:
                        err_b = (await q.json())["Error"]
                await _wait(lambda: _node_of(fake, "a") == "n1")  # a's Binding lands
                await asyncio.sleep(0.5)  # the watch brings it
                pods = fake.objects("pods")
                print(json.dumps({"a": err_a, "b": err_b or "bound",
                                  "bound": {p["metadata"]["name"]: p["spec"].get("nodeName")
                                            for p in pods}}))
                assert over_commits(fake.objects("nodes"), pods) == []
                assert err_b and _node_of(fake, "b") == "", "b was given a's GPU"
                # the watch showed a bound: its kept reservation is now a's record
                await _wait(lambda: "default/a" in r.view.placed, timeout=10)
                assert "default/a" not in r.binder.unsettled
                assert "default/a" in r.view.state.pods and not r.view.inflight
                m = await (await s.get(f"{base}/metrics")).text()
                assert 'sharegpu_extender_unsettled_binds_total{outcome="confirmed"} 1.0' in m
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())


def test_the_consistency_check_lets_requests_run_while_it_reads_the_pods() -> None:
    """The periodic check reads every listed pod: it gives the event loop back every
    ``CHECK_CHUNK`` pods (a bind's answer is never held up by a whole list's parsing), and
    finds what the one-step comparison finds."""
    from sharegpu.core.annotations import encode
    from sharegpu.core.state import Allocation
    from sharegpu.extender.informer import CHECK_CHUNK, Informer
    from sharegpu.extender.metrics import Metrics
    from sharegpu.extender.view import ClusterView
    from sharegpu_testing.memapi import MemoryApi

    nodes = [kobjects.node(f"n{i}", [16] * 8, "cgpu") for i in range(50)]
    pods = [kobjects.pod(f"p{i}", mem=1, node_name=f"n{i % 50}", annotations=encode(
        Allocation(mem={0: {(i // 50) % 8: 1}}), assume_time_ns=1)) for i in range(3000)]
    view = ClusterView()
    view.reset(nodes, pods)
    informer = Informer(MemoryApi(pods), view, Metrics(lambda: view), check_every=0)

    async def go() -> tuple[list[str], int]:
        turns = 0
        done = False

        async def tick() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(tick())
        await asyncio.sleep(0)
        turns = 0
        diff = await informer.compare_async(pods)
        done = True
        await t
        return diff, turns

    diff, turns = asyncio.run(go())
    assert diff == informer.compare(pods) == []
    assert turns >= len(pods) // CHECK_CHUNK - 1, turns
