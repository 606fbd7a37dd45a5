"""Test doubles for sharegpu's cluster adapters (need the ``test`` extra: aiohttp, cryptography).

- :class:`~sharegpu_testing.fakeapi.FakeApiServer`: a fake Kubernetes API server on 127.0.0.1.
- :mod:`sharegpu_testing.fixtures`: pytest fixtures (``fake_api``, ``fake_api_factory``,
  ``fake_api_env``).
- :func:`~sharegpu_testing.tls.make_certificates`: a throwaway CA and server certificate.
"""

from .fakeapi import FakeApiServer, RequestRecord
from .faults import FaultRule, Faults
from .status import StatusError
from .tls import CertificateFiles, make_certificates

__all__ = [
    "CertificateFiles",
    "FakeApiServer",
    "FaultRule",
    "Faults",
    "RequestRecord",
    "StatusError",
    "make_certificates",
]
