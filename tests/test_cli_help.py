"""Every command's --help states each option's real default: the text argparse prints for an
option names the value the option takes when left out, and never an empty or ``None`` one."""

from __future__ import annotations

import argparse
import re

import pytest

from sharegpu.cli import HelpFormatter, build_parser
from sharegpu.inspect_cgpu.cli import build_parser as inspect_parser


def parsers() -> dict[str, argparse.ArgumentParser]:
    root, _ = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    out = {f"sharegpu {name}": p for name, p in sub.choices.items()}
    out["kubectl inspect cgpu"] = inspect_parser()
    return out


PARSERS = parsers()


def option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    text = formatter._expand_help(action) if action.help else ""
    return " ".join(text.split())


def shown(value: object) -> set[str]:
    """The ways a default may be written: 300.0 as 300.0 or 300, a list comma-separated."""
    if isinstance(value, float) and value.is_integer():
        return {str(value), str(int(value))}
    if isinstance(value, (list, tuple)):
        return {", ".join(map(str, value)), ",".join(map(str, value))}
    return {str(value)}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_prints_no_empty_default(name):
    text = PARSERS[name].format_help()
    assert "(default: )" not in text and "default: None" not in text, name


COMPUTED = {"--id": "hostname"}  # defaults computed at start, named by what they are


def states(text: str, value: str) -> bool:
    """``text`` says ``value`` is the default: "default: VALUE", "default VALUE",
    "default 'VALUE'" or "VALUE ... (default)"."""
    v = re.escape(value)
    return bool(re.search(rf"default:? '?{v}'?(?![\w.])", text)
                or re.search(rf"(?<![\w.]){v}'?[^,;()]{{0,20}}\(default\)", text))


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_stated_default_is_the_real_one(name):
    parser = PARSERS[name]
    wrong = []
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, "", argparse.SUPPRESS):
            continue
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        flag = max(action.option_strings, key=len)
        text = option_help(parser, action)
        values = {COMPUTED[flag]} if flag in COMPUTED else shown(action.default)
        if not any(states(text, v) for v in values):
            wrong.append(f"{flag}: default {action.default!r}, help says {text!r}")
    assert not wrong, "\n".join(wrong)


def test_the_formatter_states_a_default_only_when_there_is_one():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--a", default="x", help="an a")
    p.add_argument("--b", default="", help="a b, none when left out")
    p.add_argument("--c", default=None, help="a c")
    text = " ".join(p.format_help().split())
    assert "an a (default: x)" in text
    assert "none when left out (default" not in text and "a c (default" not in text


def test_policies_prints_plain_text(capsys):
    from sharegpu.cli import main
    from sharegpu.commands.policies import plain

    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "`" not in out and ":mod:" not in out and ":class:" not in out
    assert "ACK binpack: fill the fullest node" in out
    assert plain("see :mod:`..fragmentation` and :class:`~a.B`, ``x``") == "see fragmentation and B, x"
