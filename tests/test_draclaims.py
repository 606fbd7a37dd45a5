"""DRA item 3: ACK's pod spec turned into ResourceClaims by the mutating webhook.

The translation (sharegpu.dra.draclaims, pure), its JSON patch applied to the pod, the templates
checked against the 1.37 schema, and the webhook over HTTPS as kube-apiserver calls it
(AdmissionReview in, base64 JSONPatch out), with an in-memory template store.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kubernetes_validate
import pytest
from aiohttp import web

from sharegpu.core.errors import ValidationError
from sharegpu.dra import draclaims
from sharegpu.dra.draclaims import Pool, Shape, apply_patch, translate
from sharegpu.webhook import TemplateApiError, app, mutate, review
from sharegpu_testing import kobjects
from sharegpu_testing.tls import make_certificates

POOL = Pool()
DRA_SELECTOR = {"sharegpu.io/dra": "true"}


def dra_pod(name: str = "p", *, selector: Mapping[str, str] | None = DRA_SELECTOR,
            namespace: str = "team-a", **kw: Any) -> dict[str, Any]:
    pod = kobjects.pod(name, namespace=namespace, scheduler="default-scheduler", **kw)
    if selector is not None:
        pod["spec"]["nodeSelector"] = dict(selector)
    return pod


def admission(pod: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "operation": "CREATE", "namespace": pod["metadata"]["namespace"],
                        "object": pod, "dryRun": dry_run}}


class MemoryTemplates:
    def __init__(self) -> None:
        self.items: dict[tuple[str, str], dict[str, Any]] = {}
        self.creates = 0
        self.fail: Exception | None = None

    async def ensure(self, template: Mapping[str, Any]) -> None:
        if self.fail:
            raise self.fail
        key = (template["metadata"]["namespace"], template["metadata"]["name"])
        if key in self.items:
            if not draclaims.same_template(self.items[key], template):
                raise ValidationError(f"ResourceClaimTemplate {key[0]}/{key[1]}", "spec",
                                      "exists with another spec")
            return
        self.creates += 1
        self.items[key] = json.loads(json.dumps(template))


# ------------------------------------------------------------------ translation


def test_shared_pod_becomes_one_claim_per_container() -> None:
    pod = dra_pod(mem=4)
    tr = translate(pod, POOL)
    assert tr is not None
    assert tr.claims == {"sharegpu-c0": "sharegpu-4gi"}
    (t,) = tr.templates
    assert t["metadata"] == {"name": "sharegpu-4gi", "namespace": "team-a",
                             "labels": {"app.kubernetes.io/managed-by": "sharegpu-webhook"}}
    assert t["spec"] == {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.sharegpu.io",
        "selectors": [{"cel": {"expression": "device.allowMultipleAllocations == true"}}],
        "allocationMode": "ExactCount", "count": 1,
        "capacity": {"requests": {"memory": "4Gi"}}}}]}}}
    out = apply_patch(pod, tr.patch)
    c = out["spec"]["containers"][0]
    assert c["resources"] == {"limits": {}, "claims": [{"name": "sharegpu-c0"}]}
    assert out["spec"]["resourceClaims"] == [
        {"name": "sharegpu-c0", "resourceClaimTemplateName": "sharegpu-4gi"}]
    assert json.loads(out["metadata"]["annotations"][draclaims.ANNOTATION]) == tr.claims
    # nothing else of the pod changed
    rest = {k: v for k, v in out["spec"].items() if k not in ("containers", "resourceClaims")}
    assert rest == {k: v for k, v in pod["spec"].items() if k != "containers"}
    kubernetes_validate.validate(t, "1.37.0", strict=True)
    kubernetes_validate.validate(out, "1.37.0", strict=True)


def test_cores_and_gpu_count_with_distinct_uuids() -> None:
    pod = dra_pod(mem=8, core=60, gpu_count=2)  # 8 GiB and 60 % over 2 GPUs: 4 GiB and 30 % each
    pod["spec"]["containers"][0]["resources"]["requests"] = dict(
        pod["spec"]["containers"][0]["resources"]["limits"])  # as the API server defaults it
    tr = translate(pod, POOL)
    assert tr is not None and tr.claims == {"sharegpu-c0": "sharegpu-4gi-30pct-x2"}
    (t,) = tr.templates
    devices = t["spec"]["spec"]["devices"]
    assert devices["requests"][0]["exactly"]["count"] == 2
    assert devices["requests"][0]["exactly"]["capacity"] == {
        "requests": {"memory": "4Gi", "cores": "30"}}
    assert devices["constraints"] == [{"requests": ["gpu"],
                                       "distinctAttribute": "gpu.sharegpu.io/uuid"}]
    out = apply_patch(pod, tr.patch)
    assert out["spec"]["containers"][0]["resources"] == {
        "limits": {}, "requests": {}, "claims": [{"name": "sharegpu-c0"}]}
    kubernetes_validate.validate(t, "1.37.0", strict=True)


def test_another_driver_name_keeps_its_own_attribute_distinct() -> None:
    """With ``agent.dra.driver`` renamed, the slices' attributes are qualified by that name:
    the template's constraint must name it (a constraint on an attribute no device has keeps
    the claim from ever being allocated), and the claim rules accept it."""
    from sharegpu.dra import claimrules

    pool = Pool(POOL.key, POOL.value, "gpu.example.com")
    tr = translate(dra_pod(mem=8, gpu_count=2), pool)
    assert tr is not None
    (t,) = tr.templates
    assert t["spec"]["spec"]["devices"]["constraints"] == [
        {"requests": ["gpu"], "distinctAttribute": "gpu.example.com/uuid"}]
    verdict = claimrules.check_template(t, "gpu.example.com")
    assert verdict.refusals == () and not any("distinct" in w for w in verdict.warnings)
    # the default driver's attribute is not one of this driver's devices
    assert any("distinct" in w for w in claimrules.check_template(
        {**t, "spec": {"spec": {**t["spec"]["spec"], "devices": {
            **t["spec"]["spec"]["devices"], "constraints": [
                {"requests": ["gpu"], "distinctAttribute": "gpu.sharegpu.io/uuid"}]}}}},
        "gpu.example.com").warnings)


def test_two_gpu_containers_and_the_pods_own_claims_pass_through() -> None:
    pod = dra_pod(containers=[{"aliyun.com/gpu-mem": "3"}, {}, {"aliyun.com/gpu-mem": "3"}])
    own = {"name": "mine", "resourceClaimName": "nic-claim"}
    pod["spec"]["resourceClaims"] = [own]
    pod["spec"]["containers"][1]["resources"]["claims"] = [{"name": "mine"}]
    pod["metadata"]["annotations"] = {"keep": "me"}
    tr = translate(pod, POOL)
    assert tr is not None
    assert tr.claims == {"sharegpu-c0": "sharegpu-3gi", "sharegpu-c2": "sharegpu-3gi"}
    assert len(tr.templates) == 1  # one template per shape
    out = apply_patch(pod, tr.patch)
    assert out["spec"]["resourceClaims"] == [
        own, {"name": "sharegpu-c0", "resourceClaimTemplateName": "sharegpu-3gi"},
        {"name": "sharegpu-c2", "resourceClaimTemplateName": "sharegpu-3gi"}]
    assert out["spec"]["containers"][1]["resources"]["claims"] == [{"name": "mine"}]
    assert out["spec"]["containers"][2]["resources"]["claims"] == [{"name": "sharegpu-c2"}]
    assert out["metadata"]["annotations"]["keep"] == "me"
    # a pod with only its own claims is not touched at all
    pod2 = dra_pod()
    pod2["spec"]["resourceClaims"] = [own]
    assert translate(pod2, POOL) is None


def test_pods_not_bound_for_the_pool_are_left_alone() -> None:
    assert translate(dra_pod(mem=4, selector=None), POOL) is None
    assert translate(dra_pod(mem=4, selector={"sharegpu.io/dra": "false"}), POOL) is None
    # the pool named by required node affinity, in every term
    pod = dra_pod(mem=4, selector=None)
    term = {"matchExpressions": [{"key": "sharegpu.io/dra", "operator": "In",
                                  "values": ["true"]}]}
    pod["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term, term]}}}
    assert translate(pod, POOL) is not None


@pytest.mark.parametrize("case,change,field,rule", [
    ("mem not whole", {"mem": "1.5"}, 'spec.containers[0].resources.limits["aliyun.com/gpu-mem"]',
     "must be a whole number of GiB, at least 1"),
    ("cores off step", {"mem": 4, "core": 33},
     'spec.containers[0].resources.limits["aliyun.com/gpu-core.percentage"]',
     "must be a multiple of 5 between 5 and 100"),
    ("count does not divide", {"mem": 5, "gpu_count": 2},
     'spec.containers[0].resources.limits["aliyun.com/gpu-mem"]', "must be divisible"),
    ("whole cards", {"cards": 1}, 'spec.containers[0].resources.limits["nvidia.com/gpu"]',
     "is not translated on the DRA pool"),
    ("node name", {"mem": 4, "node_name": "gpu-node-1"}, "spec.nodeName",
     "must be placed by kube-scheduler"),
])
def test_bad_dra_pods_refused_naming_field_and_rule(case: str, change: dict[str, Any],
                                                     field: str, rule: str) -> None:
    with pytest.raises(ValidationError) as e:
        translate(dra_pod(**change), POOL)
    assert e.value.field == field, case
    assert rule in str(e.value)


def test_ambiguous_pool_choice_refused() -> None:
    pod = dra_pod(mem=4, selector=None)
    pool_term = {"matchExpressions": [{"key": "sharegpu.io/dra", "operator": "In",
                                       "values": ["true"]}]}
    other = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    pod["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [pool_term, other]}}}
    with pytest.raises(ValidationError) as e:
        translate(pod, POOL)
    assert e.value.field.endswith("nodeSelectorTerms[1]")
    assert "every required nodeSelectorTerm, or in none" in str(e.value)
    pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"] = [{"matchExpressions": [{"key": "sharegpu.io/dra",
                                                       "operator": "In",
                                                       "values": ["true", "false"]}]}]
    with pytest.raises(ValidationError) as e:
        translate(pod, POOL)
    assert e.value.field.endswith("nodeSelectorTerms[0].matchExpressions[0]")
    # a claim name the webhook needs, taken by the pod
    pod = dra_pod(mem=4)
    pod["spec"]["resourceClaims"] = [{"name": "sharegpu-c0", "resourceClaimName": "x"}]
    with pytest.raises(ValidationError) as e:
        translate(pod, POOL)
    assert e.value.field == "spec.resourceClaims[0].name"


def test_template_names_are_deterministic_per_shape() -> None:
    assert Shape(4).template_name == "sharegpu-4gi"
    assert Shape(4, 30).template_name == "sharegpu-4gi-30pct"
    assert Shape(80, 100, 8).template_name == "sharegpu-80gi-100pct-x8"
    a = translate(dra_pod("a", mem=6, core=50), POOL)
    b = translate(dra_pod("b", mem=6, core=50), POOL)
    assert a is not None and b is not None and a.templates == b.templates
    # as the API server writes it back (an empty spec.metadata): the same template
    (t,) = a.templates
    assert draclaims.same_template({"spec": {"metadata": {}, **t["spec"]}}, t)
    assert not draclaims.same_template({"spec": {"metadata": {"labels": {"x": "y"}},
                                                 **t["spec"]}}, t)


def test_validating_webhook_on_dra_pods() -> None:
    # translated (no extended resources; the gpu-count label is only a note): allowed by the
    # validating webhook whatever the scheduler; untranslated: refused
    pod = dra_pod(mem=8, gpu_count=2)
    tr = translate(pod, POOL)
    assert tr is not None
    out = apply_patch(pod, tr.patch)
    schedulers = frozenset({"ack-co-scheduler"})
    assert review(admission(out), schedulers, POOL)["response"]["allowed"] is True
    r = review(admission(pod), schedulers, POOL)["response"]
    assert r["allowed"] is False
    assert "sharegpu mutating webhook" in r["status"]["message"]
    # without DRA mode the old rules stand
    assert review(admission(out), schedulers)["response"]["allowed"] is False


# ------------------------------------------------------------------ the webhook


def test_mutate_creates_templates_once_and_answers_a_patch() -> None:
    store = MemoryTemplates()

    async def go() -> None:
        first = await mutate(admission(dra_pod("a", mem=4, core=20)), POOL, store)
        again = await mutate(admission(dra_pod("b", mem=4, core=20)), POOL, store)
        assert first["response"]["patchType"] == "JSONPatch"
        assert first["response"]["patch"] == again["response"]["patch"]
        assert store.creates == 1
        # a dry run creates nothing
        await mutate(admission(dra_pod("c", mem=2), dry_run=True), POOL, store)
        assert store.creates == 1
        # a template of the same name with another spec: refused naming it
        t = store.items[("team-a", "sharegpu-4gi-20pct")]
        t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = 3
        bad = await mutate(admission(dra_pod("d", mem=4, core=20)), POOL, store)
        assert bad["response"]["allowed"] is False
        assert "ResourceClaimTemplate team-a/sharegpu-4gi-20pct" in bad["response"]["status"][
            "message"]
        store.fail = TemplateApiError("connection refused")
        down = await mutate(admission(dra_pod("e", mem=5)), POOL, store)
        assert down["response"]["allowed"] is False
        assert down["response"]["status"]["code"] == 500
        # not a DRA pod, or no DRA mode: allowed, no patch, no API call
        plain = await mutate(admission(dra_pod("f", mem=5, selector=None)), POOL, store)
        assert plain["response"] == {"uid": "u-1", "allowed": True}
        off = await mutate(admission(dra_pod("g", mem=5)), None, None)
        assert off["response"] == {"uid": "u-1", "allowed": True}

    asyncio.run(go())


def test_webhook_over_https_as_the_api_server_calls_it(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path, hosts=("127.0.0.1",))
    store = MemoryTemplates()

    async def go() -> None:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(str(certs.cert), str(certs.key))
        runner = web.AppRunner(app(frozenset({"ack-co-scheduler"}), POOL, store))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client_ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
        url = f"https://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                pod = dra_pod(mem=12, core=120, gpu_count=3)  # 4 GiB and 40 % on each of 3
                async with s.post(f"{url}/mutate", json=admission(pod), ssl=client_ctx) as r:
                    assert r.status == 200
                    body = await r.json()
                resp = body["response"]
                assert resp["allowed"] is True and resp["uid"] == "u-1"
                patch = json.loads(base64.b64decode(resp["patch"]))
                out = apply_patch(pod, patch)
                assert out["spec"]["resourceClaims"] == [{
                    "name": "sharegpu-c0",
                    "resourceClaimTemplateName": "sharegpu-4gi-40pct-x3"}]
                assert ("team-a", "sharegpu-4gi-40pct-x3") in store.items
                # the mutated pod passes the validating webhook of the same process
                async with s.post(f"{url}/validate", json=admission(out), ssl=client_ctx) as r:
                    assert (await r.json())["response"]["allowed"] is True
                bad = dra_pod(mem=4, core=7)
                async with s.post(f"{url}/mutate", json=admission(bad), ssl=client_ctx) as r:
                    resp = (await r.json())["response"]
                assert resp["allowed"] is False and resp["status"]["code"] == 422
                assert resp["status"]["message"].startswith(
                    'spec.containers[0].resources.limits["aliyun.com/gpu-core.percentage"]')
                async with s.post(f"{url}/mutate", data=b"{nope", ssl=client_ctx) as r:
                    assert r.status == 400  # fail closed
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_a_translated_gpu_count_pod_is_read_as_a_claim_pod_everywhere() -> None:
    """Found end to end (tests/e2e/test_dra_end_to_end_real.py): the webhook keeps the
    ``aliyun.com/gpu-count`` label on a pod it translated, and every reader of ACK's pod spec
    (the extender's filter, inspect) refused it for that label
    ("needs a container that asks for aliyun.com/gpu-mem"), so the extender filtered every
    gpu-count 2 DRA pod out of every node. The webhook's annotation makes the label a note."""
    from sharegpu.core.podreader import PlacementReader
    from sharegpu.core.request import RULE_COUNT_NEEDS_MEM, Kind, parse_pod

    pod = dra_pod(mem=8, gpu_count=2)
    tr = translate(pod, POOL)
    assert tr is not None
    out = apply_patch(pod, tr.patch)
    assert out["metadata"]["labels"]["aliyun.com/gpu-count"] == "2"
    assert draclaims.ANNOTATION in out["metadata"]["annotations"]
    req = parse_pod(out)
    assert req.kind is Kind.NONE and not req.wants_gpu
    reader = PlacementReader()
    assert reader.request(out).kind is Kind.NONE
    # the same pod without the webhook's note is still refused, also through the reader's
    # cache of pod shapes (the note is part of its key)
    bare = json.loads(json.dumps(out))
    del bare["metadata"]["annotations"][draclaims.ANNOTATION]
    with pytest.raises(ValidationError) as e:
        parse_pod(bare)
    assert RULE_COUNT_NEEDS_MEM in str(e.value)
    with pytest.raises(ValidationError):
        reader.request(bare)
    # a pod that still asks for gpu-mem keeps every rule, with or without the note
    half = dra_pod(mem=5, gpu_count=2)
    half["metadata"]["annotations"] = {draclaims.ANNOTATION: "{}"}
    with pytest.raises(ValidationError):
        parse_pod(half)
