"""sharegpu's own components as local processes beside the real control plane, and the chart.

- :class:`SharegpuProcess` runs ``python -m sharegpu.cli <component> ...`` in its own process
  group with the kubeconfig it is given (a ServiceAccount's, so the chart's RBAC applies), logs to
  the control plane's work directory and is killed with it.
- :func:`helm` / :func:`install_chart` drive the real ``helm`` (``.tools/bin/helm``) against the
  real API server with the admin kubeconfig; :func:`chart_docs` renders the chart as
  ``helm template`` does.
- :func:`agent_kubeconfig`: the agent's credentials as its pod has them (a token bound to a
  pod on its node).
- :func:`scheduler_config` is the KubeSchedulerConfiguration the chart renders for its
  ``ack-co-scheduler`` profile, with only the extender's ``urlPrefix`` pointed at a local
  extender (nothing else changed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .controlplane import ControlPlane, _die_with_parent, _kill_group, free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "sharegpu"


class SharegpuProcess:
    def __init__(self, cp: ControlPlane, name: str, args: Sequence[str],
                 env: Mapping[str, str] | None = None) -> None:
        self.cp, self.name, self.args = cp, name, list(args)
        self.log = cp.workdir / f"sharegpu-{name}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.pop("KUBECONFIG", None)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SharegpuProcess:
        argv = [sys.executable, "-m", "sharegpu.cli", *self.args]
        with self.log.open("ab") as out:
            out.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, cwd=ROOT, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None:
            _kill_group(self.proc, grace)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing given up (leases stay held)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_until(self, check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        while not check():
            if not self.alive():
                raise AssertionError(f"sharegpu {self.name} exited before {what}:\n"
                                     f"{self.log_tail()}")
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"sharegpu {self.name}: no {what} after {timeout}s:\n"
                                     f"{self.log_tail()}")
            time.sleep(0.1)

    def wait_http(self, url: str, timeout: float = 60.0, context: Any = None) -> None:
        def ok() -> bool:
            try:
                with urllib.request.urlopen(url, timeout=2, context=context) as r:
                    return r.status == 200
            except (OSError, urllib.error.URLError):
                return False

        self.wait_until(ok, f"200 from {url}", timeout)


def helm_binary() -> str:
    found = shutil.which("helm", path=str(ROOT / ".tools" / "bin")) or shutil.which("helm")
    assert found, "helm is missing: bash scripts/install-tools.sh installs it into .tools/bin"
    return found


def helm(cp: ControlPlane | None, *args: str, timeout: float = 300) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cp.workdir if cp else "/tmp"),
           "KUBECONFIG": str(cp.admin_kubeconfig) if cp else "/nonexistent"}
    r = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    assert r.returncode == 0, f"helm {' '.join(args)} failed:\n{r.stderr}"
    return r.stdout


def _sets(values: Mapping[str, str] | None) -> list[str]:
    out: list[str] = []
    for k, v in (values or {}).items():
        out += ["--set", f"{k}={v}"]
    return out


def chart_docs(namespace: str, values: Mapping[str, str] | None = None,
               kube_version: str = "1.37.2") -> list[dict[str, Any]]:
    out = helm(None, "template", "sharegpu", str(CHART), "-n", namespace,
               "--kube-version", kube_version, *_sets(values))
    return [d for d in yaml.safe_load_all(out) if d]


def install_chart(cp: ControlPlane, namespace: str, release: str = "sharegpu",
                  values: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """``helm install`` into the real API server; the manifest helm applied."""
    helm(cp, "install", release, str(CHART), "-n", namespace, "--create-namespace",
         *_sets(values))
    out = helm(cp, "get", "manifest", release, "-n", namespace)
    return [d for d in yaml.safe_load_all(out) if d]


def scheduler_config(docs: Sequence[Mapping[str, Any]], extender_url: str,
                     client_tls: Path | None = None) -> dict[str, Any]:
    """The chart's KubeSchedulerConfiguration with the extender's urlPrefix set to
    ``extender_url`` (the chart names the in-cluster Service) and, with ``client_tls``, its
    client certificate read from that directory (tls.crt, tls.key) instead of the pod's
    mount."""
    for d in docs:
        if d.get("kind") != "ConfigMap":
            continue
        for text in (d.get("data") or {}).values():
            cfg = yaml.safe_load(text)
            if isinstance(cfg, dict) and cfg.get("kind") == "KubeSchedulerConfiguration":
                for ext in cfg.get("extenders") or []:
                    ext["urlPrefix"] = extender_url
                    tls = ext.get("tlsConfig") or {}
                    if client_tls is not None and "certFile" in tls:
                        tls["certFile"] = str(client_tls / "tls.crt")
                        tls["keyFile"] = str(client_tls / "tls.key")
                return cfg
    raise AssertionError("the chart renders no KubeSchedulerConfiguration")


def local_webhook_args(deployment: Mapping[str, Any], port: int, cert: Any, key: Any) -> list[str]:
    """The chart's webhook container arguments with its listen address and TLS files swapped for
    a webhook process run on this machine (127.0.0.1:``port``, ``cert`` and ``key``)."""
    local = {"--listen": f"--listen=127.0.0.1:{port}", "--tls-cert": f"--tls-cert={cert}",
             "--tls-key": f"--tls-key={key}"}
    return [local.get(a.split("=", 1)[0], a)
            for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]]


def node_object(name: str, *, labels: Mapping[str, str] | None = None,
                annotations: Mapping[str, str] | None = None,
                resources: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A Node with room for pods and a Ready condition (no kubelet is behind it)."""
    from datetime import UTC, datetime

    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    res = {"cpu": "64", "memory": "512Gi", "pods": "110", **(resources or {})}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name,
                     "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                     "annotations": dict(annotations or {})},
        "status": {"capacity": dict(res), "allocatable": dict(res),
                   "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                   "message": "no kubelet behind this Node object",
                                   "lastHeartbeatTime": now, "lastTransitionTime": now}]},
    }


def create_node(client: Any, name: str, **kwargs: Any) -> str:
    """Create the Node (lightkube ``Client``, admin; ``kwargs`` as for :func:`node_object`); see
    :func:`create_node_object`."""
    return create_node_object(client, node_object(name, **kwargs))


def create_node_object(client: Any, obj: Mapping[str, Any]) -> str:
    """Create the Node ``obj`` (lightkube ``Client``, admin) and do what the node-lifecycle
    controller would: lift the ``node.kubernetes.io/not-ready`` taint that admission
    (TaintNodesByCondition) puts on a new Node, when it did."""
    from lightkube.resources.core_v1 import Node
    from lightkube.types import PatchType

    name = obj["metadata"]["name"]
    created = client.create(Node.from_dict(dict(obj)))
    if created.spec is not None and created.spec.taints:
        client.patch(Node, name, {"spec": {"taints": None}}, patch_type=PatchType.MERGE)
    return name


def agent_kubeconfig(cp: ControlPlane, namespace: str, service_account: str, node: str) -> Path:
    """A kubeconfig for the agent of ``node`` as its DaemonSet pod has it: a token of
    ``service_account`` bound to a pod of that ServiceAccount on ``node`` (created here, a
    placeholder no kubelet runs), so it carries the node name the chart's tenant guard reads
    (docs/security.md)."""
    import json

    name = f"{service_account}-{node}"[:63].rstrip("-")
    path = f"/api/v1/namespaces/{namespace}/pods"
    status, body = cp.request("GET", f"{path}/{name}")
    if status == 404:
        status, body = cp.request("POST", path, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "serviceAccountName": service_account,
                     "automountServiceAccountToken": False,
                     "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "agent",
                                     "image": "registry.invalid/sharegpu/pause:never-pulled"}]}})
    assert status in (200, 201), f"the agent's pod {namespace}/{name}: HTTP {status}: {body}"
    return cp.service_account_kubeconfig(namespace, service_account, create=False,
                                         bound_pod=json.loads(body))


T = TypeVar("T")


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 60.0,
             every: float = 0.2) -> T:
    """``fn()``'s first truthy value, asked every ``every`` seconds; an ``ApiError`` counts as
    not yet (it is named if time runs out). Fails the test after ``timeout`` seconds."""
    import pytest
    from lightkube import ApiError

    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = fn()
        except ApiError as e:
            value, last = None, e
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what} (last error: {last})")
        time.sleep(every)


__all__ = ["CHART", "ROOT", "SharegpuProcess", "agent_kubeconfig", "chart_docs", "create_node", "create_node_object",
           "free_port", "helm", "install_chart", "node_object", "scheduler_config", "wait_for"]
