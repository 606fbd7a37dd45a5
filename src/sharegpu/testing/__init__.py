"""Test doubles for sharegpu's cluster adapters (need the ``test`` extra: aiohttp).

- :class:`~sharegpu.testing.fakeapi.FakeApiServer`: a fake Kubernetes API server on 127.0.0.1.
- :mod:`sharegpu.testing.fixtures`: pytest fixtures (``fake_api``, ``fake_api_factory``).
"""

from .fakeapi import FakeApiServer, RequestRecord
from .faults import FaultRule, Faults
from .status import StatusError

__all__ = ["FakeApiServer", "FaultRule", "Faults", "RequestRecord", "StatusError"]
