"""CDI specs (Container Device Interface) for prepared claims: one JSON file per claim in the
node's CDI directory, which the container runtime reads when the kubelet passes it the claim's
CDI device IDs.

A spec is written whole (a temporary file in the same directory, then a rename), so a runtime
never reads half of one; its name is fixed by the claim's UID, so preparing a claim again
rewrites the same file and unpreparing finds it without any other record.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..dra import driver as dra
from .isolation import ContainerEnv

CDI_VERSION = "0.6.0"  # the first with spec annotations; containerd 1.7 and CRI-O read it
SPEC_PREFIX = f"{dra.CDI_VENDOR}-{dra.CDI_CLASS}_"
ANN_CLAIM = "sharegpu.io/claim"  # spec annotation: namespace/name of the claim


def spec_path(directory: str, claim_uid: str) -> str:
    return os.path.join(directory, f"{SPEC_PREFIX}{claim_uid}.json")


def device_name(claim_uid: str, device: str) -> str:
    """The CDI device name (the part after ``sharegpu.io/gpu=``)."""
    return f"{claim_uid}-{device}"


def container_edits(env: ContainerEnv) -> dict[str, Any]:
    """What a container gets, as CDI ``containerEdits``: the variables and the bind mounts."""
    edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in sorted(env.envs.items())]}
    if env.mounts:
        edits["mounts"] = [
            {"hostPath": m.host_path, "containerPath": m.container_path,
             "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "bind"]}
            for m in env.mounts
        ]
    return edits


def build_spec(claim_uid: str, claim_ref: str,
               devices: Sequence[tuple[str, ContainerEnv]]) -> dict[str, Any]:
    """The spec of one claim: a CDI device per (device name, what it gives)."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": dra.CDI_KIND,
        "annotations": {ANN_CLAIM: claim_ref},
        "devices": [{"name": device_name(claim_uid, d), "containerEdits": container_edits(e)}
                    for d, e in devices],
    }


def write_json(path: str, obj: Mapping[str, Any], mode: int = 0o644) -> None:
    """Write ``obj`` to ``path`` whole: a temporary file beside it, flushed to disk, renamed."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_spec(directory: str, claim_uid: str, spec: Mapping[str, Any]) -> str:
    path = spec_path(directory, claim_uid)
    write_json(path, spec)
    return path


def remove_spec(directory: str, claim_uid: str) -> bool:
    """Remove a claim's spec; whether there was one."""
    try:
        os.unlink(spec_path(directory, claim_uid))
        return True
    except FileNotFoundError:
        return False


def spec_uids(directory: str) -> set[str]:
    """The claims that have a spec of sharegpu's in ``directory``."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return set()
    return {n[len(SPEC_PREFIX):-len(".json")] for n in names
            if n.startswith(SPEC_PREFIX) and n.endswith(".json")}
