"""kube-scheduler's extender wire format (k8s.io/kube-scheduler/extender/v1), pure functions.

The Go types carry no json tags, so keys are the Go field names (``Pod``, ``Nodes``,
``NodeNames``, ``FailedNodes``, ``Host``, ``Score``, ``PodName`` ...). Go's decoder matches keys
case-insensitively, so requests are read the same way here; answers are written in CamelCase.
A malformed payload raises :class:`ValidationError` naming the field; the server turns it into
an ``Error`` answer (HTTP 400), never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import ValidationError
from ..core.k8snames import dns_label, dns_subdomain

MAX_EXTENDER_PRIORITY = 10


def _field(obj: Mapping[str, Any], name: str) -> Any:
    """``obj[name]`` matched case-insensitively (as Go's encoding/json does)."""
    if name in obj:
        return obj[name]
    low = name.lower()
    for k, v in obj.items():
        if isinstance(k, str) and k.lower() == low:
            return v
    return None


@dataclass(frozen=True)
class ExtenderArgs:
    """A filter or prioritize request. ``nodes`` holds full Node objects when kube-scheduler
    sent them (``nodeCacheCapable: false``), else ``None``; ``names`` always holds the names."""

    pod: Mapping[str, Any]
    names: list[str]
    nodes: list[Mapping[str, Any]] | None

    @property
    def node_cache_capable(self) -> bool:
        return self.nodes is None


@dataclass(frozen=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str

    @property
    def key(self) -> str:
        return f"{self.pod_namespace}/{self.pod_name}"


def parse_args(body: Any) -> ExtenderArgs:
    if not isinstance(body, Mapping):
        raise ValidationError("body", type(body).__name__, "must be a JSON object (ExtenderArgs)")
    pod = _field(body, "Pod")
    if not isinstance(pod, Mapping):
        raise ValidationError("Pod", pod, "must be a Pod object")
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping) or not meta.get("name"):
        raise ValidationError("Pod.metadata.name", None, "must be set")
    check_pod_names(meta)
    raw_nodes = _field(body, "Nodes")
    raw_names = _field(body, "NodeNames")
    if raw_nodes is not None:
        items = raw_nodes.get("items") if isinstance(raw_nodes, Mapping) else None
        if items is None and isinstance(raw_nodes, Mapping):
            items = []
        if not isinstance(items, list):
            raise ValidationError("Nodes.items", items, "must be a list of Node objects")
        names: list[str] = []
        for i, n in enumerate(items):
            meta = n.get("metadata") if isinstance(n, Mapping) else None
            name = meta.get("name") if isinstance(meta, Mapping) else None
            if not isinstance(name, str) or not name:
                raise ValidationError(f"Nodes.items[{i}].metadata.name", name, "must be set")
            names.append(name)
        return ExtenderArgs(pod, names, list(items))
    if raw_names is None:
        raise ValidationError("NodeNames", None, "one of Nodes or NodeNames must be set")
    if not isinstance(raw_names, list) or not set(map(type, raw_names)) <= {str}:
        raise ValidationError("NodeNames", raw_names, "must be a list of node names")
    return ExtenderArgs(pod, list(raw_names), None)


def check_pod_names(meta: Mapping[str, Any]) -> None:
    """The pod's name and namespace, as the API server would accept them (they name the pod's
    API paths: its Events, its binding)."""
    name, ns = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str):
        raise ValidationError("Pod.metadata.name", name, "must be a string")
    dns_subdomain("Pod.metadata.name", name)
    if ns is not None and ns != "":
        if not isinstance(ns, str):
            raise ValidationError("Pod.metadata.namespace", ns, "must be a string")
        dns_label("Pod.metadata.namespace", ns)


_UID_MAX = 128


def parse_binding(body: Any) -> BindingArgs:
    """ExtenderBindingArgs, every name checked before any API path is built from it: the pod's
    name and the node's as DNS-1123 subdomains, the namespace as a DNS-1123 label."""
    if not isinstance(body, Mapping):
        raise ValidationError(
            "body", type(body).__name__, "must be a JSON object (ExtenderBindingArgs)"
        )
    out = {}
    for f in ("PodName", "PodNamespace", "PodUID", "Node"):
        v = _field(body, f)
        if v is None:
            v = ""
        if not isinstance(v, str) or (not v and f != "PodUID"):
            raise ValidationError(f, v, "must be a non-empty string")
        out[f] = v
    dns_subdomain("PodName", out["PodName"])
    dns_label("PodNamespace", out["PodNamespace"])
    dns_subdomain("Node", out["Node"])
    uid = out["PodUID"]
    if len(uid) > _UID_MAX or not all(c.isascii() and (c.isalnum() or c == "-") for c in uid):
        raise ValidationError("PodUID", uid, f"must be a pod UID: at most {_UID_MAX} "
                              "characters of letters, digits and '-'")
    return BindingArgs(out["PodName"], out["PodNamespace"], uid, out["Node"])


def go_safe(text: str) -> str:
    """``text`` without ``%``: kube-scheduler hands an extender's ``Error`` to ``fmt.Errorf``
    and the per-node reasons to an event's format string, where ``%`` starts a verb
    (``needs 10% on`` would read ``needs 10%!o(MISSING)n``). So it is written out."""
    if "%" not in text:
        return text
    return text.replace("%", " percent").replace("  percent", " percent")


def _safe_reasons(reasons: Mapping[str, str]) -> dict[str, str]:
    return {k: go_safe(v) for k, v in reasons.items()}


def filter_result(
    args: ExtenderArgs,
    passed: Sequence[str],
    failed: Mapping[str, str],
    unresolvable: Mapping[str, str],
    error: str = "",
) -> dict[str, Any]:
    """ExtenderFilterResult: the passing nodes in the form they came in (names or objects)."""
    out: dict[str, Any] = {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": _safe_reasons(failed),
        "FailedAndUnresolvableNodes": _safe_reasons(unresolvable),
        "Error": go_safe(error),
    }
    if args.nodes is None:
        out["NodeNames"] = list(passed)
    else:
        keep = set(passed)
        out["Nodes"] = {
            "metadata": {},
            "items": [n for n, name in zip(args.nodes, args.names, strict=True) if name in keep],
        }
    return out


def filter_result_json(
    args: ExtenderArgs,
    passed: Sequence[str],
    failed: Mapping[str, str],
    unresolvable: Mapping[str, str],
    passed_json: bytes | None = None,
) -> bytes:
    """``json.dumps(filter_result(...))``, with the passing names (hundreds of them) written
    directly when they need no escaping (node names are DNS names); ``passed_json``, when
    given, is :func:`names_json` of ``passed``, already made."""
    if args.nodes is not None:
        return _dumps(filter_result(args, passed, failed, unresolvable))
    names = passed_json if passed_json is not None else names_json(passed)
    if names is None:
        return _dumps(filter_result(args, passed, failed, unresolvable))
    f, u = reasons_json(failed), reasons_json(unresolvable)
    if f is None or u is None:
        rest = _dumps({"FailedNodes": _safe_reasons(failed),
                       "FailedAndUnresolvableNodes": _safe_reasons(unresolvable), "Error": ""})
        return b'{"Nodes":null,"NodeNames":' + names + b"," + rest[1:]
    return (b'{"Nodes":null,"NodeNames":' + names + b',"FailedNodes":' + f
            + b',"FailedAndUnresolvableNodes":' + u + b',"Error":""}')


_REASONS: dict[str, str] = {}  # reason -> its JSON string (made Go-safe), few distinct ones


def reasons_json(reasons: Mapping[str, str]) -> bytes | None:
    """The JSON object {node: reason} with the reasons made Go-safe (:func:`go_safe`), each
    distinct reason encoded once (hundreds of nodes fail for a handful of reasons); ``None``
    when a node name would need escaping."""
    if not reasons:
        return b"{}"
    if not _plain("".join(reasons)):
        return None
    enc = _REASONS
    parts = []
    for name, why in reasons.items():
        e = enc.get(why)
        if e is None:
            if len(enc) > 4096:
                enc.clear()
            e = enc[why] = json.dumps(go_safe(why))
        parts.append(f'"{name}":{e}')
    return ("{" + ",".join(parts) + "}").encode()


def names_json(names: Sequence[str]) -> bytes | None:
    """The compact JSON array of ``names`` (what Go's encoding/json writes for them), or
    ``None`` when a name would need escaping."""
    if not _plain("".join(names)):
        return None
    return ('["' + '","'.join(names) + '"]' if names else "[]").encode()


_NAMES_KEY = b'"NodeNames":'


def prioritize_body(filter_body: bytes, passed_json: bytes) -> bytes | None:
    """The prioritize request kube-scheduler will send after a filter request with this body,
    when the filter answer passed the names ``passed_json``: kube-scheduler marshals the same
    ``ExtenderArgs`` (the same Pod object, then ``NodeNames`` last) with the names it got back,
    so only the names differ. ``None`` when the filter body is not in that form."""
    i = filter_body.rfind(_NAMES_KEY)
    # the key must open a member ("," or "{" before it, so not the tail of an escaped string)
    # whose array value ends the top-level object
    if i < 1 or filter_body[i - 1 : i] not in (b",", b"{") or not filter_body.endswith(b"]}"):
        return None
    return filter_body[: i + len(_NAMES_KEY)] + passed_json + b"}"


def split_names(body: bytes) -> tuple[bytes, bytes] | None:
    """A filter request in kube-scheduler's form (``ExtenderArgs`` with ``NodeNames`` last) cut
    in two: the JSON object without its names, and the names' JSON array as sent (not
    decoded); ``None`` when the body is not in that form."""
    i = body.rfind(_NAMES_KEY)
    if i < 1 or body[i - 1 : i] != b"," or not body.endswith(b"]}"):
        return None
    names = body[i + len(_NAMES_KEY) : -1]
    if not names.startswith(b"[") or b"{" in names:
        return None
    return body[: i - 1] + b"}", names


def pass_all_json(names: bytes) -> bytes:
    """The filter answer passing every node of ``names`` (the JSON array as sent), no reason."""
    return (b'{"Nodes":null,"NodeNames":' + names
            + b',"FailedNodes":{},"FailedAndUnresolvableNodes":{},"Error":""}')


def _dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def error_filter_result(message: str) -> dict[str, Any]:
    return {"Nodes": None, "NodeNames": None, "FailedNodes": {},
            "FailedAndUnresolvableNodes": {}, "Error": go_safe(message)}


def priority_list(scores: Mapping[str, int]) -> list[dict[str, Any]]:
    """HostPriorityList. kube-scheduler adds each listed score × weight to the host's total; a
    host left out gets nothing added, so zero scores are left out (a shorter answer)."""
    return [{"Host": h, "Score": s} for h, s in scores.items() if s]


def _plain(text: str) -> bool:
    """Whether ``text`` goes into a JSON string as it is: printable ASCII without quotes or
    backslashes (node names, which are DNS names, always are)."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def priority_list_json(scores: Mapping[str, int]) -> bytes:
    """``json.dumps(priority_list(scores))`` up to the order of the hosts (kube-scheduler adds
    each host's score wherever it is listed), formatted directly when every host name needs no
    escaping (node names are DNS names): hosts are grouped by score and each group joined in
    one call, several times faster than encoding 500 objects one by one."""
    groups: dict[int, list[str]] = {}
    for h, s in scores.items():
        if s:
            if s in groups:
                groups[s].append(h)
            else:
                groups[s] = [h]
    if not _plain("".join(["".join(g) for g in groups.values()])):
        return json.dumps(priority_list(scores), separators=(",", ":")).encode()
    parts = []
    for s, hosts in groups.items():
        tail = f'","Score":{int(s)}}}'
        parts.append('{"Host":"' + (tail + ',{"Host":"').join(hosts) + tail)
    return ("[" + ",".join(parts) + "]").encode()


def binding_result(error: str = "") -> dict[str, str]:
    return {"Error": go_safe(error)}
