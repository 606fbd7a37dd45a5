"""The simulator's progress: counted in pods over every run, a line per finished run when not
on a terminal, an estimate of the time left, and the same counts with worker processes."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from sharegpu.sim.engine import RunResult
from sharegpu.sim.progress import LineProgress, estimate_left
from sharegpu.sim.runner import Source, run_matrix, stream_lengths


def result(policy: str, seed: int, pods: int) -> RunResult:
    return RunResult(policy, "w", seed, 6.5, [], 2.0, pods, pods, 1.0, 0.5)


def test_estimate_left_is_the_pace_so_far():
    assert estimate_left(10.0, 250, 1000) == pytest.approx(30.0)
    assert estimate_left(0.0, 0, 1000) is None
    assert estimate_left(5.0, 1000, 1000) == 0.0


def test_lines_one_per_finished_run_with_the_time_left():
    now = [0.0]
    out = io.StringIO()
    p = LineProgress(out, total_pods=400, total_runs=2, clock=lambda: now[0])
    now[0] = 3.0
    p.pods(50)  # a poll behind: the finished run's 200 pods count
    p.finished(result("fgd", 42, 200))
    now[0] = 6.0
    p.pods(400)
    p.finished(result("strand", 42, 200))
    first, second = out.getvalue().splitlines()
    assert first.startswith("simulate: run 1/2 done: w fgd seed 42: 6.50 % unallocated")
    assert "50 % of all pods" in first and "about 0:03 left" in first
    assert second.startswith("simulate: run 2/2 done: w strand seed 42")
    assert "100 % of all pods" in second and "left" not in second


@pytest.mark.parametrize("jobs", [1, 2])
def test_pods_are_counted_over_every_run(jobs):
    source = Source()
    seeds = [42, 43]
    lengths = stream_lengths(source, ["generated"], seeds, 1.3)
    total = 2 * sum(lengths.values())
    seen: list[int] = []
    done: list[RunResult] = []
    run_matrix(source, ["generated"], ["random", "bestfit"], seeds, jobs=jobs,
               on_pods=seen.append, on_done=done.append, poll_s=0.05)
    assert sorted((r.policy, r.seed) for r in done) == [
        ("bestfit", 42), ("bestfit", 43), ("random", 42), ("random", 43)]
    assert {(r.seed, r.pods) for r in done} == {(s, lengths[("generated", s)]) for s in seeds}
    assert seen == sorted(seen) and seen[-1] == total
    # it moves inside runs, not only when one ends
    assert len({n for n in seen if 0 < n < total}) > 4


def test_a_piped_run_prints_a_line_per_run_and_the_results():
    p = subprocess.run(
        [sys.executable, "-m", "sharegpu.cli", "simulate", "--seeds", "42,43",
         "--policy", "bestfit", "--policy", "random", "--jobs", "1"],
        capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    # the run lines; a loaded machine may add a line at a tenth of the pods between them
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("simulate: run ")]
    assert len(lines) == 4
    for i, line in enumerate(lines, 1):
        assert re.match(rf"simulate: run {i}/4 done: generated (bestfit|random) seed 4[23]: ",
                        line), line
    assert "about" in lines[0] and "left" in lines[0]
    assert "bestfit" in p.stdout and "random" in p.stdout
