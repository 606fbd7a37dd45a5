"""One reader of a ResourceClaim's allocation result (sharegpu.dra.allocation), and its two
callers: the kubelet plugin refuses a result the reader cannot read, naming the field and the
rule; the counting reader (inspect, extender) leaves the same result out with a warning naming
the same field, and counts the rest."""

from __future__ import annotations

from fractions import Fraction

import pytest

from sharegpu.agent.draclaim import parse_claim
from sharegpu.core.errors import ValidationError
from sharegpu.dra import driver as dra
from sharegpu.dra.allocation import RESULTS, AllocatedGpu, allocated_results, read_result
from sharegpu.dra.drashares import claim_shares

NODE = "gpu-node-1"
GIB = 1 << 30


def result(**over) -> dict:
    r = {"request": "gpu", "driver": dra.DRIVER, "pool": NODE, "device": "gpu-1",
         "shareID": "s1", "consumedCapacity": {"memory": "4Gi", "cores": "30"}}
    return {k: v for k, v in {**r, **over}.items() if v is not None}


def claim(*results: dict) -> dict:
    return {"metadata": {"name": "c", "namespace": "default", "uid": "uid-c"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": dra.DRIVER,
                "capacity": {"requests": {"memory": "4Gi", "cores": "30"}}}}]}},
            "status": {"allocation": {"devices": {"results": list(results)}}}}


def test_a_result_is_read_once_into_the_gpu_and_what_it_consumed():
    got = read_result(result(), f"{RESULTS}[0]", 0)
    assert got == AllocatedGpu(0, "gpu", NODE, "gpu-1", 1, False, Fraction(4 * GIB),
                               Fraction(30), "s1")
    whole = read_result(result(consumedCapacity=None, shareID=None), "r", 3)
    assert whole.whole and whole.memory is None and whole.cores is None and whole.index == 3
    assert allocated_results({"status": {}}) is None
    with pytest.raises(ValidationError, match=r"results=7: must be a list"):
        allocated_results({"status": {"allocation": {"devices": {"results": 7}}}})


def test_both_callers_read_a_good_result_alike():
    c = claim(result(), result(request="whole", device="gpu-0", consumedCapacity=None,
                               shareID=None))
    strict = parse_claim(c, uid="uid-c", node=NODE, gpu_mem=[16, 16])
    shares, warnings = claim_shares(c)
    assert warnings == []
    assert [(d.gpu, d.mem_gib, d.core) for d in strict.devices] == [(1, 4, 30), (0, None, None)]
    assert [(s.node, s.gpu, s.mem_gib, s.core) for s in shares] == [
        (NODE, 1, 4, 30), (NODE, 0, None, None)]


@pytest.mark.parametrize(("bad", "field", "rule"), [
    (result(request=""), "request", "must be a non-empty string"),
    (result(shareID=5), "shareID", "must be a non-empty string"),
    (result(consumedCapacity="4Gi"), "consumedCapacity", "must be a map of capacity name"),
    (result(consumedCapacity={"memory": "4Gi", "gpus": "1"}), "consumedCapacity.gpus",
     "unknown capacity"),
    (result(consumedCapacity={"memory": "lots"}), "consumedCapacity.memory", "quantity"),
    (result(consumedCapacity={"memory": "-1Gi"}), "consumedCapacity.memory",
     "must not be negative"),
    (result(consumedCapacity={"memory": "1Gi", "cores": "x"}), "consumedCapacity.cores",
     "quantity"),
])
def test_a_result_the_reader_refuses_is_refused_by_the_plugin_and_left_out_by_the_count(
        bad, field, rule):
    c = claim(result(device="gpu-0"), bad)
    with pytest.raises(ValidationError) as e:
        parse_claim(c, uid="uid-c", node=NODE, gpu_mem=[16, 16])
    assert e.value.field == f"{RESULTS}[1].{field}" and rule in e.value.rule
    shares, warnings = claim_shares(c)
    assert [s.gpu for s in shares] == [0]
    (w,) = warnings
    assert f"ResourceClaim default/c: {RESULTS}[1].{field}=" in w and rule in w
    assert w.endswith("that result is left out")


def test_what_only_the_node_can_tell_is_the_plugins_rule():
    """Another node's pool, a GPU the node lacks, memory off the 1Gi step: readable results,
    counted by the cluster-wide reader, refused by the node that would prepare them."""
    for bad, field in ((result(pool="gpu-node-2"), "pool"), (result(device="gpu-7"), "device"),
                       (result(consumedCapacity={"memory": "1536Mi"}), "consumedCapacity.memory")):
        c = claim(bad)
        with pytest.raises(ValidationError) as e:
            parse_claim(c, uid="uid-c", node=NODE, gpu_mem=[16, 16])
        assert e.value.field == f"{RESULTS}[0].{field}"
        shares, warnings = claim_shares(c)
        assert len(shares) == 1 and warnings == []
    assert claim_shares(claim(result(consumedCapacity={"memory": "1536Mi"})))[0][0].mem_gib == 2
