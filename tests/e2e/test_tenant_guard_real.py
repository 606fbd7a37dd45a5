"""The chart's tenant guard on the REAL kube-apiserver (v1.37.2, see controlplane.py): its
ValidatingAdmissionPolicies and bindings applied as ``helm template`` renders them, the chart's
RBAC for the extender and the agent, and real ServiceAccount tokens (TokenRequest) for

- a tenant: a ServiceAccount of its own namespace that may create, update and patch pods there
  (and Bindings and Deployments: more than a namespace user usually has);
- the extender: the chart's ServiceAccount;
- the agent: the chart's ServiceAccount, its token bound to an agent pod on node A, so it
  carries ``authentication.kubernetes.io/node-name`` (as the DaemonSet pod's projected token
  does); and one not bound to a pod, which names no node.

Each attack of issue 40 is refused with a message naming the key (or field) and who may write
it: rewriting, removing or server-side applying a decision (1), forging one at creation (2),
adding a key the extender did not write and removing the assigned mark (3), Bindings and pod
templates carrying decisions, the agent's token on another node, on its own node's spec, on
keys that are not sharegpu's, on another node's pods (6). The webhook, run here with the chart's
arguments and hooks, refuses the routes by which a shared-GPU container could set its own
limits (5). The legitimate writes pass: the extender's Binding with its annotations, the agent
marking its own node's pod assigned and writing its own node's labels, annotations and
condition, the kubelet's pod status, a controller creating pods from a clean template, the
tenant's own labels.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from sharegpu.core.annotations import Allocation, encode
from sharegpu_testing.tls import make_certificates

from .components import SharegpuProcess, free_port, local_webhook_args
from .components import wait_for as _wait_for
from .controlplane import ControlPlane
from .realcluster import render_chart

wait_for = functools.partial(_wait_for, timeout=60, every=0.2)
RELEASE = "sharegpu-guard"  # the objects are sharegpu-guard-<part>
IMAGE = "registry.invalid/sharegpu/pause:never-pulled"
ALLOC = "scheduler.framework.gpushare.allocation"
CORE = "gpushare.alibabacloud.com/core-percentage"
ASSIGNED = "scheduler.framework.gpushare.assigned"
MEM_IDX = "ALIYUN_COM_GPU_MEM_IDX"
VAP = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
VAPB = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
VWC = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


class Identity:
    """HTTP requests to the API server with one bearer token."""

    def __init__(self, cp: ControlPlane, token: str, user: str) -> None:
        self.cp, self.token, self.user = cp, token, user
        self.ctx = ssl.create_default_context(cafile=str(cp.ca_path))

    def call(self, method: str, path: str, body: Any = None,
             content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
        data = None if body is None else (body if isinstance(body, bytes)
                                          else json.dumps(body).encode())
        req = urllib.request.Request(self.cp.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            text = e.read()
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, {"message": text.decode(errors="replace")}

    def merge(self, path: str, patch: Any, subresource: str = "") -> tuple[int, dict[str, Any]]:
        return self.call("PATCH", path + (f"/{subresource}" if subresource else ""), patch,
                         "application/merge-patch+json")


def admin_call(cp: ControlPlane, method: str, path: str, body: Any = None) -> dict[str, Any]:
    status, text = cp.request(method, path, body)
    assert status in (200, 201), f"{method} {path}: HTTP {status}: {text[:600]}"
    return json.loads(text)


def token(cp: ControlPlane, namespace: str, sa: str, pod: Mapping[str, Any] | None = None) -> str:
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if pod is not None:
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod",
                                  "name": pod["metadata"]["name"],
                                  "uid": pod["metadata"]["uid"]}
    got = admin_call(cp, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
                     {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                      "spec": spec})
    return str(got["status"]["token"])


def pod_obj(name: str, *, node: str = "", annotations: Mapping[str, str] | None = None,
            mem: int = 4, sa: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "schedulerName": "ack-co-scheduler",
        "containers": [{"name": "main", "image": IMAGE,
                        "resources": {"limits": {"aliyun.com/gpu-mem": str(mem)}}}]}
    if node:
        spec["nodeName"] = node
    if sa:
        spec["serviceAccountName"] = sa
        spec["containers"][0].pop("resources")
    meta: dict[str, Any] = {"name": name}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@dataclass
class Guarded:
    cp: ControlPlane
    release_ns: str
    tenant_ns: str
    node_a: str
    node_b: str
    tenant: Identity
    extender: Identity
    agent: Identity  # token bound to a pod on node_a
    agent_unbound: Identity
    extender_user: str
    agent_user: str
    seq: list[int]

    def name(self, stem: str) -> str:
        self.seq[0] += 1
        return f"{stem}-{self.seq[0]}"

    def pod_path(self, name: str, ns: str | None = None) -> str:
        return f"/api/v1/namespaces/{ns or self.tenant_ns}/pods/{name}"

    def tenant_pod(self, stem: str, **kw: Any) -> str:
        name = self.name(stem)
        status, body = self.tenant.call("POST", f"/api/v1/namespaces/{self.tenant_ns}/pods",
                                        pod_obj(name, **kw))
        assert status == 201, body
        return name

    def bind(self, name: str, node: str, annotations: Mapping[str, str],
             who: Identity | None = None) -> tuple[int, dict[str, Any]]:
        """A Binding as the extender posts it (sharegpu.extender.kube.bind)."""
        body = {"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name, "namespace": self.tenant_ns,
                             "annotations": dict(annotations)},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        return (who or self.extender).call("POST", self.pod_path(name) + "/binding", body)

    def annotations(self, name: str) -> dict[str, str]:
        got = admin_call(self.cp, "GET", self.pod_path(name))
        return dict(got["metadata"].get("annotations") or {})


def decision(gpu: int = 0, mem: int = 4, assume: int = 1) -> dict[str, str]:
    """What the extender writes at bind for a memory-only pod (sharegpu.core.annotations)."""
    return encode(Allocation(mem={0: {gpu: mem}}), assume_time_ns=assume)


def refused(got: tuple[int, dict[str, Any]], *parts: str) -> str:
    status, body = got
    message = str(body.get("message", ""))
    assert status in (403, 422), (status, body)
    for p in parts:
        assert p in message, message
    return message


@pytest.fixture(scope="module")
def guarded(controlplane: ControlPlane) -> Iterator[Guarded]:
    cp = controlplane
    suffix = uuid.uuid4().hex[:6]
    release_ns, tenant_ns = f"sg-guard-{suffix}", f"tenant-{suffix}"
    node_a, node_b = f"guard-a-{suffix}", f"guard-b-{suffix}"
    docs = render_chart(RELEASE, release_ns)
    policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert len(policies) == len(bindings) == 5
    created: list[str] = []
    try:
        for ns in (release_ns, tenant_ns):
            admin_call(cp, "POST", "/api/v1/namespaces",
                       {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            created.append(f"/api/v1/namespaces/{ns}")
        for n in (node_a, node_b):
            admin_call(cp, "POST", "/api/v1/nodes", {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": n, "labels": {"ack.node.gpu.schedule": "cgpu"}}})
            created.append(f"/api/v1/nodes/{n}")
        # the chart's RBAC of the extender and the agent, as rendered
        for d in docs:
            if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding") and \
                    d["metadata"]["name"] in (f"{RELEASE}-extender", f"{RELEASE}-agent"):
                path = _path(d)
                admin_call(cp, "POST", path.rsplit("/", 1)[0], d)
                created.append(path)
        # a tenant: its namespace's pods (and Bindings, Deployments), nothing else
        admin_call(cp, "POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{tenant_ns}/roles",
                   {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                    "metadata": {"name": "tenant"},
                    "rules": [{"apiGroups": [""], "resources": ["pods", "pods/binding"],
                               "verbs": ["create", "get", "list", "update", "patch", "delete"]},
                              {"apiGroups": ["apps"], "resources": ["deployments"],
                               "verbs": ["create", "get", "update", "patch"]}]})
        admin_call(cp, "POST", f"/api/v1/namespaces/{tenant_ns}/serviceaccounts",
                   {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant"}})
        admin_call(cp, "POST",
                   f"/apis/rbac.authorization.k8s.io/v1/namespaces/{tenant_ns}/rolebindings",
                   {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                    "metadata": {"name": "tenant"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                "name": "tenant"},
                    "subjects": [{"kind": "ServiceAccount", "name": "tenant",
                                  "namespace": tenant_ns}]})
        # the agent's pod on node A: its bound token names the node
        agent_pod = admin_call(cp, "POST", f"/api/v1/namespaces/{release_ns}/pods",
                               pod_obj("agent", node=node_a, sa=f"{RELEASE}-agent"))
        for d in [*policies, *bindings]:
            path = _path(d)
            admin_call(cp, "POST", path.rsplit("/", 1)[0], d)
            created.append(path)
        g = Guarded(
            cp, release_ns, tenant_ns, node_a, node_b,
            tenant=Identity(cp, token(cp, tenant_ns, "tenant"),
                            f"system:serviceaccount:{tenant_ns}:tenant"),
            extender=Identity(cp, token(cp, release_ns, f"{RELEASE}-extender"), "extender"),
            agent=Identity(cp, token(cp, release_ns, f"{RELEASE}-agent", agent_pod), "agent"),
            agent_unbound=Identity(cp, token(cp, release_ns, f"{RELEASE}-agent"), "agent"),
            extender_user=f"system:serviceaccount:{release_ns}:{RELEASE}-extender",
            agent_user=f"system:serviceaccount:{release_ns}:{RELEASE}-agent",
            seq=[0])
        # RBAC and the policies take effect shortly after they are created
        probe = pod_obj("probe", node=node_a, annotations={ALLOC: '{"0":{"0":1}}'})

        def guard_on() -> bool:
            status, body = g.tenant.call(
                "POST", f"/api/v1/namespaces/{tenant_ns}/pods?dryRun=All", probe)
            return status == 403 and ALLOC in str(body.get("message"))

        wait_for("the tenant guard to refuse a forged decision", guard_on)
        yield g
    finally:
        for path in reversed(created):
            cp.request("DELETE", path)
        # the API server drops the policies shortly after: leave once the admin may write a
        # decision again (other tests write them as the admin)
        probe = pod_obj("probe", node=node_a, annotations={ALLOC: '{"0":{"0":1}}'})
        wait_for("the API server to drop the tenant guard", lambda: cp.request(
            "POST", "/api/v1/namespaces/default/pods?dryRun=All", probe)[0] == 201)


def _path(doc: Mapping[str, Any]) -> str:
    kind, name = doc["kind"], doc["metadata"]["name"]
    ns = doc["metadata"].get("namespace")
    if kind == "ServiceAccount":
        return f"/api/v1/namespaces/{ns}/serviceaccounts/{name}"
    if kind in ("ClusterRole", "ClusterRoleBinding"):
        return f"/apis/rbac.authorization.k8s.io/v1/{kind.lower()}s/{name}"
    if kind == "ValidatingAdmissionPolicy":
        return f"{VAP}/{name}"
    if kind == "ValidatingAdmissionPolicyBinding":
        return f"{VAPB}/{name}"
    raise AssertionError(kind)


# --- the extender's decision: only the extender writes it --------------------------------------


def test_rewriting_a_decision_is_refused_and_the_extenders_binding_passes(guarded: Guarded):
    g = guarded
    name = g.tenant_pod("moved")
    # the legitimate path: the extender's Binding with its annotations
    status, body = g.bind(name, g.node_a, decision(gpu=0, mem=16))
    assert status == 201, body
    anns = g.annotations(name)
    assert anns[ALLOC] == '{"0":{"0":16}}' and anns[ASSIGNED] == "false"
    # 1: the owner moves its pod to GPU 1 in the books
    path = g.pod_path(name)
    msg = refused(g.tenant.merge(path, {"metadata": {"annotations": {ALLOC: '{"0":{"1":16}}'}}}),
                  f"metadata.annotations[{ALLOC}]", g.extender_user, g.tenant.user,
                  "may not set, change or remove it")
    # removing it, and the first generation's index
    refused(g.tenant.merge(path, {"metadata": {"annotations": {ALLOC: None}}}), ALLOC)
    refused(g.tenant.merge(path, {"metadata": {"annotations": {MEM_IDX: "1"}}}), MEM_IDX,
            g.extender_user)
    # a JSON patch and a full update (PUT) say the same
    refused(g.tenant.call("PATCH", path, [{"op": "replace",
                                           "path": "/metadata/annotations/" + ALLOC.replace(
                                               "/", "~1"), "value": "{}"}],
                          "application/json-patch+json"), ALLOC)
    status, current = g.tenant.call("GET", path)
    assert status == 200
    changed = copy.deepcopy(current)
    changed["metadata"]["annotations"][ALLOC] = '{"0":{"1":16}}'
    refused(g.tenant.call("PUT", path, changed), ALLOC)
    # server-side apply arrives as an update too
    applied = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "annotations": {ALLOC: '{"0":{"1":16}}'}}}
    refused(g.tenant.call("PATCH", path + "?fieldManager=tenant&force=true",
                          json.dumps(applied).encode(), "application/apply-patch+yaml"), ALLOC)
    assert g.annotations(name)[ALLOC] == '{"0":{"0":16}}'
    # what is not a decision stays the owner's: labels, other annotations, an unchanged PUT
    status, _ = g.tenant.merge(path, {"metadata": {"labels": {"team": "a"},
                                                   "annotations": {"note": "mine"}}})
    assert status == 200
    status, current = g.tenant.call("GET", path)
    assert g.tenant.call("PUT", path, current)[0] == 200
    print(f"\nrefused: {msg}")


def test_forging_a_decision_at_creation_is_refused(guarded: Guarded):
    g = guarded
    for anns in ({ALLOC: '{"0":{"0":16}}'}, {MEM_IDX: "0", "ALIYUN_COM_GPU_MEM_POD": "16"},
                 {CORE: '{"0":{"0":100}}'}, {ASSIGNED: "true"}):
        key = sorted(anns)[0] if ASSIGNED not in anns else ASSIGNED
        refused(g.tenant.call("POST", f"/api/v1/namespaces/{g.tenant_ns}/pods",
                              pod_obj(g.name("forged"), node=g.node_a, annotations=anns)),
                key, g.tenant.user)
    # nor through a Binding of its own, nor in a template a controller copies into pods
    name = g.tenant_pod("self-bound")
    refused(g.bind(name, g.node_a, decision(), who=g.tenant), "Binding metadata.annotations[",
            g.extender_user, g.tenant.user)
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": g.name("forged-template")},
           "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "x"}},
                    "template": {"metadata": {"labels": {"app": "x"},
                                              "annotations": {ALLOC: '{"0":{"0":1}}'}},
                                 "spec": pod_obj("x")["spec"]}}}
    refused(g.tenant.call("POST", f"/apis/apps/v1/namespaces/{g.tenant_ns}/deployments", dep),
            f"spec.template.metadata.annotations[{ALLOC}]", g.extender_user)


def test_a_key_the_extender_did_not_write_and_the_assigned_mark(guarded: Guarded):
    g = guarded
    name = g.tenant_pod("memonly")
    assert g.bind(name, g.node_a, decision())[0] == 201
    path = g.pod_path(name)
    assert CORE not in g.annotations(name)
    # 3: a memory-only pod adds a compute share the kubelet will never ask for
    refused(g.tenant.merge(path, {"metadata": {"annotations": {CORE: '{"0":{"0":30}}'}}}),
            f"metadata.annotations[{CORE}]", g.extender_user)
    # the agent of the pod's node marks it assigned: passes
    status, body = g.agent.merge(path, {"metadata": {"annotations": {
        ASSIGNED: "true", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}}})
    assert status == 200, body.get("message")
    # the owner removes the mark, or sets it back
    msg = refused(g.tenant.merge(path, {"metadata": {"annotations": {ASSIGNED: None}}}),
                  f"metadata.annotations[{ASSIGNED}]", g.extender_user, g.agent_user,
                  "the sharegpu agent of the pod's node", g.tenant.user)
    refused(g.tenant.merge(path, {"metadata": {"annotations": {ASSIGNED: "false"}}}), ASSIGNED)
    assert g.annotations(name)[ASSIGNED] == "true"
    # the kubelet of the node writes the pod's status as always
    kubelet = g.cp.kubeconfig_for(f"system:node:{g.node_a}", ["system:nodes"])
    # (the node authorizer learns of the pod's node shortly after the bind)
    wait_for("the kubelet's pod status update", lambda: _as_kubelet_patch_status(
        g, kubelet, name) == 200, timeout=30)
    print(f"\nrefused: {msg}")


def _as_kubelet_patch_status(g: Guarded, kubeconfig: Any, name: str) -> int:
    from lightkube import ApiError, Client, KubeConfig
    from lightkube.resources.core_v1 import Pod
    from lightkube.types import PatchType

    client = Client(KubeConfig.from_file(kubeconfig))
    try:
        client.patch(Pod.Status, name, {"status": {"conditions": [
            {"type": "PodScheduled", "status": "True"}]}}, namespace=g.tenant_ns,
            patch_type=PatchType.STRATEGIC)
    except ApiError as e:
        return int(e.status.code or 0)
    return 200


def test_a_controller_creates_pods_from_a_clean_template(guarded: Guarded):
    g = guarded
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": g.name("clean")},
           "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "clean"}},
                    "template": {"metadata": {"labels": {"app": "clean"}},
                                 "spec": pod_obj("x")["spec"]}}}
    status, body = g.tenant.call("POST", f"/apis/apps/v1/namespaces/{g.tenant_ns}/deployments",
                                 dep)
    assert status == 201, body

    def pods() -> bool:
        got = admin_call(g.cp, "GET",
                         f"/api/v1/namespaces/{g.tenant_ns}/pods?labelSelector=app%3Dclean")
        return bool(got["items"])

    wait_for("the ReplicaSet controller to create the Deployment's pod", pods)


# --- the agent: only its own node ---------------------------------------------------------------


def test_the_agent_writes_only_its_own_node(guarded: Guarded):
    g = guarded
    a, b = f"/api/v1/nodes/{g.node_a}", f"/api/v1/nodes/{g.node_b}"
    # its own node: the card labels, sharegpu.io/ annotations, its condition
    status, body = g.agent.merge(a, {"metadata": {
        "labels": {"aliyun.accelerator/nvidia_name": "Tesla-T4",
                   "aliyun.accelerator/nvidia_count": "2"},
        "annotations": {"sharegpu.io/gpu-mem": "15,15", "sharegpu.io/pod-resources": "v1"}}})
    assert status == 200, body.get("message")
    cond = {"type": "GPUIsolationReady", "status": "True", "reason": "HamiCoreLoaded",
            "message": "ok"}
    status, body = g.agent.call("PATCH", a + "/status", {"status": {"conditions": [cond]}},
                                "application/strategic-merge-patch+json")
    assert status == 200, body.get("message")
    # 6: another node, by any route
    msg = refused(g.agent.merge(b, {"metadata": {"labels": {"aliyun.accelerator/nvidia_count":
                                                            "8"}}}),
                  f"the sharegpu agent of node {g.node_a} may update only node {g.node_a}")
    refused(g.agent.call("PATCH", b + "/status", {"status": {"conditions": [cond]}},
                         "application/strategic-merge-patch+json"), g.node_a)
    refused(g.agent.call("PATCH", b + "/status", {"status": {"allocatable": {
        "aliyun.com/gpu-mem": "1000"}}}, "application/strategic-merge-patch+json"), g.node_a)
    # on its own node: nothing that is not sharegpu's
    refused(g.agent.merge(a, {"metadata": {"labels": {"ack.node.gpu.schedule": "exclusive"}}}),
            "metadata.labels[ack.node.gpu.schedule]")
    refused(g.agent.merge(a, {"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}),
            "spec: the sharegpu agent does not change its node's spec")
    refused(g.agent.merge(a, {"metadata": {"annotations": {"other.io/x": "y"}}}),
            "metadata.annotations[other.io/x]")
    refused(g.agent.call("PATCH", a + "/status", {"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "x", "message": "x"}]}},
        "application/strategic-merge-patch+json"), "status.conditions")
    refused(g.agent.call("PATCH", a + "/status", {"status": {"allocatable": {
        "aliyun.com/gpu-mem": "1000"}}}, "application/strategic-merge-patch+json"),
        "status.capacity/status.allocatable")
    # a token that is not its pod's names no node: refused everything
    refused(g.agent_unbound.merge(a, {"metadata": {"annotations": {
        "sharegpu.io/gpu-mem": "1"}}}), "no node")
    print(f"\nrefused: {msg}")


def test_the_agent_marks_only_pods_of_its_node(guarded: Guarded):
    g = guarded
    here, there = g.tenant_pod("here"), g.tenant_pod("there")
    assert g.bind(here, g.node_a, decision())[0] == 201
    assert g.bind(there, g.node_b, decision())[0] == 201
    mark = {"metadata": {"annotations": {ASSIGNED: "true"}}}
    assert g.agent.merge(g.pod_path(here), mark)[0] == 200
    # (two policies refuse these; the API server answers with either's message)
    msg = refused(g.agent.merge(g.pod_path(there), mark), f"of node {g.node_a}")
    assert "may only mark pods bound to its node" in msg or f"[{ASSIGNED}]" in msg, msg
    msg2 = refused(g.agent_unbound.merge(g.pod_path(here), mark))
    assert "no node" in msg2 or f"[{ASSIGNED}]" in msg2, msg2
    # on its own node: only the marks, not the image, labels or a decision
    refused(g.agent.call("PATCH", g.pod_path(here), [
        {"op": "replace", "path": "/spec/containers/0/image", "value": "registry.invalid/evil:1"}],
        "application/json-patch+json"), "changes nothing of a pod")
    refused(g.agent.merge(g.pod_path(here), {"metadata": {"labels": {"x": "y"}}}),
            "changes nothing of a pod")
    refused(g.agent.merge(g.pod_path(here), {"metadata": {"annotations": {
        ALLOC: '{"0":{"1":4}}'}}}), ALLOC)
    # nor delete a pod (its ClusterRole has no delete; the API server says so first)
    assert g.agent.call("DELETE", g.pod_path(here))[0] == 403
    print(f"\nrefused: {msg}")


# --- 5 at admission: the webhook refuses routes to a container's own limits ----------------------


@pytest.fixture(scope="module")
def limits_hook(guarded: Guarded, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The chart's webhook process on 127.0.0.1 and its pod and pod-template hooks registered
    (only clientConfig changed); yields the configuration's name."""
    g = guarded
    docs = render_chart(RELEASE, g.release_ns)
    (vwc,) = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"
              and d["metadata"]["name"] == vwc["metadata"]["name"]]
    certs = make_certificates(tmp_path_factory.mktemp("guard-webhook-tls"), hosts=("127.0.0.1",))
    port = free_port()
    proc = SharegpuProcess(g.cp, f"guard-webhook-{port}",
                           local_webhook_args(dep, port, certs.cert, certs.key)).start()
    name = f"{vwc['metadata']['name']}-guard-e2e"
    try:
        ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
        proc.wait_http(f"https://127.0.0.1:{port}/healthz", timeout=30, context=ctx)
        mine = copy.deepcopy(vwc)
        mine["metadata"]["name"] = name
        mine["webhooks"] = [w for w in mine["webhooks"] if w["name"] in (
            "pods.validate.sharegpu.io", "podtemplates.validate.sharegpu.io")]
        assert len(mine["webhooks"]) == 2
        for w in mine["webhooks"]:
            assert w["failurePolicy"] == "Fail"
            w["clientConfig"] = {"url": f"https://127.0.0.1:{port}/validate",
                                 "caBundle": base64.b64encode(certs.ca_cert.read_bytes()).decode()}
        admin_call(g.cp, "POST", VWC, mine)
        bad = pod_obj("probe")
        bad["spec"]["containers"][0]["env"] = [{"name": "LD_PRELOAD", "value": "x"}]
        wait_for("the API server to call the webhook", lambda: g.tenant.call(
            "POST", f"/api/v1/namespaces/{g.tenant_ns}/pods?dryRun=All", bad)[0] == 422)
        yield name
    finally:
        proc.stop()
        g.cp.request("DELETE", f"{VWC}/{name}")
        probe = pod_obj("probe")
        wait_for("the API server to drop the webhook configuration", lambda: g.tenant.call(
            "POST", f"/api/v1/namespaces/{g.tenant_ns}/pods?dryRun=All", probe)[0] == 201)


ROUTES = {
    "env": ({"env": [{"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "80g"}]},
            "spec.containers[0].env[0].name='CUDA_DEVICE_MEMORY_LIMIT_0'"),
    "configmap": ({"envFrom": [{"configMapRef": {"name": "limits"}}]},
                  "spec.containers[0].envFrom[0]: "),
    "configmap-prefix": ({"envFrom": [{"prefix": "CUDA_DEVICE_",
                                       "configMapRef": {"name": "limits"}}]},
                         "spec.containers[0].envFrom[0].prefix: "),
    "secret-mps": ({"envFrom": [{"prefix": "CUDA_MPS_", "secretRef": {"name": "mps"}}]},
                   "spec.containers[0].envFrom[0].prefix: "),
    "ld-preload": ({"env": [{"name": "LD_PRELOAD", "value": "/my/hook.so"}]},
                   "spec.containers[0].env[0].name='LD_PRELOAD'"),
    "preload-list": ({"volumeMounts": [{"name": "etc", "mountPath": "/etc"}]},
                     "spec.containers[0].volumeMounts[0].mountPath='/etc'"),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_shared_gpu_container_cannot_set_its_own_limits(guarded: Guarded, limits_hook: str,
                                                          route: str):
    g = guarded
    extra, field = ROUTES[route]
    p = pod_obj(g.name(route))
    p["spec"]["containers"][0].update(extra)
    if "volumeMounts" in extra:
        p["spec"]["volumes"] = [{"name": "etc", "emptyDir": {}}]
    msg = refused(g.tenant.call("POST", f"/api/v1/namespaces/{g.tenant_ns}/pods", p), field,
                  "under isolation")
    # the same in a Deployment's template, at creation and when an update brings it in
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": g.name(route)},
           "spec": {"replicas": 0, "selector": {"matchLabels": {"app": route}},
                    "template": {"metadata": {"labels": {"app": route}}, "spec": p["spec"]}}}
    base = f"/apis/apps/v1/namespaces/{g.tenant_ns}/deployments"
    refused(g.tenant.call("POST", base, dep), "spec.template." + field)
    clean = copy.deepcopy(dep)
    clean["spec"]["template"]["spec"] = pod_obj("x")["spec"]
    assert g.tenant.call("POST", base, clean)[0] == 201
    refused(g.tenant.merge(f"{base}/{dep['metadata']['name']}",
                           {"spec": {"template": {"spec": p["spec"]}}}), "spec.template.")
    print(f"\nrefused: {msg[:200]}")


def test_a_safe_prefix_passes(guarded: Guarded, limits_hook: str):
    g = guarded
    p = pod_obj(g.name("app-prefix"))
    p["spec"]["containers"][0]["envFrom"] = [{"prefix": "APP_", "configMapRef": {"name": "c"}}]
    status, body = g.tenant.call("POST", f"/api/v1/namespaces/{g.tenant_ns}/pods?dryRun=All", p)
    assert status == 201, body
