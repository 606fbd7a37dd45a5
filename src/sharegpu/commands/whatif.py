"""``sharegpu whatif``: a cluster replayed through every placement policy."""

from __future__ import annotations

import argparse

NAME = "whatif"
HELP = "what a cluster's GPUs hold today, what each policy would make of its pods, headroom"
DESCRIPTION = (
    "Reads a cluster (a `kubectl get nodes,pods -A -o json` dump, gzipped or not, or the live "
    "cluster) as the extender reads it. Today: per node and in total, GPU memory and compute "
    "allocated, free and stranded (free, but no pod of the shapes this cluster asks for fits "
    "there), and why each pending GPU pod does not fit. Replay: the cluster's GPU pods placed "
    "again in their order under each policy, through the core the extender runs. Headroom "
    "(--shape): how many more pods of a shape fit now and after each replay. docs/whatif.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..whatif.cli import add_arguments as whatif_arguments

    whatif_arguments(p)


def run(args: argparse.Namespace) -> int:
    from ..whatif.cli import run as whatif_run

    return whatif_run(args)
