"""The writable host directories a container's isolation mounts, made before the container
starts so that a container running as any user can write them (the container runtime would
otherwise create a missing one owned by root, mode 0755): a pod's or claim's own HAMi-core
cache directory (mode 0777) and the HAMi-core lock directory shared by the containers on the
same GPUs (mode 1777, as ``/tmp``)."""

from __future__ import annotations

import os
from collections.abc import Iterable

OWN_DIR_MODE = 0o777
OPEN_DIR_MODE = 0o1777


def make_dir(path: str, mode: int) -> None:
    """``path`` as a directory with exactly ``mode`` (whatever the umask)."""
    os.makedirs(path, exist_ok=True)
    if os.stat(path).st_mode & 0o7777 != mode:
        os.chmod(path, mode)


def open_dirs(own: Iterable[str], shared: Iterable[str]) -> None:
    """Make ``own`` (one pod's or claim's) mode 0777 and ``shared`` (the node's) mode 1777."""
    for d in sorted(set(shared)):
        make_dir(d, OPEN_DIR_MODE)
    for d in sorted(set(own)):
        make_dir(d, OWN_DIR_MODE)
