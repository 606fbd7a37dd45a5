"""Extender latency and throughput through HTTP, and the state rebuild from annotations.

    python bench/extender_latency.py --nodes 5000 --json

A server process runs the extender's HTTP service (the same ExtenderApp as ``sharegpu extender``)
over a ClusterView of ``--nodes`` nodes × 8 GPUs in mixed modes; its binder writes to an in-memory
API (so the figures are the extender's own cost, not an API server's). A driver plays kube-
scheduler: for each pod one filter, then one prioritize when more than one node passed (serially, as
kube-scheduler's scheduling cycle), then a bind in the background (up to ``--inflight`` binds at
once, as its binding cycles). Pods carry a resourceVersion as kube-scheduler's cache has them, so
bind uses the filter's copy (no read back). Latencies are measured at the driver, HTTP and JSON
included; the extender's own handler time per verb is read from its /metrics. The kubelet's part is
played too: ``--kubelet-ms`` after each binding the pod is marked assigned and the extender's view
sees it, as its watch would (the starting-pods rule waits for it).

``--burst N --kubelet-ms 200``: only N pods of one shape at once, kubelets admitting each pod
200 ms after its binding, bind failures placed again after 1 s: the time until all are bound,
side by side on nodes whose agents do not name pods (the starting-pods rule) and on nodes whose
agents name them through the kubelet's pod-resources API (``sharegpu.io/pod-resources``).

Side by side in one run:
- ``scheduler``: what kube-scheduler sends by default at this size: the nodes its own filters
  pass (the node advertises the pod's resource, i.e. the right mode), at most 10 % of the
  cluster (its adaptive percentageOfNodesToScore at 5,000 nodes), with nodeCacheCapable;
- ``scheduler, graded scores``: the same, the extender started with ``--graded-scores``
  (prioritize scores every feasible node, not only the policy's pick);
- ``all``: every node name in every request (percentageOfNodesToScore: 100, the worst case);
- the ``scheduler`` lists through the view and the binder in process, without HTTP.

With ``--other-pods N`` (default 100,000), the ``scheduler`` scenarios run a second time with
N pods without GPUs bound on the nodes besides (each asking for CPU and memory, as
kube-scheduler placed them) and GPU pods that ask for CPU and memory too: the extender then
counts every node's CPU and memory (strand's R term), and the figures stand beside today's.

Then: a ClusterView rebuilt from ``--rebuild-pods`` annotated pods (the start of a replica),
alone and with the N other pods; and what one watch event of a pod without GPUs costs the view.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import devpath  # noqa: F401  (testing/ on sys.path)
from sharegpu.core import names
from sharegpu.core.annotations import Allocation, encode
from sharegpu.core.modes import Mode
from sharegpu.core.placement.base import available, resolve
from sharegpu_testing import kobjects

MODES = [(Mode.CGPU, 0.45), (Mode.CORE_MEM, 0.2), (Mode.SHARE, 0.05), (Mode.MPS, 0.05),
         (Mode.EXCLUSIVE, 0.15), (Mode.TOPOLOGY, 0.10)]
SIZES = [16, 24, 32, 80]
KIND_MODES = {
    "mem": {Mode.CGPU, Mode.CORE_MEM, Mode.SHARE, Mode.MPS},
    "core": {Mode.CORE_MEM},
    "multi": {Mode.CGPU, Mode.CORE_MEM, Mode.SHARE, Mode.MPS},
    "cards": {Mode.EXCLUSIVE},
    "topology": {Mode.TOPOLOGY},
}


def cluster(n: int, seed: int = 1, naming: bool = False) -> list[dict[str, Any]]:
    """``n`` nodes of mixed modes and sizes; ``naming``: each agent names the pod of each
    kubelet call (``sharegpu.io/pod-resources``), so look-alike pods start together."""
    rng = random.Random(seed)
    modes = [m for m, _ in MODES]
    weights = [w for _, w in MODES]
    out = []
    for i in range(n):
        mode = rng.choices(modes, weights)[0]
        size = rng.choice(SIZES)
        node = kobjects.node(f"node-{i:05d}", [size] * 8, mode, model=f"GPU-{size}GB")
        if naming:
            node["metadata"].setdefault("annotations", {})[names.ANN_NODE_POD_RESOURCES] = "v1"
        out.append(node)
    return out


CPU_CHOICES = ["500m", "1", "2", "4", "8"]
MEMORY_CHOICES = ["1Gi", "4Gi", "8Gi", "16Gi", "32Gi"]


def template_host(kind: str, pod: dict[str, Any]) -> tuple[str, str]:
    """CPU and memory of a GPU pod made from a template: they follow its GPU request (a
    workload's deployment fixes all three), so there are as many shapes as GPU requests."""
    lim = pod["spec"]["containers"][0]["resources"]["limits"]
    if kind in ("cards", "topology"):
        k = int(lim.get(names.RES_NVIDIA_GPU) or lim.get(names.RES_TOPOLOGY_GPU))
        return str(6 * k), f"{24 * k}Gi"
    if kind == "core":
        return "2", "8Gi"
    if kind == "multi":
        return "4", "32Gi"
    m = int(lim[names.RES_GPU_MEM])
    return str(max(1, m // 4)), f"{4 * m}Gi"


def other_pods(nodes: list[dict[str, Any]], n: int, seed: int = 5) -> list[dict[str, Any]]:
    """``n`` running pods without GPUs, bound round robin over ``nodes``, asking for CPU and
    memory (a few templates, as deployments make them; ~20 per node at 5,000 nodes take about
    a quarter of a 64-core, 256 GiB node)."""
    rng = random.Random(seed)
    templates = [(rng.choice(["100m", "250m", "500m", "1"]), rng.choice(["128Mi", "512Mi",
                                                                       "1Gi", "2Gi"]))
                 for _ in range(50)]
    out = []
    for i in range(n):
        cpu, mem = templates[i % len(templates)]
        node = nodes[(i * 7919) % len(nodes)]["metadata"]["name"]
        p = kobjects.pod(f"other-{i:06d}", namespace="apps", containers=[{}], cpu=cpu,
                         memory=mem, node_name=node, uid=f"uid-other-{i}")
        p["spec"]["schedulerName"] = "default-scheduler"
        p["status"]["phase"] = "Running"
        out.append(p)
    return out


def pods(n: int, seed: int = 2, host: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(kind, pod) pairs of a mixed workload. ``host``: "" (no CPU or memory asked),
    "template" (CPU and memory follow the GPU request, :func:`template_host`) or "random"
    (each drawn on its own from 5 values: 25 host shapes for every GPU request)."""
    rng = random.Random(seed)
    hrng = random.Random(seed + 1)
    out = []
    for i in range(n):
        r = rng.random()
        name = f"pod-{i:06d}"
        kw: dict[str, Any] = {"uid": f"uid-{name}"}  # the same in the server and the driver
        if r < 0.45:
            out.append(("mem", kobjects.pod(name, mem=rng.choice([1, 2, 4, 8, 12]), **kw)))
        elif r < 0.65:
            out.append(("core", kobjects.pod(name, mem=rng.choice([2, 4, 8]),
                                             core=rng.choice([10, 25, 30, 50]), **kw)))
        elif r < 0.75:
            out.append(("multi", kobjects.pod(name, mem=rng.choice([8, 16, 32]), gpu_count=2,
                                              **kw)))
        elif r < 0.9:
            out.append(("cards", kobjects.pod(name, cards=rng.choice([1, 1, 2, 4]), **kw)))
        else:
            out.append(("topology", kobjects.pod(name, topology=rng.choice([1, 2, 4, 8]), **kw)))
        kind, pod = out[-1]
        if host:
            cpu, mem = (template_host(kind, pod) if host == "template" else
                        (hrng.choice(CPU_CHOICES), hrng.choice(MEMORY_CHOICES)))
            pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": cpu,
                                                                     "memory": mem}
        # as kube-scheduler's cache has it: the resourceVersion the in-memory API gives the
        # i-th pod it stores
        pod["metadata"]["resourceVersion"] = str(i + 1)
    return out


# -- server process -----------------------------------------------------------------------------
def play_kubelet(api: Any, view: Any, delay: float) -> None:
    """The kubelet's part after a binding, as the other harnesses play it: ``delay`` seconds
    after each binding the node's kubelet admits the pod and its agent marks it assigned, and
    the extender's watch shows it (the starting-pods rule waits for that,
    docs/architecture.md "Starting pods")."""
    from sharegpu.core.annotations import assigned_patch

    real = api.bind
    loop = asyncio.get_running_loop()

    def admitted(key: str) -> None:
        pod = api.pods.get(key)
        if pod is None:
            return
        pod["metadata"].setdefault("annotations", {}).update(assigned_patch())
        pod["metadata"]["resourceVersion"] = api._next_rv()
        view.upsert_pod(json.loads(json.dumps(pod)))

    async def bind(namespace: str, name: str, *a: Any, **kw: Any) -> Any:
        out = await real(namespace, name, *a, **kw)
        loop.call_later(delay, admitted, f"{namespace}/{name}")
        return out

    api.bind = bind


def web_policy() -> dict[str, Any]:
    """A ResourcePolicy selecting the pods labelled app=web in namespace default."""
    from sharegpu.core.resourcepolicy import API_VERSION

    return {"apiVersion": API_VERSION, "kind": "ResourcePolicy",
            "metadata": {"name": "web", "namespace": "default",
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"selector": {"app": "web"}, "units": [{"nodeSelector": {"pool": "a"}}]}}


def serve(n_nodes: int, n_pods: int, q: Any, graded: bool = False, others: int = 0,
          kubelet_s: float = 0.0, work: list[dict[str, Any]] | None = None,
          policy: bool = False, placement: str = "default", naming: bool = False) -> None:
    from sharegpu.extender.bind import Binder
    from sharegpu.extender.metrics import Metrics
    from sharegpu.extender.server import ExtenderApp
    from sharegpu.extender.view import ClusterView
    from sharegpu_testing.memapi import MemoryApi

    async def main() -> None:
        view = ClusterView(placement, graded=graded)
        nodes = cluster(n_nodes, naming=naming)
        view.reset(nodes, other_pods(nodes, others))
        api = MemoryApi(work if work is not None else
                        (p for _, p in pods(n_pods, host="template" if others else "")))
        play_kubelet(api, view, kubelet_s)
        metrics = Metrics(lambda: view)
        units = None
        if policy:
            from sharegpu.extender.resourcepolicies import ResourcePolicies

            units = ResourcePolicies()
            units.set_policies([web_policy()])
            units.reset(nodes, [])
            assert units.policies and not units.problems, units.problems
        app = ExtenderApp(view, Binder(api, lambda: view, units=units), metrics, units=units)
        q.put(await app.server().start("127.0.0.1", 0))
        await asyncio.Event().wait()

    asyncio.run(main())


# -- driver -------------------------------------------------------------------------------------
class Http:
    """A lean HTTP/1.1 keep-alive client on one connection: kube-scheduler's Go client costs
    microseconds per call, a general-purpose Python client (aiohttp) costs about as much as the
    extender's own handler, which would make the driver, not the extender, the measured part."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, ssl: Any = None, server_hostname: str | None = None) -> Http:
        """``ssl``: an ``ssl.SSLContext`` to speak TLS, verifying ``server_hostname``."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ssl,
                                                       server_hostname=server_hostname)
        return cls(reader, writer)

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nHost: extender\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        self.writer.write(head.encode() + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = 0
        for line in lines[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def candidate_lists(nodes: list[dict[str, Any]], work: list[tuple[str, dict[str, Any]]],
                    mode: str) -> Iterator[list[str]]:
    """The node names kube-scheduler sends with each pod: all of them (``all``), or a sample of
    the nodes its own filters pass (the node advertises the pod's resource), at most 10 % of
    the cluster (``scheduler``). Drawn as they are asked for, from one seeded generator."""
    all_names = [n["metadata"]["name"] for n in nodes]
    by_kind = {k: [n["metadata"]["name"] for n in nodes
                   if Mode(n["metadata"]["labels"][names.LABEL_SCHEDULE]) in m]
               for k, m in KIND_MODES.items()}
    sample = max(100, len(nodes) // 10)
    rng = random.Random(3)
    for kind, _pod in work:
        if mode == "all":
            yield all_names
        else:
            pool = by_kind[kind]
            yield rng.sample(pool, min(sample, len(pool)))


def plan(n_nodes: int, work: list[tuple[str, dict[str, Any]]], mode: str
         ) -> list[tuple[dict[str, Any], bytes, bytes]]:
    """For each pod: the pod, its JSON, and the filter request body. What kube-scheduler sends
    does not depend on the extender's answers up to here (its own filters pass the nodes that
    advertise the pod's resource), so it is prepared before the clock starts."""
    out = []
    for (_kind, pod), cand in zip(work, candidate_lists(cluster(n_nodes), work, mode),
                                  strict=True):
        pod_json = json.dumps(pod, separators=(",", ":")).encode()
        body = b'{"Pod":' + pod_json + b',"Nodes":null,"NodeNames":' + json.dumps(
            cand, separators=(",", ":")).encode() + b"}"
        out.append((pod, pod_json, body))
    return out


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) a process has used, from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def handler_seconds(metrics: bytes) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) per verb of the extender's own request histogram."""
    out: dict[str, list[float]] = {}
    for line in metrics.decode().splitlines():
        for part, i in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("sharegpu_extender_request_seconds" + part):
                verb = line.split('verb="')[1].split('"')[0]
                out.setdefault(verb, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
    return {v: (x[0], x[1]) for v, x in out.items()}


async def drive(port: int, n_nodes: int, work: list[tuple[str, dict[str, Any]]], mode: str,
                inflight: int, warmup: int = 0, server_pid: int | None = None) -> dict[str, Any]:
    bodies = plan(n_nodes, work, mode)
    rng = random.Random(3)
    lat: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": []}
    errors: dict[str, int] = {"filter": 0, "prioritize": 0, "bind": 0, "unschedulable": 0}
    main = await Http.open(port)
    idle = [await Http.open(port) for _ in range(inflight)]  # one connection per bind in flight
    free = asyncio.Semaphore(inflight)
    tasks: set[asyncio.Task[None]] = set()
    before: dict[str, tuple[float, float]] = {}

    async def server_time() -> dict[str, tuple[float, float]]:
        """(sum of seconds, count) per verb from the extender's own histogram."""
        _, body = await main.request("GET", "/metrics")
        return handler_seconds(body)

    async def post(conn: Http, verb: str, body: bytes) -> Any:
        t0 = time.perf_counter()
        _, raw = await conn.request("POST", f"/{verb}", body)
        out = json.loads(raw)
        lat[verb].append(time.perf_counter() - t0)
        return out

    async def bind(pod: dict[str, Any], node: str) -> None:
        conn = idle.pop()
        try:
            m = pod["metadata"]
            out = await post(conn, "bind", json.dumps(
                {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"],
                 "Node": node}, separators=(",", ":")).encode())
            if out.get("Error"):
                errors["bind"] += 1
        finally:
            idle.append(conn)
            free.release()

    t_start = time.perf_counter()
    cpu_before = cpu_seconds(server_pid)
    for n, (pod, pod_json, filter_body) in enumerate(bodies):
        if n == warmup:  # measure from here: the policy's caches are warm
            if tasks:
                await asyncio.gather(*tasks)
            before = await server_time()
            cpu_before = cpu_seconds(server_pid)
            for xs in lat.values():
                xs.clear()
            errors.update(dict.fromkeys(errors, 0))
            t_start = time.perf_counter()
        f = await post(main, "filter", filter_body)
        if f.get("Error"):
            errors["filter"] += 1
            continue
        passed = f.get("NodeNames") or []
        if not passed:
            errors["unschedulable"] += 1
            continue
        if len(passed) == 1:  # kube-scheduler uses the one feasible node, unscored
            node = passed[0]
        else:
            pr = await post(main, "prioritize", b'{"Pod":' + pod_json
                            + b',"Nodes":null,"NodeNames":'
                            + json.dumps(passed, separators=(",", ":")).encode() + b"}")
            if isinstance(pr, dict):
                errors["prioritize"] += 1
                continue
            top = max((h["Score"] for h in pr), default=0)
            node = rng.choice([h["Host"] for h in pr if h["Score"] == top] if top else passed)
        await free.acquire()
        t = asyncio.create_task(bind(pod, node))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t_start
    cpu_after = cpu_seconds(server_pid)
    after = await server_time()
    for conn in [main, *idle]:
        await conn.close()
    server_ms = {
        v: round(1000 * (after[v][0] - before.get(v, (0.0, 0.0))[0])
                 / max(after[v][1] - before.get(v, (0.0, 0.0))[1], 1), 3)
        for v in lat if v in after
    }

    def pct(xs: list[float], q: float) -> float:
        return round(float(np.percentile(np.array(xs) * 1000, q)), 3) if xs else 0.0

    return {
        "candidates": mode,
        "warmup_pods": warmup,
        "pods": len(work) - warmup,
        "pods_per_s": round((len(work) - warmup) / wall, 1),
        "latency_ms": {v: {"p50": pct(x, 50), "p99": pct(x, 99), "n": len(x)}
                       for v, x in lat.items()},
        "server_mean_ms": server_ms,
        # the extender process's whole CPU time per pod (HTTP, event loop and scoring ahead
        # included), and the pods/s that would make it busy all the time
        "server_cpu_ms_per_pod": (
            round(1000 * (cpu_after - cpu_before) / (len(work) - warmup), 3)
            if cpu_after is not None and cpu_before is not None else None),
        "server_capacity_pods_per_s": (
            round((len(work) - warmup) / (cpu_after - cpu_before), 1)
            if cpu_after is not None and cpu_before is not None and cpu_after > cpu_before
            else None),
        "errors": errors,
    }


def direct(n_nodes: int, work: list[tuple[str, dict[str, Any]]], warmup: int,
           others: int = 0, label: str = "", placement: str = "default") -> dict[str, Any]:
    """The same pods through the view and the binder in one process, no HTTP: what the
    extender's own logic costs (the candidate lists of the ``scheduler`` scenario)."""
    from sharegpu.core.annotations import assigned_patch
    from sharegpu.extender.bind import Binder
    from sharegpu.extender.view import ClusterView
    from sharegpu.extender.wire import BindingArgs
    from sharegpu_testing.memapi import MemoryApi

    nodes = cluster(n_nodes)
    view = ClusterView(placement)
    one_call = hasattr(view, "pick")  # the extender's filter answers with one node
    view.reset(nodes, other_pods(nodes, others))
    api = MemoryApi(p for _, p in work)
    binder = Binder(api, lambda: view)
    lists = candidate_lists(nodes, work, "scheduler")
    lat: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": []}
    filter_cpu = [0.0]  # CPU seconds in filter (the process's own: robust to a busy machine)

    async def go() -> float:
        t_start = time.perf_counter()
        for n, (_kind, pod) in enumerate(work):
            if n == warmup:
                for xs in lat.values():
                    xs.clear()
                filter_cpu[0] = 0.0
                t_start = time.perf_counter()
            cand = next(lists)
            c0 = time.process_time()
            t0 = time.perf_counter()
            req = view.reader.request(pod)
            passed, _, _ = view.filter(req, cand)
            if passed and one_call:  # the server's filter answers with the held pick
                passed = [view.pick(req, passed, hold=True)]
            if passed:
                binder.hint(pod, req)
            t1 = time.perf_counter()
            filter_cpu[0] += time.process_time() - c0
            if not passed:
                continue
            if len(passed) == 1:
                node = passed[0]
            else:
                scores = view.prioritize(view.reader.request(pod), passed)
                node = max(scores, key=scores.__getitem__)
            t2 = time.perf_counter()
            m = pod["metadata"]
            await binder.bind(BindingArgs(m["name"], m["namespace"], m["uid"], node))
            t3 = time.perf_counter()
            admitted = api.pods[f"{m['namespace']}/{m['name']}"]  # the kubelet, at once
            admitted["metadata"].setdefault("annotations", {}).update(assigned_patch())
            view.upsert_pod(admitted)
            lat["filter"].append(t1 - t0)
            lat["prioritize"].append(t2 - t1)
            lat["bind"].append(t3 - t2)
        return time.perf_counter() - t_start

    wall = asyncio.run(go())

    def pct(xs: list[float], q: float) -> float:
        return round(float(np.percentile(np.array(xs) * 1000, q)), 3) if xs else 0.0

    label = "scheduler, in process (no HTTP)" + label
    return {"candidates": label, "policy": f"{placement} ({resolve(placement)})",
            "warmup_pods": warmup,
            "pods": len(work) - warmup,
            "pods_per_s": round((len(work) - warmup) / wall, 1),
            "filter_cpu_ms_per_pod": round(1000 * filter_cpu[0] / max(len(work) - warmup, 1),
                                           3),
            "latency_ms": {v: {"p50": pct(x, 50), "p99": pct(x, 99), "n": len(x)}
                           for v, x in lat.items()}}


async def drive_burst(port: int, work: list[dict[str, Any]], names_: list[str],
                      inflight: int) -> dict[str, Any]:
    """kube-scheduler's loop over a backlog of pods: filter (and prioritize when more than one
    node passed), then the bind in the background; a pod whose bind fails is placed again
    after kube-scheduler's first back-off (1 s). Until every pod is bound."""
    rng = random.Random(3)
    main = await Http.open(port)
    idle = [await Http.open(port) for _ in range(inflight)]
    free = asyncio.Semaphore(inflight)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for pod in work:
        queue.put_nowait(pod)
    bound: set[str] = set()
    errors: list[str] = []
    calls = {"filter": 0, "prioritize": 0, "bind": 0}
    names_json = json.dumps(names_, separators=(",", ":")).encode()
    done = asyncio.Event()
    tasks: set[asyncio.Future[None]] = set()

    def spawn(coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def post(conn: Http, verb: str, body: bytes) -> Any:
        calls[verb] += 1
        _, raw = await conn.request("POST", f"/{verb}", body)
        return json.loads(raw)

    async def back_later(pod: dict[str, Any]) -> None:
        await asyncio.sleep(1.0)
        queue.put_nowait(pod)

    async def bind(pod: dict[str, Any], node: str) -> None:
        conn = idle.pop()
        try:
            m = pod["metadata"]
            out = await post(conn, "bind", json.dumps(
                {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"],
                 "Node": node}, separators=(",", ":")).encode())
            if out.get("Error"):
                errors.append(out["Error"])
                spawn(back_later(pod))
            else:
                bound.add(m["name"])
                if len(bound) == len(work):
                    done.set()
        finally:
            idle.append(conn)
            free.release()

    async def schedule() -> None:
        while not done.is_set():
            try:
                pod = await asyncio.wait_for(queue.get(), 0.1)
            except TimeoutError:
                continue
            pod_json = json.dumps(pod, separators=(",", ":")).encode()
            f = await post(main, "filter", b'{"Pod":' + pod_json + b',"Nodes":null,"NodeNames":'
                           + names_json + b"}")
            passed = f.get("NodeNames") or []
            if not passed:
                errors.append("unschedulable")
                spawn(back_later(pod))
                continue
            if len(passed) == 1:
                node = passed[0]
            else:
                pr = await post(main, "prioritize", b'{"Pod":' + pod_json
                                + b',"Nodes":null,"NodeNames":'
                                + json.dumps(passed, separators=(",", ":")).encode() + b"}")
                top = max(h["Score"] for h in pr)
                node = rng.choice([h["Host"] for h in pr if h["Score"] == top])
            await free.acquire()
            spawn(bind(pod, node))

    t0 = time.perf_counter()
    runner = asyncio.ensure_future(schedule())
    await done.wait()
    wall = time.perf_counter() - t0
    runner.cancel()
    for conn in [main, *idle]:
        await conn.close()
    return {"pods": len(work), "seconds_to_all_bound": round(wall, 2),
            "failed_binds": len(errors), "first_errors": errors[:3], "calls": calls}


def burst(n_nodes: int, n_pods: int, kubelet_s: float, inflight: int,
          mem: int = 4) -> list[dict[str, Any]]:
    """``n_pods`` pods of one shape (``mem`` GiB of one GPU) at once onto ``n_nodes`` nodes
    whose kubelets admit a pod ``kubelet_s`` seconds after its binding: the time until all are
    bound, side by side on nodes whose agents do not name pods (the starting-pods rule makes
    look-alike pods on one node bind one GPU's worth at a time, each waiting for the kubelet to
    admit the one before) and on nodes whose agents name them (the kubelet's pod-resources
    API: no wait)."""
    return [dict(burst_once(n_nodes, n_pods, kubelet_s, inflight, mem, naming),
                 agents_name_pods=naming) for naming in (False, True)]


def burst_once(n_nodes: int, n_pods: int, kubelet_s: float, inflight: int, mem: int,
               naming: bool) -> dict[str, Any]:
    work = [kobjects.pod(f"burst-{i:04d}", mem=mem, uid=f"uid-burst-{i}") for i in range(n_pods)]
    for i, pod in enumerate(work):
        pod["metadata"]["resourceVersion"] = str(i + 1)
    nodes = cluster(n_nodes)
    cand = [n["metadata"]["name"] for n in nodes
            if Mode(n["metadata"]["labels"][names.LABEL_SCHEDULE]) in KIND_MODES["mem"]]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=serve, args=(n_nodes, 0, q, False, 0, kubelet_s, work, False,
                                           "default", naming), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=600)
        out = asyncio.run(drive_burst(port, work, cand, inflight))
    finally:
        proc.terminate()
        proc.join()
    return {"nodes": n_nodes, "kubelet_admits_after_s": kubelet_s, "pod_gpu_mem_gib": mem,
            **out}


async def drive_plain(port: int, work: list[dict[str, Any]], names_: list[str],
                      server_pid: int | None) -> dict[str, Any]:
    """Pods without GPUs, one after the other: filter (with ``names_``) then bind; the
    extender's handler time per verb (its /metrics) and its CPU per pod."""
    conn = await Http.open(port)
    names_json = json.dumps(names_, separators=(",", ":")).encode()

    async def handler() -> dict[str, tuple[float, float]]:
        _, body = await conn.request("GET", "/metrics")
        return handler_seconds(body)

    warm = len(work) // 5
    errors = 0
    for n, pod in enumerate(work):
        if n == warm:
            before, cpu0, t0 = await handler(), cpu_seconds(server_pid), time.perf_counter()
        _, raw = await conn.request("POST", "/filter", b'{"Pod":' + json.dumps(
            pod, separators=(",", ":")).encode() + b',"Nodes":null,"NodeNames":' + names_json
            + b"}")
        passed = json.loads(raw).get("NodeNames") or []
        m = pod["metadata"]
        _, raw = await conn.request("POST", "/bind", json.dumps(
            {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"],
             "Node": passed[0] if passed else names_[0]}).encode())
        errors += bool(json.loads(raw).get("Error"))
    wall, cpu1, after = time.perf_counter() - t0, cpu_seconds(server_pid), await handler()
    await conn.close()
    k = len(work) - warm
    return {"pods": k, "names_per_filter": len(names_), "bind_errors": errors,
            "handler_ms": {v: round(1000 * (after[v][0] - before[v][0])
                                    / max(after[v][1] - before[v][1], 1), 3)
                           for v in ("filter", "bind") if v in after and v in before},
            "extender_cpu_ms_per_pod": (round(1000 * (cpu1 - cpu0) / k, 3)
                                        if cpu0 is not None and cpu1 is not None else None),
            "wall_ms_per_pod": round(1000 * wall / k, 3)}


def plain_pods(n_nodes: int, n_pods: int, policy: bool) -> dict[str, Any]:
    """What a pod without GPUs pays (kube-scheduler sends every pod to the extender when it
    lists no managedResources): ``n_pods`` pods labelled app=db, filtered with 10 %
    of the node names as kube-scheduler sends them, then bound; ``policy``: a ResourcePolicy
    (selecting app=web, not these pods) installed."""
    work = []
    for i in range(n_pods):
        p = kobjects.pod(f"plain-{i:05d}", containers=[{}], cpu="100m", memory="128Mi",
                         uid=f"uid-plain-{i}")
        p["metadata"]["labels"] = {"app": "db"}
        p["metadata"]["resourceVersion"] = str(i + 1)
        work.append(p)
    nodes = cluster(n_nodes)
    rng = random.Random(4)
    cand = rng.sample([n["metadata"]["name"] for n in nodes], max(100, n_nodes // 10))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=serve, args=(n_nodes, 0, q, False, 0, 0.0, work, policy),
                       daemon=True)
    proc.start()
    try:
        port = q.get(timeout=600)
        out = asyncio.run(drive_plain(port, work, cand, proc.pid))
    finally:
        proc.terminate()
        proc.join()
    return {"nodes": n_nodes, "resource_policy_installed": policy, **out}


def run_scenario(n_nodes: int, n_pods: int, mode: str, inflight: int,
                 warmup: int, graded: bool = False, others: int = 0,
                 kubelet_s: float = 0.0, placement: str = "default") -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=serve,
                       args=(n_nodes, n_pods + warmup, q, graded, others, kubelet_s),
                       kwargs={"placement": placement}, daemon=True)
    proc.start()
    try:
        port = q.get(timeout=600)
        work = pods(n_pods + warmup, host="template" if others else "")
        out = asyncio.run(drive(port, n_nodes, work, mode, inflight, warmup, proc.pid))
        out["policy"] = f"{placement} ({resolve(placement)})"
        if graded:
            out["candidates"] += ", graded scores"
        if others:
            out["candidates"] += f", +{others:,} non-GPU pods, GPU pods with CPU/memory (template)"
        return out
    finally:
        proc.terminate()
        proc.join()


# -- rebuild ------------------------------------------------------------------------------------
def annotated_pods(nodes: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` bound pods with annotations spread over the shared-mode nodes, each GPU filled with
    4 GiB pods (8 + 30 % compute on core_mem nodes) round robin; whole cards on the others."""
    shared = [x for x in nodes if x["metadata"]["labels"][names.LABEL_SCHEDULE]
              in ("cgpu", "core_mem", "share", "mps")]
    whole = [x for x in nodes if x not in shared]
    out = []
    slots = []  # (node, gpu, per-pod GiB, core)
    for x in shared:
        size = int(x["metadata"]["annotations"][names.ANN_NODE_GPU_MEM].split(",")[0])
        core = x["metadata"]["labels"][names.LABEL_SCHEDULE] == "core_mem"
        per, pct = (4, 20) if core else (2, 0)
        for g in range(8):
            for _ in range(min(size // per, 5 if core else 8)):
                slots.append((x, g, per, pct))
    for x in whole:
        size = int(x["metadata"]["annotations"][names.ANN_NODE_GPU_MEM].split(",")[0])
        for g in range(8):
            slots.append((x, g, size, -1))
    random.Random(4).shuffle(slots)
    if n > len(slots):
        raise SystemExit(f"--rebuild-pods {n}: the cluster holds at most {len(slots)}")
    for i, (x, g, per, pct) in enumerate(slots[:n]):
        node_name = x["metadata"]["name"]
        mode = x["metadata"]["labels"][names.LABEL_SCHEDULE]
        if pct < 0:
            key = "nvidia.com/gpu" if mode == "default" else "aliyun.com/gpu"
            p = kobjects.pod(f"r-{i:06d}", containers=[{key: "1"}], node_name=node_name)
            alloc = Allocation(mem={0: {g: per}}, core={0: {g: 100}})
        elif pct:
            p = kobjects.pod(f"r-{i:06d}", mem=per, core=pct, node_name=node_name)
            alloc = Allocation(mem={0: {g: per}}, core={0: {g: pct}})
        else:
            p = kobjects.pod(f"r-{i:06d}", mem=per, node_name=node_name)
            alloc = Allocation(mem={0: {g: per}})
        p["metadata"]["annotations"] = encode(alloc, assume_time_ns=1, gpu_capacity={g: per})
        p["status"]["phase"] = "Running"
        out.append(p)
    return out


def rebuild_time(n_nodes: int, n_pods: int, others: int = 0) -> dict[str, Any]:
    """A view rebuilt from ``n_pods`` annotated GPU pods and ``others`` pods without GPUs
    (the best of 3)."""
    from sharegpu.extender.view import ClusterView

    nodes = cluster(n_nodes)
    ps = annotated_pods(nodes, n_pods) + other_pods(nodes, others)
    best = float("inf")
    for _ in range(3):
        view = ClusterView("default")
        t0 = time.perf_counter()
        bad = view.reset(nodes, ps)
        best = min(best, time.perf_counter() - t0)
    return {"nodes": n_nodes, "pods": n_pods, "other_pods": others, "seconds": round(best, 3),
            "unapplied": bad, "held": len(view.state.pods), "host_ledger": len(view.host)}


def event_cost(n_nodes: int, n: int = 20_000) -> dict[str, float]:
    """Microseconds per watch event (added, then deleted) of a pod without GPUs, bound to a
    GPU node and to a node the view does not know (no GPUs), on a view of ``n_nodes``."""
    from sharegpu.extender.view import ClusterView

    nodes = cluster(n_nodes)
    view = ClusterView("default")
    view.reset(nodes, other_pods(nodes, 100_000))
    out: dict[str, float] = {}
    for label, target in (("gpu_node", nodes), ("node_without_gpus", [
            {"metadata": {"name": f"cpu-{i}"}} for i in range(100)])):
        ps = other_pods(target, n, seed=9)
        for p in ps:
            p["metadata"]["name"] += "-ev"
        t0 = time.perf_counter()
        for p in ps:
            view.upsert_pod(p)
        for p in ps:
            view.delete_pod(p)
        out[f"{label}_us"] = round(1e6 * (time.perf_counter() - t0) / (2 * n), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--pods", type=int, default=2000, help="pods driven per scenario")
    p.add_argument("--warmup", type=int, default=1000,
                   help="pods driven first and not measured (default 1000)")
    p.add_argument("--inflight", type=int, default=16, help="binds in flight at once")
    p.add_argument("--rebuild-pods", type=int, default=100_000)
    p.add_argument("--other-pods", type=int, default=100_000,
                   help="pods without GPUs on the nodes in the second run of the scheduler "
                        "scenarios and of the rebuild (0: skip that run)")
    p.add_argument("--candidates", choices=["all", "scheduler", "both"], default="both")
    p.add_argument("--no-graded", action="store_true",
                   help="skip the scenario with --graded-scores (scheduler lists)")
    p.add_argument("--kubelet-ms", type=float, default=0.0,
                   help="ms after each binding at which the node's kubelet admits the pod and "
                        "its agent marks it assigned (all scenarios; default 0: at once)")
    p.add_argument("--burst", type=int, default=0,
                   help="only the burst: this many pods of one shape at once, kubelets "
                        "admitting --kubelet-ms after each binding; time to all bound")
    p.add_argument("--policy", action="append", metavar="NAME",
                   help="placement policy of the extender (repeatable: every scenario runs "
                        "once per policy, side by side; default: default)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plain", type=int, default=0,
                   help="only pods without GPUs: this many, filtered and bound one by one, "
                        "without and with a ResourcePolicy installed")
    a = p.parse_args(argv)
    if a.plain:
        print(json.dumps([plain_pods(a.nodes, a.plain, policy) for policy in (False, True)],
                         indent=2))
        return 0
    if a.burst:
        out = burst(a.nodes, a.burst, a.kubelet_ms / 1000, a.inflight)
        print(json.dumps(out, indent=2))
        return 0
    if a.nodes < 1 or a.pods < 1 or a.warmup < 0:
        p.error("--nodes and --pods must be at least 1, --warmup at least 0")
    modes = ["scheduler", "all"] if a.candidates == "both" else [a.candidates]
    placements = a.policy or ["default"]
    unknown = [x for x in placements if resolve(x) not in available()]
    if unknown:
        p.error(f"--policy: unknown {', '.join(unknown)} (known: {', '.join(available())})")
    result: dict[str, Any] = {"nodes": a.nodes, "gpus_per_node": 8, "cpus": os.cpu_count(),
                              "policy": ", ".join(f"{x} ({resolve(x)})" for x in placements),
                              "scenarios": []}
    k = a.kubelet_ms / 1000
    for m in modes:
        for pol in placements:
            result["scenarios"].append(run_scenario(a.nodes, a.pods, m, a.inflight, a.warmup,
                                                    kubelet_s=k, placement=pol))
        if m == "scheduler" and a.other_pods:  # the same with CPU and memory counted
            for pol in placements:
                result["scenarios"].append(run_scenario(
                    a.nodes, a.pods, m, a.inflight, a.warmup, others=a.other_pods,
                    kubelet_s=k, placement=pol))
        if m == "scheduler" and not a.no_graded:  # the same with every node scored
            for pol in placements:
                result["scenarios"].append(run_scenario(
                    a.nodes, a.pods, m, a.inflight, a.warmup, graded=True, kubelet_s=k,
                    placement=pol))
    for pol in placements:
        result["scenarios"].append(direct(a.nodes, pods(a.pods + a.warmup), a.warmup,
                                          placement=pol))
    if a.other_pods:
        for host in ("template", "random"):
            for pol in placements:
                result["scenarios"].append(direct(
                    a.nodes, pods(a.pods + a.warmup, host=host), a.warmup, others=a.other_pods,
                    label=f", +{a.other_pods:,} non-GPU pods, GPU pods with CPU/memory ({host})",
                    placement=pol))
    if a.rebuild_pods:
        result["rebuild"] = [rebuild_time(a.nodes, a.rebuild_pods)]
        if a.other_pods:
            result["rebuild"].append(rebuild_time(a.nodes, a.rebuild_pods, a.other_pods))
    if a.other_pods:
        result["non_gpu_pod_event"] = event_cost(a.nodes)
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for s in result["scenarios"]:
            lat = s["latency_ms"]
            print(f"{s['candidates']} [{s['policy']}]: {s['pods_per_s']} pods/s; "
                  + "; ".join(f"{v} p50 {x['p50']} ms p99 {x['p99']} ms" for v, x in lat.items()))
        for r in result.get("rebuild", []):
            print(f"rebuild: {r['pods']} GPU pods + {r['other_pods']} others on {r['nodes']} "
                  f"nodes in {r['seconds']} s")
        if "non_gpu_pod_event" in result:
            print(f"watch event of a pod without GPUs: {result['non_gpu_pod_event']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
