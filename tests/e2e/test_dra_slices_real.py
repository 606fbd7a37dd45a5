"""DRA item 1 against the REAL control plane (kube-apiserver, kube-controller-manager,
kube-scheduler v1.37.2 with their default feature gates: resource.k8s.io/v1 is served and
DRAConsumableCapacity is on by default, so nothing is switched on for this test).

- ``helm install`` with ``agent.dra.enabled=true``: the API server accepts the DeviceClass, and
  the agent's ServiceAccount may do exactly what tests/test_chart.py's tables allow (ALLOWED plus
  ALLOWED_DRA), as the API server resolves it.
- ``sharegpu agent`` runs as that ServiceAccount with the chart's arguments (fake NVML) on a
  Node labelled into the DRA pool, and publishes a ResourceSlice the real API server validates and
  stores unchanged (allowMultipleAllocations and the capacities' requestPolicy included: a server
  with the gate off would drop them, and the agent would say so).
- The slice follows a mode change; it comes back when deleted (as the kubelet wipes its node's
  slices when it starts); a restarted agent writes nothing; a node leaving the pool loses it.
- A malformed slice is refused by the API server naming the field and the rule (the same field
  sharegpu's own check names) and the agent's slice is untouched.
- A pod's ResourceClaim is allocated by the real kube-scheduler from the slice's consumable
  capacity (consumedCapacity and shareID in its status): the capacities are usable as published.
- ``helm uninstall`` deletes the DeviceClass and the garbage collector deletes the slice.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import ApiError, Client, KubeConfig
from lightkube.models.authorization_v1 import SelfSubjectRulesReviewSpec
from lightkube.resources.authorization_v1 import SelfSubjectRulesReview
from lightkube.resources.core_v1 import Namespace, Node, Pod
from lightkube.types import PatchType

from sharegpu.core.errors import ValidationError
from sharegpu.core.modes import Mode
from sharegpu.dra.resourceslices import SliceGpu, build_slice, validate_slice

from .components import (
    SharegpuProcess,
    agent_kubeconfig,
    create_node,
    free_port,
    helm,
    install_chart,
    wait_for,
)
from .controlplane import ControlPlane
from .test_chart_real import ALLOWED, BASELINE_RESOURCES, container_args, log_problems, with_flags

RELEASE = "sharegpu-dra"
DRIVER = "gpu.sharegpu.io"
RS = "/apis/resource.k8s.io/v1/resourceslices"


def _allowed_dra() -> set[Any]:
    from .test_chart_real import CHART_TESTS

    return set(CHART_TESTS.ALLOWED_DRA)


def get(cp: ControlPlane, path: str) -> dict[str, Any] | None:
    status, body = cp.request("GET", path)
    if status == 404:
        return None
    assert status == 200, f"GET {path}: HTTP {status}: {body[:500]}"
    return json.loads(body)


def node_slices(cp: ControlPlane, node: str) -> list[dict[str, Any]]:
    got = get(cp, f"{RS}?fieldSelector=spec.nodeName={node},spec.driver={DRIVER}")
    assert got is not None
    return list(got["items"])


class Dra:
    def __init__(self, cp: ControlPlane, ns: str) -> None:
        self.cp, self.ns = cp, ns
        self.admin = Client(KubeConfig.from_file(cp.admin_kubeconfig))
        self.installed = True


@pytest.fixture(scope="module")
def dra(controlplane: ControlPlane) -> Iterator[Dra]:
    ns = f"{RELEASE}-{uuid.uuid4().hex[:6]}"
    # a second release in a cluster that may have the chart's CRDs from another one: installed
    # without them (resourcePolicy.installCRD, gang.installPodGroupCRD; values.yaml). No
    # webhook: no kubelet runs its pods here, and with DRA its claims webhook (failurePolicy
    # Fail) would refuse this test's ResourceClaims of the DeviceClass (test_dra_webhook_real
    # runs it)
    install_chart(controlplane, ns, release=RELEASE, values={
        "agent.dra.enabled": "true", "resourcePolicy.installCRD": "false",
        "gang.installPodGroupCRD": "false", "webhook.enabled": "false"})
    d = Dra(controlplane, ns)
    try:
        yield d
    finally:
        if d.installed:
            with contextlib.suppress(AssertionError):
                helm(controlplane, "uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s")
        with contextlib.suppress(ApiError):
            for p in d.admin.list(Pod, namespace=ns):
                d.admin.delete(Pod, p.metadata.name, namespace=ns, grace_period=0)
            d.admin.delete(Namespace, ns)


@pytest.fixture
def dra_node(dra: Dra) -> Iterator[str]:
    """A kubelet-less Node in cgpu mode, in the DRA pool; deleted afterwards."""
    name = create_node(dra.admin, f"e2e-dra-{uuid.uuid4().hex[:6]}",
                       labels={"ack.node.gpu.schedule": "cgpu", "sharegpu.io/dra": "true"})
    try:
        yield name
    finally:
        with contextlib.suppress(ApiError):
            dra.admin.delete(Node, name)


def kubelet_plugin_dirs(tmp: Path) -> dict[str, str]:
    """The DRA kubelet plugin's directories in place of the chart's host paths (unix socket
    paths stay short: a directory under /tmp)."""
    d = tempfile.mkdtemp(prefix="sg-dra-", dir="/tmp")
    (tmp / "kubelet-plugin-dirs").write_text(d)
    return {"dra_plugins_registry": f"{d}/registry", "dra_plugin_dir": f"{d}/plugin",
            "cdi_dir": f"{d}/cdi"}


def start_agent(d: Dra, node: str, tmp: Path, name: str) -> SharegpuProcess:
    agent = f"{RELEASE}-agent"
    kubeconfig = agent_kubeconfig(d.cp, d.ns, agent, node)  # as its pod's: names the node
    args = with_flags(
        container_args(d.cp, d.ns, "DaemonSet", agent), node_name=node,
        kubeconfig=str(kubeconfig), nvml="fake",
        fake_gpus="Tesla-T4:15,Tesla-V100-SXM2-32GB:32", isolation="none",
        device_plugin_dir=str(tmp / "device-plugins"), state_dir=str(tmp / "state"),
        metrics_listen=f"127.0.0.1:{free_port()}", hami_installed=str(tmp / "hami-installed"),
        mps_pipe_dir=str(tmp / "mps"), mps_shm_dir=str(tmp / "mps-shm"),
        log_level="DEBUG", **kubelet_plugin_dirs(tmp))
    assert "--dra=label" in args and "--dra-label=sharegpu.io/dra=true" in args
    return SharegpuProcess(d.cp, name, args).start()


def test_deviceclass_and_the_agents_rights(dra: Dra) -> None:
    dc = get(dra.cp, f"/apis/resource.k8s.io/v1/deviceclasses/{DRIVER}")
    assert dc is not None
    assert dc["spec"]["selectors"] == [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]
    client = Client(KubeConfig.from_file(dra.cp.service_account_kubeconfig(
        dra.ns, f"{RELEASE}-agent", create=False)))
    review = client.create(SelfSubjectRulesReview(
        spec=SelfSubjectRulesReviewSpec(namespace=dra.ns)))
    perms = {(g, r, v, n) for rule in review.status.resourceRules or []
             for g in rule.apiGroups or [] for r in rule.resources or [] for v in rule.verbs
             for n in rule.resourceNames or [None]}
    perms = {p for p in perms if (p[0], p[1]) not in BASELINE_RESOURCES}
    assert perms == ALLOWED["agent"] | _allowed_dra()


def test_the_agent_publishes_and_keeps_its_slice(dra: Dra, tmp_path: Path, dra_node: str) -> None:
    cp, admin = dra.cp, dra.admin
    node = dra_node
    name = f"{node}-{DRIVER}"
    dc_uid = get(cp, f"/apis/resource.k8s.io/v1/deviceclasses/{DRIVER}")["metadata"]["uid"]
    proc = start_agent(dra, node, tmp_path, "dra-agent")
    try:
        t0 = time.monotonic()
        s = wait_for("the agent's ResourceSlice", lambda: get(cp, f"{RS}/{name}"), timeout=60)
        print(f"\nslice published {time.monotonic() - t0:.1f}s after the agent started")
        spec = s["spec"]
        assert (spec["driver"], spec["nodeName"]) == (DRIVER, node)
        assert spec["pool"] == {"name": node, "generation": 1, "resourceSliceCount": 1}
        assert s["metadata"]["ownerReferences"] == [{
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "name": DRIVER,
            "uid": dc_uid}]
        t4, v100 = spec["devices"]
        # kept by the server: the gate DRAConsumableCapacity is on in 1.37 as shipped
        assert t4["allowMultipleAllocations"] is True and v100["allowMultipleAllocations"] is True
        assert t4["capacity"] == {
            "memory": {"value": "15Gi", "requestPolicy": {
                "default": "1Gi", "validRange": {"min": "1Gi", "max": "15Gi", "step": "1Gi"}}},
            "cores": {"value": "100", "requestPolicy": {
                "default": "5", "validRange": {"min": "5", "max": "100", "step": "5"}}}}
        assert v100["capacity"]["memory"]["requestPolicy"]["validRange"]["max"] == "32Gi"
        assert t4["attributes"]["model"] == {"string": "Tesla T4"}
        assert t4["attributes"]["memoryMiB"] == {"int": 15360}
        assert v100["attributes"]["index"] == {"int": 1}
        assert v100["attributes"]["uuid"]["string"].startswith("GPU-fake0001")
        assert {d["attributes"]["mode"]["string"] for d in spec["devices"]} == {"cgpu"}

        # a mode change: whole GPUs on an exclusive node
        admin.patch(Node, node, {"metadata": {"labels": {"ack.node.gpu.schedule": "default"}}},
                    patch_type=PatchType.MERGE)
        s = wait_for("the slice to follow the mode", lambda: (
            got := get(cp, f"{RS}/{name}")) and got["spec"]["pool"]["generation"] == 2 and got,
            timeout=30)
        assert all("allowMultipleAllocations" not in d for d in s["spec"]["devices"])
        assert all("requestPolicy" not in c for d in s["spec"]["devices"]
                   for c in d["capacity"].values())
        admin.patch(Node, node, {"metadata": {"labels": {"ack.node.gpu.schedule": "cgpu"}}},
                    patch_type=PatchType.MERGE)
        s = wait_for("shared again", lambda: (got := get(cp, f"{RS}/{name}")) and got[
            "spec"]["pool"]["generation"] == 3 and got, timeout=30)
        assert s["spec"]["devices"][0]["allowMultipleAllocations"] is True

        # deleted (as the kubelet does at its start): published again, through the watch
        status_code, _ = cp.request("DELETE", f"{RS}/{name}")
        assert status_code == 200
        t0 = time.monotonic()
        s = wait_for("the slice back", lambda: get(cp, f"{RS}/{name}"), timeout=30)
        print(f"slice re-created {time.monotonic() - t0:.1f}s after it was deleted")
        assert s["spec"]["pool"]["generation"] == 4
        assert len(node_slices(cp, node)) == 1

        # a malformed slice is refused naming the field and the rule; ours is untouched
        bad = build_slice(node, [SliceGpu(0, "GPU-x", "Tesla T4", 15360, 15)], Mode.CGPU)
        bad["metadata"]["name"] = f"{node}-malformed"
        bad["spec"]["pool"]["name"] = f"{node}-malformed"
        bad["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["validRange"][
            "max"] = "16Gi"
        code, body = cp.request("POST", RS, bad)
        assert code == 422, body
        message = json.loads(body)["message"]
        field = "spec.devices[0].capacity[memory].requestPolicy.validRange.max"
        assert field in message and "max is larger than capacity value" in message, message
        with pytest.raises(ValidationError) as e:  # sharegpu's own check: same field, same rule
            validate_slice(bad)
        assert e.value.field == field and "max is larger than capacity" in e.value.rule
        assert get(cp, f"{RS}/{name}")["metadata"]["resourceVersion"] == \
            s["metadata"]["resourceVersion"]

        # a restarted agent finds its slice and writes nothing
        rv = s["metadata"]["resourceVersion"]
        proc.stop()
        assert get(cp, f"{RS}/{name}") is not None  # stopping keeps it
        proc = start_agent(dra, node, tmp_path, "dra-agent-2")
        wait_for("the restarted agent to find its slice", lambda: (
            f"ResourceSlice {name} is current (pool generation 4): nothing written"
            in proc.log.read_text()), timeout=30)
        time.sleep(1)
        assert get(cp, f"{RS}/{name}")["metadata"]["resourceVersion"] == rv
        assert len(node_slices(cp, node)) == 1

        # the node leaves the DRA pool: its slice goes
        admin.patch(Node, node, {"metadata": {"labels": {"sharegpu.io/dra": None}}},
                    patch_type=PatchType.MERGE)
        wait_for("the slice withdrawn", lambda: get(cp, f"{RS}/{name}") is None, timeout=30)
        assert proc.alive()
        assert log_problems(proc) == [], proc.log_tail()
        assert "other content than sent" not in proc.log.read_text()
    finally:
        proc.stop()


def test_a_claim_is_allocated_from_the_slices_capacity(dra: Dra, tmp_path: Path, dra_node: str) -> None:
    """The real kube-scheduler allocates two claims on one GPU from the published capacities."""
    cp, admin, ns = dra.cp, dra.admin, dra.ns
    node = dra_node
    proc = start_agent(dra, node, tmp_path, "dra-agent-claims")
    try:
        wait_for("the slice", lambda: get(cp, f"{RS}/{node}-{DRIVER}"), timeout=60)
        claims = []
        for i, (mem, cores) in enumerate((("10Gi", "50"), ("5Gi", "45"))):
            claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": f"share-{i}", "namespace": ns},
                     "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                         "deviceClassName": DRIVER,
                         "selectors": [{"cel": {"expression":
                                        f'device.attributes["{DRIVER}"].index == 0'}}],
                         "capacity": {"requests": {"memory": mem, "cores": cores}}}}]}}}
            code, body = cp.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/"
                                    "resourceclaims", claim)
            assert code == 201, body
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"share-{i}", "namespace": ns},
                   "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                            "resourceClaims": [{"name": "gpu",
                                                "resourceClaimName": f"share-{i}"}],
                            "containers": [{"name": "c", "image": "registry.invalid/x",
                                            "resources": {"claims": [{"name": "gpu"}]}}]}}
            code, body = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
            assert code == 201, body
            claims.append(f"share-{i}")

        def allocated(c: str) -> dict[str, Any] | None:
            got = get(cp, f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{c}")
            return (got or {}).get("status", {}).get("allocation")

        results = [wait_for(f"claim {c} allocated", lambda c=c: allocated(c), timeout=60)
                   for c in claims]
        devs = [r["devices"]["results"][0] for r in results]
        print(f"\nallocated: {[(d['device'], d.get('consumedCapacity')) for d in devs]}")
        assert {d["device"] for d in devs} == {"gpu-0"} and {d["pool"] for d in devs} == {node}
        assert devs[0]["consumedCapacity"] == {"memory": "10Gi", "cores": "50"}
        assert devs[1]["consumedCapacity"] == {"memory": "5Gi", "cores": "45"}
        assert devs[0]["shareID"] != devs[1]["shareID"]
        for c in claims:
            pod = admin.get(Pod, c, namespace=ns)
            assert pod.spec.nodeName == node
        # the GPU is full (15 GiB): a third claim on it stays unallocated
        third = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": "share-2", "namespace": ns},
                 "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                     "deviceClassName": DRIVER,
                     "selectors": [{"cel": {"expression":
                                    f'device.attributes["{DRIVER}"].index == 0'}}],
                     "capacity": {"requests": {"memory": "1Gi"}}}}]}}}
        assert cp.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
                          third)[0] == 201
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "share-2", "namespace": ns},
               "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                        "resourceClaims": [{"name": "gpu", "resourceClaimName": "share-2"}],
                        "containers": [{"name": "c", "image": "registry.invalid/x",
                                        "resources": {"claims": [{"name": "gpu"}]}}]}}
        assert cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)[0] == 201
        time.sleep(5)
        assert allocated("share-2") is None
        assert admin.get(Pod, "share-2", namespace=ns).spec.nodeName is None
    finally:
        proc.stop()


def test_uninstall_removes_every_slice(dra: Dra, tmp_path: Path, dra_node: str) -> None:
    cp = dra.cp
    node = dra_node
    proc = start_agent(dra, node, tmp_path, "dra-agent-uninstall")
    try:
        wait_for("the slice", lambda: get(cp, f"{RS}/{node}-{DRIVER}"), timeout=60)
    finally:
        proc.stop()  # as the DaemonSet's pods go with the release
    # the claims test's node was deleted, its slice stays until the DeviceClass goes
    mine = [s["metadata"]["name"] for s in get(cp, f"{RS}?fieldSelector=spec.driver={DRIVER}")[
        "items"]]
    assert f"{node}-{DRIVER}" in mine
    t0 = time.monotonic()
    helm(cp, "uninstall", RELEASE, "-n", dra.ns, "--wait", "--timeout", "60s")
    dra.installed = False
    wait_for("the garbage collector to delete the slices", lambda: get(
        cp, f"{RS}?fieldSelector=spec.driver={DRIVER}")["items"] == [], timeout=60)
    print(f"\n{len(mine)} slice(s) gone {time.monotonic() - t0:.1f}s after helm uninstall")
    assert get(cp, f"/apis/resource.k8s.io/v1/deviceclasses/{DRIVER}") is None
