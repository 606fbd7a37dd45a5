"""The deployment samples parse and carry the keys of SPEC §4 with the values the extender
needs (weight high enough for the policy to decide, verbs matching the HTTP paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sharegpu import names

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
EXTENDER_KEYS = {"urlPrefix", "filterVerb", "prioritizeVerb", "bindVerb", "weight",
                 "nodeCacheCapable", "managedResources", "ignorable", "httpTimeout",
                 "enableHTTPS", "tlsConfig"}


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def scheduler_configs() -> dict[str, dict[str, Any]]:
    out = {"scheduler-config.yaml": docs("scheduler-config.yaml")[0]}
    for d in docs("co-scheduler.yaml"):
        if d["kind"] == "ConfigMap":
            out["co-scheduler.yaml"] = yaml.safe_load(d["data"]["scheduler-config.yaml"])
    return out


def test_every_sample_parses_into_kubernetes_objects() -> None:
    files = sorted(DEPLOY.glob("*.yaml"))
    assert {f.name for f in files} >= {"scheduler-config.yaml", "co-scheduler.yaml",
                                       "extender.yaml", "webhook.yaml"}
    for f in files:
        for d in docs(f.name):
            assert d.get("apiVersion") and d.get("kind"), f.name


def test_extenders_follow_the_wire_contract() -> None:
    configs = scheduler_configs()
    assert set(configs) == {"scheduler-config.yaml", "co-scheduler.yaml"}
    for name, cfg in configs.items():
        assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1", name
        assert cfg["kind"] == "KubeSchedulerConfiguration", name
        (ext,) = cfg["extenders"]
        assert set(ext) <= EXTENDER_KEYS, set(ext) - EXTENDER_KEYS
        assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == (
            "filter", "prioritize", "bind")
        assert ext["urlPrefix"].endswith(":8888")  # the extender's default --listen port
        # 10 × weight × 10 between the policy's best node and the next must beat the sum of
        # kube-scheduler's own scores (at most 100 per plugin times its weight)
        assert ext["weight"] >= 100_000
        assert ext["nodeCacheCapable"] is True
        assert ext["ignorable"] is False
        managed = {r["name"] for r in ext["managedResources"]}
        assert managed == {names.RES_GPU_MEM, names.RES_GPU_CORE, names.RES_TOPOLOGY_GPU,
                           names.RES_NVIDIA_GPU}


def test_profiles() -> None:
    configs = scheduler_configs()
    default = [p["schedulerName"] for p in configs["scheduler-config.yaml"]["profiles"]]
    assert default == ["default-scheduler"]
    co = configs["co-scheduler.yaml"]
    assert [p["schedulerName"] for p in co["profiles"]] == [names.CO_SCHEDULER_NAME]
    # its own lock, so it runs beside the default scheduler
    assert co["leaderElection"]["resourceName"] == names.CO_SCHEDULER_NAME


def test_extender_deployment_matches_the_command() -> None:
    all_docs = docs("extender.yaml")
    by_kind = {d["kind"]: d for d in all_docs}
    dep = by_kind["Deployment"]
    assert dep["spec"]["replicas"] >= 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["sharegpu", "extender"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    rules = [r for d in all_docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]
    granted = {(r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]}
    needed = {("pods", "get"), ("pods", "list"), ("pods", "watch"), ("pods", "patch"),
              ("nodes", "get"), ("nodes", "list"), ("nodes", "watch"),
              ("pods/binding", "create"), ("events", "create"),
              ("leases", "create"), ("leases", "get"), ("leases", "update")}
    assert granted == needed  # all it needs, and nothing more
    from sharegpu.cli import build_parser

    parser, _ = build_parser()
    args = parser.parse_args([a.replace("$(POD_NAME)", "x") for a in c["command"][1:]])
    assert args.lease_name == "sharegpu-extender" and args.listen == "0.0.0.0:8888"


def test_webhook_fails_closed() -> None:
    by_kind = {d["kind"]: d for d in docs("webhook.yaml")}
    (hook,) = by_kind["ValidatingWebhookConfiguration"]["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["clientConfig"]["service"]["path"] == "/validate"
    assert hook["rules"][0]["operations"] == ["CREATE"]
    assert hook["rules"][0]["resources"] == ["pods"]
    assert hook["admissionReviewVersions"] == ["v1"]
    c = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["sharegpu", "webhook"]
    assert any(a.startswith("--tls-cert=") for a in c["command"])
