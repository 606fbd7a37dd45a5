"""Smoke test of the e2e control plane: a real kube-apiserver (TLS, x509 client certificates,
Node+RBAC authorization, service-account tokens), kube-controller-manager and kube-scheduler,
driven through lightkube."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterator
from typing import TypeVar

import pytest
from lightkube import ApiError, Client, KubeConfig
from lightkube.models.apps_v1 import DeploymentSpec
from lightkube.models.core_v1 import (
    Container,
    PodSpec,
    PodTemplateSpec,
)
from lightkube.models.meta_v1 import LabelSelector, ObjectMeta
from lightkube.models.rbac_v1 import PolicyRule, RoleRef, Subject
from lightkube.resources.apps_v1 import Deployment, ReplicaSet
from lightkube.resources.core_v1 import ConfigMap, Namespace, Node, Pod, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding

from .components import create_node
from .components import wait_for as _wait_for
from .controlplane import ControlPlane

T = TypeVar("T")
IMAGE = "registry.invalid/sharegpu/pause:never-pulled"  # no kubelet: never pulled
wait_for = functools.partial(_wait_for, every=0.5)




@pytest.fixture
def namespace(admin: Client) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    admin.create(Namespace(metadata=ObjectMeta(name=name)))
    # Pods need the namespace's "default" ServiceAccount (the ServiceAccount admission plugin).
    wait_for(
        f"ServiceAccount {name}/default",
        lambda: admin.get(ServiceAccount, "default", namespace=name),
    )
    yield name
    admin.delete(Namespace, name)


def pod(name: str, **spec: object) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name),
        spec=PodSpec(containers=[Container(name="main", image=IMAGE)], **spec),
    )


def test_apiserver_answers(controlplane: ControlPlane) -> None:
    status, body = controlplane.request("GET", "/readyz")
    assert (status, body) == (200, "ok")
    status, body = controlplane.request("GET", "/version")
    assert status == 200
    assert json.loads(body)["gitVersion"] == "v1.37.2"
    assert controlplane.server.startswith("https://127.0.0.1:")


def test_namespace_and_configmap(admin: Client, namespace: str) -> None:
    admin.create(
        ConfigMap(metadata=ObjectMeta(name="settings"), data={"mode": "share"}),
        namespace=namespace,
    )
    got = admin.get(ConfigMap, "settings", namespace=namespace)
    assert got.data == {"mode": "share"}
    assert admin.get(Namespace, namespace).status.phase == "Active"


def test_client_certificate_users(controlplane: ControlPlane, namespace: str) -> None:
    nobody = Client(KubeConfig.from_file(controlplane.kubeconfig_for("jane", ["e2e-devs"])))
    with pytest.raises(ApiError) as err:
        nobody.get(ConfigMap, "kube-root-ca.crt", namespace=namespace)
    assert err.value.status.code == 403
    assert 'User "jane"' in err.value.status.message


def test_rbac_is_enforced(controlplane: ControlPlane, admin: Client, namespace: str) -> None:
    sa = Client(KubeConfig.from_file(controlplane.service_account_kubeconfig(namespace, "reader")))
    with pytest.raises(ApiError) as err:
        list(sa.list(Pod, namespace=namespace))
    assert err.value.status.code == 403
    assert f"system:serviceaccount:{namespace}:reader" in err.value.status.message

    admin.create(
        Role(
            metadata=ObjectMeta(name="pod-reader"),
            rules=[PolicyRule(apiGroups=[""], resources=["pods"], verbs=["get", "list", "watch"])],
        ),
        namespace=namespace,
    )
    admin.create(
        RoleBinding(
            metadata=ObjectMeta(name="reader-reads-pods"),
            roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="Role", name="pod-reader"),
            subjects=[Subject(kind="ServiceAccount", name="reader", namespace=namespace)],
        ),
        namespace=namespace,
    )
    # The RBAC authorizer sees the binding through its informers: a moment later, 200.
    wait_for("RBAC to allow listing pods", lambda: list(sa.list(Pod, namespace=namespace)) == [])
    with pytest.raises(ApiError) as err:
        list(sa.list(ConfigMap, namespace=namespace))
    assert err.value.status.code == 403


def test_controller_manager_runs_deployments(admin: Client, namespace: str) -> None:
    labels = {"app": "smoke"}
    admin.create(
        Deployment(
            metadata=ObjectMeta(name="smoke"),
            spec=DeploymentSpec(
                replicas=2,
                selector=LabelSelector(matchLabels=labels),
                template=PodTemplateSpec(
                    metadata=ObjectMeta(labels=labels),
                    # No node matches: the pods stay Pending even when a test added a Node.
                    spec=PodSpec(
                        containers=[Container(name="main", image=IMAGE)],
                        nodeSelector={"sharegpu.dev/e2e-no-such-node": "true"},
                    ),
                ),
            ),
        ),
        namespace=namespace,
    )
    rs = wait_for(
        "a ReplicaSet for the Deployment",
        lambda: next(iter(admin.list(ReplicaSet, namespace=namespace, labels=labels)), None),
    )
    assert rs.metadata.ownerReferences[0].kind == "Deployment"
    pods = wait_for(
        "2 pods of the ReplicaSet",
        lambda: (p := list(admin.list(Pod, namespace=namespace, labels=labels))) and len(p) == 2
        and p,
    )  # fmt: skip
    for p in pods:
        assert p.metadata.ownerReferences[0].name == rs.metadata.name
        assert p.status.phase == "Pending"
        assert not p.spec.nodeName

    # The scheduler looked at them and found no node.
    def unschedulable() -> bool:
        for p in admin.list(Pod, namespace=namespace, labels=labels):
            conds = {c.type: c for c in p.status.conditions or []}
            cond = conds.get("PodScheduled")
            if not cond or cond.status != "False" or cond.reason != "Unschedulable":
                return False
        return True

    wait_for("the scheduler to mark the pods Unschedulable", unschedulable)


@pytest.fixture
def node(admin: Client) -> Iterator[str]:
    """A Node object with room for pods and a Ready condition (there is no kubelet behind it)."""
    name = create_node(admin, f"e2e-node-{uuid.uuid4().hex[:6]}",
                       resources={"cpu": "8", "memory": "32Gi", "pods": "110"})
    yield name
    admin.delete(Node, name)


def bound_to(admin: Client, namespace: str, name: str) -> str | None:
    return admin.get(Pod, name, namespace=namespace).spec.nodeName


def test_scheduler_binds_pods(admin: Client, namespace: str, node: str) -> None:
    got = admin.get(Node, node)
    assert got.status.allocatable["pods"] == "110"
    admin.create(pod("bind-me", nodeSelector={"kubernetes.io/hostname": node}), namespace=namespace)
    # The admission plugin TaintNodesByCondition taints a new Node not-ready; create_node lifts
    # it, as the node-lifecycle controller would on Ready=True; then the scheduler binds.
    assert wait_for("the pod to be bound", lambda: bound_to(admin, namespace, "bind-me")) == node


def test_scheduler_restart_with_config(
    controlplane: ControlPlane, admin: Client, namespace: str, node: str
) -> None:
    # Only a scheduler running with this config has a profile named "sharegpu-e2e".
    controlplane.restart_scheduler(
        config={"profiles": [{"schedulerName": "sharegpu-e2e"}]},
        extra_args=["--v=2"],
    )
    try:
        admin.create(
            pod(
                "custom-scheduler",
                schedulerName="sharegpu-e2e",
                nodeSelector={"kubernetes.io/hostname": node},
            ),
            namespace=namespace,
        )
        assert (
            wait_for("the pod to be bound", lambda: bound_to(admin, namespace, "custom-scheduler"))
            == node
        )
    finally:
        controlplane.restart_scheduler()
    controlplane.check_alive()
