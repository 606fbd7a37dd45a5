"""Prometheus metrics of the extender, served on ``/metrics``.

Per-GPU gauges are read from the cluster state at scrape time (a collector), so decisions pay
nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .. import names
from .view import ClusterView

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _GpuCollector(Collector):
    def __init__(self, view: Callable[[], ClusterView]) -> None:
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self.view().state
        labels = ["node", "gpu"]
        fams = {
            "mem_total": GaugeMetricFamily("sharegpu_gpu_memory_total",
                                           "GPU memory (GiB)", labels=labels),
            "mem_alloc": GaugeMetricFamily("sharegpu_gpu_memory_allocated",
                                           "GPU memory allocated to pods (GiB)", labels=labels),
            "core_total": GaugeMetricFamily("sharegpu_gpu_core_total_percent",
                                            "GPU compute (percent of the GPU)", labels=labels),
            "core_alloc": GaugeMetricFamily("sharegpu_gpu_core_allocated_percent",
                                            "GPU compute allocated to pods (percent of the GPU)",
                                            labels=labels),
            "pods": GaugeMetricFamily("sharegpu_gpu_pods", "pods on the GPU", labels=labels),
        }
        node_mem = GaugeMetricFamily("sharegpu_node_gpu_memory_allocated",
                                     "GPU memory allocated on the node (GiB)", labels=["node"])
        node_total = GaugeMetricFamily("sharegpu_node_gpu_memory_total",
                                       "GPU memory of the node (GiB)", labels=["node"])
        for name, i in st.index.items():
            g = int(st.gpu_count[i])
            tot = st.gpu_total[i, :g].tolist()
            free = st.gpu_free[i, :g].tolist()
            core = st.core_free[i, :g].tolist()
            pods = st.gpu_pods[i, :g].tolist()
            for j in range(g):
                lab = [name, str(j)]
                fams["mem_total"].add_metric(lab, tot[j])
                fams["mem_alloc"].add_metric(lab, tot[j] - free[j])
                fams["core_total"].add_metric(lab, names.CORE_PER_GPU)
                fams["core_alloc"].add_metric(lab, names.CORE_PER_GPU - core[j])
                fams["pods"].add_metric(lab, pods[j])
            node_mem.add_metric([name], sum(tot) - sum(free))
            node_total.add_metric([name], sum(tot))
        yield from fams.values()
        yield node_mem
        yield node_total


class Metrics:
    def __init__(self, view: Callable[[], ClusterView] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("sharegpu_extender_decisions", "answers given, by verb and result",
                                 ["verb", "result"], registry=r)
        self.latency = Histogram("sharegpu_extender_request_seconds",
                                 "time to answer a request, by verb", ["verb"],
                                 buckets=BUCKETS, registry=r)
        self.failures = Counter("sharegpu_extender_failures", "failures by verb and reason",
                                ["verb", "reason"], registry=r)
        self.leader = Gauge("sharegpu_extender_leader", "1 when this replica is the leader",
                            registry=r)
        self.drift = Counter("sharegpu_extender_state_drift",
                             "consistency checks that found the state differing from the "
                             "pod annotations", registry=r)
        self.drifted_pods = Gauge("sharegpu_extender_state_drift_pods",
                                  "pods that differed at the last consistency check", registry=r)
        self.relists = Counter("sharegpu_extender_relists",
                               "full relists (start, 410 Gone, repair)", ["resource"], registry=r)
        self.rebuild_seconds = Gauge("sharegpu_extender_rebuild_seconds",
                                     "time of the last rebuild from annotations", registry=r)
        self.events = Counter("sharegpu_extender_events", "Events posted, by reason", ["reason"],
                              registry=r)
        if view is not None:
            r.register(_GpuCollector(view))

    def render(self) -> bytes:
        return generate_latest(self.registry)
