"""strandfill's key decisions: a gap (or a whole GPU) is worth its LP price only while a pod
that could fill it still fits the node's CPU, memory and model."""

from __future__ import annotations

import numpy as np
import pytest

from sharegpu.core.placement import get_policy
from sharegpu.core.placement.base import resolve
from sharegpu.core.placement.fragmentation import TargetWorkload
from sharegpu.core.placement.policies.strandfill import StrandFill
from sharegpu.core.placement.rowmemo import row_keys
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.sim.trace import TracePod

G = 1000


def pod(share: int = 0, gpus: int = 1, cpu: int = 1_000, mem: int = 1_000) -> TracePod:
    return TracePod("p", cpu, mem, gpus if share else 0, share, "")


def workload(pods: list[TracePod]) -> TargetWorkload:
    return TargetWorkload.from_shapes([p.shape for p in pods], 0.95, mem=[p.mem_mib for p in pods])


# the openb default trace's main share sizes (more 320s than 650s, so that a 320 is worth 1/3
# of a GPU, as on openb); a 320 asks 4 cores
HISTORY = ([pod(G, cpu=8_000)] * 40 + [pod(810)] * 11 + [pod(470)] * 8 + [pod(650)] * 3
           + [pod(320, cpu=4_000)] * 6 + [pod(160)] + [pod(cpu=8_000)] * 10)


def scheduler(policy: str, nodes: list[NodeSpec], history: list[TracePod]) -> Scheduler:
    state = ClusterState(nodes)
    state.set_order(list(range(len(nodes))))
    pol = get_policy(policy)
    pol.prepare(state, workload(history))
    return Scheduler(state, pol)


def worth(pol: StrandFill, free: list[int], cpu: int, mem: int = 256_000) -> float:
    keys = row_keys(np.array([free]), np.array([cpu]), np.array([mem]), np.array([0]))
    return float(pol.node_worth(keys)[0])


def test_a_gap_that_no_partner_can_reach_is_worth_nothing() -> None:
    s = scheduler("strandfill", [NodeSpec("a", [G, G], cpu_milli=64_000, mem_mib=256_000)],
                  HISTORY)
    pol = s.policy
    assert isinstance(pol, StrandFill)
    # beside a 650: 350 free, worth a 320 (1/3) while 4 cores are left for one
    assert worth(pol, [350, 0], 64_000) == pytest.approx(1 / 3)
    assert worth(pol, [350, 0], 3_000) == 0.0
    # a whole GPU is worth 1 while more than a quarter of what could use it fits: behind 3
    # cores the 1-core 810s, 650s and 470s still do (29 %), behind half a core nothing does
    assert worth(pol, [G, G], 64_000) == pytest.approx(2.0)
    assert worth(pol, [G, G], 3_000) == pytest.approx(2.0)
    assert worth(pol, [G, G], 500) == 0.0
    # memory binds the same way
    assert worth(pol, [G, G], 64_000, mem=500) == 0.0


def test_a_share_keeps_its_gap_on_a_node_that_can_still_fill_it() -> None:
    # a 650 asking 10 cores: on node a (first in the order) it would leave 2 cores, so no 320
    # could ever complete its GPU (its 350 dies: a loss of 1/3 of a GPU); on b it loses nothing
    nodes = [NodeSpec("a", [G], cpu_milli=12_000, mem_mib=256_000),
             NodeSpec("b", [G], cpu_milli=64_000, mem_mib=256_000)]
    s = scheduler("strandfill", nodes, HISTORY)
    pol = s.policy
    assert isinstance(pol, StrandFill)
    assert worth(pol, [G], 12_000) - pol.prices.price(650) - worth(pol, [350], 2_000) == (
        pytest.approx(1 / 3))
    assert worth(pol, [G], 64_000) - pol.prices.price(650) - worth(pol, [350], 54_000) == (
        pytest.approx(0.0))
    d = s.schedule(pod(650, cpu=10_000).request("x"))
    assert d is not None and d.node_name == "b"


def test_a_cpu_only_pod_keeps_off_the_node_whose_gpus_it_would_strand() -> None:
    # node a (first) has 2 free GPUs and 20 cores: a 12-core CPU-only pod would leave 8, enough
    # for one 8-core whole-GPU pod only; node b has cores to spare
    nodes = [NodeSpec("a", [G, G], cpu_milli=20_000, mem_mib=256_000),
             NodeSpec("b", [G, G], cpu_milli=100_000, mem_mib=256_000)]
    s = scheduler("strandfill", nodes, HISTORY)
    d = s.schedule(pod(cpu=12_000).request("c"))
    assert d is not None and d.node_name == "b"


def test_same_decisions_as_strandlp_when_cpu_and_memory_do_not_bind() -> None:
    rng = np.random.default_rng(5)
    nodes = [NodeSpec(f"n{i}", [G] * int(rng.choice([2, 4, 8])), cpu_milli=1_000_000,
                      mem_mib=10_000_000) for i in range(8)]
    shapes = [pod(G), pod(810), pod(470), pod(650), pod(320), pod(160), pod(G, gpus=2)]
    history = [*HISTORY, pod(G, gpus=2)]
    lp, fill = scheduler("strandlp", nodes, history), scheduler("strandfill", nodes, history)
    placed = 0
    for i in range(120):
        p = shapes[int(rng.integers(len(shapes)))]
        a, b = lp.schedule(p.request(f"z{i}")), fill.schedule(p.request(f"z{i}"))
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert (a.node_name, a.alloc.mem) == (b.node_name, b.alloc.mem)
            placed += 1
    assert placed > 40


def test_strandfill_is_the_default_policy() -> None:
    assert resolve("default") == "strandfill"
    assert type(get_policy("default")) is StrandFill


def test_registered_and_needs_a_workload() -> None:
    pol = get_policy("strandfill")
    with pytest.raises(ValueError, match="target workload"):
        pol.prepare(ClusterState([NodeSpec("a", [G])]), None)
