"""Which binds this extender does: a pod its filter passed, or one that its own scheduler
profiles could have sent it, and only to a Node that exists.

kube-scheduler sends a bind only for a pod of a profile that carries the extender (the chart's
``scheduler.name``, or with ``scheduler.mode=default`` the cluster's ``default-scheduler``, which
sends only pods asking for the GPU resources it manages) and only to a node it knows. A bind
outside that was not sent by kube-scheduler: it is refused, whatever the caller's certificate.
Each check answers the refusal's text, or ``None``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..core.names import CO_SCHEDULER_NAME

DEFAULT_SCHEDULER = "default-scheduler"  # the API server's default for spec.schedulerName


class BindScope:
    """``schedulers``: the schedulerNames whose profiles call this extender; ``gpu_only``: they
    send it only pods asking for GPUs (managedResources); ``node_exists``: whether a Node of
    that name exists (the informer's view)."""

    def __init__(self, schedulers: Iterable[str] = (CO_SCHEDULER_NAME,), *,
                 gpu_only: bool = False,
                 node_exists: Callable[[str], bool] = lambda name: False) -> None:
        self.schedulers = frozenset(schedulers)
        self.gpu_only = gpu_only
        self.node_exists = node_exists

    def node_refusal(self, node: str) -> str | None:
        if self.node_exists(node):
            return None
        return f"node {node} does not exist (no such Node in the cluster): not bound there"

    def pod_refusal(self, key: str, pod: Mapping[str, Any]) -> str | None:
        """A pod read from the API server (no filter of this replica passed it)."""
        spec = pod.get("spec") or {}
        name = str(spec.get("schedulerName") or DEFAULT_SCHEDULER)
        if name in self.schedulers:
            return None
        return (f"pod {key} is not this extender's to bind: its schedulerName {name!r} is not "
                f"a profile that calls it ({', '.join(sorted(self.schedulers))})")

    def plain_refusal(self, key: str) -> str | None:
        """A pod that asks for no GPU."""
        if not self.gpu_only:
            return None
        return (f"pod {key} asks for no GPU: the scheduler sends this extender only pods that "
                "ask for GPU resources (managedResources), so it does not bind others")
