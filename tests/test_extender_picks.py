"""Filter answers with the policy's pick and holds it until the bind; the bind confirms it in
one write, or gives up unwritten past its deadline."""

from __future__ import annotations

import asyncio
from typing import Any

from sharegpu.core import names
from sharegpu.core.annotations import decode
from sharegpu.extender.bind import Binder
from sharegpu.extender.metrics import Metrics
from sharegpu.extender.picks import HeldPicks
from sharegpu.extender.server import ExtenderApp
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects
from sharegpu_testing.memapi import MemoryApi
from test_extender_http import Env, run

ONE_GPU = [kobjects.node(f"n{i}", [16], "cgpu") for i in range(3)]
ONE_NAMES = [f"n{i}" for i in range(3)]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _view(graded: bool = False) -> ClusterView:
    v = ClusterView(graded=graded)
    v.reset(ONE_GPU, [])
    return v


class Picks:
    """An ExtenderApp on one-GPU nodes with an in-memory API, driven verb by verb."""

    def __init__(self, pods: list[dict[str, Any]], graded: bool = False,
                 bind_timeout: float = 7.0) -> None:
        self.view = _view(graded)
        self.clock = Clock()
        self.view.picks.clock = self.clock
        self.api = MemoryApi(pods)
        self.binder = Binder(self.api, lambda: self.view, bind_timeout=bind_timeout)
        self.app = ExtenderApp(self.view, self.binder, Metrics(lambda: self.view))
        self.server = self.app.server()
        self.client: Any = None

    async def __aenter__(self) -> Picks:
        import aiohttp

        port = await self.server.start("127.0.0.1", 0)
        self.client = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.close()
        await self.server.close()

    async def post(self, verb: str, body: Any) -> Any:
        r = await self.client.post(f"/{verb}", json=body)
        return await r.json()

    async def filter(self, pod: dict[str, Any], names: list[str] = ONE_NAMES) -> Any:
        """As kube-scheduler sends it: the pod as stored (with its resourceVersion), which the
        view has seen created, as the informer shows it."""
        m = pod["metadata"]
        stored = self.api.pods.get(f"{m['namespace']}/{m['name']}", pod)
        if not stored["spec"].get("nodeName"):
            self.view.upsert_pod(stored)
        return await self.post("filter", {"Pod": stored, "NodeNames": names})

    async def bind(self, pod: dict[str, Any], node: str) -> str:
        m = pod["metadata"]
        b = await self.post("bind", {"PodName": m["name"], "PodNamespace": m["namespace"],
                                     "PodUID": m["uid"], "Node": node})
        return str(b["Error"])


def _go(coro: Any) -> None:
    asyncio.run(coro)


def test_filter_answers_the_pick_alone_and_graded_keeps_every_passing_node() -> None:
    pod = kobjects.pod("p", mem=8)

    async def body() -> None:
        async with Picks([pod]) as env:
            f = await env.filter(pod)
            assert len(f["NodeNames"]) == 1 and f["FailedNodes"] == {}
            # the pick is prioritize's 10 and is held in flight
            assert env.view.held_pick("default/p") == f["NodeNames"][0]
            assert "default/p" in env.view.inflight
        async with Picks([pod], graded=True) as env:
            f = await env.filter(pod)
            assert f["NodeNames"] == ONE_NAMES and env.view.held_pick("default/p") is None

    _go(body())


def test_the_next_filter_sees_the_hold_and_binds_in_any_order_succeed() -> None:
    # each pod fills a node's one GPU: without the hold both filters would pick the same node
    pods = [kobjects.pod(f"p{i}", mem=16) for i in range(3)]

    async def body() -> None:
        async with Picks(pods) as env:
            picks = [(await env.filter(p))["NodeNames"] for p in pods]
            assert sorted(n for (n,) in picks) == ONE_NAMES
            # a fourth finds nothing, with the held GPUs as the reason, as today's full nodes
            late = kobjects.pod("late", mem=16)
            env.api.add_pod(late)
            f = await env.filter(late)
            assert f["NodeNames"] == [] and set(f["FailedNodes"]) == set(ONE_NAMES)
            for p, (node,) in reversed(list(zip(pods, picks, strict=True))):
                assert await env.bind(p, node) == ""
            assert env.app.metrics.latency.labels("prioritize")._sum.get() == 0
            assert len(env.view.picks) == 0 and env.view.drift() == []

    _go(body())


def test_the_assume_time_is_when_the_pick_was_made_not_when_the_bind_lands() -> None:
    # the core's order of decisions is the picks' order; binds complete in any order, and a
    # replay of the node's pods by assume-time must see them as they were decided
    a, b, c = (kobjects.pod(n, mem=8) for n in ("a", "b", "c"))
    ticks = iter(range(1_000, 10_000, 1_000))

    async def body() -> None:
        async with Picks([a, b, c]) as env:
            env.view.picks.wall_ns = lambda: next(ticks)
            (na,) = (await env.filter(a))["NodeNames"]
            (nb,) = (await env.filter(b))["NodeNames"]
            (nc,) = (await env.filter(c))["NodeNames"]
            assert await env.bind(b, nb) == ""
            assert await env.bind(a, na) == ""
            other = next(n for n in ONE_NAMES if n not in (na, nb, nc))
            assert await env.bind(c, other) == ""  # not the held node: assumed at the bind
            times = {k: int(env.api.pods[f"default/{k}"]["metadata"]["annotations"][
                names.ANN_ASSUME_TIME]) for k in "abc"}
            assert (times["a"], times["b"]) == (1_000, 2_000)
            assert times["c"] > 1_000_000_000  # the wall clock at its bind

    _go(body())


def test_filtered_again_the_pod_gives_back_its_hold_first() -> None:
    pod = kobjects.pod("p", mem=16)

    async def body() -> None:
        async with Picks([pod]) as env:
            (first,) = (await env.filter(pod))["NodeNames"]
            (again,) = (await env.filter(pod))["NodeNames"]
            assert again == first  # its own hold does not push it elsewhere
            st = env.view.state
            taken = [n for n in ONE_NAMES if st.gpu_free[st.index[n], 0] == 0]
            assert taken == [first]  # held once, not twice

    _go(body())


def test_hold_ends_on_timeout_delete_and_binding_elsewhere() -> None:
    a, b, c = (kobjects.pod(n, mem=16) for n in ("a", "b", "c"))

    async def body() -> None:
        async with Picks([a, b, c]) as env:
            (na,) = (await env.filter(a))["NodeNames"]
            (nb,) = (await env.filter(b))["NodeNames"]
            (nc,) = (await env.filter(c))["NodeNames"]
            # timeout: a's pick is given up; the next filter may take its node
            env.clock.t += env.view.picks.timeout + 1
            late = kobjects.pod("late", mem=16)
            f = await env.filter(late)
            assert f["NodeNames"] == [na] and "default/a" not in env.view.inflight
            assert "default/b" not in env.view.inflight  # b and c expired with a
            env.clock.t = 100.0
            (nb,) = (await env.filter(b))["NodeNames"]
            (nc,) = (await env.filter(c))["NodeNames"]
            assert {na, nb, nc} == set(ONE_NAMES)
            # deleted: its GPUs are free at once
            env.view.delete_pod(b)
            assert "default/b" not in env.view.picks and "default/b" not in env.view.inflight
            # bound by someone else elsewhere: the hold goes, what the pod says counts
            elsewhere = {**c, "spec": {**c["spec"], "nodeName": nb}}
            env.view.upsert_pod(elsewhere)
            assert "default/c" not in env.view.picks and "default/c" not in env.view.inflight

    _go(body())


def test_bind_to_another_node_than_held_moves_the_reservation() -> None:
    pod = kobjects.pod("p", mem=8)

    async def body() -> None:
        async with Picks([pod]) as env:
            (held,) = (await env.filter(pod))["NodeNames"]
            other = next(n for n in ONE_NAMES if n != held)
            assert await env.bind(pod, other) == ""
            assert env.view.state.pods["default/p"].node == other
            assert env.view.drift() == [] and len(env.view.picks) == 0

    _go(body())


def test_one_write_carries_the_annotations_with_the_binding() -> None:
    pod = kobjects.pod("p", mem=8)

    async def body() -> None:
        async with Picks([pod]) as env:
            patched: list[Any] = []
            real = env.api.patch_pod_annotations

            async def spy(*a: Any, **kw: Any) -> Any:
                patched.append(a)
                return await real(*a, **kw)

            env.api.patch_pod_annotations = spy  # type: ignore[method-assign]
            (node,) = (await env.filter(pod))["NodeNames"]
            assert await env.bind(pod, node) == ""
            stored = env.api.pods["default/p"]
            assert stored["spec"]["nodeName"] == node
            assert decode(stored["metadata"]["annotations"]) is not None
            assert patched == [] and env.binder.writes == 1 and env.binder.reads == 0

    _go(body())


def test_stale_resource_version_is_refused_then_read_afresh() -> None:
    pod = kobjects.pod("p", mem=8)

    async def body() -> None:
        async with Picks([pod]) as env:
            (node,) = (await env.filter(pod))["NodeNames"]
            # the pod changed after filter saw it (a label, say): the hinted binding is refused
            # (409), the pod read again and bound with its new resourceVersion
            env.api.pods["default/p"]["metadata"]["resourceVersion"] = "777"
            assert await env.bind(pod, node) == ""
            assert env.binder.writes == 2 and env.binder.reads == 1
            assert env.api.pods["default/p"]["spec"]["nodeName"] == node

    _go(body())


def test_a_bind_past_its_deadline_never_binds_later() -> None:
    pod = kobjects.pod("p", mem=8)

    async def body() -> None:
        async with Picks([pod], bind_timeout=0.3) as env:
            real = env.api.bind

            async def slow(*a: Any, **kw: Any) -> Any:
                await asyncio.sleep(1.0)
                return await real(*a, **kw)

            env.api.bind = slow  # type: ignore[method-assign]
            env.binder.unsettled.grace = 0.0
            (node,) = (await env.filter(pod))["NodeNames"]
            err = await env.bind(pod, node)
            assert "caller's deadline" in err
            # the outcome is unknown: held until the API server's own timeout (0.3 s) passed
            assert "default/p" in env.view.inflight
            await asyncio.sleep(1.2)  # long after: still not bound
            assert not env.api.pods["default/p"]["spec"].get("nodeName")
            await env.binder.settle()  # a read shows it unbound: released
            assert "default/p" not in env.view.inflight and env.api.bindings == []

    _go(body())


def test_a_bind_waiting_for_the_kubelet_holds_up_no_other_bind_to_its_node() -> None:
    # a and b ask the same of one GPU each; a starts on GPU 0 of n0 and the kubelet has not
    # admitted it: b, placed on GPU 1, must wait; c, asking something else, binds meanwhile
    a, b, c = kobjects.pod("a", mem=4), kobjects.pod("b", mem=4), kobjects.pod("c", mem=6)
    nodes = [kobjects.node("n0", [16, 16], "cgpu")]

    async def body() -> None:
        async with Picks([a, b, c], bind_timeout=0.4) as env:
            env.view.reset(nodes, [])
            env.binder.start_wait = 5.0
            assert await env.bind(a, "n0") == ""
            r = env.view.state.pods["default/a"]
            env.view.state.release("default/a")  # b is made to go to the other GPU
            from sharegpu.core.annotations import Allocation

            other = 1 - r.alloc.gpus[0]
            env.view.state.reserve(r.request, "n0", Allocation(mem={0: {r.alloc.gpus[0]: 4}}),
                                   check_host=False)
            env.view.state.bind("default/a")
            blocker = env.view.state.reserve(
                kobjects_req(env, b), "n0", Allocation(mem={0: {other: 4}}), check_host=False)
            env.view.inflight["default/b"] = blocker
            env.view.picks.hold("default/b", "n0")  # as if its filter had picked GPU `other`
            waiting = asyncio.ensure_future(env.bind(b, "n0"))
            await asyncio.sleep(0.05)
            assert await env.bind(c, "n0") == ""
            assert not waiting.done()  # c was not held up behind b, which still waits
            assert "0.4" in await waiting or "starting" in await waiting

    _go(body())


def kobjects_req(env: Picks, pod: dict[str, Any]) -> Any:
    return env.view.reader.request(env.api.pods[f"{pod['metadata']['namespace']}/"
                                                f"{pod['metadata']['name']}"])


def test_held_picks_expire_in_order_and_refuse_a_bad_timeout() -> None:
    clock = Clock()
    h = HeldPicks(5.0, clock)
    h.hold("a", "n1")
    clock.t += 1
    h.hold("b", "n2")
    clock.t += 1
    h.hold("a", "n3")  # held again: a new deadline
    clock.t += 4.5
    assert h.expired() == ["b"] and h.node("a") == "n3" and h.expired_total == 1
    assert h.take("a") == "n3" and h.take("a") is None and len(h) == 0
    try:
        HeldPicks(0)
    except ValueError as e:
        assert "timeout" in str(e)
    else:
        raise AssertionError("a zero timeout was accepted")


def test_http_env_still_places_with_one_node_answers() -> None:
    pods = [kobjects.pod("q", mem=6)]

    async def body(env: Env) -> None:
        assert await env.schedule(pods[0]) == ("a", "")

    run(pods, body)


def test_fake_api_server_binds_like_the_real_one() -> None:
    """kube-apiserver's Binding (tests/e2e/test_binding_metadata_real.py shows it on the real
    one): uid and resourceVersion preconditions refused with 409 and nothing changed, then
    ``nodeName`` and the annotations in one update; the unit tests rely on the same."""
    from sharegpu_testing.resources import POD
    from sharegpu_testing.status import StatusError
    from sharegpu_testing.store import Store

    s = Store()
    pod = s.create(POD, "ns", kobjects.pod("p", namespace="ns", mem=4))
    rv, uid = pod["metadata"]["resourceVersion"], pod["metadata"]["uid"]
    anns = {"ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_POD": "4"}
    for bad in ({"uid": uid, "resourceVersion": str(int(rv) - 1)},
                {"uid": "other", "resourceVersion": rv}):
        try:
            s.bind("ns", "p", {"metadata": {"name": "p", **bad, "annotations": anns},
                               "target": {"kind": "Node", "name": "n"}})
        except StatusError as e:
            assert e.code == 409, e
        else:
            raise AssertionError("the fake API server accepted a failed precondition")
    cur = s.get(POD, "ns", "p")
    assert not cur["spec"].get("nodeName") and cur["metadata"]["resourceVersion"] == rv
    out = s.bind("ns", "p", {"metadata": {"name": "p", "uid": uid, "resourceVersion": rv,
                                          "annotations": anns},
                             "target": {"kind": "Node", "name": "n"}})
    assert out["spec"]["nodeName"] == "n"
    assert {k: out["metadata"]["annotations"][k] for k in anns} == anns


def _raw_filter(env: Picks, pod: dict[str, Any], names_json: bytes) -> Any:
    """kube-scheduler's own encoding: the Pod, Nodes null, NodeNames last."""
    import json

    return b'{"Pod":' + json.dumps(pod).encode() + b',"Nodes":null,"NodeNames":' + names_json \
        + b"}"


def test_a_pod_without_gpus_is_answered_with_the_names_as_sent() -> None:
    import json

    from sharegpu.extender import wire

    plain = kobjects.pod("web", containers=[{}], cpu="1", memory="1Gi")
    names_json = b'["n0","n1","n2","not-a-gpu-node"]'

    async def body() -> None:
        async with Picks([plain]) as env:
            # a Node without GPUs, as the informer shows it
            env.view.upsert_node({"metadata": {"name": "not-a-gpu-node"}, "status": {}})
            stored = env.api.pods["default/web"]
            r = await env.client.post("/filter", data=_raw_filter(env, stored, names_json))
            raw = await r.read()
            assert raw == wire.pass_all_json(names_json)
            assert json.loads(raw)["NodeNames"] == json.loads(names_json)
            # its bind needs no read back: one write
            assert await env.bind(plain, "not-a-gpu-node") == ""
            assert env.binder.reads == 0 and env.binder.writes == 1
            assert env.app.metrics.latency.labels("prioritize")._sum.get() == 0

    _go(body())
    # not kube-scheduler's form, a GPU pod, a pod with claims: the full answer
    assert wire.split_names(b'{"NodeNames":["a"],"Pod":{}}') is None
    assert wire.split_names(b'{"Pod":{},"NodeNames":[{"x":1}]}') is None
    assert wire.split_names(b'{"Pod":{"a":1},"Nodes":null,"NodeNames":["a"]}') == (
        b'{"Pod":{"a":1},"Nodes":null}', b'["a"]')


def test_pods_a_resource_policy_selects_still_get_their_unit() -> None:
    from sharegpu.core import resourcepolicy as rp
    from sharegpu.extender.resourcepolicies import ResourcePolicies

    web = kobjects.pod("web", containers=[{}], cpu="1", memory="1Gi")
    web["metadata"]["labels"] = {"app": "web"}
    db = kobjects.pod("db", containers=[{}], cpu="1", memory="1Gi")
    db["metadata"]["labels"] = {"app": "db"}
    policy = {"apiVersion": rp.API_VERSION, "kind": "ResourcePolicy",
              "metadata": {"name": "web", "namespace": "default",
                           "creationTimestamp": "2026-01-01T00:00:00Z"},
              "spec": {"selector": {"app": "web"},
                       "units": [{"nodeSelector": {"pool": "b"}}]}}
    nodes = [{"metadata": {"name": n, "labels": {"pool": "b" if n == "n1" else "a"}}}
             for n in ONE_NAMES]

    async def body() -> None:
        async with Picks([web, db]) as env:
            units = ResourcePolicies()
            units.set_policies([policy])
            units.reset(nodes, [])
            env.app.units = units
            names_json = b'["n0","n1","n2"]'
            r = await env.client.post("/filter", data=_raw_filter(
                env, env.api.pods["default/web"], names_json))
            got = await r.json()
            assert got["NodeNames"] == ["n1"] and set(got["FailedAndUnresolvableNodes"]) == {
                "n0", "n2"}
            r = await env.client.post("/filter", data=_raw_filter(
                env, env.api.pods["default/db"], names_json))
            assert (await r.json())["NodeNames"] == ["n0", "n1", "n2"]

    _go(body())


def test_metrics_show_the_held_and_the_expired_picks() -> None:
    pod = kobjects.pod("p", mem=8)

    async def body() -> None:
        async with Picks([pod]) as env:
            await env.filter(pod)
            text = env.app.metrics.render().decode()
            assert "sharegpu_extender_held_picks 1.0" in text
            env.clock.t += env.view.picks.timeout + 1
            env.view.expire_picks()
            text = env.app.metrics.render().decode()
            assert "sharegpu_extender_held_picks 0.0" in text
            assert "sharegpu_extender_expired_picks 1.0" in text

    _go(body())


def test_a_replica_that_may_not_bind_answers_the_pick_without_holding() -> None:
    pod = kobjects.pod("p", mem=16)

    async def body() -> None:
        async with Picks([pod]) as env:
            env.view.picks.may_hold = lambda: False  # a follower
            f = await env.filter(pod)
            assert len(f["NodeNames"]) == 1 and not env.view.inflight
            env.view.picks.may_hold = lambda: True  # it leads now
            (node,) = (await env.filter(pod))["NodeNames"]
            assert env.view.held_pick("default/p") == node
            assert env.view.drop_picks() == ["default/p"] and not env.view.inflight

    _go(body())


def test_a_bound_pod_comes_before_a_pick_held_on_its_gpus() -> None:
    from sharegpu.core.annotations import encode

    mine, other = kobjects.pod("mine", mem=16), kobjects.pod("other", mem=16)

    async def body() -> None:
        async with Picks([mine, other]) as env:
            (node,) = (await env.filter(mine))["NodeNames"]
            # another replica (a leader before this one) bound a pod on the same GPU
            from sharegpu.core.annotations import Allocation

            bound = {**other, "spec": {**other["spec"], "nodeName": node}}
            bound["metadata"] = {**other["metadata"], "annotations": encode(
                Allocation(mem={0: {0: 16}}), assume_time_ns=1, gpu_capacity={0: 16})}
            env.view.upsert_pod(bound)
            assert env.view.state.pods["default/other"].node == node
            assert "default/mine" not in env.view.inflight and len(env.view.picks) == 0
            assert env.view.drift() == [] and "default/other" not in env.view.problems

    _go(body())
