"""The REAL kube-apiserver (v1.37.2, see controlplane.py) calls ``sharegpu webhook`` over TLS.

Services cannot route here (no kube-proxy, no Pods), so ``sharegpu webhook`` runs as a local
process on 127.0.0.1 with the arguments the chart gives it (only ``--listen`` and the certificate
paths changed; no kubeconfig: it never calls the API server), serving a certificate this test
makes for 127.0.0.1. The ValidatingWebhookConfiguration registered is the chart's (``helm
template``: same rules, matchConditions, failurePolicy, namespaceSelector, sideEffects,
timeoutSeconds, admissionReviewVersions) with only ``clientConfig`` changed to
``url: https://127.0.0.1:PORT/validate`` and this test's CA as ``caBundle``.

Shown: bad GPU pods are refused by the API server with a message naming the field and the rule;
good GPU pods are admitted; pods that ask for no GPU, and pods in kube-system and in the release
namespace, are never sent to the webhook (the API server's own admission-webhook metrics count
the calls); with the webhook process stopped a GPU pod is refused (failurePolicy Fail: the API
server says it could not call the webhook) while a pod without GPU is still admitted.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
import ssl
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sharegpu.core import request as rules
from sharegpu_testing.tls import make_certificates

from .components import SharegpuProcess, chart_docs, free_port, local_webhook_args
from .components import wait_for as _wait_for
from .controlplane import ControlPlane

T = TypeVar("T")
IMAGE = "registry.invalid/sharegpu/pause:never-pulled"  # no kubelet: never pulled
HOOK = "pods.validate.sharegpu.io"
GPU_SCHEDULER = "ack-co-scheduler"  # the chart's scheduler.name (profile mode)
VWC_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
MEM, CORE = "aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage"
wait_for = functools.partial(_wait_for, timeout=30, every=0.1)




def container(name: str = "main", limits: Mapping[str, str] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": IMAGE}
    if limits:
        c["resources"] = {"limits": dict(limits)}
    return c


def pod(name: str, *containers: dict[str, Any], scheduler: str | None = GPU_SCHEDULER,
        labels: Mapping[str, str] | None = None,
        init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": list(containers) or [container()],
        # no node matches: a pod the default scheduler sees stays Pending (and is deleted at once)
        "nodeSelector": {"sharegpu.dev/e2e-no-such-node": "true"},
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": dict(labels or {})}, "spec": spec}


def create(cp: ControlPlane, namespace: str, obj: Mapping[str, Any],
           dry_run: bool = False) -> tuple[int, dict[str, Any]]:
    path = f"/api/v1/namespaces/{namespace}/pods" + ("?dryRun=All" if dry_run else "")
    status, body = cp.request("POST", path, obj)
    return status, json.loads(body)


def webhook_calls(cp: ControlPlane) -> int:
    """How many times the API server has called our webhook (its own metric, every outcome)."""
    status, text = cp.request("GET", "/metrics")
    assert status == 200
    total = 0
    for line in text.splitlines():
        if line.startswith("apiserver_admission_webhook_request_total{") and \
                f'name="{HOOK}"' in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


class Hook:
    def __init__(self, cp: ControlPlane, proc: SharegpuProcess, port: int, namespace: str,
                 release_namespace: str, chart_hook: dict[str, Any], name: str) -> None:
        self.cp, self.proc, self.port = cp, proc, port
        self.namespace, self.release_namespace = namespace, release_namespace
        self.chart_hook, self.name = chart_hook, name


def _namespace(cp: ControlPlane, name: str) -> None:
    status, body = cp.request("POST", "/api/v1/namespaces",
                              {"apiVersion": "v1", "kind": "Namespace",
                               "metadata": {"name": name}})
    assert status == 201, body
    wait_for(f"ServiceAccount {name}/default", lambda: cp.request(
        "GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")[0] == 200)


@pytest.fixture(scope="module")
def hook(controlplane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hook]:
    cp = controlplane
    suffix = uuid.uuid4().hex[:6]
    release_ns = f"sharegpu-rel-{suffix}"  # the release namespace the chart is rendered for
    docs = chart_docs(release_ns)
    (vwc,) = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and
              d["metadata"]["name"] == vwc["metadata"]["name"]]
    # the pod webhook alone (the chart's other one checks ResourcePolicies)
    (chart_hook,) = [w for w in vwc["webhooks"] if w["name"] == HOOK]

    certs = make_certificates(tmp_path_factory.mktemp("webhook-tls"), hosts=("127.0.0.1",))
    port = free_port()
    args = local_webhook_args(dep, port, certs.cert, certs.key)
    assert f"--gpu-schedulers={GPU_SCHEDULER}" in args
    proc = SharegpuProcess(cp, f"webhook-{suffix}", args).start()  # no kubeconfig
    name = f"{vwc['metadata']['name']}-e2e-{suffix}"
    namespaces = [f"e2e-webhook-{suffix}", release_ns]
    try:
        ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
        proc.wait_http(f"https://127.0.0.1:{port}/healthz", timeout=30, context=ctx)
        for ns in namespaces:
            _namespace(cp, ns)
        mine = copy.deepcopy(vwc)
        mine["metadata"]["name"] = name
        mine["webhooks"] = [copy.deepcopy(chart_hook)]
        mine["webhooks"][0]["clientConfig"] = {
            "url": f"https://127.0.0.1:{port}/validate",
            "caBundle": base64.b64encode(certs.ca_cert.read_bytes()).decode(),
        }
        status, body = cp.request("POST", VWC_PATH, mine)
        assert status == 201, body
        h = Hook(cp, proc, port, namespaces[0], release_ns, chart_hook, name)
        # the API server's webhook configuration is cached: wait until it calls ours
        bad = pod("probe", container(limits={MEM: "4", CORE: "33"}))
        wait_for("the API server to call the webhook", lambda: create(
            cp, h.namespace, bad, dry_run=True)[0] == 422)
        yield h
    finally:
        proc.stop()
        cp.request("DELETE", f"{VWC_PATH}/{name}")
        for ns in namespaces:
            cp.request("DELETE", f"/api/v1/namespaces/{ns}")
        # until the API server forgets the configuration, GPU pods would be refused (the
        # webhook is gone, failurePolicy Fail): leave only once they are admitted again
        probe = pod("probe", container(limits={MEM: "1"}))
        wait_for("the API server to drop the webhook configuration",
                 lambda: create(cp, "default", probe, dry_run=True)[0] == 201)
    assert not proc.alive()


def test_registered_configuration_is_the_charts(hook: Hook) -> None:
    status, body = hook.cp.request("GET", f"{VWC_PATH}/{hook.name}")
    assert status == 200
    (stored,) = json.loads(body)["webhooks"]
    chart = hook.chart_hook
    # everything the chart sets, as the API server stored it; only clientConfig differs
    for key in ("name", "rules", "matchConditions", "failurePolicy", "namespaceSelector",
                "sideEffects", "timeoutSeconds", "admissionReviewVersions"):
        assert stored[key] == chart[key], key
    assert set(chart) - {"clientConfig"} <= set(stored)
    assert stored["clientConfig"]["url"] == f"https://127.0.0.1:{hook.port}/validate"
    assert "service" in chart["clientConfig"]
    assert chart["failurePolicy"] == "Fail" and chart["sideEffects"] == "None"
    excluded = chart["namespaceSelector"]["matchExpressions"][0]
    assert excluded["key"] == "kubernetes.io/metadata.name" and excluded["operator"] == "NotIn"
    assert set(excluded["values"]) == {hook.release_namespace, "kube-system"}
    assert [m["name"] for m in chart["matchConditions"]] == ["asks-for-gpu"]


def _field(name: str, container_index: int = 0) -> str:
    return f'spec.containers[{container_index}].resources.limits["{name}"]'


BAD = {
    "core-33": (pod("core-33", container(limits={MEM: "4", CORE: "33"})),
                f"{_field(CORE)}='33': {rules.RULE_CORE}"),
    "default-scheduler": (pod("default-sched", container(limits={MEM: "4"}), scheduler=None),
                          "spec.schedulerName='default-scheduler': a pod asking for "
                          f"{MEM}"),
    "core-without-mem": (pod("core-only", container(limits={CORE: "50"})),
                         f"{_field(CORE)}='50': {rules.RULE_CORE_NEEDS_MEM}"),
    "count-does-not-divide": (pod("count-3", container(limits={MEM: "8"}),
                                  labels={"aliyun.com/gpu-count": "3"}),
                              f"{_field(MEM)}='8': {rules.RULE_COUNT_DIVIDES}"),
    "mixed-kinds": (pod("mixed", container("a", {MEM: "4"}),
                        container("b", {"nvidia.com/gpu": "1"})),
                    "spec.containers[1].resources='exclusive': " +
                    rules.RULE_NO_MIX_POD.format(other="shared")),
    "gpu-in-init-container": (pod("init-gpu", container(),
                                  init=[container("init", {MEM: "2"})]),
                              f"spec.initContainers[0].resources.limits[\"{MEM}\"]='2': "
                              f"{rules.RULE_INIT_CONTAINER}"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_gpu_pods_are_refused_naming_field_and_rule(hook: Hook, case: str) -> None:
    obj, expected = BAD[case]
    status, body = create(hook.cp, hook.namespace, obj)
    assert status == 422, body
    message = body["message"]
    assert message.startswith(f'admission webhook "{HOOK}" denied the request: '), message
    assert expected in message, message
    if case == "default-scheduler":
        assert f"set schedulerName: {GPU_SCHEDULER}" in message
    assert body["reason"] == "Invalid"
    # nothing was created
    name = obj["metadata"]["name"]
    assert hook.cp.request("GET", f"/api/v1/namespaces/{hook.namespace}/pods/{name}")[0] == 404


GOOD = {
    "gpu-mem": pod("good-mem", container(limits={MEM: "4"})),
    "core-mem": pod("good-core", container(limits={MEM: "4", CORE: "30"})),
    "multi-gpu": pod("good-count", container(limits={MEM: "8"}),
                     labels={"aliyun.com/gpu-count": "2"}),
    "two-containers": pod("good-two", container("a", {MEM: "2"}), container("b", {MEM: "3"})),
    # whole cards need no extender: any scheduler
    "whole-card": pod("good-card", container(limits={"nvidia.com/gpu": "1"}), scheduler=None),
}


@pytest.mark.parametrize("case", list(GOOD))
def test_good_gpu_pods_are_admitted(hook: Hook, case: str) -> None:
    before = webhook_calls(hook.cp)
    status, body = create(hook.cp, hook.namespace, GOOD[case])
    assert status == 201, body
    assert body["metadata"]["namespace"] == hook.namespace
    # the API server did ask the webhook (exactly once)
    assert webhook_calls(hook.cp) == before + 1


def _create_and_clean(hook: Hook, namespace: str, obj: dict[str, Any]) -> tuple[int, dict]:
    status, body = create(hook.cp, namespace, obj)
    if status == 201:
        hook.cp.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/"
                                  f"{obj['metadata']['name']}?gracePeriodSeconds=0")
    return status, body


def test_pods_without_gpu_and_excluded_namespaces_are_not_sent(hook: Hook) -> None:
    cp = hook.cp
    before = webhook_calls(cp)
    # matchConditions: a pod that asks for no GPU resource never reaches the webhook
    plain = pod("plain", container(limits={"cpu": "1"}), scheduler=None)
    assert create(cp, hook.namespace, plain)[0] == 201
    # namespaceSelector: kube-system and the release namespace are never sent, so even a pod
    # the webhook would refuse is admitted there
    bad = pod(f"bad-{uuid.uuid4().hex[:6]}", container(limits={MEM: "4", CORE: "33"}))
    for ns in ("kube-system", hook.release_namespace):
        status, body = _create_and_clean(hook, ns, bad)
        assert status == 201, (ns, body)
    assert webhook_calls(cp) == before
    # ... while the same pod elsewhere is sent, and refused
    assert create(cp, hook.namespace, bad)[0] == 422
    assert webhook_calls(cp) == before + 1


def test_webhook_process_used_no_kubeconfig(hook: Hook) -> None:
    """The webhook answers the API server and never calls it: started without credentials."""
    assert not any("kubeconfig" in a for a in hook.proc.args)
    assert "Traceback" not in Path(hook.proc.log).read_text()


def test_controller_made_pods_are_refused_with_the_reason_in_an_event(hook: Hook) -> None:
    """A Deployment whose pod template breaks a rule: kube-controller-manager's ReplicaSet
    controller is refused (the pods have generated names) and says why in a FailedCreate
    Event."""
    cp, ns = hook.cp, hook.namespace
    labels = {"app": "bad-gpu"}
    template = pod("", container(limits={MEM: "4", CORE: "33"}), labels=labels)
    del template["metadata"]["name"], template["apiVersion"], template["kind"]
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "bad-gpu"},
           "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": template}}
    status, body = cp.request("POST", f"/apis/apps/v1/namespaces/{ns}/deployments", dep)
    assert status == 201, body

    def refused() -> str | None:
        events = json.loads(cp.request("GET", f"/api/v1/namespaces/{ns}/events")[1])["items"]
        return next((e["message"] for e in events if e["reason"] == "FailedCreate"
                     and e["involvedObject"]["kind"] == "ReplicaSet"), None)

    message = wait_for("the ReplicaSet's FailedCreate event", refused)
    assert f'admission webhook "{HOOK}" denied the request: ' in message, message
    assert f"{_field(CORE)}='33': {rules.RULE_CORE}" in message, message
    pods = json.loads(cp.request("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector=app%3D"
                                        "bad-gpu")[1])["items"]
    assert pods == []


def test_webhook_down_fails_closed_for_gpu_pods_only(hook: Hook) -> None:
    """Runs last: stops the webhook process."""
    cp = hook.cp
    hook.proc.stop()
    assert not hook.proc.alive()
    status, body = create(cp, hook.namespace, pod("down-gpu", container(limits={MEM: "4"})))
    assert status == 500, body
    message = body["message"]
    assert f'failed calling webhook "{HOOK}"' in message, message
    assert f"https://127.0.0.1:{hook.port}/validate" in message, message
    assert re.search(r"connection refused|connect:", message), message
    assert cp.request("GET", f"/api/v1/namespaces/{hook.namespace}/pods/down-gpu")[0] == 404
    # a pod without GPU is still admitted (matchConditions: never sent)
    status, body = create(cp, hook.namespace, pod("down-plain", scheduler=None))
    assert status == 201, body
    # and kube-system is not sent to it either
    status, body = _create_and_clean(hook, "kube-system", pod(
        f"down-gpu-{uuid.uuid4().hex[:6]}", container(limits={MEM: "4"})))
    assert status == 201, body

