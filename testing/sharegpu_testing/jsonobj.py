"""Helpers for JSON-like objects (dicts, lists, scalars) as the fake API server stores them."""

from __future__ import annotations

from typing import Any


def clone(value: Any) -> Any:
    """A deep copy of a JSON-like value (several times faster than ``copy.deepcopy``)."""
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone(v) for v in value]
    return value


def same_content(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal apart from ``metadata.resourceVersion`` and ``metadata.managedFields``."""
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        if key != "metadata":
            if value != b[key]:
                return False
            continue
        ma, mb = value or {}, b[key] or {}
        ignore = ("resourceVersion", "managedFields")
        if {k: v for k, v in ma.items() if k not in ignore} != {
            k: v for k, v in mb.items() if k not in ignore
        }:
            return False
    return True
