"""Starting pods (bound to a node, not yet started by its kubelet) and the rule that keeps the
kubelet from mistaking one for another: its device-plugin calls name a resource and a count,
never the pod, so on one node the starting pods whose first GPU containers make the same request
must be twins (the same GPUs, memory, compute and isolation opt-out for every container, the same
total). The extender binds a pod only while it keeps the rule; why, and what it costs:
docs/architecture.md, "Starting pods". Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import names
from .annotations import Allocation, is_assigned
from .request import Kind, PodRequest

# A request the kubelet makes for one container: (resource, number of devices).
KubeletRequest = tuple[str, int]
# What one container gets: (requests, memory per GPU, compute per GPU, pod total memory,
# isolation opted out).
Grant = tuple[tuple[KubeletRequest, ...], tuple[tuple[int, int], ...], tuple[tuple[int, int], ...],
              int, bool]


def kubelet_requests(req: PodRequest) -> dict[int, tuple[KubeletRequest, ...]]:
    """Container index → the device-plugin requests the kubelet makes for it (sorted)."""
    out: dict[int, tuple[KubeletRequest, ...]] = {}
    for c in req.containers:
        if c.whole:
            res = names.RES_TOPOLOGY_GPU if req.kind is Kind.TOPOLOGY else names.RES_NVIDIA_GPU
            out[c.index] = ((res, c.gpus),)
            continue
        asks = [(names.RES_GPU_MEM, c.total_mem)]
        if c.gpu_core:
            asks.append((names.RES_GPU_CORE, c.gpu_core * c.gpus))
        out[c.index] = tuple(sorted(asks))
    return out


def container_grants(req: PodRequest, alloc: Allocation) -> dict[int, Grant]:
    """Container index → what the container gets, as far as the kubelet and the agent's answer
    are concerned."""
    total = alloc.total_mem
    by_index = {c.index: c for c in req.containers}
    return {i: (asks, tuple(sorted(alloc.mem.get(i, {}).items())),
                tuple(sorted(alloc.core.get(i, {}).items())), total, by_index[i].isolation_off)
            for i, asks in sorted(kubelet_requests(req).items())}


def first_requests(req: PodRequest) -> tuple[KubeletRequest, ...]:
    """The requests the kubelet makes for the pod's first GPU container."""
    asks = kubelet_requests(req)
    return asks[min(asks)] if asks else ()


def pod_grant(req: PodRequest, alloc: Allocation) -> tuple[Grant, ...]:
    """What each GPU container of the pod gets, in container order: equal for twins."""
    return tuple(g for _, g in sorted(container_grants(req, alloc).items()))


def started(pod: Mapping[str, Any]) -> bool:
    """Whether the kubelet has started ``pod`` (its devices were allocated at admission): its
    agent marked it assigned, or it runs (phase ``Running``, or a container running or ended)
    whatever the mark says, so a lost or removed mark cannot keep it starting for ever."""
    meta = pod.get("metadata") or {}
    if is_assigned(meta.get("annotations") or {}):
        return True
    status = pod.get("status") or {}
    if status.get("phase") == "Running":
        return True
    for c in status.get("containerStatuses") or []:
        state = (c or {}).get("state") or {} if isinstance(c, Mapping) else {}
        if state.get("running") or state.get("terminated"):
            return True
    return False


@dataclass(frozen=True)
class Conflict:
    """A starting pod that the kubelet could not tell from the pod being bound."""

    pod: str
    request: KubeletRequest

    def reason(self, node: str) -> str:
        res, n = self.request
        return (f"node {node}: starting pod {self.pod} also asks the kubelet for {n} {res} "
                "for its first GPU container but is placed or shaped differently; the "
                "kubelet's device plugin calls name no pod, so this pod is bound once the "
                "kubelet has started that one")


class StartingPods:
    """The starting pods of every node, indexed by the requests of their first GPU
    container. ``naming``: the nodes whose agent names the pod of each kubelet call (through
    the kubelet's pod-resources API): there no starting pod conflicts with another."""

    def __init__(self, naming: set[str] | None = None,
                 trusted: Callable[[str], bool] | None = None) -> None:
        """``trusted``: whether a node's promise to name pods holds now (its agent serves:
        :mod:`sharegpu.core.agentserving`); by default every promise does."""
        self.naming: set[str] = naming if naming is not None else set()
        self.trusted = trusted if trusted is not None else (lambda node: True)
        # node -> first container's kubelet request -> pod -> the pod's grant
        self._nodes: dict[str, dict[KubeletRequest, dict[str, tuple[Grant, ...]]]] = {}
        self._pods: dict[str, tuple[str, tuple[KubeletRequest, ...]]] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def __contains__(self, pod: str) -> bool:
        return pod in self._pods

    def add(self, pod: str, node: str, req: PodRequest, alloc: Allocation) -> None:
        """``pod`` is bound to ``node`` (or about to be) and not started yet."""
        self.discard(pod)
        first = first_requests(req)
        if not first:
            return
        self._pods[pod] = (node, first)
        grant = pod_grant(req, alloc)
        at = self._nodes.setdefault(node, {})
        for a in first:
            at.setdefault(a, {})[pod] = grant

    def discard(self, pod: str) -> None:
        """``pod`` was started by its kubelet, deleted, or its hold released."""
        got = self._pods.pop(pod, None)
        if got is None:
            return
        node, first = got
        at = self._nodes.get(node, {})
        for a in first:
            pods = at.get(a)
            if pods is not None:
                pods.pop(pod, None)
                if not pods:
                    del at[a]
        if not at:
            self._nodes.pop(node, None)

    def conflict(self, node: str, req: PodRequest, alloc: Allocation) -> Conflict | None:
        """The first starting pod on ``node`` that the kubelet could not tell from ``req``
        placed as ``alloc``, or ``None``."""
        at = self._nodes.get(node)
        if not at or (node in self.naming and self.trusted(node)):
            return None
        grant = pod_grant(req, alloc)
        for a in first_requests(req):
            for pod, theirs in (at.get(a) or {}).items():
                if pod != req.key and theirs != grant:
                    return Conflict(pod, a)
        return None

    def on(self, node: str) -> set[str]:
        """The starting pods of ``node``."""
        return {p for pods in self._nodes.get(node, {}).values() for p in pods}


__all__ = ["Conflict", "Grant", "KubeletRequest", "StartingPods", "container_grants",
           "first_requests", "kubelet_requests", "pod_grant", "started"]
