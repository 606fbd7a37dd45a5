"""Users' own ResourceClaims and ResourceClaimTemplates of sharegpu's DeviceClass (issue 21, bad
input "a size off the step"): sharegpu.dra.claimrules (pure) and the validating webhook's
``/validate`` over HTTP, as kube-apiserver calls it."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kubernetes_validate
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sharegpu.dra import claimrules
from sharegpu.dra.claimrules import check_claim, check_template
from sharegpu.dra.draclaims import Pool, Shape, claim_template
from sharegpu.webhook import app, review

CLS = "gpu.sharegpu.io"
SHAREABLE = [{"cel": {"expression": "device.allowMultipleAllocations == true"}}]
AT = "spec.devices.requests[0].exactly"


def request(name: str = "gpu", cls: str = CLS, **exactly: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": cls, "selectors": SHAREABLE,
                            "allocationMode": "ExactCount", "count": 1}
    body.update(exactly)
    return {"name": name, "exactly": body}


def claim(*requests: dict[str, Any], constraints: list[Any] | None = None,
          name: str = "mine") -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints is not None:
        devices["constraints"] = constraints
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "team-a"}, "spec": {"devices": devices}}


def template(c: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": c["metadata"], "spec": {"spec": c["spec"]}}


def cap(**requests: Any) -> dict[str, Any]:
    return {"requests": requests}


def refusal(obj: dict[str, Any], kind: str = claimrules.CLAIM) -> tuple[str, str]:
    v = claimrules.check(kind, obj)
    assert not v.allowed
    (e,) = v.refusals
    assert v.message == str(e)
    return e.field, e.rule


# ------------------------------------------------------------------ good claims pass


GOOD = [
    ("4Gi", claim(request(capacity=cap(memory="4Gi")))),
    ("4Gi and 30 %", claim(request(capacity=cap(memory="4Gi", cores="30")))),
    ("bytes that are whole GiB", claim(request(capacity=cap(memory=str(3 << 30))))),
    ("cores alone (memory: the 1Gi default)", claim(request(capacity=cap(cores="100")))),
    ("no capacity (the default, or a whole GPU)", claim(request())),
    ("2 GPUs kept apart", claim(request(count=2, capacity=cap(memory="8Gi")),
                                constraints=[{"requests": ["gpu"],
                                              "distinctAttribute": f"{CLS}/uuid"}])),
    ("2 requests kept apart by a constraint over all requests",
     claim(request("a", capacity=cap(memory="1Gi")), request("b", capacity=cap(memory="2Gi")),
           constraints=[{"distinctAttribute": f"{CLS}/index"}])),
    ("a GPU and another driver's device", claim(
        request(capacity=cap(memory="2Gi")),
        request("nic", cls="nic.example.com", capacity=cap(memory="4.5Gi")))),
    ("firstAvailable: 8Gi, else 4Gi", claim({"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": CLS, "selectors": SHAREABLE,
         "capacity": cap(memory="8Gi")},
        {"name": "small", "deviceClassName": CLS, "selectors": SHAREABLE,
         "capacity": cap(memory="4Gi", cores="50")}]})),
    ("no devices at all", {"spec": {}}),
]


@pytest.mark.parametrize(("case", "obj"), GOOD, ids=[g[0] for g in GOOD])
def test_good_claims_and_templates_pass_without_a_word(case: str, obj: dict[str, Any]) -> None:
    assert check_claim(obj) == claimrules.Verdict(), case
    assert check_template(template(obj) if "metadata" in obj else {"spec": obj["spec"]}) == \
        claimrules.Verdict(), case
    if "metadata" in obj:  # what the tests call good is what the API server stores
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
        kubernetes_validate.validate(template(obj), "1.37.0", strict=True)


@pytest.mark.parametrize("shape", [Shape(1), Shape(4, 30), Shape(40, 100), Shape(4, 5, 2),
                                   Shape(80, 0, 8)])
def test_sharegpus_own_templates_and_the_claims_made_from_them_pass(shape: Shape) -> None:
    t = claim_template("team-a", shape, Pool())
    assert check_template(t) == claimrules.Verdict()
    # the resourceclaim controller creates each pod's claim with the template's spec.spec
    made = {"metadata": {"name": "p-sharegpu-c0-x1y2z", "namespace": "team-a"},
            "spec": copy.deepcopy(t["spec"]["spec"])}
    assert check_claim(made) == claimrules.Verdict()


def test_other_drivers_requests_are_untouched() -> None:
    other = claim(request(cls="nic.example.com", count=3, allocationMode="ExactCount",
                          capacity=cap(memory="4.5Gi", bandwidth="12")),
                  request("b", cls="nic.example.com", capacity=cap(memory="0")))
    assert check_claim(other) == claimrules.Verdict()
    # the class the webhook is given decides what is ours
    ours = claim(request(capacity=cap(memory="4.5Gi")))
    assert claimrules.check(claimrules.CLAIM, ours, "gpu.example.com").allowed
    assert not claimrules.check(claimrules.CLAIM, ours, CLS).allowed


# ------------------------------------------------------------------ refusals, one per rule


MEM = f"{AT}.capacity.requests.memory"
CORES = f"{AT}.capacity.requests.cores"
STEP = "the driver's memory is consumed in steps of 1Gi"
CORE_RULE = "must be a whole multiple of 5 from 5 to 100 (percent of the GPU; the driver's " \
    "cores are consumed in steps of 5, so "

REFUSED = [
    ("memory 4.5Gi", cap(memory="4.5Gi"), MEM,
     f"must be a whole number of GiB: {STEP}, so 4.5Gi would consume 5Gi; ask for 4Gi or 5Gi"),
    ("memory 4608Mi (as the API server writes 4.5Gi)", cap(memory="4608Mi"), MEM,
     f"must be a whole number of GiB: {STEP}, so 4608Mi (4.5 GiB) would consume 5Gi; ask for "
     "4Gi or 5Gi"),
    ("memory in decimal bytes", cap(memory="5G"), MEM,
     f"must be a whole number of GiB: {STEP}, so 5G (4.657 GiB) would consume 5Gi; ask for "
     "4Gi or 5Gi"),
    ("memory 1.5Gi", cap(memory="1.5Gi"), MEM, "so 1.5Gi would consume 2Gi; ask for 1Gi or 2Gi"),
    ("memory below 1Gi", cap(memory="512Mi"), MEM,
     "must be at least 1Gi (the driver's smallest share of memory; 512Mi would consume 1Gi)"),
    ("memory 0", cap(memory="0"), MEM,
     "must be at least 1Gi (the driver's smallest share of memory; 0 would consume 1Gi)"),
    ("memory negative", cap(memory="-2Gi"), MEM,
     "must be at least 1Gi (the driver's smallest share of memory)"),
    ("memory not a quantity", cap(memory="lots"), MEM, "must be a Kubernetes quantity"),
    ("memory beyond what Kubernetes stores", cap(memory="9Ei"), MEM,
     "is beyond the largest quantity Kubernetes stores"),
    ("cores 12", cap(memory="4Gi", cores="12"), CORES, CORE_RULE + "12 would consume 15)"),
    ("cores 12.5", cap(cores="12.5"), CORES, CORE_RULE + "12.5 would consume 15)"),
    ("cores 0", cap(cores="0"), CORES, CORE_RULE + "0 would consume 5)"),
    ("cores 3", cap(cores="3"), CORES, CORE_RULE + "3 would consume 5)"),
    ("cores 105", cap(cores="105"), CORES, CORE_RULE + "105 fits no GPU, which has 100)"),
    ("cores negative", cap(cores="-5"), CORES, CORE_RULE + "-5 is no share)"),
    ("cores in milli", cap(cores="50500m"), CORES, CORE_RULE + "50500m would consume 55)"),
    ("cores not a quantity", cap(cores="half"), CORES, "must be a Kubernetes quantity"),
    ("a capacity the driver does not publish", cap(memory="4Gi", gpus="1"),
     f'{AT}.capacity.requests["gpus"]',
     f"is not a capacity of DeviceClass {CLS}: its GPUs publish only memory (bytes, in steps "
     "of 1Gi) and cores (percent, in steps of 5); a request for another name is never "
     "allocated"),
    ("memory qualified with the driver's domain", cap(**{f"{CLS}/memory": "4Gi"}),
     f'{AT}.capacity.requests["{CLS}/memory"]', "is not a capacity of DeviceClass"),
    ("requests not a map", {"requests": ["memory"]}, f"{AT}.capacity.requests",
     "must be a map of capacity name to quantity"),
]


@pytest.mark.parametrize(("case", "capacity", "field", "rule"), REFUSED,
                         ids=[r[0] for r in REFUSED])
def test_refused_naming_the_field_and_the_rule(case: str, capacity: dict[str, Any], field: str,
                                               rule: str) -> None:
    got_field, got_rule = refusal(claim(request(capacity=capacity)))
    assert got_field == field, case
    assert rule in got_rule, (case, got_rule)
    # the same in a template, one level down
    got_field, got_rule = refusal(template(claim(request(capacity=capacity))),
                                  claimrules.TEMPLATE)
    assert got_field == "spec." + field and rule in got_rule, case


def test_every_bad_request_is_named_at_once_and_subrequests_by_their_path() -> None:
    c = claim(request("a", capacity=cap(memory="4.5Gi", cores="12")),
              {"name": "b", "firstAvailable": [
                  {"name": "x", "deviceClassName": "other.example.com",
                   "capacity": cap(memory="1.5Gi")},
                  {"name": "y", "deviceClassName": CLS, "selectors": SHAREABLE,
                   "capacity": cap(memory="2Gi", cores="7")}]},
              constraints=[{"requests": ["a", "b"], "distinctAttribute": f"{CLS}/uuid"}])
    v = check_claim(c)
    assert [e.field for e in v.refusals] == [
        MEM, CORES, "spec.devices.requests[1].firstAvailable[1].capacity.requests.cores"]
    assert v.message == "; ".join(str(e) for e in v.refusals)
    assert "7 would consume 10" in v.message


def test_two_requests_of_the_class_must_be_kept_on_distinct_gpus() -> None:
    """First fit gives each request the first GPU that fits, so two small requests share one,
    and the kubelet plugin refuses a GPU twice in one claim: refused at admission."""
    two = [request("a", capacity=cap(memory="2Gi")), request("b", capacity=cap(memory="4Gi"))]
    field, rule = refusal(claim(*two))
    assert field == "spec.devices.constraints"
    assert rule == (f"requests [a, b] of DeviceClass {CLS} in one claim must be kept on "
                    "distinct GPUs: add constraints: [{requests: [a, b], distinctAttribute: "
                    f"{CLS}/uuid}}] (the allocator gives each request the first GPU that fits, "
                    "and a GPU twice in one claim cannot be prepared)")
    # a constraint on one of them only, or on another attribute, or matchAttribute: still
    for constraints in ([{"requests": ["a"], "distinctAttribute": f"{CLS}/uuid"}],
                        [{"requests": ["a", "b"], "distinctAttribute": f"{CLS}/model"}],
                        [{"requests": ["a", "b"], "matchAttribute": f"{CLS}/uuid"}]):
        assert not check_claim(claim(*two, constraints=constraints)).allowed, constraints
    # three requests, two constraints that leave a and c free to meet
    three = [*two, request("c", capacity=cap(memory="1Gi"))]
    pairs = [{"requests": ["a", "b"], "distinctAttribute": f"{CLS}/uuid"},
             {"requests": ["b", "c"], "distinctAttribute": f"{CLS}/uuid"}]
    assert "[a, c]" in check_claim(claim(*three, constraints=pairs)).message
    ok = [{"requests": ["a", "b", "c"], "distinctAttribute": f"{CLS}/uuid"}]
    assert check_claim(claim(*three, constraints=ok)).allowed
    # a firstAvailable request counts as one request of the class; naming it covers its subs
    fa = {"name": "f", "firstAvailable": [{"name": "s", "deviceClassName": CLS,
                                           "selectors": SHAREABLE}]}
    assert not check_claim(claim(two[0], fa)).allowed
    assert check_claim(claim(two[0], fa, constraints=[
        {"requests": ["a", "f"], "distinctAttribute": f"{CLS}/uuid"}])).allowed


def test_malformed_structures_are_refused_not_passed() -> None:
    assert refusal({"spec": []}) == ("spec", "must be an object")
    assert refusal({"spec": {"devices": "gpu"}}) == ("spec.devices", "must be an object")
    assert refusal({"spec": {"devices": {"requests": {"gpu": 1}}}}) == (
        "spec.devices.requests", "must be a list")
    assert refusal({"spec": {"devices": {"requests": ["gpu"]}}}) == (
        "spec.devices.requests[0]", "must be an object")
    assert refusal({"spec": {"spec": 3}}, claimrules.TEMPLATE) == ("spec.spec",
                                                                   "must be an object")
    assert refusal(claim({"name": "g", "exactly": "gpu"})) == (
        "spec.devices.requests[0].exactly", "must be an object")
    assert refusal(claim({"name": "g", "firstAvailable": {}})) == (
        "spec.devices.requests[0].firstAvailable", "must be a list")
    for count in (0, -1, "2", True):
        assert refusal(claim(request(count=count))) == (
            f"{AT}.count", "must be a positive whole number of GPUs"), count
    assert refusal(claim(request(capacity=["memory"]))) == (f"{AT}.capacity",
                                                            "must be an object")


# ------------------------------------------------------------------ warnings: admitted


def test_what_works_is_admitted_with_a_warning() -> None:
    # count 2 without distinctAttribute: kube-scheduler 1.37 gives 2 distinct GPUs anyway
    v = check_claim(claim(request(count=2, capacity=cap(memory="4Gi"))))
    assert v.allowed
    assert v.warnings == (
        f"{AT}.count=2: add constraints: [{{requests: [gpu], distinctAttribute: {CLS}/uuid}}] "
        "to be sure of 2 distinct GPUs (kube-scheduler 1.37 gives them; the API does not "
        "promise it)",)
    # a capacity request without the shareable selector may take a whole exclusive GPU
    bare = request(capacity=cap(memory="4Gi"))
    del bare["exactly"]["selectors"]
    v = check_claim(claim(bare))
    assert v.allowed and len(v.warnings) == 1
    assert v.warnings[0].startswith(f"{AT}.selectors: without {{cel: {{expression: "
                                    "'device.allowMultipleAllocations == true'}}")
    assert "whole GPU of an exclusive node" in v.warnings[0]
    # allocationMode All: a share of every GPU of the node
    every = request(allocationMode="All", capacity=cap(memory="2Gi"))
    del every["exactly"]["count"]
    v = check_claim(claim(every))
    assert v.allowed and v.warnings == (
        f"{AT}.allocationMode='All': takes a share of every GPU of DeviceClass {CLS} on the "
        "node, and a node where one GPU lacks the room does not fit; sharegpu's extender does "
        "not rank it",)
    # tolerating sharegpu's own taints
    tol = request(capacity=cap(memory="2Gi"), tolerations=[
        {"key": f"{CLS}/unhealthy", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "other.example.com/x", "operator": "Exists"}])
    v = check_claim(claim(tol))
    assert v.allowed and v.warnings == (
        f"{AT}.tolerations[0]: lets the claim onto a GPU with a critical XID",)
    everything = request(tolerations=[{"operator": "Exists"}])
    assert len(check_claim(claim(everything)).warnings) == 2
    # every warning fits what the API server shows in full (256 characters)
    for w in (*check_claim(claim(request(count=12, capacity=cap(memory="4Gi")))).warnings,
              *check_claim(claim(everything)).warnings, *v.warnings):
        assert len(w) <= 256, w


# ------------------------------------------------------------------ the webhook


def admission(obj: dict[str, Any], kind: str = "ResourceClaim", operation: str = "CREATE",
              version: str = "v1") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "rc-1", "kind": {"group": "resource.k8s.io", "version": version,
                                                "kind": kind},
                        "resource": {"group": "resource.k8s.io", "version": version,
                                     "resource": kind.lower() + "s"},
                        "operation": operation, "namespace": "team-a", "object": obj}}


def test_review_refuses_and_warns_only_in_dra_mode() -> None:
    bad = claim(request(capacity=cap(memory="4.5Gi")))
    out = review(admission(bad), None, Pool())["response"]
    assert out["allowed"] is False and out["uid"] == "rc-1"
    assert out["status"] == {"code": 422, "reason": "Invalid", "message": (
        f"{MEM}='4.5Gi': must be a whole number of GiB: {STEP}, so 4.5Gi would consume 5Gi; "
        "ask for 4Gi or 5Gi")}
    out = review(admission(template(bad), "ResourceClaimTemplate"), None, Pool())["response"]
    assert out["allowed"] is False and out["status"]["message"].startswith(
        f"spec.{MEM}='4.5Gi': must be a whole number of GiB")
    warned = claim(request(count=2, capacity=cap(memory="4Gi")))
    out = review(admission(warned), None, Pool())["response"]
    assert out["allowed"] is True and len(out["warnings"]) == 1
    assert review(admission(claim(request())), None, Pool())["response"] == {
        "uid": "rc-1", "allowed": True}
    # without DRA mode the webhook has no DeviceClass to look after: not its business
    assert review(admission(bad))["response"] == {"uid": "rc-1", "allowed": True}
    # claims are immutable: only CREATE is read; another group's kind of that name neither
    assert review(admission(bad, operation="UPDATE"), None, Pool())["response"]["allowed"]
    other = admission(bad)
    other["request"]["kind"]["group"] = "example.com"
    assert review(other, None, Pool())["response"]["allowed"]
    # the webhook's DeviceClass is the pool's (--dra-device-class)
    mine = Pool(device_class="gpu.example.com")
    assert review(admission(bad), None, mine)["response"]["allowed"]


def test_http_validate_claims_and_fail_closed() -> None:
    async def go() -> None:
        async with TestClient(TestServer(app(None, Pool()))) as client:
            async def post(body: Any) -> tuple[int, Any]:
                r = await client.post("/validate", json=body)
                return r.status, await r.json()

            status, body = await post(admission(claim(request(capacity=cap(cores="12")))))
            assert status == 200 and body["kind"] == "AdmissionReview"
            resp = body["response"]
            assert resp["allowed"] is False and resp["status"]["code"] == 422
            assert resp["status"]["message"] == f"{CORES}='12': {CORE_RULE}12 would consume 15)"
            status, body = await post(admission(template(claim(request(
                capacity=cap(memory="8Gi", cores="40")))), "ResourceClaimTemplate"))
            assert status == 200 and body["response"] == {"uid": "rc-1", "allowed": True}
            # a review of these kinds that cannot be read: HTTP 400, as for pods
            for broken in (admission("not a claim"), admission(None, "ResourceClaimTemplate"),
                           admission(claim(request()), version="v1beta2")):
                status, body = await post(broken)
                assert status == 400, broken
                assert body["error"].startswith(("request.object", "request.kind.version"))
            status, body = await post(admission(claim(request()), version="v1beta2"))
            assert body["error"] == ("request.kind.version='v1beta2': must be v1: the webhook "
                                     "reads resource.k8s.io/v1 ResourceClaims")
            # a claim nested deep: an answer, not a crash
            deep: Any = {}
            for _ in range(5000):
                deep = {"x": deep}
            c = claim(request(capacity=cap(memory="1Gi")))
            c["spec"]["devices"]["config"] = [deep]
            r = await client.post("/validate", data=_dumps_deep(admission(c)),
                                  headers={"Content-Type": "application/json"})
            assert r.status in (200, 400)

    asyncio.run(go())


def _dumps_deep(obj: Any) -> bytes:
    import json
    import sys

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)
    try:
        return json.dumps(obj).encode()
    finally:
        sys.setrecursionlimit(old)
