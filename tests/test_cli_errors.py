"""Where users expect one line, they get one: every case here printed a traceback before. Each
runs the real command in a subprocess and checks the exit code and that stderr is one line
naming what is wrong (or, for the extender, one line per retry)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict | None = None, timeout: float = 120,
        pre: str = "") -> subprocess.CompletedProcess:
    code = f"{pre}\nimport sys\nfrom sharegpu.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def inspect(kubeconfig: Path) -> subprocess.CompletedProcess:
    code = "import sys\nfrom sharegpu.inspect_cgpu.cli import main\nsys.exit(main())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin",
                                           "HOME": str(kubeconfig.parent)})


def one_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_generate_into_a_directory_that_cannot_exist():
    r = run("generate", "--out", "/proc/nope")
    assert r.returncode == 2
    assert one_line(r) == "sharegpu generate: error: /proc/nope: No such file or directory"


def test_plot_is_checked_before_the_run(tmp_path):
    r = run("simulate", "--policy", "bestfit", "--seeds", "42", "--plot", "/proc/fig.png")
    assert r.returncode == 2 and r.stdout == ""  # refused before simulating anything
    assert one_line(r).startswith("sharegpu simulate: error: --plot='/proc/fig.png': cannot "
                                  "write in /proc")
    r = run("simulate", "--seeds", "42", "--plot", str(tmp_path / "f.png"),
            pre="import sys; sys.modules['matplotlib'] = None")
    assert r.returncode == 2 and r.stdout == ""
    assert f"needs matplotlib, which is not installed: {sys.executable} -m pip install matplotlib" \
        in one_line(r)


def test_json_into_a_closed_pipe_is_quiet():
    cmd = (f"{sys.executable} -m sharegpu.cli simulate --policy bestfit --seeds 42 --json "
           "| head -c 1 >/dev/null")
    # stdout buffered, as where PYTHONUNBUFFERED is not set (a CI runner): the pipe is met when
    # the buffer is flushed, which must be inside the command's error handling too
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


KUBECONFIGS = {
    "not YAML": ("{{{\n", "is not YAML at line 2"),
    "no clusters": ("apiVersion: v1\nkind: Config\ncurrent-context: x\ncontexts: [{name: x, "
                    "context: {cluster: c, user: u}}]\nusers: [{name: u, user: {}}]\n",
                    "'clusters' must be a list"),
    "missing client certificate": (
        "apiVersion: v1\nkind: Config\ncurrent-context: x\nclusters: [{name: c, cluster: "
        "{server: 'https://127.0.0.1:1'}}]\ncontexts: [{name: x, context: {cluster: c, user: "
        "u}}]\nusers: [{name: u, user: {client-certificate: /nonexistent.crt, client-key: "
        "/nonexistent.key}}]\n", "user 'u': client-certificate /nonexistent.crt does not exist"),
    "no context": ("apiVersion: v1\nkind: Config\nclusters: []\n", "has no current-context"),
}


@pytest.mark.parametrize("case", sorted(KUBECONFIGS))
def test_bad_kubeconfigs_are_one_line(tmp_path, case):
    text, rule = KUBECONFIGS[case]
    kc = tmp_path / "kubeconfig"
    kc.write_text(text)
    r = inspect(kc)
    assert r.returncode != 0
    line = one_line(r)
    assert line.startswith(f"kubectl inspect cgpu: error: kubeconfig='{kc}': {rule}"), line
    r = run("extender", "--kubeconfig", str(kc), "--listen", "127.0.0.1:0", "--insecure")
    assert r.returncode == 2
    assert one_line(r).startswith(f"sharegpu extender: error: --kubeconfig='{kc}': {rule}")


def test_extender_waits_for_an_unreachable_api_server():
    """It retries with back-off and logs one line per attempt, instead of exiting after 0.7 s
    with an 88-line traceback. Read until the second attempt (however slowly the machine starts
    Python), then stopped: still waiting is what we want."""
    code = "import sys\nfrom sharegpu.cli import main\nsys.exit(main(sys.argv[1:]))"
    p = subprocess.Popen([sys.executable, "-c", code, "extender", "--api-url",
                          "http://127.0.0.1:1", "--listen", "127.0.0.1:0", "--insecure"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    lines: list[str] = []
    try:
        assert p.stderr is not None
        for ln in p.stderr:  # ends when the process does (a crash) or at the second attempt
            lines.append(ln)
            if sum("cannot list the cluster yet" in x for x in lines) >= 2:
                break
        alive = p.poll() is None
    finally:
        p.kill()
        p.wait(timeout=30)
    out = "".join(lines)
    assert alive, out
    assert "Traceback" not in out
    attempts = [ln for ln in out.splitlines() if "cannot list the cluster yet" in ln]
    assert len(attempts) >= 2 and "attempt 1: ConnectError" in attempts[0]
    assert "retrying in 0.5s" in attempts[0] and "retrying in 1.0s" in attempts[1]


def test_every_option_has_help_that_shows_its_default():
    import argparse

    from sharegpu.cli import HelpFormatter, build_parser

    p, _ = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        sp.format_help()  # renders without error
        for a in sp._actions:
            if not a.option_strings or a.dest == "help":
                continue
            assert a.help, f"sharegpu {name} {a.option_strings[0]} has no help"
            shown = HelpFormatter("x")._get_help_string(a)
            if a.default not in (None, False):
                assert "default" in shown, f"sharegpu {name} {a.option_strings[0]}"


def test_policies_says_what_each_does():
    r = run("policies")
    lines = dict(ln.split(None, 1) for ln in r.stdout.splitlines())
    assert lines["strand"].startswith("Strand: FGD's fragmentation gradient")
    assert lines["default"] == "the default: strandfill"
    assert all(len(v) > 20 for k, v in lines.items() if k != "default")


@pytest.mark.parametrize("flag,value,rule", [
    ("--heartbeat-every", "0", "must be more than 0 and at most 30 seconds"),
    ("--heartbeat-every", "45", "must be more than 0 and at most 30 seconds"),
    ("--stop-drain", "-1", "must be 0 to 20 seconds"),
])
def test_agent_liveness_flags_are_checked(flag, value, rule):
    r = run("agent", "--node-name", "n1", "--standalone", "--nvml", "fake", flag, value)
    assert r.returncode != 0
    line = one_line(r)
    assert flag in line and rule in line, line
