"""What ships: the wheel (which the image installs) holds the product and no test double."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the test doubles' modules (testing/sharegpu_testing), by name
DOUBLES = {p.stem for p in (ROOT / "testing" / "sharegpu_testing").glob("*.py")} - {"__init__"}
# doubles that once lived in the package: their old paths must stay empty
FORMER_DOUBLES = ("sharegpu/kobjects.py", "sharegpu/extender/memapi.py")


def test_doubles_known_by_name():
    """The doubles that moved out of the package are among the names the wheel is checked for."""
    assert {"kobjects", "memapi", "fakeapi"} <= DOUBLES, DOUBLES


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from exactly what the Dockerfile copies (pyproject.toml, README.md,
    LICENSE, src)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                   check=True, cwd=tmp_path, timeout=300)
    (built,) = out.glob("sharegpu-*.whl")
    return built


@pytest.mark.timeout(300)
def test_wheel_lists_no_test_doubles(wheel):
    """The wheel holds only ``sharegpu/`` and its metadata, no ``testing`` package, no fake."""
    files = zipfile.ZipFile(wheel).namelist()
    tops = {f.split("/", 1)[0] for f in files}
    assert tops == {"sharegpu", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert "sharegpu/core/state.py" in files and "sharegpu/extender/server.py" in files
    assert not [f for f in files if "testing" in f], files
    modules = {Path(f).stem for f in files if f.endswith(".py")}
    assert not modules & DOUBLES, modules & DOUBLES
    assert "sharegpu/fakeapi.py" not in files
    assert not [f for f in FORMER_DOUBLES if f in files]
    wheel_zip = zipfile.ZipFile(wheel)
    users = [f for f in files if f.endswith(".py")
             and "sharegpu_testing" in wheel_zip.read(f).decode("utf-8", "replace")]
    assert not users, f"modules of the wheel naming the test doubles' package: {users}"
    assert not any("fake" in f for f in files), [f for f in files if "fake" in f]


def test_image_copies_no_test_doubles():
    """The image builds its wheel from ``COPY pyproject.toml README.md ./`` and ``COPY src``
    only, and the build context leaves the dev-only trees out."""
    text = (ROOT / "Dockerfile").read_text()
    copies = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("COPY ")]
    sources = {w for c in copies if "--from=" not in c for w in c.split()[:-1]}
    assert sources == {"pyproject.toml", "README.md", "LICENSE", "constraints.txt", "src"}, sources
    assert not (ROOT / "src" / "sharegpu" / "testing").exists()
    assert not [f for f in FORMER_DOUBLES if (ROOT / "src" / f).exists()]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"testing", "tests", "bench"} <= set(ignored)


def test_the_wheel_names_the_version_and_the_dependencies(wheel):
    """What ``pip install sharegpu`` resolves: the wheel's metadata carries the package's
    version and every dependency of pyproject.toml, the plot extra too."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert wheel.name.startswith(f"sharegpu-{project['version']}-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"sharegpu-{project['version']}.dist-info/METADATA").decode()
        entry = z.read(f"sharegpu-{project['version']}.dist-info/entry_points.txt").decode()
    requires = [ln.split(": ", 1)[1] for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    for dep in project["dependencies"]:
        assert dep in requires, dep
    assert any(r.startswith("matplotlib") and 'extra == "plot"' in r for r in requires)
    assert "sharegpu = sharegpu.cli:main" in entry
    assert "kubectl-inspect-cgpu = sharegpu.whatif.plugin:main" in entry


@pytest.mark.timeout(300)
def test_the_wheel_in_a_fresh_venv_gives_both_commands(wheel, tmp_path):
    """``pip install`` of the wheel into a fresh virtual environment, then its two commands run
    from it. No index here: the dependencies are this environment's, seen through a ``.pth``
    file (the release workflow's dist job installs them from PyPI)."""
    import sysconfig

    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                    "--no-index", "--disable-pip-version-check", "-q", str(wheel)],
                   check=True, timeout=300)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (Path(site) / "deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    where = subprocess.run([py, "-c", "import sharegpu; print(sharegpu.__file__)"], env=env,
                           capture_output=True, text=True, check=True, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel's, not src
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    r = subprocess.run([venv / "bin" / "sharegpu", "--version"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == f"sharegpu {version}\n", r.stderr
    r = subprocess.run([venv / "bin" / "sharegpu", "policies"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and "strandfill" in r.stdout, r.stderr
    r = subprocess.run([venv / "bin" / "kubectl-inspect-cgpu", "--file",
                        ROOT / "tests" / "data" / "quickstart.json"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and "Allocated/Total GPU Memory In Cluster" in r.stdout, r.stderr


def test_the_image_constraints_pin_every_dependency():
    """constraints.txt (the image's pip) pins every dependency of the package, followed to the
    leaves in this environment, and the build backend."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    def key(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, line
            pins[key(name)] = version
    seen, todo = set(), ["sharegpu"]
    while todo:
        name = todo.pop()
        if key(name) in seen:
            continue
        seen.add(key(name))
        for r in md.distribution(name).requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    assert seen - {"sharegpu"} <= set(pins), sorted(seen - {"sharegpu"} - set(pins))
    assert {"setuptools", "wheel"} <= set(pins)
    for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(dep)
        assert req.specifier.contains(pins[key(req.name)]), (dep, pins[key(req.name)])
