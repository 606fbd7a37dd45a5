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
from agent_kubelet import TestPodResources

from sharegpu.agent.allocate import ANN_GRANT, Candidate
from sharegpu.agent.podresources import admitting, kubelet_supported
from sharegpu.core import names

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


@pytest.mark.xfail(strict=True, reason="issue 40 attack 4: S gets Y's decision, then Z and Y "
                   "share card 1")
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


def test_admitting_is_the_listed_pod_without_devices_of_the_resource():
    def cand(name: str, container: str = "c0", core: bool = False) -> Candidate:
        req = frozenset({names.RES_GPU_MEM, names.RES_GPU_CORE} if core
                        else {names.RES_GPU_MEM})
        return Candidate(namespace="default", name=name, uid=f"uid-{name}", container=0,
                         container_name=container, mem={0: 2}, core={0: 30} if core else {},
                         whole=False, pod_total_mem=2, assume_time=1, required=req)

    listing = {("default", "done"): {"c0": {names.RES_GPU_MEM: frozenset({"x"})}},
               ("default", "now"): {"c0": {}},
               ("default", "half"): {"c0": {names.RES_GPU_MEM: frozenset({"y"})}}}
    cands = [cand("done"), cand("now"), cand("later"), cand("half", core=True)]
    # "later" is not in the kubelet's pod manager yet; "half" holds its memory, not its compute
    assert admitting(listing, cands, names.RES_GPU_MEM) == {"uid-now"}
    assert admitting(listing, cands, names.RES_GPU_CORE) == {"uid-half"}
    assert admitting({}, cands, names.RES_GPU_MEM) == set()


@pytest.mark.parametrize("version,ok", [("v1.34.0", True), ("v1.37.2", True), ("1.40.1+k3s1", True),
                                        ("v1.33.9", False), ("v2", False), ("", False)])
def test_kubelet_versions(version, ok):
    assert kubelet_supported(version) is ok
