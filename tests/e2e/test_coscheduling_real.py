"""Issue 15's co-scheduler features (ResourcePolicy, gang scheduling) on the REAL control plane.

The real kube-scheduler v1.37.2 runs with the KubeSchedulerConfiguration the chart renders (only
urlPrefix's host and port changed: https, the chart's CA and the Service's name stay) and the
chart's scheduler ServiceAccount; it calls ``sharegpu extender`` (the chart's arguments, TLS
certificate, ServiceAccount and RBAC, leader election on the chart's Lease). The chart's two
CRDs (ResourcePolicy, PodGroup) are created as rendered when the API server does not have them
yet, and removed again. Nodes have no kubelet behind them: :class:`StandInKubelets` marks bound
pods assigned as each node's kubelet and agent would. A missing permission fails the test: the
extender is not ready without ``list``/``watch`` on resourcepolicies, its log is checked for
``Forbidden``, and every label, annotation and binding is read back from the API server.

1. ``test_resourcepolicy_deployment_fills_units_and_scales_in_from_the_last``: a ResourcePolicy
   (units of max 10 / 10 / unlimited over three pools of GPU nodes) and a real ``apps/v1``
   Deployment of 30 GPU pods: the real kube-scheduler and the extender place 10 / 10 / 10 in
   unit order, every pod carrying its unit's labels and annotations, the unit annotation and
   ``controller.kubernetes.io/pod-deletion-cost``; the Deployment scaled to 12, the real
   ReplicaSet controller (kube-controller-manager) deletes the last unit's pods first: 10 / 2 / 0.
2. ``test_two_gangs_one_binds_then_the_other``: two gangs of 8 GPU pods created together on
   capacity that fits one (12 GPUs of 16 GiB, each pod 16 GiB): one gang ends fully bound, the
   other has no pod bound, holds nothing (the extender's per-node allocated GPU memory on
   /metrics equals what the bound pods' annotations say) and its pods carry kube-scheduler's
   FailedScheduling Event with the extender's gang reason; the first gang's pods deleted, the
   second binds completely. No over-commit, and the state rebuilt from the pods' annotations
   fits every GPU.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from lightkube import ApiError, Client
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Event, Pod
from lightkube.types import PatchType

from sharegpu.core import names
from sharegpu.core.annotations import decode
from sharegpu.core.gang import LABEL_GROUP, LABEL_MIN_AVAILABLE
from sharegpu.core.resourcepolicy import ANN_DELETION_COST, ANN_UNIT
from sharegpu.extender.view import ClusterView

from .components import ROOT, create_node_object
from .controlplane import ControlPlane
from .realcluster import (
    RUN_LABEL,
    ChartRbac,
    LocalExtender,
    Report,
    StandInKubelets,
    cleanup,
    gpu_node,
    gpu_node_object,
    gpu_pod,
    make_namespace,
    metric,
    node_dicts,
    pod_dicts,
    render_chart,
    sa_client,
    scheduler_config_for,
    start_extender,
    wait_allowed,
    wait_for,
)

if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))
from scheduler_driver import over_commits

RELEASE = "sg-cosched"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
RP_PATH = "/apis/scheduling.alibabacloud.com/v1alpha1/namespaces/{ns}/resourcepolicies"


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Iterator[Report]:
    r = Report()
    yield r
    r.flush(capsys)


def _crds(cp: ControlPlane, docs: list[dict[str, Any]]) -> list[str]:
    """Create the chart's CRDs the API server does not serve yet (as rendered); wait until they
    are Established. Returns the names created here (the caller deletes them)."""
    created = []
    for d in docs:
        if d["kind"] != "CustomResourceDefinition":
            continue
        name = d["metadata"]["name"]
        status, _ = cp.request("GET", f"{CRD_PATH}/{name}")
        if status == 404:
            status, body = cp.request("POST", CRD_PATH, d)
            assert status == 201, body
            created.append(name)

        def established(name: str = name) -> bool:
            st, body = cp.request("GET", f"{CRD_PATH}/{name}")
            conds = {c["type"]: c["status"]
                     for c in (json.loads(body).get("status") or {}).get("conditions") or []}
            return st == 200 and conds.get("Established") == "True"

        wait_for(f"CRD {name} established", established, timeout=30)
    return created


@pytest.fixture(scope="module")
def cluster(controlplane: ControlPlane, admin: Client) -> Iterator[dict[str, Any]]:
    """A namespace, the chart's RBAC and CRDs, ``sharegpu extender`` (leader) and the real
    kube-scheduler with the chart's configuration calling it; stand-in kubelets."""
    ns = make_namespace(admin, "sg-cosched")
    docs = render_chart(RELEASE, ns)
    rbac = ChartRbac(admin, docs, RELEASE)
    crds: list[str] = []
    local: LocalExtender | None = None
    kubelets: StandInKubelets | None = None
    try:
        crds = _crds(controlplane, docs)
        sa = rbac.apply("extender")
        rbac.apply("scheduler")
        kubeconfig, ext = sa_client(controlplane, ns, sa)
        wait_allowed("the extender to list pods", lambda: list(ext.list(Pod, namespace="*")))
        # not ready until it has listed the ResourcePolicies (a 403 there keeps it not ready)
        local = start_extender(controlplane, docs, "sharegpu-extender-0", kubeconfig)
        lu = local.metrics_url
        wait_for("the extender to lead", lambda: metric(lu, "sharegpu_extender_leader") == 1,
                 timeout=30)
        cfg = scheduler_config_for(controlplane, docs, RELEASE, ns, local.url)
        ext_cfg = cfg["extenders"][0]
        assert ext_cfg["enableHTTPS"] is True and ext_cfg["bindVerb"] == "bind"
        # every pod of the profile goes to the extender, GPU or not
        assert not ext_cfg.get("managedResources"), ext_cfg
        controlplane.restart_scheduler(config=cfg, extra_args=["--leader-elect=true", "--v=2"])
        kubelets = StandInKubelets(controlplane.admin_kubeconfig, ns).start()
        yield {"namespace": ns, "extender": local, "kubelets": kubelets}
    finally:
        if kubelets is not None:
            kubelets.stop()
        controlplane.restart_scheduler()
        if local is not None:
            local.proc.stop()
        cleanup(admin, ns)
        rbac.delete()
        for name in crds:  # helm installs of other tests must not find them
            controlplane.request("DELETE", f"{CRD_PATH}/{name}")
        for name in crds:
            wait_for(f"CRD {name} removed",
                     lambda name=name: controlplane.request("GET", f"{CRD_PATH}/{name}")[0]
                     == 404, timeout=60)


def _extender_log_clean(local: LocalExtender) -> None:
    assert local.proc.alive(), local.proc.log_tail()
    bad = [ln for ln in local.proc.log.read_text(errors="replace").splitlines()
           if " ERROR " in ln or "Traceback" in ln or "Forbidden" in ln or " 403" in ln]
    assert bad == [], bad


def _failed_scheduling(admin: Client, ns: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for e in admin.list(Event, namespace=ns):
        if e.reason == "FailedScheduling" and e.involvedObject is not None:
            out[e.involvedObject.name or ""].append(e.message or "")
    return out


def _alive(p: dict[str, Any]) -> bool:
    return not p["metadata"].get("deletionTimestamp")


# ---------------------------------------------------------------------------------------------
# 1. ResourcePolicy with a real Deployment and the real ReplicaSet controller

POOLS = ("reserved", "on-demand", "spot")
NODES_PER_POOL = 2


def _policy(run: str) -> dict[str, Any]:
    def sel(pool: str) -> dict[str, str]:
        return {"pool": pool, RUN_LABEL: run}

    return {
        "apiVersion": "scheduling.alibabacloud.com/v1alpha1", "kind": "ResourcePolicy",
        "metadata": {"name": "web"},
        "spec": {
            "selector": {"app": f"web-{run}"},
            "strategy": "prefer",
            "units": [
                {"nodeSelector": sel("reserved"), "max": 10, "podLabels": {"unit": "reserved"}},
                {"nodeSelector": sel("on-demand"), "max": 10,
                 "podAnnotations": {"billing": "on-demand"}},
                {"nodeSelector": sel("spot"), "podLabels": {"unit": "spot"}},
            ],
            "matchLabelKeys": ["pod-template-hash"],
            "whenTryNextUnits": {"policy": "LackResourceOrExceedMax"},
        },
    }


def _deployment(run: str, replicas: int) -> dict[str, Any]:
    tmpl = gpu_pod("unused", run, mem=2)
    labels = {"app": f"web-{run}", RUN_LABEL: run}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": f"web-{run}"}},
            "template": {"metadata": {"labels": labels}, "spec": tmpl["spec"]},
        },
    }


def _unit_of(p: dict[str, Any], pool_of: dict[str, str]) -> int:
    return POOLS.index(pool_of[p["spec"]["nodeName"]])


def test_resourcepolicy_deployment_fills_units_and_scales_in_from_the_last(
        controlplane: ControlPlane, admin: Client, cluster: dict[str, Any],
        report: Report) -> None:
    ns, local = cluster["namespace"], cluster["extender"]
    kubelets: StandInKubelets = cluster["kubelets"]
    run = uuid.uuid4().hex[:6]
    pool_of: dict[str, str] = {}
    for pool in POOLS:
        for i in range(NODES_PER_POOL):
            name = f"rp-{pool}-{i}-{run}"
            obj = gpu_node_object(name, "cgpu", [16, 16, 16, 16], run)
            obj["metadata"]["labels"]["pool"] = pool
            create_node_object(admin, obj)
            pool_of[name] = pool
    status, body = controlplane.request("POST", RP_PATH.format(ns=ns), _policy(run))
    assert status == 201, body
    try:
        # the extender has the policy (its watch) before the first pod is filtered
        time.sleep(1.0)
        t0 = time.monotonic()
        admin.create(Deployment.from_dict(_deployment(run, 30)), namespace=ns)

        def web_pods() -> list[dict[str, Any]]:
            return [p for p in pod_dicts(admin, ns)
                    if p["metadata"]["labels"].get("app") == f"web-{run}" and _alive(p)]

        def all_bound() -> list[dict[str, Any]] | None:
            ps = web_pods()
            return ps if len(ps) == 30 and all(p["spec"].get("nodeName") for p in ps) else None

        pods = wait_for("30 pods of the Deployment bound", all_bound, timeout=120, every=0.5)
        t_bound = time.monotonic() - t0
        per_unit = Counter(_unit_of(p, pool_of) for p in pods)
        assert [per_unit[u] for u in range(3)] == [10, 10, 10], per_unit
        for p in pods:
            u = _unit_of(p, pool_of)
            anns, labels = p["metadata"]["annotations"], p["metadata"]["labels"]
            key = p["metadata"]["name"]
            assert anns[ANN_UNIT] == f"web/{u}", (key, anns)
            assert anns[ANN_DELETION_COST] == str((3 - u) * 100), (key, anns)
            assert labels.get("unit") == {0: "reserved", 1: None, 2: "spot"}[u], (key, labels)
            assert anns.get("billing") == ("on-demand" if u == 1 else None), (key, anns)
            assert decode(anns) is not None, key  # the GPU decision with it
            assert p["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
        # unit order: the unit is claimed when filter answers (the held pick) and the
        # assume-time is written when the bind lands; kube-scheduler binds asynchronously, so two
        # pods whose binds were in flight together may land in either order, but a pod of a
        # later unit is never bound before a pod of an earlier one by more than a bind in flight
        # (the units never go back)
        assumed = sorted((int(p["metadata"]["annotations"][names.ANN_ASSUME_TIME]),
                          _unit_of(p, pool_of)) for p in pods)
        in_flight_ns = int(2e9)
        back = [(t1, u1, t2, u2) for i, (t1, u1) in enumerate(assumed)
                for t2, u2 in assumed[i + 1:] if u2 < u1 and t2 - t1 > in_flight_ns]
        assert back == [], back
        order = [u for _, u in assumed]
        assert over_commits(node_dicts(admin, run), pod_dicts(admin, ns)) == []
        fs = _failed_scheduling(admin, ns)
        retried = {k: v for k, v in fs.items() if k.startswith("web-")}
        # kube-scheduler binds asynchronously: pods filtered while the binds that fill a unit
        # were in flight lose the race at bind (the unit's claims) and are retried; the reason
        # says so (nothing else refuses these pods: the nodes have room for all 30)
        for k, msgs in retried.items():
            for m in msgs:
                assert "became full" in m and "after this pod was filtered" in m, (k, m)
        report(f"ResourcePolicy web (max 10 / 10 / unlimited) + Deployment of 30 GPU pods "
               f"(aliyun.com/gpu-mem: 2) on {len(pool_of)} nodes: all bound in {t_bound:.1f}s; "
               f"per unit {[per_unit[u] for u in range(3)]}; order of the binds by unit: "
               f"{''.join(map(str, order))}; FailedScheduling events on "
               f"{len(retried)} pods (bind races lost at a full unit, retried)")
        for k, v in sorted(retried.items())[:3]:
            report(f"  {k}: {v[-1][:240]}")

        # scale in with the real ReplicaSet controller: lowest pod-deletion-cost first
        t1 = time.monotonic()
        admin.patch(Deployment, "web", {"spec": {"replicas": 12}}, namespace=ns,
                    patch_type=PatchType.MERGE)
        last: list[Any] = [None, time.monotonic()]

        def scaled() -> list[dict[str, Any]] | None:
            ps = web_pods()
            state = sorted(p["metadata"]["name"] for p in ps)
            if state != last[0]:
                last[0], last[1] = state, time.monotonic()
            ok = len(ps) == 12 and time.monotonic() - last[1] > 3.0
            return ps if ok else None

        left = wait_for("12 pods left, stable for 3 s", scaled, timeout=90, every=0.5)
        t_scaled = time.monotonic() - t1
        after = Counter(_unit_of(p, pool_of) for p in left)
        phases = Counter((p.get("status") or {}).get("phase") for p in pods)
        ready = sum(1 for p in pods for c in (p.get("status") or {}).get("conditions") or []
                    if c["type"] == "Ready" and c["status"] == "True")
        report(f"  scaled to 12 by the real ReplicaSet controller in {t_scaled:.1f}s: left per "
               f"unit {[after[u] for u in range(3)]} (pods were {dict(phases)}, {ready} Ready: "
               f"the pod-deletion-cost decides)")
        assert [after[u] for u in range(3)] == [10, 2, 0], (
            f"scale-in left {[after[u] for u in range(3)]} per unit; "
            f"{[(p['metadata']['name'], p['spec']['nodeName']) for p in left]}")
        assert {p["metadata"]["name"] for p in left} <= set(kubelets.started)
        _extender_log_clean(local)
    finally:
        with contextlib.suppress(ApiError):  # scaled to 0 first: no ReplicaSet recreates pods
            admin.patch(Deployment, "web", {"spec": {"replicas": 0}}, namespace=ns,
                        patch_type=PatchType.MERGE)
            with contextlib.suppress(BaseException):
                wait_for("the Deployment's pods gone", lambda: not any(
                    p.metadata.labels.get("app") == f"web-{run}"
                    for p in admin.list(Pod, namespace=ns)), timeout=30)
            admin.delete(Deployment, "web", namespace=ns)
        controlplane.request("DELETE", RP_PATH.format(ns=ns) + "/web")
        for p in admin.list(Pod, namespace=ns):
            with contextlib.suppress(ApiError):
                admin.delete(Pod, p.metadata.name, namespace=ns, grace_period=0)
        cleanup(admin, None, pool_of)
    controlplane.check_alive()


# ---------------------------------------------------------------------------------------------
# 2. two gangs on the real kube-scheduler

GANG_NODES = 3  # 4 GPUs of 16 GiB each: 12 GPUs, one gang of 8 whole-GPU pods fits, two do not
GANG_SIZE = 8


def _gang_pod(group: str, i: int, run: str) -> dict[str, Any]:
    p = gpu_pod(f"{group}-{i}", run, mem=16)
    p["metadata"]["labels"].update({LABEL_GROUP: group, LABEL_MIN_AVAILABLE: str(GANG_SIZE)})
    return p


def _allocated(local: LocalExtender, nodes: list[str]) -> dict[str, int]:
    """The extender's GPU memory allocated per node (its live state, holds included)."""
    return {n: int(metric(local.metrics_url, "sharegpu_node_gpu_memory_allocated", {"node": n}))
            for n in nodes}


def _annotated(pods: list[dict[str, Any]], nodes: list[str]) -> dict[str, int]:
    """GPU memory per node from the bound pods' annotations."""
    out = dict.fromkeys(nodes, 0)
    for p in pods:
        n = p["spec"].get("nodeName")
        if n in out and _alive(p):
            a = decode(p["metadata"].get("annotations") or {})
            assert a is not None, p["metadata"]["name"]
            out[n] += a.total_mem
    return out


def _rebuilt(admin: Client, run: str, ns: str) -> dict[str, int]:
    """No over-commit, and the state rebuilt from the pods' annotations (as a restarted
    extender does) fits every GPU; its GPU memory allocated per node."""
    nodes, pods = node_dicts(admin, run), pod_dicts(admin, ns)
    assert over_commits(nodes, pods) == []
    fresh = ClusterView()
    assert fresh.reset(nodes, [p for p in pods if _alive(p)]) == 0
    st = fresh.state
    rows = [st.index[n["metadata"]["name"]] for n in nodes]
    assert (st.gpu_free[rows] >= 0).all() and (st.core_free[rows] >= 0).all()
    return {n["metadata"]["name"]: int(st.total_sum[i] - st.free_sum[i])
            for n, i in zip(nodes, rows, strict=True)}


def test_two_gangs_one_binds_then_the_other(controlplane: ControlPlane, admin: Client,
                                            cluster: dict[str, Any], report: Report) -> None:
    ns, local = cluster["namespace"], cluster["extender"]
    run = uuid.uuid4().hex[:6]
    nodes = [gpu_node(admin, f"gang-{i}-{run}", "cgpu", [16, 16, 16, 16], run)
             for i in range(GANG_NODES)]
    groups = {g: [_gang_pod(g, i, run) for i in range(GANG_SIZE)] for g in ("train-a", "train-b")}
    try:
        t0 = time.monotonic()
        for pa, pb in zip(groups["train-a"], groups["train-b"], strict=True):  # together
            admin.create(Pod.from_dict(pa), namespace=ns)
            admin.create(Pod.from_dict(pb), namespace=ns)

        def bound_by_group() -> dict[str, int]:
            out = dict.fromkeys(groups, 0)
            for p in pod_dicts(admin, ns):
                g = p["metadata"]["labels"].get(LABEL_GROUP)
                if g in out and p["spec"].get("nodeName") and _alive(p):
                    out[g] += 1
            return out

        winner = wait_for("one gang fully bound", lambda: next(
            (g for g, n in bound_by_group().items() if n == GANG_SIZE), None), timeout=120,
            every=0.5)
        t_first = time.monotonic() - t0
        loser = next(g for g in groups if g != winner)
        reason = f"gang {ns}/{loser}:"

        def loser_explained() -> dict[str, list[str]] | None:
            fs = _failed_scheduling(admin, ns)
            ok = all(any(reason in m for m in fs.get(p["metadata"]["name"], []))
                     for p in groups[loser])
            return fs if ok else None

        fs = wait_for(f"FailedScheduling with the gang reason on every pod of {loser}",
                      loser_explained, timeout=60, every=1.0)
        time.sleep(5.0)  # kube-scheduler keeps retrying the loser: nothing of it binds
        counts = bound_by_group()
        assert counts == {winner: GANG_SIZE, loser: 0}, counts
        pods = pod_dicts(admin, ns)
        # nothing held for the loser: the extender's live allocation is what bound pods say
        alloc, annotated = _allocated(local, nodes), _annotated(pods, nodes)
        assert alloc == annotated, (alloc, annotated)
        assert sum(annotated.values()) == GANG_SIZE * 16
        assert _rebuilt(admin, run, ns) == alloc
        msg = max((m for p in groups[loser] for m in fs[p["metadata"]["name"]] if reason in m),
                  key=len)
        report(f"two gangs of {GANG_SIZE} pods (16 GiB each) on {GANG_NODES} nodes x 4 GPUs of "
               f"16 GiB: {winner} fully bound {t_first:.1f}s after creation, {loser} 0 bound; "
               f"extender's allocated GiB per node {list(alloc.values())} = the annotations' "
               f"{list(annotated.values())} (nothing held for {loser})")
        report(f"  {loser}'s FailedScheduling: {msg[:300]}")

        # the winner's pods deleted: kube-scheduler retries the loser's, which binds complete
        t1 = time.monotonic()
        for p in groups[winner]:
            admin.delete(Pod, p["metadata"]["name"], namespace=ns, grace_period=0)
        wait_for(f"{loser} fully bound", lambda: bound_by_group()[loser] == GANG_SIZE,
                 timeout=150, every=0.5)
        t_second = time.monotonic() - t1
        pods = pod_dicts(admin, ns)
        alloc, annotated = _allocated(local, nodes), _annotated(pods, nodes)
        assert alloc == annotated, (alloc, annotated)
        assert _rebuilt(admin, run, ns) == alloc
        per_node = Counter(p["spec"]["nodeName"] for p in pods
                           if p["metadata"]["labels"].get(LABEL_GROUP) == loser)
        report(f"  {winner}'s pods deleted: {loser} fully bound {t_second:.1f}s later "
               f"(pods per node {sorted(per_node.values())}); allocated GiB per node "
               f"{list(alloc.values())} = the annotations'; no over-commit")
        _extender_log_clean(local)
    finally:
        for p in admin.list(Pod, namespace=ns):
            with contextlib.suppress(ApiError):
                admin.delete(Pod, p.metadata.name, namespace=ns, grace_period=0)
        cleanup(admin, None, nodes)
    controlplane.check_alive()
