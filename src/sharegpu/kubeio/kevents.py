"""The core/v1 Events sharegpu's components post about a pod or a node (one shape for all)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any


def _event(involved: dict[str, Any], namespace: str, *, reason: str, message: str,
           component: str, host: str, kind: str) -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{involved['name']}.{uuid.uuid4().hex[:16]}",
                     "namespace": namespace},
        "involvedObject": involved,
        "reason": reason, "message": message[:1024], "type": kind,
        "source": {"component": component, "host": host},
        "reportingComponent": component, "reportingInstance": host,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


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
    involved = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name,
                "uid": uid, "resourceVersion": resource_version}
    return _event(involved, namespace, reason=reason, message=message, component=component,
                  host=host, kind=kind)


def node_event(node: str, *, reason: str, message: str, component: str,
               kind: str = "Warning") -> dict[str, Any]:
    """An Event about a Node (in namespace ``default``, where the kubelet posts node events)."""
    involved = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}
    return _event(involved, "default", reason=reason, message=message, component=component,
                  host=node, kind=kind)
