"""The Helm chart, rendered by a real helm (scripts/install-tools.sh puts it in .tools/bin):
lint, render for the default values and every example, validate every manifest against the
Kubernetes schemas (kubernetes-validate, strict), least-privilege RBAC, and the wiring between
components (scheduler profile -> extender Service, agent DaemonSet flags, webhook certificate)."""

from __future__ import annotations

import base64
import functools
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "sharegpu"
EXAMPLES = sorted(p.name for p in (CHART / "examples").glob("*.yaml"))
NS = "gpu-system"
KUBE = "1.30.0"  # kubernetes-validate ships schemas for it; matchConditions are GA there
CRD_KINDS = {"ServiceMonitor", "Certificate", "Issuer"}
# below Kubernetes 1.30 the chart installs only when told to go without the tenant guard
UNGUARDED = "tenantGuard.installUnguarded=true"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def helm() -> str:
    found = shutil.which("helm", path=str(ROOT / ".tools" / "bin")) or shutil.which("helm")
    assert found, "helm is missing: bash scripts/install-tools.sh installs it into .tools/bin"
    return found


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp",
                               "KUBECONFIG": "/nonexistent"})


@functools.cache
def render(values: str | None = None, kube: str = KUBE, *sets: str) -> tuple[dict, ...]:
    args = ["template", "sharegpu", str(CHART), "-n", NS, "--kube-version", kube]
    if values:
        args += ["-f", str(CHART / "examples" / values)]
    for s in sets:
        args += ["--set", s]
    r = run_helm(*args)
    assert r.returncode == 0, r.stderr
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def find(docs, kind, name_part=""):
    out = [d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"]]
    assert out, f"no {kind} named *{name_part}*"
    return out


def one(docs, kind, name_part=""):
    (d,) = find(docs, kind, name_part)
    return d


def pods_hook(vwc):
    """The pod webhook of the chart's ValidatingWebhookConfiguration (the second one checks
    ResourcePolicies, the third workloads' pod templates; with agent.dra.enabled two more check
    claims and templates)."""
    names = [w["name"] for w in vwc["webhooks"]]
    assert names[:3] == ["pods.validate.sharegpu.io", "resourcepolicies.validate.sharegpu.io",
                         "podtemplates.validate.sharegpu.io"]
    assert names[3:] in ([], CLAIM_HOOKS)
    return vwc["webhooks"][0]


CLAIM_HOOKS = ["resourceclaims.validate.sharegpu.io",
               "resourceclaimtemplates.validate.sharegpu.io"]


# --- lint, render, schema validation -------------------------------------------------------


@pytest.mark.parametrize("values", [None, *EXAMPLES])
def test_helm_lint_strict(values):
    args = ["lint", "--strict", str(CHART)]
    if values:
        args += ["-f", str(CHART / "examples" / values)]
    r = run_helm(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("values", [None, *EXAMPLES])
def test_every_manifest_is_valid_kubernetes(values, tmp_path):
    docs = render(values)
    for d in docs:
        if d["kind"] in CRD_KINDS:
            check_crd_object(d)
            continue
        # raises on any schema error; strict rejects unknown fields
        kubernetes_validate.validate(d, KUBE, strict=True)
    # and the command-line tool over the whole rendered stream
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    tool = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(tool), "--strict", "-k", KUBE, str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    unknown = [line for line in r.stdout.splitlines() if "Couldn't find schema" in line]
    assert all(any(k in line for k in CRD_KINDS) for line in unknown), unknown


def check_crd_object(d: dict) -> None:
    """The Prometheus Operator and cert-manager kinds have no schema in kubernetes-validate:
    check the fields the chart sets against those projects' API."""
    import jsonschema

    meta = {"type": "object", "required": ["name", "namespace"]}
    schemas = {
        "ServiceMonitor": {
            "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {
                "apiVersion": {"const": "monitoring.coreos.com/v1"}, "metadata": meta,
                "spec": {"type": "object", "required": ["selector", "endpoints"],
                         "additionalProperties": False,
                         "properties": {
                             "selector": {"type": "object", "required": ["matchLabels"]},
                             "namespaceSelector": {"type": "object"},
                             "endpoints": {"type": "array", "minItems": 1, "items": {
                                 "type": "object", "additionalProperties": False,
                                 "required": ["port"],
                                 "properties": {"port": {"type": "string"},
                                                "path": {"type": "string"},
                                                "interval": {"type": "string",
                                                             "pattern": "^[0-9]+[smh]$"}}}}}},
            },
        },
        "Certificate": {
            "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {
                "apiVersion": {"const": "cert-manager.io/v1"}, "metadata": meta,
                "spec": {"type": "object", "required": ["secretName", "issuerRef", "dnsNames"],
                         "additionalProperties": False,
                         "properties": {"secretName": {"type": "string"},
                                        "dnsNames": {"type": "array", "minItems": 1},
                                        "issuerRef": {"type": "object", "required": ["name"]}}},
            },
        },
        "Issuer": {
            "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": "cert-manager.io/v1"}, "metadata": meta,
                           "spec": {"type": "object", "minProperties": 1}},
        },
    }
    jsonschema.validate(d, {"type": "object", **schemas[d["kind"]]})


def test_bad_values_are_refused_naming_the_field():
    r = run_helm("template", "x", str(CHART), "--set", "isolation=bogus")
    assert r.returncode != 0 and "/isolation" in r.stderr and "'auto', 'hami'" in r.stderr
    r = run_helm("template", "x", str(CHART), "--set", "scheduler.mode=other")
    assert r.returncode != 0 and "/scheduler/mode" in r.stderr
    r = run_helm("template", "x", str(CHART), "--set", "placement.policy=fastest")
    assert r.returncode != 0 and "/placement/policy" in r.stderr and "'strand'" in r.stderr


def test_policy_enum_is_every_policy():
    from sharegpu.core.placement.base import ALIASES, available

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["placement"]["properties"]["policy"]["enum"] == [
        *ALIASES, *available()]


def test_second_scheduler_survives_drains():
    docs = render(None)
    dep = one(docs, "Deployment", "scheduler")
    terms = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    pdb = one(docs, "PodDisruptionBudget", "scheduler")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


# --- least privilege -------------------------------------------------------------------------

# What each component may do: (apiGroup, resource, verb, resourceName or None). Anything else a
# component's ServiceAccount can do fails the test.
def _perm(group, resources, verbs, names=(None,)):
    return {(group, r, v, n) for r in resources for v in verbs for n in names}


ALLOWED = {
    "extender": _perm("", ["pods"], ["get", "list", "watch", "patch"])
    | _perm("", ["pods/binding"], ["create"])
    | _perm("", ["nodes"], ["get", "list", "watch"])
    | _perm("", ["events"], ["create"])
    | _perm("scheduling.alibabacloud.com", ["resourcepolicies"], ["list", "watch"])
    | _perm("scheduling.sigs.k8s.io", ["podgroups"], ["get", "list", "watch"])
    | _perm("coordination.k8s.io", ["leases"], ["create"])
    | _perm("coordination.k8s.io", ["leases"], ["get", "update"], ["sharegpu-extender"]),
    "agent": _perm("", ["nodes"], ["get", "watch", "patch"])
    | _perm("", ["nodes/status"], ["patch"])
    | _perm("", ["pods"], ["list", "patch"])
    | _perm("", ["events"], ["create"]),
    "webhook": set(),
    "scheduler": _perm("coordination.k8s.io", ["leases"], ["create"])
    | _perm("coordination.k8s.io", ["leases"], ["get", "update"], ["ack-co-scheduler"]),
}
# what agent.dra.enabled adds to the agent (docs/dra.md): its node's ResourceSlice (no narrower
# rule exists: slice names are per node, and create, list and watch take no names) and the
# chart's DeviceClass, which owns the slices; and for its DRA kubelet plugin, the claims the
# kubelet names (get only)
ALLOWED_DRA = _perm("resource.k8s.io", ["resourceslices"],
                    ["list", "watch", "create", "update", "delete"]) \
    | _perm("resource.k8s.io", ["deviceclasses"], ["get"], ["gpu.sharegpu.io"]) \
    | _perm("resource.k8s.io", ["resourceclaims"], ["get"])
# what agent.dra.enabled adds to the webhook (docs/dra.md, "ACK's pod spec on DRA"): the
# ResourceClaimTemplates of translated pods, one per request shape in the pod's namespace
ALLOWED_DRA_WEBHOOK = _perm("resource.k8s.io", ["resourceclaimtemplates"], ["create", "get"])
# what agent.dra.enabled adds to the extender (docs/dra.md, "The extender and DRA pods"): DRA
# nodes' GPUs and the claims' allocated shares, read only
ALLOWED_DRA_EXTENDER = _perm("resource.k8s.io", ["resourceslices", "resourceclaims"],
                             ["list", "watch"])
# built-in roles a kube-scheduler is given by every installation (kubeadm, the docs' "multiple
# schedulers" setup); they are maintained by Kubernetes itself
BUILTIN = {"scheduler": {("ClusterRole", "system:kube-scheduler"),
                         ("ClusterRole", "system:volume-scheduler"),
                         ("Role", "extension-apiserver-authentication-reader")}}


def permissions(docs) -> dict[str, tuple[set, set]]:
    """Per ServiceAccount: (permissions from the chart's own roles, built-in roles bound)."""
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("Role", "ClusterRole")}
    out: dict[str, tuple[set, set]] = {}
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ref = (b["roleRef"]["kind"], b["roleRef"]["name"])
        for s in b["subjects"]:
            assert s["kind"] == "ServiceAccount" and s["namespace"] == NS, s
            perms, builtin = out.setdefault(s["name"], (set(), set()))
            if ref not in roles:
                builtin.add(ref)
                continue
            for rule in roles[ref]["rules"]:
                assert "nonResourceURLs" not in rule
                for g in rule.get("apiGroups", []):
                    for r in rule["resources"]:
                        for v in rule["verbs"]:
                            for n in rule.get("resourceNames") or [None]:
                                perms.add((g, r, v, n))
    return out


def component_of(sa: str) -> str:
    return sa.rsplit("-", 1)[-1]


def excess(docs, allowed=None) -> list[str]:
    allowed = ALLOWED if allowed is None else allowed
    problems = []
    for sa, (perms, builtin) in permissions(docs).items():
        comp = component_of(sa)
        for g, r, v, n in sorted(perms, key=str):
            if "*" in (g, r, v) or r == "secrets" or (g, r, v, n) not in allowed[comp]:
                problems.append(f"{sa}: {v} {r or ''} (group {g!r}, name {n})")
        for ref in sorted(builtin - BUILTIN.get(comp, set())):
            problems.append(f"{sa}: bound to {ref[0]} {ref[1]}")
    return problems


@pytest.mark.parametrize("values", [None, *EXAMPLES])
def test_rbac_is_least_privilege(values):
    docs = render(values)
    assert excess(docs) == []
    perms = permissions(docs)
    # every component that talks to the API server can do what it needs
    ext = perms["sharegpu-extender"][0]
    assert ("", "pods/binding", "create", None) in ext and ("", "pods", "patch", None) in ext
    # the agent's writes of nodes and pods are fenced to its own node by the tenant guard
    agent = perms["sharegpu-agent"][0]
    writes = {(g, r) for g, r, v, _ in agent if v in WRITE_VERBS and r != "events"}
    assert ("", "pods") in writes and ("", "nodes/status") in writes
    assert {w: fenced_to_own_node(docs, *w) for w in writes} == {w: True for w in writes}
    # the webhook has no binding at all and no token
    assert "sharegpu-webhook" not in perms
    sa = one(docs, "ServiceAccount", "webhook")
    assert sa["automountServiceAccountToken"] is False


WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
AGENT_USER = f"system:serviceaccount:{NS}:sharegpu-agent"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def fenced_to_own_node(docs, group, resource):
    """Whether a ValidatingAdmissionPolicy (bound, Deny) that matches only the agent's
    ServiceAccount covers writes of ``resource`` and checks the token's node name."""
    bound = {d["spec"]["policyName"] for d in docs
             if d["kind"] == "ValidatingAdmissionPolicyBinding"
             and d["spec"]["validationActions"] == ["Deny"]}
    for d in docs:
        if d["kind"] != "ValidatingAdmissionPolicy" or d["metadata"]["name"] not in bound:
            continue
        conds = [c["expression"] for c in d["spec"].get("matchConditions", [])]
        if conds != [f"request.userInfo.username == '{AGENT_USER}'"]:
            continue
        base = resource.split("/")[0]
        for rule in d["spec"]["matchConstraints"]["resourceRules"]:
            if group in rule["apiGroups"] and {"UPDATE", "CREATE", "DELETE"} <= set(
                    rule["operations"]) and (resource in rule["resources"]
                                             or f"{base}/*" in rule["resources"]):
                node = [v for v in d["spec"]["variables"] if v["name"] == "node"]
                return d["spec"]["failurePolicy"] == "Fail" and len(node) == 1 and \
                    NODE_NAME_EXTRA in node[0]["expression"]
    return False


def test_the_own_node_fence_check_sees_a_missing_policy():
    docs = [d for d in render(None) if d["metadata"]["name"] != "sharegpu-agent-pods"]
    assert not fenced_to_own_node(docs, "", "pods")
    assert fenced_to_own_node(docs, "", "nodes/status")


def test_the_rbac_check_catches_extra_rights():
    docs = [json.loads(json.dumps(d)) for d in render(None)]
    role = one(docs, "ClusterRole", "agent")
    role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    role["rules"].append({"apiGroups": ["apps"], "resources": ["*"], "verbs": ["*"]})
    assert len(excess(docs)) == 2
    docs = [json.loads(json.dumps(d)) for d in render(None)]
    one(docs, "ClusterRoleBinding", "scheduler-kube-scheduler")["roleRef"]["name"] = \
        "cluster-admin"
    assert excess(docs) == ["sharegpu-scheduler: bound to ClusterRole cluster-admin"]


# --- components ------------------------------------------------------------------------------


def container(d):
    """The component's own container (the first; the agent's DaemonSet has mps-control too)."""
    return d["spec"]["template"]["spec"]["containers"][0]


def args_of(d):
    return container(d)["args"]


def test_extender_two_replicas_leader_election_and_policy():
    docs = render(None)
    dep = one(docs, "Deployment", "extender")
    assert dep["spec"]["replicas"] == 2
    a = args_of(dep)
    assert a[0] == "extender" and f"--lease-namespace={NS}" in a
    assert "--lease-name=sharegpu-extender" in a and "--policy=default" in a
    assert "--no-leader-election" not in a and "--graded-scores" not in a
    graded = args_of(one(render(None, KUBE, "extender.gradedScores=true"), "Deployment",
                         "extender"))
    assert "--graded-scores" in graded
    assert one(docs, "PodDisruptionBudget", "extender")["spec"]["minAvailable"] == 1
    assert "--policy=binpack" in args_of(one(render("cgpu-binpack.yaml"), "Deployment",
                                             "extender"))


def test_scheduler_profile_calls_the_extender_service():
    docs = render(None)
    svc = one(docs, "Service", "extender")
    cfg = yaml.safe_load(one(docs, "ConfigMap", "scheduler-config")["data"]["config.yaml"])
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert cfg["kind"] == "KubeSchedulerConfiguration"
    assert [p["schedulerName"] for p in cfg["profiles"]] == ["ack-co-scheduler"]
    assert cfg["leaderElection"] == {"leaderElect": True, "resourceNamespace": NS,
                                     "resourceName": "ack-co-scheduler"}
    (ext,) = cfg["extenders"]
    known = {"urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb",
             "enableHTTPS", "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources",
             "ignorable"}
    assert set(ext) <= known
    port = svc["spec"]["ports"][0]["port"]
    assert svc["spec"]["ports"][0]["name"] == "https"
    assert ext["urlPrefix"] == f"https://{svc['metadata']['name']}.{NS}.svc:{port}"
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == (
        "filter", "prioritize", "bind")
    # no managedResources: every pod of the profile is sent, so a ResourcePolicy governs pods
    # without GPUs too (docs/resourcepolicy.md)
    assert "managedResources" not in ext
    # the extender watches nodes itself (node names only), fails closed, and its score must
    # outweigh kube-scheduler's own scores so placement follows the sharegpu policy
    assert ext["nodeCacheCapable"] is True and ext["ignorable"] is False
    assert ext["weight"] >= 100_000
    dep = one(docs, "Deployment", "scheduler")
    c = container(dep)
    assert c["image"] == "registry.k8s.io/kube-scheduler:v1.30.0"  # follows the cluster
    assert c["command"][:2] == ["kube-scheduler", "--config=/etc/sharegpu-scheduler/config.yaml"]
    # the extender Service selects the extender pod that serves the verbs: the leader, which
    # labels its own pod (--own-pod) sharegpu.io/extender-serving=true
    ext_dep = one(docs, "Deployment", "extender")
    selector = dict(svc["spec"]["selector"])
    assert selector.pop("sharegpu.io/extender-serving") == "true"
    assert selector.items() <= ext_dep["spec"]["template"]["metadata"]["labels"].items()
    assert "--own-pod=$(POD_NAMESPACE)/$(POD_NAME)" in args_of(ext_dep)
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.namespace"}}} in container(ext_dep)["env"]
    solo = render(None, KUBE, "extender.leaderElection.enabled=false")
    assert "sharegpu.io/extender-serving" not in one(solo, "Service", "extender")["spec"][
        "selector"]


def test_bind_timeout_must_leave_a_margin_below_the_schedulers_http_timeout():
    """A bind answers before kube-scheduler's httpTimeout: bindTimeout + 1 s at most."""
    a = args_of(one(render(None), "Deployment", "extender"))
    assert "--bind-timeout=7" in a and "--hold-timeout=120" in a
    for sets in (("scheduler.httpTimeout=8s",), ("scheduler.httpTimeout=5s",),
                 ("extender.bindTimeout=9",), ("scheduler.httpTimeout=7500ms",)):
        r = run_helm("template", "x", str(CHART), "--kube-version", KUBE,
                     *[f"--set={x}" for x in sets])
        assert r.returncode != 0 and "must be below scheduler.httpTimeout" in r.stderr, sets
    ok = render(None, KUBE, "scheduler.httpTimeout=1m", "extender.bindTimeout=30")
    assert "--bind-timeout=30" in args_of(one(ok, "Deployment", "extender"))
    r = run_helm("template", "x", str(CHART), "--kube-version", KUBE,
                 "--set=scheduler.httpTimeout=10")
    assert r.returncode != 0 and "httpTimeout" in r.stderr
    r = run_helm("template", "x", str(CHART), "--kube-version", KUBE,
                 "--set=extender.bindTimeout=4")
    assert r.returncode != 0 and "must be above extender.startWait" in r.stderr


def test_default_profile_mode_runs_no_scheduler_and_prints_the_config():
    docs = render("default-scheduler.yaml")
    assert not [d for d in docs if "scheduler" in d["metadata"]["name"]]
    r = run_helm("install", "sharegpu", str(CHART), "-n", NS, "--dry-run=client",
                 "-f", str(CHART / "examples" / "default-scheduler.yaml"))
    assert r.returncode == 0, r.stderr
    notes = r.stdout.split("NOTES:", 1)[1]
    block = notes.split("extenders:", 1)[1].split("\n\n", 1)[0]
    (ext,) = yaml.safe_load(block)
    assert ext["urlPrefix"] == f"https://sharegpu-extender.{NS}.svc:8888"
    assert ext["enableHTTPS"] is True
    assert ext["tlsConfig"]["serverName"] == f"sharegpu-extender.{NS}.svc"
    assert "schedulerName" not in notes
    # the cluster's own scheduler sends only GPU pods
    assert {r["name"] for r in ext["managedResources"]} == {
        "aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage", "aliyun.com/gpu",
        "nvidia.com/gpu"}


def test_notes_show_the_seeds_verification_commands():
    r = run_helm("install", "sharegpu", str(CHART), "-n", NS, "--dry-run=client")
    assert r.returncode == 0, r.stderr
    notes = r.stdout.split("NOTES:", 1)[1]
    for line in [
        "kubectl label node <NODE_NAME> ack.node.gpu.schedule=cgpu --overwrite",
        "kubectl label node <NODE_NAME> ack.node.gpu.schedule=default --overwrite",
        'kubectl get nodes <NODE_NAME> -o yaml | grep "aliyun.com/gpu-mem"',
        "kubectl get nodes <NODE_NAME> -o yaml | grep -E "
        "'aliyun\\.com/gpu-core\\.percentage|aliyun\\.com/gpu-mem'",
        "kubectl get nodes <NODE_NAME> -o yaml | grep aliyun.com/gpu",
        "kubectl inspect cgpu",
        "schedulerName: ack-co-scheduler",
        "Allocated/Total GPU Memory In Cluster:",
    ]:
        assert line in notes, line
    from test_inspect_golden import BINPACK
    sample = "\n".join(line[5:] for line in notes.splitlines()
                       if line.startswith("     ") and ("GPU" in line or "/" in line
                                                        or line.strip().startswith("---")))
    assert BINPACK.strip() in sample  # the NOTES' sample is the tool's real output


def test_agent_daemonset_on_gpu_nodes_only_node_critical():
    docs = render(None)
    ds = one(docs, "DaemonSet", "agent")
    spec = ds["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert "ack.node.gpu.schedule" in keys and "nvidia.com/gpu.present" in keys
    assert all(len(t["matchExpressions"]) == 1 for t in terms)  # any one GPU label (OR)
    c = container(ds)
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert args_of(ds)[0] == "agent" and "--isolation=auto" in args_of(ds)
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/var/lib/kubelet/device-plugins" in mounts and "/var/lib/sharegpu" in mounts
    assert "--isolation=mps" in args_of(one(render("mps.yaml"), "DaemonSet", "agent"))
    assert "--isolation=none" in args_of(one(render("share.yaml"), "DaemonSet", "agent"))
    fake = args_of(one(render("fake-gpus.yaml"), "DaemonSet", "agent"))
    assert "--nvml=fake" in fake and "--fake-gpus=Tesla-T4:15,Tesla-T4:15" in fake


# --- DRA (docs/dra.md) ------------------------------------------------------------------------

DRA = ("agent.dra.enabled=true",)


def test_dra_off_by_default_renders_nothing_of_it():
    docs = render(None)
    assert not [d for d in docs if d["kind"] == "DeviceClass"]
    assert not [a for a in args_of(one(docs, "DaemonSet", "agent")) if a.startswith("--dra")]
    assert not [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    assert not [a for a in args_of(one(docs, "Deployment", "webhook")) if a.startswith("--dra")]


def test_dra_mutating_webhook_only_for_the_pool_and_fails_closed():
    docs = render(None, "1.37.0", *DRA)
    mwc = one(docs, "MutatingWebhookConfiguration", "webhook")
    (hook,) = mwc["webhooks"]
    assert hook["name"] == "pods.mutate.sharegpu.io"
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "NoneOnDryRun"
    assert hook["clientConfig"]["service"]["path"] == "/mutate"
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    conds = {c["name"]: c["expression"] for c in hook["matchConditions"]}
    assert set(conds) == {"asks-for-gpu", "names-the-dra-pool"}
    assert "'sharegpu.io/dra' in object.spec.nodeSelector" in conds["names-the-dra-pool"]
    vwc = one(docs, "ValidatingWebhookConfiguration", "webhook")
    assert hook["namespaceSelector"] == vwc["webhooks"][0]["namespaceSelector"]
    assert hook["clientConfig"]["caBundle"] == vwc["webhooks"][0]["clientConfig"]["caBundle"]
    dep = one(docs, "Deployment", "webhook")
    assert {"--dra-label=sharegpu.io/dra=true", "--dra-device-class=gpu.sharegpu.io"} <= set(
        args_of(dep))
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert permissions(docs)["sharegpu-webhook"][0] == ALLOWED_DRA_WEBHOOK
    # the webhook's own parser takes the flags
    from sharegpu.dra.draclaims import Pool

    assert Pool.parse("sharegpu.io/dra=true", "gpu.sharegpu.io") == Pool()


def test_dra_claims_webhook_sees_only_the_deviceclass_and_fails_closed():
    """agent.dra.enabled: users' own ResourceClaims and ResourceClaimTemplates of the chart's
    DeviceClass go to /validate (docs/dra.md); the matchConditions send nothing else, so an
    outage of the webhook never holds up another driver's claims."""
    import celpy

    assert not [w for w in one(render(None), "ValidatingWebhookConfiguration")["webhooks"]
                if w["name"] in CLAIM_HOOKS]
    docs = render(None, "1.37.0", *DRA)
    vwc = one(docs, "ValidatingWebhookConfiguration", "webhook")
    pods = pods_hook(vwc)
    hooks = {w["name"]: w for w in vwc["webhooks"] if w["name"] in CLAIM_HOOKS}
    assert list(hooks) == CLAIM_HOOKS
    env = celpy.Environment()
    for resource, hook in zip(("resourceclaims", "resourceclaimtemplates"), hooks.values(),
                              strict=True):
        assert hook["rules"] == [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"],
                                  "operations": ["CREATE"], "resources": [resource],
                                  "scope": "Namespaced"}]
        assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
        assert hook["clientConfig"] == pods["clientConfig"]  # /validate of the same Service
        assert hook["admissionReviewVersions"] == ["v1"]
        assert "namespaceSelector" not in hook  # every namespace: the webhook uses no claim
        (cond,) = hook["matchConditions"]
        prog = env.program(env.compile(cond["expression"]))

        def sent(spec, prog=prog, resource=resource):
            obj = {"metadata": {"name": "x"},
                   "spec": spec if resource == "resourceclaims" else {"spec": spec}}
            return bool(prog.evaluate({"object": celpy.json_to_cel(obj)}))

        def exactly(cls):
            return {"name": "r", "exactly": {"deviceClassName": cls, "count": 1}}

        def first(*classes):
            return {"name": "f", "firstAvailable": [
                {"name": f"s{i}", "deviceClassName": c} for i, c in enumerate(classes)]}

        assert sent({"devices": {"requests": [exactly("gpu.sharegpu.io")]}})
        assert sent({"devices": {"requests": [exactly("nic.example.com"),
                                              exactly("gpu.sharegpu.io")]}})
        assert sent({"devices": {"requests": [first("nic.example.com", "gpu.sharegpu.io")]}})
        assert not sent({"devices": {"requests": [exactly("nic.example.com")]}})
        assert not sent({"devices": {"requests": [first("nic.example.com")]}})
        assert not sent({"devices": {"requests": [exactly("gpu.sharegpu.io.other")]}})
        assert not sent({"devices": {}})
        assert not sent({})
    # the DeviceClass follows agent.dra.driver; failurePolicy follows webhook.failurePolicy
    custom = one(render(None, "1.37.0", *DRA, "agent.dra.driver=gpu.example.com",
                        "webhook.failurePolicy=Ignore"), "ValidatingWebhookConfiguration")
    for w in custom["webhooks"][3:]:
        assert "'gpu.example.com'" in w["matchConditions"][0]["expression"]
        assert "gpu.sharegpu.io" not in w["matchConditions"][0]["expression"]
        assert w["failurePolicy"] == "Ignore"
    cm = one(render("cert-manager.yaml", "1.37.0", *DRA), "ValidatingWebhookConfiguration")
    assert [w["name"] for w in cm["webhooks"]][3:] == CLAIM_HOOKS
    assert all("caBundle" not in w["clientConfig"] for w in cm["webhooks"])


def test_dra_pool_deviceclass_rbac_and_agent_flags(tmp_path):
    docs = render(None, "1.37.0", *DRA)
    for d in docs:  # the 1.37 schemas know resource.k8s.io/v1
        if d["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(d, "1.37.0", strict=True)
    dc = one(docs, "DeviceClass")
    assert dc["apiVersion"] == "resource.k8s.io/v1" and dc["metadata"]["name"] == "gpu.sharegpu.io"
    assert dc["spec"] == {"selectors": [{"cel": {
        "expression": 'device.driver == "gpu.sharegpu.io"'}}]}
    ds = one(docs, "DaemonSet", "agent")
    a = args_of(ds)
    assert {"--dra=label", "--dra-label=sharegpu.io/dra=true", "--dra-driver=gpu.sharegpu.io",
            "--dra-device-class=gpu.sharegpu.io"} <= set(a)
    # pool nodes get the agent too (one term of the OR)
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"matchExpressions": [{"key": "sharegpu.io/dra", "operator": "In",
                                  "values": ["true"]}]} in terms
    # exactly what DRA adds, nothing more
    allowed = {**ALLOWED, "agent": ALLOWED["agent"] | ALLOWED_DRA,
               "webhook": ALLOWED_DRA_WEBHOOK,
               "extender": ALLOWED["extender"] | ALLOWED_DRA_EXTENDER}
    assert excess(docs, allowed) == []
    assert len(excess(docs)) == len(ALLOWED_DRA) + len(ALLOWED_DRA_WEBHOOK) + len(
        ALLOWED_DRA_EXTENDER)
    assert permissions(docs)["sharegpu-agent"][0] == allowed["agent"]
    assert permissions(docs)["sharegpu-extender"][0] == allowed["extender"]
    # the agent's own parser takes the flags the chart gives it
    from sharegpu.commands.agent import _dra_label

    assert _dra_label("sharegpu.io/dra=true") == ("sharegpu.io/dra", "true")
    custom = render(None, "1.37.0", *DRA, "agent.dra.driver=gpu.example.com",
                    "agent.dra.poolLabel.key=pool", "agent.dra.poolLabel.value=dra")
    assert one(custom, "DeviceClass")["metadata"]["name"] == "gpu.example.com"
    assert "--dra-label=pool=dra" in args_of(one(custom, "DaemonSet", "agent"))
    role = one(custom, "ClusterRole", "agent")
    assert {"apiGroups": ["resource.k8s.io"], "resources": ["deviceclasses"],
            "resourceNames": ["gpu.example.com"], "verbs": ["get"]} in role["rules"]
    # the kubelet plugin serves gpu.sharegpu.io only: another driver name gets slices only, and
    # neither the plugin's rights nor its host directories
    assert "--dra-kubelet-plugin=off" in args_of(one(custom, "DaemonSet", "agent"))
    assert not [r for r in role["rules"] if "resourceclaims" in r["resources"]]
    assert not {"dra-registry", "dra-plugin", "cdi"} & {
        v["name"] for v in one(custom, "DaemonSet", "agent")["spec"]["template"]["spec"]["volumes"]}


HOST_DRA = {  # the DRA kubelet plugin's host directories, each mounted at the host's own path
    "dra-registry": "/var/lib/kubelet/plugins_registry",
    "dra-plugin": "/var/lib/kubelet/plugins/gpu.sharegpu.io",
    "cdi": "/var/run/cdi",
}
HOST_HAMI = {  # HAMi-core's writable host directories, which the agent opens to any user
    "vgpu-cache": "/tmp/sharegpu-vgpu",
    "vgpu-lock": "/tmp/vgpulock",
}


def test_dra_kubelet_plugin_mounts_and_flags():
    """agent.dra.enabled: the agent serves the kubelet plugin from the kubelet's directories (the
    registration socket in plugins_registry, the endpoint under plugins/<driver>, whose path the
    kubelet dials as the plugin names it, so host and container paths agree), writes CDI specs
    to the runtime's CDI directory and the claims' HAMi-core cache directories on the host."""
    from sharegpu.agent.draplugin import CDI_DIR, PLUGINS_DIR, REGISTRY_DIR
    from sharegpu.commands import agent as agent_cmd

    assert (agent_cmd.REGISTRY_DIR, agent_cmd.PLUGINS_DIR, agent_cmd.CDI_DIR) == (
        REGISTRY_DIR, PLUGINS_DIR, CDI_DIR)
    off_ds = one(render(None), "DaemonSet", "agent")
    off = off_ds["spec"]["template"]["spec"]
    assert not set(HOST_DRA) & {v["name"] for v in off["volumes"]}
    ds = one(render(None, "1.37.0", *DRA), "DaemonSet", "agent")
    for d, dirs in ((ds, {**HOST_DRA, **HOST_HAMI}), (off_ds, HOST_HAMI)):
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["name"]: m for m in container(d)["volumeMounts"]}
        for name, path in dirs.items():
            assert volumes[name]["hostPath"] == {"path": path, "type": "DirectoryOrCreate"}
            assert mounts[name]["mountPath"] == path and not mounts[name].get("readOnly")
    a = args_of(ds)
    assert {"--dra-plugins-registry=/var/lib/kubelet/plugins_registry",
            "--dra-plugin-dir=/var/lib/kubelet/plugins/gpu.sharegpu.io",
            "--cdi-dir=/var/run/cdi"} <= set(a)
    assert "--dra-kubelet-plugin=off" not in a
    moved = one(render(None, "1.37.0", *DRA, "agent.dra.kubeletDir=/data/kubelet/",
                       "agent.dra.cdiDir=/etc/cdi"), "DaemonSet", "agent")
    assert {"--dra-plugins-registry=/data/kubelet/plugins_registry",
            "--dra-plugin-dir=/data/kubelet/plugins/gpu.sharegpu.io",
            "--cdi-dir=/etc/cdi"} <= set(args_of(moved))
    assert {m["mountPath"] for m in container(moved)["volumeMounts"]} >= {
        "/data/kubelet/plugins_registry", "/data/kubelet/plugins/gpu.sharegpu.io", "/etc/cdi"}
    r = run_helm("template", "x", str(CHART), "--set", "agent.dra.cdiDir=relative/cdi")
    assert r.returncode != 0 and "/agent/dra/cdiDir" in r.stderr
    # the agent's parser takes the chart's arguments
    import argparse

    p = argparse.ArgumentParser()
    agent_cmd.add_arguments(p)
    ns = p.parse_args([x for x in a if x.startswith("--")])
    assert (ns.dra, ns.dra_kubelet_plugin, ns.cdi_dir) == ("label", "on", "/var/run/cdi")


def test_dra_is_refused_before_kubernetes_1_34_and_bad_names_naming_the_field():
    r = run_helm("template", "x", str(CHART), "--kube-version", "1.33.0", "--set", DRA[0])
    assert r.returncode != 0 and "agent.dra.enabled needs Kubernetes >= 1.34" in r.stderr
    r = run_helm("template", "x", str(CHART), "--set", "agent.dra.driver=Not_A_Domain")
    assert r.returncode != 0 and "/agent/dra/driver" in r.stderr
    r = run_helm("template", "x", str(CHART), "--set", "agent.dra.poolLabel.value=a b")
    assert r.returncode != 0 and "/agent/dra/poolLabel/value" in r.stderr
    r = run_helm("lint", "--strict", str(CHART), "--set", DRA[0])
    assert r.returncode == 0, r.stdout + r.stderr


def test_webhook_certificate_and_fail_closed():
    docs = render(None)
    vwc = one(docs, "ValidatingWebhookConfiguration")
    hook = pods_hook(vwc)
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    svc = one(docs, "Service", "webhook")
    ref = hook["clientConfig"]["service"]
    assert (ref["name"], ref["namespace"], ref["path"], ref["port"]) == (
        svc["metadata"]["name"], NS, "/validate", svc["spec"]["ports"][0]["port"])
    secret = one(docs, "Secret", "webhook-tls")
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    pem = base64.b64decode(secret["data"]["tls.crt"]).decode()
    assert pem.startswith("-----BEGIN CERTIFICATE-----")
    cert = _x509(pem)
    assert f"DNS:{svc['metadata']['name']}.{NS}.svc" in cert
    dep = one(docs, "Deployment", "webhook")
    assert {"--tls-cert=/tls/tls.crt", "--tls-key=/tls/tls.key"} <= set(args_of(dep))
    assert dep["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == \
        secret["metadata"]["name"]
    excluded = hook["namespaceSelector"]["matchExpressions"][0]["values"]
    assert NS in excluded and "kube-system" in excluded
    # cert-manager instead of the Helm-made certificate
    cm = render("cert-manager.yaml")
    assert not [d for d in cm if d["kind"] == "Secret" and "webhook" in d["metadata"]["name"]]
    assert one(cm, "Certificate")["spec"]["secretName"] == secret["metadata"]["name"]
    assert "caBundle" not in one(cm, "ValidatingWebhookConfiguration")["webhooks"][0][
        "clientConfig"]


# --- the extender over TLS, and its NetworkPolicy (issue 13, item 6) -------------------------


def _extender_tls(docs):
    cfg = yaml.safe_load(one(docs, "ConfigMap", "scheduler-config")["data"]["config.yaml"])
    (ext,) = cfg["extenders"]
    return ext, one(docs, "Secret", "extender-tls")


def test_scheduler_verifies_the_extender_certificate_with_the_charts_ca(tmp_path):
    """kube-scheduler's extender block is https with caData (the chart's CA) and serverName
    (the Service's name), and a real TLS handshake verifies the extender's certificate from the
    chart's Secret with exactly that caData under that name (a client without it fails)."""
    import ssl

    docs = render(None)
    ext, secret = _extender_tls(docs)
    svc = one(docs, "Service", "extender")
    name = f"{svc['metadata']['name']}.{NS}.svc"
    assert ext["urlPrefix"] == f"https://{name}:8888"
    assert ext["enableHTTPS"] is True
    client_dir = "/etc/sharegpu-extender-client"
    assert ext["tlsConfig"] == {"serverName": name, "caData": secret["data"]["ca.crt"],
                                "certFile": f"{client_dir}/tls.crt",
                                "keyFile": f"{client_dir}/tls.key"}
    assert secret["type"] == "kubernetes.io/tls"
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    for k in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / k).write_bytes(data[k])
    # kube-scheduler's client certificate: its own Secret, mounted where certFile/keyFile say
    client_secret = one(docs, "Secret", "extender-client-tls")
    assert client_secret["type"] == "kubernetes.io/tls"
    assert set(client_secret["data"]) == {"tls.crt", "tls.key"}  # no key of the extender's
    for k, v in client_secret["data"].items():
        (tmp_path / f"client-{k}").write_bytes(base64.b64decode(v))
    sched = one(docs, "Deployment", "scheduler")
    (vol,) = [v for v in sched["spec"]["template"]["spec"]["volumes"]
              if v["name"] == "extender-client"]
    assert vol["secret"]["secretName"] == client_secret["metadata"]["name"]
    assert {"name": "extender-client", "mountPath": client_dir, "readOnly": True} in \
        container(sched)["volumeMounts"]
    assert sched["spec"]["template"]["metadata"]["annotations"]["checksum/client-tls"]
    from sharegpu.commands.extender import handshake_in_memory, ssl_context

    # the extender as the chart runs it: its certificate, callers' certificates required
    # (--tls-client-ca=/tls/ca.crt)
    server = ssl_context(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"),
                         client_ca=str(tmp_path / "ca.crt"))
    assert server is not None

    def scheduler(cert: bool = True) -> ssl.SSLContext:
        ctx = ssl.create_default_context(
            cadata=base64.b64decode(ext["tlsConfig"]["caData"]).decode())
        if cert:
            ctx.load_cert_chain(tmp_path / "client-tls.crt", tmp_path / "client-tls.key")
        return ctx

    # raises if either certificate does not verify
    handshake_in_memory(server, scheduler(), ext["tlsConfig"]["serverName"])
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake_in_memory(server, scheduler(), f"other.{NS}.svc")
    with pytest.raises(ssl.SSLCertVerificationError):  # the system's CAs do not know it
        handshake_in_memory(server, ssl.create_default_context(), name)
    with pytest.raises(ssl.SSLError) as refused:  # no client certificate: refused
        handshake_in_memory(server, scheduler(cert=False), name)
    assert refused.value.side == "server"  # type: ignore[attr-defined]
    # the replicas' own certificate is a caller too (a follower forwarding a bind)
    own = scheduler(cert=False)
    own.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    handshake_in_memory(server, own, name)
    cert = _x509(data["tls.crt"].decode())
    for dns in (name, f"{name}.cluster.local", f"sharegpu-extender.{NS}", "sharegpu-extender"):
        assert f"DNS:{dns}" in cert
    assert "TLS Web Server Authentication" in cert  # Go's verifier checks the key usage
    # the extender serves the Secret and verifies the leader with its CA under the same name
    dep = one(docs, "Deployment", "extender")
    a = args_of(dep)
    assert {"--tls-cert=/tls/tls.crt", "--tls-key=/tls/tls.key", "--tls-ca=/tls/ca.crt",
            "--tls-client-ca=/tls/ca.crt", f"--tls-server-name={name}",
            "--metrics-listen=0.0.0.0:8889"} <= set(a)
    assert "--insecure" not in a
    pod = dep["spec"]["template"]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["tls"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert {"name": "tls", "mountPath": "/tls", "readOnly": True} in container(dep)[
        "volumeMounts"]
    assert pod["metadata"]["annotations"]["checksum/tls"]  # a new certificate rolls the pods
    # the verbs on the TLS port only; probes and metrics on the plain metrics port
    ports = {p["name"]: p["containerPort"] for p in container(dep)["ports"]}
    assert ports == {"https": 8888, "metrics": 8889}
    for probe in ("livenessProbe", "readinessProbe"):
        got = container(dep)[probe]["httpGet"]
        assert got["port"] == "metrics" and got.get("scheme", "HTTP") == "HTTP"
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("https", 8888, "https"), ("metrics", 8889, "metrics")]
    # the block the NOTES print for scheduler.mode=default carries the same TLS settings
    r = run_helm("install", "sharegpu", str(CHART), "-n", NS, "--dry-run=client",
                 "-f", str(CHART / "examples" / "default-scheduler.yaml"))
    assert r.returncode == 0, r.stderr
    manifest, notes = r.stdout.split("NOTES:", 1)
    (printed,) = yaml.safe_load(notes.split("extenders:", 1)[1].split("\n\n", 1)[0])
    installed = next(d for d in yaml.safe_load_all(manifest.split("MANIFEST:", 1)[1]) if d
                     and d["kind"] == "Secret" and d["metadata"]["name"].endswith("extender-tls"))
    assert printed["tlsConfig"] == {"serverName": name, "caData": installed["data"]["ca.crt"],
                                    "certFile": f"{client_dir}/tls.crt",
                                    "keyFile": f"{client_dir}/tls.key"}
    # and the NOTES say where the client certificate comes from
    assert "secret sharegpu-extender-client-tls -o jsonpath='{.data.tls\\.key}'" in notes


def test_extender_tls_opt_out_and_own_secret():
    # plain HTTP only when asked for by name
    plain = render(None, KUBE, "extender.tls.enabled=false")
    ext = yaml.safe_load(one(plain, "ConfigMap", "scheduler-config")["data"]["config.yaml"])[
        "extenders"][0]
    assert ext["urlPrefix"].startswith("http://") and ext["enableHTTPS"] is False
    assert "tlsConfig" not in ext
    assert "--insecure" in args_of(one(plain, "Deployment", "extender"))
    assert not [d for d in plain if d["kind"] == "Secret" and "extender" in
                d["metadata"]["name"]]
    assert one(plain, "NetworkPolicy", "extender")["spec"]["ingress"][0]["ports"][0]["port"] \
        == "http"
    # a Secret of one's own (cert-manager): not rendered; the scheduler mounts only its ca.crt,
    # and its client certificate from a Secret of one's own too (required)
    r = run_helm("template", "x", str(CHART), "--set", "extender.tls.existingSecret=mine")
    assert r.returncode != 0 and "needs extender.tls.existingClientSecret" in r.stderr
    own = render(None, KUBE, "extender.tls.existingSecret=my-extender-tls",
                 "extender.tls.existingClientSecret=my-scheduler-client")
    assert not [d for d in own if d["kind"] == "Secret" and "extender" in d["metadata"]["name"]]
    ext = yaml.safe_load(one(own, "ConfigMap", "scheduler-config")["data"]["config.yaml"])[
        "extenders"][0]
    assert ext["tlsConfig"] == {"serverName": f"sharegpu-extender.{NS}.svc",
                                "caFile": "/etc/sharegpu-extender-ca/ca.crt",
                                "certFile": "/etc/sharegpu-extender-client/tls.crt",
                                "keyFile": "/etc/sharegpu-extender-client/tls.key"}
    sched_vols = one(own, "Deployment", "scheduler")["spec"]["template"]["spec"]["volumes"]
    (client_vol,) = [v for v in sched_vols if v["name"] == "extender-client"]
    assert client_vol["secret"]["secretName"] == "my-scheduler-client"
    sched = one(own, "Deployment", "scheduler")["spec"]["template"]["spec"]
    (vol,) = [v for v in sched["volumes"] if v["name"] == "extender-ca"]
    assert vol["secret"] == {"secretName": "my-extender-tls",
                             "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert {"name": "extender-ca", "mountPath": "/etc/sharegpu-extender-ca",
            "readOnly": True} in container(one(own, "Deployment", "scheduler"))["volumeMounts"]
    dep = one(own, "Deployment", "extender")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "my-extender-tls"}} in dep["volumes"]
    r = run_helm("template", "x", str(CHART), "--set", "extender.metricsPort=8888")
    assert r.returncode != 0 and "extender.metricsPort must differ" in r.stderr


def _matches(selector, labels):
    return selector["matchLabels"].items() <= labels.items()


def test_extender_network_policy_admits_only_the_scheduler_to_the_verbs():
    """Rendered selectors (no network plugin enforces NetworkPolicy here): the policy selects
    the extender pods; the verb port admits the chart's kube-scheduler pods and the extender
    replicas (bind forwarding), not the agent or the webhook; the metrics port is open."""
    docs = render(None)
    pol = one(docs, "NetworkPolicy", "extender")
    spec = pol["spec"]
    labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
              for d in docs if d["kind"] in ("Deployment", "DaemonSet")}
    assert spec["policyTypes"] == ["Ingress"]
    assert [n for n, lab in labels.items() if _matches(spec["podSelector"], lab)] == [
        "sharegpu-extender"]
    verbs, metrics = spec["ingress"]
    assert verbs["ports"] == [{"port": "https", "protocol": "TCP"}]
    admitted = {n for peer in verbs["from"] for n, lab in labels.items()
                if set(peer) == {"podSelector"} and _matches(peer["podSelector"], lab)}
    assert admitted == {"sharegpu-scheduler", "sharegpu-extender"}
    assert all(set(peer) == {"podSelector"} for peer in verbs["from"])  # this namespace only
    # the named ports are the extender container's
    names = {p["name"] for p in container(one(docs, "Deployment", "extender"))["ports"]}
    assert {verbs["ports"][0]["port"], metrics["ports"][0]["port"]} == names
    assert metrics == {"ports": [{"port": "metrics", "protocol": "TCP"}]}  # from anywhere
    prom = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    limited = one(render(None, KUBE, "extender.networkPolicy.metricsFrom[0].namespaceSelector"
                         ".matchLabels.kubernetes\\.io/metadata\\.name=monitoring"),
                  "NetworkPolicy", "extender")
    assert limited["spec"]["ingress"][1]["from"] == prom
    assert not [d for d in render(None, KUBE, "extender.networkPolicy.enabled=false")
                if d["kind"] == "NetworkPolicy"]
    # scheduler.mode=default: the cluster's kube-scheduler matches no pod selector; the chart
    # refuses to render a policy that would block it, unless told where it runs
    r = run_helm("template", "x", str(CHART), "--set", "scheduler.mode=default")
    assert r.returncode != 0
    assert "extender.networkPolicy.extraIngress" in r.stderr and "enabled=false" in r.stderr
    dflt = one(render("default-scheduler.yaml"), "NetworkPolicy", "extender")["spec"]
    peers = dflt["ingress"][0]["from"]
    assert {"ipBlock": {"cidr": "192.0.2.0/28"}} in peers
    assert not [p for p in peers if "podSelector" in p and _matches(
        p["podSelector"], {"app.kubernetes.io/component": "scheduler",
                           "app.kubernetes.io/name": "sharegpu",
                           "app.kubernetes.io/instance": "sharegpu"})]


def _x509(pem: str) -> str:
    r = subprocess.run(["openssl", "x509", "-noout", "-text"], input=pem, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_webhook_sees_only_gpu_pods():
    import celpy

    hook = pods_hook(one(render(None), "ValidatingWebhookConfiguration"))
    (cond,) = hook["matchConditions"]
    env = celpy.Environment()
    prog = env.program(env.compile(cond["expression"]))

    def sent(pod):
        return bool(prog.evaluate({"object": celpy.json_to_cel(pod)}))

    def pod(containers, labels=None, init=None):
        spec = {"containers": containers}
        if init:
            spec["initContainers"] = init
        return {"metadata": {"name": "p", **({"labels": labels} if labels else {})},
                "spec": spec}

    assert sent(pod([{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": 2}}}]))
    assert sent(pod([{"name": "a"}, {"name": "b", "resources": {
        "requests": {"aliyun.com/gpu-core.percentage": 30}}}]))
    assert sent(pod([{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}}]))
    assert sent(pod([{"name": "c"}], labels={"aliyun.com/gpu-count": "2"}))
    assert sent(pod([{"name": "c"}], init=[{"name": "i", "resources": {
        "limits": {"aliyun.com/gpu-mem": 1}}}]))
    assert not sent(pod([{"name": "c"}]))
    assert not sent(pod([{"name": "c", "resources": {"limits": {"cpu": "1"}}}],
                        labels={"app": "x"}))
    # before Kubernetes 1.28 there are no matchConditions: every pod is sent
    old = pods_hook(one(render(None, "1.27.0", UNGUARDED), "ValidatingWebhookConfiguration"))
    assert "matchConditions" not in old


# --- monitoring ------------------------------------------------------------------------------

# Metric names the dashboard may use, as the extender and the node agent export them
# (prometheus_client adds _total to counters and _bucket/_sum/_count to histograms).
DECLARED = {
    "sharegpu_gpu_memory_total", "sharegpu_gpu_memory_allocated",
    "sharegpu_gpu_core_allocated_percent", "sharegpu_gpu_pods",
    "sharegpu_node_gpu_memory_allocated", "sharegpu_node_gpu_memory_total",
    "sharegpu_extender_decisions_total", "sharegpu_extender_request_seconds_bucket",
    "sharegpu_extender_failures_total", "sharegpu_extender_leader",
    "sharegpu_extender_state_drift_total", "sharegpu_extender_state_drift_pods",
    "sharegpu_extender_relists_total", "sharegpu_extender_rebuild_seconds",
    "sharegpu_extender_events_total",
    "sharegpu_agent_gpus", "sharegpu_agent_gpu_healthy", "sharegpu_agent_mode_info",
    "sharegpu_agent_registrations_total", "sharegpu_agent_allocations_total",
    "sharegpu_agent_allocation_failures_total", "sharegpu_agent_gpu_memory_used_bytes",
    "sharegpu_agent_pod_resources_promised", "sharegpu_agent_pod_resources_named_total",
    "sharegpu_agent_container_gpu_memory_used_bytes",
    "sharegpu_agent_container_gpu_memory_allocated_bytes",
}


def exported_metrics() -> set[str]:
    """Names declared in the components' metrics modules where they are present in this tree
    (then they are the truth), else the list above."""
    found: set[str] = set()
    for mod in ("extender", "agent"):
        path = ROOT / "src" / "sharegpu" / mod / "metrics.py"
        if not path.is_file():
            return DECLARED
        text = path.read_text()
        for name in set(re.findall(r"\bsharegpu_[a-z_]+", text)):
            found.add(name)
            if re.search(rf'(?:Counter|_Counts)\(\s*"{name}"', text) or name.endswith("_total"):
                found.add(name.removesuffix("_total") + "_total")
            if re.search(rf'Histogram\(\s*"{name}"', text):
                found |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return found


def dashboard() -> dict:
    return json.loads((CHART / "dashboards" / "sharegpu.json").read_text())


def test_dashboard_uses_only_exported_metrics():
    dash = dashboard()
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = {m for e in exprs for m in re.findall(r"\bsharegpu_[a-z_]+", e)}
    assert used <= exported_metrics(), used - exported_metrics()
    # the cluster figure of kubectl inspect cgpu, the extender's health and the agents'
    assert {"sharegpu_gpu_memory_allocated", "sharegpu_extender_request_seconds_bucket",
            "sharegpu_extender_leader", "sharegpu_agent_gpu_healthy"} <= used
    # allocated against in use, per GPU and per container
    assert {"sharegpu_agent_gpu_memory_used_bytes",
            "sharegpu_agent_container_gpu_memory_used_bytes",
            "sharegpu_agent_container_gpu_memory_allocated_bytes"} <= used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "sharegpu-overview"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24


def test_service_monitors_scrape_named_ports_and_dashboard_configmap():
    docs = render("monitoring.yaml")
    for comp, port in (("extender", "metrics"), ("agent", "metrics")):
        sm = one(docs, "ServiceMonitor", comp)
        svc = one(docs, "Service", comp)
        assert sm["spec"]["selector"]["matchLabels"].items() <= \
            svc["metadata"]["labels"].items()
        assert sm["spec"]["endpoints"][0]["port"] == port
        assert port in [p["name"] for p in svc["spec"]["ports"]]
        assert sm["metadata"]["labels"]["release"] == "prometheus"
    cm = one(docs, "ConfigMap", "dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["sharegpu.json"]) == dashboard()
    assert not [d for d in render(None) if d["kind"] == "ServiceMonitor"]


# --- the image -------------------------------------------------------------------------------

# the agreed command-line interface of the components the chart starts
AGREED = {
    "extender": ["--listen", "--policy", "--tls-cert", "--tls-key", "--tls-ca",
                 "--tls-server-name", "--insecure", "--metrics-listen", "--kubeconfig",
                 "--lease-namespace", "--lease-name", "--id", "--check-every", "--log-level",
                 "--no-leader-election", "--graded-scores"],
    "agent": ["--node-name", "--device-plugin-dir", "--state-dir", "--isolation",
              "--core-mem-isolation", "--nvml",
              "--fake-gpus", "--kubeconfig", "--metrics-listen", "--hami-library",
              "--hami-installed", "--compute-policy", "--reserve-mib", "--isolation-check-every",
              "--mps-pipe-dir", "--mps-shm-dir", "--log-level"],
    "webhook": ["--listen", "--tls-cert", "--tls-key", "--insecure", "--gpu-schedulers",
                "--log-level"],
}


def parse_component_args(args: list[str]) -> None:
    """Parse a container's args with the real ``sharegpu`` CLI when the component's command
    module is in this tree, else with a parser of the agreed flags."""
    import argparse

    comp = args[0]
    try:
        importlib.import_module(f"sharegpu.commands.{comp}")
    except ModuleNotFoundError:
        p = argparse.ArgumentParser(prog=f"sharegpu {comp}", exit_on_error=False)
        for flag in AGREED[comp]:
            if flag in ("--no-leader-election", "--insecure"):
                p.add_argument(flag, action="store_true")
            else:
                p.add_argument(flag)
        p.parse_args(args[1:])
        return
    from sharegpu.cli import build_parser

    parser, _ = build_parser()
    parser.parse_args(args)


@pytest.mark.parametrize("values", [None, *EXAMPLES])
def test_chart_starts_components_with_flags_they_accept(values):
    docs = render(values)
    for d in docs:
        if d["kind"] in ("Deployment", "DaemonSet") and "scheduler" not in d["metadata"]["name"]:
            c = container(d)
            assert c["image"] == f"ghcr.io/sharegpu/sharegpu:{APP_VERSION}"
            resolved = [a.replace("$(POD_NAME)", "pod").replace("$(NODE_NAME)", "node")
                        for a in c["args"]]
            parse_component_args(resolved)


def dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_builds_one_image_for_every_component():
    """No container engine here: the Dockerfile is checked for structure, not built."""
    ins = dockerfile()
    known = {"FROM", "RUN", "COPY", "WORKDIR", "ENV", "USER", "ENTRYPOINT", "CMD", "LABEL",
             "ARG", "EXPOSE"}
    assert {w for w, _ in ins} <= known
    froms = [rest for w, rest in ins if w == "FROM"]
    assert froms and all(re.match(r"\$\{BASE_IMAGE\}(\s+AS\s+\w+)?$", f) for f in froms)
    (base,) = [rest.split("=", 1)[1] for w, rest in ins if w == "ARG" and "BASE_IMAGE=" in rest]
    assert re.match(r"docker\.io/library/python:3\.1[1-9][\w.-]*@sha256:[0-9a-f]{64}$", base)
    runs = " ".join(rest for w, rest in ins if w == "RUN")
    assert "pip wheel" in runs and "--no-index /wheels/*.whl" in runs
    copies = [rest for w, rest in ins if w == "COPY"]
    assert "pyproject.toml README.md LICENSE constraints.txt ./" in copies and "src ./src" in copies
    # the image checks both console scripts exist
    assert "sharegpu --help" in runs and "kubectl-inspect-cgpu --help" in runs
    assert ("ENTRYPOINT", '["sharegpu"]') in ins
    assert ins[-1][0] == "CMD" and [rest for w, rest in ins if w == "USER"] == ["65532:65532"]
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["sharegpu"] == "sharegpu.cli:main"
    assert scripts["kubectl-inspect-cgpu"] == "sharegpu.whatif.plugin:main"
    # what the chart runs: `sharegpu <component>` for the three components
    subcommands = {args_of(d)[0] for d in render(None) if d["kind"] in ("Deployment", "DaemonSet")
                   and "scheduler" not in d["metadata"]["name"]}
    assert subcommands == {"extender", "agent", "webhook"}
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored and "src" not in ignored


@pytest.mark.parametrize("kube", ["1.25.0", "1.28.0", "1.33.0"])
def test_default_render_is_valid_across_supported_kubernetes_versions(kube):
    docs = render(None, kube, *([] if kube == "1.33.0" else [UNGUARDED]))
    for d in docs:
        kubernetes_validate.validate(d, kube, strict=True)
    image = container(one(docs, "Deployment", "scheduler"))["image"]
    assert image == f"registry.k8s.io/kube-scheduler:v{kube}"
    hook = pods_hook(one(docs, "ValidatingWebhookConfiguration"))
    assert ("matchConditions" in hook) == (kube != "1.25.0")
    r = run_helm("template", "x", str(CHART), "--kube-version", "1.24.9")
    assert r.returncode != 0 and "kubeVersion" in r.stderr + r.stdout


# --- isolation: HAMi-core from HAMi's image, the MPS daemon, the compute policy ---------------

def init_container(ds, name):
    (c,) = [c for c in ds["spec"]["template"]["spec"].get("initContainers", [])
            if c["name"] == name]
    return c


def sidecar(ds, name):
    found = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found[0] if found else None


def test_hami_core_comes_from_hamis_pinned_image():
    ds = one(render(None), "DaemonSet", "agent")
    init = init_container(ds, "hami-install")
    assert init["image"] == "projecthami/hami:v2.10.0"
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env["HAMI_VERSION"] == "v2.10.0" and env["HAMI_LIB_DIR"] == "/k8s-vgpu/lib/nvidia"
    assert env["DEST"] == "/usr/local/vgpu/sharegpu" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/usr/local/vgpu/sharegpu"}
    args = args_of(ds)
    assert "--hami-installed=/usr/local/vgpu/sharegpu/installed" in args
    assert not any(a.startswith("--hami-library") for a in args)
    agent_mounts = {m["mountPath"]: m for m in container(ds)["volumeMounts"]}
    assert agent_mounts["/usr/local/vgpu/sharegpu"]["readOnly"] is True
    caps = {e["name"]: e.get("value") for e in container(ds)["env"]}
    assert caps["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"  # libcuda for the load check
    digest = "sha256:" + "ab" * 32
    pinned = one(render(None, KUBE, f"agent.hami.image.digest={digest}"), "DaemonSet", "agent")
    assert init_container(pinned, "hami-install")["image"] == f"projecthami/hami@{digest}"
    own = one(render(None, KUBE, "agent.hami.install=false",
                     "agent.hamiLibrary=/opt/hami/libvgpu.so.v2.10.0"), "DaemonSet", "agent")
    assert "initContainers" not in own["spec"]["template"]["spec"]
    assert "--hami-library=/opt/hami/libvgpu.so.v2.10.0" in args_of(own)
    # the agent reads (and checks) the node's library: its directory is mounted, read-only
    own_agent = next(c for c in own["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "agent")
    assert {"name": "hami-lib", "mountPath": "/opt/hami", "readOnly": True} in \
        own_agent["volumeMounts"]
    assert {"name": "hami-lib", "hostPath": {"path": "/opt/hami", "type": "DirectoryOrCreate"}} \
        in own["spec"]["template"]["spec"]["volumes"]
    share = one(render("share.yaml"), "DaemonSet", "agent")  # isolation none: nothing to install
    assert "initContainers" not in share["spec"]["template"]["spec"]


def run_install(script: str, image_lib: Path, dest: Path, version: str = "v2.10.0"):
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "HAMI_VERSION": version,
                               "HAMI_LIB_DIR": str(image_lib), "DEST": str(dest)})


# the two CUDA hooks the agent's check wants HAMi-core to export
HOOKS_C = ("int cuMemAlloc_v2(void *p, unsigned long n) { return 3; }\n"
           "int cuMemGetInfo_v2(void *f, void *t) { return 3; }\n")


def test_hami_install_script_versions_and_never_rewrites(tmp_path):
    """The init container's script, as rendered, run against the layout of HAMi's image."""
    from sharegpu.agent.readiness import check_hami

    script = init_container(one(render(None), "DaemonSet", "agent"), "hami-install")["args"][0]
    image = tmp_path / "k8s-vgpu" / "lib" / "nvidia"
    image.mkdir(parents=True)
    dest = tmp_path / "host" / "usr" / "local" / "vgpu" / "sharegpu"
    # no library in the image: a clear failure, nothing recorded
    r = run_install(script, image, dest)
    assert r.returncode == 1 and "neither libvgpu.so.v2.10.0 nor libvgpu.so" in r.stderr
    assert not (dest / "installed").exists()
    # the release's file: copied into a versioned directory, recorded in `installed`
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc
    (tmp_path / "v.c").write_text("int sharegpu_release(void) { return 210; }\n" + HOOKS_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(image / "libvgpu.so.v2.10.0"),
                    str(tmp_path / "v.c")], check=True)
    r = run_install(script, image, dest)
    assert r.returncode == 0, r.stderr
    first = Path((dest / "installed").read_text().strip())
    assert first.parent.parent == dest and first.parent.name.startswith("hami-v2.10.0-")
    assert first.name == "libvgpu.so" and check_hami(str(first)).ready
    inode = first.stat().st_ino
    # the same release again (a pod restart): nothing rewritten
    r = run_install(script, image, dest)
    assert r.returncode == 0 and "already installed" in r.stdout
    assert first.stat().st_ino == inode
    # another build under the same tag (a new digest): a new directory, the old file untouched
    (tmp_path / "v.c").write_text("int sharegpu_release(void) { return 211; }\n" + HOOKS_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(image / "libvgpu.so.v2.10.0"),
                    str(tmp_path / "v.c")], check=True)
    assert run_install(script, image, dest).returncode == 0
    second = Path((dest / "installed").read_text().strip())
    assert second != first and first.exists() and first.stat().st_ino == inode
    # releases before v2.8 ship libvgpu.so without the version in its name
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(image / "libvgpu.so.v2.10.0", old / "libvgpu.so")
    assert run_install(script, old, dest, "v2.5.0").returncode == 0
    assert "/hami-v2.5.0-" in (dest / "installed").read_text()


def test_mps_daemon_runs_beside_the_agent():
    from sharegpu.cli import build_parser

    for values in (None, "mps.yaml"):
        ds = one(render(values), "DaemonSet", "agent")
        mps = sidecar(ds, "mps-control")
        assert mps is not None and mps["args"][0] == "mps-daemon"
        build_parser()[0].parse_args(mps["args"])  # flags the command accepts
        assert "--pipe-dir=/run/nvidia/mps" in mps["args"]
        mounts = {m["mountPath"]: m for m in mps["volumeMounts"]}
        assert {"/run/nvidia/mps", "/dev/shm", "/var/lib/sharegpu"} <= set(mounts)
        env = {e["name"]: e["value"] for e in mps["env"]}
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
        vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
        shm = next(m for m in mps["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert vols[shm["name"]]["hostPath"]["path"] == "/run/nvidia/mps-shm"
    assert sidecar(one(render("share.yaml"), "DaemonSet", "agent"), "mps-control") is None
    off = one(render(None, KUBE, "agent.mps.enabled=false"), "DaemonSet", "agent")
    assert sidecar(off, "mps-control") is None


def test_compute_policy_value_and_refusal():
    assert "--compute-policy=5" in args_of(one(render(None), "DaemonSet", "agent"))
    fixed = one(render(None, KUBE, "computePolicy=3"), "DaemonSet", "agent")
    assert "--compute-policy=3" in args_of(fixed)
    assert "--reserve-mib=0" in args_of(one(render(None), "DaemonSet", "agent"))
    reserved = one(render(None, KUBE, "agent.reserveMemoryMiB=1024"), "DaemonSet", "agent")
    assert "--reserve-mib=1024" in args_of(reserved)
    for bad in ("0", "1", "2", "4"):
        r = run_helm("template", "sharegpu", str(CHART), "--set", f"computePolicy={bad}")
        assert r.returncode != 0 and "computePolicy" in r.stderr
    r = run_helm("template", "sharegpu", str(CHART), "--set", "agent.reserveMemoryMiB=-1")
    assert r.returncode != 0 and "reserveMemoryMiB" in r.stderr


# --- ResourcePolicy ---------------------------------------------------------------------------


def _policy_schema(docs) -> dict:
    crd = one(docs, "CustomResourceDefinition", "resourcepolicies")
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def _policy(**spec) -> dict:
    body = {"selector": {"app": "web"},
            "units": [{"resource": "ecs", "nodeSelector": {"pool": "a"}, "max": 10,
                       "podLabels": {"unit": "a"}, "podAnnotations": {"x": "y"}},
                      {"resource": "eci"}],
            "strategy": "prefer", "preemptPolicy": "AfterAllUnits",
            "ignorePreviousPod": False, "ignoreTerminatingPod": True,
            "matchLabelKeys": ["pod-template-hash"],
            "whenTryNextUnits": {"policy": "TimeoutOrExceedMax", "timeout": "1h30m"}}
    body.update(spec)
    return {"apiVersion": "scheduling.alibabacloud.com/v1alpha1", "kind": "ResourcePolicy",
            "metadata": {"name": "web", "namespace": "default"}, "spec": body}


def test_resourcepolicy_crd_schema_and_printer_columns():
    import jsonschema

    docs = render(None)
    crd = one(docs, "CustomResourceDefinition", "resourcepolicies")
    assert crd["metadata"]["name"] == "resourcepolicies.scheduling.alibabacloud.com"
    assert crd["spec"]["group"] == "scheduling.alibabacloud.com"
    assert crd["spec"]["scope"] == "Namespaced"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Selector", "Strategy", "Next-Unit", "Units", "Age"]
    schema = _policy_schema(docs)
    jsonschema.validate(_policy(), schema)
    for bad in (_policy(units=[]), _policy(selector={}), _policy(strategy="required"),
                _policy(units=[{"max": -1}]), _policy(units=[{"max": "3"}]),
                _policy(units=[{"resource": "elastic"}]), _policy(preemptPolicy="Never"),
                _policy(whenTryNextUnits={"policy": "Sometimes"}),
                _policy(whenTryNextUnits={"timeout": "15 minutes"}),
                _policy(ignorePreviousPod="yes"), _policy(units=[{"podLabels": {"a": 1}}])):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    del_units = _policy()
    del del_units["spec"]["units"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(del_units, schema)
    # the extender's own validation accepts what the schema accepts here
    from sharegpu.core.resourcepolicy import parse_policy

    assert parse_policy(_policy()).timeout_s == 5400
    # installCRD=false leaves it out (a cluster that has it already)
    assert [d["metadata"]["name"] for d in render(None, KUBE, "resourcePolicy.installCRD=false")
            if d["kind"] == "CustomResourceDefinition"] == ["podgroups.scheduling.sigs.k8s.io"]


def test_webhook_validates_resourcepolicies_and_fails_closed():
    docs = render(None)
    cfg = one(docs, "ValidatingWebhookConfiguration", "webhook")
    (hook,) = [w for w in cfg["webhooks"] if w["name"] == "resourcepolicies.validate.sharegpu.io"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["rules"] == [{"apiGroups": ["scheduling.alibabacloud.com"],
                              "apiVersions": ["v1alpha1"], "operations": ["CREATE", "UPDATE"],
                              "resources": ["resourcepolicies"], "scope": "Namespaced"}]
    pods = next(w for w in cfg["webhooks"] if w["name"] == "pods.validate.sharegpu.io")
    assert hook["clientConfig"] == pods["clientConfig"]
def test_podgroup_crd_and_the_extenders_right_to_read_it():
    """The gang PodGroup CRD (ACK's scheduling.sigs.k8s.io/v1alpha1) renders by default, the
    extender may read PodGroups, and the CRD can be left out where it is installed already."""
    from sharegpu.core.gang import PODGROUP_GROUP, PODGROUP_VERSION
    from sharegpu.extender.podgroups import PODGROUPS

    docs = render(None)
    crd = one(docs, "CustomResourceDefinition", "podgroups")
    assert crd["metadata"]["name"] == f"podgroups.{PODGROUP_GROUP}"
    assert crd["spec"]["group"] == PODGROUP_GROUP and crd["spec"]["scope"] == "Namespaced"
    # a *.k8s.io group: the API server wants the approval annotation (see test_chart_real)
    assert crd["metadata"]["annotations"]["api-approved.kubernetes.io"].startswith("unapproved")
    (v,) = crd["spec"]["versions"]
    assert v["name"] == PODGROUP_VERSION and v["served"] and v["storage"]
    spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["minMember"]["minimum"] == 1 and spec["scheduleTimeoutSeconds"]["minimum"] == 1
    assert f"/apis/{PODGROUP_GROUP}/{PODGROUP_VERSION}/podgroups" == PODGROUPS
    ext = permissions(docs)["sharegpu-extender"][0]
    for verb in ("get", "list", "watch"):
        assert (PODGROUP_GROUP, "podgroups", verb, None) in ext
    off = render(None, KUBE, "gang.installPodGroupCRD=false")
    assert [d["metadata"]["name"] for d in off if d["kind"] == "CustomResourceDefinition"] == [
        "resourcepolicies.scheduling.alibabacloud.com"]


def test_the_extender_watches_dra_objects_only_in_dra_mode():
    """Without agent.dra.enabled the extender is not told --dra, so it never asks for
    ResourceSlices or ResourceClaims (it has no right to); with it, it is."""
    plain = args_of(one(render(None), "Deployment", "extender"))
    assert "--dra" not in plain
    dra = args_of(one(render(None, "1.34.0", "agent.dra.enabled=true"), "Deployment",
                      "extender"))
    assert "--dra" in dra


def test_agent_metrics_name_pods_only_when_asked():
    """/metrics is reachable from the pod network: by default a container is named by its pod's
    UID only; agent.metricsPodNames adds the namespace and name."""
    assert "--metrics-pod-names" not in args_of(one(render(None), "DaemonSet", "agent"))
    named = one(render(None, KUBE, "agent.metricsPodNames=true"), "DaemonSet", "agent")
    assert "--metrics-pod-names" in args_of(named)


def test_agent_usage_metrics_share_the_hosts_pid_namespace():
    """NVML reports only the GPU processes of the caller's PID namespace: with usage metrics
    (the default) the agent pod runs with hostPID and reads /proc; off, neither."""
    ds = one(render(None), "DaemonSet", "agent")
    assert ds["spec"]["template"]["spec"]["hostPID"] is True
    assert "--host-proc=/proc" in args_of(ds)
    off = one(render(None, KUBE, "agent.usageMetrics=false"), "DaemonSet", "agent")
    assert "hostPID" not in off["spec"]["template"]["spec"]
    assert "--host-proc=" in args_of(off)
