"""Fixtures for the end-to-end tests against a real control plane (see controlplane.py).

The ``controlplane`` fixture builds the control-plane binary (scripts/build-controlplane.sh; a
no-op when it is up to date) and starts etcd, kube-apiserver, kube-controller-manager and
kube-scheduler once per session. A failed build or start FAILS the tests that use it: it is never
a skip. SHAREGPU_E2E_KEEP=1 keeps the work directory (certificates, kubeconfigs, logs).

These tests are opt-in: they are collected only when tests/e2e (or a file in it) is named on the
pytest command line, or SHAREGPU_E2E=1, so the project's plain ``pytest`` (testpaths = tests)
does not build and start a control plane.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import Client, KubeConfig

from .controlplane import ControlPlane, ControlPlaneError, build

E2E_DIR = Path(__file__).resolve().parent


def _asked_for(config: pytest.Config) -> bool:
    if os.environ.get("SHAREGPU_E2E") == "1":
        return True
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        return False  # testpaths or the current directory: not asked by name
    base = config.invocation_params.dir
    for arg in config.args:
        path = (base / arg.split("::", 1)[0]).resolve()
        if path == E2E_DIR or E2E_DIR in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name.startswith("test_") and not _asked_for(config):
        return True
    return None


@pytest.fixture(scope="session")
def controlplane_binary() -> Path:
    try:
        return build()
    except (ControlPlaneError, OSError, subprocess.SubprocessError) as e:
        pytest.fail(f"building the control plane failed: {e}", pytrace=False)


@pytest.fixture(scope="session")
def controlplane(
    controlplane_binary: Path, request: pytest.FixtureRequest
) -> Iterator[ControlPlane]:
    # Node objects here have no kubelet behind them: the node-lifecycle controller would mark
    # them NotReady and taint them after its grace period, so it does not run
    cp = ControlPlane(controlplane_binary, extra_args={
        "kube-controller-manager": ["--controllers=*,-node-lifecycle-controller"]})
    request.addfinalizer(cp.stop)
    try:
        cp.start()
    except ControlPlaneError as e:
        pytest.fail(f"starting the control plane failed: {e}", pytrace=False)
    times = ", ".join(f"{k} {v:.1f}s" for k, v in cp.startup_seconds.items())
    print(f"\ncontrol plane up at {cp.server} ({times}); work dir {cp.workdir}", file=sys.stderr)
    if os.environ.get("SHAREGPU_E2E_VERBOSE"):
        print(cp.describe(), file=sys.stderr)
    yield cp
    cp.check_alive()


@pytest.fixture(scope="session")
def admin(controlplane: ControlPlane) -> Client:
    """A lightkube client with the admin (system:masters) kubeconfig."""
    return Client(KubeConfig.from_file(controlplane.admin_kubeconfig))


@pytest.fixture(scope="session")
def real_cluster(controlplane_binary: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The control plane with kube-proxy, the cluster DNS stand-in and one real node
    (``sharegpu-node-0``: kubelet + containerd, GPU node in cgpu mode with two fake T4s); see
    realnode.py. Builds its tools first (a no-op when up to date). A piece that cannot be built
    or started FAILS the tests."""
    from .realnode import NodeError, RealNodeCluster

    cluster = RealNodeCluster(controlplane_binary, [
        ("sharegpu-node-0", {"ack.node.gpu.schedule": "cgpu"}, "Tesla T4:15109,Tesla T4:15109"),
    ])
    request.addfinalizer(cluster.stop)
    try:
        cluster.start()
    except (NodeError, ControlPlaneError, OSError, subprocess.SubprocessError) as e:
        pytest.fail(f"starting the real-node cluster failed: {e}", pytrace=False)
    times = ", ".join(f"{k} {v:.1f}s" for k, v in cluster.seconds.items())
    print(f"\nreal-node cluster up ({times}); work dir {cluster.workdir}", file=sys.stderr)
    yield cluster
    cluster.cp.check_alive()


@pytest.fixture(scope="session")
def real_release(real_cluster: Any) -> Any:
    """``real_cluster`` with charts/sharegpu installed by helm (nodepods.install_release): every
    pod of the release Running and Ready on the real node."""
    from .nodepods import install_release

    real_cluster.seconds["helm-install-ready"] = install_release(real_cluster)
    return real_cluster
