"""``sharegpu webhook``: the admission webhook for GPU requests (validating; mutating for DRA
pods and, opt-in, for the schedulerName of GPU-sharing pods)."""

from __future__ import annotations

import argparse
import re

from ..core.errors import ValidationError
from .extender import listen_address, ssl_context

NAME = "webhook"
HELP = ("run the admission webhook that refuses bad GPU requests (and, in DRA mode, turns "
        "ACK's GPU requests into ResourceClaims)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="0.0.0.0:9443", help="HOST:PORT (default 0.0.0.0:9443)")
    p.add_argument("--tls-cert", help="certificate (PEM); required unless --insecure")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--insecure", action="store_true", help="plain HTTP (tests only)")
    p.add_argument("--gpu-schedulers", default="ack-co-scheduler",
                   help="schedulerNames that run the sharegpu extender, comma-separated; a pod "
                        "asking for aliyun.com/gpu-mem, gpu-core.percentage or aliyun.com/gpu "
                        "with another is refused ('' turns the check off; default "
                        "ack-co-scheduler)")
    p.add_argument("--set-scheduler-name", default="",
                   help="on /mutate, give a pod asking for aliyun.com/gpu-mem, "
                        "gpu-core.percentage or aliyun.com/gpu that names the default scheduler "
                        "(or none) this schedulerName; other pods are left alone (default '': "
                        "off; must be one of --gpu-schedulers)")
    p.add_argument("--dra-label", default="",
                   help="KEY=VALUE: the DRA node pool's label; GPU pods whose nodeSelector or "
                        "required node affinity names it get ResourceClaims on /mutate (the "
                        "webhook then creates ResourceClaimTemplates; default '': DRA mode off, "
                        "no API access)")
    p.add_argument("--dra-device-class", default="gpu.sharegpu.io",
                   help="the DeviceClass the claims name (default gpu.sharegpu.io)")
    p.add_argument("--kubeconfig", default=None,
                   help="with --dra-label: kubeconfig file (default: in-cluster, else "
                        "$KUBECONFIG)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def scheduler_name(text: str, schedulers: frozenset[str]) -> str | None:
    """``--set-scheduler-name``: ``None`` when off; a DNS subdomain that the validating check
    accepts (one of ``--gpu-schedulers``, when that check is on)."""
    name = text.strip()
    if not name:
        return None
    if not _NAME.fullmatch(name):
        raise ValidationError("--set-scheduler-name", text,
                              "must be a scheduler name (lower-case DNS subdomain)")
    if schedulers and name not in schedulers:
        raise ValidationError("--set-scheduler-name", text,
                              f"must be one of --gpu-schedulers ({','.join(sorted(schedulers))}):"
                              " pods sent to another scheduler would then be refused")
    return name


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from ..dra.draclaims import Pool
    from ..kubeio.logs import configure as configure_logging
    from ..webhook import LightkubeTemplates, app

    configure_logging(args.log_level)
    host, port = listen_address(args.listen)
    ctx = None if args.insecure else ssl_context(args.tls_cert, args.tls_key, required=True)
    schedulers = frozenset(n.strip() for n in args.gpu_schedulers.split(",") if n.strip())
    set_scheduler = scheduler_name(args.set_scheduler_name, schedulers)
    pool = store = None
    if args.dra_label:
        from lightkube import AsyncClient

        from ..kubeio.kubeconfig import load

        pool = Pool.parse(args.dra_label, args.dra_device_class)
        store = LightkubeTemplates(AsyncClient(load(args.kubeconfig, field="--kubeconfig")))
    web.run_app(app(schedulers or None, pool, store, set_scheduler), host=host, port=port,
                ssl_context=ctx, access_log=None, print=None)
    return 0
