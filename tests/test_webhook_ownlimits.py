"""The webhook refuses shared-GPU containers under isolation that could set their own limits
(sharegpu.core.ownlimits): env, envFrom of ConfigMaps and Secrets with or without a prefix,
LD_PRELOAD, volumes mounted at or over the preload list or the library; in pods (created) and in
workloads' pod templates (created, or updated with a changed template)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sharegpu.agent.isolation import Backend, IsolationConfig, isolation_env
from sharegpu.core import ownlimits
from sharegpu.webhook import review
from sharegpu_testing import kobjects

MEM = "aliyun.com/gpu-mem"


def gpu_pod(**container: Any) -> dict[str, Any]:
    pod = kobjects.pod("p", mem=4)
    pod["spec"]["containers"][0].update(container)
    return pod


def admission(obj: dict[str, Any], kind: str = "Pod", group: str = "",
              operation: str = "CREATE", old: dict[str, Any] | None = None) -> dict[str, Any]:
    req: dict[str, Any] = {"uid": "u1", "kind": {"group": group, "version": "v1", "kind": kind},
                           "operation": operation, "namespace": "team-a", "object": obj}
    if old is not None:
        req["oldObject"] = old
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def verdict(obj: dict[str, Any], **kw: Any) -> tuple[bool, str]:
    r = review(admission(obj, **kw))["response"]
    return r["allowed"], (r.get("status") or {}).get("message", "")


@pytest.mark.parametrize("name", ["CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_MEMORY_LIMIT",
                                  "CUDA_DEVICE_SM_LIMIT", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "LD_PRELOAD",
                                  "NVIDIA_VISIBLE_DEVICES", "GPU_CORE_UTILIZATION_POLICY"])
def test_env_naming_a_limit_variable_is_refused_with_the_field(name):
    ok, msg = verdict(gpu_pod(env=[{"name": "A", "value": "1"}, {"name": name, "value": "x"}]))
    assert not ok
    assert msg.startswith(f"spec.containers[0].env[1].name={name!r}: ")
    assert f"may not set {name} itself" in msg


@pytest.mark.parametrize("ref", ["configMapRef", "secretRef"])
@pytest.mark.parametrize("prefix, refused", [
    (None, True), ("", True), ("C", True), ("CUDA_", True), ("CUDA_MPS_", True),
    ("CUDA_MPS_X", True), ("CUDA_DEVICE_MEMORY_LIMIT_", True), ("L", True), ("LD_", True),
    ("APP_", False), ("MY_CUDA_", False), ("CUDA_X", False), ("X", False),
])
def test_env_from_whose_prefix_could_make_a_limit_variable_is_refused(ref, prefix, refused):
    src: dict[str, Any] = {ref: {"name": "cfg"}}
    if prefix is not None:
        src["prefix"] = prefix
    ok, msg = verdict(gpu_pod(envFrom=[src]))
    assert ok is not refused, msg
    if refused:
        field = "spec.containers[0].envFrom[0]" + (".prefix" if prefix else "")
        assert msg.startswith(field + ": ")
        assert ("Secret" if ref == "secretRef" else "ConfigMap") in msg
        assert "give envFrom a prefix" in msg


@pytest.mark.parametrize("path, covered", [
    ("/etc/ld.so.preload", "/etc/ld.so.preload"), ("/etc", "/etc/ld.so.preload"),
    ("/etc/", "/etc/ld.so.preload"), ("//etc/./", "/etc/ld.so.preload"),
    ("/", "/etc/ld.so.preload"), ("/usr/local/vgpu", "/usr/local/vgpu/libvgpu.so"),
    ("/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so"),
])
def test_volume_over_the_preload_list_or_library_is_refused(path, covered):
    ok, msg = verdict(gpu_pod(volumeMounts=[{"name": "v", "mountPath": "/data"},
                                            {"name": "w", "mountPath": path}]))
    assert not ok
    assert msg.startswith(f"spec.containers[0].volumeMounts[1].mountPath={path!r}: ")
    assert f"at or over {covered}" in msg


@pytest.mark.parametrize("path", ["/etc/ssl", "/etc/ld.so.preload.d", "/data", "/usr/local/cuda"])
def test_other_mounts_pass(path):
    assert verdict(gpu_pod(volumeMounts=[{"name": "v", "mountPath": path}]))[0]


def test_what_stays_allowed():
    # other variables, a safe prefix, no GPU, whole cards, and a container opted out
    assert verdict(gpu_pod(env=[{"name": "CUDA_VISIBLE_DEVICES_X", "value": "1"},
                                {"name": "MY_LD_PRELOAD", "value": "x"}],
                           envFrom=[{"prefix": "APP_", "configMapRef": {"name": "c"}}]))[0]
    plain = kobjects.pod("p", containers=[{"cpu": "1"}])
    plain["spec"]["containers"][0]["env"] = [{"name": "LD_PRELOAD", "value": "x"}]
    assert verdict(plain)[0]
    cards = kobjects.pod("p", cards=1)
    cards["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "c"}}]
    assert verdict(cards)[0]
    opted = gpu_pod(env=[{"name": "CGPU_DISABLE", "value": "true"},
                         {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "99g"}],
                    envFrom=[{"configMapRef": {"name": "c"}}])
    assert verdict(opted)[0]


def test_init_containers_and_requests_count_too():
    # (the webhook refuses GPUs in a pod's init containers anyway; templates are not parsed so)
    spec = {"containers": [{"name": "c"}],
            "initContainers": [{"name": "i", "resources": {"requests": {MEM: "2"}},
                                "envFrom": [{"secretRef": {"name": "s"}}]}]}
    (found,) = ownlimits.problems(spec, "spec.template.spec")
    assert found.startswith("spec.template.spec.initContainers[0].envFrom[0]: "), found


def test_every_variable_isolation_sets_is_guarded():
    # each back-end's environment, as the agent builds it: none may come from the pod
    cfg = IsolationConfig()
    for b in (Backend.HAMI, Backend.MPS, Backend.HAMI_MPS):
        env = isolation_env(b, mem={0: 2, 1: 2}, core={0: 30, 1: 30}, pod_uid="u", config=cfg)
        for name in env.envs:
            assert ownlimits.guarded_name(name), (b, name)
            assert ownlimits.reachable_by_prefix("") is not None
            assert ownlimits.reachable_by_prefix(name[:3]) is not None, name


TEMPLATES = [
    ("apps", "Deployment", ("spec", "template")),
    ("apps", "StatefulSet", ("spec", "template")),
    ("apps", "DaemonSet", ("spec", "template")),
    ("apps", "ReplicaSet", ("spec", "template")),
    ("batch", "Job", ("spec", "template")),
    ("batch", "CronJob", ("spec", "jobTemplate", "spec", "template")),
    ("", "ReplicationController", ("spec", "template")),
    ("", "PodTemplate", ("template",)),
]


def workload(path: tuple[str, ...], pod: dict[str, Any]) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": "w"}}
    cur = obj
    for part in path[:-1]:
        cur = cur.setdefault(part, {})
    cur[path[-1]] = {"metadata": {}, "spec": pod["spec"]}
    return obj


@pytest.mark.parametrize("group, kind, path", TEMPLATES)
def test_pod_templates_are_checked_at_create_and_when_changed(group, kind, path):
    bad = workload(path, gpu_pod(envFrom=[{"configMapRef": {"name": "c"}}]))
    good = workload(path, gpu_pod())
    ok, msg = verdict(bad, kind=kind, group=group)
    assert not ok
    assert msg.startswith(".".join(path) + ".spec.containers[0].envFrom[0]: "), msg
    assert verdict(good, kind=kind, group=group)[0]
    # an update that brings the route in is refused; one that keeps an older template passes
    assert not verdict(bad, kind=kind, group=group, operation="UPDATE", old=good)[0]
    scaled = copy.deepcopy(bad)
    scaled["metadata"]["annotations"] = {"x": "y"}
    assert verdict(scaled, kind=kind, group=group, operation="UPDATE", old=bad)[0]


def test_a_kind_of_another_group_is_not_a_template():
    bad = workload(("spec", "template"), gpu_pod(envFrom=[{"configMapRef": {"name": "c"}}]))
    assert verdict(bad, kind="Deployment", group="example.com")[0]
