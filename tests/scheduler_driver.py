"""A test driver that plays kube-scheduler against extender replicas over HTTP, and the checks
the end-to-end tests make on what ends up in the (fake) API server."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sharegpu.core.annotations import decode
from sharegpu.core.names import CORE_PER_GPU, MAX_PODS_PER_GPU
from sharegpu.core.nodes import spec_from_node
from sharegpu.core.request import Kind, parse_pod
from sharegpu.extender.events import REASON_BIND_FAILED, REASON_INVALID, REASON_UNSCHEDULABLE
from sharegpu_testing import kobjects

REASONS = {REASON_UNSCHEDULABLE, REASON_BIND_FAILED, REASON_INVALID}


def mixed_nodes(n: int, seed: int = 11) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    kinds = (["cgpu"] * 8 + ["core_mem"] * 4 + ["share"] * 2 + ["mps"] * 2 + ["default"] * 2
             + ["topology"] * 2)
    for i in range(n):
        mode = kinds[i % len(kinds)]
        if mode == "topology":
            gpus = [80] * 8
        elif mode == "default":
            gpus = [24] * 4
        else:
            gpus = rng.choice([[16] * 4, [32] * 2, [16, 16, 32, 32], [24] * 8, [16]])
        placement = rng.choice(["", "", "spread"]) if mode not in ("default", "topology") else ""
        out.append(kobjects.node(f"node-{i:03d}", gpus, mode, placement=placement,
                                 model=f"GPU-{gpus[0]}GB"))
    return out


def mixed_pods(n: int, seed: int = 12) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        name = f"job-{i:04d}"
        ns = rng.choice(["team-a", "team-b", "default"])
        if r < 0.5:
            p = kobjects.pod(name, namespace=ns, mem=rng.choice([1, 2, 3, 4, 6, 8]))
        elif r < 0.65:
            p = kobjects.pod(name, namespace=ns, mem=rng.choice([2, 4]),
                             core=rng.choice([10, 25, 50]))
        elif r < 0.73:
            p = kobjects.pod(name, namespace=ns, mem=rng.choice([8, 16]), gpu_count=2)
        elif r < 0.78:
            p = kobjects.pod(name, namespace=ns,
                             containers=[{"aliyun.com/gpu-mem": "2"},
                                         {"aliyun.com/gpu-mem": str(rng.choice([1, 5]))}])
        elif r < 0.87:
            p = kobjects.pod(name, namespace=ns, cards=rng.choice([1, 2]))
        elif r < 0.95:
            p = kobjects.pod(name, namespace=ns, topology=rng.choice([1, 2, 4]))
        else:  # can never fit: more memory than any GPU has
            p = kobjects.pod(name, namespace=ns, mem=200)
        out.append(p)
    return out


@dataclass
class Outcome:
    bound: dict[str, str] = field(default_factory=dict)  # pod key -> node
    unschedulable: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # gave up after retries
    bind_errors: int = 0
    retries_after_leader_loss: int = 0


class Driver:
    """filter → prioritize (when more than one node passed) → bind for each pod, ``workers`` pods in flight, sending to whichever
    replica reports ready (as a Service in front of the replicas would)."""

    def __init__(self, urls: Callable[[], Sequence[str]], node_names: list[str],
                 workers: int = 8, bind_retries: int = 20, seed: int = 5,
                 bound_in_api: Callable[[str, str], str | None] | None = None) -> None:
        self.urls = urls
        self.node_names = node_names
        self.workers = workers
        self.bind_retries = bind_retries
        self.rng = random.Random(seed)
        self.bound_in_api = bound_in_api
        self.out = Outcome()
        self.done = 0
        self._url = ""

    async def _ready_url(self, s: aiohttp.ClientSession) -> str:
        for _ in range(600):
            for u in self.urls():
                try:
                    async with s.get(f"{u}/readyz") as r:
                        if r.status == 200:
                            self._url = u
                            return u
                except aiohttp.ClientError:
                    pass
            await asyncio.sleep(0.05)
        raise TimeoutError("no extender replica became ready")

    async def _post(self, s: aiohttp.ClientSession, verb: str, body: Any) -> Any:
        for _ in range(100):
            url = self._url or await self._ready_url(s)
            try:
                async with s.post(f"{url}/{verb}", json=body) as r:
                    return await r.json()
            except (TimeoutError, aiohttp.ClientError):
                self._url = ""
                self.out.retries_after_leader_loss += 1
                await asyncio.sleep(0.05)
        raise TimeoutError(f"{verb}: no replica answered")

    async def schedule(self, s: aiohttp.ClientSession, pod: dict[str, Any]) -> None:
        m = pod["metadata"]
        key = f"{m['namespace']}/{m['name']}"
        last = ""
        for attempt in range(self.bind_retries):
            f = await self._post(s, "filter", {"Pod": pod, "NodeNames": self.node_names})
            if f.get("Error"):  # kube-scheduler backs off as after a failed bind
                last = f["Error"]
                await asyncio.sleep(min(0.01 * 2 ** attempt, 1.0))
                continue
            passed = f.get("NodeNames") or []
            if not passed:
                self.out.unschedulable.add(key)
                return
            if len(passed) == 1:  # kube-scheduler: one feasible node is used, unscored
                node = passed[0]
            else:
                pr = await self._post(s, "prioritize", {"Pod": pod, "NodeNames": passed})
                # kube-scheduler: extender score × weight plus its own scores; ties at
                # random; hosts left out of the answer score 0
                top = max((h["Score"] for h in pr), default=0)
                best = [h["Host"] for h in pr if h["Score"] == top] if top else passed
                node = self.rng.choice(best)
            b = await self._post(s, "bind", {"PodName": m["name"], "PodNamespace": m["namespace"],
                                             "PodUID": m["uid"], "Node": node})
            if not b.get("Error"):
                self.out.bound[key] = node
                return
            last = b["Error"]
            self.out.bind_errors += 1
            # kube-scheduler's informer: a pod bound after all (a lost answer) is not retried
            node_now = self.bound_in_api(m["namespace"], m["name"]) if self.bound_in_api else None
            if node_now:
                self.out.bound[key] = node_now
                return
            # kube-scheduler backs off (1 s, doubling up to 10 s) and retries without end;
            # shorter here, but growing the same way
            await asyncio.sleep(min(0.01 * 2 ** attempt, 1.0))
        self.out.failed[key] = last

    async def run(self, pods: list[dict[str, Any]],
                  on_progress: Callable[[int], Any] | None = None) -> Outcome:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for p in pods:
            queue.put_nowait(p)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as s:

            async def worker() -> None:
                while not queue.empty():
                    p = queue.get_nowait()
                    await self.schedule(s, p)
                    self.done += 1
                    if on_progress is not None:
                        r = on_progress(self.done)
                        if asyncio.iscoroutine(r):
                            await r

            await asyncio.gather(*(worker() for _ in range(self.workers)))
        return self.out


def over_commits(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[str]:
    """Every rule a bound pod's annotations break, computed from the API objects alone."""
    specs = {s.name: s for s in (spec_from_node(n) for n in nodes) if s is not None}
    mem: dict[tuple[str, int], int] = defaultdict(int)
    core: dict[tuple[str, int], int] = defaultdict(int)
    count: dict[tuple[str, int], int] = defaultdict(int)
    whole: dict[tuple[str, int], int] = defaultdict(int)
    kinds: dict[str, set[Kind]] = defaultdict(set)
    problems = []
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if not node or (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        alloc = decode(p["metadata"].get("annotations") or {})
        key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        if alloc is None:
            problems.append(f"{key}: bound to {node} without GPU annotations")
            continue
        req = parse_pod(p)
        kinds[node].add(req.kind)
        for c in req.containers:
            if len(alloc.mem.get(c.index, {})) != c.gpus:
                problems.append(f"{key}: container {c.index} got the wrong number of GPUs")
            if c.whole:
                for g in alloc.mem.get(c.index, {}):
                    whole[(node, g)] += 1
        for g, v in alloc.per_gpu_mem().items():
            mem[(node, g)] += v
        for g, v in alloc.per_gpu_core().items():
            core[(node, g)] += v
        for g in alloc.gpus:
            count[(node, g)] += 1
    for (node, g), v in mem.items():
        if g >= len(specs[node].gpu_mem) or v > specs[node].gpu_mem[g]:
            problems.append(f"{node} GPU {g}: {v} GiB allocated")
    for (node, g), v in core.items():
        if v > CORE_PER_GPU:
            problems.append(f"{node} GPU {g}: {v}% compute allocated")
    for (node, g), v in count.items():
        if v > MAX_PODS_PER_GPU or (whole[(node, g)] and v > 1):
            problems.append(f"{node} GPU {g}: {v} pods")
    for node, ks in kinds.items():
        if {Kind.SHARED, Kind.SHARED_CORE} <= ks:
            problems.append(f"{node}: memory-only and memory+compute pods together")
    return problems
