"""Which nodes a pod may go to by its labels rule: ``spec.nodeSelector`` and the required node
affinity, as kube-scheduler's NodeAffinity filter reads them (its other filters, taints and
ports, are not read here).

kube-scheduler applies them before it asks the extender, so the extender's request never
carries them (a pod pinned to a card model by ``aliyun.accelerator/nvidia_name`` reaches the
extender with only the nodes of that model). What reads a cluster outside kube-scheduler
(``sharegpu whatif``) restricts each pod's nodes with :class:`NodeSelector`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ValidationError

AFFINITY = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")

Requirement = tuple[str, str, tuple[str, ...]]  # (key, operator, values)


@dataclass(frozen=True)
class NodeSelector:
    """``selector``: every key must have the value; ``terms``: at least one term's
    requirements must all hold (no terms: any node)."""

    selector: tuple[tuple[str, str], ...] = ()
    terms: tuple[tuple[Requirement, ...], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.selector and not self.terms

    def matches(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.selector):
            return False
        if not self.terms:
            return True
        return any(all(_holds(r, labels) for r in term) for term in self.terms)


#: the rule of a pod without one: any node
ANY = NodeSelector()


def _holds(req: Requirement, labels: Mapping[str, str]) -> bool:
    key, op, values = req
    return requirement_holds(op, labels.get(key), values)


def requirement_holds(op: object, have: str | None, values: Sequence[str]) -> bool:
    """One node-selector requirement on the node's value ``have`` (``None``: no such label), as
    kube-scheduler reads it; ``Gt``/``Lt`` compare whole numbers (not numbers: no match). An
    operator outside :data:`OPERATORS` holds (the API server refuses it first)."""
    if op == "In":
        return have is not None and have in values
    if op == "NotIn":
        return have is None or have not in values
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    if op in ("Gt", "Lt"):
        try:
            mine, bound = int(have or ""), int(values[0])
        except (ValueError, IndexError):
            return False
        return mine > bound if op == "Gt" else mine < bound
    return True


def node_selector(pod: Mapping[str, Any]) -> NodeSelector:
    """The pod's labels rule; :class:`ValidationError` naming the field when it is malformed."""
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise ValidationError("spec", type(spec).__name__, "must be a JSON object")
    if not spec.get("nodeSelector") and not spec.get("affinity"):
        return ANY
    sel = spec.get("nodeSelector") or {}
    if not isinstance(sel, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in sel.items()):
        raise ValidationError("spec.nodeSelector", type(sel).__name__,
                              "must be a JSON object of strings")
    raw_terms: Any = spec
    for field, at in (("affinity", "spec.affinity"), ("nodeAffinity", "spec.affinity.nodeAffinity"),
                      ("requiredDuringSchedulingIgnoredDuringExecution", AFFINITY)):
        raw_terms = raw_terms.get(field) or {}
        if not isinstance(raw_terms, Mapping):
            raise ValidationError(at, type(raw_terms).__name__, "must be a JSON object")
    raw_terms = raw_terms.get("nodeSelectorTerms") or []
    if not isinstance(raw_terms, list):
        raise ValidationError(f"{AFFINITY}.nodeSelectorTerms", type(raw_terms).__name__,
                              "must be a list")
    terms: list[tuple[Requirement, ...]] = []
    for i, term in enumerate(raw_terms or []):
        where = f"{AFFINITY}.nodeSelectorTerms[{i}]"
        if not isinstance(term, Mapping):
            raise ValidationError(where, type(term).__name__, "must be a JSON object")
        reqs: list[Requirement] = []
        for j, e in enumerate(term.get("matchExpressions") or []):
            at = f"{where}.matchExpressions[{j}]"
            if not isinstance(e, Mapping) or not isinstance(e.get("key"), str):
                raise ValidationError(at, "", "must be an object with a string key")
            op = e.get("operator")
            if op not in OPERATORS:
                raise ValidationError(f"{at}.operator", op, "must be one of " + ", ".join(
                    OPERATORS))
            values = e.get("values") or []
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise ValidationError(f"{at}.values", type(values).__name__,
                                      "must be a list of strings")
            reqs.append((e["key"], op, tuple(values)))
        if term.get("matchFields"):  # metadata.name: kept as a label-like rule
            for j, e in enumerate(term["matchFields"]):
                if not isinstance(e, Mapping) or e.get("operator") not in OPERATORS:
                    raise ValidationError(f"{where}.matchFields[{j}]", "", "must be an object "
                                          "with a key and an operator")
                values = tuple(str(v) for v in e.get("values") or [])
                reqs.append((FIELD_NAME, e["operator"], values))
        terms.append(tuple(reqs))
    return NodeSelector(tuple(sorted(sel.items())), tuple(terms))


#: the pseudo-label a node's name is matched as (``matchFields`` on ``metadata.name``)
FIELD_NAME = "metadata.name"


def node_labels(node: Mapping[str, Any]) -> dict[str, str]:
    """A Node's labels, with its name as :data:`FIELD_NAME` (for ``matchFields``)."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    out = {str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {}
    out[FIELD_NAME] = str(meta.get("name") or "")
    return out
