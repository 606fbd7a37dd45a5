"""The cluster cache: the core's ClusterState fed by Node and Pod objects.

Everything here is synchronous and free of I/O; the informer feeds it events and the HTTP
handlers ask it questions, all on one event loop, so every method runs atomically.

What a pod holds comes from its annotations once it is bound (:func:`sharegpu.pods.placement_of`);
the binder's own reservations are *in flight* until the binding is created, and events for an
in-flight pod do not touch its reservation. ``nodeName`` never changes once set, so an event that
shows a pod unbound after the view saw it bound is stale and ignored.

Host CPU and memory (:mod:`sharegpu.hostresources`): a GPU pod's request carries its CPU and
memory, so the state charges them with its GPUs; every other bound, live pod (no GPU, or a GPU
pod the state does not hold) is in the *host ledger* (``host``), charged per node with
:meth:`ClusterState.charge_host`. A pod is in exactly one of the two.

A part of :class:`~.view.ClusterView`: the answers to kube-scheduler's verbs are in
:mod:`.answers` and :mod:`.early_prioritize`, the policy's target workload in :mod:`.workload`.
"""

from __future__ import annotations

import gc
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from .. import hostresources
from ..annotations import Allocation, is_assigned
from ..errors import PlacementError, ValidationError
from ..modes import Mode
from ..nodes import spec_from_node
from ..placement.base import get_policy, resolve
from ..placement.fragmentation import Shape, TargetWorkload
from ..placement.nodecache import ShapeCache
from ..pods import is_terminated, node_of
from ..request import PodRequest
from ..scheduler import Scheduler
from ..startingpods import StartingPods
from ..state import ClusterState, NodeSpec, Reservation
from .drastate import DraCache
from .picks import HeldPicks
from .reader import Placed, PlacementReader, _key
from .workload import LearnedWorkload

log = logging.getLogger(__name__)

UNKNOWN_NODE = "node has no GPUs known to sharegpu (no GPU resources or annotations)"
# policies whose score of a node reads that node's row alone (so scores keep until it changes)
ROW_LOCAL_POLICIES = frozenset({"fgd", "strand", "strandlp", "strandfill"})


class ClusterCache(DraCache, LearnedWorkload):
    """Nodes and pods as the view knows them: the state, what bound pods' annotations say,
    in-flight reservations, pods without a decision, the host ledger; rebuilt from lists
    (:meth:`reset`) and kept by watch events (``upsert_*``, ``delete_*``)."""

    picks: HeldPicks  # which in-flight reservations are held filter picks (set by the view)
    drop_picks: Callable[..., list[str]]  # gives them back (the view's answers)

    def __init__(self, policy: str = "default", *, workload_refresh: int = 50,
                 workload: TargetWorkload | None = None) -> None:
        """``workload``: a fixed target workload for the policy (e.g. the history a simulation
        ran with), never re-learnt; by default it is learnt from the pods seen."""
        self.policy_name = policy
        self.policy = get_policy(policy)
        self._init_dra()
        self.workload_refresh = workload_refresh
        self.state = ClusterState()
        self.scheduler = Scheduler(self.state, self.policy, tie_break="order")
        self.specs: dict[str, NodeSpec] = {}
        self.placed: dict[str, Placed] = {}  # what bound pods' annotations say
        self.inflight: dict[str, Reservation] = {}
        # bound (or being bound) pods the kubelet has not started: the binder keeps the pods
        # it binds distinguishable to the kubelet (sharegpu.startingpods)
        self.starting = StartingPods()
        # bound GPU pods without a recorded decision, charged conservatively (key -> node)
        self.unseen: dict[str, str] = {}
        # called with such a pod the first time it is seen (the replica posts an Event)
        self.on_unseen: Callable[[Mapping[str, Any]], None] | None = None
        self.fixed_workload = workload
        # bound, live pods whose host CPU and memory the state does not hold with GPUs:
        # key -> (node, CPU millicores, memory MiB); and their sums per node (every node, GPU
        # or not, so a node that becomes a GPU node starts with what already runs there)
        self.host: dict[str, tuple[str, int, int]] = {}
        self.host_sum: dict[str, list[int]] = {}
        self.shapes: Counter[Shape] = Counter()
        # the same pods by (shape, host memory MiB): the history the workload is learnt from
        self.history: Counter[tuple[Shape, int]] = Counter()
        self._shape_of: dict[str, Shape] = {}  # live pods already counted in ``shapes``
        self._seen = 0  # pods counted in ``shapes`` (the history the workload is learnt from)
        self._shapes_at_prepare = -1
        self.workload: TargetWorkload | None = None
        self.problems: OrderedDict[str, str] = OrderedDict()
        self._epoch = 0  # grows whenever the policy is prepared afresh
        self._nodes_version = 0  # grows whenever a node is added, changed or removed
        self.synced = False
        # one set per consistency check under way (track_changes): the pods this view changed
        # or learnt about since the check began, which its list may show as they were before
        self._change_logs: list[set[str]] = []
        self.reader = PlacementReader()
        self.reader.on_problem = self._problem
        # FGD, strand and strandlp score a node from that node's row alone, so scores can be kept
        # per request shape until the node changes (they cache their common shapes themselves;
        # this covers compute, whole-card and multi-container requests)
        self._row_local = resolve(policy) in ROW_LOCAL_POLICIES
        self._scores: ShapeCache | None = (
            ShapeCache({"score": np.float64}) if self._row_local else None
        )
        self._prepare()

    def _problem(self, key: str, reason: str) -> None:
        self.problems[key] = reason
        self.problems.move_to_end(key)
        while len(self.problems) > 1000:
            self.problems.popitem(last=False)
        log.warning("%s: %s", key, reason)

    # -- full rebuild ---------------
    def reset(self, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
              dra: tuple[Iterable[Mapping[str, Any]], Iterable[Mapping[str, Any]]] | None = None
              ) -> int:
        """Rebuild everything from listed Node and Pod objects (start, relist after 410 Gone,
        repair after a failed consistency check) and, with ``dra``, listed ResourceSlices and
        ResourceClaims (without: the slices and claims known are kept and held again).
        In-flight reservations are kept. Returns the number of pods whose annotations could
        not be applied."""
        with _gc_paused():
            return self._reset(nodes, pods, dra)

    def _reset(self, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
               dra: tuple[Iterable[Mapping[str, Any]], Iterable[Mapping[str, Any]]] | None
               = None) -> int:
        state = ClusterState()
        specs: dict[str, NodeSpec] = {}
        if dra is not None:
            self._dra_load(*dra)
        self._node_objs, self.dra_slots = {}, {}
        for obj in nodes:
            spec = self._spec(obj)
            if spec is not None:
                state.add_node(spec)
                specs[spec.name] = spec
        placed: dict[str, Placed] = {}
        records: list[Placed] = []
        unseen: list[Mapping[str, Any]] = []
        # bound, live pods: (key, node, CPU, memory)
        on_nodes: list[tuple[str, str, int, int]] = []
        listed: list[str] = []
        tracking = bool(self._change_logs)
        reader, inflight = self.reader, self.inflight
        starting = StartingPods()
        bad = 0
        waiting: list[tuple[str, Mapping[str, Any]]] = []  # unbound pods with claims
        for obj in pods:  # the same answers as placement_of, known_bound, unannotated_gpu_pod
            meta = obj.get("metadata") or {}
            key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
            if tracking:
                listed.append(key)
            if is_terminated(obj):
                continue  # holds nothing, uses nothing
            node = node_of(obj)
            if not node and (obj.get("spec") or {}).get("resourceClaims"):
                waiting.append((key, obj))
            if key in inflight:
                if node:
                    on_nodes.append((key, node, *reader.host(obj)))
                continue
            try:
                alloc = reader.allocation(meta.get("annotations") or {})
                p = (reader.request(obj), node, alloc) if alloc is not None and node else None
            except ValidationError as e:
                self._problem(key, f"unreadable GPU annotations or request: {e}")
                bad += 1
                if node:
                    on_nodes.append((key, node, *reader.host(obj)))
                continue
            if not node:
                if p is None:
                    p = self.known_bound(obj)
            else:
                cpu, mem = reader.host(obj)
                on_nodes.append((key, node, cpu, mem))
            if p is None:
                if node:
                    try:
                        gpu = reader.wants_gpu(obj)
                    except ValidationError:
                        gpu = False
                    if gpu:  # a GPU pod without a decision: charged below
                        unseen.append(obj)
                continue
            placed[key] = p
            if not is_assigned(meta.get("annotations") or {}):
                starting.add(key, p[1], p[0], p[2])
            if p[1] in state.index:  # else applied when the node appears
                records.append(p)
        for key, reason in state.restore(records):
            self._problem(key, f"annotations over-commit: {reason}")
            placed.pop(key, None)
            bad += 1
        self._dra_hold_all(state)  # allocated DRA claims, after the pods' records
        for key, r in list(self.inflight.items()):
            try:
                self.inflight[key] = state.reserve(r.request, r.node, r.alloc, check_host=False)
            except (PlacementError, KeyError) as e:
                self._problem(key, f"in-flight reservation dropped on rebuild: {e}")
                del self.inflight[key]
                continue
            if key in self.starting:  # being bound: the binder counted it as starting
                starting.add(key, r.node, r.request, r.alloc)
        self.starting = starting
        if self._change_logs:  # a rebuild during a check: every pod is newer than its list
            for key in (*self.placed, *self.state.pods, *placed, *listed, *self.host):
                self._touch(key)
        self.state, self.specs, self.placed = state, specs, placed
        self.host, self.host_sum = {}, {}
        known, self.unseen = self.unseen, {}
        for obj in unseen:  # after every recorded decision, as the consistency check does
            self._charge_unseen(obj, notify=_key(obj) not in known)
        # every other bound, live pod: its host CPU and memory, per node
        held = state.pods
        for key, node, cpu, mem in on_nodes:
            if key not in held:
                self._set_host(key, node, cpu, mem, apply=False)
        for node, (cpu, mem) in self.host_sum.items():
            if node in state.index:
                state.charge_host(node, cpu, mem)
        self._forget_answers()
        self._nodes_version += 1
        self.scheduler = Scheduler(state, self.policy, tie_break="order")
        self._shape_of.clear()
        self._seen = 0
        self.shapes.clear()
        self.history.clear()
        for key, (req, _node, alloc) in placed.items():
            self._count_shape(key, req, alloc)
        self._prepare()
        self.synced = True
        self.dra_waiting_reset(waiting)
        return bad

    def _charge_unseen(self, obj: Mapping[str, Any], *, notify: bool = True) -> None:
        """Charge a bound GPU pod that carries no decision (see
        :meth:`ClusterState.charge_unseen`)."""
        key = _key(obj)
        if key in self.state.pods:
            return
        try:
            got = self.reader.unannotated(obj)
        except ValidationError:
            return
        if got is None:
            return
        req, node = got
        if node not in self.state.index:
            return
        try:
            self.state.charge_unseen(req, node)
        except PlacementError as e:
            self._problem(key, f"GPU pod without a scheduling decision not charged: {e}")
            return
        self.unseen[key] = node
        self._set_host(key, "")
        self._problem(key, f"holds GPU resources on {node} but carries no scheduling decision; "
                           "counted against every GPU of the node until it ends")
        if notify and self.on_unseen is not None:
            self.on_unseen(obj)

    # -- host CPU and memory of the pods the state does not hold ---------------
    def _set_host(self, key: str, node: str, cpu: int = 0, mem: int = 0, *,
                  apply: bool = True) -> None:
        """Record that pod ``key`` uses ``cpu`` and ``mem`` on ``node`` outside the state's
        reservations (``node`` "": nothing), charging the state's node by the difference."""
        new = (node, cpu, mem) if node and (cpu or mem) else None
        old = self.host.get(key)
        if old == new:
            return
        for rec, sign in ((old, -1), (new, 1)):
            if rec is None:
                continue
            n, c, m = rec
            total = self.host_sum.get(n)
            if total is None:
                total = self.host_sum[n] = [0, 0]
            total[0] += sign * c
            total[1] += sign * m
            if not total[0] and not total[1]:
                del self.host_sum[n]
            if apply and n in self.state.index:
                self.state.charge_host(n, sign * c, sign * m)
        if new is None:
            del self.host[key]
        else:
            self.host[key] = new

    def _sync_host(self, key: str, obj: Mapping[str, Any]) -> None:
        """After an event for a pod: in the host ledger exactly when it is bound, live and
        not held by the state."""
        node = hostresources.charges_node(obj)
        if not node or key in self.state.pods:
            self._set_host(key, "")
        else:
            self._set_host(key, node, *self.reader.host(obj))

    def known_bound(self, obj: Mapping[str, Any]) -> Placed | None:
        """Our placement of a pod that a list shows unbound though this view saw it bound
        (the list was taken before our binding landed; ``nodeName`` never goes back)."""
        if (obj.get("spec") or {}).get("nodeName") or _ended(obj):
            return None
        p = self.placed.get(_key(obj))
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if p is None or (uid and p[0].uid and p[0].uid != uid):
            return None
        return p

    # -- nodes ---------------
    def _spec(self, obj: Mapping[str, Any]) -> NodeSpec | None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        try:
            spec = self._dra_spec(obj, spec_from_node(obj))
            if spec is not None and (spec.cpu_milli is None or spec.mem_mib is None):
                problem = "; ".join(hostresources.node_allocatable(obj)[2])
                if problem and self.problems.get(f"node/{name}") != problem:
                    self._problem(f"node/{name}", problem)  # once, not at every status update
            return spec
        except ValidationError as e:
            self._problem(f"node/{name}", str(e))
            # keep the last good view of the node rather than dropping its pods
            return self.specs.get(name)

    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        spec = self._spec(obj)
        name = str((obj.get("metadata") or {}).get("name") or "")
        if spec is None:
            if name in self.state.index:
                self.delete_node(name, forget=False)
            return
        if name in self.specs and self.specs[name] == spec:
            return
        fresh = name not in self.state.index
        try:
            self.state.add_node(spec)
        except PlacementError as e:
            self._problem(f"node/{name}", f"node update refused, pods no longer fit: {e}")
            return
        self.specs[name] = spec
        self._nodes_version += 1
        if fresh:
            cpu, mem = self.host_sum.get(name, (0, 0))
            self.state.charge_host(name, cpu, mem)
            for key, (req, node, alloc) in self.placed.items():
                if node == name and key not in self.state.pods:
                    self._hold(key, req, node, alloc)
            self._hold_node_claims(name)
        if fresh and not self.shapes:
            self._prepare()

    def delete_node(self, name: str, *, forget: bool = True) -> None:
        """``forget``: the Node is gone (else it only has no GPUs now; a ResourceSlice may
        give it some)."""
        if name in self.state.index:
            self._nodes_version += 1
            for key in self.state.remove_node(name):
                self.inflight.pop(key, None)
                self.claim_held.pop(key, None)  # held again if the node comes back
        self.specs.pop(name, None)
        if forget:
            self._forget_node(name)

    # -- pods ---------------
    def _hold(self, key: str, req: PodRequest, node: str, alloc: Allocation) -> None:
        try:
            try:
                self.state.reserve(req, node, alloc, check_host=False)
            except PlacementError:
                # what a bound pod holds comes first: picks held on its node give way (their
                # binds choose afresh)
                if not self.drop_picks(node):
                    raise
                self.state.reserve(req, node, alloc, check_host=False)
            self.state.bind(key)
            self._count_shape(key, req, alloc)
        except PlacementError as e:
            self._problem(key, f"annotations over-commit: {e}")
            return
        self._set_host(key, "")  # its CPU and memory are held with its GPUs now

    # -- changes seen during a consistency check ---------------
    def track_changes(self) -> set[str]:
        """From now on, collect the keys of the pods this view changes (reservations, bindings,
        releases, watch events, a rebuild) into the returned set, until
        :meth:`untrack_changes`."""
        log: set[str] = set()
        self._change_logs.append(log)
        return log

    def untrack_changes(self, log: set[str]) -> None:
        self._change_logs = [x for x in self._change_logs if x is not log]

    def _touch(self, key: str) -> None:
        for log in self._change_logs:
            log.add(key)

    def upsert_pod(self, obj: Mapping[str, Any]) -> None:
        key = _key(obj)
        if self._change_logs:
            self._touch(key)
        self.dra_pod_event(key, obj)
        if key in self.inflight and key in self.picks and (node_of(obj) or is_terminated(obj)):
            # held since its filter, but bound by someone else (or ended): no longer ours
            self.picks.take(key)
            self.inflight.pop(key, None)
            if key in self.state.pods:
                self.scheduler.release(key)
        if key in self.inflight:
            # being bound: the binder holds it; but the node's agent may already have marked it
            # assigned (its kubelet started it) before the binding's answer came back
            if is_assigned((obj.get("metadata") or {}).get("annotations") or {}):
                self.starting.discard(key)
            return
        try:
            p = self.reader.placement(obj)
        except ValidationError as e:
            self._problem(key, f"unreadable GPU annotations or request: {e}")
            self.starting.discard(key)
            self._sync_host(key, obj)  # its CPU and memory count all the same
            return
        self._apply_pod(key, obj, p)
        self._sync_starting(key, obj, p)
        self._sync_host(key, obj)

    def _sync_starting(self, key: str, obj: Mapping[str, Any], p: Placed | None) -> None:
        """A bound pod starts when its node's agent marks it assigned (the kubelet allocated
        its devices); until then it is starting (:mod:`sharegpu.startingpods`)."""
        if p is None or key not in self.placed or is_assigned(
                (obj.get("metadata") or {}).get("annotations") or {}):
            self.starting.discard(key)
        else:
            req, node, alloc = p
            self.starting.add(key, node, req, alloc)

    def _apply_pod(self, key: str, obj: Mapping[str, Any], p: Placed | None) -> None:
        cur = self.state.pods.get(key)
        if p is None:
            if key in self.placed and not (obj.get("spec") or {}).get("nodeName") and not _ended(
                obj
            ):
                return  # stale event from before the binding: nodeName never goes back
            self.placed.pop(key, None)
            if key in self.unseen and not _ended(obj):
                return  # still charged
            if cur is not None:
                self.scheduler.release(key)
            self.unseen.pop(key, None)
            self._charge_unseen(obj)
            return
        self.unseen.pop(key, None)
        req, node, alloc = p
        self.placed[key] = p
        if cur is not None:
            if cur.node == node and _same(cur.alloc, alloc):
                cur.bound = True
                return
            self.scheduler.release(key)
        if node in self.state.index:
            self._hold(key, req, node, alloc)

    def delete_pod(self, obj: Mapping[str, Any]) -> None:
        key = _key(obj)
        if self._change_logs:
            self._touch(key)
        self.dra_pod_event(key, None)
        self._shape_of.pop(key, None)  # its shape stays in the history
        self.placed.pop(key, None)
        self.inflight.pop(key, None)
        self.picks.take(key)
        self.starting.discard(key)
        self.unseen.pop(key, None)
        self._set_host(key, "")
        if key in self.state.pods:
            self.scheduler.release(key)

    # -- checks ---------------
    def drift(self) -> list[str]:
        """Pods where the live state differs from what the annotations say."""
        out = []
        for key, (_req, node, alloc) in self.placed.items():
            r = self.state.pods.get(key)
            if node not in self.state.index:
                continue
            if r is None or r.node != node or not _same(r.alloc, alloc):
                out.append(key)
        for key in self.state.pods:
            if key not in self.placed and key not in self.inflight and key not in self.unseen \
                    and key not in self.claim_held:
                out.append(key)
        return out

    def fingerprint(self) -> dict[str, object]:
        return self.state.fingerprint()

    def node_modes(self) -> dict[str, Mode]:
        return {name: s.mode for name, s in self.specs.items()}


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a rebuild runs: it makes several objects per pod that
    all live on (records, reservations, ledger entries), and the collector would scan the
    growing heap of pod objects again and again for none (a third of the rebuild's time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _ended(obj: Mapping[str, Any]) -> bool:
    return (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _same(a: Allocation, b: Allocation) -> bool:
    return a.per_gpu_mem() == b.per_gpu_mem() and a.per_gpu_core() == b.per_gpu_core() and (
        {c: tuple(sorted(g)) for c, g in a.mem.items()}
        == {c: tuple(sorted(g)) for c, g in b.mem.items()}
    )

