"""Who holds which GPU: Node and Pod objects (as the API server returns them) turned into the
per-node, per-GPU view that ``kubectl inspect cgpu`` prints. Pure: no I/O.

- A node is shown when it advertises shared GPU memory (``aliyun.com/gpu-mem`` > 0 in its
  allocatable); its total is that allocatable, its GPUs' sizes come from
  :func:`sharegpu.core.nodes.spec_from_node` (``sharegpu.io/gpu-mem`` or an even split).
- Every pod on a shown node that is not Succeeded/Failed counts. A pod whose annotations
  (either generation, :func:`sharegpu.core.annotations.decode`) name its GPUs counts on those GPUs;
  a pod that asks for ``aliyun.com/gpu-mem`` but has no GPU index yet counts as PENDING.
- Objects that cannot be read (a bad label, a malformed annotation) are left out with a warning
  naming the object, the field and the rule; the others are still shown.

DRA mode (docs/dra.md, "inspect"): a node that publishes a ResourceSlice of driver
``gpu.sharegpu.io`` is shown with the slice's GPUs (their ``memory`` capacity; the node's total
is their sum, since a DRA node advertises no ``aliyun.com/gpu-mem``). Every ResourceClaim
allocated on its GPUs counts, as a pod does, in the GPU's allocated memory and compute and its
pod count, with ``consumedCapacity`` (a result without it: the whole GPU). In the details a
claim is listed under the pod it is reserved for (``status.reservedFor``; one row per pod, its
claims merged), or as ``claim:<name>`` while no pod holds it; a pod that holds a claim is not
also counted as PENDING.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import names
from ..core.annotations import decode
from ..core.errors import ValidationError
from ..core.modes import Mode, parse_mode
from ..core.nodes import node_mode_of, quantity, spec_from_node
from ..core.pods import is_terminated, node_of
from ..core.request import Kind, parse_pod
from ..dra.drashares import DraShare, SliceGpus, claim_shares, slice_gpus


@dataclass(frozen=True)
class GpuUsage:
    """One GPU: memory in GiB, compute in percent of the card."""

    index: int
    mem_total: int
    mem_allocated: int = 0
    core_allocated: int = 0
    pods: int = 0

    @property
    def core_total(self) -> int:
        return names.CORE_PER_GPU


@dataclass(frozen=True)
class PodUsage:
    """One pod on a node: what it holds on each GPU, or what it waits for (PENDING)."""

    namespace: str
    name: str
    mem: Mapping[int, int] = field(default_factory=dict)
    core: Mapping[int, int] = field(default_factory=dict)
    pending_mem: int = 0
    pending_core: int = 0
    #: the ResourceClaims (DRA) this row's shares come from; empty for a device-plugin pod
    claims: tuple[str, ...] = ()

    @property
    def first_gpu(self) -> int:
        return min(self.mem) if self.mem else 1 << 30


@dataclass(frozen=True)
class NodeUsage:
    name: str
    address: str
    mode: Mode
    placement: str
    mem_total: int
    gpus: tuple[GpuUsage, ...]
    pods: tuple[PodUsage, ...] = ()
    #: the GPUs come from a ResourceSlice of sharegpu's DRA driver
    dra: bool = False

    @property
    def pending_mem(self) -> int:
        return sum(p.pending_mem for p in self.pods)

    @property
    def has_pending(self) -> bool:
        return any(p.pending_mem for p in self.pods)

    @property
    def mem_allocated(self) -> int:
        return sum(g.mem_allocated for g in self.gpus) + self.pending_mem

    @property
    def shows_core(self) -> bool:
        """Compute percentages are shown for ``core_mem`` nodes."""
        return self.mode is Mode.CORE_MEM

    @property
    def core_total(self) -> int:
        return names.CORE_PER_GPU * len(self.gpus)

    @property
    def core_allocated(self) -> int:
        return sum(g.core_allocated for g in self.gpus) + sum(p.pending_core for p in self.pods)


@dataclass(frozen=True)
class ClusterUsage:
    nodes: tuple[NodeUsage, ...]
    warnings: tuple[str, ...] = ()

    @property
    def mem_total(self) -> int:
        return sum(n.mem_total for n in self.nodes)

    @property
    def mem_allocated(self) -> int:
        return sum(n.mem_allocated for n in self.nodes)

    @property
    def shows_core(self) -> bool:
        return any(n.shows_core for n in self.nodes)

    @property
    def core_total(self) -> int:
        return sum(n.core_total for n in self.nodes if n.shows_core)

    @property
    def core_allocated(self) -> int:
        return sum(n.core_allocated for n in self.nodes if n.shows_core)

    @property
    def max_gpus(self) -> int:
        return max((len(n.gpus) for n in self.nodes), default=0)


def shared_memory(node: Mapping[str, Any]) -> int:
    """The node's allocatable ``aliyun.com/gpu-mem`` in GiB (0 when it shares none)."""
    status = node.get("status") or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    return quantity(alloc.get(names.RES_GPU_MEM))


@dataclass
class _NodeAcc:
    name: str
    address: str
    mode: Mode
    placement: str
    mem_total: int
    gpu_mem: list[int]
    used: list[int]
    core: list[int]
    count: list[int]
    pods: list[PodUsage] = field(default_factory=list)
    dra: bool = False

    def freeze(self) -> NodeUsage:
        gpus = tuple(
            GpuUsage(i, m, self.used[i], self.core[i], self.count[i])
            for i, m in enumerate(self.gpu_mem)
        )
        pods = sorted(self.pods, key=lambda p: (p.first_gpu, p.namespace, p.name))
        return NodeUsage(self.name, self.address, self.mode, self.placement, self.mem_total,
                         gpus, tuple(pods), self.dra)


def _address(node: Mapping[str, Any]) -> str:
    for a in (node.get("status") or {}).get("addresses") or []:
        if isinstance(a, Mapping) and a.get("type") == "InternalIP":
            found = a.get("address", "")
            return found if isinstance(found, str) and found else "unknown"
    return "unknown"


def _dra_node(node: Mapping[str, Any], name: str, sg: SliceGpus,
              warnings: list[str]) -> _NodeAcc:
    try:
        mode = parse_mode(sg.mode) if sg.mode else node_mode_of(node)
    except ValidationError as e:
        warnings.append(f"node {name}: {e}; shown as {Mode.CGPU.value}")
        mode = Mode.CGPU
    n = max(sg.mem_gib, default=-1) + 1
    gpu_mem = [sg.mem_gib.get(i, 0) for i in range(n)]
    return _NodeAcc(name=name, address=_address(node), mode=mode, placement="",
                    mem_total=sum(gpu_mem), gpu_mem=gpu_mem, used=[0] * n, core=[0] * n,
                    count=[0] * n, dra=True)


def build(
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    only: Sequence[str] | None = None,
    slices: Iterable[Mapping[str, Any]] = (),
    claims: Iterable[Mapping[str, Any]] = (),
) -> ClusterUsage:
    """The cluster view. ``only`` keeps the named nodes (in the order given); a name that is
    not a node sharing GPU memory raises :class:`ValidationError`. ``slices`` and ``claims``
    (``resource.k8s.io/v1`` ResourceSlices and ResourceClaims) add DRA nodes and shares."""
    warnings: list[str] = []
    acc: dict[str, _NodeAcc] = {}
    seen: set[str] = set()
    dra_gpus: dict[str, SliceGpus] = {}
    for sl in slices:
        sg, problems = slice_gpus(sl)
        warnings += problems
        if sg is not None and sg.mem_gib:
            dra_gpus[sg.node] = sg
    shares: list[DraShare] = []
    for c in claims:
        got, problems = claim_shares(c)
        warnings += problems
        shares += got
    checked_nodes = []
    for node in nodes:
        problem = shape_problem(node, "Node")
        if problem:
            warnings.append(problem)
        else:
            checked_nodes.append(node)
    for node in checked_nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        seen.add(name)
        if name in dra_gpus:
            acc[name] = _dra_node(node, name, dra_gpus[name], warnings)
            continue
        total = shared_memory(node)
        if total <= 0:
            continue
        try:
            spec = spec_from_node(node)
        except ValidationError as e:
            warnings.append(f"node {name} left out: {e}")
            continue
        if spec is None:
            warnings.append(
                f"node {name} left out: it advertises {names.RES_GPU_MEM}={total} but neither "
                f"{names.ANN_NODE_GPU_MEM} nor {names.RES_GPU_COUNT} tells how many GPUs it has"
            )
            continue
        n = len(spec.gpu_mem)
        acc[spec.name] = _NodeAcc(
            name=spec.name, address=spec.address or "unknown", mode=spec.mode,
            placement=spec.placement.value if spec.placement else "",
            mem_total=total, gpu_mem=[int(m) for m in spec.gpu_mem],
            used=[0] * n, core=[0] * n, count=[0] * n,
        )

    holders = {p for sh in shares for p in sh.pods}
    for pod in pods:
        problem = shape_problem(pod, "Pod")
        if problem:
            warnings.append(problem)
            continue
        if is_terminated(pod):
            continue
        node = acc.get(node_of(pod))
        if node is None:
            continue
        usage = _pod_usage(pod, node, warnings)
        if usage is not None and not (usage.mem == {} and (usage.namespace, usage.name)
                                      in holders):
            node.pods.append(usage)
    _count_claims(shares, acc, warnings)

    if only:
        missing = [n for n in only if n not in acc]
        if missing:
            which = ", ".join(missing)
            rule = (
                "no such node" if any(m not in seen for m in missing)
                else f"the node shares no GPU memory ({names.RES_GPU_MEM} is 0 or absent)"
            )
            raise ValidationError("NODE", which, rule)
        ordered = [acc[n] for n in dict.fromkeys(only)]
    else:
        ordered = [acc[k] for k in sorted(acc)]
    return ClusterUsage(tuple(a.freeze() for a in ordered), tuple(warnings))


def _count_claims(shares: Sequence[DraShare], acc: Mapping[str, _NodeAcc],
                  warnings: list[str]) -> None:
    """Each claim's shares on the GPUs of the shown nodes, in one row per holding pod."""
    rows: dict[tuple[str, str, str], tuple[dict[int, int], dict[int, int], list[str]]] = {}
    counted: set[tuple[str, str, str, int]] = set()
    for sh in shares:
        node = acc.get(sh.node)
        if node is None:
            continue
        if sh.gpu >= len(node.gpu_mem):
            warnings.append(
                f"ResourceClaim {sh.namespace}/{sh.claim} on {node.name}: GPU index {sh.gpu} is "
                f"not in the node's ResourceSlice ({len(node.gpu_mem)} GPUs); not counted")
            continue
        mem = node.gpu_mem[sh.gpu] if sh.mem_gib is None else sh.mem_gib
        core = names.CORE_PER_GPU if sh.whole else (sh.core or 0)
        node.used[sh.gpu] += mem
        node.core[sh.gpu] += core
        key = (sh.namespace, sh.claim, sh.node, sh.gpu)
        if key not in counted:  # one share of the GPU per claim, whatever its requests
            counted.add(key)
            node.count[sh.gpu] += 1
        ns, holder = sh.pods[0] if sh.pods else (sh.namespace, f"claim:{sh.claim}")
        m, c, names_ = rows.setdefault((sh.node, ns, holder), ({}, {}, []))
        m[sh.gpu] = m.get(sh.gpu, 0) + mem
        if core:
            c[sh.gpu] = c.get(sh.gpu, 0) + core
        if sh.claim not in names_:
            names_.append(sh.claim)
    for (node_name, ns, holder), (m, c, claim_names) in rows.items():
        acc[node_name].pods.append(PodUsage(ns, holder, mem=dict(sorted(m.items())),
                                            core=dict(sorted(c.items())),
                                            claims=tuple(claim_names)))


def _strings(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def shape_problem(obj: Any, kind: str) -> str | None:
    """Why an object of a dump cannot be read as a Node or Pod (the fields inspect reads:
    metadata with string name, labels and annotations; status and spec objects with the
    expected types), naming the field and the rule; ``None`` when it can."""
    if not isinstance(obj, Mapping):
        return f"a {kind} left out: it is not a JSON object"
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return f"a {kind} left out: metadata must be an object"
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return f"a {kind} left out: metadata.name must be a non-empty string"
    if kind == "Pod" and not isinstance(meta.get("namespace") or "", str):
        return f"pod {name} left out: metadata.namespace must be a string"
    what = f"pod {meta.get('namespace') or 'default'}/{name}" if kind == "Pod" else f"node {name}"
    for f in ("labels", "annotations"):
        if meta.get(f) is not None and not _strings(meta[f]):
            return f"{what} left out: metadata.{f} must be an object of strings"
    status = obj.get("status")
    if status is not None and not isinstance(status, Mapping):
        return f"{what} left out: status must be an object"
    spec = obj.get("spec")
    if spec is not None and not isinstance(spec, Mapping):
        return f"{what} left out: spec must be an object"
    status, spec = status or {}, spec or {}
    if kind == "Node":
        for f in ("allocatable", "capacity"):
            if status.get(f) is not None and not isinstance(status[f], Mapping):
                return f"{what} left out: status.{f} must be an object"
        addresses = status.get("addresses")
        if addresses is not None and not (isinstance(addresses, list) and all(
                isinstance(a, Mapping) for a in addresses)):
            return f"{what} left out: status.addresses must be a list of objects"
    else:
        if not isinstance(spec.get("nodeName") or "", str):
            return f"{what} left out: spec.nodeName must be a string"
        if not isinstance(status.get("phase") or "", str):
            return f"{what} left out: status.phase must be a string"
    return None


def _pod_usage(pod: Mapping[str, Any], node: _NodeAcc, warnings: list[str]) -> PodUsage | None:
    meta = pod.get("metadata") or {}
    ns, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
    try:
        alloc = decode(meta.get("annotations") or {})
    except ValidationError as e:
        warnings.append(f"pod {ns}/{name} on {node.name}: {e}")
        alloc = None
    if alloc is None:
        try:
            req = parse_pod(pod)
        except ValidationError as e:
            warnings.append(f"pod {ns}/{name} on {node.name} left out: {e}")
            return None
        if req.kind not in (Kind.SHARED, Kind.SHARED_CORE):
            return None
        core = sum(c.gpu_core * c.gpus for c in req.containers)
        return PodUsage(ns, name, pending_mem=req.total_mem, pending_core=core)

    mem = alloc.per_gpu_mem()
    core = alloc.per_gpu_core()
    bad = sorted(g for g in set(mem) | set(core) if g >= len(node.gpu_mem))
    if bad:
        warnings.append(
            f"pod {ns}/{name} on {node.name}: GPU index {bad} is not on the node "
            f"({len(node.gpu_mem)} GPUs); that part is not counted"
        )
        mem = {g: v for g, v in mem.items() if g < len(node.gpu_mem)}
        core = {g: v for g, v in core.items() if g < len(node.gpu_mem)}
    for g, v in mem.items():
        node.used[g] += v
        node.count[g] += 1
    for g, v in core.items():
        node.core[g] += v
    return PodUsage(ns, name, mem=dict(sorted(mem.items())), core=dict(sorted(core.items())))

