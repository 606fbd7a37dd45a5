"""Cluster state: per-GPU free memory, free compute and pod count for every node, in numpy.

Everything a placement decision reads is an array indexed by node (and by GPU slot inside the
node), so filters and scores are vectorised. Every change goes through :meth:`reserve` and
:meth:`release`, which keep the per-GPU rules (memory, compute, 20 pods per GPU, whole cards)
and the per-node rule that pods asking for memory only and pods asking for memory + compute do
not share a node. A node's ``version`` grows on every change, so policies can cache per node.

Memory units are whatever the adapter chose: GiB in a cluster, milli-GPU (1000 a card) in the
simulator. Host CPU (millicores) and memory (MiB) are tracked when the node declares them (the
simulator's trace, a cluster node's ``status.allocatable``); unknown, they never refuse a pod.
Pods that the state does not place (in a cluster: pods without GPUs, bound by kube-scheduler)
use host CPU and memory too: :meth:`charge_host` counts them per node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import names
from .annotations import Allocation
from .errors import PlacementError, ValidationError
from .gpuchoice import assign
from .modes import Mode, Placement
from .request import ContainerRequest, Kind, PodRequest

UNBOUNDED = np.iinfo(np.int64).max // 4

# which node modes serve which pod kinds
_MODE_CODES = {m: i for i, m in enumerate(Mode)}
_MODES_BY_CODE = list(Mode)
_KIND_MODES: dict[Kind, frozenset[Mode]] = {
    Kind.NONE: frozenset(Mode),
    Kind.SHARED: frozenset({Mode.CGPU, Mode.CORE_MEM, Mode.SHARE, Mode.MPS}),
    Kind.SHARED_CORE: frozenset({Mode.CORE_MEM}),
    Kind.EXCLUSIVE: frozenset({Mode.EXCLUSIVE}),
    Kind.TOPOLOGY: frozenset({Mode.TOPOLOGY}),
}
# kind -> boolean table indexed by mode code
_MODE_TABLES = {
    k: np.array([m in modes for m in Mode], dtype=bool) for k, modes in _KIND_MODES.items()
}


@dataclass(frozen=True)
class NodeSpec:
    """What a node offers. ``gpu_mem`` holds each GPU's total memory (GPUs may differ)."""

    name: str
    gpu_mem: Sequence[int]
    mode: Mode = Mode.CGPU
    placement: Placement | None = None
    model: str = ""
    cpu_milli: int | None = None
    mem_mib: int | None = None
    links: np.ndarray | None = field(default=None, compare=False)
    address: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValidationError("node.name", self.name, "must not be empty")
        for i, m in enumerate(self.gpu_mem):
            if int(m) <= 0:
                raise ValidationError(f"node {self.name}: gpu[{i}].memory", m, "must be positive")


@dataclass
class Reservation:
    """A pod's placement as the state holds it."""

    request: PodRequest
    node: str
    alloc: Allocation
    bound: bool = False


class ClusterState:
    """The GPUs of every node and who holds them."""

    def __init__(self, nodes: Iterable[NodeSpec] = (), *, max_pods_per_gpu: int = 0) -> None:
        self.max_pods_per_gpu = max_pods_per_gpu or names.MAX_PODS_PER_GPU
        self._cap = 0
        self._width = 0
        self.n = 0  # node slots in use (removed nodes leave an inactive slot)
        self.specs: list[NodeSpec | None] = []
        self.index: dict[str, int] = {}
        self.models: dict[str, int] = {"": 0}
        self.pods: dict[str, Reservation] = {}
        self._node_pods: list[set[str]] = []
        self._alloc(16, 1)
        for spec in nodes:
            self.add_node(spec)

    # -- storage ------------------------------------------------------------------------------
    def _alloc(self, cap: int, width: int) -> None:
        def grow1(old: np.ndarray | None, dtype: type, fill: object = 0) -> np.ndarray:
            a = np.full(cap, fill, dtype=dtype)
            if old is not None:
                a[: self._cap] = old[: self._cap]
            return a

        def grow2(old: np.ndarray | None, dtype: type) -> np.ndarray:
            a = np.zeros((cap, width), dtype=dtype)
            if old is not None:
                a[: self._cap, : self._width] = old[: self._cap, : self._width]
            return a

        first = self._cap == 0
        g = (lambda k: None) if first else (lambda k: getattr(self, k))
        self.active = grow1(g("active"), np.bool_, False)
        self.cpu_cap = grow1(g("cpu_cap"), np.int64)
        self.cpu_free = grow1(g("cpu_free"), np.int64)
        self.mem_cap = grow1(g("mem_cap"), np.int64)
        self.mem_free = grow1(g("mem_free"), np.int64)
        # host CPU and memory of pods the state does not place (charge_host), per node
        self.cpu_other = grow1(g("cpu_other"), np.int64)
        self.mem_other = grow1(g("mem_other"), np.int64)
        self.model = grow1(g("model"), np.int32)
        self.mode = grow1(g("mode"), np.int8)
        self.gpu_count = grow1(g("gpu_count"), np.int32)
        self.pods_mem_only = grow1(g("pods_mem_only"), np.int32)
        self.pods_mem_core = grow1(g("pods_mem_core"), np.int32)
        self.version = grow1(g("version"), np.int64)
        self.free_sum = grow1(g("free_sum"), np.int64)  # per node: sum of gpu_free
        self.total_sum = grow1(g("total_sum"), np.int64)  # per node: sum of gpu_total
        self.rank = grow1(g("rank"), np.int64)
        self.gpu_total = grow2(g("gpu_total"), np.int64)
        self.gpu_free = grow2(g("gpu_free"), np.int64)
        self.core_free = grow2(g("core_free"), np.int64)
        self.gpu_pods = grow2(g("gpu_pods"), np.int32)
        self.gpu_exists = grow2(g("gpu_exists"), np.bool_)
        self._cap, self._width = cap, width

    @property
    def width(self) -> int:
        """GPU slots per node row (the most GPUs any node has)."""
        return self._width

    # -- nodes --------------------------------------------------------------------------------
    def set_order(self, order: Sequence[int] | np.ndarray) -> None:
        """Rank of each node slot for tie-breaking (lower wins); default: the order added."""
        order = np.asarray(order, dtype=np.int64)
        if order.shape != (self.n,):
            raise ValueError(f"order needs one rank per node slot ({self.n})")
        self.rank[: self.n] = order

    def model_id(self, model: str) -> int:
        if model not in self.models:
            self.models[model] = len(self.models)
        return self.models[model]

    def add_node(self, spec: NodeSpec) -> int:
        """Add a node, or replace the spec of a known one (its pods are kept when they still
        fit; a node that shrank below its pods' needs is refused)."""
        if spec.name in self.index:
            return self.update_node(spec)
        i = self.n
        g = len(spec.gpu_mem)
        if i >= self._cap or g > self._width:
            self._alloc(max(self._cap * 2, i + 1), max(self._width, g))
        self.n += 1
        self.specs.append(spec)
        self._node_pods.append(set())
        self.index[spec.name] = i
        self.rank[i] = i
        self._write_node(i, spec)
        return i

    def _write_node(self, i: int, spec: NodeSpec) -> None:
        g = len(spec.gpu_mem)
        self.active[i] = True
        self.cpu_cap[i] = UNBOUNDED if spec.cpu_milli is None else spec.cpu_milli
        self.mem_cap[i] = UNBOUNDED if spec.mem_mib is None else spec.mem_mib
        self.cpu_free[i] = self.cpu_cap[i] - self.cpu_other[i]
        self.mem_free[i] = self.mem_cap[i] - self.mem_other[i]
        self.model[i] = self.model_id(spec.model)
        self.mode[i] = _MODE_CODES[spec.mode]
        self.gpu_count[i] = g
        self.pods_mem_only[i] = 0
        self.pods_mem_core[i] = 0
        self.gpu_total[i, :] = 0
        self.gpu_total[i, :g] = np.asarray(spec.gpu_mem, dtype=np.int64)
        self.gpu_free[i, :] = self.gpu_total[i, :]
        self.core_free[i, :] = 0
        self.core_free[i, :g] = names.CORE_PER_GPU
        self.gpu_pods[i, :] = 0
        self.gpu_exists[i, :] = False
        self.gpu_exists[i, :g] = True
        self.total_sum[i] = int(self.gpu_total[i].sum())
        self.free_sum[i] = self.total_sum[i]
        self.version[i] += 1

    def update_node(self, spec: NodeSpec) -> int:
        """Replace a known node's spec. Its pods stay (they hold the GPUs whatever the labels now
        say); an update that drops a GPU a pod holds is refused and changes nothing."""
        i = self.index[spec.name]
        g = len(spec.gpu_mem)
        keys = sorted(self._node_pods[i])
        for k in keys:
            gone = [x for x in self.pods[k].alloc.per_gpu_mem() if x >= g]
            if gone:
                raise PlacementError(
                    f"node {spec.name}: update drops GPU {gone[0]} that {k} holds"
                )
        if g > self._width:
            self._alloc(self._cap, g)
        held = [self.pods[k] for k in keys]
        for r in held:
            self._apply(r, -1)
        self._write_node(i, spec)
        self.specs[i] = spec
        for r in held:
            self._apply(r, +1)
        return i

    def remove_node(self, name: str) -> list[str]:
        """Remove a node; its pods are released and their keys returned."""
        i = self.index.pop(name)
        keys = sorted(self._node_pods[i])
        for k in keys:
            self.release(k)
        self.active[i] = False
        self.gpu_exists[i, :] = False
        self.gpu_free[i, :] = 0
        self.gpu_total[i, :] = 0
        self.core_free[i, :] = 0
        self.free_sum[i] = self.total_sum[i] = 0
        self.cpu_other[i] = self.mem_other[i] = 0
        self.specs[i] = None
        self.version[i] += 1
        return keys

    def spec(self, node: int | str) -> NodeSpec:
        i = self.index[node] if isinstance(node, str) else node
        s = self.specs[i]
        if s is None:
            raise KeyError(node)
        return s

    def node_pods(self, node: int | str) -> list[str]:
        i = self.index[node] if isinstance(node, str) else node
        return sorted(self._node_pods[i])

    # -- fit ----------------------------------------------------------------------------------
    def gpu_fits(self, c: ContainerRequest, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """[nodes, GPU slots] mask of GPUs one GPU of container ``c`` could go to."""
        sl = slice(0, self.n) if rows is None else rows
        if c.whole:
            return (
                self.gpu_exists[sl]
                & (self.gpu_pods[sl] == 0)
                & (self.gpu_free[sl] == self.gpu_total[sl])
            )
        ok = self.gpu_exists[sl] & (self.gpu_free[sl] >= c.gpu_mem)
        ok &= self.gpu_pods[sl] < self.max_pods_per_gpu
        if c.gpu_core:
            ok &= self.core_free[sl] >= c.gpu_core
        return ok

    def node_mask(self, req: PodRequest, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """Nodes whose mode, model and host resources admit the pod (GPUs not yet checked)."""
        sl = slice(0, self.n) if rows is None else rows
        ok = self.active[sl].copy()
        if req.cpu_milli:
            ok &= self.cpu_free[sl] >= req.cpu_milli
        if req.mem_mib:
            ok &= self.mem_free[sl] >= req.mem_mib
        modes = _KIND_MODES[req.kind]
        if len(modes) < len(Mode):
            ok &= _MODE_TABLES[req.kind][self.mode[sl]]
        if req.models is not None:
            table = np.zeros(len(self.models) + 1, dtype=bool)
            for m in req.models:
                if m in self.models:
                    table[self.models[m]] = True
            ok &= table[self.model[sl]]
        if req.kind is Kind.SHARED:
            ok &= self.pods_mem_core[sl] == 0
        elif req.kind is Kind.SHARED_CORE:
            ok &= self.pods_mem_only[sl] == 0
        return ok

    def admits(self, req: PodRequest, i: int) -> bool:
        """:meth:`node_mask` for the one node slot ``i``, on scalars (a placement checks one
        node, and a one-row numpy pipeline costs more than the rules themselves)."""
        if not self.active[i]:
            return False
        if req.cpu_milli and self.cpu_free[i] < req.cpu_milli:
            return False
        if req.mem_mib and self.mem_free[i] < req.mem_mib:
            return False
        if not _MODE_TABLES[req.kind][self.mode[i]]:
            return False
        if req.models is not None:
            model = int(self.model[i])
            if not any(self.models.get(m) == model for m in req.models):
                return False
        if req.kind is Kind.SHARED:
            return bool(self.pods_mem_core[i] == 0)
        if req.kind is Kind.SHARED_CORE:
            return bool(self.pods_mem_only[i] == 0)
        return True

    def feasible(self, req: PodRequest, rows: np.ndarray | None = None) -> np.ndarray:
        """Boolean mask over node slots (or over ``rows``, an array of slots): where the pod
        can be placed."""
        ok = self.node_mask(req, rows)
        if not req.containers:
            return ok
        if len(req.containers) == 1:
            c = req.containers[0]
            fits = self.gpu_fits(c, rows)
            if c.gpus == 1:
                return ok & fits.any(axis=1)
            return ok & (fits.sum(axis=1) >= c.gpus)
        # several containers: necessary per-container condition, then an exact check
        for c in req.containers:
            ok &= self.gpu_fits(c, rows).sum(axis=1) >= c.gpus
        slots = np.arange(self.n) if rows is None else rows
        for j in np.flatnonzero(ok):
            if assign(self, req, int(slots[j]), "bestfit") is None:
                ok[j] = False
        return ok

    def explain(self, req: PodRequest, node: int | str) -> str | None:
        """Why the pod cannot go to ``node`` (``None`` when it can): one clear reason."""
        i = self.index[node] if isinstance(node, str) else node
        if not self.active[i]:
            return "node is not known to the GPU scheduler"
        mode = Mode(list(Mode)[self.mode[i]])
        if mode not in _KIND_MODES[req.kind]:
            want = "/".join(sorted(m.value for m in _KIND_MODES[req.kind]))
            return (
                f"node is in GPU mode {mode.value!r}; a {req.kind.value} GPU request needs "
                f"{names.LABEL_SCHEDULE}={want}"
            )
        if req.models is not None and self.spec(i).model not in req.models:
            return f"GPU model {self.spec(i).model!r} is not one of {sorted(req.models)}"
        if req.cpu_milli and self.cpu_free[i] < req.cpu_milli:
            return "insufficient CPU"
        if req.mem_mib and self.mem_free[i] < req.mem_mib:
            return "insufficient memory"
        if req.kind is Kind.SHARED and self.pods_mem_core[i]:
            return "node runs pods that ask for GPU compute; memory-only pods cannot join them"
        if req.kind is Kind.SHARED_CORE and self.pods_mem_only[i]:
            return "node runs memory-only GPU pods; pods that ask for GPU compute cannot join them"
        row = slice(i, i + 1)
        g = int(self.gpu_count[i])
        for c in req.containers:
            if c.whole:
                free = int(self.gpu_fits(c, row).sum())
                if free < c.gpus:
                    return f"needs {c.gpus} whole GPU(s), {free} of {g} are free"
                continue
            biggest = int(self.gpu_total[i, :g].max(initial=0))
            if c.gpu_mem > biggest:
                return f"asks {c.gpu_mem} GPU memory per GPU; the largest GPU has {biggest}"
            if c.gpus > g:
                return f"asks for {c.gpus} GPUs; node has {g}"
            by_mem = int((self.gpu_free[i, :g] >= c.gpu_mem).sum())
            if by_mem < c.gpus:
                most = int(self.gpu_free[i, :g].max(initial=0))
                return (
                    f"insufficient GPU memory in one device: needs {c.gpu_mem} on {c.gpus} GPU(s),"
                    f" the most free on one GPU is {most}"
                )
            if c.gpu_core:
                by_core = int(
                    ((self.gpu_free[i, :g] >= c.gpu_mem) & (self.core_free[i, :g] >= c.gpu_core))
                    .sum()
                )
                if by_core < c.gpus:
                    return (f"insufficient GPU compute: needs {c.gpu_core} percent on "
                            f"{c.gpus} GPU(s)")
            fits = int(self.gpu_fits(c, row).sum())
            if fits < c.gpus:
                return f"GPUs with room hold {self.max_pods_per_gpu} pods already (per-GPU limit)"
        if len(req.containers) > 1 and not bool(self.feasible_one(req, i)):
            return "the containers' GPU requests do not fit together"
        return None

    def feasible_one(self, req: PodRequest, node: int) -> bool:
        return self.admits(req, node) and assign(self, req, node, "bestfit") is not None

    # -- changes ------------------------------------------------------------------------------
    def _check(self, req: PodRequest, i: int, alloc: Allocation, check_host: bool = True) -> None:
        """Raise PlacementError unless ``alloc`` fits node ``i`` for ``req`` (its host CPU
        and memory too, unless not ``check_host``)."""
        spec = self.specs[i]
        if spec is None or not self.active[i]:
            raise PlacementError(f"{req.key}: node slot {i} is not active")
        admit = req if check_host else without_host(req)
        if not self.admits(admit, i):
            reason = self.explain(admit, i) or "node does not admit the pod"
            raise PlacementError(f"{req.key} on {spec.name}: {reason}")
        g = int(self.gpu_count[i])
        mem = alloc.per_gpu_mem()
        core = alloc.per_gpu_core()
        pods: dict[int, int] = {}
        for per in alloc.mem.values():
            for gpu in per:
                pods[gpu] = 1  # a pod counts once per GPU whatever its containers
        for gpu in set(mem) | set(core):
            if not 0 <= gpu < g:
                raise PlacementError(f"{req.key} on {spec.name}: GPU {gpu} does not exist")
            if mem.get(gpu, 0) > self.gpu_free[i, gpu]:
                raise PlacementError(
                    f"{req.key} on {spec.name}: GPU {gpu} has {int(self.gpu_free[i, gpu])} "
                    f"memory free, {mem.get(gpu, 0)} asked"
                )
            if core.get(gpu, 0) > self.core_free[i, gpu]:
                raise PlacementError(
                    f"{req.key} on {spec.name}: GPU {gpu} has {int(self.core_free[i, gpu])} "
                    f"percent compute free, {core.get(gpu, 0)} percent asked"
                )
            if self.gpu_pods[i, gpu] + pods.get(gpu, 0) > self.max_pods_per_gpu:
                raise PlacementError(
                    f"{req.key} on {spec.name}: GPU {gpu} already holds "
                    f"{self.max_pods_per_gpu} pods"
                )
        for c in req.containers:
            got = alloc.mem.get(c.index, {})
            if len(got) != c.gpus:
                raise PlacementError(
                    f"{req.key}: container {c.index} needs {c.gpus} GPU(s), allocation gives "
                    f"{len(got)}"
                )
            for gpu, v in got.items():
                if c.whole:
                    if self.gpu_pods[i, gpu] or self.gpu_free[i, gpu] != self.gpu_total[i, gpu]:
                        raise PlacementError(
                            f"{req.key} on {spec.name}: GPU {gpu} is not free as a whole card"
                        )
                elif v != c.gpu_mem:
                    raise PlacementError(
                        f"{req.key}: container {c.index} asks {c.gpu_mem} per GPU, "
                        f"allocation gives {v} on GPU {gpu}"
                    )

    def _apply(self, r: Reservation, sign: int) -> None:
        i = self.index[r.node]
        pods: set[int] = set()
        for per in r.alloc.mem.values():
            pods.update(per)
        for gpu, v in r.alloc.per_gpu_mem().items():
            self.gpu_free[i, gpu] -= sign * v
            self.free_sum[i] -= sign * v
        for gpu, v in r.alloc.per_gpu_core().items():
            self.core_free[i, gpu] -= sign * v
        for gpu in pods:
            self.gpu_pods[i, gpu] += sign
        self.cpu_free[i] -= sign * r.request.cpu_milli
        self.mem_free[i] -= sign * r.request.mem_mib
        if r.request.kind is Kind.SHARED:
            self.pods_mem_only[i] += sign
        elif r.request.kind is Kind.SHARED_CORE:
            self.pods_mem_core[i] += sign
        if sign > 0:
            self._node_pods[i].add(r.request.key)
        else:
            self._node_pods[i].discard(r.request.key)
        self.version[i] += 1

    def reserve(self, req: PodRequest, node: int | str, alloc: Allocation, *,
                check_host: bool = True) -> Reservation:
        """Hold ``alloc`` on ``node`` for the pod. Raises PlacementError (state unchanged).
        ``check_host=False`` (a pod already bound, read back) takes its host CPU and memory
        even where they exceed what is free: the pod runs, whatever the count says."""
        i = self.index[node] if isinstance(node, str) else node
        if req.key in self.pods:
            raise PlacementError(f"{req.key}: already placed on {self.pods[req.key].node}")
        alloc = whole_card_allocation(self, req, i, alloc)
        self._check(req, i, alloc, check_host)
        spec = self.specs[i]
        assert spec is not None
        r = Reservation(req, spec.name, alloc)
        self._apply(r, +1)
        self.pods[req.key] = r
        return r

    def hold(self, req: PodRequest, node: int | str, alloc: Allocation) -> Reservation:
        """Hold what another allocator already decided (a DRA claim's allocation) as
        it is, bound: no rule is checked, since it holds the GPUs whatever the count says (it
        may over-commit; then nothing more fits there). Every GPU in ``alloc`` must exist."""
        i = self.index[node] if isinstance(node, str) else node
        spec = self.specs[i]
        if spec is None or not self.active[i]:
            raise PlacementError(f"{req.key}: node slot {i} is not active")
        if req.key in self.pods:
            raise PlacementError(f"{req.key}: already placed on {self.pods[req.key].node}")
        g = int(self.gpu_count[i])
        for gpu in set(alloc.per_gpu_mem()) | set(alloc.per_gpu_core()):
            if not 0 <= gpu < g:
                raise PlacementError(f"{req.key} on {spec.name}: GPU {gpu} does not exist")
        r = Reservation(req, spec.name, alloc, bound=True)
        self._apply(r, +1)
        self.pods[req.key] = r
        return r

    def charge_host(self, node: int | str, cpu_milli: int, mem_mib: int) -> None:
        """Count host CPU and memory used on ``node`` by pods the state does not place (a
        negative amount gives it back). They may exceed what is free (then nothing that needs
        CPU or memory fits there); they survive node updates and go with the node."""
        i = self.index[node] if isinstance(node, str) else node
        if not cpu_milli and not mem_mib:
            return
        self.cpu_other[i] += cpu_milli
        self.mem_other[i] += mem_mib
        self.cpu_free[i] -= cpu_milli
        self.mem_free[i] -= mem_mib
        self.version[i] += 1

    def charge_unseen(self, req: PodRequest, node: int | str) -> Reservation | None:
        """Hold what a pod without a recorded decision may use on ``node``, conservatively: we
        do not know its GPUs, so a shared pod is charged its per-GPU memory (and compute) on
        every GPU of the node, capped at what is free there, and counts as a pod on each; whole
        cards are charged as any free cards. Nothing placed afterwards can then over-commit the
        GPU it really holds. ``None`` when there is nothing left to charge."""
        i = self.index[node] if isinstance(node, str) else node
        spec = self.specs[i]
        if spec is None or not self.active[i] or req.key in self.pods:
            return None
        g = int(self.gpu_count[i])
        if req.kind in (Kind.EXCLUSIVE, Kind.TOPOLOGY):
            alloc = assign(self, req, i, "bestfit")
            return self.reserve(req, i, alloc) if alloc is not None else None
        need = max((c.gpu_mem for c in req.containers), default=0)
        core = max((c.gpu_core for c in req.containers), default=0)
        containers: list[ContainerRequest] = []
        mem: dict[int, dict[int, int]] = {}
        cores: dict[int, dict[int, int]] = {}
        for gpu in range(g):
            if self.gpu_pods[i, gpu] >= self.max_pods_per_gpu:
                continue
            m = min(need, int(self.gpu_free[i, gpu]))
            c = min(core, int(self.core_free[i, gpu]))
            if m <= 0 and c <= 0:
                continue
            j = len(containers)
            containers.append(ContainerRequest(j, gpu_mem=m, gpu_core=c))
            mem[j] = {gpu: m}
            if c:
                cores[j] = {gpu: c}
        if not containers:
            return None
        charged = PodRequest(req.namespace, req.name, req.kind, tuple(containers), uid=req.uid,
                             cpu_milli=req.cpu_milli, mem_mib=req.mem_mib)
        r = Reservation(charged, spec.name, Allocation(mem=mem, core=cores), bound=True)
        self._apply(r, +1)
        self.pods[req.key] = r
        return r

    def restore(
        self, placed: Iterable[tuple[PodRequest, str, Allocation]]
    ) -> list[tuple[str, str]]:
        """Reserve and bind many placements read back from annotations (a rebuild), node by
        node. Where a node's pods fit together (the sums of what they hold do not depend on the
        order), they are applied in one pass; on a node where they do not, they are reserved one
        by one with :meth:`reserve`, so exactly the ones that over-commit are reported, never
        applied. Host CPU and memory are taken even beyond what is free (the pods run).
        Returns (pod key, reason) for each record not applied."""
        problems: list[tuple[str, str]] = []
        groups: dict[int, list[tuple[PodRequest, Allocation]]] = {}
        seen: set[str] = set()
        index, pods = self.index, self.pods
        for req, node, alloc in placed:
            i = index.get(node)
            key = req.key
            if i is None:
                problems.append((key, f"node {node!r} is unknown"))
            elif key in pods or key in seen:
                problems.append((key, "placed twice"))
            else:
                seen.add(key)
                group = groups.get(i)
                if group is None:
                    groups[i] = [(req, alloc)]
                else:
                    group.append((req, alloc))
        for i, group in groups.items():
            if self._restore_node(i, group):
                continue
            for req, alloc in group:
                try:
                    self.reserve(req, i, alloc, check_host=False)
                    self.bind(req.key)
                except PlacementError as e:
                    problems.append((req.key, str(e)))
        return problems

    def _restore_node(self, i: int, group: list[tuple[PodRequest, Allocation]]) -> bool:
        """Apply ``group`` on node ``i`` at once when every rule of :meth:`_check` holds for
        all of them together; ``False`` (nothing changed) otherwise."""
        spec = self.specs[i]
        if spec is None or not self.active[i]:
            return False
        g = int(self.gpu_count[i])
        free = self.gpu_free[i, :g].tolist()
        total = self.gpu_total[i, :g].tolist()
        core = self.core_free[i, :g].tolist()
        pods = self.gpu_pods[i, :g].tolist()
        busy = [pods[x] > 0 or free[x] != total[x] for x in range(g)]
        whole: list[int] = [0] * g
        cpu = mem = 0
        kinds: set[Kind] = set()
        mode = _MODES_BY_CODE[int(self.mode[i])]
        done: list[Reservation] = []
        for req, alloc in group:
            if mode not in _KIND_MODES[req.kind]:
                return False
            if req.models is not None and spec.model not in req.models:
                return False
            kinds.add(req.kind)
            cpu += req.cpu_milli
            mem += req.mem_mib
            cs, held = req.containers, alloc.mem
            if len(cs) == 1 and len(held) == 1 and not cs[0].whole:
                # the common case, one shared container: the same rules, without the sums
                c = cs[0]
                got = held.get(c.index)
                if got is None or len(got) != c.gpus:
                    return False
                for gpu, v in got.items():
                    if not 0 <= gpu < g or v != c.gpu_mem:
                        return False
                    free[gpu] -= v
                    pods[gpu] += 1
                for per in alloc.core.values():
                    for gpu, v in per.items():
                        if not 0 <= gpu < g:
                            return False
                        core[gpu] -= v
                done.append(Reservation(req, spec.name, alloc, bound=True))
                continue
            if any(c.whole for c in req.containers):
                alloc = whole_card_allocation(self, req, i, alloc)
            for c in req.containers:
                got = alloc.mem.get(c.index, {})
                if len(got) != c.gpus:
                    return False
                for gpu, v in got.items():
                    if not 0 <= gpu < g:
                        return False
                    if c.whole:
                        whole[gpu] += 1
                    elif v != c.gpu_mem:
                        return False
            for gpu, v in alloc.per_gpu_mem().items():
                if not 0 <= gpu < g:
                    return False
                free[gpu] -= v
            for gpu, v in alloc.per_gpu_core().items():
                if not 0 <= gpu < g:
                    return False
                core[gpu] -= v
            held = alloc.mem
            if len(held) == 1:  # one container: its GPUs are distinct already
                for gpu in next(iter(held.values())):
                    pods[gpu] += 1
            else:
                for gpu in {x for per in held.values() for x in per}:
                    pods[gpu] += 1
            done.append(Reservation(req, spec.name, alloc, bound=True))
        if Kind.SHARED in kinds and (Kind.SHARED_CORE in kinds or self.pods_mem_core[i]):
            return False
        if Kind.SHARED_CORE in kinds and self.pods_mem_only[i]:
            return False
        for x in range(g):
            if free[x] < 0 or core[x] < 0 or pods[x] > self.max_pods_per_gpu:
                return False
            if whole[x] and (busy[x] or pods[x] != whole[x] or whole[x] > 1):
                return False
        self.gpu_free[i, :g] = free
        self.core_free[i, :g] = core
        self.gpu_pods[i, :g] = pods
        self.free_sum[i] = sum(free)
        self.cpu_free[i] -= cpu
        self.mem_free[i] -= mem
        node_pods, all_pods = self._node_pods[i], self.pods
        mem_only = mem_core = 0
        for r in done:
            kind = r.request.kind
            if kind is Kind.SHARED:
                mem_only += 1
            elif kind is Kind.SHARED_CORE:
                mem_core += 1
            key = r.request.key
            node_pods.add(key)
            all_pods[key] = r
        self.pods_mem_only[i] += mem_only
        self.pods_mem_core[i] += mem_core
        self.version[i] += 1
        return True

    def release(self, key: str) -> Reservation | None:
        """Give back what the pod holds; ``None`` when it held nothing."""
        r = self.pods.pop(key, None)
        if r is not None and r.node in self.index:
            self._apply(r, -1)
        return r

    def bind(self, key: str) -> Reservation:
        r = self.pods[key]
        r.bound = True
        return r

    # -- views --------------------------------------------------------------------------------
    def gpu_capacity(self, node: int | str) -> dict[int, int]:
        i = self.index[node] if isinstance(node, str) else node
        return {g: int(self.gpu_total[i, g]) for g in range(int(self.gpu_count[i]))}

    def fingerprint(self) -> dict[str, object]:
        """Everything that defines the allocation, keyed by name (for equality checks)."""
        out: dict[str, object] = {}
        for name, i in sorted(self.index.items()):
            g = int(self.gpu_count[i])
            out[name] = (
                tuple(int(x) for x in self.gpu_free[i, :g]),
                tuple(int(x) for x in self.core_free[i, :g]),
                tuple(int(x) for x in self.gpu_pods[i, :g]),
                int(self.cpu_free[i]),
                int(self.mem_free[i]),
                int(self.pods_mem_only[i]),
                int(self.pods_mem_core[i]),
                tuple(sorted(self._node_pods[i])),
            )
        return out

    def allocated_fraction(self) -> float:
        """Allocated GPU memory over total GPU memory, across active nodes."""
        n = self.n
        total = float(self.gpu_total[:n].sum())
        if total == 0:
            return 0.0
        return float((self.gpu_total[:n] - self.gpu_free[:n]).sum()) / total


def without_host(req: PodRequest) -> PodRequest:
    """The pod's request without its host CPU and memory (its GPU request alone)."""
    if not req.cpu_milli and not req.mem_mib:
        return req
    return PodRequest(req.namespace, req.name, req.kind, req.containers, uid=req.uid,
                      models=req.models, labels=req.labels)


def whole_card_allocation(
    state: ClusterState, req: PodRequest, node: int, alloc: Allocation
) -> Allocation:
    """Whole-card containers take all of each card's memory and compute; fill that in."""
    if not any(c.whole for c in req.containers):
        return alloc
    mem = {c: dict(gs) for c, gs in alloc.mem.items()}
    core = {c: dict(gs) for c, gs in alloc.core.items()}
    for c in req.containers:
        if c.whole:
            gpus = mem.get(c.index, {})
            mem[c.index] = {g: int(state.gpu_total[node, g]) for g in gpus}
            core[c.index] = {g: names.CORE_PER_GPU for g in gpus}
    return Allocation(mem=mem, core={c: gs for c, gs in core.items() if gs})


def rebuild(
    nodes: Iterable[NodeSpec],
    placed: Iterable[tuple[PodRequest, str, Allocation]],
    *,
    max_pods_per_gpu: int = 0,
) -> tuple[ClusterState, list[tuple[str, str]]]:
    """A state from node specs and (pod, node, allocation) records read back from annotations.

    Returns the state and the pods that could not be re-applied, each with the reason (a record
    naming an unknown node or over-committing a GPU is reported, never applied half-way).
    """
    state = ClusterState(nodes, max_pods_per_gpu=max_pods_per_gpu)
    problems: list[tuple[str, str]] = []
    for req, node, alloc in placed:
        if node not in state.index:
            problems.append((req.key, f"node {node!r} is unknown"))
            continue
        try:
            state.reserve(req, node, alloc, check_host=False)
            state.bind(req.key)
        except PlacementError as e:
            problems.append((req.key, str(e)))
    return state, problems

