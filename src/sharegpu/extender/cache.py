"""The cluster cache: the core's ClusterState fed by Node and Pod objects.

Everything here is synchronous and free of I/O; the informer feeds it events and the HTTP
handlers ask it questions, all on one event loop, so every method runs atomically.

What a pod holds comes from its annotations once it is bound
(:func:`sharegpu.core.pods.placement_of`);
the binder's own reservations are *in flight* until the binding is created, and events for an
in-flight pod do not touch its reservation. ``nodeName`` never changes once set, so an event that
shows a pod unbound after the view saw it bound is stale and ignored.

Host CPU and memory (:mod:`sharegpu.core.hostresources`): a GPU pod's request carries its CPU and
memory, so the state charges them with its GPUs; every other bound, live pod (no GPU, or a GPU
pod the state does not hold) is in the *host ledger* (``host``), charged per node with
:meth:`ClusterState.charge_host`. A pod is in exactly one of the two.

The ledger the features of :class:`~.view.ClusterView` read and write; it calls none of them
except two ports it is handed: the GPUs of DRA nodes (``gpus``) and the held picks that give way
to what a bound pod holds (``give_way``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ..core import hostresources, names
from ..core.annotations import Allocation
from ..core.errors import PlacementError, ValidationError
from ..core.modes import Mode
from ..core.nodes import spec_from_node
from ..core.placement.learned import LearnedWorkload
from ..core.podreader import Placed, PlacementReader, pod_key
from ..core.pods import is_terminated, node_of
from ..core.request import PodRequest
from ..core.scheduler import Scheduler
from ..core.startingpods import StartingPods, started
from ..core.state import ClusterState, NodeSpec, Reservation

log = logging.getLogger(__name__)

UNKNOWN_NODE = "node has no GPUs known to sharegpu (no GPU resources or annotations)"


class NodeGpus(Protocol):
    """Where the GPUs of some nodes come from other than their device-plugin resources (the
    DRA nodes' ResourceSlices), and what else those nodes hold (allocated claims)."""

    claim_held: Mapping[str, Any]  # state keys the source holds (not pods)

    def node_spec(self, obj: Mapping[str, Any], spec: NodeSpec | None) -> NodeSpec | None: ...

    def nodes_reset(self) -> None: ...

    def hold_all(self, state: ClusterState) -> None: ...

    def node_added(self, name: str) -> None: ...

    def node_removed(self, name: str, keys: list[str], *, forget: bool) -> None: ...


class _NoNodeGpus:
    claim_held: Mapping[str, Any] = {}

    def node_spec(self, obj: Mapping[str, Any], spec: NodeSpec | None) -> NodeSpec | None:
        return spec

    def nodes_reset(self) -> None:
        pass

    def hold_all(self, state: ClusterState) -> None:
        pass

    def node_added(self, name: str) -> None:
        pass

    def node_removed(self, name: str, keys: list[str], *, forget: bool) -> None:
        pass


class ClusterCache:
    """Nodes and pods as the extender knows them: the state, what bound pods' annotations say,
    in-flight reservations, pods without a decision, the host ledger; rebuilt from lists
    (:meth:`reset`) and kept by watch events (``upsert_*``, ``delete_*``)."""

    def __init__(self, policy: str, learned: LearnedWorkload) -> None:
        """``learned``: the policy's target workload, which counts the shapes of the pods the
        state holds (and is prepared again after a rebuild)."""
        self.policy_name = policy
        self.policy = learned.policy  # the policy the learned workload prepares
        self.learned = learned
        # the GPUs of DRA nodes (set by the composition root; none until then)
        self.gpus: NodeGpus = _NoNodeGpus()
        # gives back the picks held on a node so that a bound pod's record fits (the keys)
        self.give_way: Callable[[str], list[str]] = lambda node: []
        self.state = ClusterState()
        self.scheduler = Scheduler(self.state, self.policy, tie_break="order")
        self.specs: dict[str, NodeSpec] = {}
        self.placed: dict[str, Placed] = {}  # what bound pods' annotations say
        self.inflight: dict[str, Reservation] = {}
        # bound (or being bound) pods the kubelet has not started: the binder keeps the pods
        # it binds distinguishable to the kubelet (sharegpu.core.startingpods)
        # the nodes whose agent names each pod to the kubelet (sharegpu.io/pod-resources)
        self.naming_nodes: set[str] = set()
        # whether a node's promise holds now (set by the composition root: its agent serves)
        self.naming_trusted: Callable[[str], bool] = lambda node: True
        self.starting = StartingPods(self.naming_nodes, self._trusted)
        # bound GPU pods without a recorded decision, charged conservatively (key -> node)
        self.unseen: dict[str, str] = {}
        # bound pods whose annotations over-commit their GPUs, counted all the same (key -> node)
        self.overcommitted: dict[str, str] = {}
        # called with such a pod the first time it is seen (the replica posts an Event)
        self.on_unseen: Callable[[Mapping[str, Any]], None] | None = None
        # bound, live pods whose host CPU and memory the state does not hold with GPUs:
        # key -> (node, CPU millicores, memory MiB); and their sums per node (every node, GPU
        # or not, so a node that becomes a GPU node starts with what already runs there)
        self.host: dict[str, tuple[str, int, int]] = {}
        self.host_sum: dict[str, list[int]] = {}
        self.problems: OrderedDict[str, str] = OrderedDict()
        self.nodes_version = 0  # grows whenever a node is added, changed or removed
        self.synced = False
        # one set per consistency check under way (track_changes): the pods this view changed
        # or learnt about since the check began, which its list may show as they were before
        self._change_logs: list[set[str]] = []
        self.reader = PlacementReader()
        self.reader.on_problem = self.problem
        learned.prepare(self.state)

    def _trusted(self, node: str) -> bool:
        return self.naming_trusted(node)

    def problem(self, key: str, reason: str) -> None:
        self.problems[key] = reason
        self.problems.move_to_end(key)
        while len(self.problems) > 1000:
            self.problems.popitem(last=False)
        log.warning("%s: %s", key, reason)

    # -- full rebuild ---------------
    def reset(self, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
              ) -> tuple[int, list[tuple[str, Mapping[str, Any]]]]:
        """Rebuild everything from listed Node and Pod objects (start, relist after 410 Gone,
        repair after a failed consistency check). In-flight reservations are kept. Returns the
        number of pods whose annotations could not be applied, and the unbound pods that name
        ResourceClaims (key, pod)."""
        state = ClusterState()
        specs: dict[str, NodeSpec] = {}
        self.gpus.nodes_reset()
        self.naming_nodes.clear()
        for obj in nodes:
            self._note_naming(obj)
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
        starting = StartingPods(self.naming_nodes, self._trusted)
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
                self.problem(key, f"unreadable GPU annotations or request: {e}")
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
            if not started(obj):
                starting.add(key, p[1], p[0], p[2])
            if p[1] in state.index:  # else applied when the node appears
                records.append(p)
        overcommitted: dict[str, str] = {}
        for key, reason in state.restore(records):
            p = placed.get(key)
            if p is not None and key not in state.pods and _hold_overfull(
                    state, self.problem, key, p, reason):
                overcommitted[key] = p[1]
                continue
            placed.pop(key, None)
            bad += 1
        self.overcommitted = overcommitted
        self.gpus.hold_all(state)  # allocated DRA claims, after the pods' records
        for key, r in list(self.inflight.items()):
            try:
                self.inflight[key] = state.reserve(r.request, r.node, r.alloc, check_host=False)
            except (PlacementError, KeyError) as e:
                self.problem(key, f"in-flight reservation dropped on rebuild: {e}")
                del self.inflight[key]
                continue
            if key in self.starting:  # being bound: the binder counted it as starting
                starting.add(key, r.node, r.request, r.alloc)
        self.starting = starting
        if self._change_logs:  # a rebuild during a check: every pod is newer than its list
            for key in (*self.placed, *self.state.pods, *placed, *listed, *self.host):
                self.touch(key)
        self.state, self.specs, self.placed = state, specs, placed
        self.host, self.host_sum = {}, {}
        known, self.unseen = self.unseen, {}
        for obj in unseen:  # after every recorded decision, as the consistency check does
            self._charge_unseen(obj, notify=pod_key(obj) not in known)
        # every other bound, live pod: its host CPU and memory, per node
        held = state.pods
        for key, node, cpu, mem in on_nodes:
            if key not in held:
                self._set_host(key, node, cpu, mem, apply=False)
        for node, (cpu, mem) in self.host_sum.items():
            if node in state.index:
                state.charge_host(node, cpu, mem)
        self.nodes_version += 1
        self.scheduler = Scheduler(state, self.policy, tie_break="order")
        learned = self.learned
        learned.clear()
        for key, (req, _node, alloc) in placed.items():
            learned.count(key, req, alloc)
        learned.prepare(state)
        self.synced = True
        return bad, waiting

    def _charge_unseen(self, obj: Mapping[str, Any], *, notify: bool = True) -> None:
        """Charge a bound GPU pod that carries no decision (see
        :meth:`ClusterState.charge_unseen`)."""
        key = pod_key(obj)
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
            self.problem(key, f"GPU pod without a scheduling decision not charged: {e}")
            return
        self.unseen[key] = node
        self._set_host(key, "")
        self.problem(key, f"holds GPU resources on {node} but carries no scheduling decision; "
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
        p = self.placed.get(pod_key(obj))
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if p is None or (uid and p[0].uid and p[0].uid != uid):
            return None
        return p

    # -- nodes ---------------
    def _spec(self, obj: Mapping[str, Any]) -> NodeSpec | None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        try:
            spec = self.gpus.node_spec(obj, spec_from_node(obj))
            if spec is not None and (spec.cpu_milli is None or spec.mem_mib is None):
                problem = "; ".join(hostresources.node_allocatable(obj)[2])
                if problem and self.problems.get(f"node/{name}") != problem:
                    self.problem(f"node/{name}", problem)  # once, not at every status update
            return spec
        except ValidationError as e:
            self.problem(f"node/{name}", str(e))
            # keep the last good view of the node rather than dropping its pods
            return self.specs.get(name)

    def _note_naming(self, obj: Mapping[str, Any]) -> str:
        """Whether the node's agent names each pod to the kubelet; the node's name."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if (meta.get("annotations") or {}).get(names.ANN_NODE_POD_RESOURCES) == "v1":
            self.naming_nodes.add(name)
        else:
            self.naming_nodes.discard(name)
        return name

    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        spec = self._spec(obj)
        name = self._note_naming(obj)
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
            self.problem(f"node/{name}", f"node update refused, pods no longer fit: {e}")
            return
        self.specs[name] = spec
        self.nodes_version += 1
        if fresh:
            cpu, mem = self.host_sum.get(name, (0, 0))
            self.state.charge_host(name, cpu, mem)
            for key, (req, node, alloc) in self.placed.items():
                if node == name and key not in self.state.pods:
                    self._hold(key, req, node, alloc)
            self.gpus.node_added(name)
        if fresh and not self.learned.shapes:
            self.learned.prepare(self.state)

    def delete_node(self, name: str, *, forget: bool = True) -> None:
        """``forget``: the Node is gone (else it only has no GPUs now; a ResourceSlice may
        give it some)."""
        keys: list[str] = []
        if forget:
            self.naming_nodes.discard(name)
        if name in self.state.index:
            self.nodes_version += 1
            keys = self.state.remove_node(name)
            for key in keys:
                self.inflight.pop(key, None)
        self.specs.pop(name, None)
        self.gpus.node_removed(name, keys, forget=forget)

    # -- pods ---------------
    def _hold(self, key: str, req: PodRequest, node: str, alloc: Allocation) -> None:
        self.overcommitted.pop(key, None)
        try:
            try:
                self.state.reserve(req, node, alloc, check_host=False)
            except PlacementError:
                # what a bound pod holds comes first: picks held on its node give way (their
                # binds choose afresh)
                if not self.give_way(node):
                    raise
                self.state.reserve(req, node, alloc, check_host=False)
            self.state.bind(key)
        except PlacementError as e:
            if not _hold_overfull(self.state, self.problem, key, (req, node, alloc), str(e)):
                return
            self.overcommitted[key] = node
        self.learned.count(key, req, alloc)
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

    def touch(self, key: str) -> None:
        for log in self._change_logs:
            log.add(key)

    def upsert_pod(self, key: str, obj: Mapping[str, Any]) -> None:
        """A pod's event (added or modified)."""
        if self._change_logs:
            self.touch(key)
        if key in self.inflight:
            # being bound: the binder holds it; but the node's agent may already have marked it
            # assigned (its kubelet started it) before the binding's answer came back
            if started(obj):
                self.starting.discard(key)
            return
        try:
            p = self.reader.placement(obj)
        except ValidationError as e:
            self.problem(key, f"unreadable GPU annotations or request: {e}")
            self.starting.discard(key)
            self._sync_host(key, obj)  # its CPU and memory count all the same
            return
        self._apply_pod(key, obj, p)
        self._sync_starting(key, obj, p)
        self._sync_host(key, obj)

    def _sync_starting(self, key: str, obj: Mapping[str, Any], p: Placed | None) -> None:
        """A bound pod starts when its node's agent marks it assigned (the kubelet allocated
        its devices) or it runs, whatever the mark says; until then it is starting
        (:mod:`sharegpu.core.startingpods`)."""
        if p is None or key not in self.placed or started(obj):
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
            self.overcommitted.pop(key, None)
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

    def delete_pod(self, key: str) -> None:
        """A pod's deletion."""
        if self._change_logs:
            self.touch(key)
        self.placed.pop(key, None)
        self.inflight.pop(key, None)
        self.starting.discard(key)
        self.unseen.pop(key, None)
        self.overcommitted.pop(key, None)
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
                    and key not in self.gpus.claim_held:
                out.append(key)
        return out

    # -- in-flight reservations ---------------
    def give_back(self, key: str) -> None:
        """Release ``key``'s in-flight reservation (a pick given up, a failed bind)."""
        if self._change_logs:
            self.touch(key)
        self.starting.discard(key)
        if self.inflight.pop(key, None) is not None and key in self.state.pods:
            self.scheduler.release(key)

    def bound(self, key: str) -> None:
        """The binding was created: the reservation is now what the pod's annotations say."""
        if self._change_logs:
            self.touch(key)
        r = self.inflight.pop(key, None)
        if r is None or key not in self.state.pods:
            return
        self.state.bind(key)
        self.placed[key] = (r.request, r.node, r.alloc)
        self.learned.count(key, r.request, r.alloc)

    def fingerprint(self) -> dict[str, object]:
        return self.state.fingerprint()

    def node_modes(self) -> dict[str, Mode]:
        return {name: s.mode for name, s in self.specs.items()}


def _hold_overfull(state: ClusterState, problem: Callable[[str, str], None], key: str,
                   p: Placed, reason: str) -> bool:
    """A bound pod whose annotations over-commit its GPUs: counted as they say (the GPU is then
    overfull and nothing more is placed on it until pods end) and reported, never left out,
    which would show the GPU emptier than it is and place more pods there. ``False`` (reported,
    not counted) when they name GPUs the node does not have."""
    req, node, alloc = p
    try:
        state.hold(req, node, alloc)
    except PlacementError as e:
        problem(key, f"annotations name GPUs the node does not have, not counted: {e}")
        return False
    problem(key, f"annotations over-commit: {reason}; counted as they say: the GPU is overfull, "
                 "nothing more is placed on it until pods end")
    return True


def _ended(obj: Mapping[str, Any]) -> bool:
    return (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _same(a: Allocation, b: Allocation) -> bool:
    return a.per_gpu_mem() == b.per_gpu_mem() and a.per_gpu_core() == b.per_gpu_core() and (
        {c: tuple(sorted(g)) for c, g in a.mem.items()}
        == {c: tuple(sorted(g)) for c, g in b.mem.items()}
    )

