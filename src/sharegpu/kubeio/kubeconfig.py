"""Reading a kubeconfig strictly, for every sharegpu component and CLI: a file that cannot be
used is refused up front with one sentence naming the file, the field and the rule — never a
YAML traceback, a ``KeyError`` or a missing certificate found only when the first request is
made."""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.errors import ValidationError

FIELD = "kubeconfig"


class _Bad(Exception):
    """What is wrong with the file (the rule); :func:`check` names the field and the path."""



def _named(items: Any, kind: str, name: str) -> Mapping[str, Any]:
    if not isinstance(items, list):
        raise _Bad(f"'{kind}' must be a list")
    for item in items:
        if isinstance(item, Mapping) and item.get("name") == name:
            body = item.get(kind[:-1])
            if not isinstance(body, Mapping):
                raise _Bad(f"{kind[:-1]} {name!r} has no '{kind[:-1]}' object")
            return body
    raise _Bad(f"no {kind[:-1]} named {name!r} in '{kind}'")


def _file(base: Path, ref: Any, what: str) -> None:
    if not isinstance(ref, str) or not ref:
        raise _Bad(f"{what} must be a file path")
    f = Path(ref) if os.path.isabs(ref) else base / ref
    if not f.is_file():
        raise _Bad(f"{what} {ref} does not exist")


def check(path: str, context: str | None = None, *, field: str = FIELD) -> None:
    """Refuse a kubeconfig file that cannot work: unreadable, not YAML, no cluster for the
    current context, a server that is no URL, certificate or key files that do not exist,
    inline data that is not base64. The ValidationError names ``field`` (the flag that gave
    the path, when one did)."""
    try:
        _check(path, context)
    except _Bad as e:
        raise ValidationError(field, path, str(e)) from None


def _check(path: str, context: str | None) -> None:
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise _Bad("no such file") from None
    except IsADirectoryError:
        raise _Bad("is a directory, not a kubeconfig file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _Bad(f"cannot be read ({getattr(e, 'strerror', None) or e})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise _Bad(f"is not YAML{where}") from None
    if not isinstance(doc, Mapping):
        raise _Bad("must be a YAML mapping (apiVersion: v1, kind: Config)")
    name = context or doc.get("current-context")
    if not isinstance(name, str) or not name:
        raise _Bad("has no current-context (or give a context)")
    ctx = _named(doc.get("contexts"), "contexts", name)
    cluster = _named(doc.get("clusters"), "clusters", str(ctx.get("cluster") or ""))
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise _Bad(f"cluster {ctx.get('cluster')!r}: server must be an http(s) URL")
    base = Path(path).resolve().parent
    if cluster.get("certificate-authority"):
        _file(base, cluster["certificate-authority"], "certificate-authority")
    user_name = ctx.get("user")
    if user_name:
        user = _named(doc.get("users"), "users", str(user_name))
        for key in ("client-certificate", "client-key", "tokenFile"):
            if user.get(key):
                _file(base, user[key], f"user {user_name!r}: {key}")
        for key in ("client-certificate-data", "client-key-data"):
            if user.get(key):
                _b64(user[key], f"user {user_name!r}: {key}")
    if cluster.get("certificate-authority-data"):
        _b64(cluster["certificate-authority-data"], "certificate-authority-data")


def _b64(value: Any, what: str) -> None:
    try:
        base64.b64decode(str(value), validate=True)
    except (ValueError, TypeError):
        raise _Bad(f"{what} is not base64") from None


def default_path() -> str | None:
    """``$KUBECONFIG`` (the first file of the list that exists), else ``~/.kube/config`` when
    it exists, else ``None`` (in-cluster)."""
    env = os.environ.get("KUBECONFIG", "")
    if env:
        files = [p for p in env.split(os.pathsep) if p]
        for p in files:
            if Path(p).expanduser().is_file():
                return str(Path(p).expanduser())
        return files[0] if files else None
    home = Path("~/.kube/config").expanduser()
    return str(home) if home.is_file() else None


ORDER = "--kubeconfig, else $KUBECONFIG, else ~/.kube/config, else in-cluster"
"""Where every component and CLI looks for the cluster, in kubectl's order."""


def load(path: str | None = None, context: str | None = None, *, field: str = FIELD) -> Any:
    """A lightkube ``KubeConfig``, found in the order of :data:`ORDER`: ``path``, else
    :func:`default_path`, else the in-cluster service account; a file is checked first
    (:func:`check`, for ``context`` when given). ValidationError says what is wrong."""
    from lightkube import ConfigError, KubeConfig

    if path is None:
        path = default_path()
    try:
        if path is None:
            return KubeConfig.from_service_account()
        check(path, context, field=field)
        return KubeConfig.from_file(path)
    except ValidationError:
        raise
    except (ConfigError, OSError, ValueError, KeyError, TypeError) as e:
        raise ValidationError(field, path or "(in-cluster)", f"not usable: {e}") from None
