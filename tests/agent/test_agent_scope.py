"""The agent reads only its own node and the pods bound to it (docs/security.md): the Kubernetes
calls of its production client name the node in their field selectors."""

from __future__ import annotations

from typing import Any

from sharegpu.agent.lightkube_api import LightkubeApi


class Recorder:
    """A lightkube AsyncClient that records list, get and watch calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    async def get(self, res: Any, name: str, **kw: Any) -> dict[str, Any]:
        self.calls.append(("get", res.__name__, {"name": name, **kw}))
        return {"metadata": {"name": name, "resourceVersion": "7"}}

    async def list(self, res: Any, **kw: Any) -> Any:
        self.calls.append(("list", res.__name__, kw))
        for item in ({"metadata": {"name": "p"}},):
            yield item

    async def watch(self, res: Any, **kw: Any) -> Any:
        self.calls.append(("watch", res.__name__, kw))
        for item in (("MODIFIED", {"metadata": {"name": "n1"}}),):
            yield item


async def test_pods_are_listed_by_node_and_the_node_watched_by_name():
    client = Recorder()
    api = LightkubeApi(client)
    assert await api.list_node_pods("n1") == [{"metadata": {"name": "p"}}]
    seen = [o async for o in api.watch_node("n1")]
    assert len(seen) == 2
    assert client.calls == [
        ("list", "Pod", {"namespace": "*", "fields": {"spec.nodeName": "n1"}}),
        ("get", "Node", {"name": "n1"}),
        ("watch", "Node", {"fields": {"metadata.name": "n1"}, "resource_version": "7"}),
    ]
