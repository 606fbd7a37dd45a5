"""strandlp's key decisions: the LP prices of GPU shares and where they send a share."""

from __future__ import annotations

import numpy as np
import pytest

from sharegpu.core.annotations import Allocation
from sharegpu.core.placement import get_policy
from sharegpu.core.placement.fragmentation import TargetWorkload
from sharegpu.core.placement.policies.strandlp import prior_prices
from sharegpu.core.placement.shareprices import SharePrices, knapsack, simplex_max
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.sim.trace import TracePod

G = 1000


def pod(share: int = 0, gpus: int = 1, cpu: int = 1_000, mem: int = 1_000) -> TracePod:
    return TracePod("p", cpu, mem, gpus if share else 0, share, "")


def workload(pods: list[TracePod]) -> TargetWorkload:
    return TargetWorkload.from_shapes([p.shape for p in pods], 0.95, mem=[p.mem_mib for p in pods])


def scheduler(policy: str, nodes: list[NodeSpec], history: list[TracePod]) -> Scheduler:
    state = ClusterState(nodes)
    state.set_order(list(range(len(nodes))))
    pol = get_policy(policy)
    pol.prepare(state, workload(history))
    return Scheduler(state, pol)


def hold(s: Scheduler, node: str, gpu: int, share: int, name: str) -> None:
    """Put a share on a given GPU (as if an earlier pod had been placed there)."""
    req = pod(share).request(name)
    s.state.reserve(req, node, Allocation(mem={0: {gpu: share}}))


def gpu_of(s: Scheduler, share: int, name: str) -> tuple[str, int]:
    d = s.schedule(pod(share).request(name))
    assert d is not None
    (gpu,) = d.alloc.mem[0]
    return d.node_name, gpu


# the openb default trace's main share sizes, in roughly its proportions
HISTORY = ([pod(G)] * 40 + [pod(810)] * 11 + [pod(470)] * 8 + [pod(650)] * 3
           + [pod(320)] * 3 + [pod(160)] + [pod()] * 10)


def test_simplex_solves_a_small_lp() -> None:
    # max 3x + 2y  s.t.  x + y <= 4, x + 3y <= 6, x <= 3  ->  x = 3, y = 1
    y = simplex_max(np.array([3.0, 2.0]), np.array([[1.0, 1.0], [1.0, 3.0], [1.0, 0.0]]),
                    np.array([4.0, 6.0, 3.0]))
    assert y == pytest.approx([3.0, 1.0])


def test_knapsack_takes_the_best_value_that_fits() -> None:
    best, _ = knapsack(np.array([300, 500]), np.array([1.0, 2.0]), 1000, 100)
    assert best[10] == pytest.approx(4.0)  # two 500s
    assert best[8] == pytest.approx(3.0)  # 500 + 300
    assert best[2] == 0.0


def test_prices_are_an_optimal_dual_of_the_packing() -> None:
    # 4 shares of 600 and 4 of 400 pack into 4 GPUs, no fewer
    sp = SharePrices(np.array([600, 400]), np.array([4.0, 4.0]), G)
    assert float((sp.prices * sp.weights).sum()) == pytest.approx(4.0)  # the optimum
    assert sp.value(np.array([G]))[0] == pytest.approx(1.0)  # no pattern worth more than a GPU
    # 10 shares of 810 and 2 of 160: ten GPUs; the 160s ride in the 810s' gaps for free
    sp = SharePrices(np.array([810, 160]), np.array([10.0, 2.0]), G)
    assert sp.price(810) == pytest.approx(1.0) and sp.price(160) == pytest.approx(0.0)


def test_loss_is_zero_for_moves_that_an_optimal_packing_makes() -> None:
    sp = prior_prices(workload(HISTORY), G)
    assert sp.price(810) == pytest.approx(1.0)
    assert sp.price(470) == pytest.approx(0.5)  # two to a GPU
    loss = {g: float(sp.loss(np.array([g]), 320)[0]) for g in (G, 350, 530)}
    assert loss[G] == pytest.approx(0.0)  # a fresh GPU, for a 650 to join
    assert loss[350] == pytest.approx(0.0)  # beside a 650: 30 left
    assert loss[530] > 0.1  # beside a 470: leaves 210 that only a rare 160 fits
    assert float(sp.loss(np.array([190]), 160)[0]) == pytest.approx(0.0)  # 810's gap


def test_share_keeps_off_the_gpu_that_would_strand_its_remainder() -> None:
    # node a: GPU 0 holds a 470 (530 free), GPU 1 is free. A 320 arrives: strand fills GPU 0
    # (the tighter fit), leaving 210 that almost nothing fits; strandlp opens GPU 1, where a
    # 650 completes it, and keeps GPU 0's 530 for the next 470.
    nodes = [NodeSpec("a", [G, G], cpu_milli=64_000, mem_mib=256_000)]
    strand = scheduler("strand", nodes, HISTORY)
    lp = scheduler("strandlp", nodes, HISTORY)
    for i, s in enumerate((strand, lp)):
        hold(s, "a", 0, 470, f"held-{i}")
    assert gpu_of(strand, 320, "x1") == ("a", 0)
    assert gpu_of(lp, 320, "x2") == ("a", 1)
    assert gpu_of(lp, 470, "x3") == ("a", 0)  # 470 + 470: 60 left
    assert gpu_of(lp, 650, "x4") == ("a", 1)  # 320 + 650: 30 left


def test_share_goes_beside_its_partner_on_another_node() -> None:
    # an 810 left 190 on node b; a 160 goes there rather than onto a fresh GPU of a (first in
    # the order), and the next 810 opens a fresh GPU
    nodes = [NodeSpec(n, [G, G], cpu_milli=64_000, mem_mib=256_000) for n in ("a", "b")]
    lp = scheduler("strandlp", nodes, HISTORY)
    hold(lp, "b", 1, 810, "held")
    assert gpu_of(lp, 160, "y1") == ("b", 1)


def test_pods_that_are_not_shares_are_placed_as_strand_places_them() -> None:
    rng = np.random.default_rng(3)
    nodes = [NodeSpec(f"n{i}", [G] * int(rng.choice([2, 4, 8])),
                      cpu_milli=int(rng.choice([32_000, 64_000])), mem_mib=256_000)
             for i in range(10)]
    history = [*HISTORY, pod(G, gpus=2), pod(G, gpus=4)]
    shapes = [pod(G), pod(G, gpus=2), pod(G, gpus=4), pod(cpu=8_000)]
    strand = scheduler("strand", nodes, history)
    lp = scheduler("strandlp", nodes, history)
    placed = 0
    for i in range(60):
        p = shapes[int(rng.integers(len(shapes)))]
        a, b = strand.schedule(p.request(f"z{i}")), lp.schedule(p.request(f"z{i}"))
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert (a.node_name, a.alloc.mem) == (b.node_name, b.alloc.mem)
            placed += 1
    assert placed > 20


def test_registered_and_needs_a_workload() -> None:
    pol = get_policy("strandlp")
    with pytest.raises(ValueError, match="target workload"):
        pol.prepare(ClusterState([NodeSpec("a", [G])]), None)


def test_prices_on_a_coarse_grid_when_units_are_fine() -> None:
    # GPU memory in MiB: the knapsack's grid is coarsened, the prices stay those of the LP
    sp = SharePrices(np.array([40_000, 20_001]), np.array([2.0, 2.0]), 81_920)
    assert sp.unit > 1 and len(sp.k) <= 2_001
    # two 40,000s fill one GPU, four 20,001s another: 2 · 1/2 + 2 · 1/4 = 1.5 GPUs
    assert float((sp.prices * sp.weights).sum()) == pytest.approx(1.5)
    assert sp.price(40_000) == pytest.approx(0.5)
