"""Components log what they decide at INFO; every HTTP request they make (API calls, Lease
renewals) only at DEBUG; the webhook names the pod it refused."""

from __future__ import annotations

import logging

import pytest

from sharegpu.core.errors import ValidationError
from sharegpu.kubeio.logs import configure


def test_client_request_lines_only_at_debug():
    configure("INFO")
    assert logging.getLogger("httpx2").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
    configure("DEBUG")
    assert logging.getLogger("httpx2").getEffectiveLevel() == logging.DEBUG
    with pytest.raises(ValidationError, match="--log-level"):
        configure("LOUD")


async def test_webhook_logs_the_pod_it_refused(caplog):
    from aiohttp.test_utils import TestClient, TestServer

    from sharegpu.webhook import app
    from sharegpu_testing import kobjects

    pod = kobjects.pod("greedy", mem=4, core=33, namespace="team-a")
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE",
                          "namespace": "team-a", "name": "greedy",
                          "userInfo": {"username": "alice"}, "object": pod}}
    caplog.set_level(logging.INFO, logger="sharegpu.webhook")
    async with TestClient(TestServer(app())) as client:
        r = await client.post("/validate", json=review)
        assert (await r.json())["response"]["allowed"] is False
    (line,) = [r.getMessage() for r in caplog.records if r.name == "sharegpu.webhook"]
    assert line.startswith("refused pod team-a/greedy (from alice): ")
    assert "gpu-core.percentage" in line
