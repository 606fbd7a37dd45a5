"""The README: short, and every command it shows works on a fresh clone as written.

Each command of its ``bash`` blocks is matched to a check below; a command no check knows
fails the test, so a new one must come with its check. The fast ones run for real (the
simulator on one seed, ``generate``, ``policies``, ``--plot``, ``kubectl inspect cgpu --file``,
the chart rendered with the install's arguments); the slow ones (the quick look, ten seeds, the
openb trace) are parsed by the real argument parser and their paths checked, and run for real
elsewhere (tests/test_sim.py runs the quick look on one seed)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import cgpu_cluster as cc
from sharegpu.cli import build_parser
from sharegpu.cli import main as sharegpu
from sharegpu.core import names
from sharegpu.core.modes import parse_mode
from sharegpu.core.request import Kind, parse_pod
from sharegpu.inspect_cgpu import render
from sharegpu.inspect_cgpu.cli import main as inspect_cgpu
from sharegpu.inspect_cgpu.model import build

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUP = ["python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/sharegpu simulate",
         "bash scripts/test.sh"]


def blocks(tag: str, text: str = README) -> list[str]:
    """Contents of the fenced code blocks tagged ``tag`` ('' for untagged ones)."""
    out: list[str] = []
    current: list[str] | None = None
    kind = ""
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, kind = [], line[3:].strip()
            else:
                if kind == tag:
                    out.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return out


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(" ".join(line.split()))
    return out


def section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def demo_cluster() -> dict:
    """The cluster the README's ``kubectl inspect cgpu`` output shows: one cgpu node with two
    15 GiB GPUs, running the README's pod (2 GiB)."""
    n = cc.node("gpu-node-1", "10.0.0.21", [15, 15])
    return cc.dump([n], cc.schedule([n], [cc.pod("gpu-share-demo", 2)]))


def the_pod() -> dict:
    (pod,) = [d for d in map(yaml.safe_load, blocks("yaml")) if d["kind"] == "Pod"]
    return pod


# -- the checks, one per kind of command --------------------------------------------------------
SLOW = {"simulate", "simulate --policy fgd --policy strand --seeds 42..51",
        "simulate --trace clusterdata/cluster-trace-gpu-v2023/csv"}


def check_sharegpu(cmd: str, where: Path) -> None:
    args = shlex.split(cmd)[1:]
    parser, _ = build_parser()
    parsed = parser.parse_args(args)  # a flag that does not exist fails here
    if " ".join(args) in SLOW:
        if parsed.trace is not None:  # the trace's place in the clone the README makes
            assert "git clone --depth 1 https://github.com/alibaba/clusterdata" in README
            assert str(parsed.trace).startswith("clusterdata/cluster-trace-gpu-v2023/csv")
        return
    assert sharegpu(args) == 0, cmd


def check_pip_extra(cmd: str, where: Path) -> None:
    (extra,) = re.findall(r'\.\[(\w+)\]', cmd)
    assert extra in PYPROJECT["project"]["optional-dependencies"]
    assert "matplotlib" in " ".join(PYPROJECT["project"]["optional-dependencies"][extra])


def check_clone(cmd: str, where: Path) -> None:
    assert cmd == "git clone --depth 1 https://github.com/alibaba/clusterdata"


CHART = yaml.safe_load((ROOT / "charts" / "sharegpu" / "Chart.yaml").read_text())


def check_helm_install(cmd: str, where: Path) -> None:
    args = shlex.split(cmd)
    if args[3].startswith("oci://"):  # a release's chart, where the release workflow puts it
        wf = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
        assert args[:4] == ["helm", "install", "sharegpu", f"{wf['env']['CHART_REPO']}/sharegpu"]
        assert args[4:6] == ["--version", "VERSION"]
        return
    assert args[:4] == ["helm", "install", "sharegpu", "charts/sharegpu"]
    helm = shutil.which("helm", path=str(ROOT / ".tools" / "bin")) or shutil.which("helm")
    assert helm, "helm is missing: bash scripts/install-tools.sh installs it into .tools/bin"
    flags = [a for a in args[4:] if a != "--create-namespace"]
    r = subprocess.run([helm, "template", *args[2:4], *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(where),
                            "KUBECONFIG": "/nonexistent"})
    assert r.returncode == 0, r.stderr
    # the image the README's build command makes, at the chart's appVersion
    assert f"image: REGISTRY/sharegpu:{CHART['appVersion']}" in r.stdout
    assert f"--tag REGISTRY/sharegpu:{CHART['appVersion']} " in README


def check_build_image(cmd: str, where: Path) -> None:
    """The image of the checkout's chart, by the release's build script (not run here: it
    pushes); every option it passes is one the script takes."""
    args = shlex.split(cmd)
    assert args[:2] == ["bash", "scripts/build-image.sh"]
    opts = dict(zip(args[2::2], args[3::2], strict=False))
    assert opts["--tag"] == f"REGISTRY/sharegpu:{CHART['appVersion']}"
    assert opts["--builder"] == "docker" and args[-1] == "--push"
    script = (ROOT / "scripts" / "build-image.sh").read_text()
    for a in args[2:]:
        if a.startswith("--"):
            assert f"        {a}) " in script, a


def check_label(cmd: str, where: Path) -> None:
    m = re.fullmatch(r"kubectl label node NODE_NAME ([\w./-]+)=(\w+) --overwrite", cmd)
    assert m and m.group(1) == names.LABEL_SCHEDULE
    parse_mode(m.group(2))


def check_apply(cmd: str, where: Path) -> None:
    assert cmd == "kubectl apply -f gpu-pod.yaml" and "`gpu-pod.yaml`" in README
    pod = the_pod()
    kubernetes_validate.validate(pod, "1.30.0", strict=True)
    req = parse_pod(pod)
    assert req.kind is Kind.SHARED and req.containers[0].gpu_mem == 2
    assert pod["spec"]["schedulerName"] == "ack-co-scheduler"


def check_logs(cmd: str, where: Path) -> None:
    assert cmd == f"kubectl logs {the_pod()['metadata']['name']}"


def check_path(cmd: str, where: Path) -> None:
    assert cmd == 'export PATH="$PWD/.venv/bin:$PATH"'
    assert "kubectl-inspect-cgpu" in PYPROJECT["project"]["scripts"]


def check_inspect(cmd: str, where: Path) -> None:
    args = shlex.split(cmd)[3:]
    if not args:  # the live form: its output in the README is what the tool prints
        items = demo_cluster()["items"]
        view = build([i for i in items if i["kind"] == "Node"],
                     [i for i in items if i["kind"] == "Pod"])
        assert render.summary(view) in blocks("")
        return
    assert Path.cwd() == where
    assert inspect_cgpu(args) == 0, cmd


def check_dump(cmd: str, where: Path) -> None:
    assert cmd == "kubectl get nodes,pods -A -o json > cluster-dump.json"
    (where / "cluster-dump.json").write_text(json.dumps(demo_cluster()))


CHECKS: list[tuple[str, Callable[[str, Path], None]]] = [
    (r"\.venv/bin/sharegpu .*", check_sharegpu),
    (r"\.venv/bin/pip install -e \"\.\[\w+\]\"", check_pip_extra),
    (r"git clone .*", check_clone),
    (r"helm install .*", check_helm_install),
    (r"bash scripts/build-image\.sh .*", check_build_image),
    (r"kubectl label node .*", check_label),
    (r"kubectl apply .*", check_apply),
    (r"kubectl logs .*", check_logs),
    (r"export PATH=.*", check_path),
    (r"kubectl inspect cgpu.*", check_inspect),
    (r"kubectl get nodes,pods .*", check_dump),
]


def test_readme_is_short():
    assert len(README.splitlines()) < 200


def test_exactly_two_setup_commands_that_a_fresh_clone_has():
    setup = [c for b in blocks("bash", section("Set up")) for c in commands(b)]
    assert setup == SETUP
    assert PYPROJECT["project"]["scripts"]["sharegpu"] == "sharegpu.cli:main"
    assert (ROOT / "scripts" / "test.sh").is_file()
    # the first one ends in the quick look, which names no trace
    assert "--trace" not in setup[0]


def test_every_command_runs_or_is_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative outputs (gen/, fig.png, the dump) land here
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    cmds = [c for b in blocks("bash") for c in commands(b) if c not in SETUP]
    assert len(cmds) >= 10
    unchecked = []
    for cmd in cmds:
        for pattern, check in CHECKS:
            if re.fullmatch(pattern, cmd):
                check(cmd, tmp_path)
                break
        else:
            unchecked.append(cmd)
    assert not unchecked, f"README commands no check knows: {unchecked}"
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "gen" / "openb_pod_list_generated.csv").is_file()


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_the_status_table_is_one_link_away():
    assert "docs/testing.md" in README
    text = (ROOT / "docs" / "testing.md").read_text()
    assert "What was tested against fakes, and what against the real thing" in text
    assert "| part | tested against | real or fake |" in text


@pytest.mark.parametrize("cmd", SETUP[:1])
def test_the_quick_look_is_the_default_run(cmd):
    from sharegpu.commands.simulate import QUICK_POLICIES, QUICK_SEEDS

    parsed = build_parser()[0].parse_args(shlex.split(cmd.split(" && ")[-1])[1:])
    assert parsed.trace is None and parsed.seeds is None and parsed.policy is None
    shown = re.findall(r"│ generated │ (\w+)\s*│\s+(\d+) │", README)
    assert [p for p, _ in shown] == QUICK_POLICIES
    lo, hi = map(int, QUICK_SEEDS.split(".."))
    assert {int(n) for _, n in shown} == {hi - lo + 1}
    assert sys.version_info >= (3, 11)
