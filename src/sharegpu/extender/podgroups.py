"""PodGroup objects (``scheduling.sigs.k8s.io/v1alpha1``, ACK's gang CRD) fed to the view's
gang bookkeeping (:mod:`.gangs`), and the clock that releases the holds of gangs past their
timeout.

A cluster without the CRD answers 404: the labels alone then define the groups, and the list is
tried again now and then (the CRD may be installed later). Anything else that goes wrong is
retried with a back-off; a bad PodGroup is refused at filter with the field named, never here.
"""

from __future__ import annotations

import asyncio
import logging

from ..core.gang import PODGROUP_GROUP, PODGROUP_VERSION
from .kube import ApiError, Gone, KubeApi
from .view import ClusterView

log = logging.getLogger(__name__)

PODGROUPS = f"/apis/{PODGROUP_GROUP}/{PODGROUP_VERSION}/podgroups"


class PodGroupWatch:
    def __init__(self, api: KubeApi, view: ClusterView, *, backoff: float = 0.5,
                 absent_retry: float = 60.0, expire_every: float = 1.0) -> None:
        self.api = api
        self.view = view
        self.backoff = backoff
        self.absent_retry = absent_retry
        self.expire_every = expire_every
        self.rv = ""
        self.absent = False  # the API server does not serve PodGroups (no CRD)

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                items, self.rv = await self.api.list(PODGROUPS)
                self.view.reset_podgroups(items)
                if self.absent:
                    log.info("PodGroups (%s) are served now", PODGROUPS)
                self.absent = False
                failures = 0
                while True:
                    async for kind, obj in self.api.watch(PODGROUPS, self.rv):
                        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
                        if rv:
                            self.rv = rv
                        if kind == "DELETED":
                            self.view.delete_podgroup(obj)
                        elif kind in ("ADDED", "MODIFIED"):
                            self.view.upsert_podgroup(obj)
            except asyncio.CancelledError:
                raise
            except Gone:
                continue  # relist
            except ApiError as e:
                if e.status in (403, 404):
                    if not self.absent:
                        log.info("PodGroups not readable (%s): gangs are defined by pod labels "
                                 "only; trying again every %.0f s", e, self.absent_retry)
                    self.absent = True
                    self.view.reset_podgroups([])
                    await asyncio.sleep(self.absent_retry)
                    continue
                failures += 1
                log.info("PodGroup watch failed (%s); retrying", e)
                await asyncio.sleep(min(self.backoff * failures, 5.0))
            except Exception as e:  # a dropped connection, a bad line
                failures += 1
                log.info("PodGroup watch dropped (%s); retrying", e)
                await asyncio.sleep(min(self.backoff * failures, 5.0))

    async def expire(self) -> None:
        """Release the holds of gangs past their timeout, even while no pod is being asked
        about (the filter and bind release them too, as they come)."""
        while True:
            await asyncio.sleep(self.expire_every)
            try:
                released = self.view.gang_expire()
            except Exception as e:  # never let the clock die
                log.warning("gang expiry failed: %s", e)
                continue
            if released:
                log.info("gang timeout: released the GPU shares held for %s",
                         ", ".join(released[:5]) + (" ..." if len(released) > 5 else ""))
