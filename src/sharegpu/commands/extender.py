"""``sharegpu extender``: the kube-scheduler extender (filter, prioritize, bind)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl

import httpx2 as httpx

from ..errors import ValidationError

NAME = "extender"
HELP = "run the kube-scheduler extender (filter, prioritize, bind)"


def listen_address(text: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValidationError(flag, text, "must be HOST:PORT with a port from 0 to 65535")
    return host or "0.0.0.0", int(port)


def ssl_context(
    cert: str | None, key: str | None, *, required: bool = False
) -> ssl.SSLContext | None:
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
            "--tls-cert", cert, f"cannot load the certificate and key: {e}"
        ) from None
    return ctx


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="0.0.0.0:8888", help="HOST:PORT (default 0.0.0.0:8888)")
    p.add_argument("--policy", default="default", help="placement policy (sharegpu policies)")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--kubeconfig", help="default: in-cluster, else $KUBECONFIG")
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
    p.add_argument("--check-every", type=float, default=300.0,
                   help="seconds between consistency checks against the pod annotations")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


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


async def _start_retrying(replica, host: str, port: int, ctx, stop: asyncio.Event) -> bool:  # type: ignore[no-untyped-def]
    """Start the replica; while the API server cannot be reached or refuses (not yet up, RBAC
    not yet applied), log one line and try again with back-off (0.5 s doubling to 30 s).
    ``False`` when stopped before it could start."""
    from ..extender.kube import ApiError

    log = logging.getLogger(__name__)
    delay, attempt = 0.5, 0
    while not stop.is_set():
        attempt += 1
        try:
            await replica.start(host, port, ssl_context=ctx)
            return True
        except (ApiError, OSError, httpx.HTTPError) as e:
            log.warning("cannot list the cluster yet (attempt %d: %s: %s); retrying in %.1fs",
                        attempt, type(e).__name__, e, delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        delay = min(delay * 2, 30.0)
    return False


async def _serve(args: argparse.Namespace) -> int:
    from ..extender.kube import KubeApi
    from ..extender.replica import Replica
    from ..placement.base import get_policy

    get_policy(args.policy)  # a bad name fails here with the list of policies
    host, port = listen_address(args.listen)
    ctx = ssl_context(args.tls_cert, args.tls_key)
    api = KubeApi.from_url(args.api_url) if args.api_url else KubeApi.from_config(args.kubeconfig)
    replica = Replica(api, identity=args.id, policy=args.policy,
                      lease_namespace=args.lease_namespace, lease_name=args.lease_name,
                      elect=not args.no_leader_election, check_every=args.check_every,
                      graded_scores=args.graded_scores,
                      advertise_url=advertise_url(args.advertise_url, port, ctx is not None),
                      http_limits={"max_body": max_body_bytes(args.max_body_mib)})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if not await _start_retrying(replica, host, port, ctx, stop):
        await api.close()
        return 0
    logging.getLogger(__name__).info("sharegpu extender %s listening on %s:%d", args.id, host,
                                     replica.port)
    await stop.wait()
    await replica.stop()
    await api.close()
    return 0


def run(args: argparse.Namespace) -> int:
    from ..logs import configure as configure_logging

    configure_logging(args.log_level)
    return asyncio.run(_serve(args))
