"""The node's GPU mode: read from the node label ``ack.node.gpu.schedule``, remembered in the
agent's state directory (and on the node) across restarts, and written out with the isolation
back-end it implies for the MPS daemon's supervisor beside the agent."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ..core import names
from ..core.errors import ValidationError
from ..core.modes import Mode, parse_mode
from .isolation import Backend, backend_for
from .mps import CURRENT_BACKEND_FILE, CURRENT_MODE_FILE

log = logging.getLogger(__name__)

MODE_FILE = "last-mode"


class NodeMode:
    """The mode in force, the node's labels it follows, and the back-end they give."""

    def __init__(self, node_name: str, state_dir: str, isolation: str,
                 core_mem_isolation: Backend) -> None:
        self.node_name = node_name
        self.state_dir = state_dir
        self.isolation = isolation
        self.core_mem_isolation = core_mem_isolation
        self.mode: Mode = Mode.EXCLUSIVE
        self.labels: dict[str, str] = {}

    @property
    def backend(self) -> Backend:
        return backend_for(self.isolation, self.mode, self.core_mem_isolation)

    @property
    def path(self) -> str:
        return os.path.join(self.state_dir, MODE_FILE)

    @property
    def remembered(self) -> bool:
        return os.path.exists(self.path)

    def label_mode(self) -> Mode | None:
        """The mode the node's label asks for; None without a label or with a bad one."""
        raw = self.labels.get(names.LABEL_SCHEDULE)
        if not raw:
            return None
        try:
            return parse_mode(raw)
        except ValidationError as e:
            log.error("node %s: %s; keeping mode %s", self.node_name, e, self.mode)
            return None

    def initial(self, node: Mapping) -> Mode:
        """The mode to start in: the label's, else the remembered one (file, then the node's
        annotation), else exclusive."""
        explicit = self.label_mode()
        if explicit is not None:
            return explicit
        try:
            with open(self.path) as f:
                return parse_mode(f.read().strip())
        except (OSError, ValidationError):
            pass
        raw = ((node.get("metadata") or {}).get("annotations") or {}).get(
            names.ANN_NODE_LAST_MODE
        )
        try:
            return parse_mode(raw) if raw else Mode.EXCLUSIVE
        except ValidationError:
            return Mode.EXCLUSIVE

    def remember(self, mode: Mode) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(mode.value + "\n")
        os.replace(tmp, self.path)

    def write_current(self) -> None:
        """The mode and the back-end in force, for the MPS daemon's supervisor beside the
        agent (it runs the daemon while the back-end uses MPS)."""
        for name, value in ((CURRENT_MODE_FILE, self.mode.value),
                            (CURRENT_BACKEND_FILE, self.backend.value)):
            path = os.path.join(self.state_dir, name)
            try:
                with open(path + ".tmp", "w") as f:
                    f.write(value + "\n")
                os.replace(path + ".tmp", path)
            except OSError as e:
                log.warning("could not write %s: %s", path, e)
