"""The Helm chart against the REAL control plane (kube-apiserver, kube-controller-manager,
kube-scheduler v1.37.2; see controlplane.py), and sharegpu's components talking to it as the
chart's own ServiceAccounts.

- ``helm install`` of the default chart: the API server accepts every object helm sends. The
  default chart has NO CustomResourceDefinitions: it ships no ``crds/`` directory (``helm show
  crds`` prints nothing) and renders no CustomResourceDefinition; the only non-built-in kinds it
  knows (ServiceMonitor, cert-manager's Certificate/Issuer) are rendered only with non-default
  values, so the default install needs no CRD at all.
- The ValidatingWebhookConfiguration the API server stored carries a caBundle that verifies the
  certificate in the chart's TLS Secret (checked with ``cryptography`` and by a real TLS handshake
  against ``sharegpu webhook`` serving that Secret), and that certificate names the webhook
  Service's DNS names.
- kube-controller-manager turns the chart's Deployments into ReplicaSets and Pods (Pending: no
  kubelet), and its DaemonSet puts an agent Pod on a GPU node (tolerating the GPU taint).
- ``sharegpu extender`` and ``sharegpu agent`` run as local processes with tokens of the chart's
  ServiceAccounts (TokenRequest), with the arguments the chart gives them (only addresses, paths,
  the fake NVML and the isolation back-end changed), so a missing RBAC rule shows up as a failure
  (and a 403 in their logs); what each ServiceAccount may do, as the API server resolves it
  (SelfSubjectRulesReview as that ServiceAccount, SubjectAccessReview as admin), is exactly the
  least-privilege table of tests/test_chart.py (ALLOWED): nothing more, nothing less. The webhook
  has no API access and no token.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import importlib.util
import json
import re
import socket
import ssl
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from lightkube import ApiError, Client, KubeConfig
from lightkube.models.authorization_v1 import (
    ResourceAttributes,
    SelfSubjectRulesReviewSpec,
    SubjectAccessReviewSpec,
)
from lightkube.resources.authorization_v1 import SelfSubjectRulesReview, SubjectAccessReview
from lightkube.resources.core_v1 import Event, Namespace, Node, Pod
from lightkube.types import PatchType

from .components import (
    CHART,
    SharegpuProcess,
    agent_kubeconfig,
    chart_docs,
    create_node,
    free_port,
    helm,
    install_chart,
    scheduler_config,
    wait_for,
)
from .controlplane import ControlPlane
from .realcluster import LocalExtender, write_tls

T = TypeVar("T")
RELEASE = "sharegpu-chart"  # contains the chart's name: the objects are "sharegpu-chart-<part>"
COMPONENTS = ("extender", "agent", "webhook", "scheduler")
EXTENDER_LEASE = "sharegpu-extender"  # values.yaml extender.leaderElection.leaseName
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration",
                  "CustomResourceDefinition", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding"}
# what every authenticated user may do (system:basic-user, reading ClusterTrustBundles): not
# the chart's doing
BASELINE_RESOURCES = {("authorization.k8s.io", "selfsubjectaccessreviews"),
                      ("authorization.k8s.io", "selfsubjectrulesreviews"),
                      ("authentication.k8s.io", "selfsubjectreviews"),
                      ("certificates.k8s.io", "clustertrustbundles")}


def _load_chart_tests() -> Any:
    """tests/test_chart.py, for its least-privilege table (ALLOWED) and BUILTIN roles."""
    path = Path(__file__).resolve().parents[1] / "test_chart.py"
    spec = importlib.util.spec_from_file_location("sharegpu_test_chart_tables", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CHART_TESTS = _load_chart_tests()
ALLOWED: dict[str, set[tuple[str, str, str, str | None]]] = CHART_TESTS.ALLOWED
BUILTIN: dict[str, set[tuple[str, str]]] = CHART_TESTS.BUILTIN




def get_json(cp: ControlPlane, path: str) -> dict[str, Any]:
    status, body = cp.request("GET", path)
    assert status == 200, f"GET {path}: HTTP {status}: {body[:500]}"
    return json.loads(body)


def api_path(doc: Mapping[str, Any]) -> str:
    """The REST path of a manifest object (the kinds the chart renders have regular plurals:
    -s, or -ies after a consonant and y, as NetworkPolicy)."""
    group_version = doc["apiVersion"]
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    kind = doc["kind"].lower()
    plural = kind[:-1] + "ies" if kind.endswith("y") and kind[-2] not in "aeiou" else kind + "s"
    ns = doc["metadata"].get("namespace")
    if doc["kind"] in CLUSTER_SCOPED:
        return f"{base}/{plural}/{doc['metadata']['name']}"
    assert ns, f"{doc['kind']} {doc['metadata']['name']} has no namespace"
    return f"{base}/namespaces/{ns}/{plural}/{doc['metadata']['name']}"


def with_flags(args: Sequence[str], **flags: str | None) -> list[str]:
    """A chart container's args with ``--flag=value`` replaced (or added; None removes it).
    Keyword names use ``_`` for ``-``."""
    wanted = {"--" + k.replace("_", "-"): v for k, v in flags.items()}
    out: list[str] = []
    for a in args:
        name = a.split("=", 1)[0]
        if name in wanted:
            continue
        out.append(a)
    out += [f"{k}={v}" for k, v in wanted.items() if v is not None]
    return out


def container_args(cp: ControlPlane, ns: str, kind: str, name: str) -> list[str]:
    """The args of the first container of a Deployment/DaemonSet, as the API server stored it."""
    obj = get_json(cp, f"/apis/apps/v1/namespaces/{ns}/{kind.lower()}s/{name}")
    return list(obj["spec"]["template"]["spec"]["containers"][0]["args"])


def log_problems(proc: SharegpuProcess) -> list[str]:
    """Lines of a component's log that show an authorization failure."""
    bad = []
    for line in proc.log.read_text(errors="replace").splitlines():
        if line.startswith("===="):  # the command line written by SharegpuProcess
            continue
        if "forbidden" in line.lower() or re.search(r"(?<![,.=\d])\b403\b", line):
            bad.append(line)
    return bad


# ---------------------------------------------------------------------------------------------
# The release


class Release:
    def __init__(self, cp: ControlPlane, namespace: str, manifest: list[dict[str, Any]]) -> None:
        self.cp, self.namespace, self.manifest = cp, namespace, manifest
        self.admin = Client(KubeConfig.from_file(cp.admin_kubeconfig))

    def name(self, part: str) -> str:
        return f"{RELEASE}-{part}"

    def sa_client(self, component: str) -> Client:
        kubeconfig = self.cp.service_account_kubeconfig(self.namespace, self.name(component),
                                                        create=False)
        return Client(KubeConfig.from_file(kubeconfig))

    def docs(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.manifest if d["kind"] == kind]


def _gpu_pod_admitted(cp: ControlPlane) -> bool:
    """Whether a GPU pod in namespace default passes admission now (dry run), with a decision
    written by the admin too."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "probe-"},
           "spec": {"schedulerName": "ack-co-scheduler",
                    "containers": [{"name": "c", "image": "registry.invalid/x",
                                    "resources": {"limits": {"aliyun.com/gpu-mem": "1"}}}]}}
    status, _ = cp.request("POST", "/api/v1/namespaces/default/pods?dryRun=All", pod)
    if status != 201:
        return False
    # and the chart's tenant guard is gone: the admin may write a decision again
    pod["metadata"]["annotations"] = {"scheduler.framework.gpushare.allocation": "{}"}
    status, _ = cp.request("POST", "/api/v1/namespaces/default/pods?dryRun=All", pod)
    return status == 201


@pytest.fixture(scope="module")
def release(controlplane: ControlPlane) -> Iterator[Release]:
    namespace = f"{RELEASE}-{uuid.uuid4().hex[:6]}"
    admin = Client(KubeConfig.from_file(controlplane.admin_kubeconfig))
    try:
        t0 = time.monotonic()
        manifest = install_chart(controlplane, namespace, release=RELEASE)
        print(f"\nhelm install took {time.monotonic() - t0:.1f}s")
        yield Release(controlplane, namespace, manifest)
    finally:
        with contextlib.suppress(AssertionError):  # nothing to uninstall if install failed
            helm(controlplane, "uninstall", RELEASE, "-n", namespace, "--wait",
                 "--timeout", "60s")
        with contextlib.suppress(ApiError):
            # Pods bound to a kubelet-less node would wait for a kubelet forever.
            for p in admin.list(Pod, namespace=namespace):
                admin.delete(Pod, p.metadata.name, namespace=namespace, grace_period=0)
            admin.delete(Namespace, namespace)
        # The chart's webhook (failurePolicy Fail, nothing behind its Service) and its tenant
        # guard must not outlive the release in the API server's caches: later tests create
        # GPU pods and write decisions as the admin.
        wait_for("the API server to drop the chart's webhook", lambda: _gpu_pod_admitted(
            controlplane), timeout=30)


# ---------------------------------------------------------------------------------------------
# 1. helm install into the real API server


def test_helm_install_every_object_accepted(release: Release) -> None:
    cp, ns = release.cp, release.namespace
    rendered = chart_docs(ns)
    ident = sorted((d["kind"], d["metadata"]["name"]) for d in release.manifest)
    # what helm applied is what the chart renders (helm template), object for object
    assert ident == sorted((d["kind"], d["metadata"]["name"].replace("sharegpu", RELEASE, 1))
                           for d in rendered)
    kinds = {d["kind"] for d in release.manifest}
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
            "Secret", "ConfigMap", "Service", "Deployment", "DaemonSet",
            "ValidatingWebhookConfiguration"} <= kinds
    # two CRDs, rendered as templates (upgraded with the release; nothing in crds/):
    # ResourcePolicy's and the gang PodGroup's, which the API server accepts in its protected
    # *.k8s.io group and serves
    assert helm(None, "show", "crds", str(CHART)).strip() == ""
    assert not (CHART / "crds").exists()
    crds = sorted(d["metadata"]["name"] for d in release.manifest
                  if d["kind"] == "CustomResourceDefinition")
    assert crds == ["podgroups.scheduling.sigs.k8s.io",
                    "resourcepolicies.scheduling.alibabacloud.com"]
    for name in crds:
        crd = get_json(cp, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/" + name)
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions.get("NamesAccepted") == "True"
    assert kinds.isdisjoint(CHART_TESTS.CRD_KINDS)
    # every object is in the API server, owned by the release
    for d in release.manifest:
        obj = get_json(cp, api_path(d))
        assert obj["kind"] == d["kind"]
        assert obj["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    status = json.loads(helm(cp, "status", RELEASE, "-n", ns, "-o", "json"))
    assert status["info"]["status"] == "deployed"


def test_resourcepolicy_schema_refuses_then_the_webhook_fails_closed(release: Release) -> None:
    """The chart's CRD, served by kube-apiserver: a malformed ResourcePolicy is refused by the
    schema naming the field; a valid one reaches the webhook, which (no webhook pod runs here)
    fails closed."""
    cp = release.cp
    path = ("/apis/scheduling.alibabacloud.com/v1alpha1/namespaces/default/resourcepolicies"
            "?dryRun=All")
    deadline = time.monotonic() + 30
    while True:  # the CRD is established a moment after it is created
        status, body = cp.request("POST", path, CHART_TESTS._policy(units=[{"max": -1}]))
        if status != 404 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 422, body
    assert "spec.units[0].max" in body
    status, body = cp.request("POST", path, CHART_TESTS._policy())
    assert status >= 400 and "resourcepolicies.validate.sharegpu.io" in body, body


def _collection(doc: Mapping[str, Any]) -> str:
    path = api_path(doc)
    return path.rsplit("/", 1)[0]


@pytest.mark.parametrize("example", ["(default values)", *sorted(
    p.name for p in (CHART / "examples").glob("*.yaml"))])
def test_every_example_is_accepted_by_the_api_server(release: Release, example: str) -> None:
    """The default values and each example values file, rendered, pass the real API server's
    validation (strict: an unknown field is an error) and admission (server-side dry run:
    nothing is stored). The kinds that need a CRD
    (ServiceMonitor, cert-manager's) are refused as unknown: those examples need the Prometheus
    Operator or cert-manager installed first, as they say."""
    cp, ns = release.cp, release.namespace
    name = f"sharegpu-x{uuid.uuid4().hex[:4]}"  # names that collide with nothing installed
    values = [] if example.startswith("(") else ["-f", str(CHART / "examples" / example)]
    rendered = helm(None, "template", name, str(CHART), "-n", ns, "--kube-version", "1.37.2",
                    *values)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert docs
    for d in docs:
        if d["kind"] == "CustomResourceDefinition":
            # cluster-wide and named by its group: the release installed it already, so the
            # rendered one is checked as an update of it
            d = json.loads(json.dumps(d))
            d["metadata"]["resourceVersion"] = get_json(cp, api_path(d))["metadata"][
                "resourceVersion"]
            status, body = cp.request("PUT", api_path(d) + "?dryRun=All&fieldValidation=Strict",
                                      d)
            assert status == 200, f"{example}: {d['kind']} {d['metadata']['name']}: {body}"
            continue
        status, body = cp.request("POST", _collection(d) + "?dryRun=All&fieldValidation=Strict",
                                  d)
        if d["kind"] in CHART_TESTS.CRD_KINDS:
            assert status == 404, (d["kind"], body[:300])
        elif d["kind"] == "CustomResourceDefinition" and status == 409:
            # cluster-wide and named by its group: the release installed this very object
            assert d["metadata"]["name"] in body, body[:300]
        else:
            assert status == 201, f"{example}: {d['kind']} {d['metadata']['name']}: {body}"


def _cert(pem: bytes) -> Any:
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem)


def _handshake(port: int, ca_pem: str, hostname: str) -> str:
    """GET /healthz over TLS to 127.0.0.1:port, verifying the server as ``hostname``."""
    ctx = ssl.create_default_context(cadata=ca_pem)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=hostname) as tls:
        tls.sendall(f"GET /healthz HTTP/1.1\r\nHost: {hostname}\r\nConnection: close\r\n\r\n"
                    .encode())
        data = b""
        while chunk := tls.recv(4096):
            data += chunk
    return data.decode(errors="replace")


def test_webhook_ca_bundle_verifies_the_chart_certificate(release: Release,
                                                         tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    cp, ns = release.cp, release.namespace
    name = release.name("webhook")
    vwc = get_json(cp, f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/"
                       f"{name}")
    hook = CHART_TESTS.pods_hook(vwc)
    svc_ref = hook["clientConfig"]["service"]
    assert (svc_ref["name"], svc_ref["namespace"], svc_ref["path"], svc_ref["port"]) == (
        name, ns, "/validate", 443)
    ca_pem = base64.b64decode(hook["clientConfig"]["caBundle"])
    ca = _cert(ca_pem)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True

    secret = get_json(cp, f"/api/v1/namespaces/{ns}/secrets/{name}-tls")
    assert secret["type"] == "kubernetes.io/tls"
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert data["ca.crt"] == ca_pem
    leaf = _cert(data["tls.crt"])
    # the caBundle's CA signed the serving certificate (signature checked)
    leaf.verify_directly_issued_by(ca)
    now = dt.datetime.now(dt.UTC)
    assert leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc
    assert ca.not_valid_before_utc <= now <= ca.not_valid_after_utc
    # the key in the Secret is the certificate's
    key = serialization.load_pem_private_key(data["tls.key"], password=None)
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    assert key.public_key().public_bytes(serialization.Encoding.PEM, pub) == \
        leaf.public_key().public_bytes(serialization.Encoding.PEM, pub)
    # a server certificate (Go's verifier checks the extended key usage) for the Service's names
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    dns = set(leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
              .get_values_for_type(x509.DNSName))
    # the API server calls a service webhook as <service>.<namespace>.svc
    assert {f"{name}.{ns}.svc", f"{name}.{ns}", name} <= dns
    service = get_json(cp, f"/api/v1/namespaces/{ns}/services/{name}")
    (port,) = service["spec"]["ports"]
    assert port["port"] == 443 and port["targetPort"] == "https"
    dep = get_json(cp, f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    assert {"name": "https", "containerPort": 9443, "protocol": "TCP"} in ctr["ports"]
    assert "--listen=0.0.0.0:9443" in ctr["args"]
    mounted = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert mounted["tls"]["secret"]["secretName"] == f"{name}-tls"

    # A real TLS handshake: `sharegpu webhook`, started with the chart's args and the Secret's
    # certificate, is verified with the caBundle under the Service's DNS name, as the API server
    # would; under another name verification fails.
    (tmp_path / "tls.crt").write_bytes(data["tls.crt"])
    (tmp_path / "tls.key").write_bytes(data["tls.key"])
    (tmp_path / "tls.key").chmod(0o600)
    listen = free_port()
    args = with_flags(ctr["args"], listen=f"127.0.0.1:{listen}",
                      tls_cert=str(tmp_path / "tls.crt"), tls_key=str(tmp_path / "tls.key"))
    proc = SharegpuProcess(cp, "chart-webhook", args).start()  # no kubeconfig: none needed
    try:
        ctx = ssl.create_default_context(cadata=ca_pem.decode())
        ctx.check_hostname = False  # only to wait for the port; names are checked below
        proc.wait_http(f"https://127.0.0.1:{listen}/healthz", timeout=30, context=ctx)
        answer = _handshake(listen, ca_pem.decode(), f"{name}.{ns}.svc")
        assert answer.startswith("HTTP/1.1 200") and answer.endswith("ok"), answer
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(listen, ca_pem.decode(), f"other.{ns}.svc")
    finally:
        proc.stop()
    assert not proc.alive()


def test_upgrade_keeps_the_webhook_certificate(release: Release) -> None:
    """``helm upgrade`` looks the TLS Secrets up in the real API server (``lookup``: empty under
    ``helm template``) and keeps the CA, the certificate and the caBundle, so the webhook's pods
    are not restarted and the API server keeps trusting them; likewise the extender's
    certificate and the caData of the scheduler's configuration (neither Deployment rolls)."""
    cp, ns = release.cp, release.namespace
    name = release.name("webhook")
    vwc_path = f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}"
    secret_path = f"/api/v1/namespaces/{ns}/secrets/{name}-tls"
    dep_path = f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"
    ext = release.name("extender")
    ext_secret = f"/api/v1/namespaces/{ns}/secrets/{ext}-tls"
    ext_client_secret = f"/api/v1/namespaces/{ns}/secrets/{ext}-client-tls"
    ext_dep = f"/apis/apps/v1/namespaces/{ns}/deployments/{ext}"
    sched_cm = f"/api/v1/namespaces/{ns}/configmaps/{release.name('scheduler')}-config"
    sched_dep = f"/apis/apps/v1/namespaces/{ns}/deployments/{release.name('scheduler')}"

    def state() -> tuple[Any, ...]:
        return (get_json(cp, secret_path)["data"],
                get_json(cp, vwc_path)["webhooks"][0]["clientConfig"]["caBundle"],
                get_json(cp, dep_path)["spec"]["template"],
                # the extender's certificate and the CA kube-scheduler verifies it with
                get_json(cp, ext_secret)["data"], get_json(cp, ext_dep)["spec"]["template"],
                get_json(cp, sched_cm)["data"], get_json(cp, sched_dep)["spec"]["template"],
                # kube-scheduler's client certificate for the extender
                get_json(cp, ext_client_secret)["data"])

    before = state()
    ca_data = yaml.safe_load(before[5]["config.yaml"])["extenders"][0]["tlsConfig"]["caData"]
    assert ca_data == before[3]["ca.crt"]
    helm(cp, "upgrade", RELEASE, str(CHART), "-n", ns)
    assert json.loads(helm(cp, "status", RELEASE, "-n", ns, "-o", "json"))["version"] == 2
    assert state() == before
    # the certificate made once per render (kept in .Values while rendering) is not stored as a
    # value of the release
    values = json.loads(helm(cp, "get", "values", RELEASE, "-n", ns, "--all", "-o", "json"))
    assert "_extenderTLS" not in values
    assert "LS0tLS1CRUdJTi" not in json.dumps(values)  # base64 of "-----BEGIN": no PEM at all


def test_controllers_run_the_chart_workloads(release: Release) -> None:
    cp, ns, admin = release.cp, release.namespace, release.admin
    deployments = release.docs("Deployment")
    assert {d["metadata"]["name"] for d in deployments} == {
        release.name(c) for c in ("extender", "scheduler", "webhook")}
    for d in deployments:
        name, replicas = d["metadata"]["name"], d["spec"]["replicas"]
        selector = ",".join(f"{k}={v}" for k, v in d["spec"]["selector"]["matchLabels"].items())

        def replica_set(name: str = name, selector: str = selector) -> dict | None:
            items = get_json(cp, f"/apis/apps/v1/namespaces/{ns}/replicasets?"
                                 f"labelSelector={selector}")["items"]
            owned = [rs for rs in items
                     if rs["metadata"]["ownerReferences"][0]["name"] == name]
            return owned[0] if owned and owned[0].get("status", {}).get("replicas") else None

        rs = wait_for(f"a ReplicaSet of Deployment {name}", replica_set)
        assert rs["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
        assert rs["spec"]["replicas"] == replicas

        def pods(rs_name: str = rs["metadata"]["name"], selector: str = selector,
                 replicas: int = replicas) -> list[dict] | None:
            items = get_json(cp, f"/api/v1/namespaces/{ns}/pods?labelSelector={selector}")[
                "items"]
            mine = [p for p in items if p["metadata"]["ownerReferences"][0]["name"] == rs_name]
            # ... and the scheduler has looked at each of them
            seen = [p for p in mine if any(c["type"] == "PodScheduled"
                                           for c in p["status"].get("conditions") or [])]
            return mine if len(mine) == replicas and len(seen) == replicas else None

        created = wait_for(f"{replicas} pods of {rs['metadata']['name']}", pods)
        no_nodes = not list(admin.list(Node))
        for p in created:
            assert p["status"]["phase"] == "Pending", p["status"]  # no kubelet runs them
            if no_nodes:
                (cond,) = [c for c in p["status"]["conditions"] if c["type"] == "PodScheduled"]
                assert (cond["status"], cond["reason"]) == ("False", "Unschedulable")

    (ds,) = release.docs("DaemonSet")
    got = wait_for("the DaemonSet controller to observe the agent DaemonSet", lambda: (
        d := get_json(cp, f"/apis/apps/v1/namespaces/{ns}/daemonsets/{ds['metadata']['name']}"))
        .get("status", {}).get("observedGeneration") == d["metadata"]["generation"] and d)
    assert got["status"]["numberMisscheduled"] == 0
    assert got["spec"]["template"]["spec"]["priorityClassName"] == "system-node-critical"

    # The webhook's pods get no ServiceAccount token; the extender's do.
    def volumes(component: str) -> list[dict]:
        items = get_json(cp, f"/api/v1/namespaces/{ns}/pods?labelSelector="
                             f"app.kubernetes.io/component={component}")["items"]
        assert items
        return [v for p in items for v in p["spec"].get("volumes") or []]

    def has_token(vols: list[dict]) -> bool:
        return any("serviceAccountToken" in s for v in vols
                   for s in (v.get("projected") or {}).get("sources") or [])

    assert not has_token(volumes("webhook"))
    assert has_token(volumes("extender"))


# ---------------------------------------------------------------------------------------------
# 2. The components run as the chart's ServiceAccounts


@pytest.fixture
def gpu_node(release: Release) -> Iterator[str]:
    """A kubelet-less GPU Node in cgpu mode (two 15 GiB GPUs, advertised as the kubelet would
    once the agent's device plugins registered), with the taint GPU nodes commonly carry."""
    admin = release.admin
    name = create_node(admin, f"e2e-gpu-{uuid.uuid4().hex[:6]}",
                       labels={"ack.node.gpu.schedule": "cgpu"},
                       resources={"aliyun.com/gpu-mem": "30", "aliyun.com/gpu-count": "2"})
    admin.patch(Node, name, {"spec": {"taints": [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]}},
        patch_type=PatchType.MERGE)
    try:
        yield name
    finally:
        for p in admin.list(Pod, namespace="*", fields={"spec.nodeName": name}):
            admin.delete(Pod, p.metadata.name, namespace=p.metadata.namespace, grace_period=0)
        admin.delete(Node, name)


def start_extender(release: Release, identity: str) -> LocalExtender:
    """``sharegpu extender`` with the chart's args, as the chart's ServiceAccount, serving the
    chart's TLS Secret (as the API server stores it) over TLS; ready."""
    cp, ns = release.cp, release.namespace
    name = release.name("extender")
    kubeconfig = cp.service_account_kubeconfig(ns, name, create=False)
    port, metrics = free_port(), free_port()
    chart_args = container_args(cp, ns, "Deployment", name)
    assert f"--lease-namespace={ns}" in chart_args
    assert f"--lease-name={EXTENDER_LEASE}" in chart_args
    assert "--insecure" not in chart_args
    server_name = next(a.split("=", 1)[1] for a in chart_args
                       if a.startswith("--tls-server-name="))
    assert server_name == f"{name}.{ns}.svc"
    secret = get_json(cp, f"/api/v1/namespaces/{ns}/secrets/{name}-tls")
    tls = write_tls(cp.workdir / f"chart-tls-{identity}",
                    {k: base64.b64decode(v) for k, v in secret["data"].items()})
    assert "--tls-client-ca=/tls/ca.crt" in chart_args
    client_secret = get_json(cp, f"/api/v1/namespaces/{ns}/secrets/{name}-client-tls")
    client = write_tls(cp.workdir / f"chart-client-tls-{identity}",
                       {k: base64.b64decode(v) for k, v in client_secret["data"].items()},
                       keys=("tls.crt", "tls.key"))
    # no pod to label here (the chart's --own-pod names it through the Downward API)
    chart_args = [a for a in chart_args if not a.startswith("--own-pod=")]
    args = with_flags(chart_args, listen=f"127.0.0.1:{port}", id=identity,
                      kubeconfig=str(kubeconfig), metrics_listen=f"127.0.0.1:{metrics}",
                      tls_cert=str(tls / "tls.crt"), tls_key=str(tls / "tls.key"),
                      tls_ca=str(tls / "ca.crt"), tls_client_ca=str(tls / "ca.crt"))
    proc = SharegpuProcess(cp, f"chart-{identity}", args).start()
    ext = LocalExtender(proc, f"https://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}",
                        (tls / "ca.crt").read_text(), server_name, client)
    try:
        proc.wait_http(f"{ext.metrics_url}/readyz", timeout=60)
    except BaseException:
        proc.stop()
        raise
    return ext


def lease_holder(cp: ControlPlane, namespace: str, name: str) -> dict | None:
    status, body = cp.request(
        "GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}")
    return json.loads(body)["spec"] if status == 200 else None


def test_extender_runs_as_its_service_account(release: Release, gpu_node: str) -> None:
    cp, ns, admin = release.cp, release.namespace, release.admin
    identity = "e2e-extender-0"
    ext = start_extender(release, identity)
    proc = ext.proc
    try:
        def lease() -> dict | None:
            spec = lease_holder(cp, ns, EXTENDER_LEASE)
            return spec if spec and spec.get("holderIdentity") == identity else None

        first = wait_for("the extender to hold its Lease", lease, timeout=30)
        # ... and to renew it (update on the named Lease)
        wait_for("a renewal of the Lease", lambda: (got := lease()) and got.get(
            "renewTime") != first.get("renewTime"), timeout=30)

        # Its writes, through its own ServiceAccount: a GPU pod (in the release namespace,
        # which the chart's webhook leaves alone; a scheduler name nothing runs, so only this
        # bind places it) is refused for a node that does not exist (an Event says why), and,
        # being of no profile that calls the extender, refused until the extender's filter
        # passed it (as kube-scheduler sends it); then bound to the GPU node: decision
        # annotations (patch pods) and the binding (pods/binding).
        gpu_pod = admin.create(Pod.from_dict({
            "metadata": {"name": "e2e-bind-me"},
            "spec": {"schedulerName": "sharegpu-e2e-nobody", "containers": [{
                "name": "main", "image": "registry.invalid/sharegpu/pause:never-pulled",
                "resources": {"limits": {"aliyun.com/gpu-mem": "4"}}}]}}), namespace=ns)
        args = {"PodName": gpu_pod.metadata.name, "PodNamespace": ns,
                "PodUID": gpu_pod.metadata.uid}
        refused = ext.post("/bind", {**args, "Node": "e2e-no-such-node"})  # over TLS, verified
        assert "node e2e-no-such-node does not exist" in refused["Error"], refused
        refused = ext.post("/bind", {**args, "Node": gpu_node})
        assert "is not this extender's to bind: its schedulerName 'sharegpu-e2e-nobody'" in \
            refused["Error"], refused
        assert not admin.get(Pod, gpu_pod.metadata.name, namespace=ns).spec.nodeName

        def bound() -> bool:
            # kube-scheduler's sequence: the filter (which passes the pod), then the bind
            pod = admin.get(Pod, gpu_pod.metadata.name, namespace=ns).to_dict()
            passed = ext.post("/filter", {"Pod": pod, "NodeNames": [gpu_node]})
            if passed.get("NodeNames") != [gpu_node]:
                return False
            return ext.post("/bind", {**args, "Node": gpu_node}).get("Error") == ""

        wait_for("a bind to the GPU node", bound, timeout=30, every=0.5)
        got = admin.get(Pod, gpu_pod.metadata.name, namespace=ns)
        assert got.spec.nodeName == gpu_node
        ann = got.metadata.annotations or {}
        assert ann["ALIYUN_COM_GPU_MEM_POD"] == "4" and ann["ALIYUN_COM_GPU_MEM_IDX"] in ("0", "1")
        assert "scheduler.framework.gpushare.allocation" in ann
        events = wait_for("the extender's Event about the refused bind", lambda: [
            e for e in admin.list(Event, namespace=ns, fields={
                "involvedObject.name": gpu_pod.metadata.name})
            if e.reason == "GPUSharingBindFailed"])
        assert any("e2e-no-such-node" in e.message for e in events), [e.message for e in events]
        assert proc.alive()
        assert log_problems(proc) == [], proc.log_tail()
    finally:
        proc.stop()
    assert not proc.alive()


def test_kube_scheduler_runs_as_its_service_account(release: Release, gpu_node: str) -> None:
    """The chart's second kube-scheduler (the real one, v1.37.2) with the chart's
    KubeSchedulerConfiguration, as the chart's scheduler ServiceAccount for everything (its
    client, delegated authentication and authorization, as in-cluster), elects itself on the
    chart's Lease in the release namespace and, calling ``sharegpu extender`` (as its own
    ServiceAccount), places a GPU pod; no request of either is forbidden."""
    cp, ns, admin = release.cp, release.namespace, release.admin
    kubeconfig = cp.service_account_kubeconfig(ns, release.name("scheduler"), create=False)
    ext = start_extender(release, "e2e-extender-1")
    extender = ext.proc
    (cm,) = [d for d in release.docs("ConfigMap") if d["metadata"]["name"].endswith(
        "scheduler-config")]
    # only urlPrefix's host and port change: https, caData and serverName are the chart's
    config = scheduler_config([cm], ext.url, client_tls=ext.client_tls)
    assert config["extenders"][0]["tlsConfig"]["serverName"] == ext.server_name
    assert config["leaderElection"] == {"leaderElect": True, "resourceNamespace": ns,
                                        "resourceName": "ack-co-scheduler"}
    config["clientConnection"] = {"kubeconfig": str(kubeconfig)}
    log = cp.log_path("kube-scheduler")
    offset = log.stat().st_size
    try:
        # controlplane.py starts every scheduler with --leader-elect=false (which wins over the
        # file): give the chart's choice back; the Lease's namespace and name come from the file
        cp.restart_scheduler(config=config, extra_args=[
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=true"])
        holder = wait_for("the scheduler to hold the chart's Lease",
                          lambda: lease_holder(cp, ns, "ack-co-scheduler"), timeout=60)
        assert holder.get("holderIdentity")
        pod = admin.create(Pod.from_dict({
            "metadata": {"name": "e2e-scheduled"},
            "spec": {"schedulerName": "ack-co-scheduler",
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                     "containers": [{
                         "name": "main", "image": "registry.invalid/sharegpu/pause:never-pulled",
                         "resources": {"limits": {"aliyun.com/gpu-mem": "6"}}}]}}), namespace=ns)
        got = wait_for("the GPU pod placed by kube-scheduler and the extender", lambda: (
            p := admin.get(Pod, pod.metadata.name, namespace=ns)).spec.nodeName and p,
            timeout=60)
        assert got.spec.nodeName == gpu_node
        assert (got.metadata.annotations or {}).get("ALIYUN_COM_GPU_MEM_POD") == "6"
        with log.open(errors="replace") as f:
            f.seek(offset)
            problems = [line for line in f if "forbidden" in line.lower()]
        assert problems == [], "".join(problems[:20])
        assert log_problems(extender) == [], extender.log_tail()
    finally:
        extender.stop()
        cp.restart_scheduler()
    assert not extender.alive()


def _condition(node: Any, kind: str) -> Any:
    return next((c for c in node.status.conditions or [] if c.type == kind), None)


def test_agent_runs_as_its_service_account(release: Release, gpu_node: str,
                                           tmp_path: Path) -> None:
    cp, ns, admin = release.cp, release.namespace, release.admin
    name = release.name("agent")
    kubeconfig = agent_kubeconfig(cp, ns, name, gpu_node)  # as its pod's: names the node
    chart_args = container_args(cp, ns, "DaemonSet", name)
    assert chart_args[0] == "agent" and "--node-name=$(NODE_NAME)" in chart_args
    metrics = free_port()
    args = with_flags(
        chart_args, node_name=gpu_node, kubeconfig=str(kubeconfig),
        nvml="fake", fake_gpus="Tesla-T4:15,Tesla-T4:15", isolation="none",
        device_plugin_dir=str(tmp_path / "device-plugins"), state_dir=str(tmp_path / "state"),
        metrics_listen=f"127.0.0.1:{metrics}", hami_installed=str(tmp_path / "hami-installed"),
        mps_pipe_dir=str(tmp_path / "mps"), mps_shm_dir=str(tmp_path / "mps-shm"),
        isolation_check_every="1",
    )
    proc = SharegpuProcess(cp, "chart-agent", args).start()
    try:
        def published() -> Any:
            node = admin.get(Node, gpu_node)
            labels = node.metadata.labels or {}
            cond = _condition(node, "GPUIsolationReady")
            return node if labels.get("aliyun.accelerator/nvidia_name") and cond else None

        node = wait_for("the agent's labels and node condition", published, timeout=60)
        labels, ann = node.metadata.labels, node.metadata.annotations
        assert labels["aliyun.accelerator/nvidia_name"] == "Tesla-T4"
        assert labels["aliyun.accelerator/nvidia_mem"] == "15360MiB"
        assert labels["aliyun.accelerator/nvidia_count"] == "2"
        assert ann["sharegpu.io/gpu-mem"] == "15,15"
        assert ann["sharegpu.io/last-mode"] == "cgpu"
        cond = _condition(node, "GPUIsolationReady")
        assert (cond.status, cond.reason) == ("True", "NotIsolated")
        # written through the nodes/status subresource, by the agent's client
        status_writers = {(m.manager, m.subresource) for m in node.metadata.managedFields or []
                          if m.subresource == "status"}
        assert ("sharegpu-agent", "status") in status_writers, node.metadata.managedFields
        # its node watch works: a new mode label is followed (and remembered on the node)
        admin.patch(Node, gpu_node, {"metadata": {"labels": {"ack.node.gpu.schedule": "share"}}},
                    patch_type=PatchType.MERGE)
        wait_for("the agent to follow the mode label", lambda: (
            admin.get(Node, gpu_node).metadata.annotations or {}
        ).get("sharegpu.io/last-mode") == "share", timeout=30)
        # the chart's DaemonSet targets this GPU node and tolerates its GPU taint
        ds_pod = wait_for("the DaemonSet's pod bound to the GPU node", lambda: next((
            p for p in admin.list(Pod, namespace=ns,
                                  labels={"app.kubernetes.io/component": "agent"})
            if p.spec.nodeName == gpu_node), None), timeout=60)
        assert ds_pod.status.phase == "Pending"  # no kubelet
        assert proc.alive()
        assert log_problems(proc) == [], proc.log_tail()
    finally:
        proc.stop()
    assert not proc.alive()


# -- what the API server lets each ServiceAccount do ----------------------------------------

Perm = tuple[str, str, str, str | None]


def _expand(rules: Sequence[Any]) -> set[Perm]:
    out: set[Perm] = set()
    for r in rules:
        for g in r.apiGroups or []:
            for res in r.resources or []:
                for v in r.verbs:
                    for n in r.resourceNames or [None]:
                        out.add((g, res, v, n))
    return out


def _rules(client: Client, namespace: str) -> tuple[set[Perm], set[tuple[str, str]]]:
    review = client.create(SelfSubjectRulesReview(
        spec=SelfSubjectRulesReviewSpec(namespace=namespace)))
    assert not review.status.incomplete, review.status.evaluationError
    non_resource = {(v, u) for r in review.status.nonResourceRules or []
                    for v in r.verbs for u in r.nonResourceURLs or []}
    return _expand(review.status.resourceRules or []), non_resource


def _builtin_perms(admin: Client, component: str, namespace: str) -> set[Perm]:
    """The rules of the built-in roles the chart binds (system:kube-scheduler, ...), as this
    API server defines them; a namespaced Role only counts in its own namespace."""
    from lightkube.resources.rbac_authorization_v1 import ClusterRole, Role

    perms: set[Perm] = set()
    for kind, name in BUILTIN.get(component, set()):
        if kind == "ClusterRole":
            perms |= _expand(admin.get(ClusterRole, name).rules)
        elif namespace == "kube-system":  # the chart binds it there (RoleBinding in kube-system)
            perms |= _expand(admin.get(Role, name, namespace="kube-system").rules)
    return perms


def _sar(admin: Client, user: str, perm: Perm, namespace: str) -> bool:
    group, resource, verb, name = perm
    res, _, sub = resource.partition("/")
    review = admin.create(SubjectAccessReview(spec=SubjectAccessReviewSpec(
        user=user, groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                           "system:authenticated"],
        resourceAttributes=ResourceAttributes(group=group, resource=res, subresource=sub or None,
                                              verb=verb, name=name, namespace=namespace))))
    return bool(review.status.allowed)


def test_service_accounts_have_exactly_the_least_privilege_rights(release: Release) -> None:
    cp, ns, admin = release.cp, release.namespace, release.admin
    # what any ServiceAccount may do without a binding (discovery, self reviews)
    nobody = Client(KubeConfig.from_file(cp.service_account_kubeconfig(ns, "e2e-no-bindings")))
    base, base_nr = _rules(nobody, ns)
    assert {(g, r) for g, r, *_ in base} <= BASELINE_RESOURCES, base
    other_ns = "default"
    for comp in COMPONENTS:
        client = release.sa_client(comp)
        for where in (ns, other_ns, "kube-system"):
            perms, non_resource = _rules(client, where)
            expected = set(ALLOWED[comp])
            if where != ns:  # the chart's Roles (its Leases) live in the release namespace
                expected = {p for p in expected if p[0] != "coordination.k8s.io"}
            expected |= base | _builtin_perms(admin, comp, where)
            more, less = sorted(perms - expected, key=str), sorted(expected - perms, key=str)
            assert (more, less) == ([], []), f"{comp} in {where}: excess {more}, missing {less}"
            if comp != "scheduler":
                assert non_resource == base_nr, f"{comp}: {non_resource - base_nr}"
        # the authorizer itself (Node,RBAC) agrees, per right, resource names included
        user = f"system:serviceaccount:{ns}:{release.name(comp)}"
        for perm in sorted(ALLOWED[comp], key=str):
            assert _sar(admin, user, perm, ns), f"{comp} may not {perm}"
        for perm in [("", "secrets", "get", None), ("", "pods", "delete", None),
                     ("", "pods", "create", None), ("", "nodes", "update", None),
                     ("", "nodes", "delete", None), ("", "configmaps", "list", None),
                     ("apps", "daemonsets", "patch", None),
                     ("coordination.k8s.io", "leases", "update", "some-other-lease")]:
            if perm not in ALLOWED[comp] and comp != "scheduler":
                assert not _sar(admin, user, perm, ns), f"{comp} may {perm}"
    # the agent watches and gets its node but cannot list every node; the extender cannot touch
    # nodes; neither can touch another Lease
    agent = f"system:serviceaccount:{ns}:{release.name('agent')}"
    assert not _sar(admin, agent, ("", "nodes", "list", None), ns)
    extender = f"system:serviceaccount:{ns}:{release.name('extender')}"
    assert not _sar(admin, extender, ("", "nodes", "patch", None), ns)
    assert _sar(admin, extender, ("coordination.k8s.io", "leases", "update", EXTENDER_LEASE), ns)
    assert not _sar(admin, extender,
                    ("coordination.k8s.io", "leases", "update", EXTENDER_LEASE), other_ns)


def test_webhook_needs_no_api_access(release: Release) -> None:
    cp, ns = release.cp, release.namespace
    name = release.name("webhook")
    sa = get_json(cp, f"/api/v1/namespaces/{ns}/serviceaccounts/{name}")
    assert sa["automountServiceAccountToken"] is False
    dep = get_json(cp, f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")
    spec = dep["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == name and spec["automountServiceAccountToken"] is False
    # no binding in the whole cluster names it
    for path in ("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
                 "/apis/rbac.authorization.k8s.io/v1/rolebindings"):
        for b in get_json(cp, path)["items"]:
            for s in b.get("subjects") or []:
                assert (s.get("kind"), s.get("name"), s.get("namespace")) != (
                    "ServiceAccount", name, ns), b["metadata"]["name"]
    # and its process is started with no kubeconfig at all (test above and
    # test_webhook_real.py): the webhook answers the API server, it never calls it
    assert not any("kubeconfig" in a for a in spec["containers"][0]["args"])



def test_events_as_sharegpu_posts_them_are_accepted(release: Release) -> None:
    """The extender and the agent explain themselves with core/v1 Events (sharegpu.kubeio.kevents):
    the real API server accepts them, posted with each component's own ServiceAccount."""
    from lightkube.resources.core_v1 import Event

    from sharegpu.kubeio.kevents import node_event, pod_event

    ns, admin = release.namespace, release.admin
    target = next(iter(admin.list(Pod, namespace=ns)))  # any pod: one of the chart's, Pending
    for comp in ("extender", "agent"):
        client = release.sa_client(comp)
        obj = pod_event(namespace=ns, name=target.metadata.name, uid=target.metadata.uid,
                        reason="GPUSharingE2E", message=f"posted as the {comp}",
                        component=f"sharegpu-{comp}", host="e2e")
        created = client.create(Event.from_dict(obj), namespace=ns)
        assert created.involvedObject.uid == target.metadata.uid
    client = release.sa_client("agent")
    created = client.create(Event.from_dict(node_event(
        "e2e-some-node", reason="GPUSharingE2E", message="posted as the agent",
        component="sharegpu-agent")), namespace="default")
    assert created.metadata.namespace == "default"
    admin.delete(Event, created.metadata.name, namespace="default")
    # and a webhook token could not post one
    with pytest.raises(ApiError) as err:
        release.sa_client("webhook").create(Event.from_dict(obj), namespace=ns)
    assert err.value.status.code == 403
