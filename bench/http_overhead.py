"""CPU per request of the extender's HTTP server against aiohttp's, side by side in one run.

    python bench/http_overhead.py --requests 10000

Each server runs in its own process with one trivial POST handler (it reads the body and
answers a small JSON object) and a GET handler that reports the process's CPU time; the lean
keep-alive client of ``extender_latency.py`` sends ``--requests`` POSTs of a 7 KB body (the
size of a filter request with 500 node names) one after the other. What is compared is the
server process's CPU time per request: parsing, dispatch, the answer and the kernel's share.
With ``--tls`` the extender's server is also measured over TLS (one kept-alive connection, as
kube-scheduler keeps its connections; a certificate made for the run by
``sharegpu_testing.tls``, which needs the ``cryptography`` package of the ``test`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from typing import Any

from extender_latency import Http

BODY = json.dumps({"Pod": {"metadata": {"name": "p"}},
                   "NodeNames": [f"node-{i:05d}" for i in range(500)]}).encode()


def serve_ours(q: Any, cert: tuple[str, str] | None = None) -> None:
    import ssl

    from sharegpu.extender.httpserver import HttpServer, Request, Response, text_response

    def post(req: Request) -> Response:
        return Response(200, b'{"ok":true}') if req.body else Response(400)

    ctx = None
    if cert is not None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(*cert)

    async def main() -> None:
        server = HttpServer({("POST", "/filter"): post,
                             ("GET", "/cpu"): lambda r: text_response(repr(time.process_time()))})
        q.put(await server.start("127.0.0.1", 0, ctx))
        await asyncio.Event().wait()

    asyncio.run(main())


def serve_aiohttp(q: Any) -> None:
    from aiohttp import web

    async def post(request: web.Request) -> web.Response:
        body = await request.read()
        return web.Response(body=b'{"ok":true}' if body else b"", content_type="application/json")

    async def cpu(request: web.Request) -> web.Response:
        return web.Response(text=repr(time.process_time()))

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/filter", post)
        app.router.add_get("/cpu", cpu)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        q.put(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        await asyncio.Event().wait()

    asyncio.run(main())


async def drive(port: int, n: int, client_tls: Any = None) -> dict[str, float]:
    c = await (Http.open(port, client_tls, "localhost") if client_tls else Http.open(port))
    for _ in range(3000):  # warm up
        await c.request("POST", "/filter", BODY)
    _, a = await c.request("GET", "/cpu")
    t0 = time.perf_counter()
    for _ in range(n):
        status, _ = await c.request("POST", "/filter", BODY)
        assert status == 200
    wall = time.perf_counter() - t0
    _, b = await c.request("GET", "/cpu")
    await c.close()
    return {"server_cpu_us_per_request": round(1e6 * (float(b) - float(a)) / n, 1),
            "wall_us_per_request": round(1e6 * wall / n, 1)}


def measure(target: Any, n: int, args: tuple[Any, ...] = (),
            client_tls: Any = None) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q, *args), daemon=True)
    proc.start()
    try:
        return asyncio.run(drive(q.get(timeout=60), n, client_tls))
    finally:
        proc.terminate()
        proc.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--tls", action="store_true",
                   help="also measure the extender's server over TLS (kept-alive connection)")
    a = p.parse_args(argv)
    if a.requests < 1:
        p.error("--requests must be at least 1")
    ours = measure(serve_ours, a.requests)
    theirs = measure(serve_aiohttp, a.requests)
    out = {"requests": a.requests, "body_bytes": len(BODY), "sharegpu_httpserver": ours,
           "aiohttp": theirs,
           "cpu_ratio_aiohttp_over_ours": round(theirs["server_cpu_us_per_request"]
                                                / ours["server_cpu_us_per_request"], 2)}
    if a.tls:
        import ssl
        import tempfile
        from pathlib import Path

        import devpath  # noqa: F401  (testing/ on sys.path)
        from sharegpu_testing.tls import make_certificates

        with tempfile.TemporaryDirectory() as tmp:
            files = make_certificates(Path(tmp), hosts=("localhost",))
            client = ssl.create_default_context(cafile=str(files.ca_cert))
            tls = measure(serve_ours, a.requests, ((str(files.cert), str(files.key)),), client)
        out["sharegpu_httpserver_tls"] = tls
        out["tls_extra_server_cpu_us_per_request"] = round(
            tls["server_cpu_us_per_request"] - ours["server_cpu_us_per_request"], 1)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
