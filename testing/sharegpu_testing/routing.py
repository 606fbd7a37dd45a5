"""How the fake API server reads a request path: discovery documents, and the API call
(verb, resource, namespace, name, subresource) of a resource path, as kube-apiserver routes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import resources as res
from . import status as st
from .resources import ResourceType

SERVER_VERSION = {
    "major": "1",
    "minor": "31",
    "gitVersion": "v1.31.0-sharegpu-fake",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "none",
    "compiler": "none",
    "platform": "linux/amd64",
}
PUBLIC_PATHS = frozenset({"healthz", "livez", "readyz", "version"})


class NotFoundPath(st.StatusError):
    def __init__(self) -> None:
        super().__init__(404, "NotFound", "the server could not find the requested resource")


@dataclass
class Call:
    verb: str
    rtype: ResourceType
    namespace: str | None
    name: str | None
    sub: str | None

    @property
    def resource(self) -> str:
        """``pods``, ``pods/binding``, ``leases``: the name fault rules and webhooks match."""
        return f"{self.rtype.plural}/{self.sub}" if self.sub else self.rtype.plural


def truthy(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.lower() in ("1", "true", "yes")


def discovery(segs: list[str], address: str) -> dict[str, Any] | str | None:
    """The discovery document (or health text) for a path, None for other paths."""
    if not segs:
        paths = ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/readyz", "/version"]
        paths += [f"/apis/{g}" for g in res.group_versions()]
        paths += [f"/apis/{g}/{v}" for g, vs in res.group_versions().items() for v in vs]
        return {"paths": sorted(paths)}
    if segs[0] in ("healthz", "livez", "readyz") and len(segs) == 1:
        return "ok"
    if segs == ["version"]:
        return dict(SERVER_VERSION)
    if segs == ["api"]:
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
        }
    if segs == ["api", "v1"]:
        return _resource_list("", "v1")
    if segs == ["apis"]:
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [_group(g, vs) for g, vs in res.group_versions().items()],
        }
    if len(segs) == 2 and segs[0] == "apis":
        vs = res.group_versions().get(segs[1])
        if vs is None:
            raise NotFoundPath()
        return {"kind": "APIGroup", "apiVersion": "v1", **_group(segs[1], vs)}
    if len(segs) == 3 and segs[0] == "apis":
        if segs[2] not in res.group_versions().get(segs[1], []):
            raise NotFoundPath()
        return _resource_list(segs[1], segs[2])
    return None


def _group(group: str, versions: list[str]) -> dict[str, Any]:
    gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}


def _resource_list(group: str, version: str) -> dict[str, Any]:
    out = []
    for r in res.by_group_version(group, version).values():
        entry: dict[str, Any] = {
            "name": r.plural,
            "singularName": r.singular,
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": list(r.verbs),
        }
        if r.short_names:
            entry["shortNames"] = list(r.short_names)
        out.append(entry)
        for sub in r.subresources:
            out.append(
                {
                    "name": f"{r.plural}/{sub}",
                    "singularName": "",
                    "namespaced": r.namespaced,
                    "kind": "Binding" if sub == "binding" else r.kind,
                    "verbs": ["create"] if sub == "binding" else ["get", "patch", "update"],
                }
            )
    gv = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": out}


# ------------------------------------------------------------------ routing


def route(method: str, segs: list[str], query: Mapping[str, str]) -> Call:
    """The API call a request is: verb, resource, namespace, name, subresource."""
    if segs[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", segs[2:]
    elif len(segs) >= 3 and segs[0] == "apis":
        group, version, rest = segs[1], segs[2], segs[3:]
    else:
        raise NotFoundPath()
    table = res.by_group_version(group, version)
    if not table or not rest:
        raise NotFoundPath()
    legacy_watch = rest[0] == "watch"
    if legacy_watch:
        rest = rest[1:]
    ns: str | None = None
    if (
        len(rest) >= 3
        and rest[0] == "namespaces"
        and rest[2] in table
        and table[rest[2]].namespaced
    ):
        ns, rtype, tail = rest[1], table[rest[2]], rest[3:]
    else:
        if not rest or rest[0] not in table:
            raise NotFoundPath()
        rtype, tail = table[rest[0]], rest[1:]
        if rtype.namespaced and tail:
            raise NotFoundPath()
    if len(tail) > 2:
        raise NotFoundPath()
    name = tail[0] if tail else None
    sub = tail[1] if len(tail) == 2 else None
    if sub is not None and sub not in rtype.subresources:
        raise NotFoundPath()
    watch = legacy_watch or truthy(query.get("watch")) is True
    if method == "GET":
        if name is None:
            verb = "watch" if watch else "list"
        elif legacy_watch:
            verb = "watch"
        else:
            verb = "get"
        if sub == "binding":
            raise st.method_not_allowed()
    elif method == "POST":
        if (name is None and (ns is not None or not rtype.namespaced)) or sub == "binding":
            verb = "create"
        else:
            raise st.method_not_allowed()
    elif method in ("PUT", "PATCH"):
        if name is None or sub == "binding":
            raise st.method_not_allowed()
        verb = "update" if method == "PUT" else "patch"
    elif method == "DELETE":
        if sub is not None:
            raise st.method_not_allowed()
        verb = "delete" if name is not None else "deletecollection"
    else:
        raise st.method_not_allowed()
    if verb not in rtype.verbs:
        raise st.method_not_allowed()
    if not rtype.namespaced:
        ns = None
    return Call(verb, rtype, ns, name, sub)
