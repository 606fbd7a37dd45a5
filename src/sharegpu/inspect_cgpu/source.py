"""Where ``kubectl inspect cgpu`` gets Node and Pod objects (and, for DRA mode, ResourceSlices
and ResourceClaims): a dump file or a live cluster.

- ``--file DUMP``: the output of ``kubectl get nodes,pods -A -o json`` (a ``List``), or a
  ``NodeList``/``PodList``, or several of those in a JSON array; ``-`` reads standard input;
  gzipped (``kubectl get ... | gzip``) it is read as it is.
  A support bundle can be inspected offline this way. With DRA:
  ``kubectl get nodes,pods,resourceslices,resourceclaims -A -o json``.
- Live: lightkube, with the cluster from ``--kubeconfig``, else ``$KUBECONFIG`` (the first file
  of the list that exists), else ``~/.kube/config``, else the in-cluster service account.
  ResourceSlices and ResourceClaims (``resource.k8s.io/v1``) are listed too; an API server
  without that API (before 1.34) has no DRA shares, and a user who may not list them gets a
  warning and the device-plugin view.

Every failure is a :class:`SourceError` with one clear line (which file or server, what went
wrong, what to do), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import re
import ssl
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import ShareGpuError


@dataclass
class Objects:
    nodes: list[dict[str, Any]]
    pods: list[dict[str, Any]]
    slices: list[dict[str, Any]] = field(default_factory=list)  # resource.k8s.io/v1
    claims: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: PodDisruptionBudgets (policy/v1), for a plan that evicts pods (sharegpu whatif)
    pdbs: list[dict[str, Any]] = field(default_factory=list)
    #: how many objects of each other kind the dump held (Deployments, Events, ...), left out
    other_kinds: dict[str, int] = field(default_factory=dict)


class SourceError(ShareGpuError):
    """The cluster or the dump could not be read."""


_DRA_KINDS = {"ResourceSlice": "slices", "ResourceClaim": "claims"}


def _string_field(doc: Mapping[str, Any], name: str, where: str, at: str) -> str | None:
    """``doc[name]`` when it is a string or absent (``None``); a SourceError naming the field
    and the rule otherwise."""
    value = doc.get(name)
    if value is None or isinstance(value, str):
        return value
    raise SourceError(f"{where}: field '{at}{name}' must be a string ({_RULES[name]}), "
                      f"not {_json_type(value)}")


_RULES = {"kind": "the object's kind, such as Node, Pod or List",
          "apiVersion": "such as v1 or resource.k8s.io/v1"}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _collect(doc: Any, nodes: list, pods: list, where: str, depth: int = 0,
             dra: Objects | None = None, at: str = "") -> None:
    """``at``: the path of ``doc`` in the file (``items[3].``), named in errors."""
    if depth > 4:
        raise SourceError(f"{where}: lists nested more than 4 deep; expected kubectl's output")
    if isinstance(doc, list):
        for i, d in enumerate(doc):
            _collect(d, nodes, pods, where, depth + 1, dra, f"{at.removesuffix('.')}[{i}].")
        return
    if not isinstance(doc, Mapping):
        raise SourceError(f"{where}: expected a JSON object of kind List, NodeList or PodList"
                          + (f" at '{at.removesuffix('.')}'" if at else ""))
    kind = _string_field(doc, "kind", where, at)
    version = _string_field(doc, "apiVersion", where, at)
    if kind == "Node":
        nodes.append(dict(doc))
    elif kind == "Pod":
        pods.append(dict(doc))
    elif kind in _DRA_KINDS and (version or "").startswith("resource.k8s.io/"):
        if dra is not None:
            getattr(dra, _DRA_KINDS[kind]).append(dict(doc))
    elif (kind is not None and kind.endswith("List")) or "items" in doc:
        items = doc.get("items")
        if not isinstance(items, list):
            raise SourceError(f"{where}: field '{at}items' must be a list of objects")
        implied = {"NodeList": "Node", "PodList": "Pod", "ResourceSliceList": "ResourceSlice",
                   "ResourceClaimList": "ResourceClaim",
                   "PodDisruptionBudgetList": "PodDisruptionBudget"}.get(kind or "")
        for i, item in enumerate(items):
            if isinstance(item, Mapping) and implied and "kind" not in item:
                item = {**item, "kind": implied}
                if implied in _DRA_KINDS and "apiVersion" not in item and version:
                    item["apiVersion"] = version
            _collect(item, nodes, pods, where, depth + 1, dra, f"{at}items[{i}].")
    elif kind == "PodDisruptionBudget" and dra is not None:
        dra.pdbs.append(dict(doc))
    elif dra is not None:  # other kinds (Events, Services, ...) in a support bundle: left out
        name = kind or "(no kind)"
        dra.other_kinds[name] = dra.other_kinds.get(name, 0) + 1


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_lone_surrogates(doc: Any) -> Any:
    """The document with each lone UTF-16 surrogate (a ``\\ud800`` escape without its pair,
    which no text can encode) replaced by U+FFFD, as Go's JSON decoder (kubectl's, the API
    server's) replaces it."""
    if isinstance(doc, str):
        return _LONE_SURROGATE.sub("\ufffd", doc)
    if isinstance(doc, list):
        return [_without_lone_surrogates(d) for d in doc]
    if isinstance(doc, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v) for k, v in doc.items()}
    return doc


def load_file(path: str) -> Objects:
    """Nodes and pods from a dump written by ``kubectl get nodes,pods -A -o json``."""
    where = "standard input" if path == "-" else path
    try:
        raw = _stdin_bytes() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise SourceError(f"--file {where}: cannot read it: {e.strerror or e}") from None
    if raw[:2] == GZIP_MAGIC:  # kubectl get ... -o json | gzip
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise SourceError(f"--file {where}: a gzip file that does not decompress ({e}); "
                              "write it with: kubectl get nodes,pods -A -o json | gzip > FILE"
                              ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SourceError(f"--file {where}: not UTF-8 text (nor gzip); write it with: "
                          "kubectl get nodes,pods -A -o json > FILE") from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise SourceError(f"--file {where}: JSON nested too deeply to be kubectl's output"
                          ) from None
    except ValueError as e:
        if not isinstance(e, json.JSONDecodeError):  # e.g. a number of thousands of digits
            raise SourceError(f"--file {where}: not kubectl's JSON ({e})") from None
        raise SourceError(
            f"--file {where}: not JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
            "write it with: kubectl get nodes,pods -A -o json > FILE"
        ) from None
    if _SURROGATE_ESCAPE.search(text):
        doc = _without_lone_surrogates(doc)
    nodes: list[dict[str, Any]] = []
    pods: list[dict[str, Any]] = []
    dra = Objects([], [])
    _collect(doc, nodes, pods, f"--file {where}", dra=dra)
    if not nodes:
        raise SourceError(
            f"--file {where}: holds no Node objects{_holding(dra.other_kinds)}; write it with: "
            "kubectl get nodes,pods -A -o json > FILE"
        )
    return Objects(nodes, pods, dra.slices, dra.claims, pdbs=dra.pdbs,
                   other_kinds=dra.other_kinds)


GZIP_MAGIC = b"\x1f\x8b"


def _stdin_bytes() -> bytes:
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        return buffer.read()
    return sys.stdin.read().encode("utf-8", "surrogatepass")  # a text stream (tests, IDEs)


def _holding(kinds: Mapping[str, int]) -> str:
    """`` (it holds 3 Deployment, 2 Service)``: what a dump held instead, when anything."""
    if not kinds:
        return ""
    top = sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))[:4]
    return " (it holds " + ", ".join(f"{n} {k}" for k, n in top) + ")"


def _dra_resources() -> tuple[Any, Any]:
    """``resource.k8s.io/v1`` ResourceSlice and ResourceClaim as raw objects (lightkube's models
    may predate them, and would drop fields they do not know, such as ``consumedCapacity``)."""
    from lightkube.generic_resource import (
        GenericGlobalResource,
        GenericNamespacedResource,
        create_api_info,
    )

    class ResourceSlice(GenericGlobalResource):
        _api_info = create_api_info("resource.k8s.io", "v1", "ResourceSlice", "resourceslices",
                                    verbs=["list"])

    class ResourceClaim(GenericNamespacedResource):
        _api_info = create_api_info("resource.k8s.io", "v1", "ResourceClaim", "resourceclaims",
                                    verbs=["list", "global_list"])

    return ResourceSlice, ResourceClaim


def kubeconfig_path(explicit: str | None = None) -> str | None:
    """The kubeconfig file to use, or ``None`` to try the in-cluster service account."""
    from ..kubeio.kubeconfig import default_path

    return explicit or default_path()


def load_live(kubeconfig: str | None = None, *, timeout: float = 20.0,
              context: str | None = None, with_pdbs: bool = False) -> Objects:
    """Nodes and pods from the cluster (pods of every namespace); ``context`` picks a context
    of the kubeconfig other than its current one; ``with_pdbs``: PodDisruptionBudgets too (one
    that cannot be listed leaves ``{"unreadable": True}`` in their place)."""
    try:
        from lightkube import ApiError, AsyncClient, ConfigError
        from lightkube.core.generic_client import httpx
        from lightkube.resources.core_v1 import Node, Pod
    except ImportError as e:  # pragma: no cover - lightkube is a dependency
        raise SourceError(f"the Kubernetes client library is missing: {e}") from None

    from ..core.errors import ValidationError
    from ..kubeio import kubeconfig as kc

    path = kubeconfig_path(kubeconfig)
    try:
        config = kc.load(path, context)
    except ValidationError as e:
        raise SourceError(f"{e}; set KUBECONFIG to a working kubeconfig or use --file DUMP"
                          ) from None
    except ConfigError as e:
        raise SourceError(
            f"no usable cluster configuration ({e}); set KUBECONFIG to your kubeconfig file "
            "or use --file DUMP"
        ) from None
    except (OSError, ValueError) as e:
        raise SourceError(f"cannot read kubeconfig {path}: {e}") from None
    server = "the cluster"
    with contextlib.suppress(Exception):
        server = config.get(context).cluster.server

    def plain(obj: Any) -> dict[str, Any]:
        return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)

    async def fetch() -> Objects:
        client = AsyncClient(config.get(context) if context else config, timeout=timeout)
        try:
            nodes = [n.to_dict() async for n in client.list(Node, chunk_size=500)]
            pods = [p.to_dict() async for p in client.list(Pod, namespace="*", chunk_size=500)]
            out = Objects(nodes, pods)
            if with_pdbs:
                from lightkube.resources.policy_v1 import PodDisruptionBudget

                try:
                    out.pdbs = [o.to_dict() async for o in client.list(
                        PodDisruptionBudget, namespace="*", chunk_size=500)]
                except ApiError as e:
                    out.warnings.append(f"cannot list poddisruptionbudgets ({e.status.message})"
                                        ": a plan evicts no pod")
                    out.pdbs = [{"unreadable": True}]
            slice_res, claim_res = _dra_resources()
            for what, res, ns in (("resourceslices", slice_res, None),
                                  ("resourceclaims", claim_res, "*")):
                try:
                    kw = {"namespace": ns} if ns else {}
                    got = [plain(o) async for o in client.list(res, chunk_size=500, **kw)]
                except ApiError as e:
                    code = getattr(e.status, "code", None)
                    if code == 404:  # no resource.k8s.io/v1 (before 1.34): no DRA shares
                        break
                    if code in (401, 403):
                        out.warnings.append(
                            f"cannot list {what}.resource.k8s.io ({e.status.message}): DRA "
                            "shares are not shown (your user needs list on resourceslices and "
                            "resourceclaims)")
                        break
                    raise
                for o in got:
                    o.setdefault("apiVersion", "resource.k8s.io/v1")
                (out.slices if what == "resourceslices" else out.claims).extend(got)
            return out
        finally:
            await client.close()

    try:
        return asyncio.run(fetch())
    except ApiError as e:
        code = getattr(e.status, "code", None)
        hint = (
            " (your user needs get/list on nodes and pods)" if code in (401, 403) else ""
        )
        raise SourceError(f"the API server at {server} refused: {e.status.message}{hint}") from None
    except httpx.TransportError as e:
        raise SourceError(
            f"cannot reach the API server at {server}: {e.__class__.__name__}: {e}; "
            "check KUBECONFIG and the network, or use --file DUMP"
        ) from None
    except httpx.HTTPError as e:
        raise SourceError(f"talking to the API server at {server} failed: {e}") from None
    except ConfigError as e:
        raise SourceError(f"kubeconfig {path}: {e}") from None
    except (OSError, ssl.SSLError) as e:  # certificate or key files that do not load
        raise SourceError(f"kubeconfig {path}: the client credentials do not load: {e}"
                          ) from None
