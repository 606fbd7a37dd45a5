"""The chart's tenant guard (docs/security.md): which Kubernetes versions get it, and that the
keys and names in its ValidatingAdmissionPolicies are the ones sharegpu's code writes. What the
policies do against a real kube-apiserver: tests/e2e/test_tenant_guard_real.py."""

from __future__ import annotations

import ast

import yaml

from sharegpu.core import names
from sharegpu.core.annotations import Allocation, assigned_patch, encode
from sharegpu.core.modes import card_model_labels
from sharegpu.core.resourcepolicy import ANN_UNIT
from test_chart import CHART, KUBE, NS, UNGUARDED, find, one, render, run_helm

EXTENDER = f"system:serviceaccount:{NS}:sharegpu-extender"
AGENT = f"system:serviceaccount:{NS}:sharegpu-agent"
POLICIES = ["decision-keys", "binding-keys", "template-keys", "agent-node", "agent-pods"]


def cel_list(policy, var):
    (v,) = [v for v in policy["spec"]["variables"] if v["name"] == var]
    return ast.literal_eval(v["expression"])


def policies(docs):
    return {d["metadata"]["name"].removeprefix("sharegpu-"): d for d in docs
            if d["kind"] == "ValidatingAdmissionPolicy"}


def test_every_policy_is_bound_to_deny_and_fails_closed():
    docs = render(None)
    got = policies(docs)
    assert sorted(got) == sorted(POLICIES)
    binds = {d["spec"]["policyName"]: d for d in docs
             if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    for name, p in got.items():
        assert p["spec"]["failurePolicy"] == "Fail", name
        assert binds[p["metadata"]["name"]]["spec"]["validationActions"] == ["Deny"]
        assert "paramKind" not in p["spec"] and "paramRef" not in binds[p["metadata"]["name"]]
    dra = policies(render(None, "1.37.0", "agent.dra.enabled=true"))
    assert sorted(dra) == sorted([*POLICIES, "agent-slices"])
    assert sorted(policies(render(None, KUBE, "agent.enabled=false"))) == sorted(POLICIES[:3])


def test_the_keys_are_the_ones_sharegpu_writes():
    p = policies(render(None))
    own, assigned = cel_list(p["decision-keys"], "own"), cel_list(p["decision-keys"], "assigned")
    assert set(assigned) == set(assigned_patch())
    written = encode(Allocation(mem={0: {0: 2}}, core={0: {0: 30}}), assume_time_ns=1)
    assert set(written) <= set(own) | set(assigned)
    assert set(own) == set(written) - set(assigned) | {ANN_UNIT}
    both = set(own) | set(assigned)
    assert set(cel_list(p["binding-keys"], "keys")) == both
    assert set(cel_list(p["template-keys"], "keys")) == both
    assert set(cel_list(p["agent-pods"], "assigned")) == set(assigned)
    # what the agent may write on its node: its card labels and every condition it keeps
    assert set(cel_list(p["agent-node"], "labels")) == set(card_model_labels("T4", 15109, 2))
    conditions = {v for k, v in vars(names).items() if k.startswith("CONDITION_")}
    assert conditions <= set(cel_list(p["agent-node"], "conditions"))
    # and the node annotations it writes are all under the prefix the policy lets through
    node_anns = [v for k, v in vars(names).items() if k.startswith("ANN_NODE_")]
    assert node_anns and all(v.startswith("sharegpu.io/") for v in node_anns)
    assert any("k.startsWith('sharegpu.io/')" in v["expression"]
               for v in p["agent-node"]["spec"]["validations"])


def test_the_identities_are_the_releases_service_accounts():
    p = policies(render(None))
    text = repr(p)
    assert EXTENDER in text and AGENT in text
    for name in ("agent-node", "agent-pods"):
        assert p[name]["spec"]["matchConditions"] == [
            {"name": "the-agent", "expression": f"request.userInfo.username == '{AGENT}'"}]
    # another release's names follow its fullname
    other = policies(_render_release("team-gpu"))
    assert "system:serviceaccount:gpu-system:team-gpu-sharegpu-extender" in repr(other)


def _render_release(release):
    r = run_helm("template", release, str(CHART), "-n", NS, "--kube-version", KUBE)
    assert r.returncode == 0, r.stderr
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def test_kubernetes_before_1_30_is_refused_without_the_guard():
    r = run_helm("template", "x", str(CHART), "--kube-version", "1.29.9")
    assert r.returncode != 0
    assert "tenant guard needs ValidatingAdmissionPolicy" in r.stderr
    assert "tenantGuard.installUnguarded=true" in r.stderr
    docs = render(None, "1.29.9", UNGUARDED)
    assert not [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]
    # a cluster whose discovery lists kinds but not ValidatingAdmissionPolicy: refused too
    r = run_helm("template", "x", str(CHART), "--kube-version", "1.31.0", "--api-versions",
                 "admissionregistration.k8s.io/v1/ValidatingWebhookConfiguration")
    assert r.returncode != 0 and "tenant guard" in r.stderr
    r = run_helm("template", "x", str(CHART), "--kube-version", "1.31.0", "--api-versions",
                 "admissionregistration.k8s.io/v1/ValidatingWebhookConfiguration",
                 "--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy")
    assert r.returncode == 0, r.stderr
    # 1.30 and later get the guard whatever installUnguarded says
    assert len(find(render(None, KUBE, UNGUARDED), "ValidatingAdmissionPolicy")) == 5


def test_the_webhook_sees_workload_templates_and_fails_closed():
    vwc = one(render(None), "ValidatingWebhookConfiguration")
    (hook,) = [w for w in vwc["webhooks"] if w["name"] == "podtemplates.validate.sharegpu.io"]
    assert hook["failurePolicy"] == "Fail"
    ops = {op for r in hook["rules"] for op in r["operations"]}
    assert ops == {"CREATE", "UPDATE"}
    kinds = {(g, res) for r in hook["rules"] for g in r["apiGroups"] for res in r["resources"]}
    assert kinds == {("apps", "deployments"), ("apps", "replicasets"), ("apps", "statefulsets"),
                     ("apps", "daemonsets"), ("batch", "jobs"), ("batch", "cronjobs"),
                     ("", "replicationcontrollers"), ("", "podtemplates")}
    (cond,) = hook["matchConditions"]
    assert "object.spec.jobTemplate.spec.template.spec.containers" in cond["expression"]
    assert "aliyun.com/gpu-mem" in cond["expression"]
