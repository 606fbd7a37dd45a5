"""Throughput of the fake API server (sharegpu_testing.fakeapi) under a scheduler-like load.

Creates N pods through the API with W open pod watches, then binds and annotates every pod,
then lists all pods; prints requests per second for each phase and the list latency. One
asyncio client with C concurrent connections (httpx2, the HTTP library lightkube uses).

    .venv/bin/python bench/fakeapi_throughput.py [--pods 1000] [--watches 2] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx2 as httpx

import devpath  # noqa: F401  (testing/ on sys.path)
from sharegpu_testing import FakeApiServer


async def _drain_watch(url: str, seen: list[int], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=None) as c, c.stream("GET", url) as r:
        async for line in r.aiter_lines():
            if line:
                json.loads(line)
                seen[0] += 1
            if stop.is_set():
                return


async def run(pods: int, watches: int, concurrency: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with FakeApiServer(history_size=100_000) as api:
        base = f"{api.url}/api/v1/namespaces/default/pods"
        seen = [0]
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(_drain_watch(f"{api.url}/api/v1/pods?watch=1", seen, stop))
            for _ in range(watches)
        ]
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=30) as c:
            sem = asyncio.Semaphore(concurrency)

            async def call(method: str, url: str, body: object, ctype: str = "application/json"):
                async with sem:
                    r = await c.request(method, url, content=json.dumps(body).encode(),
                                        headers={"Content-Type": ctype})
                    assert r.status_code < 300, (r.status_code, r.text)

            async def phase(name: str, coros: list) -> None:
                t0 = time.perf_counter()
                await asyncio.gather(*coros)
                out[f"{name}_per_s"] = len(coros) / (time.perf_counter() - t0)

            spec = {"containers": [{"name": "c", "image": "i"}]}
            await phase("create", [
                call("POST", base, {"metadata": {"name": f"p{i}"}, "spec": spec})
                for i in range(pods)
            ])
            await phase("bind", [
                call("POST", f"{base}/p{i}/binding",
                     {"metadata": {"name": f"p{i}"}, "target": {"name": f"n{i % 50}"}})
                for i in range(pods)
            ])
            await phase("patch", [
                call("PATCH", f"{base}/p{i}", {"metadata": {"annotations": {"x": "1"}}},
                     "application/merge-patch+json")
                for i in range(pods)
            ])
            t0 = time.perf_counter()
            r = await c.get(f"{api.url}/api/v1/pods")
            out["list_all_ms"] = (time.perf_counter() - t0) * 1000
            assert len(r.json()["items"]) == pods
        deadline = time.monotonic() + 30
        while seen[0] < 3 * pods * watches and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        out["watch_events_seen"] = seen[0]
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument("--watches", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()
    res = asyncio.run(run(a.pods, a.watches, a.concurrency))
    for k, v in res.items():
        print(f"{k:20s} {v:10.1f}")


if __name__ == "__main__":
    main()
