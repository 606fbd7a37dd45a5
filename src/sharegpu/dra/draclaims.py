"""ACK's pod spec on a DRA node pool: which pods are bound for the pool (their node selector, or
every term of their required node affinity, names the pool label), and how their
``aliyun.com/gpu-mem`` / ``gpu-core.percentage`` / ``gpu-count`` become one ResourceClaim per GPU
container, from a ResourceClaimTemplate named after its shape. Pure: the mutating webhook
(:mod:`sharegpu.webhook`) is the adapter; docs/dra.md says what the templates ask and why.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..core import names
from ..core.errors import ValidationError
from ..core.request import Kind, parse_pod
from . import driver as dra

API_VERSION: Final = "resource.k8s.io/v1"
REQUEST_NAME: Final = "gpu"
CLAIM_PREFIX: Final = "sharegpu-c"  # + container index: the pod's claim for that container
TEMPLATE_PREFIX: Final = "sharegpu-"
SHAREABLE: Final = "device.allowMultipleAllocations == true"
ANNOTATION: Final = names.ANN_DRA_CLAIMS  # {claim: template} the webhook added
MANAGED_BY: Final = "sharegpu-webhook"

RULE_AMBIGUOUS = ("must name the DRA pool label in every required nodeSelectorTerm, or in none "
                  "(a pod goes to the DRA pool or to the device plugins, never either)")
RULE_NODE_NAME = ("a pod whose GPU comes from the DRA pool must be placed by kube-scheduler "
                  "(its claim is allocated at scheduling): drop spec.nodeName, use the "
                  "nodeSelector kubernetes.io/hostname")
RULE_WHOLE = ("is not translated on the DRA pool: ask for whole GPUs with a ResourceClaim of "
              "DeviceClass {cls} (docs/dra.md)")
RULE_CLAIM_TAKEN = "is a name the sharegpu webhook gives the claim of container {i}"
RULE_NOT_TRANSLATED = ("must be turned into a ResourceClaim by the sharegpu mutating webhook on "
                       "the DRA pool (is the MutatingWebhookConfiguration installed?)")


@dataclass(frozen=True, slots=True)
class Pool:
    """The DRA node pool: the nodes labelled ``key=value``; ``device_class`` is the chart's
    DeviceClass (named after the driver)."""

    key: str = "sharegpu.io/dra"
    value: str = "true"
    device_class: str = dra.DRIVER

    @classmethod
    def parse(cls, label: str, device_class: str = dra.DRIVER) -> Pool:
        key, sep, value = label.partition("=")
        if not sep or not key:
            raise ValidationError("--dra-label", label, "must be KEY=VALUE")
        return cls(key, value, device_class)


@dataclass(frozen=True, slots=True)
class Shape:
    """One container's GPU request: GiB and percent per GPU, over ``gpus`` GPUs."""

    mem_gib: int
    cores: int = 0
    gpus: int = 1

    @property
    def template_name(self) -> str:
        name = f"{TEMPLATE_PREFIX}{self.mem_gib}gi"
        if self.cores:
            name += f"-{self.cores}pct"
        if self.gpus > 1:
            name += f"-x{self.gpus}"
        return name


@dataclass(frozen=True, slots=True)
class Translation:
    """What the webhook does for one pod: templates to have in the namespace, then the patch."""

    namespace: str
    templates: tuple[dict[str, Any], ...]
    patch: tuple[dict[str, Any], ...]
    claims: Mapping[str, str]  # pod claim name -> template name


def _str_map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def bound_for_pool(pod: Mapping[str, Any], pool: Pool) -> bool:
    """Whether the pod asks for the DRA pool (module doc); ValidationError when it is
    ambiguous."""
    spec = _str_map(pod.get("spec"))
    selector = _str_map(spec.get("nodeSelector"))
    by_selector = selector.get(pool.key) == pool.value
    affinity = _str_map(_str_map(spec.get("affinity")).get("nodeAffinity"))
    required = _str_map(affinity.get("requiredDuringSchedulingIgnoredDuringExecution"))
    terms = required.get("nodeSelectorTerms")
    terms = terms if isinstance(terms, list) else []
    naming = []
    for i, term in enumerate(terms):
        exprs = _str_map(term).get("matchExpressions")
        for j, e in enumerate(exprs if isinstance(exprs, list) else []):
            e = _str_map(e)
            if e.get("key") != pool.key:
                continue
            values = e.get("values") if isinstance(e.get("values"), list) else []
            where = (f"spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                     f".nodeSelectorTerms[{i}].matchExpressions[{j}]")
            if e.get("operator") == "In" and values == [pool.value]:
                naming.append(i)
            elif pool.value in values or (by_selector and e.get("operator") in (
                    "NotIn", "DoesNotExist")):
                raise ValidationError(where, f"{pool.key} {e.get('operator')} {values}",
                                      f"must be {pool.key} In [{pool.value!r}] alone: "
                                      + RULE_AMBIGUOUS)
    by_affinity = bool(terms) and len(set(naming)) == len(terms)
    if naming and not by_affinity:
        missing = next(i for i in range(len(terms)) if i not in naming)
        raise ValidationError(
            "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
            f".nodeSelectorTerms[{missing}]", f"no {pool.key} In [{pool.value!r}]",
            RULE_AMBIGUOUS)
    if pool.key in selector and not by_selector and naming:
        raise ValidationError(f'spec.nodeSelector["{pool.key}"]', selector[pool.key],
                              f"contradicts the node affinity's {pool.key} In "
                              f"[{pool.value!r}]: " + RULE_AMBIGUOUS)
    return by_selector or by_affinity


def claim_template(namespace: str, shape: Shape, pool: Pool) -> dict[str, Any]:
    """The ResourceClaimTemplate for one shape: as the API server stores it (defaults written)
    so a stored one compares equal (:func:`same_template`)."""
    capacity: dict[str, str] = {dra.CAPACITY_MEMORY: f"{shape.mem_gib}Gi"}
    if shape.cores:
        capacity[dra.CAPACITY_CORES] = str(shape.cores)
    exactly: dict[str, Any] = {
        "deviceClassName": pool.device_class,
        "selectors": [{"cel": {"expression": SHAREABLE}}],
        "allocationMode": "ExactCount",
        "count": shape.gpus,
        "capacity": {"requests": capacity},
    }
    devices: dict[str, Any] = {"requests": [{"name": REQUEST_NAME, "exactly": exactly}]}
    if shape.gpus > 1:
        # attributes are qualified by the driver's name, which the chart's DeviceClass bears
        devices["constraints"] = [{"requests": [REQUEST_NAME],
                                   "distinctAttribute": f"{pool.device_class}/uuid"}]
    return {
        "apiVersion": API_VERSION, "kind": "ResourceClaimTemplate",
        "metadata": {"name": shape.template_name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
        "spec": {"spec": {"devices": devices}},
    }


def same_template(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether a template found under the shape's name asks for what ours would (the API server
    writes back an empty ``spec.metadata``)."""
    spec = dict(_str_map(stored.get("spec")))
    if not spec.get("metadata"):
        spec.pop("metadata", None)
    return spec == wanted["spec"]


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _no_whole_cards(pod: Mapping[str, Any], pool: Pool) -> None:
    for i, c in enumerate(pod["spec"]["containers"]):
        res = _str_map(_str_map(c).get("resources"))
        for part in ("limits", "requests"):
            for r in (names.RES_NVIDIA_GPU, names.RES_TOPOLOGY_GPU):
                if r in _str_map(res.get(part)):
                    raise ValidationError(
                        f'spec.containers[{i}].resources.{part}["{r}"]', res[part][r],
                        RULE_WHOLE.format(cls=pool.device_class))


def translate(pod: Mapping[str, Any], pool: Pool) -> Translation | None:
    """The claims for a pod bound for the DRA pool, or ``None`` when the pod is not (or asks for
    no GPU through ACK's resources: its own claims pass untouched). ValidationError naming the
    field and the rule for a pod that cannot go: SPEC §2's rules (:func:`parse_pod`) plus those
    of this module."""
    if not bound_for_pool(pod, pool):
        return None
    spec = _str_map(pod.get("spec"))
    if isinstance(spec.get("containers"), list):
        _no_whole_cards(pod, pool)
    request = parse_pod(pod)
    if request.kind not in (Kind.SHARED, Kind.SHARED_CORE):
        return None
    if spec.get("nodeName"):
        raise ValidationError("spec.nodeName", spec["nodeName"], RULE_NODE_NAME)
    namespace = str(_str_map(pod.get("metadata")).get("namespace") or "default")
    own = spec.get("resourceClaims")
    own = own if isinstance(own, list) else []
    taken = {str(_str_map(c).get("name")) for c in own}

    patch: list[dict[str, Any]] = []
    templates: dict[str, dict[str, Any]] = {}
    claims: dict[str, str] = {}
    new_claims: list[dict[str, Any]] = []
    for c in request.containers:
        shape = Shape(c.gpu_mem, c.gpu_core, c.gpus)
        claim = f"{CLAIM_PREFIX}{c.index}"
        if claim in taken:
            i = next(i for i, x in enumerate(own) if _str_map(x).get("name") == claim)
            raise ValidationError(f"spec.resourceClaims[{i}].name", claim,
                                  RULE_CLAIM_TAKEN.format(i=c.index))
        templates.setdefault(shape.template_name, claim_template(namespace, shape, pool))
        claims[claim] = shape.template_name
        new_claims.append({"name": claim, "resourceClaimTemplateName": shape.template_name})
        base = f"/spec/containers/{c.index}/resources"
        res = _str_map(spec["containers"][c.index].get("resources"))
        for part in ("limits", "requests"):
            for r in (names.RES_GPU_MEM, names.RES_GPU_CORE):
                if r in _str_map(res.get(part)):
                    patch.append({"op": "remove", "path": f"{base}/{part}/{_escape(r)}"})
        ref = {"name": claim}
        if isinstance(res.get("claims"), list):
            patch.append({"op": "add", "path": f"{base}/claims/-", "value": ref})
        else:
            patch.append({"op": "add", "path": f"{base}/claims", "value": [ref]})
    if isinstance(spec.get("resourceClaims"), list):
        patch.extend({"op": "add", "path": "/spec/resourceClaims/-", "value": c}
                     for c in new_claims)
    else:
        patch.append({"op": "add", "path": "/spec/resourceClaims", "value": new_claims})
    meta = _str_map(pod.get("metadata"))
    note = json.dumps(claims, sort_keys=True, separators=(",", ":"))
    if isinstance(meta.get("annotations"), Mapping):
        patch.append({"op": "add", "path": f"/metadata/annotations/{_escape(ANNOTATION)}",
                      "value": note})
    else:
        patch.append({"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION: note}})
    return Translation(namespace, tuple(templates.values()), tuple(patch), claims)


def untranslated(pod: Mapping[str, Any], pool: Pool) -> ValidationError | None:
    """For the validating webhook: a pod bound for the DRA pool that still asks for ACK's
    shared resources (the mutating webhook did not run) is refused; one that was translated
    needs none of the device-plugin rules (its ``aliyun.com/gpu-count`` label is then only a
    note). ``None``: nothing to refuse."""
    containers = _str_map(pod.get("spec")).get("containers")
    for i, c in enumerate(containers if isinstance(containers, list) else []):
        res = _str_map(_str_map(c).get("resources"))
        for part in ("limits", "requests"):
            for r in (names.RES_GPU_MEM, names.RES_GPU_CORE):
                if r in _str_map(res.get(part)):
                    return ValidationError(f'spec.containers[{i}].resources.{part}["{r}"]',
                                           res[part][r], RULE_NOT_TRANSLATED)
    return None


def apply_patch(obj: Any, patch: Sequence[Mapping[str, Any]]) -> Any:
    """The JSON patch ops :func:`translate` writes (add, remove; ``-`` appends), applied to a
    copy: for tests and for checking a translation."""
    out = json.loads(json.dumps(obj))
    for op in patch:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = out
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        elif isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), op["value"])
        else:
            parent[last] = op["value"]
    return out
