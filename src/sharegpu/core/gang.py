"""Gang scheduling, the pure part: which group a pod belongs to, and placing a group's pods
jointly on the state — at least ``need`` of them, or none.

A group (ACK's "PodGroup") is named by the pod label ``pod-group.scheduling.sigs.k8s.io/name``
(or the bare ``pod-group.scheduling.sigs.k8s.io``), scoped to the pod's namespace; the number
of its pods that must have a place before any is bound comes from the label
``pod-group.scheduling.sigs.k8s.io/min-available`` or a PodGroup object's ``spec.minMember``.

:func:`plan` places pods one by one with the scheduler's own decision (the same filter, policy
scores, pick and GPU choice as a single pod), each reserved in the state before the next is
placed, so the pods of one group never take the same GPU share twice. When fewer than ``need``
fit, every reservation it made is released again: the state is as before. No I/O here; the
extender's :mod:`sharegpu.extender.gangs` keeps the groups and the holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from .errors import PlacementError, ValidationError
from .request import PodRequest
from .scheduler import Decision, Scheduler

LABEL_GROUP: Final = "pod-group.scheduling.sigs.k8s.io/name"
LABEL_GROUP_SHORT: Final = "pod-group.scheduling.sigs.k8s.io"  # ACK's PodGroup-CRD form
LABEL_MIN_AVAILABLE: Final = "pod-group.scheduling.sigs.k8s.io/min-available"
# the PodGroup custom resource (ACK's and the early scheduler-plugins' group)
PODGROUP_GROUP: Final = "scheduling.sigs.k8s.io"
PODGROUP_VERSION: Final = "v1alpha1"
DEFAULT_TIMEOUT_S: Final = 300.0  # kube-scheduler's GangScheduling waits 5 minutes at Permit


@dataclass(frozen=True)
class GangLabels:
    """What a pod's labels say about its group: the group's name and, when the label is
    there, its min-available."""

    name: str
    min_available: int | None


def _dns_subdomain(value: str) -> bool:
    if not value or len(value) > 253:
        return False
    ok = set("abcdefghijklmnopqrstuvwxyz0123456789-.")
    return (set(value) <= ok and value[0].isalnum() and value[-1].isalnum())


def parse_min(field_name: str, value: Any) -> int:
    """A min-available value: an integer ≥ 1 (a label's string, or a PodGroup's number)."""
    if isinstance(value, bool):
        raise ValidationError(field_name, value, "must be an integer ≥ 1")
    if isinstance(value, str):
        text = value.strip()
        if not text.isdigit():
            raise ValidationError(field_name, value, "must be an integer ≥ 1")
        n = int(text)
    elif isinstance(value, int):
        n = value
    else:
        raise ValidationError(field_name, value, "must be an integer ≥ 1")
    if n < 1 or n > 100000:
        raise ValidationError(field_name, value, "must be an integer from 1 to 100000")
    return n


def gang_labels(labels: Mapping[str, Any] | None) -> GangLabels | None:
    """The group a pod's labels name, ``None`` when it belongs to none. Raises
    :class:`ValidationError` naming the label and the rule when a value is malformed."""
    if not labels:
        return None
    name = labels.get(LABEL_GROUP)
    label = LABEL_GROUP
    if name is None:
        name = labels.get(LABEL_GROUP_SHORT)
        label = LABEL_GROUP_SHORT
    raw_min = labels.get(LABEL_MIN_AVAILABLE)
    if name is None:
        if raw_min is not None:
            raise ValidationError(f"label {LABEL_MIN_AVAILABLE}", raw_min,
                                  f"needs the label {LABEL_GROUP} naming the pod group")
        return None
    if not isinstance(name, str) or not _dns_subdomain(name):
        raise ValidationError(f"label {label}", name,
                              "must be a DNS subdomain (lower-case letters, digits, '-', '.')")
    n = None if raw_min is None else parse_min(f"label {LABEL_MIN_AVAILABLE}", raw_min)
    return GangLabels(name, n)


@dataclass
class GangPlan:
    """The outcome of :func:`plan`: ``placed`` holds the pods reserved in the state (empty when
    the group did not fit), ``fit`` how many fitted before it gave up."""

    placed: list[tuple[PodRequest, Decision]] = field(default_factory=list)
    fit: int = 0
    tried: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.placed)


def _demand(req: PodRequest) -> int:
    return sum(c.total_mem if not c.whole else 1_000_000 * c.gpus for c in req.containers)


def plan(scheduler: Scheduler, pods: Sequence[PodRequest], need: int,
         among: np.ndarray | None = None,
         pinned: tuple[PodRequest, int] | None = None) -> GangPlan:
    """Reserve places for as many of ``pods`` as fit, at least ``need`` (≥ 1), or none.

    Pods go largest GPU demand first (then by key), each through the scheduler's decision
    restricted to the boolean node mask ``among``; ``pinned`` (a pod and a node slot) is placed
    first and on that node only. Stops as soon as ``need`` can no longer be reached. On
    success the reservations stay in the state (the caller marks them held); otherwise the
    state is exactly as before."""
    st = scheduler.state
    out = GangPlan()
    order = sorted(pods, key=lambda r: (-_demand(r), r.key))
    todo: list[tuple[PodRequest, np.ndarray | None]] = []
    if pinned is not None:
        req, node = pinned
        only = np.zeros(st.n, dtype=bool)
        only[node] = True
        todo.append((req, only))
        order = [r for r in order if r.key != req.key]
    todo.extend((r, among) for r in order)
    for i, (req, mask) in enumerate(todo):
        left = len(todo) - i
        if out.fit + left < need:
            break
        out.tried += 1
        d = scheduler.decide(req, mask)
        if d is None:
            if pinned is not None and i == 0:
                break  # the pod kube-scheduler chose a node for does not fit there
            continue
        try:
            scheduler.reserve(req, d)
        except PlacementError:
            continue
        out.placed.append((req, d))
        out.fit += 1
    if out.fit < need:
        for req, _d in out.placed:
            scheduler.release(req.key)
        out.placed = []
    return out
