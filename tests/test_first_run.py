"""What a first run shows: ``sharegpu`` alone prints its help, ``--version`` the package's
version, the progress bar labels the time elapsed and the time left and keeps both whole at 80
columns, a pipe hears of a run before the runs finishing together end, and one seed has no
spread to show."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from rich.console import Console

from sharegpu.cli import commands
from sharegpu.sim.engine import RunResult
from sharegpu.sim.progress import LineProgress, TerminalProgress
from sharegpu.sim.report import table
from sharegpu.sim.runner import Summary

ROOT = Path(__file__).resolve().parent.parent


def sharegpu(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sharegpu.cli", *args], capture_output=True,
                          text=True, timeout=120)


def result(policy: str, seed: int, pods: int, workload: str = "w") -> RunResult:
    return RunResult(policy, workload, seed, 6.5, [], 2.0, pods, pods, 1.0, 0.5)


def test_no_arguments_prints_the_help():
    r = sharegpu()
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: sharegpu") and r.stderr == ""
    for name in commands():
        assert name in r.stdout


def test_version_is_the_packages():
    r = sharegpu("--version")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert r.returncode == 0 and r.stdout == f"sharegpu {version}\n", (r.stdout, r.stderr)


def bar_line(width: int) -> str:
    now = [100.0]
    p = TerminalProgress(Console(file=io.StringIO(), width=width, force_terminal=True),
                         1_000_000, 40, get_time=lambda: now[0])
    p.close()
    now[0] = 105.0
    p.pods(250_000)
    p.finished(result("strandfill", 42, 1000, workload="openb_pod_list_multigpu50"))
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=True, color_system=None).print(
        p.bar.make_tasks_table(p.bar.tasks))
    (line,) = out.getvalue().splitlines()
    return line


def test_the_bar_labels_both_times_and_keeps_them_whole_at_80_columns():
    for width in (80, 120):
        line = bar_line(width)
        assert len(line) <= width
        # 5 s for a quarter of the pods: 15 s left, each time named
        assert line.endswith("250,000/1,000,000 pods 1/40 runs 0:05 elapsed, about 0:15 left"), line
    assert "openb_pod_list_multigpu50/strandfill/42" in bar_line(160)


def test_a_pipe_hears_of_runs_finishing_together_before_they_end():
    now = [0.0]
    out = io.StringIO()
    p = LineProgress(out, total_pods=1000, total_runs=2, clock=lambda: now[0], every_s=10.0)
    now[0] = 5.0
    p.pods(150)  # a tenth passed, but the last line is only 5 s old: nothing yet
    assert out.getvalue() == ""
    now[0] = 20.0
    p.pods(400)
    now[0] = 25.0
    p.pods(450)  # the same tenth: nothing more
    (line,) = out.getvalue().splitlines()
    assert line == "simulate: 40 % of all pods, 0/2 runs done; 0:20 elapsed, about 0:30 left"
    now[0] = 50.0
    p.pods(1000)
    p.finished(result("a", 42, 500))
    p.finished(result("b", 42, 500))
    lines = out.getvalue().splitlines()
    assert [ln[:23] for ln in lines[1:]] == ["simulate: run 1/2 done:", "simulate: run 2/2 done:"]
    assert lines[-1].endswith("0:50 elapsed")


def test_one_seed_shows_no_spread_and_several_show_the_sd():
    def render(seeds: list[int]) -> str:
        s = Summary("fgd", "generated", seeds, [result("fgd", x, 10) for x in seeds], "policy")
        out = io.StringIO()
        table([s], Console(file=out, width=120, color_system=None))
        return out.getvalue()

    assert re.search(r"6\.50 ± —", render([42]))
    assert "± 0.00" in render([42, 43]) and "± —" not in render([42, 43])
