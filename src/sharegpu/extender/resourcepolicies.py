"""ResourcePolicy in the extender: the policies watched from the API server, the pods of each
policy counted per unit from the informer's pod events, and the two places a decision is made —
filter (:meth:`ResourcePolicies.restrict`: only the nodes of the unit the pod goes to pass) and
bind (:meth:`ResourcePolicies.claim`: the unit is checked again, counted at once, and its
``podLabels``/``podAnnotations``, the unit annotation and the deletion cost go on the pod in the
bind's patch).

Counting is incremental: each pod event moves at most one count. A pod counts in a unit of its
policy when it carries the unit annotation (``resourcepolicy.sharegpu.io/unit``) and is bound, or
is bound without one (placed before the policy, or by another scheduler) on a node of a unit —
unless ``ignorePreviousPod`` and created before the policy. A bind in flight counts from the
moment it is claimed until its pod's bound event arrives (or it fails). Everything is rebuilt
from the pods at a relist, so a restart or a new leader counts what the annotations say.
The pure rules are in :mod:`sharegpu.core.resourcepolicy`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import ValidationError
from ..core.resourcepolicy import (
    ANN_DELETION_COST,
    ANN_UNIT,
    API_VERSION,
    PLURAL,
    ResourcePolicy,
    Usage,
    choose_unit,
    parse_policy,
    parse_time,
    parse_unit_annotation,
    pick_policy,
    reachable_units,
    waited,
    why_not,
)
from .kube import NODES, PODS, ApiError, Gone, KubeApi

log = logging.getLogger(__name__)

PATH = f"/apis/{API_VERSION}/{PLURAL}"

# (policy key, group, unit, terminating)
Share = tuple[str, tuple[str | None, ...], int, bool]


@dataclass(frozen=True)
class _Pod:
    labels: Mapping[str, str]
    node: str
    unit: tuple[str, int] | None  # from the unit annotation
    created: float
    terminating: bool
    ended: bool


@dataclass(frozen=True)
class Claim:
    """What a bind writes on the pod (labels and annotations) for its unit."""
    policy: str
    unit: int
    labels: Mapping[str, str]
    annotations: Mapping[str, str]


class _PodUsage(Usage):
    def __init__(self, owner: ResourcePolicies, policy: ResourcePolicy,
                 group: tuple[str | None, ...], own: Share | None) -> None:
        self.o, self.p, self.g, self.own = owner, policy, group, own

    def count(self, unit: int) -> int:
        k = self.p.key
        n = self.o.counts[(k, self.g, unit, False)]
        if not self.p.ignore_terminating_pod:
            n += self.o.counts[(k, self.g, unit, True)]
        own = self.own
        if own is not None and own[:3] == (k, self.g, unit) and (
                not own[3] or not self.p.ignore_terminating_pod):
            n -= 1  # the pod asking does not count against itself
        return n

    def terminating(self, unit: int) -> bool:
        n = self.o.terminating_in[(self.p.key, unit)]
        own = self.own
        if own is not None and own[3] and own[0] == self.p.key and own[2] == unit:
            n -= 1
        return n > 0


class ResourcePolicies:
    """The policies and the unit counts of one extender replica. ``clock``: seconds since the
    epoch (injectable, for the ``whenTryNextUnits`` timeout)."""

    def __init__(self, clock: Callable[[], float] = time.time, retry_s: float = 2.0,
                 absent_retry_s: float = 30.0) -> None:
        self.clock = clock
        self.retry_s = retry_s
        self.absent_retry_s = absent_retry_s
        self.policies: dict[str, dict[str, ResourcePolicy]] = {}  # namespace -> name -> policy
        self.problems: dict[str, str] = {}  # policy key -> why it is ignored
        self.node_labels: dict[str, Mapping[str, str]] = {}
        self.pods: dict[str, _Pod] = {}
        self.by_ns: dict[str, set[str]] = {}
        self.claims: dict[str, Share] = {}
        self.share: dict[str, Share] = {}  # what each pod counts now (claim or record)
        self.counts: Counter[Share] = Counter()
        self.terminating_in: Counter[tuple[str, int]] = Counter()
        self.synced = False  # the policies were listed (or the CRD is not installed)
        self.crd_missing = False

    # -- policies ---------------
    def set_policies(self, objs: Iterable[Mapping[str, Any]]) -> None:
        old = self.policies
        self.policies, self.problems = {}, {}
        for obj in objs:
            self._add_policy(obj)
        for ns in set(old) | set(self.policies):
            if old.get(ns) != self.policies.get(ns):
                self._recount(ns)

    def upsert_policy(self, obj: Mapping[str, Any]) -> None:
        ns = _ns(obj)
        before = dict(self.policies.get(ns, {}))
        self._drop_policy(ns, _name(obj))
        self._add_policy(obj)
        if before != self.policies.get(ns, {}):
            self._recount(ns)

    def delete_policy(self, obj: Mapping[str, Any]) -> None:
        ns = _ns(obj)
        if self._drop_policy(ns, _name(obj)):
            self._recount(ns)
        self.problems.pop(f"{ns}/{_name(obj)}", None)

    def _add_policy(self, obj: Mapping[str, Any]) -> None:
        key = f"{_ns(obj)}/{_name(obj)}"
        try:
            p = parse_policy(obj)
        except ValidationError as e:
            # refused by the CRD's schema and the webhook; one that got in anyway is ignored
            self.problems[key] = str(e)
            log.warning("ResourcePolicy %s ignored: %s", key, e)
            return
        self.problems.pop(key, None)
        self.policies.setdefault(p.namespace, {})[p.name] = p

    def _drop_policy(self, ns: str, name: str) -> bool:
        got = self.policies.get(ns, {}).pop(name, None)
        if ns in self.policies and not self.policies[ns]:
            del self.policies[ns]
        return got is not None

    def policy_for(self, namespace: str, labels: Mapping[str, str]) -> ResourcePolicy | None:
        ps = self.policies.get(namespace)
        return pick_policy(list(ps.values()), labels) if ps else None

    # -- pods and nodes (fed by the informer) ---------------
    def reset(self, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
              ) -> None:
        """Rebuild every count from listed nodes and pods (claims in flight are kept)."""
        self.node_labels = {_name(n): _labels(n) for n in nodes}
        self.pods, self.by_ns, self.share = {}, {}, {}
        self.counts.clear()
        self.terminating_in.clear()
        for obj in pods:
            key = _key(obj)
            self.pods[key] = _record(obj)
            self.by_ns.setdefault(_ns(obj), set()).add(key)
        for key in (*self.pods, *self.claims):
            self._apply(key)

    def on_event(self, path: str, kind: str, obj: Mapping[str, Any]) -> None:
        if path == NODES:
            if kind == "DELETED":
                self.node_labels.pop(_name(obj), None)
            else:
                self.node_labels[_name(obj)] = _labels(obj)
            return
        if path != PODS:
            return
        key = _key(obj)
        if kind == "DELETED":
            self.pods.pop(key, None)
            self.by_ns.get(_ns(obj), set()).discard(key)
            self.claims.pop(key, None)
        else:
            rec = _record(obj)
            self.pods[key] = rec
            self.by_ns.setdefault(_ns(obj), set()).add(key)
            if rec.node or rec.ended:
                self.claims.pop(key, None)  # the pod's own record counts it from now on
        self._apply(key)

    def _recount(self, ns: str) -> None:
        for key in list(self.by_ns.get(ns, ())):
            self._apply(key)
        for key in list(self.claims):
            if key.startswith(ns + "/"):
                self._apply(key)

    def _record_share(self, key: str) -> Share | None:
        rec = self.pods.get(key)
        if rec is None or rec.ended or not rec.node:
            return None
        p = self.policy_for(key.split("/", 1)[0], rec.labels)
        if p is None:
            return None
        if rec.unit is not None:
            if rec.unit[0] != p.name or rec.unit[1] >= len(p.units):
                return None
            unit: int | None = rec.unit[1]
        else:
            if p.ignore_previous_pod and rec.created < p.created:
                return None
            unit = p.unit_of_node(self.node_labels.get(rec.node, {}))
        if unit is None:
            return None
        return (p.key, p.group(rec.labels), unit, rec.terminating)

    def _apply(self, key: str) -> None:
        new = self.claims.get(key) or self._record_share(key)
        old = self.share.get(key)
        if new == old:
            return
        for s, d in ((old, -1), (new, 1)):
            if s is None:
                continue
            self.counts[s] += d
            if self.counts[s] <= 0:
                del self.counts[s]
            if s[3]:
                t = (s[0], s[2])
                self.terminating_in[t] += d
                if self.terminating_in[t] <= 0:
                    del self.terminating_in[t]
        if new is None:
            self.share.pop(key, None)
        else:
            self.share[key] = new

    def unit_counts(self, policy_key: str) -> dict[int, int]:
        """Pods counted in each unit of a policy, every group and terminating pod included
        (for tests and inspection)."""
        out: Counter[int] = Counter()
        for (k, _g, u, _t), n in self.counts.items():
            if k == policy_key:
                out[u] += n
        return dict(out)

    # -- decisions ---------------
    def _decide(self, key: str, labels: Mapping[str, str], created: float
                ) -> tuple[ResourcePolicy, list[int], _PodUsage] | None:
        p = self.policy_for(key.split("/", 1)[0], labels)
        if p is None:
            return None
        usage = _PodUsage(self, p, p.group(labels), self.share.get(key))
        return p, reachable_units(p, usage, waited(created, self.clock())), usage

    def restrict(self, pod: Mapping[str, Any], passed: list[str],
                 unresolvable: dict[str, str]) -> list[str]:
        """The nodes of ``passed`` the pod may go to under its ResourcePolicy (all of them when
        none selects it); the others get the reason in ``unresolvable``."""
        if not self.policies:
            return passed
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if not isinstance(labels, Mapping):
            return passed
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
        got = self._decide(key, labels, parse_time(meta.get("creationTimestamp")))
        if got is None:
            return passed
        p, reach, usage = got
        nodes = self.node_labels
        at: dict[int, list[str]] = {}

        def fits(u: int) -> bool:
            unit = p.units[u]
            at[u] = [n for n in passed if unit.has_node(nodes.get(n, {}))]
            return bool(at[u])

        chosen = choose_unit(reach, fits)
        if chosen is None:
            reason = why_not(p, usage, reach)
            for n in passed:
                unresolvable[n] = reason
            return []
        keep = at[chosen]
        if len(keep) < len(passed):
            inside = set(keep)
            reason = (f"ResourcePolicy {p.key}: not a node of unit {chosen}, the unit this pod "
                      "goes to now")
            for n in passed:
                if n not in inside:
                    unresolvable[n] = reason
        return keep

    def claim(self, namespace: str, name: str, labels: Mapping[str, str], node: str
              ) -> Claim | None:
        """At bind: the unit ``node`` gives the pod, checked against the counts now and
        counted at once (until :meth:`release` or the pod's bound event). None when no policy
        selects the pod; ValidationError when the node is in no unit the pod may use now."""
        key = f"{namespace}/{name}"
        rec = self.pods.get(key)
        if rec is not None:
            labels = rec.labels
        got = self._decide(key, labels, rec.created if rec is not None else 0.0)
        if got is None:
            return None
        p, reach, usage = got
        labels_of_node = self.node_labels.get(node, {})
        unit = p.unit_of_node(labels_of_node, reach)
        if unit is None:
            raise ValidationError("node", node, _refusal(p, usage, reach,
                                                         p.unit_of_node(labels_of_node)))
        self.claims[key] = (p.key, p.group(labels), unit, False)
        self._apply(key)
        u = p.units[unit]
        anns = {**u.pod_annotations, ANN_UNIT: p.unit_annotation(unit),
                ANN_DELETION_COST: str(p.deletion_cost(unit))}
        return Claim(p.key, unit, dict(u.pod_labels), anns)

    def release(self, namespace: str, name: str) -> None:
        """A claimed bind failed: the pod counts as its record says again."""
        key = f"{namespace}/{name}"
        if self.claims.pop(key, None) is not None:
            self._apply(key)

    # -- the watch of ResourcePolicy objects ---------------
    async def run(self, api: KubeApi) -> None:
        """List and watch ResourcePolicies until cancelled. The CRD not installed (404): no
        policies, looked for again every ``absent_retry_s``."""
        warned = False
        failures = 0  # watches refused in a row
        while True:
            try:
                items, rv = await api.list(PATH)
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                if e.status == 404:
                    if not warned:
                        log.warning("ResourcePolicy CRD (%s) not installed: no policies",
                                    PATH)
                        warned = True
                    self.set_policies([])
                    self.crd_missing = self.synced = True
                    await asyncio.sleep(self.absent_retry_s)
                else:
                    log.warning("listing ResourcePolicies failed: %s", e)
                    await asyncio.sleep(self.retry_s)
                continue
            except Exception as e:  # connection trouble
                log.warning("listing ResourcePolicies failed: %s", e)
                await asyncio.sleep(self.retry_s)
                continue
            self.set_policies(items)
            self.crd_missing, self.synced, warned = False, True, False
            try:
                async for kind, obj in api.watch(PATH, rv):
                    failures = 0
                    if kind == "DELETED":
                        self.delete_policy(obj)
                    elif kind in ("ADDED", "MODIFIED"):
                        self.upsert_policy(obj)
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                if isinstance(e, Gone):  # history compacted: list again at once
                    continue
                # refused (403: the ServiceAccount may list but not watch, a broken RBAC): say
                # so loudly and back off; policy changes are seen at each list meanwhile
                failures += 1
                delay = min(self.retry_s * 2 ** min(failures, 6), 30.0)
                log.warning("watching ResourcePolicies refused (%s); listing again in %.1f s",
                            e, delay)
                await asyncio.sleep(delay)
            except Exception as e:  # 410 Gone, a dropped connection: list again
                log.info("ResourcePolicy watch ended (%s); listing again", e)
                await asyncio.sleep(min(self.retry_s, 0.5))


def _refusal(p: ResourcePolicy, usage: Usage, reach: list[int], at: int | None) -> str:
    """Why a bind to a node of unit ``at`` (None: of no unit) is refused. The filter passed
    the node moments ago, so the usual cause is a race: binds of other pods of the policy
    filled the unit meanwhile (kube-scheduler binds asynchronously); the pod is retried and
    goes to the units it may use now."""
    then = (f"; kube-scheduler retries the pod, which may use unit "
            f"{', '.join(map(str, reach))} now" if reach else "")
    if at is None:
        return f"ResourcePolicy {p.key}: the node is in no unit of the policy{then}"
    mx = p.units[at].max
    if mx is not None and usage.count(at) >= mx:
        return (f"ResourcePolicy {p.key}: unit {at} became full (max {mx}, binds in flight "
                f"counted) after this pod was filtered{then}")
    return (f"ResourcePolicy {p.key}: unit {at} may not be used by this pod now "
            f"({why_not(p, usage, reach).split(': ', 1)[1]}){then}")


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _ns(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("namespace") or "default")


def _key(obj: Mapping[str, Any]) -> str:
    return f"{_ns(obj)}/{_name(obj)}"


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels if isinstance(labels, Mapping) else {}


def _record(obj: Mapping[str, Any]) -> _Pod:
    meta = obj.get("metadata") or {}
    anns = meta.get("annotations") or {}
    unit = parse_unit_annotation(anns.get(ANN_UNIT)) if isinstance(anns, Mapping) else None
    node = (obj.get("spec") or {}).get("nodeName") or ""
    phase = (obj.get("status") or {}).get("phase")
    return _Pod(_labels(obj), str(node), unit, parse_time(meta.get("creationTimestamp")),
                bool(meta.get("deletionTimestamp")), phase in ("Succeeded", "Failed"))
