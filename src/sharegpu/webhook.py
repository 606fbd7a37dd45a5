"""The admission webhook. Validating: GPU requests that break a SPEC §2 rule are refused at
submission, with the message of :func:`sharegpu.core.request.parse_pod` (one set of rules for the
webhook, the extender and the simulator); so are shared-GPU containers that could set their own
isolation limits (:mod:`sharegpu.core.ownlimits`), in pods (created) and in the pod templates of
workloads (created, or updated with a changed template); ResourcePolicies (created or updated)
that break a rule of :func:`sharegpu.core.resourcepolicy.parse_policy` are refused with its
message. In DRA mode, ``resource.k8s.io/v1`` ResourceClaims and ResourceClaimTemplates (created)
that ask sharegpu's DeviceClass for what its GPUs cannot give (a size off the step, an unknown
capacity...) are refused with the message of :func:`sharegpu.dra.claimrules.check`, and its
warnings are answered as AdmissionReview ``warnings``.

POST ``/validate`` takes an ``admission.k8s.io/v1`` AdmissionReview and answers one. It fails
closed: the sample configuration uses ``failurePolicy: Fail``, and a review this service cannot
read gets HTTP 400, which the API server treats as a refusal.

POST ``/mutate`` (DRA mode): a pod bound for the DRA node pool that asks for
``aliyun.com/gpu-mem`` is answered with the JSON patch of :func:`sharegpu.dra.draclaims.translate`,
after the ResourceClaimTemplates it names exist in the pod's namespace (created here, once per
shape; an existing one of another content is refused). With a scheduler to set (opt-in,
docs/webhook.md): a GPU-sharing pod left to the default scheduler gets ``spec.schedulerName``
set to the scheduler that runs the extender (:func:`scheduler_patch`). Every other pod: allowed,
no patch.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from aiohttp import web

from .core import names, ownlimits
from .core.errors import ValidationError
from .core.request import Kind, parse_pod
from .core.resourcepolicy import KIND as POLICY_KIND
from .core.resourcepolicy import parse_policy
from .dra import claimrules, draclaims
from .dra.draclaims import Pool

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


DEFAULT_SCHEDULER = "default-scheduler"
NEEDS_EXTENDER = (Kind.SHARED, Kind.SHARED_CORE, Kind.TOPOLOGY)


def scheduler_patch(pod: Mapping[str, Any], scheduler: str) -> list[dict[str, Any]] | None:
    """The JSON patch that gives a GPU-sharing pod (one asking for ``aliyun.com/gpu-mem``,
    ``gpu-core.percentage`` or ``aliyun.com/gpu``) the scheduler that runs the extender, when
    it names the default one or none; ``None`` for every other pod: no GPU, whole
    ``nvidia.com/gpu`` cards, a scheduler of its own choosing, or a request that breaks a rule
    (left to the validating webhook, which refuses it naming the rule)."""
    try:
        request = parse_pod(pod, dra_note=False)
    except ValidationError:
        return None
    if request.kind not in NEEDS_EXTENDER:
        return None
    spec = pod.get("spec")
    current = spec.get("schedulerName") if isinstance(spec, Mapping) else None
    if current not in (None, "", DEFAULT_SCHEDULER) or current == scheduler:
        return None
    return [{"op": "add", "path": "/spec/schedulerName", "value": scheduler}]


def _check_pod(pod: Mapping[str, Any], schedulers: frozenset[str] | None,
               pool: Pool | None) -> tuple[bool, str]:
    try:
        if pool is not None and draclaims.bound_for_pool(pod, pool):
            problem_e = draclaims.untranslated(pod, pool)
            return (True, "") if problem_e is None else (False, str(problem_e))
        request = parse_pod(pod, dra_note=pool is not None)
    except ValidationError as e:
        return False, str(e)
    problem = scheduler_problem(pod, request.kind, schedulers)
    if problem is None:
        problem = _own_limits(pod.get("spec"), "spec")
    return (True, "") if problem is None else (False, problem)


def _own_limits(spec: Any, base: str) -> str | None:
    """The refusal of a pod spec whose shared-GPU containers could set their own limits
    (:mod:`sharegpu.core.ownlimits`), or ``None``."""
    found = ownlimits.problems(spec, base) if isinstance(spec, Mapping) else []
    if not found:
        return None
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return found[0] + more


# workloads whose pod template controllers copy into pods: (group, kind) -> the template's path
TEMPLATE_PATHS: dict[tuple[str, str], tuple[str, ...]] = {
    **{("apps", k): ("spec", "template")
       for k in ("Deployment", "ReplicaSet", "StatefulSet", "DaemonSet")},
    ("batch", "Job"): ("spec", "template"),
    ("batch", "CronJob"): ("spec", "jobTemplate", "spec", "template"),
    ("", "ReplicationController"): ("spec", "template"),
    ("", "PodTemplate"): ("template",),
}


def _template_spec(obj: Any, path: tuple[str, ...]) -> Any:
    for part in (*path, "spec"):
        obj = obj.get(part) if isinstance(obj, Mapping) else None
    return obj


def _check_template(req: Mapping[str, Any], kind: str, path: tuple[str, ...]) -> str | None:
    """A workload whose pod template (created, or changed by an update) has shared-GPU
    containers that could set their own limits: refused here, naming the template's field,
    rather than each pod its controller creates."""
    spec = _template_spec(_reviewed_object(req, kind), path)
    if req.get("operation") == "UPDATE" and spec == _template_spec(req.get("oldObject"), path):
        return None  # an unchanged template (a controller's update of an older object)
    return _own_limits(spec, ".".join((*path, "spec")))


def review(body: Any, schedulers: frozenset[str] | None = None,
           pool: Pool | None = None) -> dict[str, Any]:
    """The AdmissionReview answer for a review (raises ValidationError on a malformed one).
    ``schedulers``: the schedulerNames that run the extender (``None``: not checked).
    ``pool``: the DRA node pool; its pods were translated by ``/mutate`` and meet none of the
    device-plugin rules (``None``: no DRA mode)."""
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
    warnings: tuple[str, ...] = ()
    if kind == "Pod" and operation == "CREATE":
        allowed, message = _check_pod(_reviewed_object(req, "Pod"), schedulers, pool)
    elif (str(gvk.get("group") or ""), kind) in TEMPLATE_PATHS and \
            operation in ("CREATE", "UPDATE"):
        problem = _check_template(req, kind, TEMPLATE_PATHS[(str(gvk.get("group") or ""), kind)])
        allowed, message = problem is None, problem or ""
    elif kind == POLICY_KIND and operation in ("CREATE", "UPDATE"):
        obj = _reviewed_object(req, POLICY_KIND)  # malformed review: a 400, not a refusal
        try:
            parse_policy(obj)
        except ValidationError as e:
            allowed, message = False, f"ResourcePolicy refused: {e}"
    elif kind in claimrules.KINDS and gvk.get("group") == claimrules.GROUP and \
            operation == "CREATE" and pool is not None:
        if gvk.get("version") != claimrules.VERSION:  # read as v1 otherwise: not a pass
            raise ValidationError("request.kind.version", gvk.get("version"),
                                  f"must be {claimrules.VERSION}: the webhook reads "
                                  f"{claimrules.GROUP}/{claimrules.VERSION} {kind}s")
        verdict = claimrules.check(kind, _reviewed_object(req, kind), pool.device_class)
        allowed, message, warnings = verdict.allowed, verdict.message, verdict.warnings
    response: dict[str, Any] = {"uid": req["uid"], "allowed": allowed}
    if warnings:
        response["warnings"] = list(warnings)
    if not allowed:
        response["status"] = {"code": 422, "reason": "Invalid", "message": message}
    return {"apiVersion": body.get("apiVersion", API_VERSION), "kind": "AdmissionReview",
            "response": response}


def _reviewed_object(req: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The review's object (a copy), its namespace defaulted from the request's."""
    obj = req.get("object")
    if not isinstance(obj, Mapping):
        raise ValidationError("request.object", obj, f"must be a {kind} object")
    out = dict(obj)
    meta = dict(out.get("metadata") or {}) if isinstance(out.get("metadata"), Mapping) else {}
    meta.setdefault("namespace", req.get("namespace") or "default")
    out["metadata"] = meta
    return out


class TemplateStore(Protocol):
    """Where the ResourceClaimTemplates of the DRA translation are made to exist."""

    async def ensure(self, template: Mapping[str, Any]) -> None:
        """Create the template, or find it there with the same spec; ValidationError naming
        the template otherwise, TemplateApiError when the API server cannot be asked."""


class TemplateApiError(Exception):
    """The API server refused or could not be reached (not the pod's fault)."""


async def mutate(body: Any, pool: Pool | None, store: TemplateStore | None,
                 scheduler: str | None = None) -> dict[str, Any]:
    """The AdmissionReview answer of ``/mutate``: the DRA translation of a pod bound for the
    pool (templates first, then the patch), a refusal naming the field and the rule, the
    ``schedulerName`` of a GPU-sharing pod (with ``scheduler``), or allowed unchanged. A dry
    run creates no template."""
    req = parse_review(body)
    gvk = req.get("kind") or {}
    kind = gvk.get("kind", "Pod") if isinstance(gvk, Mapping) else None
    response: dict[str, Any] = {"uid": req["uid"], "allowed": True}
    out = {"apiVersion": body.get("apiVersion", API_VERSION), "kind": "AdmissionReview",
           "response": response}
    if kind != "Pod" or req.get("operation", "CREATE") != "CREATE" or (
            pool is None and not scheduler):
        return out
    pod = _reviewed_object(req, "Pod")
    meta = pod["metadata"]
    try:
        # the DRA pool first: a pod bound for it gets claims, and the default scheduler
        for_pool = pool is not None and draclaims.bound_for_pool(pod, pool)
        tr = draclaims.translate(pod, pool) if pool is not None and for_pool else None
        if tr is not None and store is not None and not req.get("dryRun"):
            for t in tr.templates:
                await store.ensure(t)
    except ValidationError as e:
        response["allowed"] = False
        response["status"] = {"code": 422, "reason": "Invalid", "message": str(e)}
        return out
    except TemplateApiError as e:
        response["allowed"] = False
        response["status"] = {"code": 500, "reason": "InternalError",
                              "message": f"ResourceClaimTemplate not made: {e}"}
        return out
    if tr is not None:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(tr.patch)).encode()).decode()
        log.debug("pod %s/%s on the DRA pool: claims %s", tr.namespace,
                  meta.get("name") or meta.get("generateName"), dict(tr.claims))
        return out
    patch = scheduler_patch(pod, scheduler) if scheduler and not for_pool else None
    if patch is not None:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
        log.debug("pod %s/%s: schedulerName set to %s", meta.get("namespace"),
                  meta.get("name") or meta.get("generateName"), scheduler)
    return out


class LightkubeTemplates:
    """:class:`TemplateStore` through lightkube's async client (generic resource: plain
    dicts). Needs ``create`` and ``get`` on ``resourceclaimtemplates``, nothing else."""

    def __init__(self, client: Any) -> None:
        from lightkube.generic_resource import create_namespaced_resource

        self.client = client
        self.rct = create_namespaced_resource(
            "resource.k8s.io", "v1", "ResourceClaimTemplate", "resourceclaimtemplates")

    async def ensure(self, template: Mapping[str, Any]) -> None:
        from lightkube import ApiError

        meta = template["metadata"]
        where = f"ResourceClaimTemplate {meta['namespace']}/{meta['name']}"
        try:
            await self.client.create(self.rct.from_dict(dict(template)))
            log.info("created %s", where)
            return
        except ApiError as e:
            if e.status.code != 409:
                raise TemplateApiError(f"{where}: {e.status.message or e}") from None
        except OSError as e:
            raise TemplateApiError(f"{where}: {e}") from None
        try:
            got = await self.client.get(self.rct, meta["name"], namespace=meta["namespace"])
        except (ApiError, OSError) as e:
            raise TemplateApiError(f"{where}: {e}") from None
        stored = got.to_dict() if hasattr(got, "to_dict") else dict(got)
        if not draclaims.same_template(stored, template):
            raise ValidationError(
                f"ResourceClaimTemplate {meta['namespace']}/{meta['name']}", "spec",
                "exists with another spec than sharegpu's for this request; the webhook names "
                "its templates sharegpu-<GiB>gi[-<cores>pct][-x<GPUs>]: delete or rename it")


async def _read(request: web.Request) -> Any:
    try:
        raw = await request.read()
        return json.loads(raw)
    except RecursionError:
        raise _Bad("body: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _Bad(f"body: must be JSON ({e})") from None


class _Bad(Exception):
    pass


async def _mutate(request: web.Request) -> web.Response:
    try:
        body = await _read(request)
        out = await mutate(body, request.app.get(POOL), request.app.get(STORE),
                           request.app.get(SET_SCHEDULER))
    except _Bad as e:
        return web.json_response({"error": str(e)}, status=400)
    except ValidationError as e:
        return web.json_response({"error": str(e)}, status=400)
    except RecursionError:
        return web.json_response({"error": "request.object: nested too deeply"}, status=400)
    resp = out["response"]
    if not resp["allowed"]:
        req = body.get("request") or {}
        log.info("refused DRA pod %s/%s: %s", req.get("namespace", ""), req.get("name") or "*",
                 resp["status"]["message"])
    return web.Response(text=json.dumps(out), content_type="application/json")


async def _validate(request: web.Request) -> web.Response:
    try:
        body = await _read(request)
    except _Bad as e:
        return web.json_response({"error": str(e)}, status=400)
    try:
        out = review(body, request.app.get(SCHEDULERS), request.app.get(POOL))
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
        kind = (req.get("kind") or {}).get("kind") if isinstance(req.get("kind"), dict) else None
        what = kind if kind in (POLICY_KIND, *claimrules.KINDS) else "pod"
        log.info("refused %s %s/%s%s: %s", what, req.get("namespace") or meta.get("namespace", ""),
                 name, f" (from {user})" if user else "", out["response"]["status"]["message"])
    return web.Response(text=json.dumps(out), content_type="application/json")


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


SCHEDULERS: web.AppKey[frozenset[str] | None] = web.AppKey("schedulers")
POOL: web.AppKey[Pool | None] = web.AppKey("pool")
STORE: web.AppKey[TemplateStore | None] = web.AppKey("store")
SET_SCHEDULER: web.AppKey[str | None] = web.AppKey("set_scheduler")


def app(schedulers: frozenset[str] | None = None, pool: Pool | None = None,
        store: TemplateStore | None = None, set_scheduler: str | None = None
        ) -> web.Application:
    """``schedulers``: the schedulerNames that run the extender; a GPU-sharing pod naming
    another is refused (``None``: not checked). ``pool``: the DRA node pool (``None``: no DRA
    mode); ``store``: where its templates are created. ``set_scheduler``: the schedulerName
    ``/mutate`` gives GPU-sharing pods left to the default scheduler (``None``: off)."""
    a = web.Application(client_max_size=16 * 1024 * 1024)
    a[SCHEDULERS] = schedulers
    a[POOL] = pool
    a[STORE] = store
    a[SET_SCHEDULER] = set_scheduler
    a.router.add_post("/validate", _validate)
    a.router.add_post("/mutate", _mutate)
    a.router.add_get("/healthz", _healthz)
    return a
