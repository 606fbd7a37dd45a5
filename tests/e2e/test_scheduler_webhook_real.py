"""The REAL kube-apiserver calls ``sharegpu webhook --set-scheduler-name`` (chart
``webhook.setSchedulerName: true``) over TLS, as in test_webhook_real.py: the chart's mutating
hook ``pods.scheduler.sharegpu.io`` and its validating pod hook, registered with only
``clientConfig`` changed to this test's local process.

Shown: a GPU-sharing pod left to the default scheduler is stored with the chart's scheduler and
admitted; a pod naming another scheduler is not rewritten (the validating hook then refuses it);
a pod asking for no GPU or for whole cards is never sent to the mutating hook (the API server's
own metric counts the calls); a quantity with whitespace around it that the API server takes is
never refused by the webhook.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import ssl
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from sharegpu_testing.tls import make_certificates

from .components import SharegpuProcess, chart_docs, free_port, local_webhook_args
from .components import wait_for as _wait_for
from .controlplane import ControlPlane

IMAGE = "registry.invalid/sharegpu/pause:never-pulled"
MUTATING = "pods.scheduler.sharegpu.io"
VALIDATING = "pods.validate.sharegpu.io"
GPU_SCHEDULER = "ack-co-scheduler"
MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
VWC_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
MEM = "aliyun.com/gpu-mem"
wait_for = functools.partial(_wait_for, timeout=30, every=0.1)


def pod(name: str, limits: Mapping[str, str] | None = None,
        scheduler: str | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "main", "image": IMAGE}
    if limits:
        c["resources"] = {"limits": dict(limits)}
    spec: dict[str, Any] = {"containers": [c],
                            "nodeSelector": {"sharegpu.dev/e2e-no-such-node": "true"}}
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def calls(cp: ControlPlane, hook: str) -> int:
    status, text = cp.request("GET", "/metrics")
    assert status == 200
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("apiserver_admission_webhook_request_total{")
               and f'name="{hook}"' in line)


class Setup:
    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.cp, self.namespace = cp, namespace

    def create(self, obj: Mapping[str, Any], dry_run: bool = False) -> tuple[int, dict]:
        """POST the pod as kubectl writes its JSON: non-ASCII text as UTF-8, not escaped."""
        path = f"/api/v1/namespaces/{self.namespace}/pods" + ("?dryRun=All" if dry_run else "")
        status, body = self.cp.request("POST", path, json.dumps(obj, ensure_ascii=False).encode())
        return status, json.loads(body)


@pytest.fixture(scope="module")
def setup(controlplane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Setup]:
    cp = controlplane
    suffix = uuid.uuid4().hex[:6]
    docs = chart_docs(f"sharegpu-rel-{suffix}", {"webhook.setSchedulerName": "true"})
    (mwc,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    (vwc,) = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"
              and d["metadata"]["name"] == vwc["metadata"]["name"]]
    certs = make_certificates(tmp_path_factory.mktemp("webhook-tls"), hosts=("127.0.0.1",))
    port = free_port()
    args = local_webhook_args(dep, port, certs.cert, certs.key)
    assert f"--set-scheduler-name={GPU_SCHEDULER}" in args
    proc = SharegpuProcess(cp, f"webhook-{suffix}", args).start()
    namespace = f"e2e-sched-{suffix}"
    name = f"{vwc['metadata']['name']}-sched-{suffix}"
    ca = base64.b64encode(certs.ca_cert.read_bytes()).decode()
    try:
        ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
        proc.wait_http(f"https://127.0.0.1:{port}/healthz", timeout=30, context=ctx)
        status, body = cp.request("POST", "/api/v1/namespaces", {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        assert status == 201, body
        wait_for("the default ServiceAccount", lambda: cp.request(
            "GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default")[0] == 200)
        for conf, path, keep, url in ((mwc, MWC_PATH, MUTATING, "/mutate"),
                                      (vwc, VWC_PATH, VALIDATING, "/validate")):
            mine = copy.deepcopy(conf)
            mine["metadata"]["name"] = name
            mine["webhooks"] = [copy.deepcopy(w) for w in conf["webhooks"] if w["name"] == keep]
            assert len(mine["webhooks"]) == 1
            mine["webhooks"][0]["clientConfig"] = {"url": f"https://127.0.0.1:{port}{url}",
                                                   "caBundle": ca}
            status, body = cp.request("POST", path, mine)
            assert status == 201, body
        s = Setup(cp, namespace)
        wait_for("the API server to call the mutating webhook", lambda: s.create(
            pod("probe", {MEM: "1"}), dry_run=True)[1].get("spec", {}).get("schedulerName")
            == GPU_SCHEDULER)
        yield s
    finally:
        proc.stop()
        cp.request("DELETE", f"{MWC_PATH}/{name}")
        cp.request("DELETE", f"{VWC_PATH}/{name}")
        cp.request("DELETE", f"/api/v1/namespaces/{namespace}")
        probe = pod("probe", {MEM: "1"}, scheduler=GPU_SCHEDULER)
        wait_for("the API server to drop the configurations",
                 lambda: Setup(cp, "default").create(probe, dry_run=True)[0] == 201)


def test_a_gpu_sharing_pod_left_to_the_default_scheduler_gets_the_extenders(setup: Setup):
    before = calls(setup.cp, MUTATING)
    status, body = setup.create(pod("forgot", {MEM: "4"}))
    assert status == 201, body
    assert body["spec"]["schedulerName"] == GPU_SCHEDULER
    assert calls(setup.cp, MUTATING) == before + 1
    status, body = setup.create(pod("named-default", {MEM: "4"}, scheduler="default-scheduler"))
    assert status == 201 and body["spec"]["schedulerName"] == GPU_SCHEDULER, body


def test_other_pods_are_left_alone(setup: Setup):
    before = calls(setup.cp, MUTATING)
    for obj in (pod("plain"), pod("cards", {"nvidia.com/gpu": "1"})):
        status, body = setup.create(obj)
        assert status == 201, body
        assert body["spec"]["schedulerName"] == "default-scheduler"
    assert calls(setup.cp, MUTATING) == before  # never sent (matchConditions)
    # a scheduler of the pod's own: not rewritten; the validating hook then refuses it
    status, body = setup.create(pod("volcano", {MEM: "4"}, scheduler="volcano"))
    assert status == 422, body
    assert "spec.schedulerName='volcano'" in body["message"]
    assert calls(setup.cp, MUTATING) == before


@pytest.mark.parametrize(("value", "taken"), [
    (" 4", True), ("4 ", True), ("4\u00a0", True), ("\u30004", True),  # as they are in JSON
    ("4\n", False), ("\t4", False),  # control characters JSON escapes
])
def test_the_webhook_never_refuses_a_quantity_the_api_server_takes(setup: Setup, value: str,
                                                                   taken: bool):
    """Quantity.UnmarshalJSON trims the raw JSON text of the string: a space around the value
    is dropped, an escaped newline or tab is not (the request is refused before admission).
    The webhook, which trims the decoded string (the rule of the API server's CBOR decoder),
    refuses neither: it never refuses what the API server stored."""
    status, body = setup.create(pod(f"q-{uuid.uuid4().hex[:6]}", {MEM: value}), dry_run=True)
    print(f"{value!r}: the API server answered {status}")
    if taken:
        assert status == 201, body
        assert body["spec"]["containers"][0]["resources"]["limits"][MEM] == "4"
    else:
        assert status == 400, body
        assert "quantities must match" in body["message"], body
        assert "admission webhook" not in body["message"], body
