"""DRA item 3 against the REAL control plane (kube-apiserver, kube-controller-manager,
kube-scheduler v1.37.2, default feature gates): ACK's pod spec keeps working on a DRA node pool.

- ``sharegpu webhook`` runs as a local process with the chart's arguments for
  ``agent.dra.enabled=true`` (only ``--listen``, the certificate and a kubeconfig for the
  chart's webhook ServiceAccount changed: the chart's ClusterRole and binding are applied, so
  the webhook creates the ResourceClaimTemplates with exactly the rights the chart gives it).
  The chart's MutatingWebhookConfiguration and its validating pod webhook are registered with
  only ``clientConfig`` changed to ``url: https://127.0.0.1:PORT/...``.
- 4 kubelet-less DRA nodes carry ResourceSlices built by the agent's own builder
  (``build_slice``, cgpu mode, 7 GPUs of 15-40 GiB).
- 50 ACK-spec pods (``aliyun.com/gpu-mem``, some with ``gpu-core.percentage``, some with the
  ``aliyun.com/gpu-count`` label 2) are admitted through the API server calling the webhook
  and placed by the real kube-scheduler (default profile) through the claims the
  resourceclaim controller makes from the templates. Read back from the claims: per GPU the sum
  of ``consumedCapacity`` stays within its capacity, every gpu-count 2 pod has 2 distinct GPUs.
- A pod larger than any GPU stays Pending with kube-scheduler's reason in its FailedScheduling
  Event; bad pods are refused naming the field and the rule, and nothing else changes.
- The chart's validating webhooks for ResourceClaims and ResourceClaimTemplates are registered
  too (every claim above, made by the resourceclaim controller from the webhook's templates,
  passes them): a user's claim off the 1Gi or 5 % step is refused at creation naming the field
  and the rule, a good one is admitted and allocated, and a claim of another DeviceClass is
  never sent to the webhook (it is created while the webhook process is stopped).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import random
import ssl
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from lightkube import ApiError, Client, KubeConfig
from lightkube.resources.core_v1 import Node

from sharegpu.core import request as rules
from sharegpu.core.modes import Mode
from sharegpu.dra.draclaims import RULE_AMBIGUOUS, RULE_NODE_NAME
from sharegpu.dra.resourceslices import SliceGpu, build_slice
from sharegpu_testing.tls import make_certificates

from .components import (
    SharegpuProcess,
    chart_docs,
    create_node,
    free_port,
    local_webhook_args,
    wait_for,
)
from .controlplane import ControlPlane

DRIVER = "gpu.sharegpu.io"
POOL = {"sharegpu.io/dra": "true"}
MEM, CORE, COUNT = "aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage", "aliyun.com/gpu-count"
IMAGE = "registry.invalid/sharegpu/pause:never-pulled"
RA = "/apis/resource.k8s.io/v1"
GIB = 1 << 30
# node -> GPU sizes (GiB)
NODES = {"a": (15, 15), "b": (16, 16), "c": (24,), "d": (40, 40)}


def get(cp: ControlPlane, path: str) -> Any:
    status, body = cp.request("GET", path)
    assert status == 200, f"GET {path}: HTTP {status}: {body[:300]}"
    return json.loads(body)


def post(cp: ControlPlane, path: str, obj: Any) -> tuple[int, dict[str, Any]]:
    status, body = cp.request("POST", path, obj)
    return status, json.loads(body) if body else {}


def gpu_pod(name: str, mem: int | str | None, *, core: int | None = None,
            count: int | None = None, selector: dict[str, str] | None = None,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    limits: dict[str, str] = {}
    if mem is not None:
        limits[MEM] = str(mem)
    if core is not None:
        limits[CORE] = str(core)
    spec: dict[str, Any] = {
        "nodeSelector": dict(POOL if selector is None else selector),
        "containers": [{"name": "main", "image": IMAGE, "resources": {"limits": limits}}],
        **(extra or {})}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {COUNT: str(count)} if count else {}},
            "spec": spec}


def user_claim(name: str, capacity: dict[str, str] | None = None, *, cls: str = DRIVER,
               count: int = 1, template: bool = False) -> dict[str, Any]:
    """A claim (or template) a user writes by hand: one request of ``cls``."""
    exactly: dict[str, Any] = {
        "deviceClassName": cls, "allocationMode": "ExactCount", "count": count,
        "selectors": [{"cel": {"expression": "device.allowMultipleAllocations == true"}}]}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    if template:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": name}, "spec": {"spec": spec}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name}, "spec": spec}


def qty_bytes(q: str) -> int:
    return int(q[:-2]) * GIB if q.endswith("Gi") else int(q)


class Env:
    def __init__(self, cp: ControlPlane, ns: str, nodes: dict[str, str], suffix: str,
                 webhook: SharegpuProcess, healthz: Callable[[], None]) -> None:
        self.cp, self.ns, self.nodes, self.suffix = cp, ns, nodes, suffix
        self.webhook = webhook
        self.healthz = healthz  # waits until the webhook process answers


@pytest.fixture(scope="module")
def env(controlplane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cp = controlplane
    admin = Client(KubeConfig.from_file(cp.admin_kubeconfig))
    suffix = uuid.uuid4().hex[:6]
    release_ns, ns = f"sharegpu-drawh-{suffix}", f"e2e-drawh-{suffix}"
    docs = chart_docs(release_ns, {"agent.dra.enabled": "true"})
    mwc = next(d for d in docs if d["kind"] == "MutatingWebhookConfiguration")
    vwc = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    hook_name = mwc["metadata"]["name"]
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == hook_name)
    created: list[str] = []  # API paths to delete afterwards, newest last
    nodes: dict[str, str] = {}
    proc = None
    try:
        for n in (release_ns, ns):
            assert post(cp, "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                   "metadata": {"name": n}})[0] == 201
            created.append(f"/api/v1/namespaces/{n}")
        # the chart's rights for the webhook, and a token of its ServiceAccount
        for d in docs:
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding") and \
                    d["metadata"]["name"] == hook_name:
                path = f"/apis/rbac.authorization.k8s.io/v1/{d['kind'].lower()}s"
                code, body = post(cp, path, d)
                assert code == 201, body
                created.append(f"{path}/{hook_name}")
        kubeconfig = cp.service_account_kubeconfig(release_ns, hook_name)
        dc = next(d for d in docs if d["kind"] == "DeviceClass")
        if cp.request("GET", f"{RA}/deviceclasses/{DRIVER}")[0] == 404:
            assert post(cp, f"{RA}/deviceclasses", dc)[0] == 201
            created.append(f"{RA}/deviceclasses/{DRIVER}")
        for key, sizes in NODES.items():
            name = create_node(admin, f"e2e-drawh-{key}-{suffix}",
                               labels={"ack.node.gpu.schedule": "cgpu", **POOL})
            nodes[key] = name
            gpus = [SliceGpu(i, f"GPU-{key}{i}-{suffix}", "Tesla T4", gib * 1024, gib)
                    for i, gib in enumerate(sizes)]
            code, body = post(cp, f"{RA}/resourceslices", build_slice(name, gpus, Mode.CGPU))
            assert code == 201, body
            created.append(f"{RA}/resourceslices/{body['metadata']['name']}")
        # a device-plugin node (not in the pool)
        nodes["dp"] = create_node(admin, f"e2e-drawh-dp-{suffix}",
                                  labels={"ack.node.gpu.schedule": "cgpu"})

        certs = make_certificates(tmp_path_factory.mktemp("drawh-tls"), hosts=("127.0.0.1",))
        port = free_port()
        args = local_webhook_args(dep, port, certs.cert, certs.key)
        assert "--dra-label=sharegpu.io/dra=true" in args
        args.append(f"--kubeconfig={kubeconfig}")
        proc = SharegpuProcess(cp, f"drawh-{suffix}", args).start()
        ctx = ssl.create_default_context(cafile=str(certs.ca_cert))

        def healthz(proc: SharegpuProcess = proc) -> None:
            proc.wait_http(f"https://127.0.0.1:{port}/healthz", timeout=30, context=ctx)

        healthz()
        ca = base64.b64encode(certs.ca_cert.read_bytes()).decode()
        for cfg, path, kind in ((mwc, "/mutate", "mutatingwebhookconfigurations"),
                                (vwc, "/validate", "validatingwebhookconfigurations")):
            mine = copy.deepcopy(cfg)
            mine["metadata"]["name"] = f"{hook_name}-e2e-{suffix}"
            # the pod webhooks and, with DRA, those of claims and templates (no ResourcePolicy
            # CRD here)
            mine["webhooks"] = [w for w in mine["webhooks"] if w["name"].startswith(
                ("pods.", "resourceclaims.", "resourceclaimtemplates."))]
            for w in mine["webhooks"]:
                w["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
            base = f"/apis/admissionregistration.k8s.io/v1/{kind}"
            code, body = post(cp, base, mine)
            assert code == 201, body
            created.append(f"{base}/{mine['metadata']['name']}")
        # the configuration is cached by the API server: wait until it calls ours
        probe = gpu_pod("probe", 1)
        wait_for("the API server to call the mutating webhook", lambda: (
            r := post(cp, f"/api/v1/namespaces/{ns}/pods?dryRun=All", probe))[0] == 201
            and r[1]["spec"].get("resourceClaims"), timeout=30, every=0.2)
        off_step = user_claim("probe", {"memory": "4.5Gi"})
        wait_for("the API server to call the claims webhook", lambda: post(
            cp, f"{RA}/namespaces/{ns}/resourceclaims?dryRun=All", off_step)[0] >= 400,
            timeout=30, every=0.2)
        yield Env(cp, ns, nodes, suffix, proc, healthz)
    finally:
        if proc is not None:
            proc.stop()
        for path in reversed(created):
            cp.request("DELETE", path)
        for name in nodes.values():
            with contextlib.suppress(ApiError):
                admin.delete(Node, name)


def claims_by_pod(cp: ControlPlane, ns: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in get(cp, f"{RA}/namespaces/{ns}/resourceclaims")["items"]:
        for o in c["metadata"].get("ownerReferences") or []:
            if o["kind"] == "Pod":
                out[o["name"]].append(c)
    return out


def test_fifty_ack_pods_on_four_dra_nodes(env: Env) -> None:
    cp, ns = env.cp, env.ns
    rnd = random.Random(21)
    wanted: dict[str, tuple[int, int, int]] = {}  # pod -> (GiB per GPU, cores, GPUs)
    t0 = time.monotonic()
    for i in range(50):
        count = 2 if i % 6 == 5 else None
        core = rnd.choice((10, 20, 25, 30)) if i % 3 == 1 else None
        mem = rnd.choice((1, 2, 3, 4)) * (count or 1)
        code, body = post(cp, f"/api/v1/namespaces/{ns}/pods",
                          gpu_pod(f"ack-{i}", mem, core=core, count=count))
        assert code == 201, body.get("message", body)
        # as stored: no extended resource, one claim from the shape's template
        c = body["spec"]["containers"][0]
        assert MEM not in c["resources"].get("limits", {}) and CORE not in c["resources"].get(
            "limits", {})
        assert c["resources"]["claims"] == [{"name": "sharegpu-c0"}]
        (rc,) = body["spec"]["resourceClaims"]
        assert rc["resourceClaimTemplateName"].startswith("sharegpu-")
        wanted[f"ack-{i}"] = (mem // (count or 1), core or 0, count or 1)
    admitted = time.monotonic() - t0

    def settled() -> dict[str, Any] | None:
        """Every pod placed, or refused by kube-scheduler (FailedScheduling)."""
        pods = {p["metadata"]["name"]: p for p in get(
            cp, f"/api/v1/namespaces/{ns}/pods")["items"] if p["metadata"]["name"] in wanted}
        return pods if all(p["spec"].get("nodeName") or scheduler_events(cp, ns, n)
                           for n, p in pods.items()) else None

    wait_for("kube-scheduler to place or refuse all 50 pods", settled, timeout=120, every=0.5)
    time.sleep(3)
    pods = settled()
    assert pods is not None
    placed = time.monotonic() - t0
    templates = get(cp, f"{RA}/namespaces/{ns}/resourceclaimtemplates")["items"]
    claims = claims_by_pod(cp, ns)
    used: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    per_node: dict[str, int] = defaultdict(int)
    pending = {n for n, p in pods.items() if not p["spec"].get("nodeName")}
    for name, (gib, core, gpus) in wanted.items():
        if name in pending:
            assert not claims[name][0].get("status", {}).get("allocation"), name
            continue
        (claim,) = claims[name]
        alloc = claim["status"]["allocation"]
        results = alloc["devices"]["results"]
        assert len(results) == gpus, name
        assert len({r["device"] for r in results}) == gpus, f"{name}: GPUs not distinct"
        node = pods[name]["spec"]["nodeName"]
        per_node[node] += 1
        assert {r["pool"] for r in results} == {node}
        assert any(r["uid"] == pods[name]["metadata"]["uid"]
                   for r in claim["status"]["reservedFor"])
        for r in results:
            cc = r["consumedCapacity"]
            assert qty_bytes(cc["memory"]) == gib * GIB, name
            assert int(cc["cores"]) == (core or 5), name  # no cores asked: the 5 % default
            used[(r["pool"], r["device"])][0] += qty_bytes(cc["memory"])
            used[(r["pool"], r["device"])][1] += int(cc["cores"])
    capacity = {(env.nodes[k], f"gpu-{i}"): gib for k, sizes in NODES.items()
                for i, gib in enumerate(sizes)}
    for key, (mem, cores) in used.items():
        assert mem <= capacity[key] * GIB, (key, mem)
        assert cores <= 100, (key, cores)
    # what kube-scheduler left Pending fits nowhere: no node has that many GPUs with the room
    for name in pending:
        gib, core, gpus = wanted[name]
        for node in env.nodes.values():
            room = [k for k in capacity if k[0] == node
                    and capacity[k] * GIB - used[k][0] >= gib * GIB
                    and 100 - used[k][1] >= (core or 5)]
            assert len(room) < gpus, (name, node, room)
        (ev,) = scheduler_events(cp, ns, name)[-1:]
        assert "cannot allocate all claims" in ev["message"], ev["message"]
    assert len(pending) <= 5
    print(f"\n{50 - len(pending)} of 50 placed, {len(pending)} Pending (fit nowhere: "
          f"{sorted((n, wanted[n]) for n in pending)}); "
          f"50 pods admitted in {admitted:.1f}s, settled {placed:.1f}s after the first; "
          f"{len(templates)} templates; pods per node {dict(sorted(per_node.items()))}; "
          "per GPU GiB/cores used: " + ", ".join(
              f"{k[0].split('-')[2]}/{k[1]} {m // GIB}/{capacity[k]} GiB {c}%"
              for k, (m, c) in sorted(used.items())))
    assert sum(1 for w in wanted.values() if w[2] == 2) == 8


def scheduler_events(cp: ControlPlane, ns: str, pod: str) -> list[dict[str, Any]]:
    return [e for e in get(cp, f"/api/v1/namespaces/{ns}/events?fieldSelector="
                               f"involvedObject.name={pod}")["items"]
            if e["reason"] == "FailedScheduling"]


def test_a_pod_that_fits_nowhere_stays_pending_with_the_schedulers_reason(env: Env) -> None:
    cp, ns = env.cp, env.ns
    code, body = post(cp, f"/api/v1/namespaces/{ns}/pods", gpu_pod("too-big", 48))
    assert code == 201, body
    (ev,) = wait_for("kube-scheduler's FailedScheduling Event",
                     lambda: scheduler_events(cp, ns, "too-big")[:1], timeout=60)
    print(f"\ntoo-big (48 GiB): {ev['message']}")
    assert "cannot allocate all claims" in ev["message"]
    assert get(cp, f"/api/v1/namespaces/{ns}/pods/too-big")["spec"].get("nodeName") is None
    # a DRA pod aimed at the device-plugin node by its hostname: kube-scheduler says why
    aimed = gpu_pod("aimed-at-dp", 1, selector={
        **POOL, "kubernetes.io/hostname": env.nodes["dp"]})
    assert post(cp, f"/api/v1/namespaces/{ns}/pods", aimed)[0] == 201
    (ev,) = wait_for("FailedScheduling of aimed-at-dp",
                     lambda: scheduler_events(cp, ns, "aimed-at-dp")[:1], timeout=60)
    print(f"aimed-at-dp: {ev['message']}")
    assert "didn't match Pod's node affinity/selector" in ev["message"]


def test_bad_pods_are_refused_naming_field_and_rule(env: Env) -> None:
    cp, ns = env.cp, env.ns
    before = sorted(p["metadata"]["name"] for p in get(
        cp, f"/api/v1/namespaces/{ns}/pods")["items"])
    claims_before = len(get(cp, f"{RA}/namespaces/{ns}/resourceclaims")["items"])
    other = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    pool_term = {"matchExpressions": [{"key": "sharegpu.io/dra", "operator": "In",
                                       "values": ["true"]}]}
    field = 'spec.containers[0].resources.limits["{}"]'
    bad = {
        "cores off the step": (gpu_pod("bad-core", 4, core=33),
                               f"{field.format(CORE)}='33': {rules.RULE_CORE}"),
        "count does not divide": (gpu_pod("bad-count", 5, count=2),
                                  f"{field.format(MEM)}='5': {rules.RULE_COUNT_DIVIDES}"),
        "aimed at a node by nodeName": (
            gpu_pod("bad-nodename", 2, extra={"nodeName": env.nodes["dp"]}),
            f"spec.nodeName='{env.nodes['dp']}': {RULE_NODE_NAME}"),
        "ambiguous pool": (
            gpu_pod("bad-affinity", 2, selector={}, extra={"affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [pool_term, other]}}}}),
            RULE_AMBIGUOUS),
        "whole cards": ({**gpu_pod("bad-cards", None), "spec": {
            "nodeSelector": POOL, "containers": [{"name": "main", "image": IMAGE, "resources": {
                "limits": {"nvidia.com/gpu": "1"}}}]}},
            f"{field.format('nvidia.com/gpu')}='1': is not translated on the DRA pool"),
    }
    for case, (pod, message) in bad.items():
        code, body = post(cp, f"/api/v1/namespaces/{ns}/pods", pod)
        assert code in (400, 422), (case, body)
        print(f"\n{case}: HTTP {code}: {body['message']}")
        assert message in body["message"], case
    # a template of the shape's name with another spec: refused naming it
    squat = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
             "metadata": {"name": "sharegpu-7gi", "namespace": ns},
             "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "deviceClassName": DRIVER}}]}}}}
    assert post(cp, f"{RA}/namespaces/{ns}/resourceclaimtemplates", squat)[0] == 201
    code, body = post(cp, f"/api/v1/namespaces/{ns}/pods", gpu_pod("bad-template", 7))
    assert code in (400, 422) and f"ResourceClaimTemplate {ns}/sharegpu-7gi" in body[
        "message"], body
    print(f"template squatted: HTTP {code}: {body['message']}")
    # nothing else changed
    assert sorted(p["metadata"]["name"] for p in get(
        cp, f"/api/v1/namespaces/{ns}/pods")["items"]) == before
    assert len(get(cp, f"{RA}/namespaces/{ns}/resourceclaims")["items"]) == claims_before
    # a pod with a claim of its own passes untouched, beside the webhook
    own = gpu_pod("own-claim", None)
    own["spec"]["resourceClaims"] = [{"name": "mine", "resourceClaimTemplateName": "sharegpu-7gi"}]
    own["spec"]["containers"][0]["resources"] = {"claims": [{"name": "mine"}]}
    code, body = post(cp, f"/api/v1/namespaces/{ns}/pods", own)
    assert code == 201, body
    assert body["spec"]["resourceClaims"] == own["spec"]["resourceClaims"]
    assert "sharegpu.io/dra-claims" not in (body["metadata"].get("annotations") or {})


def test_users_own_claims_are_checked_at_creation(env: Env) -> None:
    """A user's ResourceClaim / ResourceClaimTemplate of the DeviceClass off the step is refused
    by the chart's claims webhook, through the API server, naming the field and the rule; a good
    one is admitted and kube-scheduler allocates it; another class's claim never reaches the
    webhook (created while it is stopped), while one of ours then fails closed."""
    from lightkube.generic_resource import create_namespaced_resource
    from lightkube.types import PatchType

    cp, ns = env.cp, env.ns
    admin = Client(KubeConfig.from_file(cp.admin_kubeconfig))
    rc = create_namespaced_resource("resource.k8s.io", "v1", "ResourceClaim", "resourceclaims")
    rct = create_namespaced_resource("resource.k8s.io", "v1", "ResourceClaimTemplate",
                                     "resourceclaimtemplates")
    field = "spec.devices.requests[0].exactly.capacity.requests"
    refused = {
        "memory 4.5Gi": (rc, user_claim("half-gib", {"memory": "4.5Gi"}),
                         f"{field}.memory=", "must be a whole number of GiB: the driver's "
                         "memory is consumed in steps of 1Gi", "would consume 5Gi"),
        "cores 12": (rc, user_claim("cores-12", {"memory": "2Gi", "cores": "12"}),
                     f"{field}.cores='12'", "must be a whole multiple of 5 from 5 to 100",
                     "12 would consume 15"),
        "a capacity the GPUs do not publish": (
            rc, user_claim("gpus", {"gpus": "1"}), f'{field}["gpus"]',
            "is not a capacity of DeviceClass gpu.sharegpu.io", "never allocated"),
        "a template off the step": (
            rct, user_claim("tmpl-1500mi", {"memory": "1500Mi"}, template=True),
            f"spec.{field}.memory='1500Mi'", "must be a whole number of GiB",
            "would consume 2Gi"),
    }
    before = {p: len(get(cp, f"{RA}/namespaces/{ns}/{p}")["items"])
              for p in ("resourceclaims", "resourceclaimtemplates")}
    for case, (res, obj, *wanted) in refused.items():
        with pytest.raises(ApiError) as e:
            admin.create(res.from_dict(obj), namespace=ns)
        message = e.value.status.message or ""
        print(f"\n{case}: HTTP {e.value.status.code}: {message}")
        assert e.value.status.code == 422, case
        assert "resourceclaim" in message and "validate.sharegpu.io" in message, message
        for part in wanted:
            assert part in message, (case, part)
    assert before == {p: len(get(cp, f"{RA}/namespaces/{ns}/{p}")["items"])
                      for p in ("resourceclaims", "resourceclaimtemplates")}

    # admitted; count 2 without distinctAttribute: admitted with the webhook's warning
    code, warnings, text = cp.request_with_warnings(
        "POST", f"{RA}/namespaces/{ns}/resourceclaims?dryRun=All",
        user_claim("two", {"memory": "2Gi"}, count=2))
    print(f"count 2 without distinctAttribute: HTTP {code}, warnings {warnings}")
    assert code == 201, text
    assert len(warnings) == 1 and "distinctAttribute: gpu.sharegpu.io/uuid" in warnings[0]

    # a good claim of the user's, on a node of its own (tainted: no other test's pod goes there)
    node = create_node(admin, f"e2e-drawh-own-{env.suffix}",
                       labels={"ack.node.gpu.schedule": "cgpu", **POOL})
    admin.patch(Node, node, {"spec": {"taints": [
        {"key": "e2e.sharegpu.io/own-claims", "value": "only", "effect": "NoSchedule"}]}},
        patch_type=PatchType.MERGE)
    gpu = SliceGpu(0, f"GPU-own-{env.suffix}", "Tesla T4", 8 * 1024, 8)
    code, body = post(cp, f"{RA}/resourceslices", build_slice(node, [gpu], Mode.CGPU))
    assert code == 201, body
    slice_path = f"{RA}/resourceslices/{body['metadata']['name']}"
    try:
        good = admin.create(rc.from_dict(user_claim("mine", {"memory": "3Gi", "cores": "20"})),
                            namespace=ns)
        assert good.metadata.name == "mine"
        pod = gpu_pod("own-claim-user", None, selector={**POOL, "kubernetes.io/hostname": node},
                      extra={"resourceClaims": [{"name": "g", "resourceClaimName": "mine"}],
                             "tolerations": [{"key": "e2e.sharegpu.io/own-claims",
                                              "operator": "Exists"}]})
        pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "g"}]}
        code, body = post(cp, f"/api/v1/namespaces/{ns}/pods", pod)
        assert code == 201, body
        claim = wait_for("kube-scheduler to allocate the user's claim", lambda: (
            c := get(cp, f"{RA}/namespaces/{ns}/resourceclaims/mine")).get(
                "status", {}).get("allocation") and c, timeout=60)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        print(f"user's claim allocated: {result['pool']}/{result['device']} "
              f"{result.get('consumedCapacity')}")
        assert (result["pool"], result["device"]) == (node, "gpu-0")
        assert result["consumedCapacity"] == {"memory": "3Gi", "cores": "20"}
        assert wait_for("the pod bound", lambda: get(
            cp, f"/api/v1/namespaces/{ns}/pods/own-claim-user")["spec"].get("nodeName"),
            timeout=30) == node

        # the webhook stopped: another class's claim is created (never sent: matchConditions),
        # one of sharegpu's class is refused (failurePolicy Fail)
        env.webhook.stop()
        t0 = time.monotonic()
        code, body = post(cp, f"{RA}/namespaces/{ns}/resourceclaims",
                          user_claim("nic", {"memory": "4.5Gi"}, cls="nic.example.com"))
        print(f"other DeviceClass, webhook down: HTTP {code} in {time.monotonic() - t0:.2f}s")
        assert code == 201, body
        code, body = post(cp, f"{RA}/namespaces/{ns}/resourceclaims",
                          user_claim("ours-while-down", {"memory": "1Gi"}))
        print(f"sharegpu's DeviceClass, webhook down: HTTP {code}: {body.get('message')}")
        assert code >= 500 and "resourceclaims.validate.sharegpu.io" in body["message"], body
        assert cp.request("GET", f"{RA}/namespaces/{ns}/resourceclaims/ours-while-down")[0] \
            == 404
    finally:
        if not env.webhook.alive():
            env.webhook.start()
            env.healthz()
        cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/own-claim-user?gracePeriodSeconds=0")
        cp.request("DELETE", slice_path)
        with contextlib.suppress(ApiError):
            admin.delete(Node, node)
