"""``kubectl inspect cgpu`` with DRA mode: a node's GPUs from its ResourceSlice, the shares of
ResourceClaims (their ``consumedCapacity`` per GPU) beside device-plugin pods."""

from __future__ import annotations

import json

import cgpu_cluster as cc
from sharegpu.core.modes import Mode
from sharegpu.dra import driver as dra
from sharegpu.dra.drashares import claim_shares, slice_gpus
from sharegpu.dra.resourceslices import SliceGpu, build_slice
from sharegpu.inspect_cgpu import render
from sharegpu.inspect_cgpu.cli import main
from sharegpu.inspect_cgpu.model import build

DRA_NODE = "gpu-dra-1"


def dra_node(name: str = DRA_NODE, address: str = "192.0.2.21", mode: str = "cgpu") -> dict:
    """A DRA node as the agent leaves it: the mode label, no device-plugin GPU resources."""
    n = cc.node(name, address, [15, 15, 15], mode=mode, annotate=False)
    for key in ("allocatable", "capacity"):
        n["status"][key] = {"cpu": "16", "memory": "64Gi", "pods": "110"}
    n["metadata"]["labels"]["sharegpu.io/dra"] = "true"
    return n


def dra_slice(name: str = DRA_NODE, mem=(15, 15, 15), mode: Mode = Mode.CGPU) -> dict:
    gpus = [SliceGpu(i, f"GPU-{name}-{i}", "Tesla T4", 15109, m) for i, m in enumerate(mem)]
    return build_slice(name, gpus, mode)


def result(device: str, mem: str | None, cores: str | None = None, node: str = DRA_NODE,
           request: str = "gpu") -> dict:
    r = {"request": request, "driver": dra.DRIVER, "pool": node, "device": device,
         "shareID": f"share-{device}-{mem}"}
    if mem is not None:
        r["consumedCapacity"] = {"memory": mem, **({"cores": cores} if cores else {})}
    return r


def claim(name: str, results: list[dict], pod: str | None, ns: str = "default") -> dict:
    status: dict = {"allocation": {"devices": {"results": results}}}
    if pod:
        status["reservedFor"] = [{"resource": "pods", "name": pod, "uid": f"uid-{pod}"}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": dra.DRIVER}}]}},
            "status": status}


def dra_pod(name: str, claims: list[str], ns: str = "default", node: str = DRA_NODE) -> dict:
    """A pod of DRA mode: its GPU comes from claims, it asks for no aliyun.com resource."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                         "annotations": {}, "labels": {}},
            "spec": {"nodeName": node, "containers": [{"name": "main", "resources": {
                "claims": [{"name": c} for c in claims]}}],
                     "resourceClaims": [{"name": c, "resourceClaimName": c} for c in claims]},
            "status": {"phase": "Running"}}


def cluster() -> dict:
    """One device-plugin node with pods placed by the core, one DRA node with claims: two pods
    sharing gpu-0, one pod with two claims (gpu-0 and gpu-1), a whole GPU (gpu-2), and a claim
    allocated but not reserved by a pod yet."""
    dp_nodes = [cc.node("gpu-dp-1", "192.0.2.11", [15, 15])]
    dp_pods = cc.schedule(dp_nodes, [cc.pod("web-1", 4), cc.pod("web-2", 6)])
    claims = [
        claim("train-a", [result("gpu-0", "4Gi", "20")], "train-a"),
        claim("train-b", [result("gpu-0", "5Gi", "30")], "train-b", ns="team"),
        claim("infer-x", [result("gpu-0", "2Gi", "10")], "infer"),
        claim("infer-y", [result("gpu-1", "3Gi", "15")], "infer"),
        claim("whole", [result("gpu-2", None)], "big"),
        claim("coming", [result("gpu-1", "1Gi", "5")], None),
        claim("not-allocated", [], None) | {"status": {}},
    ]
    pods = [dra_pod("train-a", ["train-a"]), dra_pod("train-b", ["train-b"], ns="team"),
            dra_pod("infer", ["infer-x", "infer-y"]), dra_pod("big", ["whole"])]
    return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
            "items": [*dp_nodes, dra_node(), *dp_pods, *pods, dra_slice(), *claims]}


def objects(doc: dict) -> tuple[list, list, list, list]:
    by: dict[str, list] = {"Node": [], "Pod": [], "ResourceSlice": [], "ResourceClaim": []}
    for i in doc["items"]:
        by[i["kind"]].append(i)
    return by["Node"], by["Pod"], by["ResourceSlice"], by["ResourceClaim"]


SUMMARY = """\
NAME       IPADDRESS   GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU2(Allocated/Total)  GPU Memory(GiB)
gpu-dp-1   192.0.2.11  10/15                  0/15                   0/0                    10/30
gpu-dra-1  192.0.2.21  11/15                  4/15                   15/15                  30/45
---------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
40/75 (53%)
"""

DETAILS_DRA = """\

NAME:       gpu-dra-1
IPADDRESS:  192.0.2.21

NAME          NAMESPACE  GPU0(Allocated)  GPU1(Allocated)  GPU2(Allocated)
infer         default    2                3                0
train-a       default    4                0                0
train-b       team       5                0                0
claim:coming  default    0                1                0
big           default    0                0                15
Allocated :   30 (66%)
Total :       45
--------------------------------------------------------------------------


Allocated/Total GPU Memory In Cluster:  30/45 (66%)
"""


def test_summary_counts_claims_beside_device_plugin_pods(tmp_path, capsys):
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(cluster()))
    assert main(["--file", str(path)]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == (SUMMARY, "")


def test_details_list_each_claims_pod_and_unreserved_claims(tmp_path, capsys):
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(cluster()))
    assert main(["-d", "--file", str(path), DRA_NODE]) == 0
    assert capsys.readouterr().out == DETAILS_DRA


def test_inspect_agrees_with_the_claims_consumed_capacity_per_gpu():
    nodes, pods, slices, claims = objects(cluster())
    view = build(nodes, pods, None, slices, claims)
    (node,) = [n for n in view.nodes if n.name == DRA_NODE]
    # per GPU, what the claims' consumedCapacity says, summed independently of the model
    want_mem = [0, 0, 0]
    want_core = [0, 0, 0]
    want_count = [0, 0, 0]
    for c in claims:
        for r in (c["status"].get("allocation") or {}).get("devices", {}).get("results", []):
            g = int(r["device"].split("-")[1])
            cap = r.get("consumedCapacity")
            want_mem[g] += int(cap["memory"][:-2]) if cap else 15
            want_core[g] += int(cap.get("cores", 0)) if cap else 100
            want_count[g] += 1
    assert [g.mem_allocated for g in node.gpus] == want_mem == [11, 4, 15]
    assert [g.core_allocated for g in node.gpus] == want_core == [60, 20, 100]
    assert [g.pods for g in node.gpus] == want_count
    assert node.dra and node.mem_total == 45 and node.mode is Mode.CGPU
    assert node.pending_mem == 0  # DRA pods hold claims; none counts as PENDING
    doc = json.loads(render.to_json(view))
    dn = next(n for n in doc["nodes"] if n["name"] == DRA_NODE)
    infer = next(p for p in dn["pods"] if p["name"] == "infer")
    assert infer["claims"] == ["infer-x", "infer-y"] and infer["gpuMem"] == {"0": 2, "1": 3}
    dp = next(n for n in doc["nodes"] if n["name"] == "gpu-dp-1")
    assert not dp["dra"] and all(p["claims"] == [] for p in dp["pods"])


def test_core_mem_dra_node_shows_the_claims_cores():
    node = dra_node(mode="core_mem")
    sl = dra_slice(mode=Mode.CORE_MEM)
    claims = [claim("a", [result("gpu-0", "4Gi", "30")], "a"),
              claim("b", [result("gpu-0", "2Gi", "45")], "b")]
    out = render.summary(build([node], [], None, [sl], claims))
    assert "GPU0(Core%)" in out and "75/100" in out
    assert "Allocated/Total GPU Core In Cluster:\n75/300 (25%)" in out


def test_a_device_plugin_pod_on_a_dra_node_still_counts_pending_unless_it_holds_a_claim():
    node = dra_node()
    waiting = cc.pod("legacy", 3)
    waiting["spec"]["nodeName"] = DRA_NODE
    holder = cc.pod("holder", 2)  # asks aliyun.com/gpu-mem and holds a claim: the claim counts
    holder["spec"]["nodeName"] = DRA_NODE
    claims = [claim("h", [result("gpu-1", "2Gi", "5")], "holder")]
    view = build([node], [waiting, holder], None, [dra_slice()], claims)
    (n,) = view.nodes
    assert n.pending_mem == 3 and n.gpus[1].mem_allocated == 2
    assert sorted(p.name for p in n.pods) == ["holder", "legacy"]


def test_unreadable_claims_and_slices_are_warnings_not_failures():
    bad_claim = claim("bad", [result("gpu-0", "lots"), result("gpu-9", "1Gi"),
                              result("not-a-gpu", "1Gi")], "p")
    other = claim("other", [{"request": "x", "driver": "gpu.example.com", "pool": DRA_NODE,
                             "device": "gpu-0"}], "q")
    broken_slice = dra_slice("gpu-dra-2")
    broken_slice["spec"]["devices"][1]["capacity"]["memory"]["value"] = "many"
    view = build([dra_node(), dra_node("gpu-dra-2", "192.0.2.22")], [], None,
                 [dra_slice(), broken_slice], [bad_claim, other])
    text = "\n".join(view.warnings)
    assert "ResourceClaim default/bad: status.allocation.devices.results[0].consumedCapacity." \
           "memory" in text
    assert "results[2] left out: pool must name a node and device must be gpu-<index>" in text
    assert "GPU index 9 is not in the node's ResourceSlice (3 GPUs); not counted" in text
    assert "ResourceSlice gpu-dra-2-gpu.sharegpu.io: spec.devices[1].capacity.memory.value" \
           in text
    a, b = view.nodes
    assert [g.mem_allocated for g in a.gpus] == [0, 0, 0]  # another driver's result: not ours
    assert [g.mem_total for g in b.gpus] == [15, 0, 15] and b.mem_total == 30


def test_readers_in_core():
    sg, w = slice_gpus(dra_slice(mem=(15, 32)))
    assert w == [] and sg is not None and sg.mem_gib == {0: 15, 1: 32} and sg.mode == "cgpu"
    assert slice_gpus({"spec": {"driver": "other"}}) == (None, [])
    shares, w = claim_shares(claim("c", [result("gpu-1", "4.5Gi", "25")], "p"))
    assert w == [] and [(s.node, s.gpu, s.mem_gib, s.core, s.pods) for s in shares] == [
        (DRA_NODE, 1, 5, 25, (("default", "p"),))]
    assert claim_shares(claim("c", [result("gpu-0", None)], None))[0][0].whole


def test_live_cluster_lists_slices_and_claims(fake_api, capsys, monkeypatch):
    doc = cluster()
    for obj in doc["items"]:
        fake_api.create(obj)
    monkeypatch.setenv("KUBECONFIG", str(fake_api.kubeconfig_path))
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == (SUMMARY, "")


def test_claim_requests_translate_capacity_requests():
    from sharegpu.dra.drashares import DraRequest, claim_requests

    c = {"metadata": {"name": "c", "namespace": "default"}, "spec": {"devices": {"requests": [
        {"name": "a", "exactly": {"deviceClassName": dra.DRIVER,
                                  "capacity": {"requests": {"memory": "4.5Gi", "cores": "30"}}}},
        {"name": "b", "exactly": {"deviceClassName": dra.DRIVER, "count": 2}},
        {"name": "other", "exactly": {"deviceClassName": "nic.example.com"}},
        {"name": "all", "exactly": {"deviceClassName": dra.DRIVER, "allocationMode": "All"}},
        {"name": "bad", "exactly": {"deviceClassName": dra.DRIVER,
                                    "capacity": {"requests": {"memory": "lots"}}}},
    ]}}}
    got, warnings = claim_requests(c)
    # All is legal DRA the policy does not score: kept, unranked, no warning
    assert got == [DraRequest("c", "a", 1, 5, 30), DraRequest("c", "b", 2, None, 0),
                   DraRequest("c", "all", 1, None, 0, ranked=False)]
    assert len(warnings) == 1
    assert "spec.devices.requests[4].exactly.capacity.requests.memory" in warnings[0]


def test_the_extender_passes_dra_pods_everywhere_and_binds_them_plainly():
    """Today's behaviour, kept on purpose: a DRA pod asks for no aliyun.com resource, so the
    extender (profile mode: every pod of the profile reaches it) refuses no node for it, scores
    every node 0 (kube-scheduler's own scores and the allocator decide) and binds it without
    GPU annotations -- after kube-scheduler's PreBind, where DynamicResources wrote the claim's
    allocation (schedule_one.go: RunPreBindPlugins, then extendersBinding)."""
    from sharegpu.core.request import parse_pod
    from sharegpu.extender.view import ClusterView
    from sharegpu_testing import kobjects

    v = ClusterView("default")
    v.reset([kobjects.node("dp", [16, 16], "cgpu"), dra_node()], [])
    req = parse_pod(dra_pod("train", ["train"]))
    assert not req.wants_gpu
    names = ["dp", DRA_NODE]
    assert v.filter(req, names) == (names, {}, {})
    assert set(v.prioritize(req, names).values()) == {0}
