"""Argument types the subcommands share (``sharegpu.cli`` re-exports them; they live here so
that the commands never import the CLI that loads them)."""

from __future__ import annotations

import argparse

from ..core.errors import ValidationError


def parse_seeds(text: str) -> list[int]:
    """``42..51`` (inclusive), ``42,43,47`` or ``42``."""
    rule = "must be N, N..M (inclusive) or a comma-separated list of whole numbers"
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if ".." in part:
                a, b = part.split("..", 1)
                lo, hi = int(a), int(b)
            else:
                lo = hi = int(part)
        except ValueError:
            raise ValidationError("--seeds", text, rule) from None
        if hi < lo:
            raise ValidationError("--seeds", text, "a range N..M needs M >= N")
        out.extend(range(lo, hi + 1))
    if not out:
        raise ValidationError("--seeds", text, rule)
    return out


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return v


def reserve_mib(value: object) -> int:
    """``--reserve-mib``: MiB of each GPU kept out of the GiB it is advertised with."""
    rule = "must be a whole number of MiB, 0 or more, below 65536"
    try:
        v = int(str(value).strip())
    except ValueError:
        raise ValidationError("--reserve-mib", value, rule) from None
    if not 0 <= v < 65536:
        raise ValidationError("--reserve-mib", value, rule)
    return v
