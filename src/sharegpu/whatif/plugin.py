"""``kubectl-inspect-cgpu``, the program kubectl runs for ``kubectl inspect cgpu``: inspect's,
or with ``--what-if`` the what-if analysis of the same cluster (``--file DUMP``, or the live
one from the same kubeconfig), with whatif's options (``sharegpu whatif --help``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..inspect_cgpu import cli as inspect_cli
from . import cli as whatif_cli

FLAG = "--what-if"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if FLAG not in args:
        return inspect_cli.main(args)
    args.remove(FLAG)
    out: list[str] = []
    i = 0
    while i < len(args):  # inspect's --file DUMP is whatif's DUMP
        a = args[i]
        if a == "--file" and i + 1 < len(args):
            out.append(args[i + 1])
            i += 2
            continue
        out.append(a.removeprefix("--file=") if a.startswith("--file=") else a)
        i += 1
    return whatif_cli.main(out, prog=f"{inspect_cli.PROG} {FLAG}")
