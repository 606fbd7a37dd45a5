"""Kubernetes Events on pods that cannot be placed, with the reason, posted without blocking
the answer and at most once per pod and message every ``interval`` seconds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

from ..kubeio.kevents import pod_event
from .kube import KubeApi
from .metrics import Metrics

log = logging.getLogger(__name__)

REASON_UNSCHEDULABLE = "GPUSharingUnschedulable"
REASON_BIND_FAILED = "GPUSharingBindFailed"
REASON_INVALID = "GPUSharingInvalidRequest"
REASON_UNANNOTATED = "GPUSharingNoDecision"  # a bound GPU pod the extender did not place
# a DRA pod kube-scheduler found unschedulable and no node of the DRA pool can take as it is
REASON_DRA_UNSCHEDULABLE = "GPUSharingDRAUnschedulable"
COMPONENT = "sharegpu-extender"


def summarize(total: int, reasons: Mapping[str, str], limit: int = 3) -> str:
    """``0/50 nodes can take the GPU request: 30× node is in GPU mode ...; 20× ...``."""
    counts = Counter(reasons.values())
    parts = [f"{n}× {r}" for r, n in counts.most_common(limit)]
    more = len(counts) - limit
    if more > 0:
        parts.append(f"{more} other reason(s)")
    return f"0/{total} nodes can take the GPU request: " + "; ".join(parts)


class EventRecorder:
    def __init__(self, api: KubeApi | None, metrics: Metrics | None = None,
                 interval: float = 30.0, host: str = "") -> None:
        self.api = api
        self.metrics = metrics
        self.interval = interval
        self.host = host
        self._sent: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def record(self, pod: Mapping[str, Any], reason: str, message: str,
               kind: str = "Warning") -> None:
        meta = pod.get("metadata") or {}
        ns, name = meta.get("namespace") or "default", meta.get("name") or ""
        key = (f"{ns}/{name}/{meta.get('uid', '')}", f"{reason}:{message}")
        now = time.monotonic()
        last = self._sent.get(key)
        if last is not None and now - last < self.interval:
            return
        self._sent[key] = now
        self._sent.move_to_end(key)
        while len(self._sent) > 10000:
            self._sent.popitem(last=False)
        if self.metrics is not None:
            self.metrics.events.labels(reason).inc()
        if self.api is None:
            return
        event = pod_event(namespace=ns, name=name, uid=meta.get("uid", ""), reason=reason,
                          message=message, component=COMPONENT, host=self.host,
                          resource_version=meta.get("resourceVersion", ""), kind=kind)
        task = asyncio.get_running_loop().create_task(self._post(event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, event: dict[str, Any]) -> None:
        assert self.api is not None
        for attempt in range(3):
            try:
                await self.api.create_event(event)
                return
            except Exception as e:
                if attempt == 2:
                    log.warning("event for %s not posted: %s",
                                event["involvedObject"]["name"], e)
                await asyncio.sleep(0.2 * (attempt + 1))

    async def drain(self) -> None:
        while self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.gather(*list(self._tasks))
