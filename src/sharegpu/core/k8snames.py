"""Kubernetes object names (RFC 1123), checked before a name is put into an API path."""

from __future__ import annotations

import re

from .errors import ValidationError

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SUBDOMAIN_MAX = 253


def dns_label(field: str, value: str) -> str:
    """``value`` when it is a DNS-1123 label (a namespace's name), else ValidationError."""
    if not _LABEL.fullmatch(value):
        raise ValidationError(field, value, "must be a DNS-1123 label: at most 63 characters "
                              "of a-z, 0-9 and '-', starting and ending with a letter or digit")
    return value


def dns_subdomain(field: str, value: str) -> str:
    """``value`` when it is a DNS-1123 subdomain (a pod's or a node's name), else
    ValidationError."""
    if len(value) > _SUBDOMAIN_MAX or not all(_LABEL.fullmatch(p) for p in value.split(".")):
        raise ValidationError(field, value, "must be a DNS-1123 subdomain: at most 253 "
                              "characters, labels of a-z, 0-9 and '-' (each starting and ending "
                              "with a letter or digit) joined by '.'")
    return value
