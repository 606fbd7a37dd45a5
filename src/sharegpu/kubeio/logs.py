"""Logging of sharegpu's long-running components: one format, and the HTTP clients' per-request
lines (every API call, every Lease renewal) at DEBUG, so INFO shows what the component decided,
not each request it made."""

from __future__ import annotations

import logging

from ..core.errors import ValidationError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
CLIENT_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "aiohttp.access")


def configure(level: str) -> None:
    name = str(level).upper()
    if name not in LEVELS:
        raise ValidationError("--log-level", level, "must be DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(level=name, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet = logging.DEBUG if name == "DEBUG" else logging.WARNING
    for logger in CLIENT_LOGGERS:
        logging.getLogger(logger).setLevel(quiet)
