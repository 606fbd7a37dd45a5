"""A re-pack plan: the fewest pod evictions that leave K more GPUs whole and free, the evicted
pods placed again by the cluster's policy elsewhere. Printed as the commands a person would
run; sharegpu runs none of them.

Only a pod a controller re-creates is evicted (an owner reference with ``controller: true``,
not a Node: a static pod's mirror is never chosen), never a bare pod, and never more pods under
a PodDisruptionBudget than its ``status.disruptionsAllowed``.

A plan targets a set of GPUs: it evicts every pod holding them, places the evicted pods again
one by one through the policy's decision (the extender's, as the re-created pods would be; they
may land anywhere, the freed GPUs included), and counts the GPUs whole and free at the end,
against before.
When at most :data:`EXACT_GPUS` GPUs could be targeted, every set of K of them is tried, fewest
evictions first: the plan is the fewest evictions among plans that evict exactly the holders of
K GPUs. Otherwise the GPUs are added greedily, fewest holders first, and the plan states a
lower bound: no plan frees K GPUs with fewer evictions than the K least-held GPUs' holders
over the most GPUs one pod holds.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import PlacementError
from ..core.nodeselector import NodeSelector
from ..core.placement.base import get_policy
from ..core.request import PodRequest
from ..core.scheduler import Scheduler
from ..core.state import ClusterState
from .cluster import Cluster, GpuPod

EXACT_GPUS = 14
GREEDY_TRIES = 200  # GPUs tried, fewest holders first
Gpu = tuple[str, int]


@dataclass
class Budget:
    """One PodDisruptionBudget: the pods it selects and the evictions it allows."""

    name: str
    namespace: str
    match: dict[str, str]
    expressions: list[tuple[str, str, tuple[str, ...]]]
    allowed: int

    def selects(self, namespace: str, labels: Mapping[str, str]) -> bool:
        if namespace != self.namespace:
            return False
        if any(labels.get(k) != v for k, v in self.match.items()):
            return False
        for key, op, values in self.expressions:
            have = labels.get(key)
            ok = {"In": have in values, "NotIn": have not in values,
                  "Exists": have is not None, "DoesNotExist": have is None}.get(op, False)
            if not ok:
                return False
        return True


def budgets(pdbs: Sequence[Mapping[str, Any]]) -> tuple[list[Budget], list[str]]:
    """The budgets, and a warning for each that cannot be read (it then allows nothing for
    the pods of its namespace)."""
    out: list[Budget] = []
    warnings: list[str] = []
    for obj in pdbs:
        meta = obj.get("metadata") or {}
        name, ns = str(meta.get("name") or "?"), str(meta.get("namespace") or "default")
        try:
            sel = (obj.get("spec") or {}).get("selector") or {}
            match = {str(k): str(v) for k, v in (sel.get("matchLabels") or {}).items()}
            exprs = [(str(e["key"]), str(e["operator"]), tuple(str(v) for v in e.get("values")
                                                                 or ()))
                     for e in sel.get("matchExpressions") or []]
            allowed = int((obj.get("status") or {}).get("disruptionsAllowed") or 0)
        except (AttributeError, KeyError, TypeError, ValueError):
            warnings.append(f"PodDisruptionBudget {ns}/{name} cannot be read: no pod of "
                            f"namespace {ns} is evicted")
            out.append(Budget(name, ns, {}, [], 0))
            continue
        out.append(Budget(name, ns, match, exprs, allowed))
    return out, warnings


@dataclass
class Plan:
    k: int
    freed: int  # GPUs whole and free after the plan, more than before
    evict: list[GpuPod]
    targets: list[Gpu]
    placed_again: dict[str, str]  # evicted pod -> the node the policy gives it
    exact: bool
    lower_bound: int
    note: str = ""
    warnings: list[str] = field(default_factory=list)
    fit: str = ""  # --fit: the pod to make room for
    skipped: dict[str, int] = field(default_factory=dict)  # why GPUs could not be targeted

    def commands(self) -> list[str]:
        """The evictions, through the Eviction API (which keeps PodDisruptionBudgets)."""
        out = []
        for p in self.evict:
            ns, name = p.key.split("/", 1)
            body = json.dumps({"apiVersion": "policy/v1", "kind": "Eviction",
                               "metadata": {"name": name, "namespace": ns}},
                              separators=(",", ":"))
            out.append(f"kubectl create --raw /api/v1/namespaces/{ns}/pods/{name}/eviction "
                       f"-f - <<< '{body}'")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            **({"fit": self.fit} if self.fit else {"free_gpus": self.k, "freed": self.freed}),
            "evictions": len(self.evict),
            "exact": self.exact, "lower_bound": self.lower_bound, "note": self.note,
            "gpus": [f"{n}/{g}" for n, g in self.targets],
            "evict": [{"pod": p.key, "node": p.node, "owner": p.owner,
                       "placed_again_on": self.placed_again.get(p.key)} for p in self.evict],
            "commands": self.commands(), "gpus_not_targeted": self.skipped,
            "warnings": self.warnings,
        }


def _whole_free(state: ClusterState) -> int:
    n = state.n
    return int((state.gpu_exists[:n] & (state.gpu_pods[:n] == 0)
                & (state.gpu_free[:n] == state.gpu_total[:n])).sum())


def _try(state: ClusterState, sched: Scheduler, cluster: Cluster, evict: Sequence[GpuPod]
         ) -> tuple[int, dict[str, str]] | None:
    """Apply the plan, measure it, undo it: (GPUs freed, where each pod went), or ``None``
    when an evicted pod finds no node."""
    before = _whole_free(state)
    held = [state.pods[p.key] for p in evict]
    for p in evict:
        sched.release(p.key)
    placed: dict[str, str] = {}
    ok = True
    for p in evict:
        d = sched.schedule(p.request, cluster.among(p.selector))
        if d is None:
            ok = False
            break
        placed[p.key] = d.node_name
    freed = _whole_free(state) - before
    for key in placed:
        sched.release(key)
    for r in held:
        try:
            state.reserve(r.request, r.node, r.alloc, check_host=False)
        except PlacementError as e:  # cannot happen: the same records, in the same state
            raise AssertionError(f"re-pack undo failed: {e}") from None
        state.bind(r.request.key)
    return (freed, placed) if ok else None


class Evictable:
    """Which pods a plan may evict (see the module), and whether a set of evictions keeps every
    PodDisruptionBudget."""

    def __init__(self, cluster: Cluster, pdbs: Sequence[Mapping[str, Any]] | None) -> None:
        self.known = pdbs is not None
        self.rules, self.warnings = budgets(pdbs or [])
        self.pods = {p.key: p for p in cluster.placed}
        self.labels = {key: p.request.labels for key, p in self.pods.items()}

    def why_not(self, key: str) -> str | None:
        p = self.pods.get(key)
        if p is None:
            return "held by a pod without a recorded decision"
        if not p.owner or p.owner.startswith("Node/"):
            return "held by a bare or static pod"
        if not self.known:
            return ("PodDisruptionBudgets unknown: dump them (kubectl get nodes,pods,pdb -A "
                    "-o json) or say there are none (--assume-no-pdbs)")
        ns = key.split("/", 1)[0]
        if any(b.allowed <= 0 and b.selects(ns, self.labels.get(key, {})) for b in self.rules):
            return "held by a pod whose PodDisruptionBudget allows no disruption"
        return None

    def within(self, evict: Sequence[GpuPod]) -> bool:
        for b in self.rules:
            n = sum(1 for p in evict
                    if b.selects(p.key.split("/", 1)[0], self.labels.get(p.key, {})))
            if n > b.allowed:
                return False
        return True


def _plan(cluster: Cluster, state: ClusterState, policy: str, k: int,
          pdbs: Sequence[Mapping[str, Any]] | None) -> Plan:
    """The plan (see the module). ``pdbs`` ``None``: the budgets are not known, so no pod
    is evicted."""
    ev = Evictable(cluster, pdbs)
    pods = ev.pods
    holders: dict[Gpu, set[str]] = {}
    for key, r in state.pods.items():
        for g in r.alloc.per_gpu_mem():
            holders.setdefault((r.node, g), set()).add(key)
    skipped: dict[str, int] = {}
    movable = ev.why_not
    within_budgets = ev.within

    candidates: list[Gpu] = []
    for gpu, keys in sorted(holders.items()):
        why = next((w for w in map(movable, sorted(keys)) if w), None)
        if why:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            candidates.append(gpu)
    candidates.sort(key=lambda g: (len(holders[g]), g))
    span = max((len(pods[key].alloc.per_gpu_mem()) for g in candidates for key in holders[g]
                if pods[key].alloc is not None), default=1)
    bound = math.ceil(sum(len(holders[g]) for g in candidates[:k]) / max(span, 1))
    pol = get_policy(policy)
    learned = cluster.learned(pol)
    learned.prepare(state)
    sched = Scheduler(state, pol, tie_break="order")

    def pods_of(targets: Sequence[Gpu]) -> list[GpuPod]:
        keys = sorted(set().union(*(holders[g] for g in targets)),
                      key=lambda x: (pods[x].created, x))
        return [pods[x] for x in keys]

    if len(candidates) < k:
        return Plan(k, 0, [], [], {}, True, bound, f"only {len(candidates)} GPUs can be "
                    "targeted", skipped=skipped)
    if len(candidates) <= EXACT_GPUS:
        sets = sorted(itertools.combinations(candidates, k),
                      key=lambda s: (len(set().union(*(holders[g] for g in s))), s))
        for targets in sets:
            evict = pods_of(targets)
            if not within_budgets(evict):
                continue
            got = _try(state, sched, cluster, evict)
            if got is not None and got[0] >= k:
                return Plan(k, got[0], evict, list(targets), got[1], True, bound,
                            "the fewest evictions of the pods holding K GPUs", skipped=skipped)
        return Plan(k, 0, [], [], {}, True, bound, "no set of GPUs can be freed: the evicted "
                    "pods would find no other node", skipped=skipped)
    targets: list[Gpu] = []
    best: tuple[int, dict[str, str]] | None = None
    for g in candidates[:GREEDY_TRIES]:
        trial = [*targets, g]
        evict = pods_of(trial)
        if not within_budgets(evict):
            continue
        got = _try(state, sched, cluster, evict)
        if got is None:
            continue
        targets, best = trial, got
        if got[0] >= k:
            break
    if best is None or best[0] < k:
        return Plan(k, best[0] if best else 0, [], [], {}, False, bound,
                    "no plan found: the evicted pods would find no other node", skipped=skipped)
    evict = pods_of(targets)
    return Plan(k, best[0], evict, targets, best[1], False, bound,
                f"greedy (more than {EXACT_GPUS} GPUs could be targeted): at least {bound} "
                "evictions are needed", skipped=skipped)


def plan(cluster: Cluster, state: ClusterState, policy: str, k: int,
         pdbs: Sequence[Mapping[str, Any]] | None) -> Plan:
    """The plan (see the module). ``pdbs`` ``None``: the budgets are not known, so no pod
    is evicted."""
    out = _plan(cluster, state, policy, k, pdbs)
    out.warnings = budgets(pdbs or [])[1]
    return out


FIT_MOST = 3  # evictions a --fit plan considers on one node
FIT_SETS = 2000  # sets of pods tried on one node, fewest evictions first


def fit(cluster: Cluster, state: ClusterState, policy: str, req: PodRequest,
        selector: NodeSelector, pdbs: Sequence[Mapping[str, Any]] | None) -> Plan:
    """The fewest evictions after which a pending pod fits: on each node the pod may go to,
    the sets of at most :data:`FIT_MOST` evictable pods there (fewest first) after which it
    fits the node; then, fewest evictions first (then the least GPU memory moved), each set is
    checked whole: the pods evicted,
    the pending pod placed by the policy (anywhere), the evicted pods placed again. Exact up to
    :data:`FIT_MOST` evictions on one node."""
    out = _fit(cluster, state, policy, req, selector, pdbs)
    out.fit = req.key
    out.warnings = budgets(pdbs or [])[1]
    return out


def _fit(cluster: Cluster, state: ClusterState, policy: str, req: PodRequest,
         selector: NodeSelector, pdbs: Sequence[Mapping[str, Any]] | None) -> Plan:
    ev = Evictable(cluster, pdbs)
    pods = ev.pods
    among = cluster.among(selector)
    pol = get_policy(policy)
    cluster.learned(pol).prepare(state)
    sched = Scheduler(state, pol, tie_break="order")
    pending = PodRequest("whatif", "fit", req.kind, req.containers, cpu_milli=req.cpu_milli,
                         mem_mib=req.mem_mib, models=req.models)
    if sched.candidates(pending, among).size:
        return Plan(0, 0, [], [], {}, True, 0, "the pod fits now: nothing to evict")
    rules_ok = state.node_mask(without_gpus(pending))
    if among is not None:
        rules_ok &= among
    skipped: dict[str, int] = {}
    options: list[tuple[int, int, str, tuple[str, ...]]] = []
    for i in np.flatnonzero(rules_ok):
        node = state.spec(int(i)).name
        keys = state.node_pods(int(i))
        ok = []
        for key in keys:
            why = ev.why_not(key)
            if why:
                skipped[why] = skipped.get(why, 0) + 1
            else:
                ok.append(key)
        tried = 0
        for size in range(1, min(FIT_MOST, len(ok)) + 1):
            found = False
            for combo in itertools.combinations(ok, size):
                tried += 1
                if tried > FIT_SETS:
                    break
                held = [state.pods[x] for x in combo]
                for x in combo:
                    state.release(x)
                fits_there = bool(state.feasible(pending, np.array([int(i)]))[0])
                for r in held:
                    state.reserve(r.request, r.node, r.alloc, check_host=False)
                    state.bind(r.request.key)
                if fits_there:
                    moved = sum(r.alloc.total_mem for r in held)
                    options.append((size, moved, node, combo))
                    found = True
            if found:
                break
    options.sort()
    for _size, _moved, node, combo in options:
        evict = [pods[x] for x in combo]
        if not ev.within(evict):
            continue
        got = _try_fit(state, sched, cluster, evict, pending, among)
        if got is not None:
            where, placed = got
            return Plan(0, 0, evict, [], placed, True, len(evict),
                        f"the pod then goes to {where} (the policy's choice; evictions on "
                        f"{node})", skipped=skipped)
    return Plan(0, 0, [], [], {}, True, FIT_MOST + 1,
                f"no plan with at most {FIT_MOST} evictions on one node", skipped=skipped)


def without_gpus(req: PodRequest) -> PodRequest:
    """The pod's rules for a node (mode, model, host resources), its GPUs left aside."""
    return PodRequest(req.namespace, req.name, req.kind, (), cpu_milli=0, mem_mib=0,
                      models=req.models)


def _try_fit(state: ClusterState, sched: Scheduler, cluster: Cluster, evict: Sequence[GpuPod],
             pending: PodRequest, among: np.ndarray | None
             ) -> tuple[str, dict[str, str]] | None:
    held = [state.pods[p.key] for p in evict]
    for p in evict:
        sched.release(p.key)
    placed: dict[str, str] = {}
    d = sched.schedule(pending, among)
    ok = d is not None
    if ok:
        for p in evict:
            e = sched.schedule(p.request, cluster.among(p.selector))
            if e is None:
                ok = False
                break
            placed[p.key] = e.node_name
    for key in placed:
        sched.release(key)
    if d is not None:
        sched.release(pending.key)
    for r in held:
        state.reserve(r.request, r.node, r.alloc, check_host=False)
        state.bind(r.request.key)
    return (d.node_name, placed) if ok and d is not None else None
