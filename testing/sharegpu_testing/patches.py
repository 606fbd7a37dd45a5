"""The patch formats the Kubernetes API server accepts, applied to plain JSON-like objects.

- JSON merge patch (RFC 7386, ``application/merge-patch+json``): objects merge recursively,
  ``null`` removes a key, anything else (lists included) replaces.
- Strategic merge patch (``application/strategic-merge-patch+json``): a merge patch in which
  the lists the core API declares with a merge key (``containers`` by ``name``,
  ``conditions`` by ``type``, ...) merge element by element, ``finalizers`` merges as a set,
  and the ``$patch: replace|delete`` and ``$deleteFromPrimitiveList/<field>`` directives work.
  Other directives (``$setElementOrder``, ``$retainKeys``) are accepted and ignored.
- JSON patch (RFC 6902, ``application/json-patch+json``): add, remove, replace, move, copy,
  test, with RFC 6901 pointers.

Errors raise :class:`PatchError`; ``malformed`` tells a patch that does not decode (400 on
the real server) from one that does not apply (422 on the real server).
"""

from __future__ import annotations

from typing import Any

from .jsonobj import clone

# Lists merged by key in a strategic merge patch, by field name (core/v1 patch strategies).
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "conditions": "type",
    "addresses": "type",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "podIPs": "ip",
    "hostIPs": "ip",
    "schedulingGates": "name",
    "resourceClaims": "name",
}
# Lists of scalars merged as sets in a strategic merge patch.
SET_LISTS = frozenset({"finalizers"})


class PatchError(ValueError):
    def __init__(self, message: str, *, malformed: bool = False) -> None:
        super().__init__(message)
        self.malformed = malformed


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; returns a new value, never mutates its arguments."""
    if not isinstance(patch, dict):
        return clone(patch)
    result = clone(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A strategic merge patch on the core/v1 list strategies listed in MERGE_KEYS."""
    return _smp(target, patch)


def _smp(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return clone(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: clone(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    if directive not in (None, "merge"):
        raise PatchError(f"unknown patch directive $patch: {directive!r}", malformed=True)
    result = clone(target) if isinstance(target, dict) else {}
    deletions: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key == "$patch":
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            deletions[key.split("/", 1)[1]] = value if isinstance(value, list) else [value]
            continue
        if key.startswith("$"):
            continue  # $setElementOrder/..., $retainKeys: ordering and pruning hints, ignored
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in MERGE_KEYS:
            result[key] = _merge_keyed_list(result.get(key), value, MERGE_KEYS[key])
        elif isinstance(value, list) and key in SET_LISTS:
            have = list(result.get(key) or [])
            result[key] = have + [v for v in value if v not in have]
        else:
            merged = _smp(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
    for key, gone in deletions.items():
        if isinstance(result.get(key), list):
            result[key] = [v for v in result[key] if v not in gone]
    return result


def _merge_keyed_list(current: Any, patch: list[Any], merge_key: str) -> list[Any]:
    out = [clone(e) for e in current] if isinstance(current, list) else []
    for element in patch:
        if not isinstance(element, dict) or merge_key not in element:
            if isinstance(element, dict) and element.get("$patch") == "replace":
                return [clone(e) for e in patch if e.get("$patch") != "replace"]
            raise PatchError(
                f"strategic merge patch: list elements need the merge key {merge_key!r}",
                malformed=True,
            )
        idx = next(
            (
                i
                for i, e in enumerate(out)
                if isinstance(e, dict) and e.get(merge_key) == element[merge_key]
            ),
            None,
        )
        if element.get("$patch") == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            out.append(_smp({}, element))
        else:
            out[idx] = _smp(out[idx], element)
    return out


# ---------------------------------------------------------------- JSON patch (RFC 6902)


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str):
        raise PatchError(f"JSON pointer must be a string, got {path!r}", malformed=True)
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} must start with '/'", malformed=True)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise PatchError(f"invalid array index {token!r}")
    i = int(token)
    if i > len(container) or (i == len(container) and not allow_end):
        raise PatchError(f"array index {i} out of bounds")
    return i


def _parent(doc: Any, tokens: list[str], path: str) -> tuple[Any, str]:
    cur = doc
    for tok in tokens[:-1]:
        if isinstance(cur, dict):
            if tok not in cur:
                raise PatchError(f"doc is missing path: {path!r}")
            cur = cur[tok]
        elif isinstance(cur, list):
            cur = cur[_index(cur, tok, allow_end=False)]
        else:
            raise PatchError(f"doc is missing path: {path!r}")
    return cur, tokens[-1]


def _get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent, last = _parent(doc, tokens, path)
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"doc is missing key: {path!r}")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, allow_end=False)]
    raise PatchError(f"doc is missing path: {path!r}")


def _add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent, last = _parent(doc, tokens, path)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    else:
        raise PatchError(f"add operation does not apply: doc is missing path: {path!r}")
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    tokens = _pointer(path)
    if not tokens:
        raise PatchError("remove operation cannot remove the whole document")
    parent, last = _parent(doc, tokens, path)
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"remove operation does not apply: doc is missing key: {path!r}")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, allow_end=False))
    raise PatchError(f"remove operation does not apply: doc is missing path: {path!r}")


def json_patch(doc: Any, operations: Any) -> Any:
    """Apply an RFC 6902 patch; atomic: the input is never modified."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations", malformed=True)
    doc = clone(doc)
    for n, op in enumerate(operations):
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"operation {n}: needs 'op' and 'path'", malformed=True)
        kind, path = op["op"], op["path"]
        _pointer(path)
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"operation {n} ({kind}): missing 'value'", malformed=True)
        if kind in ("move", "copy") and "from" not in op:
            raise PatchError(f"operation {n} ({kind}): missing 'from'", malformed=True)
        if kind == "add":
            doc = _add(doc, path, clone(op["value"]))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)  # must exist
            if not _pointer(path):
                doc = clone(op["value"])
            else:
                doc, _ = _remove(doc, path)
                doc = _add(doc, path, clone(op["value"]))
        elif kind == "move":
            src = op["from"]
            if path != src and path.startswith(src + "/"):
                raise PatchError(f"move operation cannot move {src!r} into its own child {path!r}")
            doc, value = _remove(doc, src)
            doc = _add(doc, path, value)
        elif kind == "copy":
            doc = _add(doc, path, clone(_get(doc, op["from"])))
        elif kind == "test":
            try:
                have = _get(doc, path)
            except PatchError:
                have = _MISSING
            if have is _MISSING or not _json_equal(have, op["value"]):
                raise PatchError(f"testing value {path} failed: test failed")
        else:
            raise PatchError(f"operation {n}: unknown op {kind!r}", malformed=True)
    return doc


_MISSING = object()


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b
