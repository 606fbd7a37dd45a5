"""The ``sharegpu`` command line.

Every module in :mod:`sharegpu.commands` is one subcommand: it defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``. Bad arguments get a message naming the
argument and the rule (exit code 2), never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

from . import __version__
from .commands.argtypes import parse_seeds, positive_float
from .core.errors import ShareGpuError

__all__ = ["main", "parse_seeds", "positive_float"]


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it. An option
    whose default is empty (``None``, ``False``, ``""``) shows none: its text says what leaving
    it out means."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, "", argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with exit code 2 and one clear line on bad arguments."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def commands() -> dict[str, ModuleType]:
    from . import commands as pkg

    out = {}
    for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{pkg.__name__}.{m.name}")
        if hasattr(mod, "NAME"):
            out[mod.NAME] = mod
    return out


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    p = Parser(prog="sharegpu", description="GPU sharing for Kubernetes")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    cmds = commands()
    for name, mod in cmds.items():
        sp = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                            formatter_class=HelpFormatter)
        mod.add_arguments(sp)
    return p, cmds


def main(argv: Sequence[str] | None = None) -> int:
    parser, cmds = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # nothing asked: what there is to ask
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    try:
        code = int(cmds[args.command].run(args) or 0)
        # buffered output (no PYTHONUNBUFFERED) meets a closed pipe here, not at exit
        sys.stdout.flush()
        return code
    except ShareGpuError as e:
        print(f"sharegpu {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (``sharegpu simulate --json | head``): stop quietly, and keep
        # Python from failing again while it flushes stdout at exit
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a process killed by SIGPIPE
    except OSError as e:  # a file or directory named on the command line
        where = f"{e.filename}: " if e.filename else ""
        print(f"sharegpu {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
