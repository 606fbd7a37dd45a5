"""Seeded, bounded fuzzing of the entry points that read objects a client controls: whatever
the shape, the answer is a value or a refusal naming the field (ValidationError, HTTP 400) —
never another exception, a traceback or a 5xx — and the server keeps answering."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu import kobjects
from sharegpu.errors import ValidationError
from sharegpu.request import parse_pod
from sharegpu.webhook import review

KEYS = st.sampled_from(["metadata", "spec", "containers", "initContainers", "resources",
                        "limits", "requests", "name", "namespace", "labels", "uid",
                        "aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage",
                        "aliyun.com/gpu-count", "nvidia.com/gpu", "kind", "object",
                        "operation", "request", "apiVersion", "env", "value"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30),
                    st.floats(allow_nan=True), st.text(max_size=12),
                    st.sampled_from(["4", "²", "٤", "4Gi", "500m", "1e3", "-1", "30"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=5)), max_leaves=25)


def mutated_pod(draw_path: list, value: object) -> dict:
    pod = kobjects.pod("p", mem=4, core=30, gpu_count=2)
    obj: object = pod
    for k in draw_path[:-1]:
        obj = obj[k] if isinstance(obj, dict) else obj[0]  # type: ignore[index]
    if isinstance(obj, dict):
        obj[draw_path[-1]] = value
    return pod


PATHS = st.sampled_from([
    ["metadata"], ["metadata", "labels"], ["metadata", "labels", "aliyun.com/gpu-count"],
    ["metadata", "name"], ["spec"], ["spec", "containers"], ["spec", "initContainers"],
    ["spec", "containers", 0, "resources"], ["spec", "containers", 0, "name"],
    ["spec", "containers", 0, "resources", "limits"],
    ["spec", "containers", 0, "resources", "limits", "aliyun.com/gpu-mem"],
])


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(JSON, st.builds(mutated_pod, PATHS, JSON)))
def test_parse_pod_refuses_with_a_field(obj):
    try:
        parse_pod(obj)  # type: ignore[arg-type]
    except ValidationError as e:
        assert e.field and e.rule


def envelope(req: object) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    JSON,
    st.builds(envelope, JSON),
    st.builds(lambda k, op, o: envelope({"uid": "u", "kind": k, "operation": op, "object": o}),
              JSON, JSON, st.one_of(JSON, st.builds(mutated_pod, PATHS, JSON))),
))
def test_admission_review_answers_or_refuses(body):
    try:
        out = review(body)
    except ValidationError as e:
        assert e.field and e.rule
    else:
        assert out["kind"] == "AdmissionReview" and isinstance(out["response"]["allowed"], bool)
        json.dumps(out)


async def test_webhook_http_never_5xx_and_keeps_answering():
    from aiohttp.test_utils import TestClient, TestServer

    from sharegpu.webhook import app

    deep = "[" * 100000 + "]" * 100000
    good = envelope({"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE",
                     "object": kobjects.pod("ok", mem=4)})
    async with TestClient(TestServer(app())) as client:
        cases = [
            (deep.encode(), "application/json"),
            (b'{"kind": "AdmissionReview"', "application/json"),
            (json.dumps(good).encode(), "application/json; charset=bogus"),
            (b"\xff\xfe\x00garbage", "application/json"),
            (json.dumps(envelope({"uid": "u", "kind": "Pod", "object": {}})).encode(),
             "application/json"),
            (json.dumps(envelope({"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE",
                                  "object": {"spec": "x"}})).encode(), "application/json"),
        ]
        for body, ctype in cases:
            r = await client.post("/validate", data=body, headers={"Content-Type": ctype})
            assert r.status < 500, (r.status, body[:40])
            assert "Traceback" not in await r.text()
        r = await client.post("/validate", json=good)
        assert r.status == 200 and (await r.json())["response"]["allowed"] is True
