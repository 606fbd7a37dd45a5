"""``sharegpu generate``: write the generated cluster and workload as openb-format CSVs."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "generate"
HELP = "write the generated cluster and workload as openb CSVs"


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="folder to write into (made when missing)")
    g.add_argument("--seed", type=int, default=None,
                   help="generator seed (default: the one 'sharegpu simulate' uses)")


def run(args: argparse.Namespace) -> int:
    from ..sim import generate

    seed = args.seed if args.seed is not None else generate.DEFAULT_SEED
    nodes, pods = generate.write(args.out, seed)
    print(f"wrote {nodes} ({generate.DEFAULT_NODES} nodes) and {pods} "
          f"({generate.DEFAULT_PODS} pods)")
    print(f"replay them: sharegpu simulate --trace {args.out} --workload {generate.WORKLOAD_NAME}")
    return 0
