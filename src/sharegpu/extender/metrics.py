"""Prometheus metrics of the extender, served on ``/metrics``.

Per-GPU gauges are written from the cluster state at scrape time (:func:`gpu_exposition`), so
decisions pay nothing for them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ..core import names
from ..core.state import ClusterState
from .view import ClusterView

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 7.5,
           10.0)


# (name, help, value of each GPU from (total, free GiB, free compute %, pods))
_GPU_FAMILIES: tuple[tuple[str, str, Callable[..., np.ndarray]], ...] = (
    ("sharegpu_gpu_memory_total", "GPU memory (GiB)", lambda t, f, c, p: t),
    ("sharegpu_gpu_memory_allocated", "GPU memory allocated to pods (GiB)",
     lambda t, f, c, p: t - f),
    ("sharegpu_gpu_core_total_percent", "GPU compute (percent of the GPU)",
     lambda t, f, c, p: np.full_like(t, names.CORE_PER_GPU)),
    ("sharegpu_gpu_core_allocated_percent", "GPU compute allocated to pods (percent of the GPU)",
     lambda t, f, c, p: names.CORE_PER_GPU - c),
    ("sharegpu_gpu_pods", "pods on the GPU", lambda t, f, c, p: p),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def gpu_exposition(st: ClusterState) -> bytes:
    """The per-GPU and per-node gauges in Prometheus' text format, written directly from the
    state's arrays: 5,000 nodes × 8 GPUs are 200,000 samples, which prometheus_client's generic
    path takes seconds to write (the event loop is blocked meanwhile) and this takes tens of
    milliseconds."""
    node_names = list(st.index)
    rows = np.fromiter(st.index.values(), dtype=np.int64, count=len(node_names))
    count = st.gpu_count[rows].astype(np.int64)
    have = np.arange(st.width)[None, :] < count[:, None]
    cols = [a[rows][have] for a in (st.gpu_total, st.gpu_free, st.core_free, st.gpu_pods)]
    esc = [_label(n) for n in node_names]
    gpu_labels = [f'{{gpu="{j}",node="{e}"}} ' for e, g in zip(esc, count.tolist(), strict=True)
                  for j in range(g)]
    out: list[str] = []
    for name, text, value in _GPU_FAMILIES:
        out.append(f"# HELP {name} {text}\n# TYPE {name} gauge\n")
        out.extend([f"{name}{lab}{float(v)!r}\n"
                    for lab, v in zip(gpu_labels, value(*cols).tolist(), strict=True)])
    total = st.total_sum[rows]
    alloc = total - st.free_sum[rows]
    for name, text, values in (
        ("sharegpu_node_gpu_memory_allocated", "GPU memory allocated on the node (GiB)", alloc),
        ("sharegpu_node_gpu_memory_total", "GPU memory of the node (GiB)", total),
    ):
        out.append(f"# HELP {name} {text}\n# TYPE {name} gauge\n")
        out.extend([f'{name}{{node="{e}"}} {float(v)!r}\n'
                    for e, v in zip(esc, values.tolist(), strict=True)])
    return "".join(out).encode()


class _Counts(Collector):
    """A labelled counter kept as plain integers (a request pays a dict increment, not a
    lock and a child lookup) and written out at scrape time."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...]) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, n in sorted(self.counts.items()):
            fam.add_metric(list(values), n)
        yield fam


class _PickEnds:
    """Held picks given back without their bind, by reason (the view's own count)."""

    def __init__(self, view: Callable[[], ClusterView]) -> None:
        self.view = view

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("sharegpu_extender_picks_ended",
                                  "held picks given back without their bind, by reason "
                                  "(expired, refiltered, bind-refused, dropped, deleted, "
                                  "bound-elsewhere, ended)", labels=("reason",))
        for reason, n in sorted(self.view().holds.ended.items()):
            fam.add_metric([reason], n)
        yield fam


class Metrics:
    def __init__(self, view: Callable[[], ClusterView] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = _Counts("sharegpu_extender_decisions",
                                 "answers given, by verb and result", ("verb", "result"))
        r.register(self.decisions)
        self.latency = Histogram("sharegpu_extender_request_seconds",
                                 "time to answer a request, by verb", ["verb"],
                                 buckets=BUCKETS, registry=r)
        self.failures = _Counts("sharegpu_extender_failures", "failures by verb and reason",
                                ("verb", "reason"))
        r.register(self.failures)
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
        self.unannotated = Gauge("sharegpu_extender_unannotated_gpu_pods",
                                 "bound GPU pods without a scheduling decision, charged against "
                                 "every GPU of their node", registry=r)
        self.overcommitted = Gauge("sharegpu_extender_overcommitted_pods",
                                   "bound pods whose decisions over-commit their GPUs, counted "
                                   "as they say (those GPUs are overfull: nothing more is "
                                   "placed on them)", registry=r)
        self.held_picks = Gauge("sharegpu_extender_held_picks",
                                "picks filter answered with, held until their binds", registry=r)
        self.expired_picks = Gauge("sharegpu_extender_expired_picks",
                                   "picks given up without their binds since the start (the "
                                   "timeout passed)", registry=r)
        self.late = _Counts("sharegpu_extender_late_answers",
                            "answers given after their caller's deadline (counted from the "
                            "request's first byte), by verb", ("verb",))
        r.register(self.late)
        self.unsettled = _Counts("sharegpu_extender_unsettled_binds",
                                 "Bindings sent without a known outcome (their GPUs kept), "
                                 "then how they settled: kept, confirmed, released, deleted",
                                 ("outcome",))
        r.register(self.unsettled)
        if view is not None:
            r.register(_PickEnds(view))
            self.unannotated.set_function(lambda: len(view().unseen))
            self.overcommitted.set_function(lambda: len(view().overcommitted))
            self.held_picks.set_function(lambda: len(view().picks))
            self.expired_picks.set_function(lambda: view().picks.expired_total)
        self.view = view

    def decided(self, verb: str, result: str) -> None:
        """Count an answer (this runs on every request: a dict increment)."""
        self.decisions.counts[(verb, result)] += 1

    def failed(self, verb: str, reason: str) -> None:
        self.failures.counts[(verb, reason)] += 1

    def render(self) -> bytes:
        out = generate_latest(self.registry)
        if self.view is not None:
            out += gpu_exposition(self.view().state)
        return out
