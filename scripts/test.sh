#!/usr/bin/env bash
# The project's test command: a fresh virtual environment, the package with its test extras,
# ruff, the end-to-end control plane (Go), then pytest. Extra test prerequisites (compilers,
# helm) are installed by the steps below.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# helm and kubectl for the chart and plugin tests, built from pinned Go modules into .tools/
# (e2e/tools/; the first time a few minutes, then skipped while up to date)
bash scripts/install-tools.sh
export PATH="$PWD/.tools/bin:$PATH"
.venv/bin/ruff check src tests bench testing
# the layering contracts (pyproject.toml [tool.importlinter]; docs/architecture.md)
.venv/bin/lint-imports
# the real Kubernetes control plane of tests/e2e (kube-apiserver, etcd, kube-controller-manager,
# kube-scheduler, and the real node's kubelet and kube-proxy) from pinned Go modules: built once
# (a long while on 2 cores the first time; Go's module and build caches are reused), then only
# checked
bash scripts/build-controlplane.sh
# the real node of tests/e2e/test_realnode*.py (docs/real-node.md): Debian packages (buildah,
# mmdebstrap, CNI plugins, libseccomp, ipset), containerd v2.4.2 and runc v1.5.2 from pinned Go
# modules, and the images (the project's image from its Dockerfile, with buildah); each step is
# skipped while its output is up to date
bash scripts/install-node-packages.sh
bash scripts/build-node.sh
# kube-router's NetworkPolicy controller (e2e/tools/kube-router/go.mod), the policy enforcer of
# tests/e2e/test_netpol_real.py and test_realnode_netpol.py; skipped while up to date
bash scripts/build-kube-router.sh
bash scripts/build-node-images.sh
export SHAREGPU_E2E=1
.venv/bin/python -m pytest "$@"
