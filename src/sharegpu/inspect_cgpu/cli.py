"""``kubectl-inspect-cgpu``: the command kubectl runs for ``kubectl inspect cgpu``.

kubectl finds any executable named ``kubectl-inspect-cgpu`` on PATH and passes it the arguments
after ``inspect cgpu``. Exit codes: 0 shown, 1 the cluster or dump could not be read, 2 bad
arguments (argparse) or an unknown node.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from ..core.errors import ValidationError
from . import render
from .model import build
from .source import SourceError, load_file, load_live

PROG = "kubectl inspect cgpu"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Show how much GPU memory (and, on core_mem nodes, compute) each shared "
        "GPU has allocated, per node and for the cluster. The cluster comes from KUBECONFIG.",
        epilog="Offline: kubectl get nodes,pods -A -o json > dump.json (with DRA: "
        "nodes,pods,resourceslices,resourceclaims); "
        "kubectl inspect cgpu --file dump.json. Exit codes: 0 shown (objects that cannot be "
        "read are left out with a warning); 1 the cluster or the dump could not be read; 2 bad "
        "arguments (or a NODE that shares no GPU memory); 3 an internal error (please report "
        "it).",
    )
    p.add_argument("nodes", nargs="*", metavar="NODE", help="show only these nodes")
    p.add_argument("-d", "--details", action="store_true",
                   help="per node, the pods holding each GPU")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text",
                   help="output format (default: text)")
    p.add_argument("--file", metavar="DUMP",
                   help="read `kubectl get nodes,pods -A -o json` output instead of the cluster "
                   "('-' for standard input)")
    p.add_argument("--context", metavar="NAME",
                   help="the kubeconfig context to use (default: its current-context)")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then "
                   "in-cluster)")
    p.add_argument("--request-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="API request timeout (default: 20)")
    p.add_argument("--what-if", action="store_true",
                   help="what each placement policy would make of this cluster's pods, and "
                   "headroom (the options of 'sharegpu whatif'; docs/whatif.md)")
    p.add_argument("--version", action="version", version=f"%(prog)s (sharegpu {__version__})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.what_if:  # kubectl's program (sharegpu.whatif.plugin) answers it before this
        print(f"{PROG}: error: --what-if is answered by the kubectl-inspect-cgpu program or "
              "'sharegpu whatif'", file=sys.stderr)
        return 2
    try:
        if args.file:
            objs = load_file(args.file)
        else:
            objs = load_live(args.kubeconfig, timeout=args.request_timeout,
                             context=args.context)
        view = build(objs.nodes, objs.pods, args.nodes or None, objs.slices, objs.claims)
    except SourceError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except ValidationError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: one line, and an exit code of its own
        print(f"{PROG}: internal error: {type(e).__name__}: {str(e)[:200]} (please report it)",
              file=sys.stderr)
        return 3
    for w in [*objs.warnings, *view.warnings]:
        print(f"{PROG}: warning: {w}", file=sys.stderr)
    try:
        if args.output == "json":
            text = render.to_json(view)
        elif args.details:
            text = render.details(view)
        else:
            text = render.summary(view)
    except Exception as e:  # a bug: one line, and an exit code of its own
        print(f"{PROG}: internal error: {type(e).__name__}: {str(e)[:200]} (please report it)",
              file=sys.stderr)
        return 3
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
