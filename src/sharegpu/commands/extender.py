"""``sharegpu extender``: the kube-scheduler extender (filter, prioritize, bind)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import ssl
from dataclasses import dataclass

import httpx2 as httpx

from ..core.errors import ValidationError
from .argtypes import positive_float

NAME = "extender"
HELP = "run the kube-scheduler extender (filter, prioritize, bind)"


def listen_address(text: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValidationError(flag, text, "must be HOST:PORT with a port from 0 to 65535")
    return host or "0.0.0.0", int(port)


def ssl_context(
    cert: str | None, key: str | None, *, required: bool = False, client_ca: str | None = None
) -> ssl.SSLContext | None:
    """The server's context; with ``client_ca``, every client must present a certificate
    signed by that CA (and only by it: no system CA is trusted for clients), or the handshake
    fails before any request is read."""
    if bool(cert) != bool(key):
        raise ValidationError("--tls-cert/--tls-key", cert or key, "give both or neither")
    if not cert:
        if required:
            raise ValidationError("--tls-cert", None, "is required (or --insecure for tests)")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValidationError(
            "--tls-cert", cert, f"cannot load the certificate and key (--tls-key={key!r}): {e}; "
            "give a readable PEM certificate and its key"
        ) from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as e:
            raise ValidationError(
                "--tls-client-ca", client_ca, f"cannot load the CA certificate: {e}; give the "
                "CA that signs the callers' client certificates (the chart mounts ca.crt)"
            ) from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: str | None, flag: str = "--tls-ca") -> ssl.SSLContext:
    """A client context that trusts only ``ca`` (PEM) and checks the server's name."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ValidationError(flag, ca, f"cannot load the CA certificate: {e}; give the CA "
                              "that signed --tls-cert (the chart mounts it as ca.crt)") from None
    return ctx


def handshake_in_memory(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> None:
    """A TLS handshake in memory: ``client`` verifying ``server``'s certificate under ``name``
    and, where ``server`` asks for one, ``server`` verifying the client's. Raises the
    ssl.SSLError of the end that refused, with ``side`` set on it: "client" (the server's
    certificate did not verify) or "server" (the client's certificate was refused)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname=name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for side, end in (("client", c), ("server", s)):
            if not done[side]:
                try:
                    end.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError as e:
                    e.side = side  # type: ignore[attr-defined]
                    raise
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done["client"] and done["server"]:
            return
    raise ssl.SSLError("the handshake did not complete")


@dataclass(frozen=True)
class Tls:
    server: ssl.SSLContext | None  # None: plain HTTP (--insecure)
    # verifies the leader when a follower forwards a bind, and presents this replica's
    # certificate to it
    peer: ssl.SSLContext | None
    server_name: str  # the name the replicas' certificate carries (checked when forwarding)


def tls_settings(args: argparse.Namespace) -> Tls:
    """TLS unless ``--insecure``, every caller presenting a client certificate signed by
    ``--tls-client-ca``: the certificate and key must load, and with leader election the CA
    and the server name must verify this replica's own certificate (as a follower will verify
    the leader's) and the client CA must accept it (as the leader will accept a follower's),
    so a wrong Secret is refused at start, not at the first bind."""
    if args.insecure:
        if args.tls_cert or args.tls_key:
            raise ValidationError("--insecure", True, "contradicts --tls-cert/--tls-key: "
                                  "drop --insecure to serve TLS")
        return Tls(None, None, "")
    if not args.tls_cert:
        raise ValidationError("--tls-cert", None, "is required: serve TLS with --tls-cert and "
                              "--tls-key (the chart mounts its certificate), or pass --insecure "
                              "for plain HTTP (development only)")
    server = ssl_context(args.tls_cert, args.tls_key, client_ca=args.tls_client_ca or None)
    if not args.tls_client_ca:
        raise ValidationError("--tls-client-ca", None, "is required with --tls-cert: the verbs "
                              "answer only callers with a client certificate signed by this CA "
                              "(kube-scheduler's; a follower forwarding a bind presents its own "
                              "--tls-cert); the chart mounts ca.crt")
    assert server is not None
    if args.no_leader_election:
        return Tls(server, None, "")
    if not args.tls_ca:
        raise ValidationError("--tls-ca", None, "is required with --tls-cert while leader "
                              "election runs: followers verify the leader's certificate with it "
                              "when they forward binds (the chart mounts ca.crt)")
    if not args.tls_server_name:
        raise ValidationError("--tls-server-name", None, "is required with --tls-cert while "
                              "leader election runs: the DNS name in the certificate that "
                              "followers check the leader against (the chart passes the "
                              "Service's name)")
    peer = client_context(args.tls_ca)
    # a follower forwarding a bind is a caller of the leader's verbs: it presents its own
    peer.load_cert_chain(args.tls_cert, args.tls_key)
    try:
        handshake_in_memory(server, peer, args.tls_server_name)
    except ssl.SSLError as e:
        reason = getattr(e, "verify_message", "") or e.reason or str(e)
        if getattr(e, "side", "") == "server":
            raise ValidationError("--tls-client-ca", args.tls_client_ca,
                                  f"does not accept the certificate in --tls-cert as a client "
                                  f"({reason}): a follower presents it when it forwards a bind; "
                                  "sign it with this CA, for client auth too") from None
        raise ValidationError("--tls-server-name", args.tls_server_name,
                              f"the certificate in --tls-cert does not verify with --tls-ca "
                              f"under this name ({reason}): give the CA that signed it and a "
                              "DNS name it carries") from None
    return Tls(server, peer, args.tls_server_name)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="0.0.0.0:8888", help="HOST:PORT (default 0.0.0.0:8888)")
    p.add_argument("--policy", default="default", help="placement policy (sharegpu policies)")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM); required "
                   "unless --insecure")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--tls-ca", help="the CA (PEM) that signed the replicas' certificate: a "
                   "follower verifies the leader with it when it forwards a bind (required with "
                   "--tls-cert and leader election)")
    p.add_argument("--tls-client-ca", help="the CA (PEM) that signs the certificates of the "
                   "verbs' callers: every connection to --listen must present one, or the "
                   "handshake fails before a request is read (kube-scheduler's client "
                   "certificate; a follower forwarding a bind presents its own --tls-cert). "
                   "Required with --tls-cert")
    p.add_argument("--tls-server-name", help="a DNS name the replicas' certificate carries "
                   "(the Service's): a follower connects to the leader's IP and checks its "
                   "certificate under this name (required with --tls-cert and leader election)")
    p.add_argument("--insecure", action="store_true",
                   help="plain HTTP: the verbs, /bind included, answer anyone who reaches the "
                        "port (development and tests only)")
    p.add_argument("--metrics-listen", default="",
                   help="HOST:PORT of a plain-HTTP port serving only GET /healthz, /readyz and "
                        "/metrics (kubelet probes, Prometheus); no verb is served there "
                        "(default: none; the verb port answers them too)")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else "
                   "in-cluster)")
    p.add_argument("--api-url", help="plain-HTTP API server URL instead of a kubeconfig "
                   "(kubectl proxy, tests)")
    p.add_argument("--lease-namespace", default="kube-system",
                   help="namespace of the leader-election Lease")
    p.add_argument("--lease-name", default="sharegpu-extender",
                   help="name of the leader-election Lease")
    p.add_argument("--id", default=socket.gethostname(),
                   help="replica identity (default: hostname)")
    p.add_argument("--no-leader-election", action="store_true",
                   help="bind without a Lease (a single replica only)")
    p.add_argument("--graded-scores", action="store_true",
                   help="prioritize also scores the other feasible nodes 0..9 in the policy's "
                   "order (for an extender weight low enough to blend with kube-scheduler's "
                   "own scores); by default only the policy's pick scores, 10")
    p.add_argument("--advertise-url", default="",
                   help="where the other replicas reach this one to forward binds while it "
                        "leads (default: http(s)://$POD_IP:PORT when POD_IP is set, else the "
                        "--listen address when it names one)")
    p.add_argument("--max-body-mib", type=int, default=16,
                   help="largest request body accepted (kube-scheduler with nodeCacheCapable "
                        "sends node names: 15,000 nodes take 0.4 MiB; full Node objects need "
                        "much more)")
    p.add_argument("--start-wait", type=positive_float, default=5.0,
                   help="seconds a bind waits for pods starting on its node that the kubelet "
                        "could not tell from it (docs/architecture.md, 'Starting pods'); keep "
                        "it below the scheduler's extender httpTimeout (default 5)")
    p.add_argument("--bind-timeout", type=positive_float, default=7.0,
                   help="seconds from a verb request's first byte to its deadline: a bind "
                        "gives up without binding then (kube-scheduler counts it failed at its "
                        "httpTimeout and places the pod again), and the Binding carries what "
                        "is left as the API server's timeout; keep it at least 1 s below the "
                        "scheduler's extender httpTimeout (kube-scheduler's default: 5 s) and "
                        "above --start-wait (default 7)")
    p.add_argument("--hold-timeout", type=positive_float, default=120.0,
                   help="seconds the node (and GPUs) a filter answered with stay held for the "
                        "pod's bind; then given back (kube-scheduler's Permit and PreBind waits "
                        "fall within it; default 120)")
    p.add_argument("--own-pod", default=None,
                   help="namespace/name of this replica's pod: labelled "
                        "sharegpu.io/extender-serving=true while it serves the verbs (the "
                        "chart's Service selects on it); unset: no label")
    p.add_argument("--scheduler-names", default="ack-co-scheduler",
                   help="schedulerNames whose profiles call this extender, comma-separated: a "
                        "bind of a pod that names another (and that no filter of this replica "
                        "passed) is refused (default ack-co-scheduler; the chart passes "
                        "scheduler.name, or default-scheduler with scheduler.mode=default)")
    p.add_argument("--gpu-pods-only", action="store_true",
                   help="the scheduler sends this extender only pods asking for GPU resources "
                        "(its managedResources: the chart's scheduler.mode=default): a bind of "
                        "any other pod is refused")
    p.add_argument("--dra", action="store_true",
                   help="DRA mode (docs/dra.md): watch resource.k8s.io/v1 ResourceSlices and "
                        "ResourceClaims and rank DRA pods (the chart sets it with "
                        "agent.dra.enabled; it needs list and watch on both)")
    p.add_argument("--check-every", type=float, default=300.0,
                   help="seconds between consistency checks against the pod annotations")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def own_pod(given: str | None) -> str:
    """``--own-pod``: unset (empty), or ``namespace/name`` (both DNS-1123 names)."""
    if not given:
        return ""
    ns, _, name = given.partition("/")
    dns = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
    if not dns.match(ns) or not dns.match(name):
        raise ValidationError("--own-pod", given, "must be namespace/name (DNS-1123 names)")
    return given


def scheduler_names(text: str) -> frozenset[str]:
    """``--scheduler-names``: one or more DNS-1123 subdomains, comma-separated."""
    from ..core.k8snames import dns_subdomain

    found = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not found:
        raise ValidationError("--scheduler-names", text, "must name at least one scheduler "
                              "profile that calls this extender")
    for n in found:
        dns_subdomain("--scheduler-names", n)
    return found


def max_body_bytes(mib: int) -> int:
    if not 1 <= mib <= 4096:
        raise ValidationError("--max-body-mib", mib, "must be 1..4096")
    return mib * 1024 * 1024


def advertise_url(given: str, port: int, tls: bool) -> str:
    """``--advertise-url``, or one made from $POD_IP (the chart sets it) and the port."""
    if given:
        if not given.startswith(("http://", "https://")):
            raise ValidationError("--advertise-url", given, "must be an http:// or https:// URL")
        return given
    ip = os.environ.get("POD_IP", "").strip()
    if not ip or not port:
        return ""
    host = f"[{ip}]" if ":" in ip else ip
    return f"{'https' if tls else 'http'}://{host}:{port}"


async def _start_retrying(replica, host: str, port: int, ctx, stop: asyncio.Event,  # type: ignore[no-untyped-def]
                          probe: tuple[str, int] | None = None) -> bool:
    """Start the replica; while the API server cannot be reached or refuses (not yet up, RBAC
    not yet applied), log one line and try again with back-off (0.5 s doubling to 30 s).
    ``False`` when stopped before it could start."""
    from ..extender.kube import ApiError

    log = logging.getLogger(__name__)
    delay, attempt = 0.5, 0
    while not stop.is_set():
        attempt += 1
        try:
            await replica.start(host, port, ssl_context=ctx, probe=probe)
            return True
        except (ApiError, OSError, httpx.HTTPError) as e:
            log.warning("cannot list the cluster yet (attempt %d: %s: %s); retrying in %.1fs",
                        attempt, type(e).__name__, e, delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        delay = min(delay * 2, 30.0)
    return False


async def _serve(args: argparse.Namespace) -> int:
    from ..core.placement.base import get_policy
    from ..extender.bindscope import BindScope
    from ..extender.kube import KubeApi
    from ..extender.replica import Replica

    get_policy(args.policy)  # a bad name fails here with the list of policies
    host, port = listen_address(args.listen)
    probe = listen_address(args.metrics_listen, "--metrics-listen") if args.metrics_listen \
        else None
    tls = tls_settings(args)
    scope = BindScope(scheduler_names(args.scheduler_names), gpu_only=args.gpu_pods_only)
    ctx = tls.server
    api = KubeApi.from_url(args.api_url) if args.api_url else KubeApi.from_config(args.kubeconfig)
    replica = Replica(api, identity=args.id, policy=args.policy,
                      lease_namespace=args.lease_namespace, lease_name=args.lease_name,
                      elect=not args.no_leader_election, check_every=args.check_every,
                      graded_scores=args.graded_scores,
                      advertise_url=advertise_url(args.advertise_url, port, ctx is not None),
                      http_limits={"max_body": max_body_bytes(args.max_body_mib)},
                      forward_tls=tls.peer, forward_server_name=tls.server_name,
                      start_wait=args.start_wait, bind_timeout=args.bind_timeout,
                      hold_timeout=args.hold_timeout, own_pod=own_pod(args.own_pod),
                      dra=args.dra, bind_scope=scope)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if not await _start_retrying(replica, host, port, ctx, stop, probe):
        await api.close()
        return 0
    logging.getLogger(__name__).info(
        "sharegpu extender %s listening on %s:%d (%s)%s", args.id, host, replica.port,
        "TLS" if ctx is not None else "plain HTTP: --insecure",
        f"; health and metrics on {probe[0]}:{replica.probe_port}" if probe else "")
    await stop.wait()
    await replica.stop()
    await api.close()
    return 0


def run(args: argparse.Namespace) -> int:
    from ..kubeio.logs import configure as configure_logging

    configure_logging(args.log_level)
    return asyncio.run(_serve(args))
