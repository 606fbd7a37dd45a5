"""Label and field selectors with the grammar and semantics of the Kubernetes API server.

Label selectors (``labelSelector=``): comma-separated requirements, each one of
``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``, ``key in (a,b)``,
``key notin (a,b)``, ``key>5``, ``key<5``. As on the real server, ``!=`` and ``notin`` also
match objects without the key; ``in``, ``=``, ``>`` and ``<`` need it.

Field selectors (``fieldSelector=``): comma-separated ``field=value``, ``field==value`` or
``field!=value`` terms over a per-resource set of supported fields; ``\\,``, ``\\=`` and
``\\\\`` escape inside values. An unsupported field is a 400 on the real server, and here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

_KEY_RE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


class SelectorError(ValueError):
    """A selector that does not parse; the server answers 400 BadRequest with this message."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "exists", "!", "=", "!=", "in", "notin", ">", "<"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if self.op in ("=", "in"):
            return has and value in self.values
        if self.op in ("!=", "notin"):
            return not has or value not in self.values
        if not has:
            return False
        try:
            have = int(str(value))
        except ValueError:
            return False
        want = int(self.values[0])
        return have > want if self.op == ">" else have < want


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    @property
    def empty(self) -> bool:
        return not self.requirements


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unable to parse requirement: unbalanced ')' in {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise SelectorError(f"unable to parse requirement: unbalanced '(' in {text!r}")
    parts.append("".join(cur))
    return parts


def _check_key(key: str) -> str:
    if not _KEY_RE.match(key) or len(key.split("/")[-1]) > 63:
        raise SelectorError(f"unable to parse requirement: invalid label key {key!r}")
    return key


def _check_value(value: str) -> str:
    if not _VALUE_RE.match(value):
        raise SelectorError(f"unable to parse requirement: invalid label value {value!r}")
    return value


_SET_RE = re.compile(r"^\s*(?P<key>[^\s!=<>()]+)\s+(?P<op>in|notin)\s*\((?P<vals>[^()]*)\)\s*$")
_CMP_RE = re.compile(
    r"^\s*(?P<key>[^\s!=<>()]+)\s*(?P<op>==|=|!=|>|<)\s*(?P<val>[^\s!=<>(),]*)\s*$"
)


def parse_label_selector(text: str | None) -> LabelSelector:
    """Parse a label selector string; an empty or missing one matches everything."""
    if text is None or not text.strip():
        return LabelSelector()
    reqs: list[Requirement] = []
    for raw in _split_top(text):
        part = raw.strip()
        if not part:
            raise SelectorError(f"unable to parse requirement: empty requirement in {text!r}")
        m = _SET_RE.match(part)
        if m:
            vals = tuple(_check_value(v.strip()) for v in m["vals"].split(","))
            reqs.append(Requirement(_check_key(m["key"]), m["op"], tuple(sorted(set(vals)))))
            continue
        m = _CMP_RE.match(part)
        if m:
            op = "=" if m["op"] == "==" else m["op"]
            val = m["val"]
            if op in (">", "<"):
                try:
                    int(val)
                except ValueError:
                    raise SelectorError(
                        f"unable to parse requirement: for '{op}' the value must be an integer,"
                        f" got {val!r}"
                    ) from None
            else:
                _check_value(val)
            reqs.append(Requirement(_check_key(m["key"]), op, (val,)))
            continue
        if part.startswith("!"):
            reqs.append(Requirement(_check_key(part[1:].strip()), "!"))
            continue
        if re.fullmatch(r"[^\s!=<>(),]+", part):
            reqs.append(Requirement(_check_key(part), "exists"))
            continue
        raise SelectorError(f"unable to parse requirement: {part!r}")
    return LabelSelector(tuple(reqs))


class _HasFieldValue(Protocol):
    def field_value(self, obj: Mapping[str, object], field: str) -> str: ...


@dataclass(frozen=True)
class FieldTerm:
    field: str
    op: str  # "=" or "!="
    value: str


@dataclass(frozen=True)
class FieldSelector:
    terms: tuple[FieldTerm, ...] = ()

    def matches(self, fields: Mapping[str, str]) -> bool:
        for t in self.terms:
            have = fields.get(t.field, "")
            if (have == t.value) != (t.op == "="):
                return False
        return True

    def matches_object(self, resource: _HasFieldValue, obj: Mapping[str, object]) -> bool:
        """Match an object, reading only the fields the selector names."""
        for t in self.terms:
            have = resource.field_value(obj, t.field)
            if (have == t.value) != (t.op == "="):
                return False
        return True

    @property
    def empty(self) -> bool:
        return not self.terms


def _split_escaped(text: str, sep: str) -> list[str]:
    out: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            cur.append(text[i : i + 2])
            i += 2
            continue
        if ch == sep:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    out.append("".join(cur))
    return out


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def parse_field_selector(
    text: str | None, supported: frozenset[str] | None = None
) -> FieldSelector:
    """Parse a field selector; ``supported`` (when given) lists the field labels allowed."""
    if text is None or not text.strip():
        return FieldSelector()
    terms: list[FieldTerm] = []
    for raw in _split_escaped(text, ","):
        part = raw.strip()
        m = re.match(r"^(?P<f>[^=!\s]+)\s*(?P<op>!=|==|=)(?P<v>.*)$", part)
        if not m:
            raise SelectorError(f"invalid selector: {part!r}; can't understand {part!r}")
        field, value = m["f"], _unescape(m["v"].strip())
        if supported is not None and field not in supported:
            raise SelectorError(f'field label not supported: "{field}"')
        terms.append(FieldTerm(field, "!=" if m["op"] == "!=" else "=", value))
    return FieldSelector(tuple(terms))


def dotted(obj: Mapping[str, object], path: str) -> str:
    """The string form of the value at a dotted path (``""`` when absent), as field selectors
    see it."""
    cur: object = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            return ""
        cur = cur.get(part)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


FieldExtractor = Callable[[Mapping[str, object]], dict[str, str]]
