"""The real kube-scheduler through the extender's follower: every bind ends inside its patience.

    python bench/extender_follower_real.py --pods 500 --json out.json

One real control plane (``scripts/build-controlplane.sh``, started as the e2e tests start it),
the chart's two extender replicas (its arguments, certificate, ServiceAccount and Lease) behind
one URL (``realcluster.ServiceProxy`` playing the chart's Service) and the real kube-scheduler
with the chart's configuration (``httpTimeout`` 10 s) calling that URL. Two phases, each a burst
of ``--pods`` look-alike pods (one shape: ``--mem`` GiB of ``aliyun.com/gpu-mem``) on nodes of
their own: first on nodes without the promise to name pods (``sharegpu.io/pod-resources``: a
look-alike pod is bound only once the previous one on its node started, which stand-in kubelets
mark ``--start-delay`` s after the binding), then on nodes with it. In each phase the Service
sends every new connection to the **follower** until half the pods are bound (a Service whose
endpoints lag behind the leader's label), then to the leader only: for that first half every
filter and bind goes through the follower's forward.

Reported per phase, from the API objects, both replicas' /metrics and kube-scheduler's log:
pods bound (each once, to one node), over-commits (from the pods' annotations alone), binds the
extenders answered past kube-scheduler's ``httpTimeout`` (their request histograms), late
answers (past the extender's own deadline), unsettled Bindings, verbs forwarded, kube-scheduler's
``ForgetPod`` errors and extender timeouts in its log, wall time. Exit status 1 when a phase
breaks one of: every pod bound once, 0 over-commits, 0 binds past httpTimeout, 0 ForgetPod errors.
Leaves no process behind.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import queue
import re
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "tests", ROOT / "bench", ROOT / "testing"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import pytest  # noqa: E402
from lightkube import Client, KubeConfig  # noqa: E402
from lightkube.resources.coordination_v1 import Lease  # noqa: E402
from lightkube.resources.core_v1 import Node, Pod  # noqa: E402

from e2e.components import free_port  # noqa: E402
from e2e.controlplane import (  # noqa: E402
    APISERVER,
    CONTROLLER_MANAGER,
    SCHEDULER,
    ControlPlane,
    ControlPlaneError,
    build,
)
from e2e.realcluster import (  # noqa: E402
    ChartRbac,
    LocalExtender,
    PodWatch,
    ServiceProxy,
    StandInKubelets,
    gpu_node_object,
    gpu_pod,
    http_get,
    make_namespace,
    node_dicts,
    pod_dicts,
    render_chart,
    sa_client,
    scheduler_config_for,
    start_extender,
    wait_allowed,
    wait_for,
)
from scheduler_driver import over_commits  # noqa: E402
from sharegpu.core import names  # noqa: E402

RELEASE = "sharegpu"
DEAD = "http://127.0.0.1:9"  # a probe target that never answers: not an endpoint
WAIT_FAILED = pytest.fail.Exception


class DelayedKubelets(StandInKubelets):
    """Stand-in kubelets that start a bound pod ``delay`` s after they see it bound (one
    thread, in the order seen)."""

    def __init__(self, kubeconfig: Path, namespace: str, delay: float) -> None:
        super().__init__(kubeconfig, namespace)
        self.delay = delay
        self._due: queue.Queue[tuple[float, Mapping[str, Any]] | None] = queue.Queue()
        self._starter = threading.Thread(target=self._start_pods, name="kubelets", daemon=True)

    def start(self) -> DelayedKubelets:
        self._starter.start()
        super().start()
        return self

    def stop(self) -> None:
        self._due.put(None)
        self._starter.join(10)
        super().stop()

    def _see(self, pod: Mapping[str, Any]) -> None:
        if self.delay > 0 and (pod.get("spec") or {}).get("nodeName"):
            PodWatch._see(self, pod)  # recorded now, started later
            self._due.put((time.monotonic() + self.delay, pod))
            return
        super()._see(pod)

    def _start_pods(self) -> None:
        while (item := self._due.get()) is not None:
            due, pod = item
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                StandInKubelets._see(self, pod)
            except Exception as e:  # a failed mark: the extender waits, then retries
                print(f"stand-in kubelet: {e}", file=sys.stderr)


def histogram(url: str, name: str, labels: Mapping[str, str]) -> dict[str, float]:
    """The buckets (le -> cumulative count) of one histogram series on /metrics."""
    _, text = http_get(url + "/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "_bucket{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            le = re.search(r'le="([^"]+)"', head)
            if le:
                out[le.group(1)] = float(value)
    return out


def samples(url: str, name: str) -> dict[str, float]:
    """Every sample of ``name`` (label text -> value)."""
    _, text = http_get(url + "/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            out[head[len(name):]] = float(value)
    return out


def past(buckets: Mapping[str, float], seconds: float) -> float:
    """Observations above ``seconds`` (a bucket bound)."""
    return buckets.get("+Inf", 0.0) - buckets.get(f"{seconds:g}", buckets.get(f"{seconds}", 0.0))


def scheduler_log_counts(cp: ControlPlane, start: int) -> dict[str, int]:
    text = cp.log_path(SCHEDULER).read_bytes()[start:].decode(errors="replace")
    lines = text.splitlines()
    return {
        "forgetpod_errors": sum("ForgetPod" in ln or "forget pod" in ln.lower() for ln in lines),
        # kube-scheduler's HTTP client gave up on a call (its httpTimeout)
        "client_timeouts": sum("Client.Timeout exceeded" in ln for ln in lines),
        "bind_errors": sum("Failed to bind" in ln or "binding rejected" in ln for ln in lines),
    }


def phase(cp: ControlPlane, admin: Client, ns: str, label: str, a: argparse.Namespace,
          replicas: Mapping[str, LocalExtender], leader: str, proxy: ServiceProxy,
          naming: bool) -> dict[str, Any]:
    follower = next(i for i in replicas if i != leader)
    run = f"{label}-{uuid.uuid4().hex[:5]}"
    for i in range(a.nodes):
        obj = gpu_node_object(f"{run}-{i:03d}", "cgpu", [a.gpu_mem] * a.gpus, run)
        if naming:
            obj["metadata"]["annotations"][names.ANN_NODE_POD_RESOURCES] = "v1"
        admin.create(Node.from_dict(obj))
    # the Service's endpoints: the follower only, until half the pods are bound
    proxy.probes = {replicas[leader].url: DEAD, replicas[follower].url:
                    replicas[follower].metrics_url}
    wait_for("the proxy to send to the follower only",
             lambda: proxy.ready == [replicas[follower].url], timeout=30)
    counters = ("sharegpu_extender_late_answers_total", "sharegpu_extender_unsettled_binds_total",
                "sharegpu_extender_decisions_total")
    before = {i: {"bind": histogram(r.metrics_url, "sharegpu_extender_request_seconds",
                                    {"verb": "bind"}),
                  **{c: samples(r.metrics_url, c) for c in counters}}
              for i, r in replicas.items()}
    log_start = cp.log_path(SCHEDULER).stat().st_size
    watch = DelayedKubelets(cp.admin_kubeconfig, ns, a.start_delay).start()
    pods = [gpu_pod(f"{run}-p{i:04d}", run, mem=a.mem) for i in range(a.pods)]
    try:
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: admin.create(Pod.from_dict(p), namespace=ns), pods))
        created_s = time.monotonic() - t0
        def bound() -> int:
            return sum(1 for n in list(watch.bound) if n.startswith(run))

        wait_for("half the pods bound", lambda: bound() >= a.pods // 2, timeout=a.wait,
                 every=0.1)
        half_s = time.monotonic() - t0
        proxy.probes = {replicas[leader].url: replicas[leader].metrics_url,
                        replicas[follower].url: DEAD}
        wait_for("every pod bound", lambda: bound() >= a.pods, timeout=a.wait, every=0.5)
        took = time.monotonic() - t0
        time.sleep(2.0)  # late writes, if any, would show by now
    finally:
        watch.stop()
    names_ = {p["metadata"]["name"] for p in pods}
    pods_now = [p for p in pod_dicts(admin, ns) if p["metadata"]["name"] in names_]
    over = over_commits(node_dicts(admin, run), pods_now)
    twice = {n: sorted(v) for n, v in watch.nodes.items() if n in names_ and len(v) > 1}
    http_timeout = a.http_timeout
    past_http = {}
    late = {}
    unsettled = {}
    forwarded = {}
    answered = {}
    for i, r in replicas.items():
        now = histogram(r.metrics_url, "sharegpu_extender_request_seconds", {"verb": "bind"})
        diff = {k: v - before[i]["bind"].get(k, 0.0) for k, v in now.items()}
        past_http[i] = past(diff, http_timeout)
        since = {c: {k: v - before[i][c].get(k, 0.0)
                     for k, v in samples(r.metrics_url, c).items()} for c in counters}
        late[i] = sum(since["sharegpu_extender_late_answers_total"].values())
        unsettled[i] = {k: v for k, v in since["sharegpu_extender_unsettled_binds_total"].items()
                        if v}
        forwarded[i] = {k: v for k, v in since["sharegpu_extender_decisions_total"].items()
                        if "forwarded" in k and v}
        answered[i] = {k: v for k, v in since["sharegpu_extender_decisions_total"].items()
                       if 'verb="bind"' in k and v}
    logs = scheduler_log_counts(cp, log_start)
    return {
        "phase": label, "nodes_name_pods": naming, "pods": a.pods,
        "bound": sum(1 for p in pods_now if p["spec"].get("nodeName")),
        "bound_twice": len(twice), "over_commits": len(over),
        "binds_past_http_timeout": past_http, "late_answers_total": late,
        "unsettled_binds": unsettled, "forwarded": forwarded, "bind_answers": answered,
        "scheduler_log": logs, "created_s": round(created_s, 2),
        "half_bound_s": round(half_s, 2), "all_bound_s": round(took, 2),
        "pods_per_s": round(a.pods / took, 1),
        "follower": follower, "leader": leader,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pods", type=int, default=500, help="pods per phase (default 500)")
    p.add_argument("--nodes", type=int, default=16, help="nodes per phase (default 16)")
    p.add_argument("--gpus", type=int, default=4, help="GPUs per node")
    p.add_argument("--gpu-mem", type=int, default=16, help="GiB per GPU")
    p.add_argument("--mem", type=int, default=2, help="GiB of gpu-mem per pod (one shape)")
    p.add_argument("--start-delay", type=float, default=0.3,
                   help="seconds from a binding to the stand-in kubelet's start of the pod")
    p.add_argument("--http-timeout", type=float, default=10.0,
                   help="kube-scheduler's extender httpTimeout as the chart sets it (seconds)")
    p.add_argument("--wait", type=float, default=300.0, help="seconds allowed per wait")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    a = p.parse_args(argv)

    binary = build()
    cp = ControlPlane(binary, extra_args={
        CONTROLLER_MANAGER: ["--controllers=*,-node-lifecycle-controller"],
        APISERVER: ["--disable-admission-plugins=TaintNodesByCondition"]})
    meta = {"cpus": os.cpu_count(), "load_before": os.getloadavg(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    results: list[dict[str, Any]] = []
    replicas: dict[str, LocalExtender] = {}
    proxy: ServiceProxy | None = None
    rbac: ChartRbac | None = None
    try:
        cp.start()
        admin = Client(KubeConfig.from_file(cp.admin_kubeconfig))
        ns = make_namespace(admin, "sg-follower")
        docs = render_chart(RELEASE, ns)
        rbac = ChartRbac(admin, docs, RELEASE)
        sa = rbac.apply("extender")
        rbac.apply("scheduler")
        kubeconfig, ext = sa_client(cp, ns, sa)
        wait_allowed("the extender to list pods", lambda: list(ext.list(Pod, namespace="*")))

        def holder() -> str:
            lease = admin.get(Lease, "sharegpu-extender", namespace=ns)
            return str((lease.spec.holderIdentity if lease.spec else "") or "")

        for ident in ("sharegpu-extender-a", "sharegpu-extender-b"):
            replicas[ident] = start_extender(cp, docs, ident, kubeconfig, free_port())
            if len(replicas) == 1:
                wait_for("a leader", holder, timeout=30)
        leader = holder()
        wait_for("the leader serving the verbs", lambda: http_get(
            replicas[leader].metrics_url + "/servingz")[0] == 200, timeout=30)
        proxy = ServiceProxy([r.url for r in replicas.values()],
                             probes={r.url: r.metrics_url for r in replicas.values()})
        proxy.start()
        cfg = scheduler_config_for(cp, docs, RELEASE, ns, proxy.url)
        cp.restart_scheduler(config=cfg, extra_args=["--v=2"])
        for label, naming in (("unnamed", False), ("named", True)):
            r = phase(cp, admin, ns, label, a, replicas, leader, proxy, naming)
            results.append(r)
            print(json.dumps(r), file=sys.stderr)
            if a.json:
                a.json.write_text(json.dumps({"meta": meta, "runs": results}, indent=2) + "\n")
    except (ControlPlaneError, WAIT_FAILED) as e:
        print(f"extender_follower_real: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if proxy is not None:
            proxy.stop()
        for r in replicas.values():
            r.proc.stop()
        cp.stop()
    meta["load_after"] = os.getloadavg()
    if a.json:
        a.json.write_text(json.dumps({"meta": meta, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "runs": results}, indent=2) + "\n")
    bad = [r["phase"] for r in results
           if r["bound"] != r["pods"] or r["bound_twice"] or r["over_commits"]
           or any(r["binds_past_http_timeout"].values())
           or r["scheduler_log"]["forgetpod_errors"] or r["scheduler_log"]["client_timeouts"]]
    print(json.dumps({"meta": meta, "failed_phases": bad}), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
