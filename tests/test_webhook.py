"""The admission webhook refuses every bad GPU request of SPEC §2 with the exact message."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sharegpu.webhook import app, review
from sharegpu_testing import kobjects

MEM = "aliyun.com/gpu-mem"
CORE = "aliyun.com/gpu-core.percentage"
CARDS = "nvidia.com/gpu"
TOPO = "aliyun.com/gpu"


def admission(pod: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "req-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "operation": operation, "namespace": "team-a", "object": pod},
    }


def answer(pod: dict[str, Any]) -> dict[str, Any]:
    return review(admission(pod))["response"]


def refused(pod: dict[str, Any]) -> str:
    r = answer(pod)
    assert r["allowed"] is False
    assert r["uid"] == "req-1"
    assert r["status"]["code"] == 422
    return r["status"]["message"]


def lim(c: int = 0) -> str:
    return f"spec.containers[{c}].resources.limits"


CASES = [
    # gpu-core.percentage: a multiple of 5, at least 5, at most 100
    ("core not a multiple of 5", kobjects.pod("p", mem=4, core=33),
     f"{lim()}[\"{CORE}\"]='33': must be a multiple of 5 between 5 and 100"),
    ("core below 5", kobjects.pod("p", mem=4, core=0),
     f"{lim()}[\"{CORE}\"]='0': must be a multiple of 5 between 5 and 100"),
    ("core above 100", kobjects.pod("p", mem=4, core=105),
     f"{lim()}[\"{CORE}\"]='105': must be a multiple of 5 between 5 and 100"),
    ("core negative", kobjects.pod("p", mem=4, core=-5),
     f"{lim()}[\"{CORE}\"]='-5': must be a multiple of 5 between 5 and 100"),
    ("core without memory", kobjects.pod("p", core=50),
     f"{lim()}[\"{CORE}\"]='50': needs {MEM} in the same container"),
    # gpu-mem: whole GiB >= 1
    ("mem zero", kobjects.pod("p", mem=0),
     f"{lim()}[\"{MEM}\"]='0': must be a whole number of GiB, at least 1"),
    ("mem negative", kobjects.pod("p", mem=-2),
     f"{lim()}[\"{MEM}\"]='-2': must be a whole number of GiB, at least 1"),
    ("mem not an integer", kobjects.pod("p", mem="1.5"),
     f"{lim()}[\"{MEM}\"]='1.5': must be a whole number of GiB, at least 1"),
    ("mem with a unit", kobjects.pod("p", mem="4Gi"),
     f"{lim()}[\"{MEM}\"]='4Gi': must be a whole number of GiB, at least 1"),
    # multi-GPU shared requests
    ("mem not divisible by gpu-count", kobjects.pod("p", mem=10, gpu_count=4),
     f"{lim()}[\"{MEM}\"]='10': must be divisible by the pod label aliyun.com/gpu-count "
     "(each GPU gets gpu-mem / gpu-count GiB) (gpu-count=4)"),
    ("gpu-count zero", kobjects.pod("p", mem=8, gpu_count=0),
     "metadata.labels[\"aliyun.com/gpu-count\"]='0': must be a whole number of GPUs, at least 1"),
    ("gpu-count not a number", kobjects.pod("p", mem=8, gpu_count="two"),
     "metadata.labels[\"aliyun.com/gpu-count\"]='two': must be a whole number of GPUs, "
     "at least 1"),
    ("gpu-count without gpu-mem", kobjects.pod("p", cards=1, gpu_count=2),
     "metadata.labels[\"aliyun.com/gpu-count\"]='2': needs a container that asks for "
     f"{MEM}"),
    ("gpu-count as a container resource",
     kobjects.pod("p", containers=[{MEM: "4", "aliyun.com/gpu-count": "2"}]),
     f"{lim()}[\"aliyun.com/gpu-count\"]='2': is a node resource; set the pod label "
     "aliyun.com/gpu-count to spread gpu-mem over GPUs"),
    # whole cards
    ("negative cards", kobjects.pod("p", cards=-1),
     f"{lim()}[\"{CARDS}\"]='-1': must be a whole number, at least 0"),
    ("fractional cards", kobjects.pod("p", cards="0.5"),
     f"{lim()}[\"{CARDS}\"]='0.5': must be a whole number, at least 0"),
    # exclusive and shared in one container / one pod
    ("cards and memory in one container", kobjects.pod("p", mem=4, cards=1),
     f"{lim()}[\"{MEM}\"]='4': cannot be asked for together with {CARDS} in one container"),
    ("topology and memory in one container", kobjects.pod("p", mem=4, topology=2),
     f"{lim()}[\"{MEM}\"]='4': cannot be asked for together with {TOPO} in one container"),
    ("cards and topology cards in one container", kobjects.pod("p", cards=1, topology=1),
     f"{lim()}[\"{TOPO}\"]='1': cannot be asked for together with {CARDS} in one container"),
    ("shared and exclusive containers in one pod",
     kobjects.pod("p", containers=[{MEM: "4"}, {CARDS: "1"}]),
     "spec.containers[1].resources='exclusive': cannot be mixed with shared in one pod: "
     "a node runs one GPU mode"),
    ("memory-only and memory+compute containers in one pod",
     kobjects.pod("p", containers=[{MEM: "4"}, {MEM: "4", CORE: "50"}]),
     "spec.containers[1].resources='shared-core': containers that ask for aliyun.com/gpu-mem "
     "only and containers that also ask for aliyun.com/gpu-core.percentage cannot run in one "
     "pod (a node cannot mix them)"),
]


@pytest.mark.parametrize(("case", "pod", "message"), CASES, ids=[c[0] for c in CASES])
def test_refused_with_exact_message(case: str, pod: dict[str, Any], message: str) -> None:
    assert refused(pod) == message


def test_requests_must_equal_limits() -> None:
    pod = kobjects.pod("p", mem=4)
    pod["spec"]["containers"][0]["resources"]["requests"] = {MEM: "2"}
    assert refused(pod) == (
        f"spec.containers[0].resources.requests[\"{MEM}\"]='2': "
        "requests must equal limits for GPU resources"
    )


def test_gpu_in_init_container_refused() -> None:
    pod = kobjects.pod("p", mem=4)
    pod["spec"]["initContainers"] = [{"name": "init", "resources": {"limits": {MEM: "1"}}}]
    assert refused(pod) == (
        f"spec.initContainers[0].resources.limits[\"{MEM}\"]='1': "
        "GPU resources are not supported in init containers"
    )


@pytest.mark.parametrize("pod", [
    kobjects.pod("p", mem=3),
    kobjects.pod("p", mem=8, core=30),
    kobjects.pod("p", mem=16, gpu_count=2),
    kobjects.pod("p", cards=2),
    kobjects.pod("p", topology=4),
    kobjects.pod("p", containers=[{MEM: "4"}, {MEM: "7"}]),
    kobjects.pod("p", containers=[{}]),  # no GPU at all
])
def test_good_requests_allowed(pod: dict[str, Any]) -> None:
    r = answer(pod)
    assert r == {"uid": "req-1", "allowed": True}


def test_only_pod_creation_is_checked() -> None:
    bad = kobjects.pod("p", mem=4, core=33)
    assert review(admission(bad, "UPDATE"))["response"]["allowed"] is True
    assert review(admission(bad, "CREATE"))["response"]["allowed"] is False


def test_http_validate_and_fail_closed() -> None:
    async def go() -> None:
        async with TestClient(TestServer(app())) as client:
            r = await client.post("/validate", json=admission(kobjects.pod("p", mem=4, core=7)))
            assert r.status == 200
            body = await r.json()
            assert body["kind"] == "AdmissionReview"
            assert body["apiVersion"] == "admission.k8s.io/v1"
            assert body["response"]["allowed"] is False
            assert "must be a multiple of 5" in body["response"]["status"]["message"]
            # a review that cannot be read is an error (the API server refuses: fail closed)
            r = await client.post("/validate", data=b"{not json")
            assert r.status == 400
            r = await client.post("/validate", json={"kind": "AdmissionReview",
                                                     "apiVersion": "admission.k8s.io/v1"})
            assert r.status == 400
            assert "request" in (await r.json())["error"]
            r = await client.get("/healthz")
            assert r.status == 200

    asyncio.run(go())


def _review_of(pod: dict) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "kind": {"kind": "Pod"}, "operation": "CREATE",
                        "namespace": "default", "object": pod}}


def test_gpu_sharing_pod_without_the_extenders_scheduler_is_refused():
    """A pod asking for gpu-mem with the default scheduler would be placed by count alone and
    its container failed later by the agent: refused at admission, naming schedulerName."""
    from sharegpu.webhook import review
    from sharegpu_testing import kobjects

    ack = frozenset({"ack-co-scheduler"})
    forgot = kobjects.pod("forgot", mem=4, scheduler="default-scheduler")
    out = review(_review_of(forgot), ack)["response"]
    assert not out["allowed"]
    assert out["status"]["message"] == (
        "spec.schedulerName='default-scheduler': a pod asking for aliyun.com/gpu-mem, "
        "aliyun.com/gpu-core.percentage or aliyun.com/gpu must be scheduled by a scheduler that "
        "runs the sharegpu extender: set schedulerName: ack-co-scheduler")
    unset = kobjects.pod("unset", mem=4)
    del unset["spec"]["schedulerName"]
    assert not review(_review_of(unset), ack)["response"]["allowed"]
    assert review(_review_of(kobjects.pod("ok", mem=4)), ack)["response"]["allowed"]
    # whole cards need no extender; non-GPU pods are untouched
    cards = kobjects.pod("cards", cards=1, scheduler="default-scheduler")
    assert review(_review_of(cards), ack)["response"]["allowed"]
    plain = kobjects.pod("plain", scheduler="default-scheduler")
    assert review(_review_of(plain), ack)["response"]["allowed"]
    # with the extender in the cluster's default scheduler (chart scheduler.mode=default)
    assert review(_review_of(forgot), frozenset({"default-scheduler"}))["response"]["allowed"]


def test_chart_passes_the_scheduler_names_to_the_webhook():
    from test_chart import args_of, one, render

    assert "--gpu-schedulers=ack-co-scheduler" in args_of(one(render(None), "Deployment",
                                                               "webhook"))
    dflt = one(render("default-scheduler.yaml"), "Deployment", "webhook")
    assert "--gpu-schedulers=default-scheduler" in args_of(dflt)
