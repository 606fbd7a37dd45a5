"""``sharegpu generate``: write the generated cluster and workload as openb-format CSVs."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "generate"
HELP = "write the generated cluster and workload as openb CSVs"


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--out", type=Path, required=True, help="folder to write into")
    g.add_argument("--seed", type=int, default=None, help="generator seed")


def run(args: argparse.Namespace) -> int:
    from ..sim import generate

    seed = args.seed if args.seed is not None else generate.DEFAULT_SEED
    nodes, pods = generate.write(args.out, seed)
    print(f"wrote {nodes} and {pods}")
    return 0
