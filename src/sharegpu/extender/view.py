"""The extender's view of the cluster: the core's ClusterState fed by Node and Pod objects.

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
"""

from __future__ import annotations

import gc
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from itertools import compress
from operator import itemgetter
from typing import Any

import numpy as np

from .. import hostresources, names
from ..annotations import Allocation, decode
from ..errors import PlacementError, ValidationError
from ..modes import Mode
from ..nodes import spec_from_node
from ..placement.base import get_policy, resolve
from ..placement.fragmentation import Shape, TargetWorkload
from ..placement.moves import has_fast_path
from ..placement.nodecache import ShapeCache
from ..placement.rowmemo import unique_keys
from ..pods import is_terminated, node_of
from ..request import Kind, PodRequest, parse_pod
from ..scheduler import Scheduler
from ..state import _KIND_MODES, _MODE_CODES, ClusterState, NodeSpec, Reservation, without_host

log = logging.getLogger(__name__)

Placed = tuple[PodRequest, str, Allocation]
UNKNOWN_NODE = "node has no GPUs known to sharegpu (no GPU resources or annotations)"
# policies whose score of a node reads that node's row alone (so scores keep until it changes)
ROW_LOCAL_POLICIES = frozenset({"fgd", "strand", "strandlp"})


def shape_of(req: PodRequest, alloc: Allocation) -> Shape | None:
    """The FGD shape of a placed pod: its CPU, GPU per GPU of its first container and how many
    GPUs (as the simulator's trace shapes)."""
    if not req.containers:
        return None
    c = req.containers[0]
    per = alloc.mem.get(c.index) or {}
    if not per:
        return None
    models = "|".join(sorted(req.models)) if req.models else ""
    return (req.cpu_milli, int(max(per.values())), len(per), models)


def default_workload(state: ClusterState) -> TargetWorkload:
    """Used until pods have been seen: fractions of the most common GPU size, and whole cards."""
    n = state.n
    sizes = state.gpu_total[:n][state.gpu_exists[:n]]
    size = int(Counter(sizes.tolist()).most_common(1)[0][0]) if len(sizes) else 16
    parts = sorted({max(size // d, 1) for d in (8, 4, 2, 1)})
    shapes: list[Shape] = [(0, m, 1, "") for m in parts] + [(0, size, 2, "")]
    return TargetWorkload.from_shapes(shapes, coverage=1.0)


def request_key(req: PodRequest) -> tuple[Any, ...]:
    return (
        req.kind, req.cpu_milli, req.mem_mib,
        tuple((c.gpu_mem, c.gpu_core, c.gpus, c.whole) for c in req.containers),
        tuple(sorted(req.models)) if req.models is not None else None,
    )


class PlacementReader:
    """:func:`sharegpu.pods.placement_of` with its pure steps memoised: pods made from one
    template (equal labels' GPU count and equal containers, init containers, overhead and
    pod-level resources) share one parsed GPU request and one host CPU and memory request,
    and equal annotation values share a decoded allocation (a rebuild reads 200,000 pods). The
    core functions (:func:`sharegpu.request.parse_pod`,
    :func:`sharegpu.hostresources.pod_request`) stay the only place of the rules.

    Requests carry the pod's host CPU and memory; a malformed CPU or memory quantity (an API
    server never stores one) counts as none, and ``on_problem`` is told."""

    _ANNS = (names.ANN_ALLOCATION, names.ANN_CORE, names.ANN_MEM_IDX, names.ANN_MEM_POD)

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        # template key -> (GPU request or why it is refused, (CPU millicores, memory MiB))
        self._tmpl: dict[tuple[Any, ...], tuple[PodRequest | ValidationError, tuple[int, int]]]
        self._tmpl = {}
        self._alloc: dict[tuple[Any, ...], Allocation | None] = {}
        self._last: tuple[Any, tuple[PodRequest | ValidationError, tuple[int, int]]] | None
        self._last = None
        self.on_problem: Callable[[str, str], None] | None = None

    @staticmethod
    def _template_key(obj: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """Equal for pods whose GPU and host requests are equal; ``None`` for a pod that
        cannot be keyed (then it is parsed, and refused where it breaks a rule)."""
        try:
            spec = obj["spec"]
            labels = obj["metadata"].get("labels") or {}
            parts: list[Any] = [labels.get(names.POD_LABEL_GPU_COUNT)]
            for c in spec["containers"]:
                res = c.get("resources") or {}
                lim, req = res.get("limits") or {}, res.get("requests") or {}
                "".join((*lim.values(), *req.values()))  # str only: 1 == 1.0 == True
                parts.append((c.get("name"), tuple(lim.items()), tuple(req.items())))
            inits = spec.get("initContainers")
            if inits:
                parts.append(hostresources.pod_request_key(obj))
                for c in inits:  # their GPU resources are refused: key them as well
                    res = c.get("resources") or {}
                    "".join((res.get("limits") or {}).values())
                    "".join((res.get("requests") or {}).values())
            elif spec.get("overhead") or spec.get("resources"):
                parts.append(hostresources.pod_request_key(obj))
            key = tuple(parts)
            hash(key)
            return key
        except (AttributeError, KeyError, TypeError, ValueError):
            return None

    def _template(
        self, obj: Mapping[str, Any]
    ) -> tuple[PodRequest | ValidationError, tuple[int, int]]:
        last = self._last
        if last is not None and last[0] is obj:
            return last[1]
        key = self._template_key(obj)
        hit = self._tmpl.get(key) if key is not None else None
        if hit is None:
            base: PodRequest | ValidationError
            try:
                base = parse_pod(obj)
            except ValidationError as e:
                base = e
            try:
                host = hostresources.pod_request(obj)
            except ValidationError as e:
                if self.on_problem is not None:
                    self.on_problem(_key(obj), f"CPU/memory request not counted: {e}")
                host = (0, 0)
            hit = (base, host)
            if key is not None:
                if len(self._tmpl) >= self.size:
                    self._tmpl.clear()
                self._tmpl[key] = hit
        self._last = (obj, hit)
        return hit

    def host(self, obj: Mapping[str, Any]) -> tuple[int, int]:
        """(CPU millicores, memory MiB) the pod uses where it is bound."""
        return self._template(obj)[1]

    def wants_gpu(self, obj: Mapping[str, Any]) -> bool:
        """Whether the pod asks for GPU resources (ValidationError when its request is
        refused)."""
        base = self._template(obj)[0]
        if isinstance(base, ValidationError):
            raise base
        return base.wants_gpu

    def request(self, obj: Mapping[str, Any]) -> PodRequest:
        spec = obj.get("spec") or {}
        meta = obj.get("metadata") or {}
        if not isinstance(spec, Mapping) or not isinstance(meta, Mapping):
            return parse_pod(obj)  # refuses it, naming the field
        labels = meta.get("labels") or {}
        ns, name, uid = meta.get("namespace") or "default", meta.get("name") or "", meta.get(
            "uid") or ""
        if (not isinstance(labels, Mapping) or type(ns) is not str or type(name) is not str
                or type(uid) is not str):
            return parse_pod(obj)  # refuses it, naming the field
        base, (cpu, mem) = self._template(obj)
        if isinstance(base, ValidationError):
            raise base
        return PodRequest(ns, name, base.kind, base.containers, uid, cpu, mem,
                          labels=dict(labels))

    def unannotated(self, obj: Mapping[str, Any]) -> tuple[PodRequest, str] | None:
        """Same answer as :func:`sharegpu.pods.unannotated_gpu_pod` (with the host request)."""
        node = hostresources.charges_node(obj)
        anns = (obj.get("metadata") or {}).get("annotations") or {}
        if not node or self.allocation(anns) is not None:
            return None
        if not self.wants_gpu(obj):
            return None
        return self.request(obj), node

    def allocation(self, annotations: Mapping[str, str]) -> Allocation | None:
        get = annotations.get
        a, b, c, d = self._ANNS
        key = (get(a), get(b), get(c), get(d))
        try:
            return self._alloc[key]
        except KeyError:
            pass
        alloc = decode(annotations)
        if len(self._alloc) >= self.size:
            self._alloc.clear()
        self._alloc[key] = alloc
        return alloc

    def placement(self, obj: Mapping[str, Any]) -> Placed | None:
        """Same answer as ``placement_of(obj)``."""
        if is_terminated(obj):
            return None
        alloc = self.allocation((obj.get("metadata") or {}).get("annotations") or {})
        if alloc is None:
            return None
        node = node_of(obj)
        if not node:
            return None
        return self.request(obj), node, alloc


class ClusterView:
    def __init__(self, policy: str = "default", *, workload_refresh: int = 50,
                 graded: bool = False, workload: TargetWorkload | None = None) -> None:
        """``workload``: a fixed target workload for the policy (e.g. the history a simulation
        ran with), never re-learnt; by default it is learnt from the pods seen."""
        self.policy_name = policy
        self.graded = graded  # prioritize scores every feasible node, not only the pick
        self.policy = get_policy(policy)
        self.workload_refresh = workload_refresh
        self.state = ClusterState()
        self.scheduler = Scheduler(self.state, self.policy, tie_break="order")
        self.specs: dict[str, NodeSpec] = {}
        self.placed: dict[str, Placed] = {}  # what bound pods' annotations say
        self.inflight: dict[str, Reservation] = {}
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
        self._reasons: OrderedDict[tuple[Any, ...], dict[int, tuple[int, str]]] = OrderedDict()
        self._empty_ok: dict[tuple[Any, ...], tuple[int, np.ndarray]] = {}
        # per request shape: the state it was computed on, the mask, each node's version then
        self._feasible: OrderedDict[tuple[Any, ...], tuple[ClusterState, np.ndarray, np.ndarray]]
        self._feasible = OrderedDict()
        self._epoch = 0  # grows whenever the policy is prepared afresh
        # the last prioritize: (pod asked about, names, their slots, what it read, answer)
        self._last_scores: tuple[
            tuple[Any, ...], list[str], np.ndarray, tuple[tuple[Any, ...], np.ndarray],
            dict[str, int],
        ] | None = None
        self._nodes_version = 0  # grows whenever a node is added, changed or removed
        self._passed: tuple[list[str], np.ndarray, int] = ([], np.zeros(0, dtype=np.int64), -1)
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

    # -- policy and its target workload ---------------
    def _prepare(self, force: bool = True) -> None:
        """Learn the target workload and hand it to the policy. Unless ``force``d (a new
        state), a workload that barely moved (total variation below 5 %) is not handed over
        again, since that would drop the policy's caches for nothing."""
        total = self._seen
        if self.fixed_workload is not None:
            workload = self.fixed_workload
        elif total:
            # every pod's shape with its host memory, as the simulator's history has them
            pods = list(self.history.elements())
            workload = TargetWorkload.from_shapes([t for t, _ in pods],
                                                  mem=[m for _, m in pods])
        else:
            workload = default_workload(self.state)
        self._shapes_at_prepare = total
        if not force and self.workload is not None and _distance(self.workload, workload) < 0.05:
            return
        self.workload = workload
        self.policy.prepare(self.state, self.workload)
        self._epoch += 1
        if self._scores is not None:
            self._scores = ShapeCache({"score": np.float64})

    def use_workload(self, workload: TargetWorkload | None) -> None:
        """Fix the policy's target workload (``None``: learn it from the pods seen again)."""
        self.fixed_workload = workload
        self._prepare()

    def maybe_refresh_workload(self) -> None:
        """Re-learn the target workload from the pods seen: first after ``workload_refresh``
        pods, then each time their number doubled."""
        total = self._seen
        if total < self.workload_refresh or self.fixed_workload is not None:
            return
        if self._shapes_at_prepare < self.workload_refresh:
            self._prepare()
        elif total >= 2 * self._shapes_at_prepare:
            self._prepare(force=False)

    def _count_shape(self, key: str, req: PodRequest, alloc: Allocation) -> None:
        if key in self._shape_of:
            return
        s = shape_of(req, alloc)
        if s is not None:
            self._shape_of[key] = s
            self._seen += 1
            self.shapes[s] += 1
            self.history[(s, req.mem_mib)] += 1

    def _problem(self, key: str, reason: str) -> None:
        self.problems[key] = reason
        self.problems.move_to_end(key)
        while len(self.problems) > 1000:
            self.problems.popitem(last=False)
        log.warning("%s: %s", key, reason)

    # -- full rebuild ---------------
    def reset(self, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> int:
        """Rebuild everything from listed Node and Pod objects (start, relist after 410 Gone,
        repair after a failed consistency check). In-flight reservations are kept. Returns the
        number of pods whose annotations could not be applied."""
        with _gc_paused():
            return self._reset(nodes, pods)

    def _reset(self, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
               ) -> int:
        state = ClusterState()
        specs: dict[str, NodeSpec] = {}
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
        bad = 0
        for obj in pods:  # the same answers as placement_of, known_bound, unannotated_gpu_pod
            meta = obj.get("metadata") or {}
            key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
            if tracking:
                listed.append(key)
            if is_terminated(obj):
                continue  # holds nothing, uses nothing
            node = node_of(obj)
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
            if p[1] in state.index:  # else applied when the node appears
                records.append(p)
        for key, reason in state.restore(records):
            self._problem(key, f"annotations over-commit: {reason}")
            placed.pop(key, None)
            bad += 1
        for key, r in list(self.inflight.items()):
            try:
                self.inflight[key] = state.reserve(r.request, r.node, r.alloc, check_host=False)
            except (PlacementError, KeyError) as e:
                self._problem(key, f"in-flight reservation dropped on rebuild: {e}")
                del self.inflight[key]
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
        self._feasible.clear()
        self._nodes_version += 1
        self.scheduler = Scheduler(state, self.policy, tie_break="order")
        self._reasons.clear()
        self._shape_of.clear()
        self._seen = 0
        self.shapes.clear()
        self.history.clear()
        for key, (req, _node, alloc) in placed.items():
            self._count_shape(key, req, alloc)
        self._prepare()
        self.synced = True
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
            spec = spec_from_node(obj)
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
                self.delete_node(name)
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
        if fresh and not self.shapes:
            self._prepare()

    def delete_node(self, name: str) -> None:
        if name in self.state.index:
            self._nodes_version += 1
            for key in self.state.remove_node(name):
                self.inflight.pop(key, None)
        self.specs.pop(name, None)

    # -- pods ---------------
    def _hold(self, key: str, req: PodRequest, node: str, alloc: Allocation) -> None:
        try:
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
        if key in self.inflight:
            return
        try:
            p = self.reader.placement(obj)
        except ValidationError as e:
            self._problem(key, f"unreadable GPU annotations or request: {e}")
            self._sync_host(key, obj)  # its CPU and memory count all the same
            return
        self._apply_pod(key, obj, p)
        self._sync_host(key, obj)

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
        self._shape_of.pop(key, None)  # its shape stays in the history
        self.placed.pop(key, None)
        self.inflight.pop(key, None)
        self.unseen.pop(key, None)
        self._set_host(key, "")
        if key in self.state.pods:
            self.scheduler.release(key)

    # -- decisions ---------------
    def slots(self, names: list[str]) -> np.ndarray:
        """Node slot of each name, -1 for names the view does not know."""
        index = self.state.index
        if len(names) > 1:
            try:  # all known: one C-level lookup
                return np.array(itemgetter(*names)(index), dtype=np.int64)
            except KeyError:
                pass
        get = index.get
        return np.fromiter((get(n, -1) for n in names), dtype=np.int64, count=len(names))

    def filter(
        self, req: PodRequest, names: list[str]
    ) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """(passing names, failed {name: reason}, unresolvable {name: reason})."""
        if not req.wants_gpu:
            return list(names), {}, {}
        self.maybe_refresh_workload()
        slots = self.slots(names)
        known = slots >= 0
        if known.all():
            ok = self.feasible_at(req, slots)
        else:
            ok = np.zeros(len(names), dtype=bool)
            ok[known] = self.feasible_at(req, slots[known])
        passed = list(compress(names, ok.tolist()))
        # the prioritize that follows asks for these names: their slots hold while no node
        # is added, changed or removed
        self._passed = (passed, slots[ok], self._nodes_version)
        failed: dict[str, str] = {}
        unres: dict[str, str] = {}
        bad = np.flatnonzero(~ok)
        if len(bad) == 0:
            return passed, failed, unres
        # reasons are kept per GPU request: where the host CPU and memory admit the pod, its
        # reason is the GPU request's (explain checks them before the GPUs)
        gpu_req = without_host(req)
        cache = self._reason_cache(gpu_req)
        st = self.state
        at = slots[bad]
        at_known = np.where(at >= 0, at, 0)
        version = st.version[at_known].tolist()
        cpu, mem = req.cpu_milli, req.mem_mib
        empty_ok = self.fits_empty(gpu_req)[at_known]
        host_short = np.zeros(len(at), dtype=bool)
        if cpu or mem:
            empty_ok &= (st.cpu_cap[at_known] >= cpu) & (st.mem_cap[at_known] >= mem)
            host_short = (st.cpu_free[at_known] < cpu) | (st.mem_free[at_known] < mem)
        for j, i, v, empty, short in zip(bad.tolist(), at.tolist(), version,
                                         empty_ok.tolist(), host_short.tolist(), strict=True):
            name = names[j]
            if i < 0:
                unres[name] = UNKNOWN_NODE
                continue
            if short:
                reason = st.explain(req, i) or "does not fit"
            else:
                hit = cache.get(i)
                if hit is not None and hit[0] == v:
                    reason = hit[1]
                else:
                    reason = st.explain(gpu_req, i) or "does not fit"
                    cache[i] = (v, reason)
            (failed if empty else unres)[name] = reason
        return passed, failed, unres

    def feasible_at(self, req: PodRequest, slots: np.ndarray) -> np.ndarray:
        """The core's feasibility of node ``slots`` (known ones): the GPU request's, kept per
        GPU request (:meth:`feasible`), and the host CPU and memory's, read afresh (pods
        differ in CPU and memory far more than in GPU shape)."""
        if not req.cpu_milli and not req.mem_mib:
            return self.feasible(req)[slots]
        st = self.state
        ok = self.feasible(without_host(req))[slots]
        if req.cpu_milli:
            ok &= st.cpu_free[slots] >= req.cpu_milli
        if req.mem_mib:
            ok &= st.mem_free[slots] >= req.mem_mib
        return ok

    def feasible(self, req: PodRequest) -> np.ndarray:
        """The core's feasibility mask over every node, kept per request shape and brought up
        to date row by row: a node's feasibility reads that node's row alone, so only nodes
        whose version moved since are checked again. Do not modify the returned array."""
        st, n = self.state, self.state.n
        k = request_key(req)
        hit = self._feasible.get(k)
        if hit is not None and hit[0] is st and len(hit[1]) == n:
            _, mask, ver = hit
            self._feasible.move_to_end(k)
            stale = np.flatnonzero(ver != st.version[:n])
            if len(stale) == 0:
                return mask
            if len(stale) <= n // 8:
                mask[stale] = st.feasible(req, stale)
                ver[stale] = st.version[stale]
                return mask
        mask = st.feasible(req)
        self._feasible[k] = (st, mask, st.version[:n].copy())
        self._feasible.move_to_end(k)
        while len(self._feasible) > 64:
            self._feasible.popitem(last=False)
        return mask

    def _reason_cache(self, req: PodRequest) -> dict[int, tuple[int, str]]:
        k = request_key(req)
        c = self._reasons.get(k)
        if c is None:
            c = self._reasons[k] = {}
            while len(self._reasons) > 64:
                self._reasons.popitem(last=False)
        else:
            self._reasons.move_to_end(k)
        return c

    def fits_empty(self, req: PodRequest) -> np.ndarray:
        """Nodes where the pod would fit if they were empty (else no preemption can help);
        kept per request shape until a node is added, changed or removed."""
        k = request_key(req)
        hit = self._empty_ok.get(k)
        if hit is not None and hit[0] == self._nodes_version:
            return hit[1]
        ok = self._fits_empty(req)
        if len(self._empty_ok) > 256:
            self._empty_ok.clear()
        self._empty_ok[k] = (self._nodes_version, ok)
        return ok

    def _fits_empty(self, req: PodRequest) -> np.ndarray:
        st, n = self.state, self.state.n
        ok = st.active[:n].copy()
        if req.cpu_milli:
            ok &= st.cpu_cap[:n] >= req.cpu_milli
        if req.mem_mib:
            ok &= st.mem_cap[:n] >= req.mem_mib
        modes = _KIND_MODES[req.kind]
        codes = np.array([_MODE_CODES[m] for m in modes if m in _MODE_CODES], dtype=np.int8)
        ok &= np.isin(st.mode[:n], codes)
        if req.models is not None:
            ids = [st.models[m] for m in req.models if m in st.models]
            ok &= np.isin(st.model[:n], np.array(ids, dtype=np.int32))
        for c in req.containers:
            if c.whole:
                ok &= st.gpu_count[:n] >= c.gpus
            else:
                ok &= (st.gpu_exists[:n] & (st.gpu_total[:n] >= c.gpu_mem)).sum(axis=1) >= c.gpus
        return ok

    def prioritize(self, req: PodRequest, names: list[str]) -> dict[str, int]:
        """Scores 0..10: the node the core policy would pick gets 10; with ``graded`` the other
        feasible nodes get 0..9 in the order of the policy's scores, else 0 (with the extender's
        weight above kube-scheduler's own scores, only the 10 ever decides); infeasible nodes 0.

        The last answer is kept with what it read (the pod, the names, the policy's epoch and
        the version of every node it scored, or of the whole cluster for policies that read
        more than a node's row), and given again while all of it is unchanged: the server asks
        right after answering the filter, so the prioritize that follows is a lookup. Do not
        modify the returned dict."""
        if not req.wants_gpu or not names:
            return dict.fromkeys(names, 0)
        self.maybe_refresh_workload()
        asked = (req.key, req.uid, request_key(req))
        last = self._last_scores
        if last is not None and last[0] == asked and last[1] == names and self._unchanged(last):
            return last[4]
        p_names, p_slots, p_version = self._passed
        if names is p_names and p_version == self._nodes_version:
            slots = p_slots
        else:
            slots = self.slots(names)
        out = self._prioritize(req, names, slots)
        self._last_scores = (asked, list(names), slots, self._read_now(slots), out)
        return out

    def still_current(self, scores: dict[str, int]) -> bool:
        """Whether ``scores``, the last answer :meth:`prioritize` gave, would be given again
        for the same pod and names now (nothing it read has changed)."""
        last = self._last_scores
        if last is None or last[4] is not scores:
            return False
        self.maybe_refresh_workload()
        return self._unchanged(last)

    def _read_now(self, slots: np.ndarray) -> tuple[tuple[Any, ...], np.ndarray]:
        """What a prioritize over node ``slots`` reads, as it is now: the state, its node set
        and the policy's epoch, and the versions of the nodes it scores."""
        st = self.state
        return (id(st), st.n, self._nodes_version, self._epoch), self._versions_read(slots)

    def _unchanged(self, last: tuple[Any, ...]) -> bool:
        (stamp, versions), now = last[3], self._read_now(last[2])
        return stamp == now[0] and bool(np.array_equal(versions, now[1]))

    def _versions_read(self, slots: np.ndarray) -> np.ndarray:
        st = self.state
        if not self._row_local:  # the policy may read any node: the whole cluster's versions
            return np.array([st.version[: st.n].sum()])
        return st.version[slots[slots >= 0]]

    def _prioritize(self, req: PodRequest, names: list[str], slots: np.ndarray) -> dict[str, int]:
        known = slots[slots >= 0]
        nodes = known[self.feasible_at(req, known)]
        if len(nodes) == 0:
            return dict.fromkeys(names, 0)
        scores = self.scores(req, nodes)
        if self.policy.integer_scores:
            scores = np.floor(scores)
        best = self.scheduler.pick(nodes, scores)
        if not self.graded:
            out = dict.fromkeys(names, 0)
            out[names[int(np.flatnonzero(slots == best)[0])]] = 10
            return out
        lo, hi = float(scores.min()), float(scores.max())
        if hi > lo:
            scaled = np.floor(9.0 * (scores - lo) / (hi - lo)).astype(np.int64)
        else:
            scaled = np.full(len(nodes), 9, dtype=np.int64)
        by_slot = np.zeros(self.state.n + 1, dtype=np.int64)  # the last one: unknown names
        by_slot[nodes] = np.minimum(scaled, 9)
        by_slot[best] = 10
        return dict(zip(names, by_slot[slots].tolist(), strict=True))

    def scores(self, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        """The policy's scores for feasible ``nodes``."""
        if self._scores is None or has_fast_path(req):
            return self.scheduler.scores(req, nodes)
        cache = self._scores
        col = cache.column(request_key(req))
        stale = cache.stale(self.state, nodes, col)
        if len(stale) > 16:
            # nodes whose rows are equal score equally (the policy reads only the node's row):
            # score one of each kind (most nodes of a fresh cluster look alike)
            st = self.state
            rows = np.concatenate(
                [st.gpu_total[stale], st.gpu_free[stale], st.core_free[stale],
                 st.gpu_pods[stale].astype(np.int64),
                 np.stack([st.model[stale].astype(np.int64), st.cpu_free[stale],
                           st.mem_free[stale]], axis=1)], axis=1)
            first, inverse = unique_keys(np.ascontiguousarray(rows))
            score = self.scheduler.scores(req, stale[first])[inverse]
            cache.store(self.state, stale, col, score=score)
        elif len(stale):
            cache.store(self.state, stale, col, score=self.scheduler.scores(req, stale))
        return cache.get("score", nodes, col)

    def reserve(self, req: PodRequest, node: str) -> Reservation:
        """Choose GPUs on ``node`` with the core policy and hold them, in flight. Raises
        PlacementError with the one clear reason when the pod does not fit there (any more)."""
        key = req.key
        i = self.state.index.get(node)
        if i is None:
            raise PlacementError(f"{key} on {node}: {UNKNOWN_NODE}")
        self.maybe_refresh_workload()
        held = self.state.pods.get(key)
        if held is not None:
            raise PlacementError(f"{key}: already holds GPUs on {held.node}")
        reason = self.state.explain(req, i)
        if reason is not None:
            raise PlacementError(f"{key} on {node}: {reason}")
        alloc = self.policy.select(self.state, req, i)
        if alloc is None:
            raise PlacementError(f"{key} on {node}: no GPU choice fits")
        r = self.state.reserve(req, i, alloc)
        self.policy.placed(self.state, req, i, r.alloc)
        self.inflight[key] = r
        if self._change_logs:
            self._touch(key)
        return r

    def release_inflight(self, key: str) -> None:
        if self._change_logs:
            self._touch(key)
        if self.inflight.pop(key, None) is not None and key in self.state.pods:
            self.scheduler.release(key)

    def bound(self, key: str) -> None:
        """The binding was created: the reservation is now what the pod's annotations say."""
        if self._change_logs:
            self._touch(key)
        r = self.inflight.pop(key, None)
        if r is None or key not in self.state.pods:
            return
        self.state.bind(key)
        self.placed[key] = (r.request, r.node, r.alloc)
        self._count_shape(key, r.request, r.alloc)

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
            if key not in self.placed and key not in self.inflight and key not in self.unseen:
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


def _distance(a: TargetWorkload, b: TargetWorkload) -> float:
    """Total variation distance between two workloads' shape distributions."""

    def dist(w: TargetWorkload) -> dict[tuple[Any, ...], float]:
        out: dict[tuple[Any, ...], float] = {}
        for t in range(w.size):
            k = (int(w.cpu[t]), int(w.gpu[t]), int(w.k[t]), w.models[t])
            out[k] = out.get(k, 0.0) + float(w.p[t])
        return out

    da, db = dist(a), dist(b)
    return 0.5 * sum(abs(da.get(k, 0.0) - db.get(k, 0.0)) for k in set(da) | set(db))


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"


def _ended(obj: Mapping[str, Any]) -> bool:
    return (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _same(a: Allocation, b: Allocation) -> bool:
    return a.per_gpu_mem() == b.per_gpu_mem() and a.per_gpu_core() == b.per_gpu_core() and (
        {c: tuple(sorted(g)) for c, g in a.mem.items()}
        == {c: tuple(sorted(g)) for c, g in b.mem.items()}
    )


__all__ = ["UNKNOWN_NODE", "ClusterView", "Kind", "default_workload", "shape_of"]
