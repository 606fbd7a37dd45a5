"""The validating admission webhook: GPU requests that break a SPEC §2 rule are refused at
submission, with the message of :func:`sharegpu.request.parse_pod` (one set of rules for the
webhook, the extender and the simulator); ResourcePolicies (created or updated) that break a rule
of :func:`sharegpu.resourcepolicy.parse_policy` are refused with its message.

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

from . import names
from .errors import ValidationError
from .request import Kind, parse_pod
from .resourcepolicy import KIND as POLICY_KIND
from .resourcepolicy import parse_policy

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


def scheduler_problem(pod: Mapping[str, Any], kind: Kind,
                      schedulers: frozenset[str] | None) -> str | None:
    """Why a GPU-sharing pod would be placed wrongly: its scheduler does not run the sharegpu
    extender (the default scheduler alone places shared requests by count, and the agent then
    cannot hand the container a GPU). Whole cards (``nvidia.com/gpu``) need no extender."""
    if schedulers is None or kind not in (Kind.SHARED, Kind.SHARED_CORE, Kind.TOPOLOGY):
        return None
    spec = pod.get("spec") or {}
    name = spec.get("schedulerName") or "default-scheduler"
    if name in schedulers:
        return None
    want = " or ".join(sorted(schedulers))
    return (f"spec.schedulerName={name!r}: a pod asking for {names.RES_GPU_MEM}, "
            f"{names.RES_GPU_CORE} or {names.RES_TOPOLOGY_GPU} must be scheduled by a scheduler "
            f"that runs the sharegpu extender: set schedulerName: {want}")


def review(body: Any, schedulers: frozenset[str] | None = None) -> dict[str, Any]:
    """The AdmissionReview answer for a review (raises ValidationError on a malformed one).
    ``schedulers``: the schedulerNames that run the extender (``None``: not checked)."""
    req = parse_review(body)
    gvk = req.get("kind") or {}
    if not isinstance(gvk, Mapping):
        raise ValidationError("request.kind", type(gvk).__name__,
                              "must be an object (group, version, kind)")
    kind = gvk.get("kind", "Pod")
    operation = req.get("operation", "CREATE")
    if not isinstance(kind, str) or not isinstance(operation, str):
        raise ValidationError("request.kind.kind/request.operation", "",
                              "must be strings")
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
            request = parse_pod(pod)
        except ValidationError as e:
            allowed, message = False, str(e)
        else:
            problem = scheduler_problem(pod, request.kind, schedulers)
            if problem is not None:
                allowed, message = False, problem
    elif kind == POLICY_KIND and operation in ("CREATE", "UPDATE"):
        obj = req.get("object")
        if not isinstance(obj, Mapping):
            raise ValidationError("request.object", obj, "must be a ResourcePolicy object")
        obj = dict(obj)
        meta = dict(obj.get("metadata") or {}) if isinstance(obj.get("metadata"), Mapping) else {}
        meta.setdefault("namespace", req.get("namespace") or "default")
        obj["metadata"] = meta
        try:
            parse_policy(obj)
        except ValidationError as e:
            allowed, message = False, f"ResourcePolicy refused: {e}"
    response: dict[str, Any] = {"uid": req["uid"], "allowed": allowed}
    if not allowed:
        response["status"] = {"code": 422, "reason": "Invalid", "message": message}
    return {"apiVersion": body.get("apiVersion", API_VERSION), "kind": "AdmissionReview",
            "response": response}


async def _validate(request: web.Request) -> web.Response:
    try:
        raw = await request.read()
        body = json.loads(raw)
    except RecursionError:
        return web.json_response({"error": "body: JSON nested too deeply"}, status=400)
    except (ValueError, UnicodeDecodeError) as e:
        return web.json_response({"error": f"body: must be JSON ({e})"}, status=400)
    try:
        out = review(body, request.app.get(SCHEDULERS))
    except ValidationError as e:
        return web.json_response({"error": str(e)}, status=400)
    except RecursionError:
        return web.json_response({"error": "request.object: nested too deeply"}, status=400)
    if not out["response"]["allowed"]:
        req = body.get("request") or {}
        obj = req.get("object") if isinstance(req.get("object"), dict) else {}
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        name = req.get("name") or meta.get("name") or f"{meta.get('generateName') or ''}*"
        user = (req.get("userInfo") or {}).get("username", "") if isinstance(
            req.get("userInfo"), dict) else ""
        what = "ResourcePolicy" if (req.get("kind") or {}).get("kind") == POLICY_KIND else "pod"
        log.info("refused %s %s/%s%s: %s", what, req.get("namespace") or meta.get("namespace", ""),
                 name, f" (from {user})" if user else "", out["response"]["status"]["message"])
    return web.Response(text=json.dumps(out), content_type="application/json")


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


SCHEDULERS: web.AppKey[frozenset[str] | None] = web.AppKey("schedulers")


def app(schedulers: frozenset[str] | None = None) -> web.Application:
    """``schedulers``: the schedulerNames that run the extender; a GPU-sharing pod naming
    another is refused (``None``: not checked)."""
    a = web.Application(client_max_size=16 * 1024 * 1024)
    a[SCHEDULERS] = schedulers
    a.router.add_post("/validate", _validate)
    a.router.add_get("/healthz", _healthz)
    return a
