"""The GPU choice's path for a pod on a share of one GPU (Python numbers) chooses exactly what
its general path (numpy, every pod shape) chooses: for every strategy, with and without a GPU
the policy prefers, on rows of free memory, compute and pods that hypothesis draws."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.core import gpuchoice, names
from sharegpu.core.modes import Mode
from sharegpu.core.request import ContainerRequest, Kind, PodRequest
from sharegpu.core.state import ClusterState, NodeSpec

GPU_MEM = 16


@st.composite
def cases(draw: st.DrawFn) -> tuple[ClusterState, PodRequest, str, dict | None]:
    g = draw(st.integers(0, 8))
    mode = draw(st.sampled_from([Mode.CGPU, Mode.CORE_MEM]))
    state = ClusterState([NodeSpec("n", [GPU_MEM] * g, mode)], max_pods_per_gpu=3)
    for i in range(g):  # what pods already hold
        state.gpu_free[0, i] = draw(st.integers(0, GPU_MEM))
        state.core_free[0, i] = draw(st.integers(0, names.CORE_PER_GPU))
        state.gpu_pods[0, i] = draw(st.integers(0, 3))
    core = draw(st.integers(0, 60)) if mode is Mode.CORE_MEM else 0
    c = ContainerRequest(0, "c", gpu_mem=draw(st.integers(1, GPU_MEM)), gpu_core=core)
    req = PodRequest("ns", "p", Kind.SHARED_CORE if core else Kind.SHARED, (c,))
    strategy = draw(st.sampled_from(["bestfit", "binpack", "spread", "topology", "firstfit"]))
    prefer = draw(st.none() | st.builds(lambda x: {0: (x,)}, st.integers(-1, 8)))
    return state, req, strategy, prefer


@settings(max_examples=400, deadline=None)
@given(cases())
def test_one_gpu_choice_is_the_general_choice(case: tuple) -> None:
    state, req, strategy, prefer = case
    fast = gpuchoice.assign(state, req, 0, strategy, prefer=prefer)
    saved = gpuchoice._ONE_GPU_ORDERS
    gpuchoice._ONE_GPU_ORDERS = {}  # the general path only
    try:
        general = gpuchoice.assign(state, req, 0, strategy, prefer=prefer)
    finally:
        gpuchoice._ONE_GPU_ORDERS = saved
    assert fast == general
