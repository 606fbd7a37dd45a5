"""The DRA plugin's checkpoint: the prepared claims, UID -> {namespace, name, devices (as
answered), dirs (writable host directories made for the claim)}, kept in one JSON file in the
agent's state directory, written whole. An unreadable file is moved aside (the claims are then
prepared again from the API); a file of another version is ignored."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

from . import cdi

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "dra-claims.json"
CHECKPOINT_VERSION = 1


class Checkpoint:
    def __init__(self, path: str) -> None:
        self.path = path
        self.claims: dict[str, dict[str, Any]] = {}
        self.loaded = False  # a checkpoint file was read (not absent, not unreadable)

    def load(self) -> None:
        self.claims, self.loaded = {}, False
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            aside = f"{self.path}.unreadable"
            log.error("DRA checkpoint %s cannot be read (%s): moved to %s; claims are prepared "
                      "again from the API", self.path, e, aside)
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            return
        claims = data.get("claims") if isinstance(data, dict) else None
        if not isinstance(claims, dict) or data.get("version") != CHECKPOINT_VERSION:
            log.error("DRA checkpoint %s is not version %d: ignored", self.path,
                      CHECKPOINT_VERSION)
            return
        self.claims, self.loaded = claims, True

    def save(self) -> None:
        cdi.write_json(self.path, {"version": CHECKPOINT_VERSION, "claims": self.claims},
                       mode=0o600)
