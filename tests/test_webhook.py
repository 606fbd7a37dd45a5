"""The admission webhook refuses every bad GPU request of SPEC §2 with the exact message."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
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


# --- opt-in: schedulerName for GPU-sharing pods (docs/webhook.md) ----------------------------

def _patch_of(resp: dict) -> list | None:
    import base64
    import json

    if "patch" not in resp:
        return None
    assert resp["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(resp["patch"]))


SET = [{"op": "add", "path": "/spec/schedulerName", "value": "ack-co-scheduler"}]


@pytest.mark.parametrize(("what", "pod", "patch"), [
    ("gpu-mem, default scheduler", kobjects.pod("a", mem=4, scheduler="default-scheduler"), SET),
    ("gpu-mem + core", kobjects.pod("b", mem=4, core=50, scheduler="default-scheduler"), SET),
    ("topology cards", kobjects.pod("c", topology=2, scheduler="default-scheduler"), SET),
    ("gpu-mem, no schedulerName", {**kobjects.pod("d", mem=4),
                                   "spec": {"containers": kobjects.pod("d", mem=4)["spec"][
                                       "containers"]}}, SET),
    ("already the extender's", kobjects.pod("e", mem=4), None),
    ("a scheduler of its own", kobjects.pod("f", mem=4, scheduler="volcano"), None),
    ("whole nvidia.com/gpu cards", kobjects.pod("g", cards=1, scheduler="default-scheduler"),
     None),
    ("no GPU", kobjects.pod("h", scheduler="default-scheduler"), None),
    ("a request that breaks a rule", kobjects.pod("i", mem=4, core=33,
                                                  scheduler="default-scheduler"), None),
])
def test_scheduler_patch_only_for_gpu_sharing_pods_left_to_the_default(what, pod, patch):
    from sharegpu.webhook import scheduler_patch

    assert scheduler_patch(pod, "ack-co-scheduler") == patch, what


def test_mutate_sets_the_scheduler_over_http_and_validation_then_admits():
    """``/mutate`` with a scheduler to set: the patched pod then passes ``/validate``'s
    scheduler check; other pods come back unchanged; without the option nothing changes."""
    import copy

    ack = frozenset({"ack-co-scheduler"})
    forgot = kobjects.pod("forgot", mem=4, scheduler="default-scheduler")
    plain = kobjects.pod("plain", scheduler="default-scheduler")

    async def go() -> None:
        async with TestClient(TestServer(app(ack, set_scheduler="ack-co-scheduler"))) as client:
            r = await client.post("/mutate", json=admission(forgot))
            assert r.status == 200
            resp = (await r.json())["response"]
            assert resp["allowed"] is True and resp["uid"] == "req-1"
            patch = _patch_of(resp)
            assert patch == SET
            fixed = copy.deepcopy(forgot)
            fixed["spec"]["schedulerName"] = patch[0]["value"]
            r = await client.post("/validate", json=admission(fixed))
            assert (await r.json())["response"]["allowed"] is True
            r = await client.post("/validate", json=admission(forgot))  # unpatched: refused
            assert (await r.json())["response"]["allowed"] is False
            r = await client.post("/mutate", json=admission(plain))
            assert _patch_of((await r.json())["response"]) is None
            r = await client.post("/mutate", json=admission(forgot, operation="UPDATE"))
            assert _patch_of((await r.json())["response"]) is None
            r = await client.post("/mutate", data=b"{not json")
            assert r.status == 400
        async with TestClient(TestServer(app(ack))) as client:  # off by default
            r = await client.post("/mutate", json=admission(forgot))
            resp = (await r.json())["response"]
            assert resp["allowed"] is True and _patch_of(resp) is None

    asyncio.run(go())


def test_a_dra_pod_gets_claims_not_a_scheduler():
    """In DRA mode a pod bound for the pool is translated (the default scheduler places DRA
    pods); the schedulerName is set only for the others."""
    from sharegpu.dra.draclaims import Pool
    from sharegpu.webhook import mutate

    pool = Pool.parse("sharegpu.io/dra=true", "gpu.sharegpu.io")
    dra_pod = kobjects.pod("d", mem=4, scheduler="default-scheduler")
    dra_pod["spec"]["nodeSelector"] = {"sharegpu.io/dra": "true"}
    out = asyncio.run(mutate(admission(dra_pod), pool, None, "ack-co-scheduler"))["response"]
    ops = _patch_of(out)
    assert ops and all(op["path"] != "/spec/schedulerName" for op in ops)
    other = kobjects.pod("o", mem=4, scheduler="default-scheduler")
    out = asyncio.run(mutate(admission(other), pool, None, "ack-co-scheduler"))["response"]
    assert _patch_of(out) == SET


@pytest.mark.parametrize(("text", "message"), [
    ("volcano", "must be one of --gpu-schedulers (ack-co-scheduler)"),
    ("Bad_Name", "must be a scheduler name"),
])
def test_set_scheduler_name_is_checked(text, message):
    from sharegpu.commands.webhook import scheduler_name
    from sharegpu.core.errors import ValidationError

    with pytest.raises(ValidationError, match=re.escape(message)):
        scheduler_name(text, frozenset({"ack-co-scheduler"}))
    assert scheduler_name("", frozenset()) is None
    assert scheduler_name("ack-co-scheduler", frozenset({"ack-co-scheduler"})) == \
        "ack-co-scheduler"


def test_chart_mutating_scheduler_hook_is_opt_in():
    from test_chart import KUBE, args_of, one, render, run_helm

    docs = render(None)
    assert not [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    assert not any(a.startswith("--set-scheduler-name") for a in args_of(
        one(docs, "Deployment", "webhook")))
    docs = render(None, KUBE, "webhook.setSchedulerName=true")
    assert "--set-scheduler-name=ack-co-scheduler" in args_of(one(docs, "Deployment", "webhook"))
    (hook,) = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["name"] == "pods.scheduler.sharegpu.io"
    assert hook["clientConfig"]["service"]["path"] == "/mutate"
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"],
                              "operations": ["CREATE"], "resources": ["pods"],
                              "scope": "Namespaced"}]
    conds = {c["name"]: c["expression"] for c in hook["matchConditions"]}
    assert "'aliyun.com/gpu-mem'" in conds["asks-for-shared-gpu"]
    assert "nvidia.com/gpu" not in conds["asks-for-shared-gpu"]
    assert "'default-scheduler'" in conds["left-to-the-default-scheduler"]
    r = run_helm("template", "s", str(Path(__file__).parent.parent / "charts" / "sharegpu"),
                 "--set", "webhook.setSchedulerName=true", "--set", "scheduler.mode=default")
    assert r.returncode != 0 and "needs scheduler.mode=profile" in r.stderr


@pytest.mark.parametrize("scheduler", [None, "ack-co-scheduler"])
def test_a_pod_of_ambiguous_pool_is_refused_with_or_without_the_scheduler_option(scheduler):
    """Node affinity terms of which one names the DRA pool and another does not: refused
    naming the rule (a review the webhook cannot answer would be a 500 at the API server)."""
    from sharegpu.dra.draclaims import Pool
    from sharegpu.webhook import mutate

    pool = Pool.parse("sharegpu.io/dra=true", "gpu.sharegpu.io")
    p = kobjects.pod("amb", mem=4, scheduler="default-scheduler")
    p["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "sharegpu.io/dra", "operator": "In",
                                   "values": ["true"]}]},
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
    out = asyncio.run(mutate(admission(p), pool, None, scheduler))["response"]
    assert out["allowed"] is False and out["status"]["code"] == 422
    assert "spec.affinity" in out["status"]["message"]
