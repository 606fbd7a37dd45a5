"""The extender's HTTP service against an in-memory cluster view and API: filter → prioritize →
bind, errors as ``Error`` answers, idempotent binds, release on failure, metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from sharegpu.core.annotations import decode
from sharegpu.extender.bind import Binder
from sharegpu.extender.events import EventRecorder
from sharegpu.extender.metrics import Metrics
from sharegpu.extender.server import ExtenderApp
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects
from sharegpu_testing.memapi import MemoryApi

NODES = [kobjects.node("a", [16, 16], "cgpu"), kobjects.node("b", [16, 16], "core_mem"),
         kobjects.node("c", [32] * 4, "default")]
NAMES = ["a", "b", "c"]


class Env:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.view = ClusterView()
        self.view.reset(NODES, [])
        self.api = MemoryApi(pods)
        self.metrics = Metrics(lambda: self.view)
        self.events = EventRecorder(self.api, self.metrics)
        self.app = ExtenderApp(self.view, Binder(self.api, lambda: self.view), self.metrics,
                               self.events)
        self.client: aiohttp.ClientSession | None = None

    async def post(self, verb: str, body: Any) -> tuple[int, Any]:
        assert self.client is not None
        r = await self.client.post(f"/{verb}", json=body)
        return r.status, await r.json()

    async def schedule(self, pod: dict[str, Any]) -> tuple[str, str]:
        """kube-scheduler's sequence; (node, bind error)."""
        _, f = await self.post("filter", {"Pod": pod, "NodeNames": NAMES})
        if not f["NodeNames"]:
            return "", "unschedulable"
        if len(f["NodeNames"]) == 1:  # kube-scheduler asks no scores then
            node = f["NodeNames"][0]
        else:
            _, pr = await self.post("prioritize", {"Pod": pod, "NodeNames": f["NodeNames"]})
            node = max(pr, key=lambda h: h["Score"])["Host"]
        m = pod["metadata"]
        _, b = await self.post("bind", {"PodName": m["name"], "PodNamespace": m["namespace"],
                                        "PodUID": m["uid"], "Node": node})
        return node, b["Error"]


def run(pods: list[dict[str, Any]], body: Callable[[Env], Awaitable[None]]) -> None:
    async def go() -> None:
        env = Env(pods)
        server = env.app.server()
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
                env.client = client
                await body(env)
                await env.events.drain()
        finally:
            await server.close()

    asyncio.run(go())


def test_filter_prioritize_bind_records_the_decision() -> None:
    pods = [kobjects.pod("p1", mem=6), kobjects.pod("p2", mem=6, core=30),
            kobjects.pod("p3", cards=2)]

    async def body(env: Env) -> None:
        placed = [await env.schedule(p) for p in pods]
        assert placed == [("a", ""), ("b", ""), ("c", "")]
        for p in pods:
            stored = env.api.pods[f"default/{p['metadata']['name']}"]
            anns = stored["metadata"]["annotations"]
            assert anns["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
            assert anns["scheduler.framework.gpushare.assigned"] == "false"
            alloc = decode(anns)
            held = env.view.state.pods[f"default/{p['metadata']['name']}"]
            assert held.bound and alloc is not None
            assert alloc.per_gpu_mem() == held.alloc.per_gpu_mem()
        assert env.api.pods["default/p2"]["metadata"]["annotations"][
            "gpushare.alibabacloud.com/core-percentage"] == '{"0":{"0":30}}'
        assert env.api.bindings == [("default/p1", "a"), ("default/p2", "b"), ("default/p3", "c")]
        assert env.view.drift() == []

    run(pods, body)


def test_full_node_objects_in_and_out() -> None:
    async def body(env: Env) -> None:
        status, f = await env.post("filter", {"Pod": kobjects.pod("x", mem=4),
                                              "Nodes": {"items": NODES}, "NodeNames": None})
        assert status == 200 and f["NodeNames"] is None
        # the policy's pick alone (both a and b fit)
        assert [n["metadata"]["name"] for n in f["Nodes"]["items"]] == ["a"]
        assert set(f["FailedAndUnresolvableNodes"]) == {"c"}

    run([], body)


def test_bind_is_idempotent_and_refuses_other_nodes() -> None:
    pod = kobjects.pod("p", mem=4)

    async def body(env: Env) -> None:
        node, err = await env.schedule(pod)
        assert (node, err) == ("a", "")
        before = env.view.fingerprint()
        m = pod["metadata"]
        args = {"PodName": "p", "PodNamespace": "default", "PodUID": m["uid"], "Node": "a"}
        _, again = await env.post("bind", args)
        assert again == {"Error": ""}
        _, other = await env.post("bind", {**args, "Node": "b"})
        assert "already bound to a" in other["Error"]
        _, wrong_uid = await env.post("bind", {**args, "PodUID": "other"})
        assert "has uid" in wrong_uid["Error"]
        assert env.view.fingerprint() == before and len(env.api.bindings) == 1

    run([pod], body)


def test_failed_write_releases_the_reservation_and_reports_the_error() -> None:
    """A refused write (409) releases at once; a server error (500: the write may have been
    committed) keeps the GPUs until the outcome settles, then releases them."""
    pod = kobjects.pod("p", mem=4)

    async def body(env: Env) -> None:
        binder = env.app.binder
        assert binder is not None
        binder.unsettled.grace = 0.0
        before = env.view.fingerprint()
        env.api.fail_writes = 1  # the binding fails with 500
        node, err = await env.schedule(pod)
        assert "500" in err and "injected" in err
        assert env.view.fingerprint() != before and "default/p" in env.view.inflight  # kept
        node, err = await env.schedule(pod)  # kube-scheduler's retry: refused, nothing freed
        assert "no known outcome" in err and "default/p" in env.view.inflight
        await binder.settle()  # the API server's timeout passed: the pod is unbound
        assert env.view.fingerprint() == before and not env.view.inflight
        # a conflicting change of the pod since it was read, each time: 409, released too
        real = env.api.bind

        async def racing(*a: Any, **kw: Any) -> Any:
            env.api.pods["default/p"]["metadata"]["resourceVersion"] = "999"
            return await real(*a, **kw)

        env.api.bind = racing  # type: ignore[method-assign]
        node, err = await env.schedule(pod)
        assert "409" in err and env.view.fingerprint() == before
        assert not [k for k, _ in env.api.bindings if k == "default/p"] and not env.view.inflight
        env.api.bind = real  # type: ignore[method-assign]
        env.api.fail_writes = 0
        # the binding POST fails: released, then kube-scheduler's retry works
        calls = {"n": 0}
        real_bind = env.api.bind

        async def failing_bind(*a: Any, **kw: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                from sharegpu.extender.kube import ApiError

                raise ApiError(500, "InternalError", "etcd timeout")
            return await real_bind(*a, **kw)

        env.api.bind = failing_bind  # type: ignore[method-assign]
        node, err = await env.schedule(pod)
        assert "etcd timeout" in err and "default/p" in env.view.inflight
        await binder.settle()
        assert env.view.fingerprint() == before
        node, err = await env.schedule(pod)
        assert (node, err) == ("a", "") and "default/p" in env.view.state.pods

    run([pod], body)


def test_binding_made_despite_an_error_is_kept() -> None:
    pod = kobjects.pod("p", mem=4)

    async def body(env: Env) -> None:
        real_bind = env.api.bind

        async def lost_answer(*a: Any, **kw: Any) -> Any:
            await real_bind(*a, **kw)
            from sharegpu.extender.kube import ApiError

            raise ApiError(504, "Timeout", "answer lost")

        env.api.bind = lost_answer  # type: ignore[method-assign]
        node, err = await env.schedule(pod)
        assert (node, err) == ("a", "")
        assert env.view.state.pods["default/p"].bound and env.view.drift() == []

    run([pod], body)


def test_unplaceable_pod_gets_reasons_and_an_event() -> None:
    pod = kobjects.pod("big", mem=64)

    async def body(env: Env) -> None:
        _, f = await env.post("filter", {"Pod": pod, "NodeNames": NAMES})
        assert f["NodeNames"] == [] and f["Error"] == ""
        assert f["FailedAndUnresolvableNodes"]["a"] == (
            "asks 64 GPU memory per GPU; the largest GPU has 16")
        await env.events.drain()
        ev = env.api.events[-1]
        assert ev["reason"] == "GPUSharingUnschedulable"
        assert ev["involvedObject"]["name"] == "big"
        assert ev["message"].startswith("0/3 nodes can take the GPU request: 2× asks 64 GPU")
        # the same answer again does not flood the pod with events
        await env.post("filter", {"Pod": pod, "NodeNames": NAMES})
        await env.events.drain()
        assert len(env.api.events) == 1

    run([pod], body)


def test_invalid_request_is_refused_on_every_node() -> None:
    pod = kobjects.pod("bad", mem=4, core=33)

    async def body(env: Env) -> None:
        _, f = await env.post("filter", {"Pod": pod, "NodeNames": NAMES})
        assert f["NodeNames"] == []
        msg = set(f["FailedAndUnresolvableNodes"].values())
        assert len(msg) == 1 and "must be a multiple of 5" in msg.pop()

    run([pod], body)


def test_malformed_payloads_get_400_and_an_error_naming_the_field() -> None:
    async def body(env: Env) -> None:
        assert env.client is not None
        r = await env.client.post("/filter", data=b"{oops")
        assert r.status == 400 and "body" in (await r.json())["Error"]
        status, f = await env.post("filter", {"NodeNames": ["a"]})
        assert status == 400 and f["Error"].startswith("Pod=")
        status, p = await env.post("prioritize", {"Pod": kobjects.pod("x"), "NodeNames": 5})
        assert status == 400 and p["Error"].startswith("NodeNames=")
        status, b = await env.post("bind", {"PodName": "x"})
        assert status == 400 and b["Error"].startswith("PodNamespace=")
        # a name that is no DNS-1123 name: 400 naming the field and the rule, nothing read
        assert env.app.binder is not None
        reads = env.app.binder.reads
        status, b = await env.post("bind", {"PodName": "x", "PodNamespace": "default",
                                            "Node": "../../namespaces/kube-system"})
        assert status == 400 and b["Error"].startswith("Node=") and \
            "must be a DNS-1123 subdomain" in b["Error"], b
        status, f = await env.post("filter", {"Pod": kobjects.pod("bad", namespace="a/b"),
                                              "NodeNames": ["a"]})
        assert status == 400 and f["Error"].startswith("Pod.metadata.namespace=") and \
            "must be a DNS-1123 label" in f["Error"], f
        assert env.app.binder.reads == reads
        # the view is untouched and later requests are served
        assert env.view.state.pods == {}
        status, f = await env.post("filter", {"Pod": kobjects.pod("y", mem=1),
                                              "NodeNames": ["a"]})
        assert status == 200 and f["NodeNames"] == ["a"]

    run([], body)


def test_metrics_endpoint() -> None:
    pod = kobjects.pod("p", mem=6)

    async def body(env: Env) -> None:
        await env.schedule(pod)
        await env.post("bind", {"PodName": "nope", "PodNamespace": "default", "Node": "a"})
        assert env.client is not None
        r = await env.client.get("/metrics")
        text = await r.text()
        assert r.status == 200
        assert 'sharegpu_gpu_memory_allocated{gpu="0",node="a"} 6.0' in text
        assert 'sharegpu_gpu_memory_total{gpu="1",node="a"} 16.0' in text
        assert 'sharegpu_node_gpu_memory_allocated{node="a"} 6.0' in text
        assert 'sharegpu_gpu_core_total_percent{gpu="0",node="b"} 100.0' in text
        assert 'sharegpu_gpu_core_allocated_percent{gpu="0",node="b"} 0.0' in text
        assert 'sharegpu_extender_request_seconds_count{verb="bind"} 2.0' in text
        assert 'sharegpu_extender_decisions_total{result="ok",verb="bind"} 1.0' in text
        assert 'sharegpu_extender_failures_total{reason="read-pod",verb="bind"} 1.0' in text
        for probe in ("/healthz", "/readyz"):
            assert (await env.client.get(probe)).status == 200

    run([pod], body)


def test_bind_uses_the_pod_sent_with_filter_and_starts_over_when_it_changed() -> None:
    pods = [kobjects.pod("p", mem=4), kobjects.pod("q", mem=4)]

    async def body(env: Env) -> None:
        binder = env.app.binder
        assert binder is not None
        # what kube-scheduler sends comes from its cache: with the pod's resourceVersion
        p = env.api.pods["default/p"]
        assert await env.schedule(p) == ("a", "")
        assert binder.reads == 0  # no read of the pod: the filter's copy was enough
        assert env.api.pods["default/p"]["spec"]["nodeName"] == "a"
        # the pod changed after kube-scheduler's copy was taken: 409, a fresh read, success
        q = env.api.pods["default/q"]
        stale = {**q, "metadata": {**q["metadata"]}}
        env.api.pods["default/q"]["metadata"]["labels"] = {"changed": "yes"}
        env.api.pods["default/q"]["metadata"]["resourceVersion"] = "9999"
        assert await env.schedule(stale) == ("a", "")
        assert binder.reads == 1
        assert env.view.drift() == [] and set(env.view.state.pods) == {"default/p", "default/q"}

    run(pods, body)


def test_prioritize_sent_byte_for_byte_after_filter_uses_the_scores_made_ahead() -> None:
    """kube-scheduler marshals the same ExtenderArgs for filter and prioritize, only the names
    differ: such a prioritize is answered from the scores made right after the filter, and only
    while nothing they read has changed."""
    nodes = [kobjects.node(f"n{i}", [16, 16], "cgpu") for i in range(4)]
    pod = kobjects.pod("p", mem=4)

    def compact(data: Any) -> bytes:
        return json.dumps(data, separators=(",", ":")).encode()

    async def go() -> None:
        view = ClusterView(graded=True)  # every node scored, so a change shows in the answer
        view.reset(nodes, [])
        api = MemoryApi([pod, kobjects.pod("other", mem=12)])
        app = ExtenderApp(view, Binder(api, lambda: view), Metrics(lambda: view))
        decoded = 0
        real_body = app._body

        def counting_body(request: Any) -> Any:
            nonlocal decoded
            decoded += 1
            return real_body(request)

        app._body = counting_body  # type: ignore[method-assign]
        server = app.server()
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async def post(verb: str, data: bytes) -> Any:
                    async with s.post(f"http://127.0.0.1:{port}/{verb}", data=data) as r:
                        assert r.status == 200
                        return await r.json()

                names = [n["metadata"]["name"] for n in nodes]
                f = await post("filter", compact({"Pod": pod, "Nodes": None,
                                                  "NodeNames": names}))
                passed = f["NodeNames"]
                assert len(passed) == 4
                await asyncio.sleep(0.01)  # the scores ahead are made after the answer
                same = compact({"Pod": pod, "Nodes": None, "NodeNames": passed})
                spaced = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": passed},
                                    indent=1).encode()

                def by_host(answer: list[dict[str, Any]]) -> dict[str, int]:
                    return {h["Host"]: h["Score"] for h in answer}

                before = decoded
                fast = by_host(await post("prioritize", same))
                assert decoded == before  # answered without decoding the request
                slow = by_host(await post("prioritize", spaced))
                assert decoded == before + 1 and fast == slow
                # a pod lands on the node that scored 10: the scores ahead are stale now
                best = next(h for h, v in fast.items() if v == 10)
                view.reserve(view.reader.request(kobjects.pod("other", mem=12)), best)
                again = by_host(await post("prioritize", same))
                assert decoded == before + 2  # decoded and scored afresh
                assert again == by_host(await post("prioritize", spaced))
                assert again != fast  # the node that changed scores differently now
        finally:
            await server.close()

    asyncio.run(go())
