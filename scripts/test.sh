#!/usr/bin/env bash
# The project's test command: a fresh virtual environment, the package with its test extras,
# ruff, then pytest. Extra test prerequisites (compilers, helm) are installed by the steps below.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# helm and kubectl for the chart and plugin tests (into .tools/, once)
bash scripts/install-tools.sh
export PATH="$PWD/.tools/bin:$PATH"
.venv/bin/ruff check src tests bench
.venv/bin/python -m pytest "$@"
