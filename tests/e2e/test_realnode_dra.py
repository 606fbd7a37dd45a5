"""DRA mode on the REAL node (realnode.py): GPU pods whose ResourceClaims kube-scheduler allocated
are prepared by the real kubelet through the agent's DRA kubelet plugin, and containerd v2.4.2
applies the claims' CDI specs to their containers.

The chart is installed with helm (``real_release``), then upgraded with ``agent.dra.enabled=true``
(:data:`DRA_VALUES`: the feature under test, not something the cluster forces) and the node
labelled into the DRA pool (``sharegpu.io/dra=true``, mode ``cgpu``). The agent pod then
publishes the node's ResourceSlice and serves its kubelet plugin (registration socket in the
kubelet's ``plugins_registry``, CDI specs in ``/var/run/cdi``, which is containerd's
``cdi_spec_dirs`` entry ``/run/cdi``). Pods placed by the chart's kube-scheduler (its
DynamicResources plugin allocates the claims; the extender ranks them):

- users' own ResourceClaimTemplates of the DeviceClass: memory-only shares, a share with
  compute (``cores``), a 2-GPU claim (``count: 2``, ``distinctAttribute``), a pod with two
  containers each with its own claim, and one ResourceClaim shared by the two containers of a
  pod;
- ACK-spec pods (``aliyun.com/gpu-mem``, ``gpu-core.percentage``, ``aliyun.com/gpu-count: 2``)
  with the pool label in their nodeSelector, turned into claims by the chart's mutating webhook.

Each container reports what it received (nodepods.REPORTER) and nodeclaims.compare_claims holds
it against its claims' allocation and CDI specs: 0 mismatches. Then the pods are deleted: every
claim is unprepared (no CDI spec, agent record, cache directory or kubelet checkpoint entry
left). After a kubelet restart, running claim pods keep running and a new batch is prepared.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from sharegpu.agent.cdi import SPEC_PREFIX
from sharegpu.agent.dracheckpoint import CHECKPOINT_FILE
from sharegpu.core import names
from sharegpu.dra import driver as dra

from .nodeclaims import (
    CDI_DIR,
    ClaimCheck,
    compare_claims,
    over_commit,
    read_spec,
    results,
    spec_path,
    totals,
)
from .nodepods import (
    NAMESPACE,
    REPORTER,
    WORKLOADS,
    container_log,
    create,
    events_text,
    get_pod,
    gpu_pod,
    list_pods,
    node_uuids,
    pod_summary,
    ready,
    report,
    wait,
)
from .realnode import RealNode, RealNodeCluster

# the chart's values for this file beyond its defaults: DRA mode, the feature under test
DRA_VALUES = {"agent.dra.enabled": "true"}
POOL = {"sharegpu.io/dra": "true"}
RA = "/apis/resource.k8s.io/v1"
BATCH = "sharegpu-e2e-dra"
MULTI_GPU = "sharegpu-e2e-multi-gpu"  # a pod whose claim spans GPUs: bound before the next
MEM, CORE = names.RES_GPU_MEM, names.RES_GPU_CORE
SLEEP = 3600

# users' own templates (name: memory GiB, cores or None, GPUs) and one claim shared by two
# containers
TEMPLATES = {"dra-1gi": (1, None, 1), "dra-2gi": (2, None, 1), "dra-4gi-30pct": (4, 30, 1),
             "dra-2gi-x2": (2, None, 2)}
SHARED_CLAIM = ("dra-shared-3gi", 3)


def _request(mem: int, cores: int | None, count: int) -> dict[str, Any]:
    cap = {dra.CAPACITY_MEMORY: f"{mem}Gi", **({dra.CAPACITY_CORES: str(cores)} if cores else {})}
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": dra.DRIVER, "allocationMode": "ExactCount", "count": count,
        "selectors": [{"cel": {"expression": "device.allowMultipleAllocations == true"}}],
        "capacity": {"requests": cap}}}]}
    if count > 1:
        devices["constraints"] = [{"requests": ["gpu"],
                                   "distinctAttribute": f"{dra.DRIVER}/uuid"}]
    return devices


def claim_pod(name: str, node: str, image: str, containers: Sequence[Sequence[str]],
              claims: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """A pod with its own claims: ``claims`` maps the pod's claim name to (``template`` or
    ``claim``, object name); ``containers[i]`` lists the claim names container i uses."""
    multi = any(kind == "template" and TEMPLATES.get(obj, (0, None, 1))[2] > 1
                for kind, obj in claims.values())
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "sharegpu-e2e-gpu", BATCH: "1",
                                              **({MULTI_GPU: "1"} if multi else {})}},
        "spec": {
            "schedulerName": names.CO_SCHEDULER_NAME,
            "nodeSelector": {"kubernetes.io/hostname": node, **POOL},
            "terminationGracePeriodSeconds": 0, "restartPolicy": "Never",
            "resourceClaims": [
                {"name": k, ("resourceClaimTemplateName" if kind == "template"
                             else "resourceClaimName"): obj}
                for k, (kind, obj) in claims.items()],
            "containers": [
                {"name": f"c{i}", "image": image, "imagePullPolicy": "Never",
                 "command": ["python3", "-c", REPORTER, str(SLEEP), f"c{i}"],
                 "resources": {"claims": [{"name": n} for n in uses]}}
                for i, uses in enumerate(containers)],
        },
    }


def ack_pod(name: str, node: str, image: str, limits: Mapping[str, int],
            labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An ACK-spec pod bound for the DRA pool (the webhook turns its GPU resources into a
    claim)."""
    pod = gpu_pod(name, [limits], node=node, image=image, sleep=SLEEP,
                  labels={BATCH: "1", **(labels or {})})
    pod["spec"]["nodeSelector"].update(POOL)
    pod["spec"]["containers"][0]["command"].append("c0")
    return pod


def get(cluster: RealNodeCluster, path: str) -> dict[str, Any] | None:
    status, body = cluster.cp.request("GET", path)
    if status == 404:
        return None
    assert status == 200, f"GET {path}: HTTP {status}: {body[:500]}"
    return json.loads(body)


def patch_node_labels(cluster: RealNodeCluster, node: RealNode,
                      labels: Mapping[str, str | None]) -> None:
    import urllib.request

    cp = cluster.cp
    req = urllib.request.Request(f"{cp.server}/api/v1/nodes/{node.name}",
                                 data=json.dumps({"metadata": {"labels": labels}}).encode(),
                                 method="PATCH")
    req.add_header("Content-Type", "application/merge-patch+json")
    with urllib.request.urlopen(req, context=cp._admin_ssl, timeout=10) as r:
        assert r.status == 200


def _args(pod: Mapping[str, Any]) -> list[str]:
    return [a for c in pod["spec"]["containers"] for a in c.get("args") or []]


def release_settled(cluster: RealNodeCluster, dra_on: bool) -> bool:
    """Every pod of the release Ready, none left over, each with (or without) its DRA flags."""
    pods = list_pods(cluster.cp, NAMESPACE)
    if len(pods) != 7 or not all(ready(p) for p in pods):
        return False
    flags = {"agent": lambda a: a == "--dra=label", "extender": lambda a: a == "--dra",
             "webhook": lambda a: a.startswith("--dra-label=")}
    for p in pods:
        has = flags.get(p["metadata"]["labels"].get("app.kubernetes.io/component", ""))
        if has is not None and any(has(a) for a in _args(p)) != dra_on:
            return False
    return True


def slice_of(cluster: RealNodeCluster, node: RealNode) -> dict[str, Any] | None:
    return get(cluster, f"{RA}/resourceslices/{node.name}-{dra.DRIVER}")


def agent_pod(cluster: RealNodeCluster) -> dict[str, Any]:
    (agent,) = [p for p in list_pods(cluster.cp, NAMESPACE, "app.kubernetes.io/component%3Dagent")
                if ready(p)]
    return agent


def plugin_registrations(cluster: RealNodeCluster, node: RealNode) -> int:
    """How often the kubelet told the agent's DRA plugin it is registered (the agent's log)."""
    return container_log(node, agent_pod(cluster), "agent").count(
        f"DRA plugin {dra.DRIVER} registered with the kubelet")


def kubelet_checkpoint(node: RealNode) -> str:
    """The kubelet's DRA manager checkpoint (its prepared claims and their CDI device IDs)."""
    path = node.host_path("/var/lib/kubelet/dra_manager_state")
    assert path.is_file(), f"no kubelet DRA checkpoint at {path}: " + \
        str(sorted(p.name for p in node.host_path("/var/lib/kubelet").iterdir()))
    return path.read_text()


class Tally:
    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = {}

    def add(self, batch: str, pods: int, started: int, checks: Sequence[ClaimCheck]) -> None:
        t = totals(checks)
        self.rows[batch] = {"pods": pods, "containers": started, "claims": t["claims"],
                            "mismatches": t["mismatches"]}

    def table(self) -> str:
        lines = ["| DRA batch | pods placed | containers started | claims | mismatches |",
                 "| --- | --- | --- | --- | --- |"]
        for b, r in self.rows.items():
            lines.append(f"| {b} | {r['pods']} | {r['containers']} | {r['claims']} | "
                         f"{r['mismatches']} |")
        tot = {k: sum(r[k] for r in self.rows.values()) for k in
               ("pods", "containers", "claims", "mismatches")}
        lines.append(f"| all | {tot['pods']} | {tot['containers']} | {tot['claims']} | "
                     f"{tot['mismatches']} |")
        return "\n".join(lines)


TALLY = Tally()


class DraNode:
    """The node in the DRA pool with the chart's DRA mode on, and what the tests share."""

    def __init__(self, cluster: RealNodeCluster, node: RealNode) -> None:
        self.cluster, self.node, self.cp = cluster, node, cluster.cp
        self.image = cluster.refs["SHAREGPU_REF"]
        self.slice: dict[str, Any] = {}
        self.uuids: dict[str, str] = {}
        self.times: dict[str, float] = {}
        self.batches: dict[str, dict[str, Any]] = {}  # batch -> pods, claims, uids, cdi ids


@pytest.fixture(scope="module")
def dra_node(real_release: RealNodeCluster) -> Iterator[DraNode]:
    from .components import CHART, helm

    cluster, node = real_release, real_release.nodes[0]
    cp = cluster.cp
    d = DraNode(cluster, node)
    t0 = time.monotonic()
    patch_node_labels(cluster, node, {names.LABEL_SCHEDULE: "cgpu", **POOL})
    try:
        helm(cp, "upgrade", "sharegpu", str(CHART), "-n", NAMESPACE,
             *[a for k, v in DRA_VALUES.items() for a in ("--set", f"{k}={v}")], timeout=300)
        try:
            wait("the release Ready with DRA on", lambda: release_settled(cluster, True), 240,
                 every=1)
        except BaseException:
            print(pod_summary(list_pods(cp, NAMESPACE)), file=sys.stderr)
            print(events_text(cp, NAMESPACE), file=sys.stderr)
            raise
        d.times["helm upgrade -> release Ready with DRA"] = time.monotonic() - t0
        d.slice = wait("the node's ResourceSlice with its 2 GPUs", lambda: (
            s := slice_of(cluster, node)) and len(s["spec"].get("devices") or []) == 2 and s,
            120)
        d.times["helm upgrade -> ResourceSlice"] = time.monotonic() - t0
        d.uuids = {dv["name"]: dv["attributes"]["uuid"]["string"]
                   for dv in d.slice["spec"]["devices"]}
        wait("the kubelet to register the agent's DRA plugin",
             lambda: plugin_registrations(cluster, node) > 0, 120)
        d.times["helm upgrade -> DRA plugin registered with the kubelet"] = time.monotonic() - t0
        # the webhook pods serve DRA mode: an ACK pod bound for the pool gets claims
        probe = ack_pod("probe", node.name, d.image, {MEM: 1})
        wait("the webhook to turn ACK pods bound for the pool into claims", lambda: (
            r := cp.request("POST", f"/api/v1/namespaces/{WORKLOADS}/pods?dryRun=All",
                            probe))[0] == 201 and json.loads(r[1])["spec"].get("resourceClaims"),
             60)
        yield d
    finally:
        print("\n" + "\n".join(f"{k}: {v:.1f}s" for k, v in d.times.items()), file=sys.stderr)
        # deleted gracefully: the kubelet stops them and unprepares their claims while the
        # plugin is still registered
        cp.request("DELETE", f"/api/v1/namespaces/{WORKLOADS}/pods?labelSelector={BATCH}%3D1"
                             "&gracePeriodSeconds=1")
        wait("the DRA pods gone", lambda: not list_pods(cp, WORKLOADS, f"{BATCH}%3D1"), 120)
        wait("every claim unprepared", lambda: not list(
            node.host_path(CDI_DIR).glob(f"{SPEC_PREFIX}*.json")), 60)
        for kind in ("resourceclaims", "resourceclaimtemplates"):
            cp.request("DELETE", f"{RA}/namespaces/{WORKLOADS}/{kind}")
        patch_node_labels(cluster, node, {"sharegpu.io/dra": None})
        # without values helm upgrade would reuse the last ones (DRA on): back to the defaults
        helm(cp, "upgrade", "sharegpu", str(CHART), "-n", NAMESPACE, "--reset-values",
             timeout=300)
        try:
            wait("the release Ready again without DRA", lambda: release_settled(cluster, False),
                 240, every=1)
        except BaseException:
            print(pod_summary(list_pods(cp, NAMESPACE)), file=sys.stderr)
            print(events_text(cp, NAMESPACE), file=sys.stderr)
            raise


def create_objects(d: DraNode) -> None:
    cp = d.cp
    for name, (mem, cores, count) in TEMPLATES.items():
        obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
               "metadata": {"name": name}, "spec": {"spec": {"devices": _request(mem, cores,
                                                                                 count)}}}
        status, body = cp.request("POST", f"{RA}/namespaces/{WORKLOADS}/resourceclaimtemplates",
                                  obj)
        assert status in (201, 409), body
    name, mem = SHARED_CLAIM
    obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": name}, "spec": {"devices": _request(mem, None, 1)}}
    status, body = cp.request("POST", f"{RA}/namespaces/{WORKLOADS}/resourceclaims", obj)
    assert status in (201, 409), body


def first_batch(d: DraNode) -> list[dict[str, Any]]:
    """The pods of the first batch, the 2-GPU ones first (placed while both GPUs have room)."""
    n, img = d.node.name, d.image

    def tpl(t: str) -> dict[str, tuple[str, str]]:
        return {"gpu": ("template", t)}

    return [
        claim_pod("dra-x2", n, img, [["gpu"]], tpl("dra-2gi-x2")),
        ack_pod("dra-ack-x2", n, img, {MEM: 4}, {names.POD_LABEL_GPU_COUNT: "2"}),
        claim_pod("dra-2gi-a", n, img, [["gpu"]], tpl("dra-2gi")),
        claim_pod("dra-2gi-b", n, img, [["gpu"]], tpl("dra-2gi")),
        claim_pod("dra-compute", n, img, [["gpu"]], tpl("dra-4gi-30pct")),
        claim_pod("dra-shared", n, img, [["gpu"], ["gpu"]],
                  {"gpu": ("claim", SHARED_CLAIM[0])}),
        claim_pod("dra-two-claims", n, img, [["a"], ["b"]],
                  {"a": ("template", "dra-1gi"), "b": ("template", "dra-2gi")}),
        ack_pod("dra-ack-2gi", n, img, {MEM: 2}),
        ack_pod("dra-ack-compute", n, img, {MEM: 1, CORE: 20}),
    ]


def run_batch(d: DraNode, batch: str, pods: Sequence[dict[str, Any]],
              timeout: float = 240) -> list[ClaimCheck]:
    """Create the pods (the multi-GPU ones bound before the next is made), wait until every
    container runs, read the claims, their CDI specs and every container's report, compare."""
    cp, node = d.cp, d.node
    made = []
    t0 = time.monotonic()
    for obj in pods:
        status, body = create(cp, WORKLOADS, obj)
        assert status == 201, body
        name = obj["metadata"]["name"]
        made.append(name)
        labels = obj["metadata"]["labels"]
        if names.POD_LABEL_GPU_COUNT in labels or MULTI_GPU in labels:
            wait(f"{name} bound", lambda n=name: (p := get_pod(cp, WORKLOADS, n)) and
                 p["spec"].get("nodeName"), 90, every=0.3)

    def all_running() -> list[dict[str, Any]] | None:
        got = [get_pod(cp, WORKLOADS, n) for n in made]
        return got if all(p and ready(p) for p in got) else None  # type: ignore[return-value]

    try:
        running = wait(f"the DRA batch {batch} to run", all_running, timeout, every=1)
    except BaseException:
        print(pod_summary([p for n in made if (p := get_pod(cp, WORKLOADS, n))]), file=sys.stderr)
        print(events_text(cp, WORKLOADS), file=sys.stderr)
        raise
    d.times[f"{batch}: created -> every container running"] = time.monotonic() - t0
    claims = {c["metadata"]["name"]: c for c in get(
        d.cluster, f"{RA}/namespaces/{WORKLOADS}/resourceclaims")["items"]}
    mine = [c for c in claims.values() if any(
        r.get("uid") in {p["metadata"]["uid"] for p in running}
        for r in (c.get("status") or {}).get("reservedFor") or [])]
    specs = {c["metadata"]["uid"]: read_spec(node, c["metadata"]["uid"]) for c in mine}
    checkpoint = kubelet_checkpoint(node)
    checks: list[ClaimCheck] = []
    started = 0
    for p in running:
        for i, c in enumerate(p["spec"]["containers"]):
            got = report(node, p, c["name"])
            started += got is not None
            check = compare_claims(node, p, i, got, claims, specs, d.uuids)
            # the kubelet prepared the claim: its checkpoint holds the CDI devices it passed
            check.mismatches += [f"kubelet checkpoint lacks {cid}" for cid in check.cdi_ids
                                 if cid not in checkpoint]
            checks.append(check)
    TALLY.add(batch, len(running), started, checks)
    d.batches[batch] = {"pods": made, "claims": [c["metadata"]["name"] for c in mine],
                        "uids": [c["metadata"]["uid"] for c in mine],
                        "cdi_ids": sorted({i for c in checks for i in c.cdi_ids})}
    per_gpu: dict[str, list[str]] = {}
    for c in mine:
        for r in results(c):
            per_gpu.setdefault(r["device"], []).append(
                f"{c['metadata']['name']}:{r['consumedCapacity'].get('memory')}"
                f"/{r['consumedCapacity'].get('cores', '-')}")
    print(f"\nDRA batch {batch}: {len(running)} pods, {started} containers, {len(mine)} claims, "
          f"{len(specs)} CDI specs; per GPU {json.dumps(per_gpu, sort_keys=True)}",
          file=sys.stderr)
    bad = [c for c in checks if c.mismatches]
    for c in checks:
        print(f"  {c.pod}/{c.container}: claims {c.claims} -> {c.cdi_ids}: "
              f"{len(c.mismatches)} mismatches", file=sys.stderr)
    assert not bad, "\n".join(f"{c.pod}/{c.container}: {c.mismatches}" for c in bad)
    assert started == sum(len(p["spec"]["containers"]) for p in running)
    problems = over_commit(claims.values(), d.slice)
    assert not problems, problems
    return checks


def test_dra_pods_start_with_their_claims_through_containerds_cdi(dra_node: DraNode) -> None:
    d = dra_node
    # the slice publishes the node's own GPUs (the UUIDs its driver reports)
    assert [d.uuids[f"gpu-{i}"] for i in range(2)] == node_uuids(d.node)
    create_objects(d)
    checks = run_batch(d, "first", first_batch(d))
    ack = [c for c in checks if c.pod.startswith("dra-ack-")]
    assert ack and all(c.claims and c.claims[0] for c in ack), "the webhook made no claims"
    (x2,) = [c for c in checks if c.pod == "dra-x2"]
    assert len(x2.cdi_ids) == 2, x2
    shared = [c for c in checks if c.pod == "dra-shared"]
    assert len(shared) == 2 and shared[0].claims == shared[1].claims == [SHARED_CLAIM[0]]
    print("\n" + TALLY.table(), file=sys.stderr)


def _left_on_node(d: DraNode, uids: Sequence[str], cdi_ids: Sequence[str]) -> list[str]:
    node = d.node
    left = [f"CDI spec {spec_path(node, u).name}" for u in uids if spec_path(node, u).exists()]
    agent_state = node.host_path(f"/var/lib/sharegpu/{CHECKPOINT_FILE}")  # the chart's stateDir
    recorded = json.loads(agent_state.read_text()).get("claims", {}) if agent_state.exists() \
        else {}
    left += [f"agent record {u}" for u in uids if u in recorded]
    left += [f"cache dir {u}" for u in uids if node.host_path(f"/tmp/sharegpu-vgpu/{u}").exists()]
    checkpoint = kubelet_checkpoint(node)
    left += [f"kubelet checkpoint {i}" for i in cdi_ids if i in checkpoint]
    return left


def test_deleted_pods_have_their_claims_unprepared(dra_node: DraNode) -> None:
    d, cp = dra_node, dra_node.cp
    batch = d.batches.get("first")
    assert batch, "the first batch did not run"
    uids, cdi_ids = batch["uids"], batch["cdi_ids"]
    assert all(spec_path(d.node, u).exists() for u in uids), "a claim's spec is missing already"
    t0 = time.monotonic()
    for name in batch["pods"]:
        cp.request("DELETE", f"/api/v1/namespaces/{WORKLOADS}/pods/{name}?gracePeriodSeconds=1")
    wait("the DRA pods gone", lambda: not any(get_pod(cp, WORKLOADS, n) for n in batch["pods"]),
         120)
    wait("every claim unprepared on the node", lambda: not _left_on_node(d, uids, cdi_ids), 60)
    took = time.monotonic() - t0
    d.times["pods deleted -> every claim unprepared"] = took

    def claims_released() -> bool:
        items = get(d.cluster, f"{RA}/namespaces/{WORKLOADS}/resourceclaims")["items"]
        left = {c["metadata"]["name"]: c for c in items}
        # the templates' claims are deleted with their pods; the user's claim stays, reserved
        # for nobody
        return set(left) <= {SHARED_CLAIM[0]} and not (
            left.get(SHARED_CLAIM[0], {}).get("status") or {}).get("reservedFor")

    wait("the generated claims deleted and the shared claim released", claims_released, 120)
    print(f"\n{len(batch['pods'])} pods deleted: {len(uids)} claims unprepared in {took:.1f}s "
          "(no CDI spec, agent record, cache directory or kubelet checkpoint entry left)",
          file=sys.stderr)


def test_claim_pods_survive_a_kubelet_restart_and_new_ones_are_prepared(
        dra_node: DraNode) -> None:
    d, cp, node = dra_node, dra_node.cp, dra_node.node
    n, img = node.name, d.image
    before = run_batch(d, "before-restart", [
        claim_pod("dra-r-a", n, img, [["gpu"]], {"gpu": ("template", "dra-2gi")}),
        ack_pod("dra-r-ack", n, img, {MEM: 3, CORE: 25}),
    ])
    pods = {c.pod for c in before}
    uids = {p: get_pod(cp, WORKLOADS, p)["metadata"]["uid"] for p in pods}
    registered = plugin_registrations(d.cluster, node)
    t0 = time.monotonic()
    node.restart_kubelet()
    wait("the DRA plugin registered with the new kubelet",
         lambda: plugin_registrations(d.cluster, node) > registered, 120)
    d.times["kubelet restart -> DRA plugin registered again"] = time.monotonic() - t0
    for p, uid in uids.items():
        pod = get_pod(cp, WORKLOADS, p)
        assert pod and pod["metadata"]["uid"] == uid and ready(pod), pod_summary([pod] if pod
                                                                                 else [])
        assert all(s.get("restartCount", 0) == 0 for s in pod["status"]["containerStatuses"])
    t1 = time.monotonic()
    run_batch(d, "after-restart", [
        claim_pod("dra-r-x2", n, img, [["gpu"]], {"gpu": ("template", "dra-2gi-x2")}),
        claim_pod("dra-r-b", n, img, [["gpu"], ["gpu"]], {"gpu": ("template", "dra-4gi-30pct")}),
        ack_pod("dra-r-ack2", n, img, {MEM: 2}),
    ])
    d.times["kubelet restart -> new claim pods running"] = time.monotonic() - t1
    print("\n" + TALLY.table(), file=sys.stderr)
    assert all(r["mismatches"] == 0 for r in TALLY.rows.values()), TALLY.table()
