"""The extender over TLS (issue 13, item 6): the verbs are served only over TLS, with a
certificate for the extender Service's DNS names; health and metrics also on a plain-HTTP port
that answers no verb; a follower forwards binds to the leader's pod IP and verifies the leader's
certificate with the CA under the Service's name (no IP in the certificate, nothing unverified);
``sharegpu extender`` refuses to start without a certificate, or with one its CA and server name
do not verify, in one line naming the flag and the fix."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sharegpu.cli import main
from sharegpu.commands.extender import ssl_context
from sharegpu.extender.kube import KubeApi
from sharegpu.extender.replica import Replica
from sharegpu_testing import kobjects
from sharegpu_testing.tls import CertificateFiles, make_certificates

SERVICE = "sharegpu-extender.gpu-system.svc"  # the name the chart's certificate carries
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def tls(tmp_path: Path) -> CertificateFiles:
    # DNS names only, as the chart's certificate: no IP address to match 127.0.0.1
    return make_certificates(tmp_path / "pki", hosts=(SERVICE, "sharegpu-extender"))


def server_ctx(files: CertificateFiles) -> ssl.SSLContext:
    """As ``sharegpu extender`` serves: its certificate, and callers' certificates required,
    signed by the CA."""
    ctx = ssl_context(str(files.cert), str(files.key), client_ca=str(files.ca_cert))
    assert ctx is not None
    return ctx


def client_ctx(ca: Path | None, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    """Trusts ``ca``; presents ``cert`` (certificate, key) when given."""
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def scheduler_ctx(files: CertificateFiles) -> ssl.SSLContext:
    """kube-scheduler's: the CA, and its client certificate."""
    return client_ctx(files.ca_cert, (files.client_cert, files.client_key))


def replica(fake: Any, name: str, files: CertificateFiles | None, ca: Path | None = None,
            server_name: str = SERVICE, own: CertificateFiles | None = None) -> Replica:
    """A replica whose forwards trust ``ca`` (default: ``files``' CA) and present ``own``'s
    serving certificate (default: ``files``')."""
    own = own or files
    return Replica(KubeApi.from_url(fake.url), identity=name, check_every=0,
                   forward_tls=client_ctx(ca or (files.ca_cert if files else None),
                                          (own.cert, own.key) if own else None),
                   forward_server_name=server_name)


async def raw_request(port: int, request: bytes, ctx: ssl.SSLContext | None = None,
                      server_hostname: str | None = None) -> bytes:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname=server_hostname if ctx else None), 5)
    writer.write(request)
    try:
        return await asyncio.wait_for(reader.read(65536), 5)
    except (ConnectionError, ssl.SSLError):
        return b""
    finally:
        writer.close()


def post(path: str, body: Any) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


def test_verbs_only_over_tls_and_the_probe_port_answers_no_verb(
        fake_api: Any, tls: CertificateFiles) -> None:
    fake_api.create(kobjects.node("n1", [16, 16], "cgpu"))
    filt = post("/filter", {"Pod": kobjects.pod("p", mem=4), "NodeNames": ["n1"]})

    async def go() -> None:
        r = replica(fake_api, "a", tls)
        await r.start("127.0.0.1", 0, server_ctx(tls), probe=("127.0.0.1", 0))
        try:
            assert r.elector is not None and r.elector.url == f"https://127.0.0.1:{r.port}"
            for _ in range(500):  # the verbs are served once it leads
                if r.serves_verbs():
                    break
                await asyncio.sleep(0.02)
            # with the CA and the client certificate, verified under the Service's name
            # (connected by IP): served
            ok = await raw_request(r.port, filt, scheduler_ctx(tls), SERVICE)
            assert ok.startswith(b"HTTP/1.1 200") and b'"NodeNames":["n1"]' in ok, ok
            # without the CA (the system's trust store): the handshake fails
            with pytest.raises(ssl.SSLCertVerificationError):
                await raw_request(r.port, filt, client_ctx(None), SERVICE)
            # with the CA but under a name the certificate does not carry (the IP): fails
            with pytest.raises(ssl.SSLCertVerificationError):
                await raw_request(r.port, filt, scheduler_ctx(tls), "127.0.0.1")
            # plain HTTP to the TLS port: no HTTP answer at all, nothing decided
            for verb in ("/filter", "/prioritize", "/bind"):
                assert not (await raw_request(r.port, post(verb, {}))).startswith(b"HTTP/"), verb
            # the plain probe port: health and metrics, and no verb
            for path in ("/healthz", "/readyz", "/metrics"):
                got = await raw_request(r.probe_port, get(path))
                assert got.startswith(b"HTTP/1.1 200"), (path, got[:200])
            for verb in ("/filter", "/prioritize", "/bind"):
                got = await raw_request(r.probe_port, post(verb, {}))
                assert got.startswith(b"HTTP/1.1 404"), (verb, got[:200])
            assert fake_api.get("pods", "p", "default") is None
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())


async def answered(port: int, request: bytes, ctx: ssl.SSLContext) -> bytes:
    """What the server answers a TLS client (b"": the handshake or the connection refused)."""
    try:
        return await raw_request(port, request, ctx, SERVICE)
    except (ConnectionError, ssl.SSLError):
        return b""


def test_no_verb_answers_a_caller_without_a_client_certificate_of_the_ca(
        fake_api: Any, tls: CertificateFiles, tmp_path: Path) -> None:
    """Mutual TLS on the verb port: a caller that trusts the extender but presents no client
    certificate, or one signed by another CA, gets no HTTP answer on any verb (nor on the
    GETs there); nothing is decided: no pick held, no pod bound. kube-scheduler's certificate,
    and the extender's own (a follower forwarding a bind), are served."""
    fake_api.create(kobjects.node("n1", [16, 16], "cgpu"))
    fake_api.create(kobjects.pod("p", mem=4))
    stored = fake_api.get("pods", "p", "default")
    m = stored["metadata"]
    other = make_certificates(tmp_path / "other", hosts=(SERVICE,))
    requests = {
        "/filter": post("/filter", {"Pod": stored, "NodeNames": ["n1"]}),
        "/prioritize": post("/prioritize", {"Pod": stored, "NodeNames": ["n1"]}),
        "/bind": post("/bind", {"PodName": "p", "PodNamespace": "default", "PodUID": m["uid"],
                                "Node": "n1"}),
        "/readyz": get("/readyz"),
    }
    strangers = {
        "no certificate": client_ctx(tls.ca_cert),
        "another CA's client certificate": client_ctx(
            tls.ca_cert, (other.client_cert, other.client_key)),
        "another CA's server certificate": client_ctx(tls.ca_cert, (other.cert, other.key)),
    }

    async def go() -> None:
        r = replica(fake_api, "a", tls)
        await r.start("127.0.0.1", 0, server_ctx(tls))
        try:
            t0 = time.monotonic()
            while not r.is_ready():
                assert time.monotonic() - t0 < 20
                await asyncio.sleep(0.02)
            for who, ctx in strangers.items():
                for verb, request in requests.items():
                    got = await answered(r.port, request, ctx)
                    assert got == b"", (who, verb, got[:200])
            assert r.view.inflight == {} and len(r.view.picks) == 0
            assert not fake_api.get("pods", "p", "default")["spec"].get("nodeName")
            assert r.metrics.latency.labels("filter")._sum.get() == 0
            # the replicas' own certificate is a caller too (a follower's forward)
            own = client_ctx(tls.ca_cert, (tls.cert, tls.key))
            got = await answered(r.port, requests["/readyz"], own)
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
            got = await answered(r.port, requests["/bind"], scheduler_ctx(tls))
            assert got.startswith(b"HTTP/1.1 200") and b'"Error":""' in got, got[:300]
            assert fake_api.get("pods", "p", "default")["spec"]["nodeName"] == "n1"
        finally:
            await r.stop()
            await r.api.close()

    asyncio.run(go())


def test_follower_forwards_binds_to_the_leader_over_tls_by_ip(
        fake_api_factory: Any, tls: CertificateFiles, tmp_path: Path) -> None:
    """The leader publishes https://127.0.0.1:PORT (its pod IP) on the Lease; its certificate
    names only the Service. The follower connects to the IP, verifies the Service's name with the
    CA and binds through the leader, presenting its own certificate as a client. A follower
    with another CA, checking another name, or presenting a certificate the leader's client CA
    did not sign, forwards nothing: the bind is answered with an Error and the pod stays
    unbound."""
    fake = fake_api_factory()
    fake.create(kobjects.node("n1", [16, 16], "cgpu"))
    pods = [kobjects.pod(f"p{i}", mem=4) for i in range(4)]
    for p in pods:
        fake.create(p)
    pods = [fake.get("pods", p["metadata"]["name"], "default") for p in pods]
    other = make_certificates(tmp_path / "other", hosts=(SERVICE,))

    def bind_args(p: dict[str, Any]) -> dict[str, Any]:
        m = p["metadata"]
        return {"PodName": m["name"], "PodNamespace": "default", "PodUID": m["uid"],
                "Node": "n1"}

    async def go() -> None:
        a = replica(fake, "a", tls)
        followers = {"b": replica(fake, "b", tls),
                     "wrong-ca": replica(fake, "wrong-ca", tls, ca=other.ca_cert),
                     "wrong-name": replica(fake, "wrong-name", tls, server_name="127.0.0.1"),
                     "wrong-cert": replica(fake, "wrong-cert", tls, own=other)}
        await a.start("127.0.0.1", 0, server_ctx(tls))
        t0 = time.monotonic()
        while not a.is_leader():
            assert time.monotonic() - t0 < 20
            await asyncio.sleep(0.02)
        for f in followers.values():
            await f.start("127.0.0.1", 0, server_ctx(tls))
        leader_url = f"https://127.0.0.1:{a.port}"
        client = scheduler_ctx(tls)
        conn = aiohttp.TCPConnector(ssl=client)
        try:
            async with aiohttp.ClientSession(connector=conn) as s:
                t0 = time.monotonic()
                while not all(f.elector is not None and f.elector.holder_url == leader_url
                              and f.view.synced for f in followers.values()):
                    assert time.monotonic() - t0 < 20, "followers never saw the leader's URL"
                    await asyncio.sleep(0.02)

                async def bind(f: Replica, p: dict[str, Any]) -> str:
                    async with s.post(f"https://127.0.0.1:{f.port}/bind", json=bind_args(p),
                                      server_hostname=SERVICE) as r:
                        assert r.status == 200
                        return str((await r.json())["Error"])

                assert await bind(followers["b"], pods[0]) == ""
                assert followers["b"].forwarded == 1
                assert fake.get("pods", "p0", "default")["spec"]["nodeName"] == "n1"
                err = await bind(followers["wrong-ca"], pods[1])
                assert "did not answer (ConnectError)" in err, err
                err = await bind(followers["wrong-name"], pods[2])
                assert "did not answer (ConnectError)" in err, err
                # a follower whose certificate the leader's client CA did not sign: refused
                err = await bind(followers["wrong-cert"], pods[3])
                assert "did not answer" in err, err
                for p in ("p1", "p2", "p3"):
                    assert not fake.get("pods", p, "default")["spec"].get("nodeName"), p
                assert followers["wrong-ca"].forwarded == followers["wrong-name"].forwarded == 0
                assert followers["wrong-cert"].forwarded == 0
        finally:
            for r in (a, *followers.values()):
                await r.stop()
                await r.api.close()

    asyncio.run(go())


# --- the command refuses what would serve without TLS or forward unverified -----------------


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


API = ["--api-url", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"]


def test_extender_refuses_to_start_without_tls(capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(["extender", *API], capsys)
    assert line.startswith("sharegpu extender: error: --tls-cert=None: is required: serve TLS "
                           "with --tls-cert and --tls-key"), line
    assert "--insecure" in line


def test_extender_refuses_a_missing_or_unreadable_certificate(
        tmp_path: Path, tls: CertificateFiles, capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(["extender", *API, "--tls-cert", str(tmp_path / "no.crt"),
                    "--tls-key", str(tmp_path / "no.key")], capsys)
    assert f"--tls-cert='{tmp_path / 'no.crt'}': cannot load the certificate and key" in line
    assert "No such file" in line and "give a readable PEM certificate" in line
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    line = refusal(["extender", *API, "--tls-cert", str(garbage), "--tls-key", str(tls.key)],
                   capsys)
    assert "cannot load the certificate and key" in line
    line = refusal(["extender", *API, "--tls-cert", str(tls.cert)], capsys)
    assert "give both or neither" in line
    line = refusal(["extender", *API, "--insecure", "--tls-cert", str(tls.cert),
                    "--tls-key", str(tls.key)], capsys)
    assert "--insecure=True: contradicts --tls-cert/--tls-key" in line


def test_extender_refuses_tls_a_follower_could_not_verify(
        tmp_path: Path, tls: CertificateFiles, capsys: pytest.CaptureFixture[str]) -> None:
    cert = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    line = refusal(["extender", *API, *cert], capsys)
    assert "--tls-client-ca=None: is required with --tls-cert: the verbs answer only callers " \
           "with a client certificate signed by this CA" in line, line
    cert += ["--tls-client-ca", str(tls.ca_cert)]
    line = refusal(["extender", *API, *cert], capsys)
    assert "--tls-ca=None: is required with --tls-cert while leader election runs" in line
    line = refusal(["extender", *API, *cert, "--tls-ca", str(tls.ca_cert)], capsys)
    assert "--tls-server-name=None: is required" in line
    line = refusal(["extender", *API, *cert, "--tls-ca", str(tmp_path / "none.crt"),
                    "--tls-server-name", SERVICE], capsys)
    assert "--tls-ca=" in line and "cannot load the CA certificate" in line
    other = make_certificates(tmp_path / "other", hosts=(SERVICE,))
    line = refusal(["extender", *API, *cert, "--tls-ca", str(other.ca_cert),
                    "--tls-server-name", SERVICE], capsys)
    assert f"--tls-server-name='{SERVICE}': the certificate in --tls-cert does not verify " \
           "with --tls-ca under this name" in line, line
    line = refusal(["extender", *API, *cert, "--tls-ca", str(tls.ca_cert),
                    "--tls-server-name", "other.gpu-system.svc"], capsys)
    assert "does not verify with --tls-ca under this name" in line, line


def test_extender_refuses_a_client_ca_its_own_forwards_would_fail(
        tmp_path: Path, tls: CertificateFiles, capsys: pytest.CaptureFixture[str]) -> None:
    """The client CA must load, and must accept the replica's own certificate: a follower
    presents it to the leader when it forwards a bind."""
    cert = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca",
            str(tls.ca_cert), "--tls-server-name", SERVICE]
    line = refusal(["extender", *API, *cert, "--tls-client-ca", str(tmp_path / "none.crt")],
                   capsys)
    assert "--tls-client-ca=" in line and "cannot load the CA certificate" in line, line
    other = make_certificates(tmp_path / "other", hosts=(SERVICE,))
    line = refusal(["extender", *API, *cert, "--tls-client-ca", str(other.ca_cert)], capsys)
    assert f"--tls-client-ca='{other.ca_cert}': does not accept the certificate in --tls-cert " \
           "as a client" in line, line
    # a serving certificate without client auth in its key usage is refused the same way
    server_only = make_certificates(tmp_path / "server-only", hosts=(SERVICE,),
                                    client_auth=False)
    line = refusal(["extender", *API, "--tls-cert", str(server_only.cert), "--tls-key",
                    str(server_only.key), "--tls-ca", str(server_only.ca_cert),
                    "--tls-server-name", SERVICE, "--tls-client-ca",
                    str(server_only.ca_cert)], capsys)
    assert "does not accept the certificate in --tls-cert as a client" in line, line


def test_refusal_is_one_line_from_the_real_process() -> None:
    code = "import sys\nfrom sharegpu.cli import main\nsys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "extender", *API], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert line.startswith("sharegpu extender: error: --tls-cert=None: is required")


def test_insecure_serves_plain_http_on_request(fake_api: Any) -> None:
    """The opt-out: plain HTTP only when asked for by name (development and tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "import sys\nfrom sharegpu.cli import main\nsys.exit(main(sys.argv[1:]))"
    p = subprocess.Popen([sys.executable, "-c", code, "extender", "--api-url", fake_api.url,
                          "--listen", f"127.0.0.1:{port}", "--insecure",
                          "--no-leader-election"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    try:
        import urllib.request

        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() - t0 < 30 and p.poll() is None
            time.sleep(0.1)
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=20)
    assert b"plain HTTP: --insecure" in out, out
