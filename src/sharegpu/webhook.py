"""The validating admission webhook: GPU requests that break a SPEC §2 rule are refused at
submission, with the message of :func:`sharegpu.request.parse_pod` (one set of rules for the
webhook, the extender and the simulator).

POST ``/validate`` takes an ``admission.k8s.io/v1`` AdmissionReview and answers one. It fails
closed: the sample configuration uses ``failurePolicy: Fail``, and a review this service cannot
read gets HTTP 400, which the API server treats as a refusal.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from .errors import ValidationError
from .request import parse_pod

log = logging.getLogger(__name__)

API_VERSION = "admission.k8s.io/v1"


def parse_review(body: Any) -> Mapping[str, Any]:
    """The ``request`` of an AdmissionReview; ValidationError naming the field otherwise."""
    if not isinstance(body, Mapping):
        raise ValidationError("body", type(body).__name__, "must be a JSON AdmissionReview")
    if body.get("kind") != "AdmissionReview":
        raise ValidationError("kind", body.get("kind"), "must be AdmissionReview")
    if body.get("apiVersion") not in (API_VERSION, "admission.k8s.io/v1beta1"):
        raise ValidationError("apiVersion", body.get("apiVersion"), f"must be {API_VERSION}")
    req = body.get("request")
    if not isinstance(req, Mapping):
        raise ValidationError("request", req, "must be an object")
    if not isinstance(req.get("uid"), str) or not req["uid"]:
        raise ValidationError("request.uid", req.get("uid"), "must be a non-empty string")
    return req


def review(body: Any) -> dict[str, Any]:
    """The AdmissionReview answer for a review (raises ValidationError on a malformed one)."""
    req = parse_review(body)
    kind = (req.get("kind") or {}).get("kind", "Pod")
    operation = req.get("operation", "CREATE")
    allowed, message = True, ""
    if kind == "Pod" and operation == "CREATE":
        pod = req.get("object")
        if not isinstance(pod, Mapping):
            raise ValidationError("request.object", pod, "must be a Pod object")
        pod = dict(pod)
        meta = dict(pod.get("metadata") or {})
        meta.setdefault("namespace", req.get("namespace") or "default")
        pod["metadata"] = meta
        try:
            parse_pod(pod)
        except ValidationError as e:
            allowed, message = False, str(e)
    response: dict[str, Any] = {"uid": req["uid"], "allowed": allowed}
    if not allowed:
        response["status"] = {"code": 422, "reason": "Invalid", "message": message}
    return {"apiVersion": body.get("apiVersion", API_VERSION), "kind": "AdmissionReview",
            "response": response}


async def _validate(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError as e:
        return web.json_response({"error": f"body: must be JSON ({e})"}, status=400)
    try:
        out = review(body)
    except ValidationError as e:
        return web.json_response({"error": str(e)}, status=400)
    if not out["response"]["allowed"]:
        log.info("refused %s: %s", (body.get("request") or {}).get("name", ""),
                 out["response"]["status"]["message"])
    return web.Response(text=json.dumps(out), content_type="application/json")


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def app() -> web.Application:
    a = web.Application(client_max_size=16 * 1024 * 1024)
    a.router.add_post("/validate", _validate)
    a.router.add_get("/healthz", _healthz)
    return a
