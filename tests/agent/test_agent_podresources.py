"""The agent names the pod of each Allocate through the kubelet's pod-resources API.

The test kubelet admits look-alike pods (one 2 GiB container each, on different GPUs) in an
order the agent cannot know, as the kubelet does: it adds the pod to its pod manager (listed,
no devices), asks GetPreferredAllocation and Allocate, then records the devices. With the
pod-resources socket, each container gets its own pod's GPU; the node carries the promise
(``sharegpu.io/pod-resources: v1``) only where the kubelet answers and is 1.34 or later; where
it promised and cannot name the pod, the agent refuses to guess between pods placed
differently."""

from __future__ import annotations

import os

import grpc
import pytest
from agent_helpers import NODE, Harness, make_pod, short_dir  # noqa: F401
from agent_kubelet import TestPodResources, wait_until

from sharegpu.agent.allocate import ANN_GRANT
from sharegpu.agent.podresources import being_admitted, kubelet_supported
from sharegpu.core import names
from sharegpu.core.annotations import is_assigned

MIXED = [("Tesla-T4", 15), ("Tesla-T4", 15), ("Tesla-V100-SXM2-32GB", 32),
         ("Tesla-V100-SXM2-32GB", 32)]


async def start(short_dir: str, *, kubelet: str = "v1.37.2", serve: bool = True,
                socket: bool = True, gpus: list | None = None, mode: str = "cgpu",
                ) -> tuple[Harness, TestPodResources]:
    sock = os.path.join(short_dir, "pr.sock")
    pr = TestPodResources(sock)
    if serve:
        await pr.start()
    cfg = {"pod_resources_socket": sock} if socket else {}
    h = Harness(short_dir, gpus or MIXED, mode, **cfg)
    h.kube.nodes[NODE]["status"] = {"nodeInfo": {"kubeletVersion": kubelet}}
    await h.start()
    return h, pr


def look_alikes() -> list[dict]:
    """Four pods of one shape (one container, 2 GiB) on four different GPUs, assume-time order
    a, b, c, d."""
    return [make_pod(n, [{"mem": 2}], alloc={0: {g: 2}}, assume=10 * (i + 1))
            for i, (n, g) in enumerate([("a", 3), ("b", 1), ("c", 0), ("d", 2)])]


async def admit(h: Harness, pr: TestPodResources, pod: dict, free: list[str]) -> str:
    """The kubelet admits ``pod``: the pod-resources listing shows it first, then the device
    manager asks the plugin, then records the devices. The answer's pod container."""
    pr.admit(pod)
    ids = await h.kubelet.preferred(names.RES_GPU_MEM, free, 2)
    resp = await h.kubelet.allocate(names.RES_GPU_MEM, ids)
    for i in ids:
        free.remove(i)
    pr.record(pod, "c0", names.RES_GPU_MEM, ids)
    env = dict(resp.envs)
    gpu = pod_gpu(pod)
    assert env[names.ENV_VISIBLE_DEVICES] == h.agent.gpus[gpu].uuid, (
        f"{pod['metadata']['name']} placed on GPU {gpu} got {resp.annotations[ANN_GRANT]}'s")
    assert {h.agent.devices.gpu_of(i) for i in ids} == {gpu}
    return resp.annotations[ANN_GRANT]


def pod_gpu(pod: dict) -> int:
    from sharegpu.core.annotations import decode

    (g,) = decode(pod["metadata"]["annotations"]).mem[0]
    return g


async def test_look_alike_pods_admitted_in_any_order_get_their_own_gpus(short_dir):
    h, pr = await start(short_dir)
    try:
        assert h.kube.nodes[NODE]["metadata"]["annotations"][names.ANN_NODE_POD_RESOURCES] == "v1"
        pods = look_alikes()
        for p in pods:
            h.kube.add_pod(p)
        free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        for p in (pods[2], pods[0], pods[3], pods[1]):  # c, a, d, b: not assume-time order
            assert await admit(h, pr, p, free) == f"default/{p['metadata']['name']}/c0"
        assert h.agent.allocating.named == 8  # 4 preferences and 4 Allocates named their pod
        # one listing per container (its Allocate follows the preference that named the pod),
        # and the promise's probe at start
        assert pr.lists == 4 + 1
    finally:
        await h.close()
        await pr.stop()


async def test_a_kubelet_limiting_the_api_is_waited_for(short_dir):
    """The kubelet answers RESOURCE_EXHAUSTED beyond 100 calls/s: the agent lists again."""
    h, pr = await start(short_dir)
    try:
        pods = look_alikes()
        for p in pods:
            h.kube.add_pod(p)
        free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        pr.busy = 3
        assert await admit(h, pr, pods[3], free) == "default/d/c0"
        assert pr.busy == 0 and h.agent.allocating.naming.client.errors == 0
    finally:
        await h.close()
        await pr.stop()


async def test_without_the_socket_the_agent_promises_nothing(short_dir):
    """The control: the same order without the listing goes by assume-time (pod a first) and
    hands pod c's container pod a's GPU, which is why the extender keeps look-alike pods apart
    on a node that made no promise."""
    h, pr = await start(short_dir, socket=False)
    try:
        assert names.ANN_NODE_POD_RESOURCES not in h.kube.nodes[NODE]["metadata"]["annotations"]
        pods = look_alikes()
        for p in pods:
            h.kube.add_pod(p)
        free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        pr.admit(pods[2])
        ids = await h.kubelet.preferred(names.RES_GPU_MEM, free, 2)
        resp = await h.kubelet.allocate(names.RES_GPU_MEM, ids)
        assert resp.annotations[ANN_GRANT] == "default/a/c0"
        assert pr.lists == 0
    finally:
        await h.close()
        await pr.stop()


@pytest.mark.parametrize("kubelet,serve", [("v1.33.4", True), ("v1.37.2", False), ("", True)])
async def test_no_promise_where_the_kubelet_cannot_keep_it(short_dir, kubelet, serve):
    """A kubelet before 1.34 lists the pods it rejected beside the one it admits; a socket that
    does not answer names nothing; an unknown version proves nothing."""
    h, pr = await start(short_dir, kubelet=kubelet, serve=serve)
    try:
        assert names.ANN_NODE_POD_RESOURCES not in h.kube.nodes[NODE]["metadata"]["annotations"]
        assert h.agent.allocating.naming is not None
        assert not h.agent.allocating.naming.promised
        assert h.agent.allocating.naming.why_not
    finally:
        await h.close()
        await pr.stop()


async def test_a_promise_it_cannot_keep_refuses_to_guess(short_dir):
    """The node promised, but the listing shows two look-alike pods without devices (it cannot
    happen with one kubelet admitting one pod at a time; here the test makes it happen): the
    agent refuses rather than give one pod the other's GPU. Twins (the same GPU) are no guess."""
    h, pr = await start(short_dir)
    try:
        pods = look_alikes()
        for p in pods[:2]:
            h.kube.add_pod(p)
            pr.admit(p)
        free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        ids = await h.kubelet.preferred(names.RES_GPU_MEM, free, 2)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.kubelet.allocate(names.RES_GPU_MEM, ids)
        assert "refusing to guess" in (e.value.details() or "")
        assert "default/a" in (e.value.details() or "")
        # twins: both on GPU 3
        for n in ("a", "b"):
            h.kube.pods.pop(("default", n))
        pr.pods.clear()
        twins = [make_pod(n, [{"mem": 2}], alloc={0: {3: 2}}, assume=5 + i)
                 for i, n in enumerate(("e", "f"))]
        for p in twins:
            h.kube.add_pod(p)
            pr.admit(p)
        ids = await h.kubelet.preferred(names.RES_GPU_MEM, free, 2)
        resp = await h.kubelet.allocate(names.RES_GPU_MEM, ids)
        assert dict(resp.envs)[names.ENV_VISIBLE_DEVICES] == h.agent.gpus[3].uuid
    finally:
        await h.close()
        await pr.stop()


def plain_pod(name: str, resource: str, n: int) -> dict:
    """A pod that sharegpu did not place (a static pod, one created with ``spec.nodeName``, a
    whole-card pod of the default scheduler): bound to the node, no decision."""
    pod = make_pod(name, [{"cards": n}], whole=resource)
    if resource != names.RES_NVIDIA_GPU:
        pod["spec"]["containers"][0]["resources"]["limits"] = {resource: str(n)}
    return pod


async def kubelet_admits(h: Harness, pr: TestPodResources, pod: dict, resource: str,
                         free: list[str], size: int) -> tuple[list[str], object]:
    """The kubelet admits ``pod``'s one container: listed, preference, Allocate, recorded. The
    devices it chose and the answer (or the refusal, an ``AioRpcError``)."""
    pr.admit(pod)
    ids = await h.kubelet.preferred(resource, free, size)
    try:
        resp: object = await h.kubelet.allocate(resource, ids)
    except grpc.aio.AioRpcError as e:
        pr.pods.pop(("default", pod["metadata"]["name"]))  # rejected: terminal, not listed
        return ids, e
    for i in ids:
        free.remove(i)
    pr.record(pod, "c0", resource, ids)
    return ids, resp


async def test_exclusive_cards_never_go_to_two_pods(short_dir):
    """Attack 4 of issue 40: a plain ``nvidia.com/gpu: 1`` pod S is admitted on a node that names
    pods while pending pod Y has a decision for card 0. S must get the card the kubelet chose and
    nothing of Y's; Y, Z and every later grant get exactly the kubelet's cards, so no exclusive
    card ever serves two pods."""
    h, pr = await start(short_dir, gpus=[("Tesla-T4", 15)] * 2, mode="default")
    try:
        res = names.RES_NVIDIA_GPU
        free = [i for i, _ in h.kubelet.devices[res]]
        card = {h.agent.devices.gpu_of(i): i for i in free}
        holders: dict[str, str] = {}  # card ID -> pod running on it

        def run(pod: dict, resp: object, ids: list[str]) -> None:
            name = pod["metadata"]["name"]
            if isinstance(resp, grpc.aio.AioRpcError):
                return
            assert resp.annotations.get(ANN_GRANT, f"default/{name}/c0") == f"default/{name}/c0", (
                f"{name} was handed {resp.annotations[ANN_GRANT]}'s decision")
            visible = dict(resp.envs)[names.ENV_VISIBLE_DEVICES].split(",")
            assert visible == ids, f"{name} got {visible}, the kubelet gave it {ids}"
            for v in visible:
                assert v not in holders, f"{name} and {holders[v]} both on card {v}"
                holders[v] = name

        y = make_pod("y", [{"cards": 1}], alloc={0: {0: 15}}, whole=res, assume=10)
        s = plain_pod("s", res, 1)
        h.kube.add_pod(y)
        h.kube.add_pod(s)
        ids, resp = await kubelet_admits(h, pr, s, res, free, 1)
        run(s, resp, ids)
        ids, resp = await kubelet_admits(h, pr, y, res, free, 1)
        run(y, resp, ids)
        # S was steered off the card Y's decision names: Y runs on its own card
        assert not isinstance(resp, grpc.aio.AioRpcError), resp
        assert ids == [card[0]]
        # S ends; the extender places Z on the card it believes free
        h.kube.pods.pop(("default", "s"))
        pr.pods.pop(("default", "s"))
        free.append(card[0])
        believed_free = 1
        z = make_pod("z", [{"cards": 1}], alloc={0: {believed_free: 15}}, whole=res, assume=20)
        h.kube.add_pod(z)
        ids, resp = await kubelet_admits(h, pr, z, res, free, 1)
        run(z, resp, ids)
    finally:
        await h.close()
        await pr.stop()


async def test_a_named_pod_without_decision_gets_no_shared_gpu_and_only_its_own_cards(short_dir):
    """The listing names the pod being admitted and it carries no decision: a shared request is
    refused (never the pending pod's decision, which stays for its own pod), whole cards are
    exactly the kubelet's. A pod the API does not show yet (a static pod before its mirror pod)
    is such a pod too."""
    h, pr = await start(short_dir)
    try:
        y = make_pod("y", [{"mem": 2}], alloc={0: {1: 2}}, assume=10)
        h.kube.add_pod(y)
        s = plain_pod("s", names.RES_GPU_MEM, 2)
        h.kube.add_pod(s)
        free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        _, refused = await kubelet_admits(h, pr, s, names.RES_GPU_MEM, free, 2)
        assert isinstance(refused, grpc.aio.AioRpcError)
        assert "pod default/s, which the kubelet is admitting" in refused.details()
        assert "carries no sharegpu decision" in refused.details()
        assert await admit(h, pr, y, free) == "default/y/c0"  # Y's decision is still Y's
    finally:
        await h.close()
        await pr.stop()


async def test_several_listed_pods_one_without_decision_get_no_decision(short_dir):
    """The listing shows two pods waiting for devices (one kubelet admits one at a time; here
    the test makes it happen), one of them without a decision: the request may be that one's,
    so no decision is handed out."""
    h, pr = await start(short_dir)
    try:
        y = make_pod("y", [{"mem": 2}], alloc={0: {1: 2}}, assume=10)
        s = plain_pod("s", names.RES_GPU_MEM, 2)
        for p in (y, s):
            h.kube.add_pod(p)
            pr.admit(p)
        on1 = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]
               if h.agent.devices.gpu_of(i) == 1][:2]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.kubelet.allocate(names.RES_GPU_MEM, on1)
        assert "pod one of default/s, default/y, which the kubelet is admitting" \
            in e.value.details()
        assert not is_assigned(h.kube.pods[("default", "y")]["metadata"]["annotations"])
    finally:
        await h.close()
        await pr.stop()


async def test_a_listed_pod_the_api_does_not_show_gets_only_the_kubelets_cards(short_dir):
    """A static pod before its mirror pod exists: listed, not in the API, so no decision."""
    h, pr = await start(short_dir, mode="default")
    try:
        static = plain_pod("static", names.RES_NVIDIA_GPU, 1)
        static["metadata"]["namespace"] = "default"
        cards = [i for i, _ in h.kubelet.devices[names.RES_NVIDIA_GPU]]
        h.kube.add_pod(make_pod("w", [{"cards": 1}], alloc={0: {2: 32}},
                                whole=names.RES_NVIDIA_GPU, assume=5))
        pr.admit(static)  # listed; the API does not show it
        ids = await h.kubelet.preferred(names.RES_NVIDIA_GPU, cards, 1)
        assert ids == cards[:1]  # no one's decision steers it
        resp = await h.kubelet.allocate(names.RES_NVIDIA_GPU, [cards[2]])
        assert dict(resp.envs)[names.ENV_VISIBLE_DEVICES] == cards[2]
        assert ANN_GRANT not in resp.annotations  # W's decision is not handed out
        assert not is_assigned(h.kube.pods[("default", "w")]["metadata"]["annotations"])
    finally:
        await h.close()
        await pr.stop()


async def test_readmission_serves_the_recorded_decision(short_dir):
    """Issue 41: the kubelet lost its device checkpoint and admits a running, assigned pod
    again. The listing names it: the preference steers to its decision, and its Allocate gets
    its decision again, also when the kubelet's devices of the same size lie on another GPU."""
    h, pr = await start(short_dir)
    try:
        p = make_pod("p", [{"mem": 2}], alloc={0: {2: 2}}, assume=10)
        h.kube.add_pod(p)
        free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        assert await admit(h, pr, p, list(free)) == "default/p/c0"
        await wait_until(lambda: is_assigned(h.kube.pods[("default", "p")]["metadata"]
                                             ["annotations"]))
        # the kubelet restarts without its checkpoint: every device is free, P is admitted again
        pr.pods.clear()
        assert await admit(h, pr, p, list(free)) == "default/p/c0"
        # and once more, the kubelet choosing devices on GPU 0 (it did not follow the preference)
        pr.pods.clear()
        pr.admit(p)
        on0 = [i for i in free if h.agent.devices.gpu_of(i) == 0][:2]
        resp = await h.kubelet.allocate(names.RES_GPU_MEM, on0)
        assert resp.annotations[ANN_GRANT] == "default/p/c0"
        assert dict(resp.envs)[names.ENV_VISIBLE_DEVICES] == h.agent.gpus[2].uuid
        assert dict(resp.envs)["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"

    finally:
        await h.close()
        await pr.stop()


async def test_readmission_of_a_two_container_pod_serves_each_container_its_own(short_dir):
    """A marked pod of two containers on two GPUs, admitted again container by container: the
    listing shows what each already holds, so each gets its own decision."""
    h, pr = await start(short_dir)
    try:
        p = make_pod("two", [{"mem": 2}, {"mem": 3}], alloc={0: {1: 2}, 1: {3: 3}}, assume=10)
        p["metadata"]["annotations"][names.ANN_ASSIGNED] = "true"
        h.kube.add_pod(p)
        free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
        pr.admit(p)
        for c, (gpu, size) in enumerate([(1, 2), (3, 3)]):
            ids = await h.kubelet.preferred(names.RES_GPU_MEM, free, size)
            assert {h.agent.devices.gpu_of(i) for i in ids} == {gpu}
            resp = await h.kubelet.allocate(names.RES_GPU_MEM, ids)
            assert resp.annotations[ANN_GRANT] == f"default/two/c{c}"
            assert dict(resp.envs)[names.ENV_VISIBLE_DEVICES] == h.agent.gpus[gpu].uuid
            pr.record(p, f"c{c}", names.RES_GPU_MEM, ids)
            for i in ids:
                free.remove(i)
    finally:
        await h.close()
        await pr.stop()


async def test_readmission_of_whole_cards_is_the_decision_or_a_refusal(short_dir):
    """Whole cards: re-admitted on the decided card; on another card (the kubelet lost its
    checkpoint and did not follow the preference) refused, saying why."""
    h, pr = await start(short_dir, mode="default")
    try:
        cards = [i for i, _ in h.kubelet.devices[names.RES_NVIDIA_GPU]]
        x = make_pod("x", [{"cards": 1}], alloc={0: {3: 32}}, whole=names.RES_NVIDIA_GPU,
                     assume=20)
        x["metadata"]["annotations"][names.ANN_ASSIGNED] = "true"
        h.kube.add_pod(x)
        pr.admit(x)
        assert await h.kubelet.preferred(names.RES_NVIDIA_GPU, cards, 1) == [cards[3]]
        resp = await h.kubelet.allocate(names.RES_NVIDIA_GPU, [cards[3]])
        assert resp.annotations[ANN_GRANT] == "default/x/c0"
        pr.pods.clear()
        pr.admit(x)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h.kubelet.allocate(names.RES_NVIDIA_GPU, [cards[1]])
        msg = e.value.details() or ""
        assert "pod default/x, which the kubelet is admitting" in msg
        assert "carries sharegpu's decision (c0: GPU 3)" in msg and "GPU 1: 1 card" in msg
        assert "device checkpoint" in msg and "was the pod scheduled" not in msg
    finally:
        await h.close()
        await pr.stop()


def test_being_admitted_is_the_listed_pod_without_devices_of_the_resource():
    def pod(name: str, core: bool = False) -> dict:
        p = make_pod(name, [{"mem": 2, "core": 30} if core else {"mem": 2}])
        return p

    listing = {("default", "done"): {"c0": {names.RES_GPU_MEM: frozenset({"x"})}},
               ("default", "now"): {"c0": {}},
               ("default", "half"): {"c0": {names.RES_GPU_MEM: frozenset({"y"})}},
               ("default", "cpu"): {"c0": {}}}
    pods = [pod("done"), pod("now"), pod("later"), pod("half", core=True), make_pod("cpu", [{}])]
    # "later" is not in the kubelet's pod manager yet; "half" holds its memory, not its compute;
    # "cpu" asks for no GPU
    known, unknown = being_admitted(listing, pods, names.RES_GPU_MEM)
    assert [n.key for n in known] == ["uid-now"] and unknown == []
    known, _ = being_admitted(listing, pods, names.RES_GPU_CORE)
    assert [(n.key, n.ref) for n in known] == [("uid-half", "default/half")]
    assert known[0].held == {"c0": frozenset({names.RES_GPU_MEM})}
    assert being_admitted({}, pods, names.RES_GPU_MEM) == ([], [])
    # a static pod before its mirror pod exists: listed, not in the API
    known, unknown = being_admitted({("kube-system", "static"): {"c0": {}}}, pods,
                                    names.RES_NVIDIA_GPU)
    assert known == [] and [n.ref for n in unknown] == ["kube-system/static"]


@pytest.mark.parametrize("version,ok", [("v1.34.0", True), ("v1.37.2", True), ("1.40.1+k3s1", True),
                                        ("v1.33.9", False), ("v2", False), ("", False)])
def test_kubelet_versions(version, ok):
    assert kubelet_supported(version) is ok
