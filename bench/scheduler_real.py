"""The real kube-scheduler with and without sharegpu's extender, side by side in one run.

    python bench/scheduler_real.py --nodes 1000,5000 --pods 1000 --rounds 2 --json out.json

What sharegpu costs a cluster's scheduling: one real control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler v1.37.2 from ``scripts/build-controlplane.sh``, started by
the e2e tests' ``ControlPlane``), ``--nodes`` kubelet-less GPU Nodes as the agent publishes them
(cgpu mode, ``--gpus`` × ``--gpu-mem`` GiB: ``aliyun.com/gpu-mem``, ``aliyun.com/gpu-count``,
the card labels, Ready, no taints), and per node count two arms, alternated over ``--rounds``
(ABBA...: with, without, without, with, ...):

- ``before`` (with ``--before-src DIR``): the same as ``with``, with the extender and the chart
  of another checkout (``git worktree add DIR main``), alternated with the others;
- ``with``: kube-scheduler run with exactly the chart's KubeSchedulerConfiguration (only the
  extender's ``urlPrefix`` changed; the chart's scheduler ServiceAccount as its client, the
  chart's ``--v``), calling ``sharegpu extender`` (the chart's arguments and ServiceAccount,
  leader election on the chart's Lease) for filter, prioritize and bind;
- ``without``: the same configuration less its ``extenders`` block (kube-scheduler then checks
  ``aliyun.com/gpu-mem`` as a plain extended resource and binds through its default binder), and
  no extender process.

Each arm: a fresh namespace; kube-scheduler stopped; ``--pods`` pods (``schedulerName:
ack-co-scheduler``, 1..8 GiB of ``aliyun.com/gpu-mem``, the same pods in both arms) created
Pending; then a fresh kube-scheduler started, so the whole backlog is in its queue at once and
its metrics start at zero (phase 1, backlog). Then ``--paced-pods`` more pods are created one by
one at ``--paced-rate`` pods/s while it runs (phase 2, paced: latency without a queue). Figures
come from kube-scheduler's own /metrics (scraped with the admin's client certificate; its
delegated authorization allows ``system:masters``), polled every ``--poll`` seconds:

- pods/s (backlog): the pods bound, from a watch on the namespace's pods, polled over time;
  their mean rate between the moments they reached 10 % and 90 % of the pods (interpolated
  between polls); an arm ends when every pod is bound (kube-scheduler's
  ``scheduler_schedule_attempts_total{result="scheduled"}`` is reported beside: a bind it
  counted failed that landed anyway would make the two differ);
- per pod: the extender's calls by verb (its own request histogram's counts), the pod writes
  kube-apiserver counted (its ``apiserver_request_total``: Binding POSTs, pod PATCHes less the
  stand-in kubelets' ``assigned`` marks, status writes), binds the extender refused by reason
  (``sharegpu_extender_failures_total``), and the pods whose decision was on them in the watch
  event that first showed them bound;
- attempt p50/p99/mean: ``scheduler_scheduling_attempt_duration_seconds{result="scheduled"}``,
  one pod from leaving the queue to bound (the scheduling cycle: filter, score, the extender's
  filter and prioritize; then the asynchronous binding cycle: the extender's bind or the default
  binder, behind kube-scheduler's client rate limiter). In the backlog phase binds queue up, so
  this is mostly waiting; the paced phase (histogram difference between two scrapes) shows a
  pod's own latency. Quantiles are interpolated in the buckets (powers of 2 from 1 ms to
  16.4 s) as Prometheus' ``histogram_quantile`` does; means are exact (sum / count);
- algorithm mean: ``scheduler_scheduling_algorithm_duration_seconds``, the serial part of a pod
  (its inverse bounds pods/s); split with
  ``scheduler_framework_extension_point_duration_seconds`` into kube-scheduler's own plugins
  (PreFilter, Filter, PreScore, Score) and the rest (the extender's filter and prioritize round
  trips); Bind: the default binder's mean (its rate-limiter wait included);
- failed attempts (``result="error"``/``"unschedulable"``): counted, not fatal (kube-scheduler
  tries the pod again, as in a cluster);
- CPU per pod, per process (from /proc, over the same 10 %..90 % window), and the machine's
  busy CPU over that window (other work on the machine shows as the difference); the
  extender's handler time per verb from its own /metrics.

The chart sets no ``clientConnection.qps``: kube-scheduler's defaults (50 requests/s, burst 100)
then cap its default binder, i.e. the ``without`` arm, at ~50 binds/s; the extender binds with
its own client. ``--client-qps`` raises the limit in both arms alike to show the scheduling
work itself.
Leaves no process behind (every process in its own group, killed at exit).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "tests", ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import pytest  # noqa: E402
from lightkube import ApiError, Client, KubeConfig  # noqa: E402
from lightkube.resources.core_v1 import Namespace, Node, Pod  # noqa: E402

import scheduler_metrics as sm  # noqa: E402
from e2e.components import SharegpuProcess  # noqa: E402
from e2e.controlplane import (  # noqa: E402
    APISERVER,
    CONTROLLER_MANAGER,
    ETCD,
    SCHEDULER,
    ControlPlane,
    ControlPlaneError,
    build,
    free_port,
)
from e2e.realcluster import (  # noqa: E402
    ChartRbac,
    PodWatch,
    StandInKubelets,
    gpu_node_object,
    gpu_pod,
    make_namespace,
    render_chart,
    sa_client,
    scheduler_config_for,
    start_extender,
    wait_allowed,
)
from sharegpu.core import names  # noqa: E402

RELEASE = "sharegpu"
RUN = "bench"  # the nodes' and pods' RUN_LABEL value
PROFILE = names.CO_SCHEDULER_NAME
ATTEMPTS = "scheduler_schedule_attempts_total"
ATTEMPT_S = "scheduler_scheduling_attempt_duration_seconds"
ALGORITHM_S = "scheduler_scheduling_algorithm_duration_seconds"
POINT_S = "scheduler_framework_extension_point_duration_seconds"
# kube-scheduler's own plugins inside the scheduling algorithm, each observed once per cycle
ALGORITHM_POINTS = ("PreFilter", "Filter", "PreScore", "Score")
EXTENDER_S = "sharegpu_extender_request_seconds"
ARMS = ("with", "without")
ALL_ARMS = ("with", "before", "without")  # before: --before-src's sharegpu


class BenchError(RuntimeError):
    """The benchmark could not run to the end (a component died, a wait ran out)."""


# ---------------------------------------------------------------------------------------------
# CPU accounting


def _ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15)


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait


def cpu_snapshot(pids: Mapping[str, int]) -> dict[str, int]:
    out = {name: t for name, pid in pids.items() if (t := _ticks(pid)) is not None}
    out["machine"] = _machine_busy_ticks()
    return out


# ---------------------------------------------------------------------------------------------
# the cluster


def chart_scheduler_verbosity(docs: Sequence[Mapping[str, Any]]) -> str:
    """The ``--v=`` the chart gives its kube-scheduler Deployment."""
    for d in docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-scheduler"):
            for a in d["spec"]["template"]["spec"]["containers"][0]["command"]:
                if a.startswith("--v="):
                    return a
    raise BenchError("the chart's scheduler Deployment has no --v")


def add_nodes(admin: Client, first: int, last: int, gpus: int, gpu_mem: int,
              workers: int, naming: bool = True) -> float:
    """Create nodes ``first``..``last - 1`` (cgpu, ``gpus`` × ``gpu_mem`` GiB; ``naming``: with
    the promise an agent on kubelet 1.34 or later publishes, ``sharegpu.io/pod-resources``);
    seconds taken."""
    def one(i: int) -> None:
        obj = gpu_node_object(f"gpu-{i:05d}", "cgpu", [gpu_mem] * gpus, RUN)
        if naming:
            obj["metadata"]["annotations"][names.ANN_NODE_POD_RESOURCES] = "v1"
        created = admin.create(Node.from_dict(obj))
        if created.spec is not None and created.spec.taints:
            raise BenchError(f"node {obj['metadata']['name']} was created with taints "
                             f"{created.spec.taints}")

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(first, last)))
    return time.monotonic() - t0


def pod_objects(n: int, seed: int, prefix: str) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [gpu_pod(f"{prefix}-{i:05d}", RUN, mem=rng.choice([1, 2, 4, 8])) for i in range(n)]


def create_pods(admin: Client, namespace: str, pods: Sequence[Mapping[str, Any]],
                workers: int) -> float:
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda p: admin.create(Pod.from_dict(dict(p)), namespace=namespace), pods))
    return time.monotonic() - t0


def create_paced(admin: Client, namespace: str, pods: Sequence[Mapping[str, Any]],
                 rate: float) -> None:
    """Create ``pods`` one by one, the i-th at i / ``rate`` seconds (late ones go at once)."""
    t0 = time.monotonic()
    for i, p in enumerate(pods):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        admin.create(Pod.from_dict(dict(p)), namespace=namespace)


def delete_namespace(admin: Client, namespace: str, timeout: float) -> None:
    """Force-delete the namespace's pods (no kubelet confirms a graceful deletion), wait until
    they are gone, then delete the namespace. A deletion whose answer times out (a loaded API
    server deleting a thousand pods) goes on server-side: asked again until none is left."""
    import httpx2

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx2.TimeoutException):
            admin.deletecollection(Pod, namespace=namespace, grace_period=0)
        if not any(True for _ in admin.list(Pod, namespace=namespace, chunk_size=500)):
            break
        if time.monotonic() > deadline:
            raise BenchError(f"pods of {namespace} still there after {timeout}s")
        time.sleep(0.5)
    with contextlib.suppress(ApiError):
        admin.delete(Namespace, namespace)


# ---------------------------------------------------------------------------------------------
# one arm


class Bench:
    def __init__(self, cp: ControlPlane, admin: Client, a: argparse.Namespace) -> None:
        self.cp, self.admin, self.a = cp, admin, a
        self.ns = make_namespace(admin, "sharegpu")  # the release's namespace
        values = {"placement.policy": a.policy} if a.policy else None
        self.docs = render_chart(RELEASE, self.ns, values)
        self.rbac = ChartRbac(admin, self.docs, RELEASE)
        ext_sa = self.rbac.apply("extender")
        self.rbac.apply("scheduler")
        self.ext_kubeconfig, ext = sa_client(cp, self.ns, ext_sa)
        wait_allowed("the extender to list pods", lambda: list(ext.list(Pod, namespace="*")))
        self.ext_port = free_port()
        self.sched_args = ["--leader-elect=true", chart_scheduler_verbosity(self.docs)]
        self.docs_before = (render_chart(RELEASE, self.ns, values,
                                         chart=Path(a.before_src) / "charts" / "sharegpu")
                            if a.before_src else [])

    def scheduler_config(self, arm: str) -> dict[str, Any]:
        """The chart's configuration (only urlPrefix changed; a fresh token for the chart's
        scheduler ServiceAccount); ``without``: less its ``extenders`` block."""
        cfg = scheduler_config_for(self.cp, self.docs_before if arm == "before" else self.docs,
                                   RELEASE, self.ns, f"https://127.0.0.1:{self.ext_port}")
        if arm == "without":
            del cfg["extenders"]
        if self.a.client_qps:  # both arms alike
            cfg["clientConnection"].update(qps=self.a.client_qps, burst=int(self.a.client_qps))
        return cfg

    def pids(self, extender: SharegpuProcess | None) -> dict[str, int]:
        out = {c: self.cp.components[c].proc.pid
               for c in (ETCD, APISERVER, CONTROLLER_MANAGER, SCHEDULER)}
        if extender is not None and extender.proc is not None:
            out["extender"] = extender.proc.pid
        out["bench"] = os.getpid()
        return out

    def run_arm(self, arm: str, n_nodes: int, n_pods: int, seed: int) -> dict[str, Any]:
        """Phase 1, backlog: ``n_pods`` Pending pods, then kube-scheduler started (pods/s).
        Phase 2, paced: ``--paced-pods`` more created at ``--paced-rate`` while it runs
        (latency without a queue)."""
        a, cp = self.a, self.cp
        cp.stop_scheduler()
        ns = make_namespace(self.admin, f"bench-{arm}")
        extender: SharegpuProcess | None = None
        metrics_url = ""
        # the pods bound, from a watch: the bench ends on them, not on kube-scheduler's counter;
        # with the extender, it also plays each node's kubelet and agent, marking bound pods
        # assigned, as in a cluster (the extender waits for that before binding a look-alike:
        # sharegpu.core.startingpods)
        watch: PodWatch = (StandInKubelets if arm != "without" else PodWatch)(
            cp.admin_kubeconfig, ns)
        try:
            if arm == "before":  # another copy of sharegpu (and of its chart)
                src = str(Path(a.before_src).resolve() / "src")
                local = start_extender(cp, self.docs_before, "sharegpu-extender-0",
                                       self.ext_kubeconfig, port=self.ext_port,
                                       env={"PYTHONPATH": src})
                extender, metrics_url = local.proc, local.metrics_url
            elif arm == "with":
                local = start_extender(cp, self.docs, "sharegpu-extender-0",
                                       self.ext_kubeconfig, port=self.ext_port)
                extender, metrics_url = local.proc, local.metrics_url
            watch.start()
            t_create = create_pods(self.admin, ns, pod_objects(n_pods, seed, "p"), a.workers)
            api_before = self._api_writes()
            cp.restart_scheduler(config=self.scheduler_config(arm), extra_args=self.sched_args)
            series, cpu = self._poll(n_pods, time.monotonic(), self.pids(extender), extender,
                                     watch)
            backlog_text = self._scrape_settled(n_pods)
            api_backlog = self._api_writes()
            paced_text = ""
            if a.paced_pods:
                paced = pod_objects(a.paced_pods, seed + 1000, "q")
                with cf.ThreadPoolExecutor(1) as pool:
                    created = pool.submit(create_paced, self.admin, ns, paced, a.paced_rate)
                    self._poll(n_pods + a.paced_pods, time.monotonic(), {}, extender, watch,
                               a.paced_pods / a.paced_rate)
                    created.result()
                paced_text = self._scrape_settled(n_pods + a.paced_pods)
            ext_text = ""
            if extender is not None:
                ext_text = _http_text(f"{metrics_url}/metrics")
            api_after = self._api_writes()
            assigned = len(getattr(watch, "started", ()))
        finally:
            cp.stop_scheduler()
            if extender is not None:
                extender.stop()
            watch.stop()
        delete_namespace(self.admin, ns, a.wait)
        out = summarize(arm, n_nodes, n_pods, series, cpu, backlog_text, paced_text, ext_text,
                        t_create, os.sysconf("SC_CLK_TCK"))
        placed = n_pods + a.paced_pods
        writes = {k: api_after[k] - api_before.get(k, 0.0) for k in api_after}
        out["api_writes_per_pod"] = {
            # kube-apiserver's own apiserver_request_total, over both phases; the stand-in
            # kubelets' assigned marks (one PATCH per pod, the agent's in a cluster) taken out
            "binding POST": round(writes["binding"] / placed, 3),
            "pod PATCH (less the kubelets' assigned marks)":
                round((writes["patch"] - assigned) / placed, 3),
            "pod status PATCH/PUT (kube-scheduler)": round(writes["status"] / placed, 3),
        }
        out["backlog_bindings"] = api_backlog["binding"] - api_before.get("binding", 0.0)
        out["pods_bound"] = len(watch.bound)
        # pods whose decision was on them in the watch event that first showed them bound
        out["annotated_when_bound"] = sum(watch.annotated_at_bind.values())
        out["load_after"] = [round(x, 2) for x in os.getloadavg()]
        out["scheduled_counter"] = sm.value(sm.parse(paced_text or backlog_text), ATTEMPTS,
                                            {"profile": PROFILE, "result": "scheduled"})
        return out

    def _api_writes(self) -> dict[str, float]:
        """kube-apiserver's count of pod writes so far (its apiserver_request_total)."""
        status, text = self.cp.request("GET", "/metrics", timeout=30)
        if status != 200:
            raise BenchError(f"kube-apiserver /metrics: HTTP {status}: {text[:300]}")
        samples = sm.parse(text)
        name = "apiserver_request_total"
        return {
            "binding": sm.value(samples, name, {"verb": "POST", "resource": "pods",
                                                "subresource": "binding"}),
            "patch": sm.value(samples, name, {"verb": "PATCH", "resource": "pods",
                                              "subresource": ""}),
            "status": sm.value(samples, name, {"verb": "PATCH", "resource": "pods",
                                               "subresource": "status"})
            + sm.value(samples, name, {"verb": "PUT", "resource": "pods",
                                       "subresource": "status"}),
        }

    def _scrape_settled(self, n_pods: int, wait_s: float = 10.0) -> str:
        """kube-scheduler's metrics once its scheduled count reached ``n_pods`` (the watch sees
        a binding a moment before kube-scheduler counts it), or after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            text = self._scrape()
            done = sm.counter_line(text, ATTEMPTS, {"profile": PROFILE, "result": "scheduled"})
            if (done or 0) >= n_pods or time.monotonic() > deadline:
                return text
            time.sleep(0.2)

    def _scrape(self) -> str:
        status, text = self.cp.component_get(SCHEDULER, "/metrics")
        if status != 200:
            raise BenchError(f"kube-scheduler /metrics: HTTP {status}: {text[:300]}")
        return text

    def _poll(self, n_pods: int, t0: float, pids: Mapping[str, int],
              extender: SharegpuProcess | None, watch: PodWatch, extra_s: float = 0.0,
              ) -> tuple[list[tuple[float, float]], list[tuple[float, float, dict[str, int]]]]:
        """Poll the pods bound (``watch``; CPU times beside) until ``n_pods`` are; kube-
        scheduler's metrics are polled too, to tell it is up."""
        a, cp = self.a, self.cp
        series: list[tuple[float, float]] = []
        cpu: list[tuple[float, float, dict[str, int]]] = []
        deadline = t0 + a.wait + n_pods / a.min_rate + extra_s
        done = 0.0
        while True:
            status, text = cp.component_get(SCHEDULER, "/metrics")
            t = time.monotonic() - t0
            snap = cpu_snapshot(pids)
            # A scheduler just started may answer 401/403 for a moment: its delegated
            # authentication loads the client CA after /healthz passes.
            if status == 200:
                done = float(len(watch.bound))
                series.append((t, done))
                cpu.append((t, done, snap))
                if done >= n_pods:
                    return series, cpu
            elif time.monotonic() > t0 + a.wait:
                raise BenchError(f"kube-scheduler /metrics: HTTP {status}: {text[:300]}")
            # Failed attempts (result "error" or "unschedulable") are counted, not fatal: the
            # pod goes back to kube-scheduler's queue and is tried again, as in a cluster.
            try:
                cp.check_alive()
            except ControlPlaneError as e:
                raise BenchError(str(e)) from e
            if extender is not None and not extender.alive():
                raise BenchError(f"sharegpu extender exited:\n{extender.log_tail(40)}")
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{done:.0f} of {n_pods} pods bound after {t:.0f}s "
                    f"(limit: --wait {a.wait:.0f}s + pods / --min-rate {a.min_rate:.0f});\n"
                    f"kube-scheduler:\n{cp.components[SCHEDULER].log_tail(20)}")
            time.sleep(a.poll)


def _http_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode(errors="replace")


def summarize(arm: str, n_nodes: int, n_pods: int, series: Sequence[tuple[float, float]],
              cpu: Sequence[tuple[float, float, Mapping[str, int]]], backlog_text: str,
              paced_text: str, ext_text: str, t_create: float, clk_tck: int, lo: float = 0.1,
              hi: float = 0.9) -> dict[str, Any]:
    """One arm's figures from the polled counter, the CPU snapshots and the scrapes at the end
    of each phase."""
    if series[0][1] >= lo * n_pods:
        raise BenchError(f"the first poll ({series[0][0]:.2f}s) already saw {series[0][1]:.0f} "
                         f"pods scheduled: the start of the window was missed")
    rate, t_lo, t_hi = sm.throughput(series, n_pods, lo, hi)
    samples = sm.parse(backlog_text)
    labels = {"profile": PROFILE, "result": "scheduled"}
    attempt = sm.histogram(samples, ATTEMPT_S, labels)
    algorithm = sm.histogram(samples, ALGORITHM_S)
    # CPU over the polls around the 10 %..90 % window
    i_lo = max(i for i, (t, _, _) in enumerate(cpu) if t <= t_lo)
    i_hi = min(i for i, (t, _, _) in enumerate(cpu) if t >= t_hi)
    (_, d_lo, c_lo), (_, d_hi, c_hi) = cpu[i_lo], cpu[i_hi]
    pods = max(d_hi - d_lo, 1.0)
    cpu_ms = {k: round(1000 * (c_hi[k] - c_lo[k]) / clk_tck / pods, 3) for k in c_hi if k in c_lo}
    ours = sum(v for k, v in cpu_ms.items() if k != "machine")
    out: dict[str, Any] = {
        "arm": arm, "nodes": n_nodes, "pods": n_pods,
        "pods_per_s": round(rate, 1),
        "window_s": [round(t_lo, 2), round(t_hi, 2)],
        "all_scheduled_s": round(series[-1][0], 2),
        "attempt_ms": _figures(attempt),
        "algorithm_ms": _figures(algorithm),
        "failed_attempts": {r: sm.value(samples, ATTEMPTS, {"profile": PROFILE, "result": r})
                            for r in ("error", "unschedulable")},
        "cpu_ms_per_pod": cpu_ms,
        "cpu_ms_per_pod_ours": round(ours, 3),
        "create_pods_s": round(t_create, 2),
        "polls": len(series),
    }
    out["where_ms"] = _where(samples, algorithm)
    if paced_text:
        later = sm.parse(paced_text)
        out["failed_attempts_with_paced"] = {
            r: sm.value(later, ATTEMPTS, {"profile": PROFILE, "result": r})
            for r in ("error", "unschedulable")}
        paced = sm.histogram(later, ATTEMPT_S, labels).minus(attempt)
        paced_algorithm = sm.histogram(later, ALGORITHM_S).minus(algorithm)
        out["paced"] = {"pods": round(paced.count), "attempt_ms": _figures(paced),
                        "algorithm_ms": _figures(paced_algorithm),
                        "where_ms": _where(later, paced_algorithm, samples)}
    if ext_text:
        ext = sm.parse(ext_text)
        out["extender_handler_ms"] = {
            verb: _ms(sm.histogram(ext, EXTENDER_S, {"verb": verb}).mean)
            for verb in ("filter", "prioritize", "bind")}
        # the extender's own counts, over both phases
        out["extender_calls"] = {
            verb: sm.histogram(ext, EXTENDER_S, {"verb": verb}).count
            for verb in ("filter", "prioritize", "bind")}
        out["bind_refusals"] = {
            s.labels["reason"]: s.value for s in ext
            if s.name == "sharegpu_extender_failures_total" and s.labels.get("verb") == "bind"}
    return out


def _where(samples: Sequence[sm.Sample], algorithm: sm.Histogram,
           earlier: Sequence[sm.Sample] | None = None) -> dict[str, float]:
    """Mean ms per scheduling cycle: kube-scheduler's own plugins by extension point (those in
    the algorithm, and Bind: the default binder, rate limiter included), and the rest of the
    algorithm (``algorithm - plugins``: the extenders' filter and prioritize calls, and the
    little the algorithm does around the plugins). ``earlier``: a scrape to subtract."""
    def mean(point: str) -> float:
        labels = {"extension_point": point, "profile": PROFILE}
        h = sm.histogram(samples, POINT_S, labels)
        if earlier is not None:
            h = h.minus(sm.histogram(earlier, POINT_S, labels))
        return 1000 * h.mean if h.count else 0.0

    out = {p: round(mean(p), 3) for p in (*ALGORITHM_POINTS, "Bind")}
    out["algorithm - plugins"] = round(
        1000 * algorithm.mean - sum(out[p] for p in ALGORITHM_POINTS), 3)
    return out


def _figures(h: sm.Histogram) -> dict[str, float]:
    return {"p50": _ms(h.quantile(0.5)), "p99": _ms(h.quantile(0.99)), "mean": _ms(h.mean)}


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


# ---------------------------------------------------------------------------------------------
# report


def _get(r: Mapping[str, Any], path: str) -> float:
    v: Any = r
    for key in path.split("."):
        v = v[key]
    return float(v)


# (column, path in a run's figures, format)
COLUMNS = (
    ("pods/s", "pods_per_s", ".1f"),
    ("backlog attempt p99 ms", "attempt_ms.p99", ".0f"),
    ("paced attempt p50 ms", "paced.attempt_ms.p50", ".1f"),
    ("paced attempt p99 ms", "paced.attempt_ms.p99", ".1f"),
    ("algorithm mean ms", "algorithm_ms.mean", ".2f"),
    ("our CPU ms/pod", "cpu_ms_per_pod_ours", ".2f"),
)


def table(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per node count: each arm's medians over the rounds and the ratios with / without."""
    out = []
    for n in sorted({r["nodes"] for r in results}):
        row: dict[str, Any] = {"nodes": n}
        for arm in ALL_ARMS:
            rows = [r for r in results if r["nodes"] == n and r["arm"] == arm]
            if not rows:
                continue
            row[arm] = {"runs": len(rows), "pods_per_s_each": [r["pods_per_s"] for r in rows]}
            for _, path, _ in COLUMNS:
                if all(path.split(".")[0] in r for r in rows) and rows:
                    row[arm][path] = statistics.median(_get(r, path) for r in rows)
        wo = row["without"]
        for arm in ("with", "before"):
            if arm in row:
                w = row[arm]
                row[f"ratio_{arm}_without"] = {
                    path: round(w[path] / wo[path], 2) if wo.get(path) and path in w else None
                    for _, path, _ in COLUMNS}
        out.append(row)
    return out


def print_report(results: Sequence[Mapping[str, Any]], summary: Sequence[Mapping[str, Any]],
                 out: Any = sys.stdout) -> None:
    print("\nper run (CPU ms per pod over the 10..90 % window; machine: all of the host's busy "
          "CPU):", file=out)
    for r in results:
        cpu = r["cpu_ms_per_pod"]
        paced = r.get("paced", {}).get("attempt_ms", {})
        print(f"{r['nodes']:>6} nodes, round {r['round']}, {r['arm']:<7}: "
              f"{r['pods_per_s']:6.1f} pods/s; backlog attempt p50/p99/mean "
              f"{r['attempt_ms']['p50']:.0f}/{r['attempt_ms']['p99']:.0f}/"
              f"{r['attempt_ms']['mean']:.0f} ms; paced attempt p50/p99/mean "
              f"{paced.get('p50', math.nan):.1f}/{paced.get('p99', math.nan):.1f}/"
              f"{paced.get('mean', math.nan):.1f} ms; algorithm mean "
              f"{r['algorithm_ms']['mean']:.2f} ms; failed attempts "
              f"{r.get('failed_attempts_with_paced', r['failed_attempts'])}", file=out)
        print("        CPU ms/pod: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()), file=out)
        print("        mean ms per cycle, backlog: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r["where_ms"].items()), file=out)
        if "paced" in r:
            print("        mean ms per cycle, paced: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["paced"]["where_ms"].items()), file=out)
        if "extender_handler_ms" in r:
            print("        extender handler mean ms: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["extender_handler_ms"].items()), file=out)
    print("\nmedians over the rounds, with / without (ratio):", file=out)
    print("| nodes | " + " | ".join(c for c, _, _ in COLUMNS) + " |", file=out)
    print("|---" * (len(COLUMNS) + 1) + "|", file=out)
    for row in summary:
        for arm in ("with", "before"):
            if arm not in row:
                continue
            w, wo, q = row[arm], row["without"], row[f"ratio_{arm}_without"]
            cells = []
            for _, path, fmt in COLUMNS:
                if path in w and path in wo:
                    cells.append(f"{w[path]:{fmt}} / {wo[path]:{fmt}} (×{q[path]})")
                else:
                    cells.append("—")
            print(f"| {row['nodes']:,} {arm} | " + " | ".join(cells) + " |", file=out)
    print("\nper run: extender calls, sharegpu's API writes per pod, bind refusals, pods bound "
          "against kube-scheduler's scheduled count:", file=out)
    for r in results:
        print(f"{r['nodes']:>6} nodes, round {r['round']}, {r['arm']:<7}: calls "
              f"{r.get('extender_calls', {})}; writes/pod {r['api_writes_per_pod']}; refused "
              f"binds {r.get('bind_refusals', {})}; bound {r['pods_bound']} / scheduled "
              f"{r['scheduled_counter']:.0f}", file=out)


# ---------------------------------------------------------------------------------------------


def _counts(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"counts must be at least 1: {text!r}")
    return out


# what the e2e code's wait_for raises when a step times out (pytest's test failure)
WAIT_FAILED: type[BaseException] = pytest.fail.Exception


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=_counts, default=[1000, 5000],
                   help="node counts, ascending, comma-separated (default 1000,5000)")
    p.add_argument("--pods", type=_counts, default=[1000],
                   help="pods per arm, one for all node counts or one per node count")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds per node count, each running both arms (order alternates)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    p.add_argument("--gpu-mem", type=int, default=32, help="GiB per GPU")
    p.add_argument("--poll", type=float, default=0.25, help="seconds between metric polls")
    p.add_argument("--wait", type=float, default=120.0,
                   help="seconds allowed for a step, besides pods / --min-rate when scheduling")
    p.add_argument("--min-rate", type=float, default=5.0,
                   help="give up on an arm scheduling slower than this (pods/s)")
    p.add_argument("--paced-pods", type=int, default=200,
                   help="pods created after the backlog, at --paced-rate, for latency (0: none)")
    p.add_argument("--paced-rate", type=float, default=20.0, help="pods/s of the paced phase")
    p.add_argument("--workers", type=int, default=8, help="threads creating nodes and pods")
    p.add_argument("--client-qps", type=float, default=0.0,
                   help="set kube-scheduler's clientConnection qps (and burst) in both arms; "
                        "default: the chart's configuration, i.e. kube-scheduler's defaults "
                        "(qps 50, burst 100)")
    p.add_argument("--policy", default="",
                   help="the chart's placement.policy for the extender (default: the chart's)")
    p.add_argument("--before-src", type=Path,
                   help="a checkout of another sharegpu (e.g. `git worktree add ../before "
                        "main`): a third arm, ``before``, runs its extender with its chart")
    p.add_argument("--no-pod-naming", action="store_true",
                   help="nodes without the promise to name pods (sharegpu.io/pod-resources) "
                        "that the chart's agents publish on kubelet 1.34 or later: look-alike "
                        "pods then start one placement at a time (the starting-pods rule)")
    p.add_argument("--json", type=Path, help="also write every figure to this file")
    a = p.parse_args(argv)
    if a.nodes != sorted(a.nodes):
        p.error("--nodes must be ascending (nodes are added, never removed)")
    if len(a.pods) not in (1, len(a.nodes)):
        p.error("--pods: one count, or one per node count")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    pods_for = dict(zip(a.nodes, a.pods * len(a.nodes) if len(a.pods) == 1 else a.pods,
                        strict=True))

    binary = build()
    # The Nodes have no kubelet: the node-lifecycle controller would taint them NotReady, and
    # TaintNodesByCondition would taint each new one until a kubelet reported Ready.
    cp = ControlPlane(binary, extra_args={
        CONTROLLER_MANAGER: ["--controllers=*,-node-lifecycle-controller"],
        APISERVER: ["--disable-admission-plugins=TaintNodesByCondition"]})
    results: list[dict[str, Any]] = []
    meta: dict[str, Any] = {"cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                            "load_before": os.getloadavg(),
                            "nodes_name_pods": not a.no_pod_naming}
    try:
        cp.start()
        print(f"control plane up in {cp.startup_seconds['total']:.1f}s ({cp.workdir})",
              file=sys.stderr)
        admin = Client(KubeConfig.from_file(cp.admin_kubeconfig))
        bench = Bench(cp, admin, a)
        have = 0
        for n in a.nodes:
            took = add_nodes(admin, have, n, a.gpus, a.gpu_mem, a.workers,
                             naming=not a.no_pod_naming)
            print(f"{n} nodes ({n - have} created in {took:.1f}s)", file=sys.stderr)
            have = n
            for rnd in range(a.rounds):
                arms = ALL_ARMS if a.before_src else ARMS
                for arm in (arms if rnd % 2 == 0 else arms[::-1]):
                    r = bench.run_arm(arm, n, pods_for[n], seed=rnd)
                    r["round"] = rnd
                    results.append(r)
                    if a.json:  # every run as it ends: a later failure keeps them
                        a.json.write_text(json.dumps({"meta": meta, "runs": results},
                                                     indent=2) + "\n")
                    print(f"  {n} nodes, round {rnd}, {arm:<7}: {r['pods_per_s']:.1f} pods/s, "
                          f"attempt p99 {r['attempt_ms']['p99']:.1f} ms, mean "
                          f"{r['attempt_ms']['mean']:.2f} ms, failed attempts "
                          f"{r.get('failed_attempts_with_paced', r['failed_attempts'])}, bound "
                          f"{r['pods_bound']}, scheduled {r['scheduled_counter']:.0f}",
                          file=sys.stderr)
        bench.rbac.delete()
    except (BenchError, ControlPlaneError, WAIT_FAILED) as e:
        # a step of the shared e2e code that timed out fails the way a test would
        print(f"scheduler_real: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        cp.stop()
    meta["load_after"] = os.getloadavg()
    summary = table(results)
    print_report(results, summary)
    if a.json:
        a.json.write_text(json.dumps({"meta": meta, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "summary": summary, "runs": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
