"""The cluster's GPU pods placed again under a policy, as the extender would have placed them
had it run that policy from the start.

The state starts with the nodes (in the order listed, the extender's tie-break order) and the
CPU and memory of every pod that is not a GPU pod (kube-scheduler placed those; they stay).
The policy is prepared with the target workload the extender learns from the cluster's placed
pods (:meth:`.cluster.Cluster.learned`). Every GPU pod, bound or pending, then comes in its
order (:func:`orderings`), each through the core's one decision
(:class:`~sharegpu.core.scheduler.Scheduler`, ties to the first node in list order, as in the
extender) among the nodes its node selector admits. The figures are those of the end: the
bound pods placed again (or not), and the pending ones that found a node.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core.placement.base import get_policy
from ..core.scheduler import Scheduler
from ..core.state import ClusterState
from .cluster import Cluster, GpuPod
from .headroom import fits
from .measure import GpuFigures, figures

Holders = dict[tuple[str, int], frozenset[tuple[str, int]]]


def holders(state: ClusterState) -> Holders:
    """Per (node, GPU): the pods holding it and their memory there."""
    out: dict[tuple[str, int], set[tuple[str, int]]] = {}
    for key, r in state.pods.items():
        for gpu, mem in r.alloc.per_gpu_mem().items():
            out.setdefault((r.node, gpu), set()).add((key, mem))
    return {k: frozenset(v) for k, v in out.items()}


def differences(a: Holders, b: Holders) -> int:
    """GPUs whose holders (pod and memory) differ between two states."""
    return sum(1 for k in set(a) | set(b) if a.get(k) != b.get(k))


@dataclass
class Run:
    """One ordering's replay."""

    totals: dict[str, int]
    placed: int  # bound GPU pods placed again
    unplaced: list[str]  # bound GPU pods that found no node
    pending_fit: int  # pending GPU pods that found a node
    headroom: int | None
    nodes: dict[str, str | None]  # bound pod -> its node in the replay
    differences: int  # GPUs held otherwise than today
    seconds: float  # CPU time of the replay
    per_gpu: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)

    @property
    def unplaced_count(self) -> int:
        return len(self.unplaced)


@dataclass
class PolicyReplay:
    policy: str
    runs: list[Run]
    current: bool = False

    def stat(self, name: str) -> tuple[float, float]:
        values = [float(r.totals[name] if name in r.totals else getattr(r, name) or 0)
                  for r in self.runs]
        return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def orderings(cluster: Cluster, count: int, seed: int = 0) -> tuple[str, list[list[GpuPod]]]:
    """How the GPU pods are ordered (a sentence) and the orderings to replay: creation order;
    pods created in the same second (the API server keeps whole seconds) in the order the
    extender decided them where each records it (its assume-time annotation), else drawn at
    random in each of ``count`` orderings."""
    pods = sorted(cluster.pods, key=lambda p: (p.created, p.assumed, p.key))
    groups: dict[str, list[GpuPod]] = {}
    for p in pods:
        groups.setdefault(p.created, []).append(p)
    unknown = [g for g in groups.values()
               if len(g) > 1 and len({p.assumed for p in g if p.assumed}) < len(g)]
    if not unknown:
        how = "creation order" + (", the same second in the extender's decision order"
                                  if len(groups) < len(pods) else "")
        return how, [pods]
    if count <= 1:
        return "creation order, the same second by the extender's decision order, else by name", [
            pods]
    tied = sum(len(g) for g in unknown)
    drawn = {id(g) for g in unknown}
    out = []
    for s in range(count):
        rng = np.random.default_rng([seed, s])
        order: list[GpuPod] = []
        for g in groups.values():
            if id(g) in drawn:
                g = [g[int(k)] for k in rng.permutation(len(g))]
            order.extend(g)
        out.append(order)
    return (f"creation order; {tied} pods created in the same second as others, without the "
            f"extender's decision order, in {count} random orders", out)


def replay_one(cluster: Cluster, policy: str, order: Sequence[GpuPod], today: Holders,
               shape: tuple | None = None, seed: int = 0, keep_gpus: bool = False) -> Run:
    started = time.process_time()
    state = cluster.empty_state()
    pol = get_policy(policy)
    learned = cluster.learned(pol)
    learned.prepare(state)
    sched = Scheduler(state, pol, seed=seed, tie_break="order")
    placed_on: dict[str, str | None] = {}
    unplaced: list[str] = []
    fit = placed = 0
    for p in order:
        d = sched.schedule(p.request, cluster.among(p.selector))
        placed_on[p.key] = d.node_name if d is not None else None
        if not p.bound:
            fit += d is not None
        elif d is None:
            unplaced.append(p.key)
        else:
            placed += 1
    fig = figures(state, learned.workload)
    room = None
    if shape is not None:
        req, selector_mask = shape
        room = fits(state, req, selector_mask)
    diff = differences(today, holders(state))
    run = Run(fig.totals(), placed, unplaced, fit, room, placed_on, diff,
              time.process_time() - started)
    if keep_gpus:
        run.per_gpu = gpu_rows(fig)
    return run


def gpu_rows(fig: GpuFigures) -> dict[str, list[tuple[int, int, int]]]:
    """Per node: (allocated, stranded, free) memory of each GPU."""
    alloc, strand = fig.allocated, fig.stranded
    out = {}
    for i, name in enumerate(fig.nodes):
        g = int(fig.exists[i].sum())
        out[name] = [(int(alloc[i, j]), int(strand[i, j]),
                      int(fig.free[i, j] - strand[i, j])) for j in range(g)]
    return out


def replay(cluster: Cluster, policies: Sequence[str], orders: list[list[GpuPod]],
           today_state: ClusterState, current: str | None = None,
           shape: tuple | None = None, keep_gpus: bool = False) -> list[PolicyReplay]:
    today = holders(today_state)
    out = []
    for name in policies:
        runs = [replay_one(cluster, name, order, today, shape, keep_gpus=keep_gpus and i == 0)
                for i, order in enumerate(orders)]
        out.append(PolicyReplay(name, runs, current=name == current))
    return out
