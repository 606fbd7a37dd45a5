"""Allocate throughput of the node agent over real gRPC on a unix socket.

A node of GPUs of two sizes in ``cgpu`` mode (in-memory API, fake NVML) holds N pending pods placed
like the scheduler would (single-container, multi-container and 2-GPU shared pods); a client
plays the kubelet and allocates every container, either all pods at once (``--concurrency``
pods in flight) or one after another. Reports containers/s, the latency spread, and checks that
every container got the GPUs and memory its pod's annotations record.

    .venv/bin/python bench/agent_allocate.py --pods 150 --concurrency 50
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time

import grpc

from sharegpu.agent.builder import build_agent
from sharegpu.agent.config import AgentConfig
from sharegpu.agent.kube import MemoryKube
from sharegpu.agent.nvml import FakeNvml
from sharegpu.agent.proto import api_pb2 as pb
from sharegpu.agent.proto import api_pb2_grpc as pb_grpc
from sharegpu.core import names
from sharegpu.core.annotations import Allocation, encode

NODE = "bench-node"


def place(n: int, sizes: list[int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    free = list(sizes)
    count = [0] * len(sizes)
    pods: list[dict] = []
    for _ in range(100 * n):
        if len(pods) == n:
            break
        shape = rng.choice(["single", "single", "multi", "multigpu"])
        k = 2 if shape == "multigpu" else 1
        per = [rng.randint(1, 2) for _ in range(rng.randint(2, 3) if shape == "multi" else 1)]
        trial, alloc = list(free), {}
        for c, m in enumerate(per):
            fits = [g for g in range(len(sizes)) if trial[g] >= m and count[g] < 20]
            if len(fits) < k:
                break
            gpus = rng.sample(fits, k)
            for g in gpus:
                trial[g] -= m
            alloc[c] = {g: m for g in gpus}
        else:
            free = trial
            for g in {g for gs in alloc.values() for g in gs}:
                count[g] += 1
            labels = {names.POD_LABEL_GPU_COUNT: "2"} if k == 2 else {}
            pods.append({
                "metadata": {"name": f"p{len(pods)}", "namespace": "bench",
                             "uid": f"u{len(pods)}", "labels": labels,
                             "annotations": encode(Allocation(mem=alloc),
                                                   assume_time_ns=rng.randint(0, 10**6))},
                "spec": {"nodeName": NODE, "containers": [
                    {"name": f"c{c}", "resources": {"limits": {names.RES_GPU_MEM: str(m * k)}}}
                    for c, m in enumerate(per)]},
                "status": {"phase": "Pending"},
            })
    return pods


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=150)
    ap.add_argument("--concurrency", type=int, default=50, help="pods in flight (1: serial)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--api-latency-ms", type=float, default=0.0,
                    help="added to each pod list, standing in for the API server round trip")
    args = ap.parse_args()

    sizes = [15] * 4 + [80] * 4  # 20 pods per GPU at most: up to 160 single-GPU pods
    d = tempfile.mkdtemp(prefix="sgb-")
    kube = MemoryKube()
    kube.add_node(NODE, {names.LABEL_SCHEDULE: "cgpu"})
    pods = place(args.pods, sizes, args.seed)
    for p in pods:
        kube.add_pod(p)
    kube.latency_s = args.api_latency_ms / 1000
    nvml = FakeNvml([("T4", 15)] * 4 + [("A100", 80)] * 4)
    agent = build_agent(AgentConfig(node_name=NODE, device_plugin_dir=f"{d}/dp",
                              state_dir=f"{d}/state", allocate_retries=0), nvml, kube)
    await agent.start()
    ch = grpc.aio.insecure_channel(f"unix://{d}/dp/sharegpu-gpu-mem.sock")
    stub = pb_grpc.DevicePluginStub(ch)
    pool: dict[int, list[str]] = {}
    for dev in agent.plugins[names.RES_GPU_MEM].devices:
        pool.setdefault(dev.gpu, []).append(dev.id)

    lat: list[float] = []
    bad = 0
    sem = asyncio.Semaphore(args.concurrency)

    async def start(pod: dict) -> None:
        nonlocal bad
        from sharegpu.core.annotations import decode

        alloc = decode(pod["metadata"]["annotations"])
        async with sem:
            for c in sorted(alloc.mem):
                ids = [pool[g].pop() for g, m in alloc.mem[c].items() for _ in range(m)]
                t = time.perf_counter()
                r = await stub.Allocate(pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]))
                lat.append(time.perf_counter() - t)
                env = r.container_responses[0].envs
                want = ",".join(agent.gpus[g].uuid for g in sorted(alloc.mem[c]))
                if env[names.ENV_VISIBLE_DEVICES] != want or env[names.ENV_MEM_CONTAINER] != str(
                        sum(alloc.mem[c].values())):
                    bad += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(start(p) for p in pods))
    wall = time.perf_counter() - t0
    await ch.close()
    await agent.stop()
    n = len(lat)
    q = statistics.quantiles(lat, n=100)
    print(f"pods={len(pods)} containers={n} concurrency={args.concurrency} "
          f"wall={wall:.2f}s rate={n / wall:.0f} containers/s "
          f"p50={q[49] * 1000:.1f}ms p99={q[98] * 1000:.1f}ms pod-lists={kube.lists} "
          f"mismatches={bad}")
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
