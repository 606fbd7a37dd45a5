"""The data model behind ``kubectl inspect cgpu``: which nodes and pods count, and how."""

from __future__ import annotations

import json

import pytest

import cgpu_cluster as cc
from sharegpu.core import names
from sharegpu.core.errors import ValidationError
from sharegpu.inspect_cgpu import render
from sharegpu.inspect_cgpu.model import build
from sharegpu.inspect_cgpu.render import percent, tabwrite


def split(doc):
    items = doc["items"]
    return ([i for i in items if i["kind"] == "Node"], [i for i in items if i["kind"] == "Pod"])


def placed(name, node, alloc: dict, core: dict | None = None, phase="Running", first_gen=False):
    p = cc.pod(name, sum(sum(g.values()) for g in alloc.values()))
    p.pop("_phase")
    p["spec"]["nodeName"] = node
    p["status"]["phase"] = phase
    ann = p["metadata"]["annotations"]
    if first_gen:
        gpus = sorted({g for per in alloc.values() for g in per})
        ann[names.ANN_MEM_IDX] = ",".join(map(str, gpus))
        ann[names.ANN_MEM_POD] = str(sum(sum(g.values()) for g in alloc.values()))
    else:
        ann[names.ANN_ALLOCATION] = json.dumps(alloc)
        if core:
            ann[names.ANN_CORE] = json.dumps(core)
    return p


def test_tabwrite_column_blocks_like_go_tabwriter():
    # consecutive lines with a cell in a column share its width; a line without one ends it
    lines = [["a", "bb", ""], ["cccc", "d", ""], ["no tabs here"], ["e", "f"]]
    assert tabwrite(lines) == ["a     bb", "cccc  d", "no tabs here", "e  f"]
    # the last cell of a line is not padded and does not widen its column
    assert tabwrite([["x", "a very long tail"], ["yy", "z"]]) == ["x   a very long tail", "yy  z"]


def test_percent_is_truncated_integer():
    assert percent(24, 60) == 40 and percent(8, 15) == 53 and percent(2, 3) == 66
    assert percent(29, 100) == 29 and percent(0, 0) == 0


def test_finished_pods_do_not_count_and_other_phases_do():
    n = cc.node("n1", "10.0.0.1", [15, 15])
    pods = [
        placed("a", "n1", {"0": {"0": 3}}, phase="Succeeded"),
        placed("b", "n1", {"0": {"0": 4}}, phase="Failed"),
        placed("c", "n1", {"0": {"1": 5}}, phase="Pending"),
        placed("d", "n1", {"0": {"1": 1}}, phase="Unknown"),
    ]
    view = build([n], pods)
    (node,) = view.nodes
    assert [g.mem_allocated for g in node.gpus] == [0, 6]
    assert [p.name for p in node.pods] == ["c", "d"]


def test_both_annotation_generations_and_multi_container_multi_gpu():
    n = cc.node("n1", "10.0.0.1", [16, 16, 16, 16])
    pods = [
        placed("old", "n1", {"0": {"2": 4, "3": 4}}, first_gen=True),
        placed("new", "n1", {"0": {"1": 1}, "1": {"1": 7}}),  # two containers on GPU1
        placed("wide", "n1", {"0": {"0": 2, "2": 2}}),
    ]
    (node,) = build([n], pods).nodes
    assert [g.mem_allocated for g in node.gpus] == [2, 8, 6, 4]
    assert [g.pods for g in node.gpus] == [1, 1, 2, 1]
    assert node.mem_allocated == 20
    out = render.details(build([n], pods))
    rows = [" ".join(line.split()) for line in out.splitlines()]
    assert "new default 0 8 0 0" in rows and "old default 0 0 4 4" in rows


def test_pod_without_gpu_index_is_pending_and_pods_without_gpu_are_ignored():
    n = cc.node("n1", "10.0.0.1", [15])
    waiting = cc.pod("waiting", 6)
    waiting.pop("_phase")
    waiting["spec"]["nodeName"] = "n1"
    cpu_only = cc.pod("cpu", 1)
    cpu_only.pop("_phase")
    cpu_only["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
    cpu_only["spec"]["nodeName"] = "n1"
    elsewhere = cc.pod("unbound", 2)  # no nodeName: not on any node yet
    elsewhere.pop("_phase")
    view = build([n], [waiting, cpu_only, elsewhere])
    (node,) = view.nodes
    assert node.pending_mem == 6 and node.mem_allocated == 6
    assert [p.name for p in node.pods] == ["waiting"]
    text = render.summary(view)
    assert text.splitlines()[0].split()[-3:] == ["PENDING(Allocated)", "GPU", "Memory(GiB)"]
    assert text.splitlines()[1].split() == ["n1", "10.0.0.1", "0/15", "6", "6/15"]


def test_nodes_that_share_no_memory_are_not_shown_and_totals_come_from_allocatable():
    shared = cc.node("shared", "10.0.0.1", [15, 15])
    exclusive = cc.node("excl", "10.0.0.2", [15, 15], mode="default")
    # no sharegpu.io/gpu-mem annotation: allocatable gpu-mem split over gpu-count
    plain = cc.node("plain", "10.0.0.3", [12, 12], annotate=False)
    # the agent may report less than the cards hold; the node total is its allocatable
    shared["status"]["allocatable"][names.RES_GPU_MEM] = "28"
    view = build([shared, exclusive, plain], [])
    assert [n.name for n in view.nodes] == ["plain", "shared"]
    assert [g.mem_total for g in view.nodes[0].gpus] == [12, 12]
    assert view.nodes[1].mem_total == 28 and view.mem_total == 52


def test_gpus_of_different_sizes():
    n = cc.node("mixed", "10.0.0.1", [15, 32])
    view = build([n], [placed("a", "mixed", {"0": {"1": 20}})])
    assert "0/15                   20/32" in render.summary(view)


def test_node_filter_keeps_order_and_rejects_unknown_names():
    a, b = cc.node("a", "10.0.0.1", [15]), cc.node("b", "10.0.0.2", [15])
    excl = cc.node("x", "10.0.0.3", [15], mode="default")
    assert [n.name for n in build([a, b, excl], [], ["b", "a"]).nodes] == ["b", "a"]
    with pytest.raises(ValidationError, match="no such node"):
        build([a, b], [], ["zzz"])
    with pytest.raises(ValidationError, match="shares no GPU memory"):
        build([a, b, excl], [], ["x"])


def test_bad_objects_are_reported_and_the_rest_still_shown():
    good = cc.node("good", "10.0.0.1", [15])
    bad = cc.node("bad", "10.0.0.2", [15])
    bad["metadata"]["annotations"][names.ANN_NODE_GPU_MEM] = "15,x"
    broken = placed("broken", "good", {"0": {"0": 2}})
    broken["metadata"]["annotations"][names.ANN_ALLOCATION] = "{not json"
    off = placed("off", "good", {"0": {"5": 3}})  # GPU index the node does not have
    ok = placed("ok", "good", {"0": {"0": 4}})
    uncounted = cc.node("uncounted", "10.0.0.3", [15], annotate=False)
    del uncounted["status"]["allocatable"][names.RES_GPU_COUNT]
    del uncounted["metadata"]["labels"][names.LABEL_CARD_COUNT]
    view = build([good, bad, uncounted], [broken, off, ok])
    assert [n.name for n in view.nodes] == ["good"]
    text = "\n".join(view.warnings)
    assert "node uncounted left out" in text and names.RES_GPU_COUNT in text
    assert "node bad left out" in text and names.ANN_NODE_GPU_MEM in text
    assert "default/broken" in text and names.ANN_ALLOCATION in text
    assert "default/off" in text and "GPU index [5]" in text
    # the broken pod still asks for 2 GiB: it counts as PENDING, never silently as free
    assert view.nodes[0].gpus[0].mem_allocated == 4 and view.nodes[0].pending_mem == 2


def test_empty_cluster():
    out = render.summary(build([], []))
    assert out.splitlines()[-2:] == ["Allocated/Total GPU Memory In Cluster:", "0/0 (0%)"]


def test_json_output():
    doc = json.loads(render.to_json(build(*split(cc.core_mem()))))
    core, mem = doc["nodes"]
    assert (core["name"], core["mode"], core["placement"]) == ("gpu-core-1", "core_mem", "binpack")
    assert core["gpus"][0] == {"index": 0, "memAllocated": 4, "memTotal": 15, "pods": 2,
                               "coreAllocated": 60, "coreTotal": 100}
    assert core["pendingGpuMem"] == 2 and core["gpuCoreAllocated"] == 90
    pending = [p for p in core["pods"] if p["pending"]]
    assert [p["name"] for p in pending] == ["cuda-sample-m3"]
    assert "coreAllocated" not in mem["gpus"][0]
    assert (doc["gpuMemAllocated"], doc["gpuMemTotal"], doc["gpuMemAllocatedPercent"]) == (
        12, 90, 13)
