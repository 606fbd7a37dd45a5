"""Pytest fixtures for the fake Kubernetes API server.

Use from a test suite's ``conftest.py``::

    from sharegpu_testing.fixtures import fake_api, fake_api_factory  # noqa: F401

``fake_api`` is a started :class:`~sharegpu_testing.fakeapi.FakeApiServer` (background thread,
so sync and async tests alike can use it); ``fake_api_factory(**options)`` starts more, or
with options (``history_size``, ``seed``, ``bookmark_interval``, ``watch_timeout``,
``graceful_pod_deletion``, ``strict_namespaces``, ``kubelet_start_s``: by default every node's
kubelet and agent start a bound pod 20 ms after its binding; ``None`` for no kubelets). All are
stopped at the end of the test.
``fake_api_env`` is ``fake_api`` with ``$KUBECONFIG`` pointing at it for the test, for code
that finds its cluster the default way (in-cluster, else ``$KUBECONFIG``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .fakeapi import FakeApiServer


@pytest.fixture
def fake_api_factory() -> Iterator[Callable[..., FakeApiServer]]:
    started: list[FakeApiServer] = []

    def make(**options: Any) -> FakeApiServer:
        options.setdefault("kubelet_start_s", 0.02)
        server = FakeApiServer(**options).start()
        started.append(server)
        return server

    yield make
    for server in reversed(started):
        server.stop()


@pytest.fixture
def fake_api(fake_api_factory: Callable[..., FakeApiServer]) -> FakeApiServer:
    return fake_api_factory()


@pytest.fixture
def fake_api_env(fake_api: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> FakeApiServer:
    monkeypatch.setenv("KUBECONFIG", str(fake_api.kubeconfig_path))
    return fake_api
