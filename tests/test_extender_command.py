"""``sharegpu extender`` and ``sharegpu webhook`` as processes: flags, TLS, probes, clean stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sharegpu.cli import main
from sharegpu_testing import kobjects
from sharegpu_testing.tls import make_certificates


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ok(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(url)
        time.sleep(0.1)


def post(url: str, body: Any, ctx: ssl.SSLContext | None = None) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
        return json.loads(r.read())


def certs(tmp_path: Path) -> tuple[Path, Path, ssl.SSLContext]:
    """The server's certificate and key, and a client trusting the CA and presenting a client
    certificate it signed (the extender requires one; the webhook ignores it)."""
    files = make_certificates(tmp_path)
    client = ssl.create_default_context(cafile=str(files.ca_cert))
    client.load_cert_chain(files.client_cert, files.client_key)
    return files.cert, files.key, client


def ca_of(crt: Path) -> Path:
    return crt.parent / "ca.crt"  # make_certificates writes it beside the certificate


def spawn(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "sharegpu.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def stop(p: subprocess.Popen[bytes]) -> tuple[int, str]:
    p.send_signal(signal.SIGTERM)
    try:
        out, _ = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    return p.returncode, out.decode()


def test_extender_process_over_tls(fake_api: Any, tmp_path: Path) -> None:
    fake_api.create(kobjects.node("gpu-1", [16, 16], "cgpu"))
    crt, key, client = certs(tmp_path)
    port = free_port()
    p = spawn("extender", "--api-url", fake_api.url, "--listen", f"127.0.0.1:{port}",
              "--tls-cert", str(crt), "--tls-key", str(key), "--id", "one",
              "--tls-ca", str(ca_of(crt)), "--tls-server-name", "localhost",
              "--tls-client-ca", str(ca_of(crt)),
              "--lease-namespace", "default")
    try:
        base = f"https://127.0.0.1:{port}"
        wait_ok(f"{base}/readyz", client)  # ready: state rebuilt and the lease held
        f = post(f"{base}/filter", {"Pod": kobjects.pod("p", mem=4), "NodeNames": ["gpu-1"]},
                 client)
        assert f["NodeNames"] == ["gpu-1"] and f["Error"] == ""
        lease = fake_api.get("leases", "sharegpu-extender", "default")
        assert lease["spec"]["holderIdentity"] == "one"
    finally:
        code, out = stop(p)
    assert code == 0, out
    # a clean stop hands the lease back
    assert fake_api.get("leases", "sharegpu-extender", "default")["spec"]["holderIdentity"] == ""


def test_webhook_process_over_tls(tmp_path: Path) -> None:
    crt, key, client = certs(tmp_path)
    port = free_port()
    p = spawn("webhook", "--listen", f"127.0.0.1:{port}", "--tls-cert", str(crt),
              "--tls-key", str(key))
    try:
        base = f"https://127.0.0.1:{port}"
        wait_ok(f"{base}/healthz", client)
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                  "request": {"uid": "u1", "operation": "CREATE", "kind": {"kind": "Pod"},
                              "object": kobjects.pod("p", mem=0)}}
        r = post(f"{base}/validate", review, client)
        assert r["response"]["allowed"] is False
        assert r["response"]["status"]["message"].endswith(
            "must be a whole number of GiB, at least 1")
    finally:
        code, out = stop(p)
    assert code in (0, -signal.SIGTERM), out


@pytest.mark.parametrize(("argv", "needle"), [
    (["extender", "--listen", "nope"], "--listen='nope': must be HOST:PORT"),
    (["extender", "--policy", "bogus", "--api-url", "http://127.0.0.1:9"],
     "policy='bogus': must be one of: default"),
    (["extender", "--tls-cert", "/nonexistent.crt", "--api-url", "http://127.0.0.1:9"],
     "give both or neither"),
    (["webhook", "--listen", "127.0.0.1:0"], "--tls-cert=None: is required"),
])
def test_bad_flags_are_refused_clearly(argv: list[str], needle: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_own_pod_is_namespace_slash_name() -> None:
    from sharegpu.commands.extender import own_pod
    from sharegpu.core.errors import ValidationError

    assert own_pod(None) == "" and own_pod("gpu-system/sharegpu-extender-7d9-x2") == \
        "gpu-system/sharegpu-extender-7d9-x2"
    for bad in ("no-slash", "$(POD_NAMESPACE)/pod", "ns/Pod_1", "/pod"):
        with pytest.raises(ValidationError, match="--own-pod"):
            own_pod(bad)
