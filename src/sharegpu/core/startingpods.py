"""Starting pods: bound to a node, not yet started by its kubelet, and which of them the kubelet
cannot tell apart.

The kubelet's device plugin calls (``GetPreferredAllocation``, ``Allocate``) name a resource and
a number of devices, never the pod. The node agent therefore matches each call to a pending pod
container by what the call asks for. While the kubelet admits pods one at a time in the order
they were bound, the agent knows which comes first; when it admits several at once (a kubelet
restart, a relist) it takes them by creationTimestamp, whose ties it breaks in no fixed order,
and when kube-scheduler binds concurrently the bind order is not the assume order either. Two
starting containers that ask the kubelet for the same thing — the same number of devices of
the same resource — are then indistinguishable: whichever the kubelet admits first gets the
decision the agent ranks first.

What the agent knows is the kubelet's order *within* a pod: it admits one pod at a time and
allocates that pod's containers in order. So a call made while a pod is partly handed out is
that pod's, and any other call is some pod's *first* GPU container (:mod:`sharegpu.agent.allocate`).
Only the first container's requests can be mistaken.

The rule kept here makes that harmless. On one node, for every request the kubelet can make for
a pod's first GPU container (a resource and a number of devices: ``aliyun.com/gpu-mem`` × 4,
``nvidia.com/gpu`` × 1), all starting pods whose first container makes it must be *twins*: every
container gets the same GPUs, the same memory and compute on each, the same isolation opt-out,
and the pods ask the same in total. Whichever twin the kubelet admits first gets the decision
the agent ranks first, which is, container by container, the environment and limits its own
pod's decision says.

The extender binds a pod only while it keeps the rule on its node (it waits, briefly, for the
kubelet to start the pods it would be confused with); the agent marks a pod ``assigned`` once
the kubelet has allocated it, which ends its starting. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import names
from .annotations import Allocation
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
    container."""

    def __init__(self) -> None:
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
        if not at:
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
           "first_requests", "kubelet_requests", "pod_grant"]
