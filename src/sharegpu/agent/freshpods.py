"""The node's pods as listed after a request began, one API list shared by concurrent callers:
each joins the next list that has not started yet, so a burst of Allocate calls costs a few
API lists, not one each, and no caller sees a list older than its request."""

from __future__ import annotations

import asyncio

from .kube import KubeApi


class FreshPods:
    def __init__(self, kube: KubeApi, node_name: str) -> None:
        self.kube = kube
        self.node_name = node_name
        self._next_list: asyncio.Future[list[dict]] | None = None
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()

    async def get(self) -> list[dict]:
        if self._next_list is None:
            fut: asyncio.Future[list[dict]] = asyncio.get_running_loop().create_future()
            self._next_list = fut
            t = asyncio.get_running_loop().create_task(self._run_list(fut))
            self._background.add(t)
            t.add_done_callback(self._background.discard)
        return await asyncio.shield(self._next_list)

    async def _run_list(self, fut: asyncio.Future[list[dict]]) -> None:
        async with self._lock:
            if self._next_list is fut:
                self._next_list = None  # later callers wait for a list that starts after them
            try:
                fut.set_result(await self.kube.list_node_pods(self.node_name))
            except Exception as e:
                fut.set_exception(e)

    def cancel(self) -> None:
        for t in list(self._background):
            t.cancel()
