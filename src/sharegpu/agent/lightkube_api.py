"""The node agent's Kubernetes API calls through lightkube's async client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from .kube import Obj


def make_client(kubeconfig: str | None = None):  # type: ignore[no-untyped-def]
    """An async client, from the cluster configuration found in
    :data:`sharegpu.kubeio.kubeconfig.ORDER`."""
    import ssl

    from lightkube import AsyncClient

    from ..core.errors import ValidationError
    from ..kubeio import kubeconfig as kc

    config = kc.load(kubeconfig, field="--kubeconfig" if kubeconfig else "kubeconfig")
    try:
        return AsyncClient(config=config, field_manager="sharegpu-agent")
    except (OSError, ssl.SSLError) as e:
        raise ValidationError("kubeconfig", kubeconfig or "", f"credentials do not load: {e}"
                              ) from None


def _resource_claim():  # type: ignore[no-untyped-def]
    """``resource.k8s.io/v1`` ResourceClaim as a raw object (lightkube's models may predate it,
    and a model would drop fields it does not know, such as ``consumedCapacity``): a generic
    resource of our own, not put in lightkube's registry."""
    global _CLAIM
    if _CLAIM is None:
        from lightkube.generic_resource import GenericNamespacedResource, create_api_info

        class ResourceClaim(GenericNamespacedResource):
            _api_info = create_api_info("resource.k8s.io", "v1", "ResourceClaim",
                                        "resourceclaims", verbs=["get"])

        _CLAIM = ResourceClaim
    return _CLAIM


_CLAIM: Any = None


def _plain(obj: Any) -> Obj:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


class LightkubeApi:
    def __init__(self, client: Any) -> None:
        self.client = client

    async def get_node(self, name: str) -> Obj:
        from lightkube.resources.core_v1 import Node

        return _plain(await self.client.get(Node, name=name))

    async def watch_node(self, name: str) -> AsyncIterator[Obj]:
        from lightkube.resources.core_v1 import Node

        node = await self.get_node(name)
        yield node
        rv = (node.get("metadata") or {}).get("resourceVersion")
        async for _event, obj in self.client.watch(
            Node, fields={"metadata.name": name}, resource_version=rv
        ):
            yield _plain(obj)

    async def patch_node_metadata(
        self,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> None:
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        meta: dict[str, Any] = {}
        if labels:
            meta["labels"] = dict(labels)
        if annotations:
            meta["annotations"] = dict(annotations)
        if meta:
            await self.client.patch(Node, name, {"metadata": meta}, patch_type=PatchType.MERGE)

    async def list_node_pods(self, node: str) -> list[Obj]:
        from lightkube.resources.core_v1 import Pod

        return [
            _plain(p)
            async for p in self.client.list(Pod, namespace="*", fields={"spec.nodeName": node})
        ]

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str], *, uid: str = ""
    ) -> None:
        from lightkube import ApiError
        from lightkube.resources.core_v1 import Pod
        from lightkube.types import PatchType

        from .kube import PodGone

        meta: dict[str, Any] = {"annotations": dict(annotations)}
        if uid:
            meta["uid"] = uid  # a precondition: refused for another pod of the same name
        try:
            await self.client.patch(Pod, name, {"metadata": meta}, namespace=namespace,
                                    patch_type=PatchType.MERGE)
        except ApiError as e:
            if e.status.code in (404, 409) or (uid and e.status.code == 422):
                raise PodGone(f"pod {namespace}/{name} (uid {uid or 'any'}): "
                              f"{e.status.message}") from None
            raise

    async def patch_node_condition(self, name: str, condition: Mapping[str, str]) -> None:
        """A strategic merge patch of ``status.conditions`` (merged by ``type``) through the
        ``nodes/status`` subresource; the time stamps are the agent's."""
        from datetime import UTC, datetime

        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cond = {"lastHeartbeatTime": now, "lastTransitionTime": now, **dict(condition)}
        await self.client.patch(Node.Status, name, {"status": {"conditions": [cond]}},
                                patch_type=PatchType.STRATEGIC)

    async def create_event(
        self, *, namespace: str, pod: str, uid: str, reason: str, message: str, node: str
    ) -> None:
        from lightkube.resources.core_v1 import Event

        from ..kubeio.kevents import pod_event
        from .kube import EVENT_COMPONENT

        obj = pod_event(namespace=namespace, name=pod, uid=uid, reason=reason, message=message,
                        component=EVENT_COMPONENT, host=node)
        await self.client.create(Event.from_dict(obj), namespace=namespace)

    async def create_node_event(self, node: str, *, reason: str, message: str) -> None:
        from lightkube.resources.core_v1 import Event

        from ..kubeio.kevents import node_event
        from .kube import EVENT_COMPONENT

        obj = node_event(node, reason=reason, message=message, component=EVENT_COMPONENT)
        await self.client.create(Event.from_dict(obj), namespace="default")

    async def get_resource_claim(self, namespace: str, name: str) -> Obj:
        return _plain(await self.client.get(_resource_claim(), name=name, namespace=namespace))
