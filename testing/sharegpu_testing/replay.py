"""An openb trace played through the scheduler extender over HTTP, against the fake API server,
as kube-scheduler would play it; and the same seed through the simulator, for comparison.

The cluster: one Node per trace node (each GPU ``1000`` GiB, so that the extender's GiB are the
simulator's milli-GPU; ``status.allocatable`` holds the node's CPU and memory), named so that
the extender's node order is the simulator's per-seed order (ties go to the same node). The
pods: the simulator's stream for the seed, one at a time. A GPU pod asks for its share as
``aliyun.com/gpu-mem`` (and ``gpu-count``) and for its CPU and memory, written in the ways
kube-scheduler counts alike (one container; a container plus pod overhead; a container plus a
larger init container; two containers, one a sidecar), and goes filter → (prioritize) → bind.
kube-scheduler's own filters run before the extender's: the driver sends only the nodes whose
free CPU and memory (allocatable minus the requests of the pods bound there) admit the pod, as
its NodeResourcesFit does. A pod without GPUs is placed by kube-scheduler, not by the
extender: the driver binds it where the simulator put it (its policy decided there too), and
waits until the extender's watch has seen it. Besides the trace, pods that must change nothing
are on the nodes from the start: pods without requests, finished pods with large requests, and
pods on a node without GPUs.

``hide_host=True`` leaves CPU and memory out of the objects the extender reads (kube-scheduler
still filters by them): what the extender saw before it tracked them, where kube-scheduler
kept pods off nodes without room but strand's scores could not see CPU or memory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from sharegpu.core import names
from sharegpu.core.state import NodeSpec
from sharegpu.extender.kube import KubeApi
from sharegpu.extender.replica import Replica
from sharegpu.sim.engine import RunResult, node_order, run_one, unallocated
from sharegpu.sim.trace import GPU_UNITS, TracePod
from sharegpu.sim.workload import stream, target_workload

from . import kobjects
from .fakeapi import FakeApiServer

NAMESPACE = "replay"


@dataclass
class Replay:
    placements: list[str | None]  # per pod of the stream: the trace node's name, or None
    unallocated_pct: float
    pods: int
    seconds: float


def simulate(nodes: Sequence[NodeSpec], pods: Sequence[TracePod], seed: int,
             policy: str = "default", workload: str = "default"
             ) -> tuple[RunResult, list[str | None]]:
    """``sharegpu simulate`` for one seed and policy, with each pod's node."""
    placements: list[str | None] = []
    result = run_one(nodes, pods, policy, seed, workload, target_workload(pods),
                     placements=placements)
    return result, placements


def node_names(nodes: Sequence[NodeSpec], seed: int) -> dict[str, str]:
    """Trace node name -> Node name; listed by name, the Nodes come in the seed's order."""
    rank = node_order(len(nodes), seed)
    width = len(str(len(nodes)))
    return {n.name: f"r{int(rank[i]):0{width}d}-{n.name.lower()}" for i, n in enumerate(nodes)}


def node_object(spec: NodeSpec, name: str, hide_host: bool) -> dict[str, Any]:
    obj = kobjects.node(name, [GPU_UNITS] * len(spec.gpu_mem), "cgpu", model=spec.model)
    for part in ("capacity", "allocatable"):
        res = obj["status"][part]
        if hide_host:
            res.pop("cpu", None)
            res.pop("memory", None)
        else:
            res["cpu"] = f"{spec.cpu_milli}m"
            res["memory"] = f"{spec.mem_mib}Mi"
    return obj


def _res(cpu: int, mem: int) -> dict[str, Any]:
    return {"requests": {"cpu": f"{cpu}m", "memory": f"{mem}Mi"}}


def pod_object(i: int, tp: TracePod, hide_host: bool, node: str = "") -> dict[str, Any]:
    """The ``i``-th pod of the stream; its CPU and memory written one of four ways."""
    gpu: dict[str, Any] = {}
    labels: dict[str, str] = {}
    if tp.num_gpu:
        gpu[names.RES_GPU_MEM] = str(tp.gpu_milli * tp.num_gpu)
        if tp.num_gpu > 1:
            labels[names.POD_LABEL_GPU_COUNT] = str(tp.num_gpu)
    main: dict[str, Any] = {"name": "main", "image": "busybox",
                            "resources": {"limits": dict(gpu)} if gpu else {}}
    spec: dict[str, Any] = {"schedulerName": names.CO_SCHEDULER_NAME, "containers": [main]}
    cpu, mem = tp.cpu_milli, tp.mem_mib
    if not hide_host:
        way = i % 4 if cpu >= 2 and mem >= 2 else 0
        if way == 1:  # pod overhead
            main["resources"].update(_res(cpu - cpu // 4, mem - mem // 4))
            spec["overhead"] = {"cpu": f"{cpu // 4}m", "memory": f"{mem // 4}Mi"}
        elif way == 2:  # an init container asks for more than the app, for a while
            main["resources"].update(_res(cpu // 2, mem // 2))
            spec["initContainers"] = [{"name": "init", "image": "busybox",
                                       "resources": _res(cpu, mem)}]
        elif way == 3:  # a sidecar (restartable init container) beside the app
            main["resources"].update(_res(cpu - cpu // 2, mem - mem // 2))
            spec["initContainers"] = [{"name": "side", "image": "busybox",
                                       "restartPolicy": "Always",
                                       "resources": _res(cpu // 2, mem // 2)}]
        else:
            main["resources"].update(_res(cpu, mem))
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p{i:05d}", "namespace": NAMESPACE, "uid": f"uid-p{i:05d}",
                         "labels": labels, "annotations": {}},
            "spec": spec, "status": {"phase": "Running" if node else "Pending"}}


def bystanders(node_objs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pods that must not change any decision: no requests (BestEffort) on every 5th GPU node,
    finished pods asking for more than any node has on every 7th, and pods asking for CPU and
    memory on a node without GPUs."""
    out: list[dict[str, Any]] = []
    huge = {"requests": {"cpu": "100000", "memory": "100Ti"}}
    for j, n in enumerate(node_objs):
        name = n["metadata"]["name"]
        if j % 5 == 0:
            out.append(_plain(f"idle-{j}", name, {}, "Running"))
        if j % 7 == 0:
            out.append(_plain(f"done-{j}", name, huge, "Succeeded"))
    for j in range(20):
        out.append(_plain(f"cpu-{j}", "cpu-only-node", {"requests": {"cpu": "2",
                                                                     "memory": "4Gi"}},
                          "Running"))
    return out


def _plain(name: str, node: str, res: dict[str, Any], phase: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "other", "uid": f"uid-{name}"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox",
                                                        "resources": res}]},
            "status": {"phase": phase}}


async def replay(fake: FakeApiServer, nodes: Sequence[NodeSpec], pods: Sequence[TracePod],
                 seed: int, sim_placements: Sequence[str | None], *, policy: str = "default",
                 hide_host: bool = False, inflation: float = 1.3,
                 on_progress: Callable[[int], None] | None = None) -> Replay:
    """Play the seed's stream through an extender replica over HTTP (see the module)."""
    started = time.perf_counter()
    to_k8s = node_names(nodes, seed)
    from_k8s = {v: k for k, v in to_k8s.items()}
    node_objs = [node_object(n, to_k8s[n.name], hide_host) for n in nodes]
    cpu_node = kobjects.node("cpu-only-node", [], "cgpu")
    spaces = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
              for ns in (NAMESPACE, "other")]
    for obj in [*spaces, *node_objs, cpu_node, *bystanders(node_objs)]:
        fake.create(obj)
    capacity = sum(len(n.gpu_mem) for n in nodes)
    seq = stream(pods, capacity, seed, inflation)
    if len(sim_placements) != len(seq):
        raise ValueError("sim_placements must hold one entry per pod of the seed's stream")
    replica = Replica(KubeApi.from_url(fake.url), identity="replay", policy=policy,
                      elect=False, check_every=3600.0)
    replica.view.use_workload(target_workload(pods))  # the simulator's history
    await replica.start()
    try:
        url = f"http://127.0.0.1:{replica.port}"
        # what kube-scheduler's NodeResourcesFit sees free on each GPU node
        free = {to_k8s[n.name]: [n.cpu_milli or 0, n.mem_mib or 0] for n in nodes}
        order = sorted(free)
        out: list[str | None] = []
        arrived = np.zeros(len(seq))
        used = np.zeros(len(seq))
        total_arrived = total_used = 0
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await _ready(s, url)
            for i, tp in enumerate(seq):
                if tp.num_gpu:
                    fit = [n for n in order
                           if free[n][0] >= tp.cpu_milli and free[n][1] >= tp.mem_mib]
                    got = await _schedule(s, url, fake, pod_object(i, tp, hide_host),
                                          [*fit, "cpu-only-node"])
                else:  # kube-scheduler's own decision: where the simulator's policy put it
                    sim = sim_placements[i]
                    got = to_k8s[sim] if sim is not None else None
                    fake.create(pod_object(i, tp, hide_host, got or ""))
                    if got is not None:
                        await _caught_up(replica, fake)
                if got is not None:
                    free[got][0] -= tp.cpu_milli
                    free[got][1] -= tp.mem_mib
                node = from_k8s[got] if got is not None else None
                out.append(node)
                total_arrived += tp.gpu_demand
                if node is not None:
                    total_used += tp.gpu_demand
                arrived[i], used[i] = total_arrived, total_used
                if on_progress is not None and i % 256 == 0:
                    on_progress(i)
    finally:
        await replica.stop()
    pct, _curve = unallocated(arrived, used, capacity, "default", inflation)
    return Replay(out, round(pct, 4), len(seq), time.perf_counter() - started)


async def _ready(s: aiohttp.ClientSession, url: str) -> None:
    for _ in range(1200):
        try:
            async with s.get(f"{url}/readyz") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError("the extender did not become ready")


async def _caught_up(replica: Replica, fake: FakeApiServer) -> None:
    want = int(fake.resource_version)
    for _ in range(2000):
        if int(replica.informer.rv.get("/api/v1/pods") or 0) >= want:
            return
        await asyncio.sleep(0.002)
    raise TimeoutError("the extender's pod watch did not catch up")


async def _schedule(s: aiohttp.ClientSession, url: str, fake: FakeApiServer,
                    pod: dict[str, Any], node_names_: list[str]) -> str | None:
    """kube-scheduler's scheduling and binding cycles for one GPU pod: filter, prioritize
    when more than one node passed (the best total score), bind. The node, or None when no
    node passed."""
    stored = fake.create(pod)
    async with s.post(f"{url}/filter", json={"Pod": stored, "NodeNames": node_names_}) as r:
        f = await r.json()
    if f.get("Error"):
        raise RuntimeError(f"filter: {f['Error']}")
    passed = f.get("NodeNames") or []
    if not passed:
        return None
    if len(passed) == 1:  # kube-scheduler uses the one feasible node, unscored
        node = passed[0]
    else:
        async with s.post(f"{url}/prioritize", json={"Pod": stored, "NodeNames": passed}) as r:
            pr = await r.json()
        scores = {h["Host"]: h["Score"] for h in pr}
        # the extender's weight makes its 10 win over kube-scheduler's own scores
        node = max(passed, key=lambda n: scores.get(n, 0))
    m = stored["metadata"]
    async with s.post(f"{url}/bind", json={"PodName": m["name"], "PodNamespace": m["namespace"],
                                           "PodUID": m["uid"], "Node": node}) as r:
        b = await r.json()
    if b.get("Error"):
        raise RuntimeError(f"bind {m['name']} to {node}: {b['Error']}")
    return node


__all__ = ["Replay", "bystanders", "node_names", "pod_object", "replay", "simulate"]
