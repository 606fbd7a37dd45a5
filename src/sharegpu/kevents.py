"""The core/v1 Event that sharegpu's components post about a pod (one shape for all of them)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any


def pod_event(
    *,
    namespace: str,
    name: str,
    uid: str,
    reason: str,
    message: str,
    component: str,
    host: str = "",
    resource_version: str = "",
    kind: str = "Warning",
) -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace,
                           "name": name, "uid": uid, "resourceVersion": resource_version},
        "reason": reason, "message": message[:1024], "type": kind,
        "source": {"component": component, "host": host},
        "reportingComponent": component, "reportingInstance": host,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


def node_event(node: str, *, reason: str, message: str, component: str,
               kind: str = "Warning") -> dict[str, Any]:
    """An Event about a Node (in namespace ``default``, where the kubelet posts node events)."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{node}.{uuid.uuid4().hex[:16]}", "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node},
        "reason": reason, "message": message[:1024], "type": kind,
        "source": {"component": component, "host": node},
        "reportingComponent": component, "reportingInstance": node,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }
