"""Leader election on a coordination.k8s.io/v1 Lease, in the manner of client-go.

- Every update of the Lease carries its resourceVersion, so two replicas can never both win.
- A follower takes the Lease only after it has seen the same holder record unchanged for a whole
  ``lease_duration`` on its own clock (no trust in other machines' clocks).
- The leader counts as leader only while its last successful renewal is younger than
  ``renew_deadline`` (< ``lease_duration``), so it stops binding before anyone may take over.
- A follower reads the Lease twice per ``retry_period`` and tries again exactly when the holder's
  record will have stood unchanged for ``lease_duration``, so it takes the Lease within half a
  retry period and one API round trip of its expiry (the holder's last renewTime + duration).
- The leader writes its URL on the Lease (annotation ``sharegpu.io/leader-url``): followers
  forward the binds they receive to it.
With the defaults (10 s lease, 7 s renew deadline, 2 s retry) the leader stops binding 7 s after
its last renewal and a follower takes over about ``lease_duration`` after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from .kube import ApiError, KubeApi

log = logging.getLogger(__name__)

URL_ANNOTATION = "sharegpu.io/leader-url"


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, api: KubeApi, namespace: str, name: str, identity: str, *,
                 lease_duration: float = 10.0, renew_deadline: float = 7.0,
                 retry_period: float = 2.0,
                 on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, url: str = "") -> None:
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("need retry_period < renew_deadline < lease_duration")
        self.api = api
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self.collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.on_change = on_change
        self.clock = clock
        self._renewed_at = -1e18
        self._observed: tuple[object, ...] | None = None
        self._observed_at = 0.0
        self._was_leader = False
        self.holder = ""
        self.url = url  # where this replica serves (written on the Lease while it leads)
        self.holder_url = ""  # the holder's URL, as the Lease said

    def is_leader(self) -> bool:
        return self.clock() - self._renewed_at < self.renew_deadline

    def next_wait(self) -> float:
        """Seconds until the next try: the retry period, or less when another holder's lease
        runs out sooner (on this replica's clock)."""
        if not self.holder or self.holder == self.identity or self._observed is None:
            return self.retry_period
        # a follower looks twice per retry period, so it sees the holder's last renewal at most
        # half a period late: that lag is what its takeover trails the lease's real expiry by
        left = self._observed_at + self.lease_duration - self.clock()
        return max(0.01, min(self.retry_period / 2, left + 0.01))

    async def run(self) -> None:
        try:
            while True:
                await self.step()
                await asyncio.sleep(self.next_wait())
        finally:
            self._set(False)

    def _set(self, leader: bool) -> None:
        if leader != self._was_leader:
            self._was_leader = leader
            log.info("%s: %s", self.identity, "became leader" if leader else "is a follower")
            if self.on_change is not None:
                self.on_change(leader)

    async def step(self) -> None:
        """One try to acquire or renew."""
        try:
            await self._try()
        except (ApiError, OSError) as e:
            log.warning("lease %s: %s", self.path, e)
        except Exception as e:  # transport errors of the HTTP client
            log.warning("lease %s: %s", self.path, e)
        self._set(self.is_leader())

    async def _try(self) -> None:
        now = self.clock()
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration)),
            "renewTime": _now_rfc3339(),
        }
        try:
            lease = await self.api.get(self.path)
        except ApiError as e:
            if e.status != 404:
                raise
            meta: dict[str, object] = {"name": self.name, "namespace": self.namespace}
            if self.url:
                meta["annotations"] = {URL_ANNOTATION: self.url}
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                    "spec": {**spec, "acquireTime": spec["renewTime"], "leaseTransitions": 0}}
            await self.api.request("POST", self.collection, body)
            self._renewed_at = now
            self.holder, self.holder_url = self.identity, self.url
            return
        cur = lease.get("spec") or {}
        holder = cur.get("holderIdentity") or ""
        record = (holder, cur.get("renewTime"), cur.get("acquireTime"),
                  (lease.get("metadata") or {}).get("resourceVersion"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        self.holder = holder
        anns = (lease.get("metadata") or {}).get("annotations") or {}
        self.holder_url = str(anns.get(URL_ANNOTATION) or "") if holder else ""
        mine = holder == self.identity
        expired = now - self._observed_at >= self.lease_duration
        if holder and not mine and not expired:
            return
        new_spec = dict(cur)
        new_spec.update(spec)
        if not mine:
            new_spec["acquireTime"] = spec["renewTime"]
            new_spec["leaseTransitions"] = int(cur.get("leaseTransitions") or 0) + 1
        meta = dict(lease.get("metadata") or {})
        anns = {k: v for k, v in (meta.get("annotations") or {}).items() if k != URL_ANNOTATION}
        if self.url:
            anns[URL_ANNOTATION] = self.url
        meta["annotations"] = anns
        body = {**lease, "metadata": meta, "spec": new_spec}
        try:
            await self.api.request("PUT", self.path, body)  # carries resourceVersion
        except ApiError as e:
            if e.status == 409:
                return  # someone else wrote first
            raise
        self._renewed_at = now
        self.holder, self.holder_url = self.identity, self.url

    async def release(self) -> None:
        """Give the Lease up (clean shutdown), so a follower need not wait for it to expire."""
        if not self.is_leader():
            return
        self._renewed_at = -1e18
        with contextlib.suppress(Exception):
            lease = await self.api.get(self.path)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                await self.api.request("PUT", self.path, lease)
        self._set(False)
