"""Errors the core raises. Every one names the field, the value and the rule it broke."""

from __future__ import annotations

from typing import Any


class ShareGpuError(Exception):
    """Base of every error sharegpu raises on purpose."""


def _shown(value: Any, limit: int = 200) -> str:
    """``repr(value)`` for a message, bounded: a number of thousands of digits or a huge string
    from a client is cut, never the cause of another error."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return "a number of more than 75 digits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "…"


class ValidationError(ShareGpuError, ValueError):
    """Bad input: a pod spec, a label, a payload, a trace row, a CLI argument."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"{field}={_shown(value)}: {rule}")

    @property
    def message(self) -> str:
        return str(self)


class PlacementError(ShareGpuError):
    """A placement could not be reserved, released or bound (state is left unchanged)."""
