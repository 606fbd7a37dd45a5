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

from ..core.errors import PlacementError
from ..core.placement.base import get_policy
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
            "free_gpus": self.k, "freed": self.freed, "evictions": len(self.evict),
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


def _plan(cluster: Cluster, state: ClusterState, policy: str, k: int,
         pdbs: Sequence[Mapping[str, Any]] | None) -> Plan:
    """The plan (see the module). ``pdbs`` ``None``: the budgets are not known, so no pod
    is evicted."""
    rules, _ = budgets(pdbs or [])
    pods = {p.key: p for p in cluster.placed}
    labels = {key: p.request.labels for key, p in pods.items()}
    holders: dict[Gpu, set[str]] = {}
    for key, r in state.pods.items():
        for g in r.alloc.per_gpu_mem():
            holders.setdefault((r.node, g), set()).add(key)
    skipped: dict[str, int] = {}

    def movable(key: str) -> str | None:
        p = pods.get(key)
        if p is None:
            return "held by a pod without a recorded decision"
        if not p.owner or p.owner.startswith("Node/"):
            return "held by a bare or static pod"
        if pdbs is None:
            return ("PodDisruptionBudgets unknown: dump them (kubectl get nodes,pods,pdb -A "
                    "-o json) or say there are none (--assume-no-pdbs)")
        ns = key.split("/", 1)[0]
        if any(b.allowed <= 0 and b.selects(ns, labels.get(key, {})) for b in rules):
            return "held by a pod whose PodDisruptionBudget allows no disruption"
        return None

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

    def within_budgets(evict: Sequence[GpuPod]) -> bool:
        for b in rules:
            n = sum(1 for p in evict if b.selects(p.key.split("/", 1)[0], labels.get(p.key, {})))
            if n > b.allowed:
                return False
        return True

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
