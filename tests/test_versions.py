"""Versions that cannot lie: the chart, the package and the image name one version, and the chart
never starts sharegpu's image with a flag or a path that the image of its ``appVersion`` would
not accept.

"The image of its appVersion" is made concrete from git:

- a pre-release appVersion (``0.2.0-dev``, what main carries between releases) is the image built
  from this tree (scripts/build-node-images.sh tags it so for the real-node tests): the chart's
  arguments go through this tree's ``sharegpu`` argument parser;
- a released appVersion ``X.Y.Z`` is the image the release workflow built from the tag
  ``vX.Y.Z``: the arguments go through the parser of that tag's tree (``git archive``), and a
  missing tag fails the test: nothing can say what that image accepts.

What it cannot see: a flag the parser accepts but the command then refuses at run time, and
the Python dependencies of a released tree (its parser runs on this tree's environment)."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from sharegpu import __version__
from test_chart import EXAMPLES, render

ROOT = Path(__file__).resolve().parent.parent
CHART = yaml.safe_load((ROOT / "charts" / "sharegpu" / "Chart.yaml").read_text())
VALUES = yaml.safe_load((ROOT / "charts" / "sharegpu" / "values.yaml").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SEMVER = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z.-]+))?$")

# Parse each argv of the JSON list on stdin with the parser of the sharegpu package first on
# sys.path (PYTHONPATH: the tree under test); print one line per argv: "" or the error.
PARSE = r"""
import contextlib, io, json, sys
import sharegpu
from sharegpu.cli import build_parser
print(json.dumps({"file": sharegpu.__file__}))
for argv in json.load(sys.stdin):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser()[0].parse_args(argv)
        print(json.dumps(""))
    except SystemExit:
        print(json.dumps(err.getvalue().strip().splitlines()[-1]))
"""


def is_prerelease(v: str) -> bool:
    m = SEMVER.match(v)
    assert m, f"{v!r} is not a semantic version"
    return m.group(4) is not None


def git(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=60, **kw)


def released_tree(version: str, into: Path) -> Path:
    """The ``src`` of the tag ``v<version>``, extracted under ``into``."""
    tag = f"v{version}"
    r = git("rev-parse", "--verify", "--quiet", f"refs/tags/{tag}^{{commit}}")
    assert r.returncode == 0, (
        f"the chart's appVersion {version} is a released version, but this checkout has no tag "
        f"{tag}: nothing says what the image {VALUES['image']['repository']}:{version} accepts. "
        "Between releases main's chart carries the next version as a pre-release (0.2.0-dev); "
        "a release is tagged by the commit that sets it (docs/release.md)")
    archive = into / "src.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", tag, "src"],
                       stdout=f, check=True, timeout=60)
    with tarfile.open(archive) as t:
        t.extractall(into, filter="data")
    return into / "src"


def image_cli_errors(src: Path, argvs: list[list[str]]) -> list[str]:
    """Each argv parsed by the ``sharegpu`` parser of the tree ``src``: the errors, or ''."""
    r = subprocess.run([sys.executable, "-c", PARSE], input=json.dumps(argvs), text=True,
                       capture_output=True, timeout=120, cwd=src.parent,
                       env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    first, *answers = (json.loads(line) for line in r.stdout.splitlines())
    assert Path(first["file"]).is_relative_to(src), first  # that tree's parser, not the venv's
    assert len(answers) == len(argvs)
    return answers


def sharegpu_containers(docs) -> list[tuple[str, dict, dict]]:
    """(workload, pod spec, container) for every container running sharegpu's image."""
    out = []
    for d in docs:
        if d["kind"] not in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            continue
        spec = d["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["image"].rsplit(":", 1)[0] == VALUES["image"]["repository"]:
                out.append((f"{d['kind']}/{d['metadata']['name']}/{c['name']}", spec, c))
    return out


def argv_of(c: dict) -> list[str]:
    """The sharegpu argv the container runs (the image's ENTRYPOINT is ``sharegpu``)."""
    argv = list(c.get("command") or ["sharegpu"]) + list(c.get("args") or [])
    assert argv[0] == "sharegpu", (c["name"], argv)
    return [a.replace("$(POD_NAME)", "pod").replace("$(NODE_NAME)", "node").replace(
        "$(POD_NAMESPACE)", "ns") for a in argv[1:]]


# --- one version ------------------------------------------------------------------------------


def test_chart_package_and_code_name_one_version():
    chart, app = CHART["version"], CHART["appVersion"]
    pkg = PYPROJECT["project"]["version"]
    assert SEMVER.match(chart) and SEMVER.match(app), (chart, app)
    assert chart == app, "the chart's version and appVersion move together"
    # PEP 440 spells the chart's 0.2.0-dev as 0.2.0.dev0; both parse to the same version
    assert Version(chart) == Version(pkg) == Version(__version__), (chart, pkg, __version__)
    assert str(Version(pkg)) == pkg, f"pyproject's version {pkg!r} is not in PEP 440's form"
    assert is_prerelease(chart) == Version(pkg).is_prerelease


def test_a_released_version_is_a_tag_of_this_history():
    """main carries a pre-release; a released version is only ever at its own tag."""
    version = CHART["appVersion"]
    if is_prerelease(version):
        tags = git("tag", "--list", "v*", text=True).stdout.split()
        released = [Version(t[1:]) for t in tags if SEMVER.match(t[1:])]
        assert all(Version(version) > v for v in released), (
            f"{version} is not after the released {max(released)}")
        return
    tag = git("tag", "--points-at", "HEAD", text=True).stdout.split()
    assert f"v{version}" in tag, f"appVersion {version} is a release: HEAD must be v{version}"


def test_the_default_image_is_the_app_version():
    assert VALUES["image"]["tag"] == ""
    images = {c["image"] for _, _, c in sharegpu_containers(render())}
    assert images == {f"{VALUES['image']['repository']}:{CHART['appVersion']}"}


# --- the image of appVersion accepts the chart ------------------------------------------------


@functools.cache
def argvs_of_every_example() -> tuple[tuple[str, tuple[str, ...]], ...]:
    out = []
    for values in (None, *EXAMPLES):
        for where, _, c in sharegpu_containers(render(values)):
            out.append((f"{values or 'values.yaml'}: {where}", tuple(argv_of(c))))
    return tuple(out)


def test_the_image_of_app_version_accepts_every_argument_the_chart_passes(tmp_path):
    version = CHART["appVersion"]
    src = ROOT / "src" if is_prerelease(version) else released_tree(version, tmp_path)
    cases = argvs_of_every_example()
    assert {argv[0] for _, argv in cases} == {"extender", "agent", "webhook", "mps-daemon"}
    errors = image_cli_errors(src, [list(argv) for _, argv in cases])
    refused = [f"{where}: {err}" for (where, _), err in zip(cases, errors, strict=True) if err]
    assert not refused, (f"the image {VALUES['image']['repository']}:{version} (from "
                         f"{'this tree' if src.is_relative_to(ROOT) else 'v' + version}) "
                         "refuses:\n" + "\n".join(refused))


def test_the_check_sees_a_flag_the_image_lacks():
    """The parse check itself: an agent flag this tree does not know is refused, by name."""
    (err,) = image_cli_errors(ROOT / "src", [["agent", "--node-name=n", "--no-such-flag=1"]])
    assert "unrecognized arguments: --no-such-flag=1" in err


def host_side_flags(command: str) -> set[str]:
    """The options of ``sharegpu <command>`` that name a path on the host, handed to other
    containers (their help says "host path" or "host directory"), not opened by the command."""
    import argparse

    from sharegpu.cli import build_parser

    sub = next(a for a in build_parser()[0]._actions
               if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {o for a in sub._actions for o in a.option_strings
            if re.match(r"host (path|directory)\b", a.help or "")}


@pytest.mark.parametrize("values", [None, *EXAMPLES])
def test_every_path_the_chart_passes_is_mounted(values):
    """An absolute path given to sharegpu lies in a volume the container mounts, or is the
    container's /proc on a pod that shares the host's PID namespace, or is a host path the
    command hands to other containers."""
    for where, spec, c in sharegpu_containers(render(values)):
        mounts = [m["mountPath"].rstrip("/") for m in c.get("volumeMounts", [])]
        argv = argv_of(c)
        host_side = host_side_flags(argv[0])
        for arg in argv:
            flag, eq, path = arg.partition("=")
            if not (eq and flag.startswith("--") and path.startswith("/")) or flag in host_side:
                continue
            if path == "/proc":
                assert spec.get("hostPID") is True, (where, arg)
                continue
            assert any(path == m or path.startswith(m + "/") for m in mounts), (
                f"{where}: {arg} is in no volume the container mounts ({mounts})")


# --- the real-node tests' image carries the tag the chart asks for, never a release's ---------


def node_images_script(repo: Path) -> subprocess.CompletedProcess:
    """scripts/build-node-images.sh of a scratch repository, on a PATH without buildah (it
    stops at its first missing tool after the version checks, root or not)."""
    tools = repo / "tools"
    tools.mkdir(exist_ok=True)
    for t in ("bash", "git", "sed", "head", "dirname"):
        (tools / t).unlink(missing_ok=True)
        (tools / t).symlink_to(subprocess.run(["bash", "-c", f"command -v {t}"], text=True,
                                              capture_output=True, check=True).stdout.strip())
    return subprocess.run([str(tools / "bash"), "scripts/build-node-images.sh"], cwd=repo,
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": str(tools), "HOME": str(repo)})


def scratch_repo(tmp_path: Path, app_version: str) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "charts" / "sharegpu").mkdir(parents=True)
    (repo / "src").mkdir()
    (repo / "src" / "x.py").write_text("x = 1\n")
    (repo / "scripts" / "build-node-images.sh").write_text(
        (ROOT / "scripts" / "build-node-images.sh").read_text())
    (repo / "charts" / "sharegpu" / "values.yaml").write_text(
        (ROOT / "charts" / "sharegpu" / "values.yaml").read_text())
    (repo / "charts" / "sharegpu" / "Chart.yaml").write_text(
        f'version: {app_version}\nappVersion: "{app_version}"\n')
    cmds = [["init", "-q"], ["add", "scripts", "charts", "src"],
            ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "scratch"]]
    for c in cmds:
        subprocess.run(["git", "-C", str(repo), *c], check=True, capture_output=True)
    return repo


def test_the_node_images_refuse_a_released_tag_for_an_untagged_tree(tmp_path):
    repo = scratch_repo(tmp_path, "9.9.9")
    r = node_images_script(repo)
    assert r.returncode == 1
    assert "appVersion 9.9.9 is a released version and there is no tag v9.9.9" in r.stderr
    subprocess.run(["git", "-C", str(repo), "tag", "v9.9.9"], check=True)
    r = node_images_script(repo)  # at the release's tag: past the version checks
    assert r.returncode == 1 and "buildah is missing" in r.stderr, r.stderr
    (repo / "src" / "x.py").write_text("x = 2\n")
    r = node_images_script(repo)
    assert "the image's inputs have uncommitted changes" in r.stderr, r.stderr
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qam", "after"], check=True)
    r = node_images_script(repo)
    assert "HEAD is not v9.9.9" in r.stderr, r.stderr


def test_the_node_images_take_a_prerelease_from_the_tree(tmp_path):
    r = node_images_script(scratch_repo(tmp_path, "9.9.10-dev"))
    assert r.returncode == 1 and "buildah is missing" in r.stderr, r.stderr
    assert "released version" not in r.stderr
