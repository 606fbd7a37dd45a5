"""Progress of a simulator run, for the person waiting on it.

Counted in pods decided over every run of the matrix (each policy × seed × workload replays
its seed's stream), so it moves within seconds even when one run takes minutes. On a terminal:
a bar with the pods done, the runs done, the time elapsed and an estimate of the time left,
each labelled, redrawn in place. Elsewhere (a pipe, a log, CI): one line per finished run as it
finishes, with the same estimate, and between them a line at each tenth of all pods (at most one
every ``every_s`` seconds), so that runs finishing together do not leave the pipe silent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TextIO

from rich.console import Console
from rich.progress import BarColumn, ProgressColumn, Task, TextColumn
from rich.progress import Progress as Bar
from rich.table import Column
from rich.text import Text

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


def times(elapsed: float, left: float | None) -> str:
    """``0:05 elapsed, about 0:13 left``: each time with its label."""
    tail = f", about {_clock(left)} left" if left is not None else ""
    return f"{_clock(elapsed)} elapsed{tail}"


class LineProgress:
    """One line per finished run on ``out``, and one at each tenth of all pods decided when the
    last line is ``every_s`` seconds old; nothing else, so a log stays readable."""

    def __init__(self, out: TextIO, total_pods: int, total_runs: int,
                 clock: Callable[[], float] = time.monotonic, every_s: float = 10.0) -> None:
        self.out = out
        self.total_pods = total_pods
        self.total_runs = total_runs
        self.clock = clock
        self.every_s = every_s
        self.started = clock()
        self.last_line = self.started
        self.done_pods = 0
        self.done_runs = 0
        self.finished_pods = 0
        self.tenth = 0

    def pods(self, done: int) -> None:
        self.done_pods = done
        tenth = 10 * done // self.total_pods if self.total_pods else 10
        now = self.clock()
        if tenth <= self.tenth or tenth >= 10 or now - self.last_line < self.every_s:
            return
        self.tenth = tenth
        self.last_line = now
        elapsed = now - self.started
        print(f"simulate: {100 * done // self.total_pods} % of all pods, "
              f"{self.done_runs}/{self.total_runs} runs done; "
              f"{times(elapsed, estimate_left(elapsed, done, self.total_pods))}",
              file=self.out, flush=True)

    def finished(self, result: RunResult) -> None:
        self.done_runs += 1
        self.finished_pods += result.pods
        elapsed = self.clock() - self.started
        # a finished run's pods are all decided, whatever the last count said
        done = max(self.done_pods, self.finished_pods)
        left = estimate_left(elapsed, done, self.total_pods)
        pct = 100.0 * done / self.total_pods if self.total_pods else 100.0
        more = self.done_runs < self.total_runs
        self.last_line = self.clock()
        self.tenth = max(self.tenth, 10 * done // self.total_pods if self.total_pods else 10)
        print(f"simulate: run {self.done_runs}/{self.total_runs} done: {result.workload} "
              f"{result.policy} seed {result.seed}: {result.unallocated_pct:.2f} % unallocated "
              f"({result.pods:,} pods, {result.seconds:.1f} s); {pct:.0f} % of all pods, "
              f"{times(elapsed, left if more else None)}", file=self.out, flush=True)

    def close(self) -> None:
        pass


class TimesColumn(ProgressColumn):
    """``0:05 elapsed, about 0:13 left``, never wrapped or cut: the other columns give way."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True))

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        left = estimate_left(elapsed, int(task.completed), int(task.total or 0))
        return Text(times(elapsed, left), style="progress.remaining")


class TerminalProgress:
    """A rich bar redrawn in place on a terminal, gone when the run ends. At 80 columns the
    description and the bar shrink; the counts and the times stay whole."""

    def __init__(self, console: Console, total_pods: int, total_runs: int,
                 get_time: Callable[[], float] | None = None) -> None:
        self.total_runs = total_runs
        self.done_runs = 0
        self.bar = Bar(
            TextColumn("[progress.description]{task.description}",
                       table_column=Column(overflow="ellipsis", no_wrap=True, ratio=1)),
            BarColumn(bar_width=None, table_column=Column(ratio=1)),
            TextColumn("{task.completed:,}/{task.total:,} pods",
                       table_column=Column(no_wrap=True)),
            TextColumn("{task.fields[runs]}", table_column=Column(no_wrap=True)),
            TimesColumn(),
            console=console, transient=True, refresh_per_second=4, expand=True,
            get_time=get_time,
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
