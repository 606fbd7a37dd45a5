"""Filter and bind are one decision: the core's feasibility (what the extender's filter answers)
holds exactly when the policy's GPU choice (what bind uses) finds GPUs, for every policy,
placement label, mode, and multi-container and multi-GPU shape — and exactly when an exhaustive
search finds an assignment at all."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import limits, pod
from sharegpu.core import names
from sharegpu.core.annotations import Allocation
from sharegpu.core.modes import Mode, Placement
from sharegpu.core.placement import available, get_policy
from sharegpu.core.placement.gpus import assign
from sharegpu.core.request import ContainerRequest, Kind, PodRequest, parse_pod
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.extender.view import default_workload

POLICIES = available()


def exists(state: ClusterState, req: PodRequest, node: int) -> bool:
    """Brute force: try every GPU set for every container."""
    g = int(state.gpu_count[node])
    free0 = [int(x) for x in state.gpu_free[node, :g]]
    total = [int(x) for x in state.gpu_total[node, :g]]
    core0 = [int(x) for x in state.core_free[node, :g]]
    pods0 = [int(x) for x in state.gpu_pods[node, :g]]
    choices = [list(itertools.combinations(range(g), c.gpus)) for c in req.containers]
    for pick in itertools.product(*choices):
        free, core, pods = list(free0), list(core0), list(pods0)
        touched: set[int] = set()
        ok = True
        for c, gpus in zip(req.containers, pick, strict=True):
            for x in gpus:
                if c.whole:
                    ok &= pods[x] == 0 and free[x] == total[x] and x not in touched
                    free[x] = 0
                    core[x] = 0
                else:
                    ok &= free[x] >= c.gpu_mem and core[x] >= c.gpu_core
                    ok &= x in touched or pods[x] < state.max_pods_per_gpu
                    free[x] -= c.gpu_mem
                    core[x] -= c.gpu_core
                if x not in touched:
                    pods[x] += 1
                    touched.add(x)
        if ok:
            return True
    return False


KINDS = {Mode.CGPU: Kind.SHARED, Mode.CORE_MEM: Kind.SHARED_CORE,
         Mode.EXCLUSIVE: Kind.EXCLUSIVE, Mode.TOPOLOGY: Kind.TOPOLOGY}


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    mode = draw(st.sampled_from(list(KINDS)))
    sizes = draw(st.lists(st.sampled_from([4, 8, 15, 16, 24, 32]), min_size=1, max_size=6))
    placement = draw(st.sampled_from([None, Placement.BINPACK, Placement.SPREAD]))
    spec = NodeSpec("n0", sizes, mode=mode, placement=placement)
    state = ClusterState([spec], max_pods_per_gpu=draw(st.sampled_from([2, 3, 20])))
    kind = KINDS[mode]
    whole = kind in (Kind.EXCLUSIVE, Kind.TOPOLOGY)
    # what is already there: pods of one container on one GPU each (or whole cards)
    for i in range(draw(st.integers(0, 8))):
        gpu = draw(st.integers(0, len(sizes) - 1))
        c = ContainerRequest(0, gpu_mem=draw(st.integers(1, 8)),
                             gpu_core=draw(st.sampled_from([5, 20, 45])) if
                             kind is Kind.SHARED_CORE else 0, whole=whole)
        existing = PodRequest("default", f"e{i}", kind, (c,))
        alloc = assign(state, existing, 0, "bestfit", prefer={0: (gpu,)})
        if alloc is not None:
            state.reserve(existing, "n0", alloc)
    # the new pod: 1-4 containers, some spanning several GPUs
    containers = []
    for j in range(draw(st.integers(1, 4))):
        containers.append(ContainerRequest(
            j, gpu_mem=0 if whole else draw(st.integers(1, 16)),
            gpu_core=draw(st.sampled_from([5, 30, 50, 100])) if kind is Kind.SHARED_CORE else 0,
            gpus=draw(st.integers(1, 3)), whole=whole))
    return state, PodRequest("default", "new", kind, tuple(containers))


def policy_for(name: str, state: ClusterState):  # type: ignore[no-untyped-def]
    """The policy as the extender prepares it before it has seen pods."""
    p = get_policy(name)
    p.prepare(state, default_workload(state))
    return p


@settings(max_examples=3000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_filter_passes_iff_select_finds_gpus(case):
    state, req = case
    feasible = bool(state.feasible(req)[0])
    assert feasible == exists(state, req, 0)
    assert (state.explain(req, 0) is None) == feasible
    for name in POLICIES:
        alloc = policy_for(name, state).select(state, req, 0)
        assert (alloc is not None) == feasible, name
        if alloc is not None:  # and what it picks is a placement the state accepts
            before = state.fingerprint()
            state.reserve(req, "n0", alloc)
            state.release(req.key)
            assert state.fingerprint() == before


def test_spread_node_two_containers_2_and_4_gib():
    """The reproducer: a spread node with 2 and 4 GiB free on two GPUs, a pod of two containers
    asking 2 and 4 GiB. Filter passed it and every bind failed with "no GPU choice fits"."""
    state = ClusterState([NodeSpec("n0", [8, 8], placement=Placement.SPREAD)])
    for name, gpu, mem in (("a", 0, 6), ("b", 1, 4)):
        r = parse_pod(pod(name, [limits(mem=mem)]))
        state.reserve(r, "n0", Allocation(mem={0: {gpu: mem}}))
    assert list(state.gpu_free[0, :2]) == [2, 4]
    req = parse_pod(pod("two", [limits("small", mem=2), limits("big", mem=4)]))
    assert state.feasible(req)[0]
    for name in POLICIES:
        alloc = policy_for(name, state).select(state, req, 0)
        assert alloc is not None, name
        assert alloc.mem == {0: {0: 2}, 1: {1: 4}}, name
    # spread's own first pick (the big free GPU for the first container) is kept when it fits
    roomy = ClusterState([NodeSpec("n0", [8, 8], placement=Placement.SPREAD)])
    alloc = get_policy("strand").select(roomy, req, 0)
    assert alloc is not None and len(alloc.per_gpu_mem()) == 2  # spread over both GPUs


def test_search_keeps_the_per_gpu_pod_limit():
    state = ClusterState([NodeSpec("n0", [16, 16])], max_pods_per_gpu=1)
    r = parse_pod(pod("a", [limits(mem=1)]))
    state.reserve(r, "n0", Allocation(mem={0: {0: 1}}))
    req = parse_pod(pod("two", [limits("x", mem=8), limits("y", mem=8)]))
    # only GPU 1 may take another pod, and it holds both containers (16 GiB)
    alloc = get_policy("bestfit").select(state, req, 0)
    assert alloc is not None and alloc.per_gpu_mem() == {1: 16}
    assert np.all(state.gpu_pods[0, :2] == [1, 0])
    assert names.MAX_PODS_PER_GPU == 20
