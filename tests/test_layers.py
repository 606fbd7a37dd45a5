"""The layering is a contract: ``lint-imports`` (import-linter, configured in pyproject.toml
and run by scripts/test.sh) passes on the package, and fails when an import runs the wrong way.

The wrong-way imports are made in a copy of the package, which is put first on the path, so the
real tree is never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([str(LINT), "--no-cache", str(cwd / "pyproject.toml")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_lint_imports_passes_on_the_package():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 3 kept, 0 broken." in r.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    # the core reaching an adapter
    ("state.py", "from .extender import wire  # wrong way", "the core imports no adapter"),
    ("scheduler.py", "from . import kubeconfig  # wrong way", "the core imports no adapter"),
    # one adapter reaching another, not through the core
    ("extender/view.py", "from ..agent import allocate  # wrong way",
     "the adapters reach each other only through the core"),
    ("sim/engine.py", "from ..webhook import review  # wrong way",
     "the adapters reach each other only through the core"),
    # an adapter reaching the command line above it
    ("agent/service.py", "from .. import cli  # wrong way",
     "the adapters reach each other only through the core"),
    # the circle between state and placement, back
    ("state.py", "from .placement import gpus  # wrong way", "no import cycles"),
])
def test_a_wrong_way_import_breaks_a_contract(tmp_path, module, line, contract):
    copy = tmp_path / "sharegpu"
    shutil.copytree(ROOT / "src" / "sharegpu", copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    # the unchanged copy passes, and is the one analysed (not the installed package)
    ok = lint(tmp_path, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    target = copy / module
    target.write_text(target.read_text() + f"\n\n{line}\n")
    bad = lint(tmp_path, tmp_path)
    assert bad.returncode != 0, bad.stdout
    broken = bad.stdout.split("Broken contracts", 1)[1]
    assert contract in broken, bad.stdout
