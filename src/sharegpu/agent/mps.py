"""The MPS control daemon of a node whose isolation back-end uses MPS (``mps``, ``hami-mps``):
started, supervised, restarted and stopped.

The supervisor follows the node agent's back-end (the file ``current-backend`` the agent keeps
in its state directory; without it, the mode in ``current-mode``): while the back-end uses MPS
(an ``mps`` node, or a ``core_mem`` node on ``hami-mps``) it keeps one
``nvidia-cuda-mps-control -f`` running with its pipe, log and shared-memory directories on the
host (so client containers can mount them), restarts it with back-off when it exits, and sets
the daemon's defaults once it answers; when the node's back-end stops using MPS it asks the
daemon to ``quit`` (then terminates it).
The daemon runs in the foreground under the supervisor (``-f``; ``-d`` would fork away and
leave nothing to watch). Its state is written to a small JSON file the agent reads for metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.modes import Mode, parse_mode

log = logging.getLogger(__name__)

STATE_FILE = "mps-daemon.json"
CURRENT_MODE_FILE = "current-mode"  # written by the agent whenever its mode is set
CURRENT_BACKEND_FILE = "current-backend"  # its isolation back-end, written with the mode
MPS_BACKENDS = frozenset({"mps", "hami-mps"})


@dataclass
class MpsConfig:
    state_dir: str = "/var/lib/sharegpu"  # where the agent keeps current-mode
    pipe_dir: str = "/run/nvidia/mps"
    log_dir: str = "/var/log/nvidia-mps"
    shm_dir: str = "/run/nvidia/mps-shm"
    control: Sequence[str] = ("nvidia-cuda-mps-control",)
    poll_s: float = 1.0
    answer_timeout_s: float = 10.0  # how long a started daemon may take to answer
    stop_timeout_s: float = 10.0
    max_backoff_s: float = 30.0
    default_active_thread_percentage: int | None = None  # None: leave the daemon's default
    defaults: list[str] = field(default_factory=list)  # further control commands after start


class MpsSupervisor:
    def __init__(self, config: MpsConfig) -> None:
        self.config = config
        self.proc: asyncio.subprocess.Process | None = None
        self.state = "stopped"
        self.detail = ""
        self.starts = 0
        self.restarts = 0
        self._backoff = 0.5
        self._next_start = 0.0
        self._stopping = False

    # --- what the agent decided ---
    def wanted(self) -> bool:
        try:
            with open(os.path.join(self.config.state_dir, CURRENT_BACKEND_FILE)) as f:
                return f.read().strip() in MPS_BACKENDS
        except OSError:
            pass
        try:
            with open(os.path.join(self.config.state_dir, CURRENT_MODE_FILE)) as f:
                return parse_mode(f.read().strip()) is Mode.MPS
        except Exception:  # no mode yet, or an unreadable file: not an mps node
            return False

    # --- control client ---
    def _env(self) -> dict[str, str]:
        return dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=self.config.pipe_dir,
                    CUDA_MPS_LOG_DIRECTORY=self.config.log_dir)

    async def command(self, text: str, timeout_s: float = 5.0) -> tuple[int, str]:
        """Send one command to the daemon through the control client."""
        try:
            p = await asyncio.create_subprocess_exec(
                *self.config.control, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=self._env(),
            )
        except OSError as e:
            return 127, str(e)
        try:
            out, _ = await asyncio.wait_for(p.communicate((text + "\n").encode()), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            await p.wait()
            return 124, "no answer"
        return p.returncode or 0, out.decode(errors="replace").strip()

    # --- lifecycle ---
    async def _start(self) -> None:
        c = self.config
        for d in (c.pipe_dir, c.log_dir, c.shm_dir):
            os.makedirs(d, exist_ok=True)
        self.starts += 1
        if self.starts > 1:
            self.restarts += 1
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *c.control, "-f", env=self._env(), stdin=asyncio.subprocess.DEVNULL,
            )
        except OSError as e:
            self._set("failed", f"{c.control[0]} could not be started: {e}")
            self._schedule_retry()
            return
        self._set("starting", f"pid {self.proc.pid}")
        deadline = time.monotonic() + c.answer_timeout_s
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                break
            rc, _ = await self.command("get_server_list", timeout_s=2.0)
            if rc == 0:
                await self._apply_defaults()
                self._set("running", f"pid {self.proc.pid}")
                self._backoff = 0.5
                return
            await asyncio.sleep(0.1)
        if self.proc.returncode is None:
            self._set("failed", f"the daemon did not answer within {c.answer_timeout_s:.0f}s")
            await self._terminate()
        else:
            self._set("failed", f"the daemon exited with status {self.proc.returncode}")
        self.proc = None
        self._schedule_retry()

    async def _apply_defaults(self) -> None:
        cmds = list(self.config.defaults)
        pct = self.config.default_active_thread_percentage
        if pct is not None:
            cmds.insert(0, f"set_default_active_thread_percentage {int(pct)}")
        for cmd in cmds:
            rc, out = await self.command(cmd)
            if rc != 0:
                log.warning("MPS daemon refused %r: %s", cmd, out)

    def _schedule_retry(self) -> None:
        self._next_start = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.config.max_backoff_s)

    async def _terminate(self) -> None:
        p = self.proc
        if p is None or p.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
        try:
            await asyncio.wait_for(p.wait(), self.config.stop_timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            await p.wait()

    async def stop(self) -> None:
        """Ask the daemon to quit, then make sure it is gone."""
        p = self.proc
        if p is not None and p.returncode is None:
            await self.command("quit")
            try:
                await asyncio.wait_for(p.wait(), self.config.stop_timeout_s)
            except TimeoutError:
                await self._terminate()
        self.proc = None
        self._set("stopped", "")

    async def step(self) -> None:
        """One round: start, restart or stop the daemon as the node's mode asks."""
        want = self.wanted()
        running = self.proc is not None and self.proc.returncode is None
        if want and not running:
            if self.proc is not None:  # it died under us
                log.warning("MPS control daemon exited with status %s; restarting",
                            self.proc.returncode)
                self._set("restarting", f"exited with status {self.proc.returncode}")
                self.proc = None
                self._schedule_retry()
            if time.monotonic() >= self._next_start:
                await self._start()
        elif not want and (running or self.proc is not None):
            log.info("the node's back-end no longer uses MPS: stopping the MPS control daemon")
            await self.stop()

    async def run(self) -> None:
        try:
            while not self._stopping:
                await self.step()
                await asyncio.sleep(self.config.poll_s)
        finally:
            await self.stop()

    def shutdown(self) -> None:
        self._stopping = True

    # --- state ---
    def _set(self, state: str, detail: str) -> None:
        if (state, detail) != (self.state, self.detail):
            log.info("MPS control daemon: %s %s", state, detail)
        self.state, self.detail = state, detail
        self.write_state()

    def write_state(self) -> None:
        path = os.path.join(self.config.state_dir, STATE_FILE)
        data = {"state": self.state, "detail": self.detail, "starts": self.starts,
                "restarts": self.restarts, "pipe_dir": self.config.pipe_dir,
                "time": time.time()}
        with contextlib.suppress(OSError):
            os.makedirs(self.config.state_dir, exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)


def read_state(state_dir: str) -> dict | None:
    """The supervisor's last state, as written to the agent's state directory."""
    try:
        with open(os.path.join(state_dir, STATE_FILE)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
