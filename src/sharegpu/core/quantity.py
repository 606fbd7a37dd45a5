"""Kubernetes resource quantities, parsed as the API server parses them
(``k8s.io/apimachinery/pkg/api/resource``), once for every entry point: pod requests (webhook,
extender, agent, simulator), node status (extender, inspect). Values are exact
(:class:`fractions.Fraction`), whitespace around a value is dropped as the API server drops it
(:data:`SPACE`), and a value past the API server's limit is refused. The grammar and the
whitespace rule: docs/webhook.md.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from .errors import ValidationError

MAX = (1 << 63) - 1
MAX_LEN = 64  # longer strings are never a quantity the API server would store

_RE = re.compile(
    r"(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<exp>[eE][+-]?[0-9]+(?:\.[0-9]*)?)|"
    r"(?P<decimal>[numkMGTPE]?))",
    re.ASCII,
)
_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
           "Ei": 1 << 60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}

# Go's unicode.IsSpace, what strings.TrimSpace removes (Python's str.strip also removes
# U+001C..U+001F, which Go keeps)
SPACE = ("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
         "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")

RULE = "must be a Kubernetes quantity (digits 0-9, an optional suffix such as m, k, Ki, Gi)"


def parse(field: str, value: Any) -> Fraction:
    """The exact value of a quantity (a JSON number or a quantity string)."""
    if isinstance(value, bool):
        raise ValidationError(field, value, RULE)
    if isinstance(value, int):
        q = Fraction(value)
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValidationError(field, value, RULE)
        q = Fraction(value)
    elif isinstance(value, str):
        if len(value) > MAX_LEN:
            raise ValidationError(field, value[:20] + "…", f"{RULE}; at most {MAX_LEN} characters")
        m = _RE.fullmatch(value.strip(SPACE))
        if m is None:
            raise ValidationError(field, value, RULE)
        q = Fraction(m["number"])
        if m["binary"]:
            q *= _BINARY[m["binary"]]
        elif m["exp"]:
            exp = Fraction(m["exp"][1:])
            if exp.denominator != 1 or abs(exp) > 64:
                raise ValidationError(field, value, f"{RULE}; the exponent must be a whole "
                                                    "number up to 64")
            q *= Fraction(10) ** int(exp)
        else:
            q *= _DECIMAL[m["decimal"] or ""]
        if m["sign"] == "-":
            q = -q
    else:
        raise ValidationError(field, value, RULE)
    if abs(q) > MAX:
        raise ValidationError(field, value, "is beyond the largest quantity Kubernetes stores "
                                            "(2^63 - 1)")
    return q


def whole(field: str, value: Any, *, minimum: int = 0, rule: str | None = None) -> int:
    """A whole number (extended resources such as ``aliyun.com/gpu-mem`` are whole), at least
    ``minimum``; ``rule`` replaces the message of a value that is a quantity but not such a
    number."""
    q = parse(field, value)
    if q.denominator != 1 or q < minimum:
        raise ValidationError(field, value, rule or f"must be a whole number, at least {minimum}")
    return int(q)


def lenient_whole(value: Any) -> int:
    """A whole quantity from an object the API server already validated (a node's status):
    0 when absent or not a whole number."""
    try:
        q = parse("quantity", value)
    except ValidationError:
        return 0
    return int(q) if q.denominator == 1 and q >= 0 else 0
