"""The kubelet's part for a node agent that runs against the real API server.

There is no kubelet here. :class:`KubeletPlay` plays the two things a kubelet does for the
agent's device plugins:

- the device-plugin side, with the agent tests' own test kubelet (``tests/agent/agent_kubelet.py``
  ``TestKubelet``: real gRPC on unix sockets; it serves ``Registration`` on ``kubelet.sock``,
  dials each plugin and follows its ``ListAndWatch``), in an event loop of its own thread;
- what the kubelet does with the device counts: it writes, through ``nodes/status``, every
  registered resource's number of devices as the node's capacity and its number of healthy
  devices as allocatable (the kubelet's node-status update; here with the admin's credentials,
  as soon as a count changes).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

_AGENT_TESTS = str(Path(__file__).resolve().parents[1] / "agent")
if _AGENT_TESTS not in sys.path:
    sys.path.insert(0, _AGENT_TESTS)

from agent_kubelet import TestKubelet  # noqa: E402

T = TypeVar("T")


class KubeletPlay:
    def __init__(self, admin_kubeconfig: Path | str, node: str, directory: str,
                 poll_s: float = 0.05) -> None:
        self.admin_kubeconfig = str(admin_kubeconfig)
        self.node = node
        self.kubelet = TestKubelet(directory)
        self.poll_s = poll_s
        # (wall-clock time, {resource: (capacity, allocatable)}) of each node-status write
        self.writes: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self.errors: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kubelet-play",
                                        daemon=True)
        self._sync_task: asyncio.Future[None] | None = None

    def start(self) -> KubeletPlay:
        self._thread.start()
        self.call(self.kubelet.start)
        self._sync_task = asyncio.run_coroutine_threadsafe(self._sync(), self._loop)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        if self._sync_task is not None:
            self._loop.call_soon_threadsafe(self._sync_task.cancel)
        try:
            self.call(self.kubelet.stop, timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float = 15.0) -> T:
        """Run ``fn(*args)`` (a coroutine function) on the kubelet's loop; its result."""
        return asyncio.run_coroutine_threadsafe(fn(*args), self._loop).result(timeout)

    def counts(self) -> dict[str, tuple[int, int]]:
        """{resource: (devices, healthy devices)} as the test kubelet sees them now."""
        async def read() -> dict[str, tuple[int, int]]:
            return {r: (len(d), sum(1 for _, h in d if h == "Healthy"))
                    for r, d in self.kubelet.devices.items()}

        return self.call(read)

    async def _sync(self) -> None:
        from lightkube import AsyncClient, KubeConfig
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        client = AsyncClient(KubeConfig.from_file(self.admin_kubeconfig),
                             field_manager="kubelet-play")
        last: dict[str, tuple[int, int]] | None = None
        try:
            while True:
                now = {r: (len(d), sum(1 for _, h in d if h == "Healthy"))
                       for r, d in self.kubelet.devices.items()}
                if now and now != last:
                    body = {"status": {"capacity": {r: str(c) for r, (c, _) in now.items()},
                                       "allocatable": {r: str(a) for r, (_, a) in now.items()}}}
                    try:
                        await client.patch(Node.Status, self.node, body,
                                           patch_type=PatchType.MERGE)
                        self.writes.append((time.time(), dict(now)))
                        last = now
                    except Exception as e:  # the next round tries again
                        self.errors.append(repr(e))
                await asyncio.sleep(self.poll_s)
        finally:
            await client.close()


__all__ = ["KubeletPlay", "TestKubelet"]
