"""What the extender binds, and what its filter holds, whoever calls it (issue 36, Build 1):
a bind only for a pod its filter passed or that its own scheduler profile could have sent, only
to a Node that exists; a pick held only for a pod that exists, unbound, with the UID it was
filtered with, so filters of made-up pods cannot fill the cluster."""

from __future__ import annotations

import asyncio
from typing import Any

from sharegpu.extender.bind import Binder
from sharegpu.extender.bindscope import BindScope
from sharegpu.extender.metrics import Metrics
from sharegpu.extender.server import ExtenderApp
from sharegpu_testing import kobjects
from test_extender_picks import ONE_NAMES, Picks


def _go(coro: Any) -> None:
    asyncio.run(coro)


def _bound(env: Picks, name: str, namespace: str = "default") -> str:
    return str(env.api.pods[f"{namespace}/{name}"]["spec"].get("nodeName") or "")


def test_a_pod_never_filtered_of_another_scheduler_is_not_bound() -> None:
    """The attack: a pod of another namespace, meant for the default scheduler (with a
    nodeSelector), bound to a node of the caller's choosing. Refused; nothing written. A pod of
    the extender's own profile that this replica never filtered (the leader binding what a
    follower filtered) is bound."""
    theirs = kobjects.pod("victim", namespace="other", containers=[{}], cpu="1",
                          scheduler="default-scheduler")
    theirs["spec"]["nodeSelector"] = {"pool": "secure"}
    gpu_theirs = kobjects.pod("victim-gpu", namespace="other", mem=4,
                              scheduler="default-scheduler")
    unnamed = kobjects.pod("unnamed", namespace="other", containers=[{}])
    del unnamed["spec"]["schedulerName"]  # the API server's default: default-scheduler
    ours = kobjects.pod("ours", mem=4)  # schedulerName ack-co-scheduler, never filtered here

    async def body() -> None:
        async with Picks([theirs, gpu_theirs, unnamed, ours]) as env:
            for p in (theirs, gpu_theirs, unnamed):
                err = await env.bind(p, "n0")
                name = p["metadata"]["name"]
                assert f"pod other/{name} is not this extender's to bind: its schedulerName " \
                       "'default-scheduler' is not a profile that calls it " \
                       "(ack-co-scheduler)" in err, err
                assert _bound(env, name, "other") == ""
            assert env.binder.writes == 0 and env.api.bindings == []
            assert env.view.inflight == {}
            assert await env.bind(ours, "n1") == ""
            assert _bound(env, "ours") == "n1"

    _go(body())


def test_a_bind_to_a_node_that_does_not_exist_is_refused() -> None:
    """kube-apiserver does not check that a Binding's node exists; the extender does, before it
    reads or writes anything, for GPU pods and plain pods, filtered or not."""
    gpu = kobjects.pod("g", mem=4)
    plain = kobjects.pod("web", containers=[{}], cpu="1")

    async def body() -> None:
        async with Picks([gpu, plain]) as env:
            f = await env.filter(gpu)  # its filter passed it, with a pick held
            assert len(f["NodeNames"]) == 1
            for p in (gpu, plain):
                err = await env.bind(p, "no-such-node")
                assert err == "node no-such-node does not exist (no such Node in the cluster): " \
                              "not bound there", err
            assert env.binder.reads == 0 and env.binder.writes == 0
            assert _bound(env, "g") == _bound(env, "web") == ""
            # a Node the informer shows, GPUs or not, is one
            env.view.upsert_node({"metadata": {"name": "cpu-1"}, "status": {}})
            assert await env.bind(plain, "cpu-1") == ""
            assert _bound(env, "web") == "cpu-1"
            # a Node deleted is none any more
            env.view.delete_node("n2")
            assert "node n2 does not exist" in await env.bind(gpu, "n2")

    _go(body())


def test_a_scheduler_that_sends_only_gpu_pods_gets_no_plain_bind_done() -> None:
    """scheduler.mode=default: the cluster's own kube-scheduler sends only pods asking for the
    GPU resources it manages (default-scheduler's); a plain pod's bind is not its, even with
    that schedulerName."""
    plain = kobjects.pod("web", containers=[{}], cpu="1", scheduler="default-scheduler")
    gpu = kobjects.pod("g", mem=4, scheduler="default-scheduler")

    async def body() -> None:
        async with Picks([plain, gpu]) as env:
            scope = BindScope(["default-scheduler"], gpu_only=True,
                              node_exists=env.view.presence.has_node)
            env.binder = Binder(env.api, lambda: env.view, scope=scope)
            env.app = ExtenderApp(env.view, env.binder, Metrics(lambda: env.view))
            await env.server.close()
            env.server = env.app.server()
            port = await env.server.start("127.0.0.1", 0)
            await env.client.close()
            import aiohttp

            env.client = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}")
            err = await env.bind(plain, "n0")
            assert "pod default/web asks for no GPU" in err, err
            assert _bound(env, "web") == "" and env.binder.writes == 0
            assert await env.bind(gpu, "n0") == ""
            assert _bound(env, "g") == "n0"

    _go(body())


def test_ghost_filters_hold_nothing_and_the_real_pod_gets_its_gpu() -> None:
    """Filters of made-up pods (never created), of a real pod under another UID, or of a pod
    already bound, hold no pick: on three one-GPU nodes, any number of ghosts leave every GPU
    free, and the pods that exist each hold at most one pick."""
    real = [kobjects.pod(f"real{i}", mem=16) for i in range(3)]

    async def body() -> None:
        async with Picks(real) as env:
            for i in range(30):
                ghost = kobjects.pod(f"ghost{i}", mem=16)
                f = await env.post("filter", {"Pod": ghost, "NodeNames": ONE_NAMES})
                # answered (kube-scheduler could send it a moment before the informer shows the
                # pod), but nothing is held for it
                assert len(f["NodeNames"]) == 1, f
            impostor = {**real[0], "metadata": {**real[0]["metadata"], "uid": "not-its-uid"}}
            env.view.upsert_pod(env.api.pods["default/real0"])
            await env.post("filter", {"Pod": impostor, "NodeNames": ONE_NAMES})
            assert len(env.view.picks) == 0 and env.view.inflight == {}
            assert env.view.state.pods == {}
            # the pods that exist: each filtered twice, one pick each, every GPU taken once
            picks = []
            for p in real:
                await env.filter(p)
                picks.append((await env.filter(p))["NodeNames"])
            assert sorted(n for (n,) in picks) == ONE_NAMES
            assert len(env.view.picks) == 3
            for p, (node,) in zip(real, picks, strict=True):
                assert await env.bind(p, node) == ""
            # a bound pod is no longer waiting: a filter of it holds nothing
            bound = env.api.pods["default/real0"]
            env.view.upsert_pod(bound)
            assert not env.view.presence.waiting("default/real0", bound["metadata"]["uid"])

    _go(body())
