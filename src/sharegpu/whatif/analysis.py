"""One what-if analysis of a cluster: Today, the Replay under each policy, the Headroom of a
shape, as one JSON-able document (what ``--json`` prints and the table shows)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.nodeselector import NodeSelector
from ..core.placement.base import Policy, available, resolve
from ..core.request import PodRequest
from .cluster import Cluster
from .headroom import describe, fits
from .policyreplay import PolicyReplay, orderings, replay
from .today import Today, today

POLICY_SOURCE = {"flag": "--current-policy", "dump": "the extender's Pod in the dump (--policy)"}


@dataclass
class Options:
    policies: Sequence[str] = ()  # empty: every policy
    current: str | None = None  # --current-policy
    orderings: int = 5
    shape: tuple[PodRequest, NodeSelector] | None = None
    per_gpu: bool = False  # keep per-GPU figures (for --plot)


@dataclass
class Analysis:
    cluster: Cluster
    today: Today
    replays: list[PolicyReplay]
    order: str
    current: str | None
    current_from: str | None
    shape: tuple[PodRequest, NodeSelector] | None
    headroom_now: int | None
    seconds: dict[str, float]
    repack: Any = None  # a .repack.Plan, when one was asked for

    def to_json(self) -> dict[str, Any]:
        t = self.today
        doc: dict[str, Any] = {
            "units": {"mem": "GiB", "core": "percent of a GPU"},
            "today": {
                "totals": t.figures.totals(),
                "nodes": t.per_node,
                "pending": [{"pod": p.key, "fits_now_on_nodes": p.fits_now,
                             "reasons": [{"reason": r, "nodes": n} for r, n in p.reasons]}
                            for p in t.pending],
                "pending_not_explained": t.pending_unexplained,
                "problems": t.problems,
            },
            "replay": {
                "order": self.order,
                "current_policy": self.current,
                "current_policy_from": self.current_from,
                "bound_gpu_pods": len(self.cluster.bound),
                "pending_gpu_pods": len(self.cluster.pending),
                "policies": [_policy_json(r) for r in self.replays],
            },
            "warnings": self.cluster.warnings,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }
        if self.shape is not None:
            doc["headroom"] = {"shape": describe(self.shape[0]), "now": self.headroom_now,
                               "after_replay": {r.policy: _mean_sd(r, "headroom")
                                                for r in self.replays}}
        if self.repack is not None:
            doc["repack"] = {"policy": self.current or "default", **self.repack.to_json()}
        return doc


def _mean_sd(r: PolicyReplay, name: str) -> dict[str, float]:
    mean, sd = r.stat(name)
    return {"mean": round(mean, 3), "sd": round(sd, 3)}


def _policy_json(r: PolicyReplay) -> dict[str, Any]:
    first = r.runs[0]
    out: dict[str, Any] = {
        "policy": r.policy, "current": r.current, "orderings": len(r.runs),
        **{k: _mean_sd(r, k) for k in first.totals},
        "placed": _mean_sd(r, "placed"),
        "unplaced": _mean_sd(r, "unplaced_count"),
        "pending_that_fit": _mean_sd(r, "pending_fit"),
        "gpus_held_otherwise_than_today": _mean_sd(r, "differences"),
        "unplaced_pods": first.unplaced[:50],
        "cpu_seconds": round(sum(x.seconds for x in r.runs), 3),
    }
    return out


def analyse(cluster: Cluster, options: Options) -> Analysis:
    secs: dict[str, float] = {}
    t0 = time.process_time()
    now = today(cluster, Policy())
    shape = options.shape
    among = None
    if shape is not None:
        among = cluster.among(shape[1])
    headroom_now = fits(now.state, shape[0], among) if shape is not None else None
    secs["today_cpu"] = time.process_time() - t0
    current, current_from = None, None
    if options.current:
        current, current_from = options.current, POLICY_SOURCE["flag"]
    elif cluster.extender_policy:
        current, current_from = cluster.extender_policy, POLICY_SOURCE["dump"]
    policies = list(options.policies) or available()
    how, orders = orderings(cluster, options.orderings)
    replays = replay(cluster, policies, orders, now.state,
                     resolve(current) if current else None,
                     (shape[0], among) if shape is not None else None, options.per_gpu)
    for r in replays:
        if current and resolve(current) == resolve(r.policy):
            r.current = True
        secs[f"replay_cpu:{r.policy}"] = sum(x.seconds for x in r.runs)
    return Analysis(cluster, now, replays, how, current, current_from, shape, headroom_now,
                    secs)

