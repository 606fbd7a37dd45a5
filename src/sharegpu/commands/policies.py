"""``sharegpu policies``: list the placement policies."""

from __future__ import annotations

import argparse

NAME = "policies"
HELP = "list the placement policies"


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from ..placement.base import ALIASES, available

    for name in available():
        print(name)
    for alias, real in ALIASES.items():
        print(f"{alias} -> {real}")
    return 0
