"""``sharegpu whatif``'s Replay on dumps synthesised from an openb-format cluster: under the
policy that placed the pods it gives back every placement (0 GPUs held otherwise), and under
the other policies it places each pod where ``sharegpu simulate`` places it on the same pods in
the same order. The generated cluster runs everywhere; the openb trace where it is present."""

from __future__ import annotations

import pytest

from sharegpu.core.placement.base import Policy
from sharegpu.sim import generate
from sharegpu.sim.trace import NODE_FILE, read_nodes, read_pods, workload_path
from sharegpu.whatif.cluster import read
from sharegpu.whatif.policyreplay import holders, orderings, replay_one
from sharegpu_testing.dumps import Dump, place, synthesise

# random draws over the node slots, which the simulator holds in the trace's order and a cluster
# in the listed (name) order: the same draws land on other nodes, so it is left out here
OTHERS = ["bestfit", "fgd", "packing", "dotprod", "strand", "spread"]


def _objects(dump: Dump) -> tuple[list[dict], list[dict]]:
    items = dump.doc["items"]
    return ([o for o in items if o["kind"] == "Node"], [o for o in items if o["kind"] == "Pod"])


def _check(dump: Dump, nodes, pods, placing: str, others: list[str], seed: int = 0,
           inflation: float = 1.0) -> None:
    cluster = read(*_objects(dump))
    assert not cluster.warnings
    state, problems = cluster.state()
    assert not problems
    today = holders(state)
    how, orders = orderings(cluster, 5)
    assert how == "creation order" and len(orders) == 1
    assert [p.key for p in orders[0]] == [Dump.key(i) for i in range(len(dump.seq))]
    run = replay_one(cluster, placing, orders[0], today)
    assert run.differences == 0
    assert run.unplaced == [] and run.pending_fit == 0
    for i, d in enumerate(dump.decisions):
        if d is not None:
            assert run.nodes[Dump.key(i)] == dump.to_k8s[d.node_name]
    # the target the replays use is the one the placing policy was prepared with
    learned = cluster.learned(Policy())
    learned.prepare(state)
    target = learned.workload
    assert target is not None
    for policy in others:
        sim = place(nodes, pods, policy, seed, target, inflation)
        run = replay_one(cluster, policy, orders[0], today, seed=seed)
        got = [run.nodes[Dump.key(i)] for i in range(len(sim))]
        assert got == [dump.to_k8s[d.node_name] if d is not None else None for d in sim], policy
        pending = {Dump.key(i) for i, d in enumerate(dump.decisions) if d is None}
        assert run.placed + len(run.unplaced) == len(sim) - len(pending)
        assert run.pending_fit == sum(1 for i, d in enumerate(sim)
                                      if d is not None and Dump.key(i) in pending)


@pytest.mark.parametrize("placing", ["strandfill", "fgd"])
def test_replay_of_a_generated_cluster_gives_back_every_placement(placing):
    nodes = generate.nodes(2023, count=120)
    pods = [p for p in generate.pods(2023, count=900) if p.num_gpu]
    dump = synthesise(nodes, pods, policy=placing, seed=0, inflation=1.0)
    assert any(d is None for d in dump.decisions)  # a full cluster, with pods pending
    others = [p for p in OTHERS if p != placing]
    _check(dump, nodes, pods, placing, others)


def test_replay_of_openb_gives_back_every_placement(openb):
    nodes = read_nodes(openb / NODE_FILE)
    pods = [p for p in read_pods(workload_path(openb, "default")) if p.num_gpu]
    dump = synthesise(nodes, pods, policy="strandfill", seed=0, inflation=1.0)
    _check(dump, nodes, pods, "strandfill", ["fgd", "bestfit"])


def test_ties_in_creation_order_are_replayed_in_several_orders():
    nodes = generate.nodes(2023, count=40)
    pods = [p for p in generate.pods(2023, count=300) if p.num_gpu]
    dump = synthesise(nodes, pods, policy="bestfit", seed=0, inflation=0.9, same_second=10,
                      assume_time=False)
    cluster = read(*_objects(dump))
    how, orders = orderings(cluster, 4)
    assert "in 4 random orders" in how and len(orders) == 4
    keys = [[p.key for p in o] for o in orders]
    assert len({tuple(k) for k in keys}) == 4  # the ties drawn differently
    for k in keys:  # the seconds stay in order
        assert [x.created for x in sorted(cluster.pods, key=lambda p: k.index(p.key))] == \
            sorted(p.created for p in cluster.pods)
    how, orders = orderings(cluster, 1)
    assert "else by name" in how and len(orders) == 1


def test_whatif_reads_a_cluster_as_the_extender_rebuilds_it():
    """The same state and the same learnt target as the extender's rebuild (ClusterCache.reset)
    from the same objects: recorded placements, a GPU pod without a decision, pods without
    GPUs (their CPU and memory), a finished pod, a pending one."""
    import numpy as np

    from sharegpu.core.placement.base import get_policy
    from sharegpu.core.placement.learned import LearnedWorkload
    from sharegpu.extender.cache import ClusterCache
    from sharegpu_testing import kobjects

    nodes = generate.nodes(2023, count=30)
    pods = [p for p in generate.pods(2023, count=200) if p.num_gpu]
    dump = synthesise(nodes, pods, policy="bestfit", seed=0, inflation=1.0)
    node_objs, pod_objs = _objects(dump)
    first = node_objs[0]["metadata"]["name"]
    extra = [kobjects.pod("unrecorded", mem=100, node_name=first, cpu="1", memory="1Gi"),
             kobjects.pod("web", node_name=first, containers=[{}], cpu="3", memory="2Gi"),
             kobjects.pod("done", mem=500, node_name=first, cpu="50")]
    extra[2]["status"]["phase"] = "Succeeded"
    pod_objs = [*pod_objs, *extra]
    cache = ClusterCache("fgd", LearnedWorkload(get_policy("fgd")))
    cache.reset(node_objs, pod_objs)
    cluster = read(node_objs, pod_objs)
    state, problems = cluster.state()
    assert not problems
    assert state.fingerprint() == cache.state.fingerprint()
    learned = cluster.learned(get_policy("fgd"))
    learned.prepare(state)
    ours, theirs = learned.workload, cache.learned.workload
    assert ours is not None and theirs is not None
    for f in ("cpu", "gpu", "k", "p", "mem"):
        assert np.array_equal(getattr(ours, f), getattr(theirs, f)), f
    assert ours.models == theirs.models


def test_the_figures_are_a_mean_and_sd_over_the_orderings():
    from sharegpu.whatif.analysis import Options, analyse

    nodes = generate.nodes(2023, count=40)
    pods = [p for p in generate.pods(2023, count=400) if p.num_gpu]
    dump = synthesise(nodes, pods, policy="bestfit", seed=0, inflation=1.1, same_second=20,
                      assume_time=False)
    cluster = read(*_objects(dump))
    a = analyse(cluster, Options(policies=["bestfit", "spread"], orderings=4))
    doc = a.to_json()
    assert "in 4 random orders" in doc["replay"]["order"]
    for p in doc["replay"]["policies"]:
        assert p["orderings"] == 4
        runs = next(r for r in a.replays if r.policy == p["policy"]).runs
        alloc = [r.totals["mem_allocated"] for r in runs]
        assert p["mem_allocated"]["mean"] == round(sum(alloc) / 4, 3)
    # the orders differ, and with a cluster this full so do some figures
    assert any(p["gpus_held_otherwise_than_today"]["sd"] > 0 for p in doc["replay"]["policies"])
