"""ClusterState.restore (the bulk rebuild) gives exactly what reserving the same placements one
by one gives: the same state, the same pods refused."""

from __future__ import annotations

import random

import pytest

from sharegpu.core.annotations import Allocation
from sharegpu.core.modes import Mode
from sharegpu.core.request import ContainerRequest, Kind, PodRequest
from sharegpu.core.state import ClusterState, NodeSpec, rebuild


def random_case(seed: int) -> tuple[list[NodeSpec], list[tuple[PodRequest, str, Allocation]]]:
    rng = random.Random(seed)
    nodes = []
    for i in range(6):
        mode = rng.choice([Mode.CGPU, Mode.CORE_MEM, Mode.EXCLUSIVE])
        nodes.append(NodeSpec(f"n{i}", [rng.choice([8, 16])] * rng.choice([1, 2, 4]), mode))
    placed = []
    for k in range(rng.randint(5, 60)):
        spec = rng.choice(nodes)
        g = len(spec.gpu_mem)
        r = rng.random()
        if r < 0.45:
            mem = rng.choice([1, 2, 4, 8])
            gpu = rng.randrange(g + (1 if rng.random() < 0.05 else 0))  # now and then no GPU
            req = PodRequest("ns", f"p{k}", Kind.SHARED, (ContainerRequest(0, gpu_mem=mem),))
            alloc = Allocation(mem={0: {gpu: mem}})
        elif r < 0.75:
            mem, core = rng.choice([2, 4]), rng.choice([25, 50])
            gpu = rng.randrange(g)
            req = PodRequest("ns", f"p{k}", Kind.SHARED_CORE,
                             (ContainerRequest(0, gpu_mem=mem, gpu_core=core),))
            alloc = Allocation(mem={0: {gpu: mem}}, core={0: {gpu: core}})
        else:
            n = rng.randint(1, g)
            gpus = rng.sample(range(g), n)
            req = PodRequest("ns", f"p{k}", Kind.EXCLUSIVE,
                             (ContainerRequest(0, gpus=n, whole=True),))
            alloc = Allocation(mem={0: dict.fromkeys(gpus, 1)})
        node = spec.name if rng.random() > 0.03 else "missing"
        placed.append((req, node, alloc))
    return nodes, placed


@pytest.mark.parametrize("seed", range(150))
def test_restore_equals_one_by_one(seed: int) -> None:
    nodes, placed = random_case(seed)
    one_by_one, problems = rebuild(nodes, placed)
    bulk = ClusterState(nodes)
    got = bulk.restore(placed)
    assert bulk.fingerprint() == one_by_one.fingerprint()
    assert sorted(k for k, _ in got) == sorted(k for k, _ in problems)
    assert {k: r.alloc for k, r in bulk.pods.items()} == {
        k: r.alloc for k, r in one_by_one.pods.items()}
    assert all(r.bound for r in bulk.pods.values())


def test_restore_keeps_what_is_held() -> None:
    nodes = [NodeSpec("a", [16, 16], Mode.CGPU)]
    s = ClusterState(nodes)
    first = PodRequest("ns", "x", Kind.SHARED, (ContainerRequest(0, gpu_mem=10),))
    s.reserve(first, "a", Allocation(mem={0: {0: 10}}))
    again = PodRequest("ns", "y", Kind.SHARED, (ContainerRequest(0, gpu_mem=10),))
    problems = s.restore([(again, "a", Allocation(mem={0: {0: 10}})),
                          (first, "a", Allocation(mem={0: {1: 10}}))])
    assert [k for k, _ in problems] == ["ns/x", "ns/y"]
    assert int(s.gpu_free[0, 0]) == 6 and int(s.gpu_free[0, 1]) == 16
