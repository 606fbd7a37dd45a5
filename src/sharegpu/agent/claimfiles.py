"""What a prepared claim leaves on the node: its CDI spec, the writable host directories made
for it, and its record in the checkpoint. Written together (a failure removes what was
written), removed together, and checked against each other at start: a spec no record names
was written by a prepare that never answered, so no container uses it.

The writable host directories a claim's containers get are made writable by any user: the
claim's own (HAMi-core's shared cache, mode 0777, removed with the claim) and the node's shared
``open_dirs`` (HAMi-core's lock directories, one per GPU set under them, mode 1777 as ``/tmp``,
kept). A container running as
a user other than root would otherwise find them owned by root and closed to it."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from typing import Any

from . import cdi
from .dracheckpoint import Checkpoint
from .hostdirs import open_dirs
from .isolation import ContainerEnv

log = logging.getLogger(__name__)



class ClaimFiles:
    def __init__(self, cdi_dir: str, checkpoint: Checkpoint,
                 open_dirs: Sequence[str] = ()) -> None:
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint
        self.open_dirs = frozenset(open_dirs)

    def load(self) -> None:
        """Read the checkpoint and remove the specs of claims it does not record."""
        self.checkpoint.load()
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Only when the checkpoint was read: without it, every spec is kept (a running
        container's restart needs its spec); the kubelet prepares an orphan's claim again."""
        if not self.checkpoint.loaded:
            return
        for uid in sorted(cdi.spec_uids(self.cdi_dir) - set(self.checkpoint.claims)):
            log.info("removing the CDI spec of claim %s: prepared by no answered call", uid)
            cdi.remove_spec(self.cdi_dir, uid)

    def prepared(self, uid: str) -> dict[str, Any] | None:
        """The recorded answer for claim ``uid``, while its spec is still in place."""
        entry = self.checkpoint.claims.get(uid)
        if entry is not None and os.path.exists(cdi.spec_path(self.cdi_dir, uid)):
            return entry
        return None

    def write(self, uid: str, ref: str, edits: Sequence[tuple[str, ContainerEnv]],
              entry: dict[str, Any]) -> dict[str, Any]:
        """Make the claim's writable directories (HAMi-core's shared cache), write its spec and
        record ``entry`` (with ``dirs`` added); on any failure remove all of it again."""
        writable = {m.host_path for _, e in edits for m in e.mounts if not m.read_only}
        dirs = sorted(d for d in writable if d.endswith(f"/{uid}"))
        open_dirs(dirs, {d for d in writable
                         if d in self.open_dirs or os.path.dirname(d) in self.open_dirs})
        try:
            cdi.write_spec(self.cdi_dir, uid, cdi.build_spec(uid, ref, edits))
            entry = {**entry, "dirs": dirs}
            self.checkpoint.claims[uid] = entry
            self.checkpoint.save()
        except BaseException:
            self.checkpoint.claims.pop(uid, None)
            cdi.remove_spec(self.cdi_dir, uid)
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
            raise
        return entry

    def remove(self, uid: str) -> bool:
        """Remove the claim's spec, directories and record; whether there was anything.
        Raises OSError when a file cannot be removed."""
        entry = self.checkpoint.claims.get(uid)
        had_spec = cdi.remove_spec(self.cdi_dir, uid)
        if entry is not None:
            for d in entry.get("dirs") or []:
                shutil.rmtree(d, ignore_errors=True)
            del self.checkpoint.claims[uid]
            self.checkpoint.save()
        return entry is not None or had_spec
