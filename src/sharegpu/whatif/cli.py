"""The what-if command's arguments and run, shared by ``sharegpu whatif`` and
``kubectl inspect cgpu --what-if``. Exit codes: 0 shown; 1 the cluster or the dump could not be
read (one line: what is wrong, how to make the dump); 2 bad arguments."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from ..core.errors import ShareGpuError, ValidationError
from ..core.nodeselector import NodeSelector
from ..core.placement.base import get_policy
from ..inspect_cgpu.source import Objects, SourceError, load_file, load_live
from ..kubeio.gcpause import gc_paused
from .analysis import Options, analyse
from .cluster import read
from .headroom import RULE_SHAPE, parse_shape, shape_from_pod

HOW = "write the dump with: kubectl get nodes,pods -A -o json > FILE (or | gzip > FILE.gz)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", nargs="?", metavar="DUMP",
                   help="`kubectl get nodes,pods -A -o json` output, gzipped or not ('-' for "
                   "standard input); without it, the live cluster (KUBECONFIG)")
    p.add_argument("--policy", action="append", metavar="NAME",
                   help="replay under this policy (repeatable; default: every policy of "
                   "'sharegpu policies')")
    p.add_argument("--current-policy", metavar="NAME",
                   help="the policy the cluster's extender runs, marked in the replay (default: "
                   "read from the extender's Pod in the dump or cluster, when it is there)")
    p.add_argument("--orderings", type=int, default=5, metavar="N",
                   help="orderings replayed where pods share a creation second and the "
                   "extender's decision order is not recorded (mean ± sd over them)")
    p.add_argument("--shape", metavar="SHAPE|POD.yaml",
                   help="headroom: how many more pods of this shape fit now and after each "
                   "replay; " + RULE_SHAPE.replace("must be", "") + ", or a Pod manifest file")
    p.add_argument("--free-gpus", type=int, metavar="K",
                   help="a re-pack plan: the fewest evictions of pods a controller re-creates "
                   "that leave K more GPUs whole and free (printed, never run)")
    p.add_argument("--fit", metavar="POD.yaml",
                   help="a re-pack plan: the fewest evictions after which this pod (a Pod "
                   "manifest) fits (printed, never run)")
    p.add_argument("--assume-no-pdbs", action="store_true",
                   help="the cluster has no PodDisruptionBudget (else a plan evicts only where "
                   "the dump's PodDisruptionBudgets allow it: kubectl get nodes,pods,pdb -A "
                   "-o json)")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="per-GPU bars of allocated / stranded / free memory, one panel per "
                   "policy (needs matplotlib: pip install 'sharegpu[plot]')")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then "
                   "in-cluster)")
    p.add_argument("--context", metavar="NAME", help="the kubeconfig context to use")
    p.add_argument("--request-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="API request timeout")


def _pod_file(flag: str, text: str) -> tuple:
    import yaml

    try:
        obj = yaml.safe_load(Path(text).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValidationError(flag, text, f"cannot be read ({e.strerror or e})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValidationError(flag, text, f"is not YAML ({e})") from None
    return shape_from_pod(obj, flag)


def _shape(text: str | None) -> tuple | None:
    if not text:
        return None
    path = Path(text)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.is_file():
        return _pod_file("--shape", text)
    return parse_shape(text), NodeSelector()


def _check_plot(path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValidationError("--plot", str(path), "needs matplotlib: pip install "
                              "'sharegpu[plot]' (or pip install matplotlib)") from None
    parent = path.expanduser().resolve().parent
    if not parent.is_dir():
        raise ValidationError("--plot", str(path), f"directory {parent} does not exist")


def load(args: argparse.Namespace) -> Objects:
    if args.dump:
        objs = load_file(args.dump)
        where = "standard input" if args.dump == "-" else args.dump
        if not objs.pods:
            raise SourceError(f"--file {where}: holds no Pod objects; {HOW}")
        return objs
    return load_live(args.kubeconfig, timeout=args.request_timeout, context=args.context,
                     with_pdbs=bool(args.free_gpus or args.fit))


def run(args: argparse.Namespace, prog: str = "sharegpu whatif") -> int:
    if args.orderings < 1:
        raise ValidationError("--orderings", args.orderings, "must be at least 1")
    if args.free_gpus is not None and args.free_gpus < 1:
        raise ValidationError("--free-gpus", args.free_gpus, "must be at least 1")
    for name in [*(args.policy or []), *([args.current_policy] if args.current_policy else [])]:
        get_policy(name)  # the name is checked before anything is read
    shape = _shape(args.shape)
    if args.free_gpus and args.fit:
        raise ValidationError("--fit", args.fit, "cannot be asked for with --free-gpus")
    to_fit = _pod_file("--fit", args.fit) if args.fit else None
    if args.plot:
        _check_plot(args.plot)
    with gc_paused():
        return _run(args, prog, shape, to_fit)


def _run(args: argparse.Namespace, prog: str, shape: tuple | None, to_fit: tuple | None
         ) -> int:
    try:
        objs = load(args)
    except SourceError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    cluster = read(objs.nodes, objs.pods)
    cluster.warnings[:0] = objs.warnings
    if not cluster.specs:
        where = args.dump or "the cluster"
        print(f"{prog}: error: {where}: no node shares GPUs (none advertises aliyun.com/"
              "gpu-mem, nvidia.com/gpu or aliyun.com/gpu); " + HOW, file=sys.stderr)
        return 1
    options = Options(policies=args.policy or (), current=args.current_policy,
                      orderings=args.orderings, shape=shape, per_gpu=bool(args.plot))
    a = analyse(cluster, options)
    if args.free_gpus or to_fit is not None:
        from .repack import fit, plan

        pdbs: list | None = objs.pdbs
        if args.assume_no_pdbs:
            pdbs = []
        elif not pdbs or any(o.get("unreadable") for o in pdbs):
            pdbs = None
        policy = a.current or "default"
        a.repack = (plan(cluster, a.today.state, policy, args.free_gpus, pdbs) if to_fit is None
                    else fit(cluster, a.today.state, policy, *to_fit, pdbs))
    if args.json:
        print(json.dumps(a.to_json(), indent=1))
    else:
        from rich.console import Console

        from .render import show

        show(a, Console())
    if args.plot:
        from .render import plot

        plot(a, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None, prog: str = "sharegpu whatif") -> int:
    """Run as a program of its own (the kubectl plugin's ``--what-if``)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args, prog)
    except ShareGpuError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141
