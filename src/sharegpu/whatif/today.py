"""Today: what the cluster's GPUs hold now, per node and in total, and why each pending GPU pod
does not fit (the core's own reasons, :meth:`ClusterState.explain`, counted over the nodes)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..core.placement.base import Policy
from ..core.state import ClusterState
from .cluster import Cluster, GpuPod
from .measure import GpuFigures, figures

EXPLAINED = 20  # pending pods of different requests explained node by node (about 40 ms each on
# 5,000 nodes); the rest are counted


@dataclass
class Pending:
    key: str
    fits_now: int  # nodes it fits on now (it is waiting for something else)
    reasons: list[tuple[str, int]]  # (reason, nodes) most frequent first


@dataclass
class Today:
    state: ClusterState
    figures: GpuFigures
    pending: list[Pending]
    problems: list[str]
    pending_unexplained: int = 0
    per_node: list[dict[str, object]] = field(default_factory=list)


def _reason(text: str) -> str:
    """A reason without its figures, so that nodes failing alike count together."""
    return text.split(":", 1)[0] if "GPU memory in one device" in text else text


def why_pending(cluster: Cluster, state: ClusterState, pod: GpuPod) -> Pending:
    among = cluster.among(pod.selector)
    ok = state.feasible(pod.request)
    if among is not None:
        ok &= among
    if ok.any():
        return Pending(pod.key, int(ok.sum()), [])
    reasons: Counter[str] = Counter()
    for i in range(state.n):
        if not state.active[i]:
            continue
        if among is not None and not among[i]:
            reasons["the pod's node selector or affinity does not admit the node"] += 1
            continue
        why = state.explain(pod.request, i)
        reasons[_reason(why) if why else "the containers' GPU requests do not fit together"] += 1
    if not state.n:
        reasons["no node shares GPUs"] += 1
    return Pending(pod.key, 0, reasons.most_common())


def today(cluster: Cluster, policy: Policy) -> Today:
    state, problems = cluster.state()
    learned = cluster.learned(policy)
    learned.prepare(state)
    fig = figures(state, learned.workload)
    pending: list[Pending] = []
    explained: dict[tuple[object, ...], Pending] = {}
    unexplained = 0
    for p in cluster.pending:
        shape = (p.request.kind, p.request.containers, p.request.cpu_milli, p.request.mem_mib,
                 p.selector)
        got = explained.get(shape)
        if got is None:
            if len(explained) >= EXPLAINED:
                unexplained += 1
                continue
            got = explained[shape] = why_pending(cluster, state, p)
        pending.append(Pending(p.key, got.fits_now, got.reasons))
    per_node = []
    alloc, strand = fig.allocated, fig.stranded
    core_alloc, core_strand = fig.core_allocated, fig.core_stranded
    for i, name in enumerate(fig.nodes):
        ex = fig.exists[i]
        spec = state.spec(name)
        per_node.append({
            "node": name, "mode": spec.mode.value, "model": spec.model,
            "gpus": int(ex.sum()),
            "mem_total": int(fig.total[i][ex].sum()), "mem_allocated": int(alloc[i].sum()),
            "mem_free": int(fig.free[i][ex].sum()), "mem_stranded": int(strand[i].sum()),
            "core_allocated": int(core_alloc[i].sum()),
            "core_free": int(fig.core_free_gpus[i].sum()),
            "core_stranded": int(core_strand[i].sum()),
            "gpus_free": int(fig.whole_free[i].sum()),
            "per_gpu": [[int(alloc[i, j]), int(strand[i, j]),
                         int(fig.free[i, j] - strand[i, j])] for j in np.flatnonzero(ex)],
        })
    return Today(state, fig, pending, problems, unexplained, per_node)
