"""The layering is a contract: ``lint-imports`` (import-linter, configured in pyproject.toml
and run by scripts/test.sh) passes on the package, and fails when an import runs the wrong way.

The wrong-way imports are made in a copy of the package, which is put first on the path, so the
real tree is never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
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


def _contract(contract_id: str) -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (found,) = [c for c in config["contracts"] if c["id"] == contract_id]
    return found


def test_every_part_of_the_package_is_in_a_layer():
    """The contracts name packages: whatever sits directly under ``sharegpu`` is a layer of the
    layers contract, so a module put anywhere is under the rules of the package it is put in."""
    layered = {name.strip() for layer in _contract("layers")["layers"]
               for name in layer.split("|")}
    pkg = ROOT / "src" / "sharegpu"
    children = {f"sharegpu.{p.stem}" for p in pkg.iterdir()
                if (p.suffix == ".py" and p.stem != "__init__")
                or (p.is_dir() and (p / "__init__.py").exists())}
    assert children == layered, (children - layered, layered - children)
    assert set(_contract("pure")["source_modules"]) == {"sharegpu.core", "sharegpu.dra"}


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "sharegpu"
    shutil.copytree(ROOT / "src" / "sharegpu", copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    # the unchanged copy passes, and is the one analysed (not the installed package)
    ok = lint(tmp_path, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    return copy


def _broken(tmp_path: Path) -> str:
    bad = lint(tmp_path, tmp_path)
    assert bad.returncode != 0, bad.stdout
    return bad.stdout.split("Broken contracts", 1)[1]


LAYERS = "the layers: commands wire the adapters"
PURE = "core and dra do no I/O"


@pytest.mark.parametrize(("module", "line", "contract"), [
    # the core reaching an adapter, DRA or the Kubernetes I/O helpers
    ("core/state.py", "from ..extender import wire  # wrong way", LAYERS),
    ("core/scheduler.py", "from ..kubeio import kubeconfig  # wrong way", LAYERS),
    ("core/request.py", "from ..dra import driver  # wrong way", LAYERS),
    # DRA's pure part reaching the I/O helpers, or an adapter
    ("dra/drashares.py", "from ..kubeio import kevents  # wrong way", LAYERS),
    ("dra/claimrules.py", "from .. import webhook  # wrong way", LAYERS),
    # I/O in the pure packages
    ("core/state.py", "import logging  # wrong way", PURE),
    ("dra/draclaims.py", "import os  # wrong way", PURE),
    # one adapter reaching another, not through the core
    ("extender/view.py", "from ..agent import allocate  # wrong way", LAYERS),
    ("sim/engine.py", "from ..webhook import review  # wrong way", LAYERS),
    # an adapter reaching the command line above it
    ("agent/service.py", "from .. import cli  # wrong way", LAYERS),
    # the circle between state and placement, back
    ("core/state.py", "from .placement import gpus  # wrong way", "no import cycles"),
])
def test_a_wrong_way_import_breaks_a_contract(tmp_path, module, line, contract):
    copy = _copy(tmp_path)
    target = copy / module
    target.write_text(target.read_text() + f"\n\n{line}\n")
    assert contract in _broken(tmp_path)


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("core/newrule.py", "from ..extender import wire", LAYERS),
    ("core/placement/policies/newpolicy.py", "from ....agent import allocate", LAYERS),
    ("core/newclock.py", "import time", PURE),
    ("dra/newreader.py", "from ..kubeio import logs", LAYERS),
    ("dra/newwatch.py", "import asyncio", PURE),
    ("kubeio/newclient.py", "from ..dra import driver", LAYERS),
])
def test_a_new_module_is_under_the_contracts_of_its_package(tmp_path, module, line, contract):
    """A module nobody has named in pyproject.toml, imported by nothing, is checked by where
    it is put: its wrong-way import breaks the contract of its package."""
    copy = _copy(tmp_path)
    new = copy / module
    new.write_text(f'"""A module that did not exist."""\n\n{line}\n')
    broken = _broken(tmp_path)
    assert contract in broken
    assert f"sharegpu.{module.removesuffix('.py').replace('/', '.')}" in broken
