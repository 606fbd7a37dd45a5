"""Progress of a simulator run, for the person waiting on it.

Counted in pods decided over every run of the matrix (each policy × seed × workload replays
its seed's stream), so it moves within seconds even when one run takes minutes. On a terminal:
a bar with the pods done, the runs done and an estimate of the time left, redrawn in place.
Elsewhere (a pipe, a log, CI): one line per finished run, with the same estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TextIO

from rich.console import Console

from .engine import RunResult


class Progress(Protocol):
    """What :func:`sharegpu.sim.runner.run_matrix`'s callbacks drive."""

    def pods(self, done: int) -> None: ...
    def finished(self, result: RunResult) -> None: ...
    def close(self) -> None: ...


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def estimate_left(elapsed: float, done: int, total: int) -> float | None:
    """Seconds left at the pace so far, or ``None`` before there is a pace to go by."""
    if done <= 0 or elapsed <= 0:
        return None
    return elapsed * max(total - done, 0) / done


class LineProgress:
    """One line per finished run on ``out``; nothing in between, so a log stays readable."""

    def __init__(self, out: TextIO, total_pods: int, total_runs: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out
        self.total_pods = total_pods
        self.total_runs = total_runs
        self.clock = clock
        self.started = clock()
        self.done_pods = 0
        self.done_runs = 0
        self.finished_pods = 0

    def pods(self, done: int) -> None:
        self.done_pods = done

    def finished(self, result: RunResult) -> None:
        self.done_runs += 1
        self.finished_pods += result.pods
        elapsed = self.clock() - self.started
        # a finished run's pods are all decided, whatever the last count said
        done = max(self.done_pods, self.finished_pods)
        left = estimate_left(elapsed, done, self.total_pods)
        pct = 100.0 * done / self.total_pods if self.total_pods else 100.0
        more = left is not None and self.done_runs < self.total_runs
        tail = f", about {_clock(left)} left" if more and left is not None else ""
        print(f"simulate: run {self.done_runs}/{self.total_runs} done: {result.workload} "
              f"{result.policy} seed {result.seed}: {result.unallocated_pct:.2f} % unallocated "
              f"({result.pods:,} pods, {result.seconds:.1f} s); {pct:.0f} % of all pods, "
              f"{_clock(elapsed)} elapsed{tail}", file=self.out, flush=True)

    def close(self) -> None:
        pass


class TerminalProgress:
    """A rich bar redrawn in place on a terminal, gone when the run ends."""

    def __init__(self, console: Console, total_pods: int, total_runs: int) -> None:
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self.total_runs = total_runs
        self.done_runs = 0
        self.bar = Bar(
            TextColumn("[progress.description]{task.description}"), BarColumn(),
            TextColumn("{task.completed:,}/{task.total:,} pods"),
            TextColumn("{task.fields[runs]}"), TimeElapsedColumn(),
            TextColumn("left"), TimeRemainingColumn(),
            console=console, transient=True, refresh_per_second=4,
        )
        self.task = self.bar.add_task("simulating", total=total_pods,
                                      runs=f"0/{total_runs} runs")
        self.bar.start()

    def pods(self, done: int) -> None:
        self.bar.update(self.task, completed=done)

    def finished(self, result: RunResult) -> None:
        self.done_runs += 1
        self.bar.update(self.task, runs=f"{self.done_runs}/{self.total_runs} runs",
                        description=f"{result.workload}/{result.policy}/{result.seed} "
                        f"{result.unallocated_pct:.2f} %")

    def close(self) -> None:
        self.bar.stop()


def for_stream(console: Console, out: TextIO, total_pods: int, total_runs: int) -> Progress:
    """A bar on a terminal, lines elsewhere."""
    if console.is_terminal:
        return TerminalProgress(console, total_pods, total_runs)
    return LineProgress(out, total_pods, total_runs)
