"""Gang scheduling in the extender: the groups as the informer shows them, the GPU shares held
for a group's pods while they wait, and the hooks the view asks first for a gang's pod. A
verb's hook answers for a gang's pod and returns ``None`` for any other, which the plain
answers (:mod:`.answers`) then take. How a group is planned, held, timed out and released, and
what a leader change does: docs/gang.md ("How it works").
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import PlacementError, ValidationError
from ..core.gang import (
    DEFAULT_TIMEOUT_S,
    LABEL_GROUP,
    LABEL_GROUP_SHORT,
    LABEL_MIN_AVAILABLE,
    gang_labels,
    parse_min,
    plan,
)
from ..core.placement.learned import LearnedWorkload
from ..core.podreader import pod_key
from ..core.pods import is_terminated, node_of
from ..core.request import PodRequest
from ..core.state import Reservation
from .answers import SchedulingAnswers
from .cache import ClusterCache
from .drastate import DraPodRequest

GroupKey = tuple[str, str]  # (namespace, name)


def _names_group(labels: Mapping[str, Any]) -> bool:
    return LABEL_GROUP in labels or LABEL_GROUP_SHORT in labels or LABEL_MIN_AVAILABLE in labels


@dataclass
class _Member:
    request: PodRequest | None  # None: no GPU request, or a request that is refused
    bound: bool
    min_label: int | None
    problem: str = ""  # why the pod's request or labels are refused


@dataclass
class _Group:
    key: GroupKey
    members: dict[str, _Member] = field(default_factory=dict)
    holds: set[str] = field(default_factory=set)
    deadline: float = 0.0
    generation: int = 0  # grows with every plan that made holds (expiry checks it)

    @property
    def name(self) -> str:
        return f"{self.key[0]}/{self.key[1]}"


@dataclass(frozen=True)
class PodGroupSpec:
    """What a PodGroup object says (``problem``: why it is refused, naming the field)."""

    min_member: int | None
    timeout_s: float | None
    problem: str = ""


def podgroup_spec(obj: Mapping[str, Any]) -> PodGroupSpec:
    spec = obj.get("spec") or {}
    if not isinstance(spec, Mapping):
        return PodGroupSpec(None, None, "PodGroup spec must be an object")
    try:
        raw = spec.get("minMember")
        n = None if raw is None else parse_min("PodGroup spec.minMember", raw)
        t = spec.get("scheduleTimeoutSeconds")
        timeout = None
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                raise ValidationError("PodGroup spec.scheduleTimeoutSeconds", t,
                                      "must be an integer ≥ 1")
            timeout = float(t)
    except ValidationError as e:
        return PodGroupSpec(None, None, str(e))
    return PodGroupSpec(n, timeout)


class GangScheduling:
    """Pod groups over the cluster cache ``ledger`` (their holds are its in-flight
    reservations), planned with the ``learned`` workload; a held pod that moves node is
    reserved afresh through the plain ``answers``."""

    def __init__(self, ledger: ClusterCache, learned: LearnedWorkload,
                 answers: SchedulingAnswers,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.learned = learned
        self.answers = answers
        self.gang_clock = clock
        self.gang_may_hold: Callable[[], bool] = lambda: True
        self.gang_default_timeout = DEFAULT_TIMEOUT_S
        self.groups: dict[GroupKey, _Group] = {}
        self._group_of: dict[str, GroupKey] = {}  # pod key -> its group
        self._held_by: dict[str, GroupKey] = {}  # held pod key -> its group
        self._binding: set[str] = set()  # held pods the binder is binding now
        self._deadlines: list[tuple[float, GroupKey, int]] = []
        self.podgroups: dict[GroupKey, PodGroupSpec] = {}

    # -- the groups, from pod and PodGroup events ---------------
    def _note_pod(self, key: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") if isinstance(meta, Mapping) else None
        gk: GroupKey | None = None
        member: _Member | None = None
        if labels and _names_group(labels) and not is_terminated(obj):
            try:
                g = gang_labels(labels)
            except ValidationError as e:
                g, problem = None, str(e)
                name = labels.get(LABEL_GROUP) or labels.get(LABEL_GROUP_SHORT)
                if isinstance(name, str) and name:
                    gk = (key.split("/", 1)[0], name)
                    member = _Member(None, bool(node_of(obj)), None, problem)
            if g is not None:
                gk = (key.split("/", 1)[0], g.name)
                req: PodRequest | None
                problem = ""
                try:
                    req = self.ledger.reader.request(obj)
                    if not req.wants_gpu:
                        req = None
                except ValidationError as e:
                    req, problem = None, str(e)
                member = _Member(req, bool(node_of(obj)), g.min_available, problem)
        old = self._group_of.get(key)
        if old is not None and old != gk:
            self._forget_member(key, old)
        if gk is None or member is None:
            return
        group = self.groups.get(gk)
        if group is None:
            group = self.groups[gk] = _Group(gk)
        group.members[key] = member
        self._group_of[key] = gk

    def _forget_member(self, key: str, gk: GroupKey) -> None:
        self._group_of.pop(key, None)
        group = self.groups.get(gk)
        if group is None:
            return
        group.members.pop(key, None)
        if not group.members and not group.holds:
            del self.groups[gk]

    def upsert_podgroup(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        gk = (str(meta.get("namespace") or "default"), str(meta.get("name") or ""))
        self.podgroups[gk] = podgroup_spec(obj)

    def delete_podgroup(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        self.podgroups.pop((str(meta.get("namespace") or "default"),
                            str(meta.get("name") or "")), None)

    def reset_podgroups(self, objs: Iterable[Mapping[str, Any]]) -> None:
        self.podgroups = {}
        for obj in objs:
            self.upsert_podgroup(obj)

    # -- pod events ---------------
    def on_pod(self, key: str, obj: Mapping[str, Any]) -> None:
        """A pod's event, before the cache applies it."""
        self._note_pod(key, obj)
        if key in self._held_by and key not in self._binding and (
                node_of(obj) or is_terminated(obj)):
            # bound by someone else (a new leader), or ended: the hold is no longer ours
            self._release_hold(key)

    def on_pod_deleted(self, key: str) -> None:
        gk = self._group_of.get(key)
        if gk is not None:
            self._forget_member(key, gk)
        self._unmark(key)

    def after_reset(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """The cache was rebuilt from ``pods``: the groups are read again from them; holds
        whose reservations the rebuild kept survive."""
        inflight = self.ledger.inflight
        holds = {k: gk for k, gk in self._held_by.items() if k in inflight}
        self.groups, self._group_of = {}, {}
        for obj in pods:
            meta = obj.get("metadata") or {}
            labels = meta.get("labels") or {}
            if labels and _names_group(labels):
                self._note_pod(pod_key(obj), obj)
        self._held_by = {}
        for k, gk in holds.items():  # in-flight holds survive a rebuild (the reset keeps them)
            self._held_by[k] = gk
            group = self.groups.get(gk)
            if group is None:
                group = self.groups[gk] = _Group(gk)
            group.holds.add(k)
        for group in self.groups.values():
            group.holds &= set(holds)
        self._binding &= set(holds)

    # -- holds ---------------
    def _unmark(self, key: str) -> None:
        gk = self._held_by.pop(key, None)
        self._binding.discard(key)
        if gk is not None:
            group = self.groups.get(gk)
            if group is not None:
                group.holds.discard(key)
                if not group.members and not group.holds:
                    del self.groups[gk]

    def _release_hold(self, key: str) -> None:
        self._unmark(key)
        ledger = self.ledger
        ledger.touch(key)
        if ledger.inflight.pop(key, None) is not None and key in ledger.state.pods:
            ledger.scheduler.release(key)

    def drop_gang_holds(self) -> int:
        """Release every hold not being bound now (this replica stopped leading)."""
        keys = [k for k in self._held_by if k not in self._binding]
        for k in keys:
            self._release_hold(k)
        return len(keys)

    def gang_expire(self) -> list[str]:
        """Release the holds of every group whose timeout passed; the released pod keys."""
        now = self.gang_clock()
        out: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, gk, gen = heapq.heappop(self._deadlines)
            group = self.groups.get(gk)
            if group is None or group.generation != gen:
                continue
            for k in sorted(group.holds):
                if k not in self._binding:
                    self._release_hold(k)
                    out.append(k)
        return out

    def gang_holds(self, group: str) -> dict[str, str]:
        """Held pod -> node for the group ``namespace/name`` (for tests and inspection)."""
        ns, _, name = group.partition("/")
        g = self.groups.get((ns, name))
        if g is None:
            return {}
        inflight = self.ledger.inflight
        return {k: inflight[k].node for k in sorted(g.holds) if k in inflight}

    # -- what a group needs ---------------
    def _group_for(self, req: PodRequest) -> _Group | None:
        """The pod's group (ValidationError for malformed labels); the pod is noted in it
        when the informer has not shown it yet."""
        g = gang_labels(req.labels)
        if g is None:
            return None
        gk = (req.namespace, g.name)
        group = self.groups.get(gk)
        if group is None:
            group = self.groups[gk] = _Group(gk)
        if req.key not in group.members:
            group.members[req.key] = _Member(req, False, g.min_available)
            self._group_of[req.key] = gk
        return group

    def _min_available(self, group: _Group) -> tuple[int, float]:
        """(min-available, timeout) of the group; PlacementError naming the rule when
        neither a PodGroup nor a label gives it, or a PodGroup is refused."""
        pg = self.podgroups.get(group.key)
        timeout = self.gang_default_timeout
        if pg is not None:
            if pg.problem:
                raise PlacementError(f"gang {group.name}: {pg.problem}")
            if pg.timeout_s is not None:
                timeout = pg.timeout_s
            if pg.min_member is not None:
                return pg.min_member, timeout
        labels = [m.min_label for m in group.members.values() if m.min_label is not None]
        if not labels:
            raise PlacementError(
                f"gang {group.name}: no min-available: set the pod label {LABEL_MIN_AVAILABLE} "
                f"or create PodGroup {group.key[1]} (scheduling.sigs.k8s.io/v1alpha1) with "
                "spec.minMember in the namespace")
        return max(labels), timeout

    def _plan_group(self, group: _Group, among: np.ndarray | None,
                    pinned: tuple[PodRequest, int] | None, hold: bool) -> bool | str:
        """Place the group's waiting pods so that bound + held reaches min-available. True:
        met already (nothing to plan); False: planned (held when ``hold``); a string: the
        reason nothing fits."""
        need_total, timeout = self._min_available(group)
        ledger = self.ledger
        bound = sum(1 for m in group.members.values() if m.bound)
        for k in [k for k in group.holds if k not in ledger.inflight]:  # gone with a node
            self._unmark(k)
        held = len(group.holds)
        need = need_total - bound - held
        if need <= 0:
            return True
        waiting = [m.request for k, m in group.members.items()
                   if not m.bound and k not in group.holds and m.request is not None
                   and k not in ledger.state.pods]
        problems = [m.problem for m in group.members.values() if m.problem]
        if len(waiting) < need:
            why = (f"gang {group.name}: {bound + held + len(waiting)} of {need_total} pods "
                   f"can take part (bound {bound}, held {held}, waiting {len(waiting)}); "
                   f"min-available {need_total}")
            if problems:
                why += f"; refused: {problems[0]}"
            return why
        self.learned.maybe_refresh(ledger.state)
        got = plan(ledger.scheduler, waiting, need, among, pinned)
        if not got.ok:
            return (f"gang {group.name}: {bound + held + got.fit} of {need_total} pods fit "
                    f"(bound {bound}, held {held}, waiting {len(waiting)}); "
                    f"min-available {need_total}")
        if not hold:
            for r, _d in got.placed:
                ledger.scheduler.release(r.key)
            return False
        group.generation += 1
        group.deadline = self.gang_clock() + timeout
        heapq.heappush(self._deadlines, (group.deadline, group.key, group.generation))
        for r, _d in got.placed:
            k = r.key
            ledger.inflight[k] = ledger.state.pods[k]
            self._held_by[k] = group.key
            group.holds.add(k)
            ledger.touch(k)
        return False

    # -- the verbs ---------------
    def held_node(self, key: str) -> str | None:
        """The node ``key``'s GPU share is held on by its group, if any."""
        if key in self._held_by:
            r = self.ledger.inflight.get(key)
            if r is not None:
                return r.node
        return None

    def filter(self, req: PodRequest, names: list[str]
               ) -> tuple[list[str], dict[str, str], dict[str, str]] | None:
        """A gang pod's filter answer; ``None`` for any other pod."""
        self.gang_expire()
        if not req.wants_gpu or isinstance(req, DraPodRequest):  # DRA: no gang holds
            return None
        try:
            group = self._group_for(req)
        except ValidationError as e:
            return [], {}, dict.fromkeys(names, f"invalid pod group: {e}")
        if group is None:
            return None
        node = self.held_node(req.key)
        if node is None:
            try:
                slots = self.answers.slots(names)
                among = np.zeros(self.ledger.state.n, dtype=bool)
                among[slots[slots >= 0]] = True
                # a view that may not bind (a follower) plans as a dry run: the filter says
                # whether the group fits, the leader's bind plans again and holds
                outcome = self._plan_group(group, among, None, hold=self.gang_may_hold())
            except PlacementError as e:
                return [], {}, dict.fromkeys(names, str(e))
            if isinstance(outcome, str):
                return [], dict.fromkeys(names, outcome), {}
            node = self.held_node(req.key)
            if node is None:
                return None  # min-available met without it: the plain filter
        why = f"gang {group.name}: this pod's GPU share is held on node {node}"
        return ([node] if node in names else [], {n: why for n in names if n != node}, {})

    def holds_own(self, req: PodRequest) -> bool:
        """Whether ``req``'s pod names a group (well or not): a plain pick must not hold it,
        since a gang's pods are held by their group only."""
        try:
            return gang_labels(req.labels) is not None
        except ValidationError:
            return True

    def prioritize(self, req: PodRequest, names: list[str]) -> dict[str, int] | None:
        """A held pod's scores (10 on its held node); ``None`` for any other pod."""
        node = self.held_node(req.key)
        if node is None:
            return None
        return {n: 10 if n == node else 0 for n in names}

    def reserve(self, req: PodRequest, node: str) -> Reservation | None:
        """A gang pod's reservation at its bind (its hold, or the group planned now with the
        pod pinned to ``node``); ``None`` for any other pod. PlacementError naming the group
        when it does not fit."""
        self.gang_expire()
        ledger = self.ledger
        key = req.key
        if key in self._held_by and key in ledger.inflight:
            r = ledger.inflight[key]
            if r.node == node:
                self._binding.add(key)
                return r
            # kube-scheduler chose another node: move the hold there when the pod fits there
            gk = self._held_by[key]
            self._release_hold(key)
            try:
                r = self.answers.reserve(req, node)
            except PlacementError:
                back = ledger.state.reserve(req, r.node, r.alloc, check_host=False)
                ledger.inflight[key] = back
                self._held_by[key] = gk
                self.groups[gk].holds.add(key)
                raise PlacementError(
                    f"{key}: gang {gk[0]}/{gk[1]} holds this pod's GPU share on node {r.node}, "
                    f"and it does not fit on {node}") from None
            self._held_by[key] = gk
            self.groups[gk].holds.add(key)
            self._binding.add(key)
            return r
        if not req.wants_gpu:
            return None
        try:
            group = self._group_for(req)
        except ValidationError as e:
            raise PlacementError(f"{key}: invalid pod group: {e}") from None
        if group is None:
            return None
        i = ledger.state.index.get(node)
        if i is None:
            return None  # the plain reservation's clear error
        outcome = self._plan_group(group, None, (req, i), hold=True)
        if isinstance(outcome, str):
            raise PlacementError(outcome)
        if key in self._held_by and key in ledger.inflight:
            self._binding.add(key)
            return ledger.inflight[key]
        return None

    def bind_failed(self, key: str) -> bool:
        """A bind of ``key`` failed: True when its group's hold stays (for the retry, or the
        timeout), so its reservation must not be released."""
        if key in self._held_by:
            self._binding.discard(key)
            return True
        return False

    def bound(self, key: str) -> None:
        """``key`` was bound: no longer held, a bound member of its group."""
        gk = self._held_by.get(key)
        self._unmark(key)
        if gk is not None:
            group = self.groups.get(gk)
            m = group.members.get(key) if group is not None else None
            if m is not None:
                m.bound = True
