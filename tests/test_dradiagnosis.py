"""Why no node of the DRA pool can take a pod (sharegpu.dra.dradiagnosis, issue 21 bad input): each
reason names the field and the rule; a pod that would fit an empty pool gets none."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from sharegpu.core import names
from sharegpu.core.modes import Mode
from sharegpu.dra import driver as dra
from sharegpu.dra.draclaims import Pool, Shape, apply_patch, claim_template, translate
from sharegpu.dra.dradiagnosis import (
    ISOLATION_FIX,
    OtherNode,
    diagnose,
    is_unschedulable,
    message,
    pool_node,
    selects,
)
from sharegpu.dra.drashares import DraRequest, claim_requests, slice_gpus
from sharegpu.dra.resourceslices import SliceGpu, build_slice

POOL = {"sharegpu.io/dra": "true"}
SIZES = {"n1": (15, 15), "n2": (16, 16), "n3": (24,), "n4": (40, 40)}


@dataclass(frozen=True)
class Facts:
    requests: tuple[DraRequest, ...]
    problem: str = ""
    allocated: bool = False


def node_labels(name: str, **extra: str) -> dict[str, str]:
    return {"kubernetes.io/hostname": name, **POOL, **extra}


def pool(sizes: dict[str, tuple[int, ...]] = SIZES, *, unhealthy: bool = False,
         isolation: bool = False, mode: Mode = Mode.CGPU, labels: dict[str, dict] | None = None,
         said: str = "") -> list:
    out = []
    for name, gib in sizes.items():
        gpus = [SliceGpu(i, f"GPU-{name}-{i}", "Tesla T4", g * 1024, g, unhealthy=unhealthy,
                         isolation_unavailable=isolation) for i, g in enumerate(gib)]
        got, warnings = slice_gpus(build_slice(name, gpus, mode))
        assert got is not None and warnings == []
        out.append(pool_node(name, (labels or {}).get(name, node_labels(name)), got,
                             said.replace("NODE", name)))
    return out


def ack_pod(mem: int, *, core: int | None = None, count: int | None = None,
            selector: dict[str, str] | None = None, affinity: Any = None,
            name: str = "p") -> tuple[dict[str, Any], dict[str, Facts]]:
    """An ACK-spec pod as the webhook translates it, once unschedulable, and its generated
    claim as the claim controller makes it from the template."""
    limits = {names.RES_GPU_MEM: str(mem)}
    if core is not None:
        limits[names.RES_GPU_CORE] = str(core)
    spec: dict[str, Any] = {"nodeSelector": dict(POOL if selector is None else selector),
                            "containers": [{"name": "main", "image": "x",
                                            "resources": {"limits": limits}}]}
    if affinity is not None:
        spec["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": affinity}}}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "ns",
                        "labels": {names.POD_LABEL_GPU_COUNT: str(count)} if count else {}},
           "spec": spec}
    t = translate(pod, Pool())
    assert t is not None
    pod = apply_patch(pod, t.patch)
    claims = {}
    statuses = []
    for entry, template in t.claims.items():
        gen = f"{name}-{entry}-x1y2z"
        shape = Shape(mem // (count or 1), (core or 0) // (count or 1), count or 1)
        assert shape.template_name == template
        tmpl = claim_template("ns", shape, Pool())
        claim = {"metadata": {"name": gen, "namespace": "ns"}, "spec": tmpl["spec"]["spec"]}
        reqs, problems = claim_requests(claim)
        assert problems == []
        claims[f"ns/{gen}"] = Facts(tuple(reqs))
        statuses.append({"name": entry, "resourceClaimName": gen})
    pod["status"] = {"phase": "Pending", "resourceClaimStatuses": statuses, "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/5 nodes are available: 4 cannot allocate all claims."}]}
    return pod, claims


def own_claim_pod(requests: list[dict], constraints: list | None = None,
                  **spec: Any) -> tuple[dict[str, Any], dict[str, Facts]]:
    """A pod with its own ResourceClaim (not translated)."""
    claim = {"metadata": {"name": "mine", "namespace": "ns"},
             "spec": {"devices": {"requests": requests, "constraints": constraints or []}}}
    reqs, problems = claim_requests(claim)
    pod = {"metadata": {"name": "p", "namespace": "ns"},
           "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "mine"}],
                    "containers": [{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}],
                    **spec}}
    return pod, {"ns/mine": Facts(tuple(reqs), "; ".join(problems))}


def gpu_request(name: str = "gpu", **exactly: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": dra.DRIVER, **exactly}}


# -- fits an empty pool: nothing said ---------------

@pytest.mark.parametrize("mem,core,count", [(1, None, None), (40, None, None), (24, 30, None),
                                           (80, None, 2), (30, 100, 2)])
def test_a_pod_that_fits_an_empty_pool_gets_no_reason(mem, core, count):
    pod, claims = ack_pod(mem, core=core, count=count)
    assert is_unschedulable(pod)
    assert diagnose(pod, claims, pool()) == []


def test_unknown_allocated_or_foreign_claims_give_no_reason():
    pod, claims = ack_pod(48)
    assert diagnose(pod, {}, pool()) == []  # the claim not seen yet
    pod["status"]["resourceClaimStatuses"] = []
    assert diagnose(pod, claims, pool()) == []  # not generated yet
    pod, claims = ack_pod(48)
    ((key, facts),) = claims.items()
    assert diagnose(pod, {key: Facts(facts.requests, allocated=True)}, pool()) == []
    assert diagnose(pod, {key: Facts(())}, pool()) == []  # another driver's claim
    # firstAvailable / All: left to the allocator, nothing said even when the pod also
    # selects no node of the pool
    for req in ({"name": "gpu", "firstAvailable": [
                    {"name": "a", "deviceClassName": dra.DRIVER,
                     "capacity": {"requests": {"memory": "99Gi"}}}]},
                gpu_request(allocationMode="All")):
        mine, facts = own_claim_pod([req], nodeName="dp-node")
        assert facts["ns/mine"].requests and not facts["ns/mine"].problem
        assert diagnose(mine, facts, pool()) == []
    assert diagnose({"metadata": {"name": "x"}, "spec": {}}, {}, pool()) == []


# -- capacity ---------------

def test_a_request_larger_than_every_gpu_names_the_claim_field_and_the_ack_resource():
    pod, claims = ack_pod(48)
    (why,) = diagnose(pod, claims, pool())
    assert why == ("ResourceClaim ns/p-sharegpu-c0-x1y2z spec.devices.requests[0].exactly."
                   "capacity.requests.memory=48Gi (spec.containers[0] aliyun.com/gpu-mem=48): "
                   "larger than every GPU of the DRA pool (largest: 40Gi, node n4 gpu-0)")
    assert message([why]).startswith(
        f"no node of the DRA pool (driver {dra.DRIVER}) can take this pod as it is: ")


def test_gpu_count_per_gpu_memory_and_the_label():
    pod, claims = ack_pod(96, count=2)  # 48 GiB per GPU
    (why,) = diagnose(pod, claims, pool())
    assert "capacity.requests.memory=48Gi (spec.containers[0] aliyun.com/gpu-mem=96 over " \
           "metadata.labels[aliyun.com/gpu-count]=2): larger than every GPU" in why
    # 4 GPUs of 20 GiB: some GPUs hold 20, but no node has 4 distinct ones
    pod, claims = ack_pod(80, count=4)
    (why,) = diagnose(pod, claims, pool())
    assert why == ("ResourceClaim ns/p-sharegpu-c0-x1y2z spec.devices.requests[0].exactly."
                   "count=4 (metadata.labels[aliyun.com/gpu-count]=4, spec.containers[0] "
                   "aliyun.com/gpu-mem=80) with distinctAttribute: more GPUs of at least 20Gi "
                   "than any node of the DRA pool has (most: 2, node n4)")
    # 2 GPUs of 24 GiB: n4 has two
    assert diagnose(*ack_pod(48, count=2), pool()) == []
    # 2 x 30 GiB without n4: one GPU of 24 at most
    small = {k: v for k, v in SIZES.items() if k != "n4"}
    (why,) = diagnose(*ack_pod(60, count=2), pool(small))
    assert "larger than every GPU of the DRA pool (largest: 24Gi, node n3 gpu-0)" in why


def test_own_claims_cores_count_and_shared_gpus():
    pod, claims = own_claim_pod([gpu_request(capacity={"requests": {"memory": "4Gi",
                                                                     "cores": "150"}})])
    (why,) = diagnose(pod, claims, pool())
    assert why == ("ResourceClaim ns/mine spec.devices.requests[0].exactly.capacity.requests."
                   "cores=150: more than every GPU of the DRA pool has (most: 100, node n1 "
                   "gpu-0)")
    # count 3 with distinctAttribute on all requests (no requests named)
    pod, claims = own_claim_pod([gpu_request(count=3)],
                                [{"distinctAttribute": f"{dra.DRIVER}/uuid"}])
    (why,) = diagnose(pod, claims, pool())
    assert "exactly.count=3 with distinctAttribute: more GPUs than any node of the DRA pool " \
           "has (most: 2, node n1)" in why
    # without distinctAttribute a shareable GPU may be given twice: not a reason
    assert diagnose(*own_claim_pod([gpu_request(count=3)]), pool()) == []
    # memory as written, rounded up to the step
    pod, claims = own_claim_pod([gpu_request(capacity={"requests": {"memory": "40.5Gi"}})])
    (why,) = diagnose(pod, claims, pool())
    assert "capacity.requests.memory=40.5Gi: larger than every GPU" in why
    # the webhook's selector on a pool of exclusive nodes only
    pod, claims = ack_pod(4)
    (why,) = diagnose(pod, claims, pool(mode=Mode.EXCLUSIVE))
    assert why.startswith("ResourceClaim ns/p-sharegpu-c0-x1y2z spec.devices.requests[0]."
                          "exactly.selectors (device.allowMultipleAllocations == true): no GPU "
                          "of the DRA pool is shared")
    # a bigger exclusive GPU does not count for it
    mixed = pool() + pool({"big": (80,)}, mode=Mode.EXCLUSIVE)
    (why,) = diagnose(*ack_pod(48), mixed)
    assert "larger than every shared GPU of the DRA pool (largest: 40Gi" in why
    assert diagnose(*own_claim_pod([gpu_request(capacity={"requests": {"memory": "48Gi"}})]),
                    mixed) == []


def test_two_claims_that_fit_no_single_node_together():
    pod, claims = own_claim_pod([
        gpu_request("big", capacity={"requests": {"memory": "30Gi"}}),
        gpu_request("pair", count=2, capacity={"requests": {"memory": "16Gi"}})],
        [{"requests": ["pair"], "distinctAttribute": f"{dra.DRIVER}/uuid"}])
    nodes = pool({"n2": (16, 16), "n3": (40,)})
    (why,) = diagnose(pod, claims, nodes)
    assert why == ("its claims fit no single node together (a pod's claims are allocated on "
                   "the node it runs on): ResourceClaim ns/mine requests[0] (memory=30Gi) only "
                   "on n3; ResourceClaim ns/mine requests[1] (memory=16Gi, count=2) only on n2")
    assert diagnose(pod, claims, pool({"n2": (16, 16), "n3": (40,), "n4": (40, 40)})) == []


# -- node selection ---------------

def test_a_dra_pod_aimed_at_a_device_plugin_node():
    pod, claims = ack_pod(4, selector={**POOL, "kubernetes.io/hostname": "dp-node"})
    others = [OtherNode("dp-node", {"kubernetes.io/hostname": "dp-node"}, device_plugin=True),
              OtherNode("cpu-node", {"kubernetes.io/hostname": "cpu-node"})]
    (why,) = diagnose(pod, claims, pool(), others)
    assert why == ("spec.nodeSelector[kubernetes.io/hostname]=dp-node: selects no node of the "
                   "DRA pool (nodes with a ResourceSlice of gpu.sharegpu.io: n1, n2, n3, n4); "
                   "dp-node serves its GPUs through the device plugins")
    # a node outside the pool that is no GPU node
    pod, claims = ack_pod(4, selector={**POOL, "kubernetes.io/hostname": "cpu-node"})
    assert diagnose(pod, claims, pool(), others)[0].endswith("; cpu-node is not in the DRA pool")
    # the pool label itself matches: not named
    pod, claims = ack_pod(4, selector={**POOL, "zone": "b"})
    (why,) = diagnose(pod, claims, pool())
    assert why.startswith("spec.nodeSelector[zone]=b: selects no node of the DRA pool")
    # a node of the pool named by hostname, too small: the scope is that node
    pod, claims = ack_pod(30, selector={**POOL, "kubernetes.io/hostname": "n3"})
    (why,) = diagnose(pod, claims, pool())
    assert why.endswith("larger than every GPU of the DRA nodes the pod's node selection "
                        "allows (n3) (largest: 24Gi, node n3 gpu-0)")
    # both wrong: both said
    pod, claims = ack_pod(48, selector={**POOL, "kubernetes.io/hostname": "dp-node"})
    got = diagnose(pod, claims, pool(), others)
    assert len(got) == 2 and "larger than every GPU of the DRA pool" in got[1]


def test_the_affinity_variant_names_the_term_and_expression():
    aff = [{"matchExpressions": [
        {"key": "sharegpu.io/dra", "operator": "In", "values": ["true"]},
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["dp-node"]}]}]
    pod, claims = ack_pod(4, selector={}, affinity=aff)
    others = [OtherNode("dp-node", {"kubernetes.io/hostname": "dp-node",
                                    "sharegpu.io/dra": "true"}, device_plugin=True)]
    (why,) = diagnose(pod, claims, pool(), others)
    assert why == ("spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuring"
                   "Execution.nodeSelectorTerms: no term selects a node of the DRA pool "
                          "(nodes with a ResourceSlice of gpu.sharegpu.io: n1, n2, n3, n4): "
                          "nodeSelectorTerms[0].matchExpressions[1] (kubernetes.io/hostname In "
                   "[dp-node]); dp-node serves its GPUs through the device plugins")
    # two terms, each failing its own way (the webhook refuses that for ACK pods: own claim)
    aff.append({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["x"]}]})
    (why,) = diagnose(*own_claim_pod([gpu_request()], affinity={"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": aff}}}), pool())
    assert why.endswith("nodeSelectorTerms[0].matchExpressions[1] (kubernetes.io/hostname In "
                        "[dp-node]); nodeSelectorTerms[1].matchFields[0] (metadata.name In [x])")
    # an affinity that selects pool nodes is no reason
    assert diagnose(*ack_pod(4, selector={}, affinity=[{"matchExpressions": [
        {"key": "sharegpu.io/dra", "operator": "In", "values": ["true"]},
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]}]}]),
        pool()) == []


def test_node_selection_matching():
    labels = node_labels("n3", gen="4", zone="a")

    def sel(*terms: Any, **spec: Any) -> bool:
        s: dict[str, Any] = dict(spec)
        if terms:
            s["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": list(terms)}}}
        return selects({"spec": s}, "n3", labels)

    def expr(key: str, op: str, *values: str) -> dict[str, Any]:
        return {"matchExpressions": [{"key": key, "operator": op,
                                      **({"values": list(values)} if values else {})}]}

    assert sel() and sel(nodeName="n3") and not sel(nodeName="n4")
    assert sel(nodeSelector={"zone": "a"}) and not sel(nodeSelector={"zone": "b"})
    assert sel(expr("zone", "In", "a", "b")) and not sel(expr("zone", "In", "b"))
    assert sel(expr("zone", "NotIn", "b")) and not sel(expr("zone", "NotIn", "a"))
    assert sel(expr("rack", "NotIn", "x"))  # absent key: NotIn holds
    assert sel(expr("zone", "Exists")) and not sel(expr("rack", "Exists"))
    assert sel(expr("rack", "DoesNotExist")) and not sel(expr("zone", "DoesNotExist"))
    assert sel(expr("gen", "Gt", "3")) and not sel(expr("gen", "Gt", "4"))
    assert sel(expr("gen", "Lt", "5")) and not sel(expr("gen", "Lt", "4"))
    assert not sel(expr("zone", "Gt", "1"))  # not a number
    assert not sel(expr("rack", "Lt", "9"))  # absent
    # terms ORed, expressions ANDed
    assert sel(expr("zone", "In", "b"), expr("gen", "Gt", "1"))
    both = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]},
                                 {"key": "gen", "operator": "Gt", "values": ["9"]}]}
    assert not sel(both)
    # matchFields on metadata.name
    assert sel({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n3"]}]})
    assert not sel({"matchFields": [{"key": "metadata.name", "operator": "NotIn",
                                     "values": ["n3"]}]})
    assert not sel({})  # an empty term matches no node
    # nodeSelector and affinity together
    assert not sel(expr("zone", "In", "a"), nodeSelector={"gen": "5"})


def test_constraints_that_each_select_pool_nodes_but_not_together():
    pod, claims = ack_pod(4, selector={**POOL, "kubernetes.io/hostname": "n1"},
                          affinity=[{"matchExpressions": [
                              {"key": "kubernetes.io/hostname", "operator": "In",
                               "values": ["n2"]}]}])
    (why,) = diagnose(pod, claims, pool())
    assert why.startswith("spec.affinity.nodeAffinity and spec.nodeSelector together select no node of the "
                          "DRA pool")
    pod, claims = own_claim_pod([gpu_request()], nodeName="dp-node")
    (why,) = diagnose(pod, claims, pool(), [OtherNode("dp-node", {}, True)])
    assert why.startswith("spec.nodeName=dp-node: selects no node of the DRA pool")


# -- taints ---------------

def test_every_fitting_gpu_tainted_isolation_unavailable():
    pod, claims = ack_pod(4)
    (why,) = diagnose(pod, claims, pool(isolation=True))
    assert why == (
        "ResourceClaim ns/p-sharegpu-c0-x1y2z requests[0] (memory=4Gi) (spec.containers[0] "
        "aliyun.com/gpu-mem=4): every GPU of the DRA pool that could hold it carries a device "
        "taint the claim does not tolerate: gpu.sharegpu.io/isolation-unavailable on n1 (gpu-0, "
        f"gpu-1), n2 (gpu-0, gpu-1), n3 (gpu-0) and 1 more: {ISOLATION_FIX}")
    # the agent's own words from the node condition, when known
    said = ("node NODE: isolation back-end hami is not usable: the HAMi-core library "
            "/usr/local/vgpu/libvgpu.so does not exist; fix: install HAMi-core")
    (why,) = diagnose(pod, claims, pool(isolation=True, said=said))
    assert why.endswith("and 1 more: the node's GPU isolation back-end (HAMi-core or MPS) is "
                        "not usable, so its agent keeps new claims off its GPUs until it is; "
                        "GPUIsolationReady on n1, n2 and 2 more: isolation back-end hami is not "
                        "usable: the HAMi-core library /usr/local/vgpu/libvgpu.so does not "
                        "exist; fix: install HAMi-core")
    # only the GPUs that could hold it count: 30 GiB fits only n4's, which are tainted
    nodes = pool({k: v for k, v in SIZES.items() if k != "n4"}) + pool({"n4": (40, 40)},
                                                                      isolation=True)
    (why,) = diagnose(*ack_pod(30), nodes)
    assert "isolation-unavailable on n4 (gpu-0, gpu-1)" in why
    assert diagnose(*ack_pod(20), nodes) == []  # n3's 24 GiB GPU is clean


def test_unhealthy_taint_and_tolerations():
    pod, claims = own_claim_pod([gpu_request(capacity={"requests": {"memory": "4Gi"}})])
    (why,) = diagnose(pod, claims, pool({"n1": (15,)}, unhealthy=True))
    assert "gpu.sharegpu.io/unhealthy on n1 (gpu-0): the GPU had a critical XID error" in why
    for tol in ({"key": f"{dra.DRIVER}/unhealthy", "operator": "Exists"},
                {"operator": "Exists"},
                {"key": f"{dra.DRIVER}/unhealthy", "operator": "Equal", "value": "",
                 "effect": "NoSchedule"}):
        pod, claims = own_claim_pod([gpu_request(capacity={"requests": {"memory": "4Gi"}},
                                                 tolerations=[tol])])
        assert diagnose(pod, claims, pool({"n1": (15,)}, unhealthy=True)) == [], tol
    pod, claims = own_claim_pod([gpu_request(
        capacity={"requests": {"memory": "4Gi"}},
        tolerations=[{"key": f"{dra.DRIVER}/unhealthy", "operator": "Exists",
                      "effect": "NoExecute"}])])
    assert diagnose(pod, claims, pool({"n1": (15,)}, unhealthy=True)) != []  # other effect


# -- claims sharegpu cannot read; no pool ---------------

def test_a_claim_that_cannot_be_read_names_its_field():
    pod, claims = own_claim_pod([gpu_request(capacity={"requests": {"memory": "lots"}})])
    (why,) = diagnose(pod, claims, pool())
    assert why.startswith("spec.resourceClaims[0] (ResourceClaim ns/mine): sharegpu cannot read "
                          "its request: ResourceClaim ns/mine: spec.devices.requests[0].exactly."
                          "capacity.requests.memory='lots'")
    pod, claims = ack_pod(4)
    (why,) = diagnose(pod, claims, [])
    assert why.startswith("the DRA pool has no node")


def test_malformed_pods_never_raise():
    pod, claims = ack_pod(48)
    for spec in ({"resourceClaims": "x"}, {"resourceClaims": [1, {"name": 3}]},
                 {**pod["spec"], "nodeSelector": "x", "affinity": {"nodeAffinity": [1]}},
                 {**pod["spec"], "affinity": {"nodeAffinity": {
                     "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                         1, {"matchExpressions": [{"key": 1}, "x"]}]}}}}):
        bad = {**pod, "spec": spec}
        assert isinstance(diagnose(bad, claims, pool()), list)
    bad = json.loads(json.dumps(pod))
    bad["metadata"]["annotations"][names.ANN_DRA_CLAIMS] = "{not json"
    (why,) = diagnose(bad, claims, pool())
    assert "memory=48Gi: larger than every GPU" in why  # the ACK field is not named
    assert not is_unschedulable({"status": {"conditions": "x"}})
