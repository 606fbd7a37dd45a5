"""The strand policy's key decisions on small hand-built clusters."""

from __future__ import annotations

import numpy as np
import pytest

from sharegpu.core.annotations import Allocation
from sharegpu.core.placement import get_policy
from sharegpu.core.placement.base import resolve
from sharegpu.core.placement.fragmentation import TargetWorkload
from sharegpu.core.placement.stranding import StrandingModel
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.sim.trace import TracePod

G = 1000  # one GPU in the simulator's units


def node(name: str, gpus: int, cpu: int | None = 64_000, mem: int | None = 256_000,
         model: str = "G2") -> NodeSpec:
    return NodeSpec(name, [G] * gpus, model=model, cpu_milli=cpu, mem_mib=mem)


def pod(cpu: int = 0, mem: int = 0, gpus: int = 0, share: int = 0, spec: str = "") -> TracePod:
    return TracePod("p", cpu, mem, gpus, share, spec)


def workload(pods: list[TracePod], coverage: float = 0.95) -> TargetWorkload:
    return TargetWorkload.from_shapes([p.shape for p in pods], coverage,
                                      mem=[p.mem_mib for p in pods])


def scheduler(policy: str, nodes: list[NodeSpec], history: list[TracePod],
              order: list[int] | None = None) -> Scheduler:
    state = ClusterState(nodes)
    if order is not None:
        state.set_order(order)
    pol = get_policy(policy)
    pol.prepare(state, workload(history))
    return Scheduler(state, pol)


_seq = iter(range(10**9))


def place(s: Scheduler, p: TracePod) -> str | None:
    d = s.schedule(p.request(f"pod-{next(_seq)}"))
    return None if d is None else d.node_name


def fill_gpus(s: Scheduler, node_name: str, gpus: list[int]) -> None:
    """Hold whole GPUs of a node with pods that ask for no CPU or memory."""
    for g in gpus:
        req = pod(gpus=1, share=G).request(f"filler-{next(_seq)}")
        s.state.reserve(req, node_name, Allocation(mem={0: {g: G}}))


WHOLE = pod(cpu=10_000, mem=1_000, gpus=1, share=G)


def test_cpu_only_pod_avoids_the_node_whose_gpus_it_would_strand() -> None:
    # a and b have the same CPU; a still has 2 free GPUs, b none. A CPU-only pod that takes
    # 30 of a's 40 cores leaves CPU for only one GPU pod there: one GPU stranded.
    nodes = [node("a", 2, cpu=40_000), node("b", 2, cpu=40_000)]
    history = [WHOLE] * 9 + [pod(cpu=30_000, mem=1_000)]
    fgd = scheduler("fgd", nodes, history, order=[0, 1])
    strand = scheduler("strand", nodes, history, order=[0, 1])
    for s in (fgd, strand):
        fill_gpus(s, "b", [0, 1])
    cpu_pod = pod(cpu=30_000, mem=1_000)
    assert place(fgd, cpu_pod) == "a"  # FGD sees no fragment either way; order decides
    assert place(strand, cpu_pod) == "b"
    # and so the next GPU pods both fit on a
    assert place(strand, WHOLE) == "a"
    assert place(strand, WHOLE) == "a"


def test_memory_counts_like_cpu() -> None:
    nodes = [node("a", 2, mem=40_000), node("b", 2, mem=40_000)]
    heavy = pod(cpu=1_000, mem=15_000, gpus=1, share=G)
    history = [heavy] * 9 + [pod(cpu=1_000, mem=30_000)]
    s = scheduler("strand", nodes, history, order=[0, 1])
    fill_gpus(s, "b", [0, 1])
    assert place(s, pod(cpu=1_000, mem=30_000)) == "b"


def test_gpu_pod_goes_where_it_strands_no_gpu_behind_cpu() -> None:
    # a: 4 free GPUs, 40 cores; b: 4 free GPUs, 45 cores; most pods want 10 cores a GPU.
    # A pod with 15 cores leaves a with 25 cores for its 3 other GPUs (one stranded), b with
    # 30 (none). Both stay able to host every shape, so FGD sees no difference.
    nodes = [node("a", 4, cpu=40_000), node("b", 4, cpu=45_000)]
    mid = pod(cpu=15_000, mem=1_000, gpus=1, share=G)
    history = [WHOLE] * 8 + [mid] * 2
    assert place(scheduler("fgd", nodes, history, order=[0, 1]), mid) == "a"
    assert place(scheduler("strand", nodes, history, order=[0, 1]), mid) == "b"


def test_untyped_pod_keeps_off_the_scarce_model_that_typed_pods_need() -> None:
    # 4 % of the history may only run on T4: too rare for FGD's 95 % typical shapes, so FGD
    # sees no difference between the nodes and takes the first; strand keeps the T4 free.
    nodes = [node("t4", 2, model="T4"), node("g2", 2, model="G2")]
    history = [WHOLE] * 96 + [pod(cpu=10_000, mem=1_000, gpus=1, share=G, spec="T4")] * 4
    fgd = scheduler("fgd", nodes, history, order=[0, 1])
    strand = scheduler("strand", nodes, history, order=[0, 1])
    assert place(fgd, WHOLE) == "t4"
    assert place(strand, WHOLE) == "g2"


def test_ties_go_to_the_node_first_in_the_order() -> None:
    nodes = [node("a", 2), node("b", 2), node("c", 2)]
    history = [WHOLE] * 10
    assert place(scheduler("strand", nodes, history, order=[2, 0, 1]), WHOLE) == "b"
    assert place(scheduler("strand", nodes, history, order=[1, 2, 0]), WHOLE) == "c"


def test_sharing_pod_fills_the_gpu_that_fgd_would() -> None:
    # GPU 1 of a already holds 500: a 500 share that completes it leaves no fragment, while
    # one on a free GPU leaves half a GPU that whole-GPU pods cannot use
    nodes = [node("a", 2), node("b", 2)]
    half = pod(cpu=1_000, mem=1_000, gpus=1, share=500)
    history = [half] * 5 + [WHOLE] * 5
    for policy in ("fgd", "strand"):
        s = scheduler(policy, nodes, history, order=[1, 0])
        s.state.reserve(half.request("first"), "a", Allocation(mem={0: {1: 500}}))
        d = s.schedule(half.request("second"))
        assert d is not None and d.node_name == "a" and d.alloc.gpus == (1,), policy


def test_reduces_to_fgd_when_cpu_memory_and_models_do_not_bind() -> None:
    # no host resources tracked, no model restrictions: every decision equals FGD's
    rng = np.random.default_rng(7)
    nodes = [NodeSpec(f"n{i}", [G] * int(rng.choice([1, 2, 4, 8]))) for i in range(12)]
    shapes = [pod(gpus=1, share=int(m)) for m in (200, 300, 450, 500, 700, G)]
    shapes += [pod(gpus=2, share=G), pod(gpus=4, share=G)]
    history = [shapes[int(i)] for i in rng.integers(len(shapes), size=200)]
    order = list(rng.permutation(len(nodes)))
    fgd = scheduler("fgd", nodes, history, order)
    strand = scheduler("strand", nodes, history, order)
    placed = 0
    for i, p in enumerate(history[:60]):
        a = fgd.schedule(p.request(f"x{i}"))
        b = strand.schedule(p.request(f"x{i}"))
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert (a.node_name, a.alloc.mem) == (b.node_name, b.alloc.mem)
            placed += 1
    assert placed > 20


def test_scarcity_weighs_shapes_by_how_few_gpus_can_host_them() -> None:
    state = ClusterState([node("t4", 2, model="T4"), node("g2", 6, model="G2")])
    history = [WHOLE] * 5 + [pod(cpu=10_000, mem=1_000, gpus=1, share=G, spec="T4")] * 5
    wl = workload(history, coverage=1.0)
    m = StrandingModel(wl, state.models, "resources")
    n = state.n
    w = m.scarcity(state.gpu_count[:n].astype(np.int64), state.cpu_cap[:n], state.mem_cap[:n],
                   state.model[:n], cap=10.0)
    typed = [i for i, models in enumerate(wl.models) if models is not None]
    assert w[typed[0]] == pytest.approx(8 / 2)
    assert w[1 - typed[0]] == pytest.approx(1.0)


def test_resources_measure_counts_gpus_behind_exhausted_cpu() -> None:
    state = ClusterState([node("a", 4, cpu=25_000)])
    m = StrandingModel(workload([WHOLE] * 4, coverage=1.0), state.models, "resources")
    free = np.array([[G, G, G, G]])
    model = state.model[:1]
    mem = np.array([10**6])
    # CPU for 2 pods of 10 cores: 2 of the 4 free GPUs are stranded
    assert m.rows(free, np.array([25_000]), mem, model)[0] == pytest.approx(2 * G)
    assert m.rows(free, np.array([40_000]), mem, model)[0] == pytest.approx(0.0)
    assert m.rows(free, np.array([5_000]), mem, model)[0] == pytest.approx(4 * G)


def test_history_keeps_every_shape_and_its_memory() -> None:
    history = [WHOLE] * 96 + [pod(cpu=1, mem=7, gpus=8, share=G)] * 3 + [pod(mem=5)]
    wl = workload(history)
    assert wl.size == 1  # FGD's typical shapes: the one that crosses 95 %
    assert wl.full is not None and wl.full.size == 3
    assert sorted(wl.full.mem.tolist()) == [5.0, 7.0, 1_000.0]
    assert wl.full.p.sum() == pytest.approx(1.0)
    assert workload(history, coverage=1.0).full is not None  # memory splits shapes there


def test_registered_and_needs_a_workload() -> None:
    pol = get_policy("strand")
    with pytest.raises(ValueError, match="target workload"):
        pol.prepare(ClusterState([node("a", 1)]), None)
    assert resolve("strand") == "strand"


def test_multi_container_pod_is_placed_through_the_slow_path() -> None:
    from sharegpu.core.request import ContainerRequest, Kind, PodRequest

    nodes = [node("a", 2), node("b", 2)]
    s = scheduler("strand", nodes, [WHOLE] * 10, order=[0, 1])
    fill_gpus(s, "a", [0])
    c0 = ContainerRequest(0, "main", gpu_mem=600, gpus=1)
    c1 = ContainerRequest(1, "side", gpu_mem=300, gpus=1)
    req = PodRequest("ns", "two", Kind.SHARED, (c0, c1), cpu_milli=1_000, mem_mib=1_000)
    d = s.schedule(req)
    # both containers fit on a's last free GPU, which keeps b whole for whole-GPU pods
    assert d is not None and d.node_name == "a"
    assert set(d.alloc.gpus) == {1}


def test_strand_in_gib_units_stays_decisive():
    # a cluster's state counts GiB, not milli-GPU: scores are scaled by one GPU, so the
    # hole-filling choice FGD makes in the simulator's units is made in GiB too
    from sharegpu.core.annotations import Allocation
    from sharegpu.core.placement import get_policy
    from sharegpu.core.placement.fragmentation import TargetWorkload
    from sharegpu.core.request import ContainerRequest, Kind, PodRequest
    from sharegpu.core.scheduler import Scheduler
    from sharegpu.core.state import ClusterState, NodeSpec

    def pod(name, gib):
        return PodRequest("default", name, Kind.SHARED, (ContainerRequest(0, "m", gpu_mem=gib),))

    wl = TargetWorkload.from_shapes([(0, 8, 1, "")] * 9 + [(0, 4, 1, "")])
    s = ClusterState([NodeSpec(n, [16, 16]) for n in "ab"])
    s.reserve(pod("hole", 12), "a", Allocation(mem={0: {0: 12}}))
    pol = get_policy("strand")
    pol.prepare(s, wl)
    d = Scheduler(s, pol).decide(pod("small", 4))
    assert d.node_name == "a" and d.alloc.mem == {0: {0: 4}}
    s.set_order([1, 0])  # b first in the order: the score, not the tie-break, decides
    assert Scheduler(s, pol).decide(pod("small", 4)).node_name == "a"
