"""The extender's HTTP/1.1 server over real sockets: keep-alive, pipelining in order, chunked
bodies, limits, malformed requests, errors, HTTP/1.0, 100-continue, TLS, and clients that leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sharegpu.extender.httpserver import HttpServer, Request, Response, json_response
from sharegpu_testing.tls import make_certificates

FINISHED: list[str] = []


async def _slow(req: Request) -> Response:
    await asyncio.sleep(0.05)
    FINISHED.append(req.body.decode())
    return json_response({"slow": req.body.decode()})


def _echo(req: Request) -> Response:
    return json_response({"path": req.path, "query": req.query, "len": len(req.body),
                          "body": req.body.decode(errors="replace"),
                          "type": req.headers.get("content-type", "")})


def _boom(req: Request) -> Response:
    raise RuntimeError("the handler broke")


ROUTES: dict[tuple[str, str], Callable[[Request], Response | Awaitable[Response]]] = {
    ("POST", "/echo"): _echo, ("GET", "/echo"): _echo, ("POST", "/slow"): _slow,
    ("POST", "/boom"): _boom,
}


def serve(body: Callable[[int], Awaitable[None]], *, tls: ssl.SSLContext | None = None,
          **kw: Any) -> None:
    async def go() -> None:
        server = HttpServer(ROUTES, **kw)
        port = await server.start("127.0.0.1", 0, tls)
        try:
            await body(port)
        finally:
            await server.close()

    asyncio.run(go())


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    async def body(port: int) -> None:
        r, w = await connect(port)
        for i in range(50):
            w.write(post(f"/echo?i={i}", json.dumps({"i": i}).encode()))
            status, headers, out = await read_response(r)
            assert status == 200 and headers["content-type"] == "application/json"
            assert json.loads(out) == {"path": "/echo", "query": f"i={i}", "len": len(
                json.dumps({"i": i})), "body": json.dumps({"i": i}),
                "type": "application/json"}
            assert "connection" not in headers
        w.close()

    serve(body)


def test_pipelined_requests_are_answered_in_order() -> None:
    async def body(port: int) -> None:
        r, w = await connect(port)
        # a slow coroutine handler first: the fast ones behind it must wait for it
        w.write(post("/slow", b"one") + post("/echo", b"two") + post("/slow", b"three")
                + post("/echo", b"four"))
        got = [json.loads((await read_response(r))[2]) for _ in range(4)]
        assert [g.get("slow") or g.get("body") for g in got] == ["one", "two", "three", "four"]
        w.close()

    serve(body)


def test_chunked_body_is_read_whole() -> None:
    async def body(port: int) -> None:
        r, w = await connect(port)
        payload = b'{"Pod": "x"}' * 1000
        chunks = [payload[i:i + 777] for i in range(0, len(payload), 777)]
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")
        status, _, out = await read_response(r)
        assert status == 200 and json.loads(out)["len"] == len(payload)
        w.close()

    serve(body)


def test_body_over_the_limit_is_refused_and_the_connection_closed() -> None:
    async def body(port: int) -> None:
        for data in (post("/echo", b"x" * 2000),  # announced by Content-Length
                     b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"400\r\n" + b"y" * 1024 + b"\r\n" + b"400\r\n" + b"y" * 1024 + b"\r\n"):
            r, w = await connect(port)
            w.write(data)
            status, headers, out = await read_response(r)
            assert status == 413 and headers["connection"] == "close"
            assert "larger than 1500 bytes" in json.loads(out)["Error"]
            assert await r.read() == b""  # closed
            w.close()

    serve(body, max_body=1500)


def test_huge_headers_are_refused() -> None:
    async def body(port: int) -> None:
        r, w = await connect(port)
        w.write(post("/echo", b"{}", extra="X-Junk: " + "j" * 5000 + "\r\n"))
        status, _, out = await read_response(r)
        assert status == 431 and "headers larger than 4096" in json.loads(out)["Error"]
        w.close()

    serve(body, max_header=4096)


def test_malformed_request_gets_400_and_the_server_goes_on() -> None:
    async def body(port: int) -> None:
        r, w = await connect(port)
        w.write(b"THIS IS NOT HTTP\r\n\r\n")
        status, headers, out = await read_response(r)
        assert status == 400 and headers["connection"] == "close"
        assert "malformed HTTP request" in json.loads(out)["Error"]
        assert await r.read() == b""
        w.close()
        r, w = await connect(port)  # others are still served
        w.write(post("/echo", b"ok"))
        assert (await read_response(r))[0] == 200
        w.close()

    serve(body)


def test_unknown_path_and_wrong_method_are_named() -> None:
    async def body(port: int) -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/nope") as resp:
                assert resp.status == 404
                assert (await resp.json())["Error"] == "no such path: /nope"
            async with s.delete(f"http://127.0.0.1:{port}/slow") as resp:
                assert resp.status == 405
                assert (await resp.json())["Error"] == (
                    "method DELETE not allowed on /slow (use POST)")

    serve(body)


def test_a_handler_that_raises_gets_500_and_the_connection_continues() -> None:
    async def body(port: int) -> None:
        r, w = await connect(port)
        w.write(post("/boom", b"{}"))
        status, headers, out = await read_response(r)
        assert status == 500 and "connection" not in headers
        assert json.loads(out)["Error"] == "internal error: RuntimeError: the handler broke"
        w.write(post("/echo", b"after"))
        status, _, out = await read_response(r)
        assert status == 200 and json.loads(out)["body"] == "after"
        w.close()

    serve(body)


def test_http_1_0_and_connection_close_end_the_connection() -> None:
    async def body(port: int) -> None:
        for data in (post("/echo", b"a", version="1.0"),
                     post("/echo", b"b", extra="Connection: close\r\n")):
            r, w = await connect(port)
            w.write(data)
            status, headers, _ = await read_response(r)
            assert status == 200 and headers["connection"] == "close"
            assert await r.read() == b""
            w.close()

    serve(body)


def test_expect_100_continue_gets_the_interim_answer() -> None:
    async def body(port: int) -> None:
        r, w = await connect(port)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                b"Expect: 100-continue\r\n\r\n")
        assert await r.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        w.write(b"hello")
        status, _, out = await read_response(r)
        assert status == 200 and json.loads(out)["body"] == "hello"
        w.close()

    serve(body)


def test_client_leaving_during_a_slow_handler_harms_nobody() -> None:
    FINISHED.clear()

    async def body(port: int) -> None:
        r, w = await connect(port)
        w.write(post("/slow", b"gone"))
        await asyncio.sleep(0.01)
        w.close()
        await asyncio.sleep(0.1)
        assert FINISHED == ["gone"]  # ran to its end although nobody waits for the answer
        r, w = await connect(port)
        w.write(post("/slow", b"here"))
        assert json.loads((await read_response(r))[2]) == {"slow": "here"}
        w.close()

    serve(body)


def test_a_bad_request_behind_a_running_handler_does_not_cancel_it() -> None:
    FINISHED.clear()

    async def body(port: int) -> None:
        r, w = await connect(port)
        w.write(post("/slow", b"bind") + b"NOT HTTP\r\n\r\n")
        status, _, out = await read_response(r)  # answers keep the order of the requests
        assert status == 200 and json.loads(out) == {"slow": "bind"}
        status, headers, _ = await read_response(r)
        assert status == 400 and headers["connection"] == "close"
        assert FINISHED == ["bind"]
        assert await r.read() == b""
        w.close()

    serve(body)


def test_close_waits_for_running_handlers() -> None:
    FINISHED.clear()

    async def go() -> None:
        server = HttpServer(ROUTES)
        port = await server.start("127.0.0.1", 0)
        _r, w = await connect(port)
        w.write(post("/slow", b"last"))
        await asyncio.sleep(0.01)
        await server.close()
        assert FINISHED == ["last"]
        w.close()

    asyncio.run(go())


def test_tls(tmp_path: Path) -> None:
    files = make_certificates(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(files.cert, files.key)
    client_ctx = ssl.create_default_context(cafile=str(files.ca_cert))

    async def body(port: int) -> None:
        async with aiohttp.ClientSession() as s:
            for i in range(3):
                async with s.post(f"https://127.0.0.1:{port}/echo", data=b"secret",
                                  ssl=client_ctx) as resp:
                    assert resp.status == 200 and (await resp.json())["body"] == "secret", i
            try:  # plain HTTP to a TLS port gets nowhere
                async with s.get(f"http://127.0.0.1:{port}/echo") as resp:
                    raise AssertionError(f"answered {resp.status} without TLS")
            except aiohttp.ClientError:
                pass

    serve(body, tls=server_ctx)


# --- limits on what a client controls -------------------------------------------------------

def test_idle_connections_are_closed() -> None:
    async def body(port: int) -> None:
        r, w = await connect(port)
        w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(r))[0] == 200
        # then nothing: the server closes it after idle_timeout
        assert await asyncio.wait_for(r.read(), 3) == b""
        w.close()

    serve(body, idle_timeout=0.5)


def test_a_slowloris_gets_408_and_is_closed() -> None:
    async def body(port: int) -> None:
        r, w = await connect(port)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        for _ in range(2):  # a byte now and then keeps it "active", never complete
            await asyncio.sleep(0.2)
            w.write(b"a")
        status, _, out = await asyncio.wait_for(read_response(r), 3)
        assert status == 408 and b"not received in time" in out
        with contextlib.suppress(ConnectionResetError):  # EOF, or a reset crossing the close
            assert await r.read() == b""
        w.close()

    serve(body, request_timeout=0.8)


def test_a_thousand_idle_connections_and_a_slowloris_leave_healthz_fast() -> None:
    """1,000 idle keep-alive connections and 100 half-sent requests, against a cap of 512:
    a new /healthz-style request (a fresh connection, as the kubelet's probe makes) is answered
    within 100 ms; the oldest idle connections made room."""
    import time

    async def body(port: int) -> None:
        held = []
        for i in range(1100):
            r, w = await connect(port)
            if i >= 1000:
                w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
            held.append((r, w))
        await asyncio.sleep(0.2)
        worst = 0.0
        for _ in range(20):
            t0 = time.perf_counter()
            r, w = await connect(port)
            w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(read_response(r), 1))[0] == 200
            worst = max(worst, time.perf_counter() - t0)
            w.close()
        print(f"healthz worst of 20 beside 1,000 idle + 100 slowloris: {worst * 1000:.1f} ms")
        assert worst < 0.1, worst
        for _, w in held:
            w.close()

    serve(body, max_connections=512)


def test_body_limit_is_sized_for_node_names() -> None:
    from sharegpu.extender.httpserver import MAX_BODY

    names = json.dumps({"NodeNames": [f"gpu-node-{i:05d}.cluster.example" for i in range(15000)]})
    assert len(names) < MAX_BODY // 16  # 15,000 node names fit many times over

    async def body(port: int) -> None:
        r, w = await connect(port)
        w.write(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n"
                .encode())
        status, _, out = await read_response(r)
        assert status == 413 and b"larger than" in out
        w.close()

    serve(body)


def _send_all_then_read(port: int, head: bytes, body_len: int) -> tuple[bytes, str]:
    """A plain client: the whole request written first (blocking), then the answer read, as
    simple HTTP clients do. Returns what it read, and the error it met while sending."""
    import socket

    err = ""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(head)
            chunk = b"z" * 65536
            left = body_len
            while left > 0:
                s.sendall(chunk[:left])
                left -= len(chunk)
        except OSError as e:
            err = type(e).__name__
        got = b""
        with contextlib.suppress(OSError):
            while data := s.recv(65536):
                got += data
    return got, err


def test_an_oversized_body_gets_its_413_while_the_client_is_still_sending() -> None:
    """Refused at its headers, the body still arrives: the server half-closes and reads it
    away, so the client's writes succeed and it reads the 413 (a close with its bytes unread
    would reset the connection under it)."""
    async def body(port: int) -> None:
        size = 8 * 1024 * 1024
        for head in (f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode(),
                     b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"800000\r\n"):
            got, err = await asyncio.to_thread(_send_all_then_read, port, head, size)
            assert err == "", f"the client could not send its body: {err}"
            assert got.startswith(b"HTTP/1.1 413 "), got[:200]
            assert b"larger than 1500 bytes" in got and b"Connection: close" in got
            r, w = await connect(port)  # and the server goes on
            w.write(post("/echo", b"{}"))
            assert (await read_response(r))[0] == 200
            w.close()

    serve(body, max_body=1500)


def test_a_lingering_close_is_bounded_in_bytes_and_time() -> None:
    async def go() -> None:
        server = HttpServer(ROUTES, max_body=1500, linger_bytes=256 * 1024, linger_time=0.6)
        port = await server.start("127.0.0.1", 0)
        try:
            # bytes: a client sending without end is cut off after about linger_bytes
            _got, err = await asyncio.to_thread(
                _send_all_then_read, port,
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",
                64 * 1024 * 1024)
            assert err in ("ConnectionResetError", "BrokenPipeError"), err
            # time: a client trickling its body is closed after linger_time
            r, w = await connect(port)
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 9999\r\n\r\n")
            status, _, _ = await read_response(r)
            assert status == 413
            assert await asyncio.wait_for(r.read(), 2) == b""  # half-closed: EOF after it
            t0 = asyncio.get_running_loop().time()
            while server.connections:
                w.write(b"x")
                await asyncio.sleep(0.05)
                assert asyncio.get_running_loop().time() - t0 < 3, "still lingering"
            w.close()
        finally:
            await server.close()

    asyncio.run(go())


FD_SERVER = """
import asyncio, resource, sys
from sharegpu.extender.httpserver import HttpServer, json_response, open_descriptors
resource.setrlimit(resource.RLIMIT_NOFILE, (CAP, CAP))
routes = {("GET", "/healthz"): lambda r: json_response("ok"),
          ("GET", "/stats"): lambda r: json_response(
              [main_server.shed, main_server.out_of_descriptors, open_descriptors()])}
async def main():
    global main_server
    main_server, probe = HttpServer(routes, fd_headroom=HEADROOM), HttpServer(routes)
    ports = await main_server.start(), await probe.start()
    print(*ports, flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
"""


@pytest.mark.parametrize("headroom", ["None", "1"])
def test_idle_connections_at_the_descriptor_limit_leave_healthz_answering(headroom: str) -> None:
    """A process allowed 160 descriptors, its cap on connections (1,024) far above that:
    400 idle connections (keep-alive ones, then bare ones opened in a burst) must not take
    the last descriptors, or accept() fails (EMFILE) and /healthz, on this port or on a probe
    port beside it, stops answering. The oldest idle connections are shed instead: before the
    limit (the default headroom), or when accept() meets EMFILE (a headroom of 1)."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", FD_SERVER.replace("CAP", "160").replace("HEADROOM", headroom)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port, probe = map(int, proc.stdout.readline().split())

        async def healthz(p: int) -> float:
            t0 = time.perf_counter()
            r, w = await asyncio.wait_for(connect(p), 3)
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(read_response(r), 3))[0] == 200
            w.close()
            return time.perf_counter() - t0

        async def body() -> None:
            held = []
            for _ in range(200):  # keep-alive clients, each served once, then idle
                r, w = await connect(port)
                w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await asyncio.wait_for(read_response(r), 3))[0] == 200
                held.append(w)
            held += [(await connect(port))[1] for _ in range(200)]  # bare, in a burst
            await asyncio.sleep(1.5)
            worst = max([await healthz(p) for p in (port, probe) for _ in range(5)])
            print(f"healthz worst of 10 beside 400 idle at a 160-descriptor limit "
                  f"(headroom {headroom}): {worst * 1000:.1f} ms")
            assert worst < 0.5, worst
            r, w = await connect(probe)
            w.write(b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n")
            shed, emfile, open_fds = json.loads((await read_response(r))[2])
            w.close()
            assert shed >= 400 - 160
            if headroom == "None":  # the headroom (10 of 160) stays free once bursts settle
                assert open_fds <= 160 - 10 + 2, open_fds  # + this /stats connection
            else:
                assert emfile > 0  # shed when accept() failed, and served at once
            for w in held:
                w.close()

        asyncio.run(body())
    finally:
        proc.kill()
        proc.wait()
