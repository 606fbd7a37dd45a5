"""The extender's view of the cluster: the composition root that builds the cluster cache and
the feature objects, hands each its dependencies, and answers kube-scheduler's verbs and the
informer's events by calling them in a fixed order. :class:`ClusterView` is that facade.

The parts (one module each):

- :mod:`.cache` (:class:`~.cache.ClusterCache`): the ledger; nodes, pods, the state, in-flight
  reservations, the host ledger;
- :mod:`.workload` (:class:`~.workload.LearnedWorkload`): the policy's target workload;
- :mod:`.drastate` (:class:`~.drastate.DraState`): DRA nodes' GPUs, claims, DRA pods;
- :mod:`.pickholds` (:class:`~.pickholds.PickHolds`): the picks held until their binds;
- :mod:`.answers` (:class:`~.answers.SchedulingAnswers`): filter, pick, scores, reservation;
- :mod:`.early_prioritize` (:class:`~.early_prioritize.EarlyPrioritize`): prioritize, kept;
- :mod:`.gangs` (:class:`~.gangs.GangScheduling`): pod groups, asked first for their pods;
- :mod:`.presence` (:class:`~.presence.Presence`): the Nodes and unbound pods that exist.

ResourcePolicy (:mod:`.resourcepolicies`) restricts the filter's answer in the server.
Everything is synchronous and free of I/O; the informer feeds it events and the HTTP handlers
ask it questions, all on one event loop, so every method runs atomically.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..core.agentserving import STALE_AFTER_S, AgentLiveness
from ..core.placement.base import get_policy
from ..core.placement.fragmentation import TargetWorkload
from ..core.placement.learned import LearnedWorkload, default_workload, shape_of
from ..core.podreader import Placed, PlacementReader, pod_key
from ..core.request import Kind, PodRequest
from ..core.state import Reservation
from ..kubeio.gcpause import gc_paused
from .answers import ROW_LOCAL_POLICIES, SchedulingAnswers, request_key
from .cache import UNKNOWN_NODE, ClusterCache
from .drastate import DraState
from .early_prioritize import EarlyPrioritize
from .gangs import GangScheduling
from .pickholds import PickHolds
from .picks import DEFAULT_TIMEOUT_S, HeldPicks
from .presence import Presence


class _Part:
    """An attribute of one of the view's parts, read (and set) through the view."""

    def __init__(self, part: str, name: str = "") -> None:
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, view: object, owner: type | None = None) -> Any:
        if view is None:
            return self
        return getattr(getattr(view, self.part), self.name)

    def __set__(self, view: object, value: Any) -> None:
        setattr(getattr(view, self.part), self.name, value)


class ClusterView:
    """The cluster cache and the features over it, composed; the verbs and the events in their
    order. The parts' own attributes are read through the view (``state``, ``inflight``,
    ``picks``, ``claims``, ``groups`` ...)."""

    def __init__(self, policy: str = "default", *, workload_refresh: int = 50,
                 graded: bool = False, workload: TargetWorkload | None = None,
                 hold_timeout: float = DEFAULT_TIMEOUT_S,
                 agent_stale_after_s: float = STALE_AFTER_S) -> None:
        """``workload``: a fixed target workload for the policy (e.g. the history a simulation
        ran with), never re-learnt; by default it is learnt from the pods seen. ``graded``:
        prioritize scores every feasible node, not only the policy's pick. ``hold_timeout``:
        seconds a pick filter answered with stays held without its bind.
        ``agent_stale_after_s``: a node's ``GPUAgentServing`` condition not renewed this long
        counts as not serving (:mod:`sharegpu.core.agentserving`)."""
        # the nodes' agents: no GPU pod goes to a node whose agent does not serve, and a
        # node's promise to name pods holds only while its agent serves
        self.clock = time.monotonic
        self.wall = time.time
        self.agents = AgentLiveness(agent_stale_after_s)
        self.learned = LearnedWorkload(get_policy(policy), refresh=workload_refresh,
                                       fixed=workload)
        self.ledger = ClusterCache(policy, self.learned)
        self.presence = Presence()
        self.dra = DraState(self.ledger)
        self.holds = PickHolds(self.ledger, HeldPicks(hold_timeout), self.presence.waiting)
        self.ledger.gpus = self.dra  # DRA nodes' GPUs come from their ResourceSlices
        self.ledger.give_way = self.holds.drop  # held picks yield to a bound pod's record
        self.ledger.naming_trusted = lambda node: self.agents.serving(node, self.clock())
        self.answers = SchedulingAnswers(self.ledger, self.learned, self.dra, self.holds,
                                         graded=graded,
                                         agents_down=lambda: self.agents.down(self.clock()))
        self.early = EarlyPrioritize(self.ledger, self.learned, self.answers)
        self.gangs = GangScheduling(self.ledger, self.learned, self.answers)

    # -- kube-scheduler's verbs: a gang's pod first, then the plain answers ---------------
    def filter(self, req: PodRequest, names: list[str]
               ) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """(passing names, failed {name: reason}, unresolvable {name: reason})."""
        got = self.gangs.filter(req, names)
        return got if got is not None else self.answers.filter(req, names)

    def pick(self, req: PodRequest, names: list[str], *, hold: bool) -> str | None:
        """The node among ``names`` the policy picks (a gang's held pod: its held node); with
        ``hold``, held until the bind (:mod:`.pickholds`)."""
        node = self.gangs.held_node(req.key)
        if node is not None:
            return node if node in names else None
        return self.answers.pick(req, names, hold=hold and not self.gangs.holds_own(req))

    def prioritize(self, req: PodRequest, names: list[str]) -> dict[str, int]:
        """Scores 0..10 (:meth:`~.early_prioritize.EarlyPrioritize.prioritize`)."""
        got = self.gangs.prioritize(req, names)
        return got if got is not None else self.early.prioritize(req, names)

    def reserve(self, req: PodRequest, node: str) -> Reservation:
        """The bind's reservation on ``node``, in flight (PlacementError: it does not fit)."""
        got = self.gangs.reserve(req, node)
        return got if got is not None else self.answers.reserve(req, node)

    def release_inflight(self, key: str) -> None:
        """The bind failed: its reservation goes (a gang's hold stays)."""
        if self.gangs.bind_failed(key):
            return
        self.holds.take(key)
        self.ledger.give_back(key)

    def bound(self, key: str) -> None:
        """The binding was created: the reservation is now what the pod's annotations say."""
        self.gangs.bound(key)
        self.ledger.bound(key)

    # -- the informer's events ---------------
    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        self.agents.observe(_node_name(obj), obj, mono=self.clock(), wall=self.wall())
        self.presence.upsert_node(obj)
        self.ledger.upsert_node(obj)

    def delete_node(self, name: str, *, forget: bool = True) -> None:
        if forget:
            self.agents.forget(name)
        self.presence.delete_node(name)
        self.ledger.delete_node(name, forget=forget)

    def upsert_pod(self, obj: Mapping[str, Any]) -> None:
        key = pod_key(obj)
        self.presence.upsert_pod(key, obj)
        self.gangs.on_pod(key, obj)
        self.dra.dra_pod_event(key, obj)
        self.holds.on_pod(key, obj)
        self.ledger.upsert_pod(key, obj)

    def delete_pod(self, obj: Mapping[str, Any]) -> None:
        key = pod_key(obj)
        self.presence.delete_pod(key)
        self.gangs.on_pod_deleted(key)
        self.dra.dra_pod_event(key, None)
        self.learned.forget(key)
        self.holds.forget(key)
        self.ledger.delete_pod(key)

    def reset(self, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
              dra: tuple[Iterable[Mapping[str, Any]], Iterable[Mapping[str, Any]]] | None = None
              ) -> int:
        """Rebuild everything from listed Node and Pod objects (start, relist after 410 Gone,
        repair after a failed consistency check) and, with ``dra``, listed ResourceSlices and
        ResourceClaims (without: the slices and claims known are kept and held again).
        In-flight reservations are kept. Returns the number of pods whose annotations could
        not be applied."""
        pods = pods if isinstance(pods, list) else list(pods)
        nodes = nodes if isinstance(nodes, list) else list(nodes)
        mono, wall = self.clock(), self.wall()
        listed = {_node_name(obj) for obj in nodes}
        for name in self.agents.nodes() - listed:
            self.agents.forget(name)
        for obj in nodes:  # a node seen before keeps when its heartbeat was last seen to change
            self.agents.observe(_node_name(obj), obj, mono=mono, wall=wall)
        self.presence.reset(nodes, ((pod_key(p), p) for p in pods))
        with gc_paused():
            if dra is not None:
                self.dra.load(*dra)
            bad, waiting = self.ledger.reset(nodes, pods)
            self.answers.forget()
            self.dra.dra_waiting_reset(waiting)
        self.gangs.after_reset(pods)
        return bad

    def maybe_refresh_workload(self) -> None:
        self.learned.maybe_refresh(self.ledger.state)

    def use_workload(self, workload: TargetWorkload | None) -> None:
        """Fix the policy's target workload (``None``: learn it from the pods seen again)."""
        self.learned.use(workload, self.ledger.state)

    # -- the parts' attributes, read through the view ---------------
    state = _Part("ledger")
    scheduler = _Part("ledger")
    policy = _Part("ledger")
    policy_name = _Part("ledger")
    specs = _Part("ledger")
    placed = _Part("ledger")
    inflight = _Part("ledger")
    starting = _Part("ledger")
    unseen = _Part("ledger")
    overcommitted = _Part("ledger")
    on_unseen = _Part("ledger")
    host = _Part("ledger")
    host_sum = _Part("ledger")
    problems = _Part("ledger")
    synced = _Part("ledger")
    reader = _Part("ledger")
    track_changes = _Part("ledger")
    untrack_changes = _Part("ledger")
    known_bound = _Part("ledger")
    drift = _Part("ledger")
    fingerprint = _Part("ledger")
    node_modes = _Part("ledger")

    workload = _Part("learned")
    fixed_workload = _Part("learned")
    workload_refresh = _Part("learned")
    shapes = _Part("learned")
    history = _Part("learned")

    dra_driver = _Part("dra")
    slices = _Part("dra")
    slice_gpus = _Part("dra")
    claims = _Part("dra")
    claim_held = _Part("dra")
    dra_slots = _Part("dra")
    dra_waiting = _Part("dra")
    _waiting_on = _Part("dra")
    on_dra_unschedulable = _Part("dra")
    upsert_slice = _Part("dra")
    delete_slice = _Part("dra")
    upsert_claim = _Part("dra")
    delete_claim = _Part("dra")
    dra_request = _Part("dra")
    dra_holds = _Part("dra")
    dra_pool = _Part("dra")
    dra_recheck = _Part("dra")
    pool_mask = _Part("dra")
    pool_reason = _Part("dra")

    picks = _Part("holds")
    held_pick = _Part("holds")
    expire_picks = _Part("holds", "expire")
    drop_picks = _Part("holds", "drop")

    graded = _Part("answers")
    slots = _Part("answers")
    feasible = _Part("answers")
    feasible_at = _Part("answers")
    fits_empty = _Part("answers")
    scores = _Part("answers")

    still_current = _Part("early")

    groups = _Part("gangs")
    podgroups = _Part("gangs")
    gang_clock = _Part("gangs")
    gang_may_hold = _Part("gangs")
    gang_default_timeout = _Part("gangs")
    gang_holds = _Part("gangs")
    gang_expire = _Part("gangs")
    drop_gang_holds = _Part("gangs")
    upsert_podgroup = _Part("gangs")
    delete_podgroup = _Part("gangs")
    reset_podgroups = _Part("gangs")


def _node_name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


__all__ = [
    "ROW_LOCAL_POLICIES", "UNKNOWN_NODE", "ClusterView", "Kind", "Placed", "PlacementReader",
    "default_workload", "request_key", "shape_of",
]
