"""What ships: the wheel (which the image installs) holds the product and no test double."""

from __future__ import annotations

import shutil
import subprocess
import sys
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


@pytest.mark.timeout(300)
def test_wheel_lists_no_test_doubles(tmp_path):
    """Build the wheel from exactly what the Dockerfile copies (pyproject.toml, README.md, src)
    and list it: only ``sharegpu/`` and its metadata, no ``testing`` package, no fake."""
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                   check=True, cwd=tmp_path)
    (wheel,) = out.glob("sharegpu-*.whl")
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
    assert sources == {"pyproject.toml", "README.md", "constraints.txt", "src"}, sources
    assert not (ROOT / "src" / "sharegpu" / "testing").exists()
    assert not [f for f in FORMER_DOUBLES if (ROOT / "src" / f).exists()]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"testing", "tests", "bench"} <= set(ignored)
