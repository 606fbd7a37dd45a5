"""Errors the core raises. Every one names the field, the value and the rule it broke."""

from __future__ import annotations

from typing import Any


class ShareGpuError(Exception):
    """Base of every error sharegpu raises on purpose."""


class ValidationError(ShareGpuError, ValueError):
    """Bad input: a pod spec, a label, a payload, a trace row, a CLI argument."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"{field}={value!r}: {rule}")

    @property
    def message(self) -> str:
        return str(self)


class PlacementError(ShareGpuError):
    """A placement could not be reserved, released or bound (state is left unchanged)."""
