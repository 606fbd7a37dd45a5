"""``sharegpu policies``: the placement policies, each with what it does."""

from __future__ import annotations

import argparse
import re
import sys

NAME = "policies"
HELP = "list the placement policies and what each does"


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


_ROLE = re.compile(r":[a-z]+:`(~?)\.*([^`]+)`")  # :mod:`..x`, :class:`~a.B`


def plain(text: str) -> str:
    """reStructuredText markup out of a docstring's sentence: ``x``, `x` and :role:`x` are x
    (:role:`~a.b` is b, as Sphinx shows it)."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2),
                     text)
    return text.replace("``", "").replace("`", "")


def describe(name: str) -> str:
    """The first sentence of the policy module's docstring, as plain text."""
    from ..core.placement.base import _REGISTRY, _load_all

    _load_all()
    doc = sys.modules[_REGISTRY[name].__module__].__doc__ or ""
    text = " ".join(doc.split())
    end = text.find(". ")
    return plain(text if end < 0 else text[: end + 1])


def run(args: argparse.Namespace) -> int:
    from ..core.placement.base import ALIASES, available

    names = available()
    width = max(len(n) for n in [*names, *ALIASES])
    for name in names:
        print(f"{name:<{width}}  {describe(name)}")
    for alias, real in ALIASES.items():
        print(f"{alias:<{width}}  the default: {real}")
    return 0
