"""One order for finding the cluster, in every component and CLI (the extender, the agent and
``kubectl inspect cgpu`` all load through :func:`sharegpu.kubeio.kubeconfig.load`):
``--kubeconfig``,
else ``$KUBECONFIG``, else ``~/.kube/config``, else the in-cluster service account — kubectl's
order, and the one the docs state."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharegpu.core.errors import ValidationError
from sharegpu.inspect_cgpu.source import kubeconfig_path
from sharegpu.kubeio import kubeconfig as kc

ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, server: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""apiVersion: v1
kind: Config
current-context: c
contexts: [{{name: c, context: {{cluster: k, user: u}}}}]
clusters: [{{name: k, cluster: {{server: "{server}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
""")
    return path


def server(cfg) -> str:
    return cfg.get().cluster.server


@pytest.fixture
def places(tmp_path, monkeypatch):
    home = tmp_path / "home"
    write(home / ".kube" / "config", "https://home.test:6443")
    env = write(tmp_path / "env.yaml", "https://env.test:6443")
    flag = write(tmp_path / "flag.yaml", "https://flag.test:6443")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("KUBECONFIG", str(env))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # as in a pod
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    return home, env, flag


def test_the_flag_then_the_env_then_home_then_in_cluster(places, monkeypatch):
    home, env, flag = places
    assert server(kc.load(str(flag))) == "https://flag.test:6443"
    assert server(kc.load()) == "https://env.test:6443"  # even in a pod
    assert kubeconfig_path() == str(env)
    monkeypatch.delenv("KUBECONFIG")
    assert server(kc.load()) == "https://home.test:6443"
    assert kubeconfig_path() == str(home / ".kube" / "config")
    (home / ".kube" / "config").unlink()
    assert kubeconfig_path() is None
    with pytest.raises(ValidationError) as e:  # no service account here: a clear refusal
        kc.load()
    assert "(in-cluster)" in str(e.value)


def test_the_docs_state_that_order():
    order = "`--kubeconfig`, else `$KUBECONFIG`, else `~/.kube/config`, else the in-cluster"
    for doc in ("README.md", "docs/quickstart.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert order in text, doc
    assert kc.ORDER == "--kubeconfig, else $KUBECONFIG, else ~/.kube/config, else in-cluster"
