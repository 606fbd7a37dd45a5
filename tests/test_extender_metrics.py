"""The per-GPU gauges written straight from the state parse as Prometheus text and say what the
state holds, for GPUs of different sizes, compute shares, and node names needing escapes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from sharegpu.core.request import parse_pod
from sharegpu.extender.metrics import Metrics
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_gpu_gauges_match_the_state() -> None:
    odd = 'odd"name\\x'  # not a valid node name, but the text format must survive it
    view = ClusterView()
    view.reset([kobjects.node("a", [16, 32], "core_mem"), kobjects.node(odd, [24], "cgpu"),
                kobjects.node("c", [80] * 3, "default")], [])
    for name, pod, node in (("p1", kobjects.pod("p1", mem=6, core=30), "a"),
                            ("p2", kobjects.pod("p2", mem=4), odd),
                            ("p3", kobjects.pod("p3", mem=5), odd),
                            ("p4", kobjects.pod("p4", cards=2), "c")):
        view.reserve(parse_pod(pod), node)
        view.bound(f"default/{name}")
    got = samples(Metrics(lambda: view).render().decode())

    def gpu(metric: str, node: str, g: int) -> float:
        return got[(metric, (("gpu", str(g)), ("node", node)))]

    st = view.state
    for node in ("a", odd, "c"):
        i = st.index[node]
        for g in range(int(st.gpu_count[i])):
            total, free = int(st.gpu_total[i, g]), int(st.gpu_free[i, g])
            assert gpu("sharegpu_gpu_memory_total", node, g) == total
            assert gpu("sharegpu_gpu_memory_allocated", node, g) == total - free
            assert gpu("sharegpu_gpu_core_total_percent", node, g) == 100
            assert gpu("sharegpu_gpu_core_allocated_percent", node, g) == 100 - int(
                st.core_free[i, g])
            assert gpu("sharegpu_gpu_pods", node, g) == int(st.gpu_pods[i, g])
        assert got[("sharegpu_node_gpu_memory_total", (("node", node),))] == int(
            st.gpu_total[i].sum())
    # what was placed shows: 6 GiB and 30 % on a, 9 GiB in two pods on the odd node, 2 cards
    assert sum(gpu("sharegpu_gpu_memory_allocated", "a", g) for g in (0, 1)) == 6
    assert sum(gpu("sharegpu_gpu_core_allocated_percent", "a", g) for g in (0, 1)) == 30
    assert got[("sharegpu_node_gpu_memory_allocated", (("node", odd),))] == 9
    assert gpu("sharegpu_gpu_pods", odd, 0) == 2
    assert got[("sharegpu_node_gpu_memory_allocated", (("node", "c"),))] == 160
    assert ("sharegpu_gpu_memory_total", (("gpu", "2"), ("node", "a"))) not in got
