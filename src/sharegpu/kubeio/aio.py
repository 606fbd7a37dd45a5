"""Small asyncio helpers shared by the adapters (extender, agent)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel the tasks and wait until each has finished; their errors are dropped (the tasks
    are being shut down)."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
