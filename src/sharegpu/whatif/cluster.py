"""A cluster read from its Node and Pod objects as the extender reads it after a relist: the
nodes' specs in list order, each GPU pod's request and recorded placement
(:class:`~sharegpu.core.podreader.PlacementReader`, the extender's reader), bound GPU pods
without a decision, pending GPU pods, and the host CPU and memory of every other bound pod.

:meth:`Cluster.state` builds the state as the extender's rebuild does (records restored, pods
without a decision charged on every GPU of their node, other pods' CPU and memory charged), and
:meth:`Cluster.learned` the policy's target workload with the extender's
:class:`~sharegpu.core.placement.learned.LearnedWorkload`, counting the placed pods.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core import names
from ..core.annotations import Allocation, assume_time
from ..core.errors import PlacementError, ValidationError
from ..core.nodes import spec_from_node
from ..core.nodeselector import NodeSelector, node_labels, node_selector
from ..core.placement.base import Policy
from ..core.placement.learned import LearnedWorkload
from ..core.podreader import PlacementReader, pod_key
from ..core.pods import is_terminated
from ..core.request import PodRequest
from ..core.state import ClusterState, NodeSpec
from ..inspect_cgpu.model import shape_problem


@dataclass(frozen=True)
class GpuPod:
    """A pod that asks for GPUs: ``node`` "" while pending; ``alloc`` its recorded placement
    (``None``: pending, or bound without a decision)."""

    key: str
    request: PodRequest
    node: str
    alloc: Allocation | None
    created: str  # metadata.creationTimestamp (RFC 3339, sorts as text)
    assumed: int  # the extender's decision time (ns), 0 when not recorded
    selector: NodeSelector
    #: the controller that re-creates it (kind/name), "" for a bare pod
    owner: str = ""

    @property
    def bound(self) -> bool:
        return bool(self.node)


@dataclass
class Cluster:
    specs: list[NodeSpec]
    labels: list[dict[str, str]]  # per spec
    pods: list[GpuPod]  # every live GPU pod: placed, bound without a decision, pending
    host: dict[str, list[int]]  # node -> [CPU millicores, memory MiB] of the other bound pods
    warnings: list[str] = field(default_factory=list)
    #: the extender's --policy read from its own Pod in the dump, when it is there
    extender_policy: str | None = None
    _masks: dict[NodeSelector, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def placed(self) -> list[GpuPod]:
        return [p for p in self.pods if p.bound and p.alloc is not None]

    @property
    def bound(self) -> list[GpuPod]:
        return [p for p in self.pods if p.bound]

    @property
    def pending(self) -> list[GpuPod]:
        return sorted((p for p in self.pods if not p.bound), key=lambda p: (p.created, p.key))

    def among(self, selector: NodeSelector) -> np.ndarray | None:
        """The node slots (in :attr:`specs` order) the selector admits; ``None``: all."""
        if selector.empty:
            return None
        mask = self._masks.get(selector)
        if mask is None:
            mask = np.array([selector.matches(lb) for lb in self.labels], dtype=bool)
            self._masks[selector] = mask
        return mask

    def empty_state(self) -> ClusterState:
        """The nodes, with the host CPU and memory of the pods that are not GPU pods."""
        state = ClusterState(self.specs)
        for node, (cpu, mem) in self.host.items():
            if node in state.index:
                state.charge_host(node, cpu, mem)
        return state

    def state(self) -> tuple[ClusterState, list[str]]:
        """The state as the extender rebuilds it, and the records it could not apply."""
        state = ClusterState(self.specs)
        records = [(p.request, p.node, p.alloc) for p in self.placed
                   if p.node in state.index and p.alloc is not None]
        problems = [f"{key}: annotations over-commit: {why}"
                    for key, why in state.restore(records)]
        for p in self.pods:
            if p.bound and p.alloc is None and p.node in state.index:
                try:
                    state.charge_unseen(p.request, p.node)
                except PlacementError as e:
                    problems.append(f"{p.key}: not charged: {e}")
        for node, (cpu, mem) in self.host.items():
            if node in state.index:
                state.charge_host(node, cpu, mem)
        return state, problems

    def learned(self, policy: Policy) -> LearnedWorkload:
        """The policy's target workload as the extender learns it from these pods (handed to
        the policy by :meth:`LearnedWorkload.prepare` with a state)."""
        learned = LearnedWorkload(policy)
        for p in self.placed:
            assert p.alloc is not None
            learned.count(p.key, p.request, p.alloc)
        return learned


def _owner(meta: Mapping[str, Any]) -> str:
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return f"{ref.get('kind', '')}/{ref.get('name', '')}"
    return ""


def _extender_policy(obj: Mapping[str, Any]) -> str | None:
    """``--policy`` of a running ``sharegpu extender`` container in the Pod (``default`` when
    it gives none); ``None`` for any other pod."""
    for c in (obj.get("spec") or {}).get("containers") or []:
        if not isinstance(c, Mapping):
            continue
        argv = [str(a) for a in [*(c.get("command") or []), *(c.get("args") or [])]]
        if "extender" not in argv or not any(a.endswith("sharegpu") for a in argv):
            continue
        for i, a in enumerate(argv):
            if a == "--policy" and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith("--policy="):
                return a.split("=", 1)[1]
        return "default"
    return None


def read(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> Cluster:
    """The cluster from listed Node and Pod objects (objects that cannot be read are left out,
    each with a warning)."""
    warnings: list[str] = []
    specs: list[NodeSpec] = []
    labels: list[dict[str, str]] = []
    seen: set[str] = set()
    for obj in nodes:
        problem = shape_problem(obj, "Node")
        if problem:
            warnings.append(problem)
            continue
        name = str(obj["metadata"]["name"])
        try:
            spec = spec_from_node(obj)
        except (ValidationError, AttributeError, TypeError) as e:
            warnings.append(f"node {name or '?'} left out: {e}")
            continue
        if spec is None or spec.name in seen:
            continue
        seen.add(spec.name)
        specs.append(spec)
        labels.append(node_labels(obj))
    reader = PlacementReader()
    reader.on_problem = lambda key, why: warnings.append(f"pod {key}: {why}")
    out: list[GpuPod] = []
    host: dict[str, list[int]] = {}
    policy: str | None = None
    for obj in pods:
        try:
            got = _read_pod(obj, reader, host)
            if policy is None and got is not None and got[1] is not None:
                policy = got[1]
        except (ValidationError, AttributeError, TypeError, KeyError, ValueError) as e:
            warnings.append(shape_problem(obj, "Pod") or f"pod {pod_key(obj)} left out: {e}")
            continue
        if got is not None and got[0] is not None:
            out.append(got[0])
    if not specs:
        warnings.append(f"no node shares GPUs (none advertises {names.RES_GPU_MEM}, "
                        f"{names.RES_NVIDIA_GPU} or {names.RES_TOPOLOGY_GPU})")
    return Cluster(specs, labels, out, host, warnings, policy)


def _read_pod(obj: Mapping[str, Any], reader: PlacementReader, host: dict[str, list[int]]
              ) -> tuple[GpuPod | None, str | None] | None:
    """A GPU pod (``None`` for another pod, whose CPU and memory go to ``host`` when it is
    bound) and the extender's policy when the pod runs the extender. Raises on an object of
    the wrong shape (the caller names the field)."""
    meta = obj["metadata"]
    if not isinstance(meta, Mapping) or not isinstance(meta["name"], str):
        raise TypeError("metadata.name must be a string")
    if is_terminated(obj):
        return None
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    node = spec.get("nodeName") or ""
    if not isinstance(node, str) or not isinstance(status.get("phase") or "", str):
        raise TypeError("spec.nodeName and status.phase must be strings")
    policy = _extender_policy(obj) if node and status.get("phase") == "Running" else None
    anns = meta.get("annotations") or {}
    wants = reader.wants_gpu(obj)
    alloc = reader.allocation(anns) if node else None
    if not wants and alloc is None:
        if node:
            cpu, mem = reader.host(obj)
            got = host.setdefault(node, [0, 0])
            got[0] += cpu
            got[1] += mem
        return None, policy
    req = reader.request(obj)
    selector = node_selector(obj)
    created = meta.get("creationTimestamp") or ""
    if not isinstance(created, str):
        raise TypeError("metadata.creationTimestamp must be a string")
    return GpuPod(pod_key(obj), req, node, alloc, created, assume_time(anns), selector,
                  _owner(meta)), policy
