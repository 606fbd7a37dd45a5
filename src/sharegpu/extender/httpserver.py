"""The extender's HTTP/1.1 server: asyncio, with httptools (llhttp, Node.js's parser) parsing.

It does what the extender needs and no more (keep-alive, pipelining, chunked bodies, TLS), with
limits on everything a client controls (body, headers, time, connections, descriptors) and a
lingering close after an early error. A handler is a plain function or a coroutine function; a
running handler is never cancelled because its client left. The limits and the reasons for
them: docs/extender-http.md.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httptools

log = logging.getLogger(__name__)

# kube-scheduler with nodeCacheCapable (the chart's setting) sends node names: at 15,000 nodes
# about 0.4 MB of names plus the Pod. Full Node objects (nodeCacheCapable: false) need more:
# raise it with --max-body-mib.
MAX_BODY = 16 * 1024 * 1024
MAX_HEADER = 64 * 1024
MAX_QUEUED = 64  # pipelined requests held per connection before reading pauses
IDLE_TIMEOUT = 90.0  # Go's http.Transport keeps idle connections 90 s: close ours no sooner
REQUEST_TIMEOUT = 10.0  # from a request's first byte to its last
MAX_CONNECTIONS = 1024
BACKLOG = 1024
ACCEPT_BATCH = 16  # connections accepted per turn of the event loop, at most
ACCEPT_RETRY = 0.2  # seconds before accepting again when descriptors ran out, none to shed
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
LINGER_BYTES = 64 * 1024 * 1024  # discarded after an early error answer, at most
LINGER_TIME = 5.0  # seconds a lingering close waits for the client to stop sending


def descriptor_limit() -> int:
    """The process's soft limit on open descriptors (``ulimit -n``)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_descriptors() -> int:
    """How many descriptors the process has open (0 where ``/proc/self/fd`` cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def default_headroom(limit: int) -> int:
    """Descriptors kept free below ``limit`` for everything but this server's connections:
    one in sixteen, between 8 and 256."""
    return max(8, min(256, limit // 16))


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lower case
    body: bytes = b""
    started: float = 0.0  # loop time of the request's first byte (its caller's clock starts)


@dataclass(slots=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    close: bool = False  # close the connection after this answer (the client reconnects)


def json_response(data: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(data, separators=(",", ":")).encode())


def text_response(text: str, status: int = 200) -> Response:
    return Response(status, text.encode(), "text/plain; charset=utf-8")


Handler = Callable[[Request], Response | Awaitable[Response]]


def _head(status: int, content_type: str, length: int, close: bool) -> bytes:
    key = (status, content_type, close)
    start = _HEADS.get(key)
    if start is None:
        reason = _REASONS.get(status, "Status")
        conn = "Connection: close\r\n" if close else ""
        start = _HEADS[key] = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                               f"{conn}Content-Length: ").encode("latin-1")
    return start + b"%d\r\n\r\n" % length


_REASONS = {s.value: s.phrase for s in HTTPStatus}
_HEADS: dict[tuple[int, str, bool], bytes] = {}


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing a request that is refused."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[tuple[Request, bool]] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closing = False
        self.paused = False
        self.broken: Response | None = None  # the error to answer once the running one is done
        self.last_activity = 0.0  # loop time of the last byte read or answer written
        self.request_started: float | None = None  # loop time of an unfinished request's start
        self.lingering: float | None = None  # loop time a lingering close began
        self.linger_left = 0  # bytes still discarded before closing
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.header_bytes = 0
        self.chunks: list[bytes] = []
        self.body_bytes = 0

    # -- transport ---------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.last_activity = asyncio.get_running_loop().time()
        sock = transport.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        if not self.server.make_room(fd):
            transport.close()  # every connection is busy answering: refuse this one
            self.closing = True
            return
        self.server.connections.add(self)

    @property
    def idle(self) -> bool:
        return self.task is None and not self.queue and self.request_started is None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.lingering is not None:
            self.linger_left -= len(data)
            if self.linger_left <= 0 and self.transport is not None:
                self.transport.close()
            return
        if self.closing or self.broken is not None:
            return
        self.last_activity = asyncio.get_running_loop().time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _Refused):
                self._fail(cause.status, str(cause))
            else:  # a bug of ours; never leave the client hanging
                log.exception("HTTP parser callback failed")
                self._fail(500, "internal error while reading the request")
        except httptools.HttpParserError as e:
            self._fail(400, f"malformed HTTP request: {e}")

    # -- parser callbacks ---------------
    def on_message_begin(self) -> None:
        self.request_started = asyncio.get_running_loop().time()
        self._reset()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.header_bytes += len(url)
        if self.header_bytes > self.server.max_header:
            raise _Refused(414, "request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > self.server.max_header:
            raise _Refused(431, f"request headers larger than {self.server.max_header} bytes")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and int(length) > self.server.max_body:
            raise _Refused(413, f"request body larger than {self.server.max_body} bytes")
        if self.headers.get("expect", "").lower() == "100-continue" and self.transport:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.server.max_body:
            raise _Refused(413, f"request body larger than {self.server.max_body} bytes")
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        started = self.request_started
        self.request_started = None
        url = self.url.decode("latin-1")
        path, _, query = url.partition("?")
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        req = Request(self.parser.get_method().decode("latin-1"), path, query, self.headers,
                      body, started if started is not None
                      else asyncio.get_running_loop().time())
        self.queue.append((req, bool(self.parser.should_keep_alive())))
        if len(self.queue) > MAX_QUEUED and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self._serve()

    # -- answering ---------------
    def _serve(self) -> None:
        while self.queue and self.task is None and not self.closing:
            req, keep = self.queue.popleft()
            handler = self.server.route(req)
            try:
                out = handler(req)
            except Exception as e:
                out = self.server.crashed(req, e)
            if isinstance(out, Response):
                self._write(out, keep and not out.close)
                continue
            self.task = asyncio.get_running_loop().create_task(self._await(out, req, keep))
            self.server.running.add(self.task)
            self.task.add_done_callback(self.server.running.discard)
        if self.paused and len(self.queue) <= MAX_QUEUED // 2 and self.transport is not None:
            self.transport.resume_reading()
            self.paused = False

    async def _await(self, out: Awaitable[Response], req: Request, keep: bool) -> None:
        try:
            resp = await out
        except asyncio.CancelledError:
            raise
        except Exception as e:
            resp = self.server.crashed(req, e)
        self.task = None
        keep = keep and not resp.close
        self._write(resp, keep)
        if not keep:
            return
        if self.broken is not None:
            self._write(self.broken, keep=False, linger=True)
            return
        self._serve()

    def _write(self, resp: Response, keep: bool, *, linger: bool = False) -> None:
        if self.transport is None or self.closing:
            return
        self.last_activity = asyncio.get_running_loop().time()
        self.transport.write(_head(resp.status, resp.content_type, len(resp.body), not keep)
                             + resp.body)
        if not keep:
            self.closing = True
            if linger:
                self._linger()
            else:
                self.transport.close()

    def time_out(self) -> None:
        """A request that did not arrive whole in time: 408, and a lingering close."""
        self.queue.clear()
        self._write(json_response({"Error": "request not received in time"}, 408), keep=False,
                    linger=True)

    def _linger(self) -> None:
        """Close without resetting: half-close (where the transport can: not TLS), then discard
        what arrives until the client closes, ``LINGER_BYTES`` were read, or the reaper finds
        ``LINGER_TIME`` passed."""
        t = self.transport
        assert t is not None
        self.closing = True
        self.lingering = asyncio.get_running_loop().time()
        self.linger_left = self.server.linger_bytes
        self.request_started = None
        self.queue.clear()
        if t.can_write_eof():
            t.write_eof()
        if self.paused:
            t.resume_reading()
            self.paused = False

    def eof_received(self) -> bool | None:
        return None  # the client is done sending: close (after what is left is written)

    def _fail(self, status: int, message: str) -> None:
        """Answer a request that cannot be read, after the one running if any (answers keep
        the requests' order), and close: the stream's framing is lost, so nothing after it is
        read. Requests read before it and not yet answered are dropped unanswered."""
        self.queue.clear()
        error = json_response({"Error": message}, status)
        if self.task is None:
            self._write(error, keep=False, linger=True)
        else:
            self.broken = error


class HttpServer:
    """Serves ``routes``: ``{(method, path): handler}``."""

    def __init__(self, routes: Mapping[tuple[str, str], Handler], *, max_body: int = MAX_BODY,
                 max_header: int = MAX_HEADER, idle_timeout: float = IDLE_TIMEOUT,
                 request_timeout: float = REQUEST_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, fd_limit: int | None = None,
                 fd_headroom: int | None = None, linger_bytes: int = LINGER_BYTES,
                 linger_time: float = LINGER_TIME) -> None:
        """``fd_limit``: the descriptor limit (default: the process's, read at
        :meth:`start`); ``fd_headroom``: descriptors kept free below it (default
        :func:`default_headroom`)."""
        self.routes = dict(routes)
        self.paths = {p for _, p in self.routes}
        self.max_body = max_body
        self.max_header = max_header
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self.fd_limit = fd_limit
        self.fd_headroom = fd_headroom
        self.linger_bytes = linger_bytes
        self.linger_time = linger_time
        self.shed = 0  # connections closed because descriptors ran short
        self.out_of_descriptors = 0  # accept() calls that failed with EMFILE/ENFILE/...
        self.closed_idle = 0  # connections closed for idling, timed out, or evicted (tests)
        self.timed_out = 0
        self.evicted = 0
        self._reaper: asyncio.Task[None] | None = None
        self.connections: set[_Connection] = set()
        self.running: set[asyncio.Task[None]] = set()  # coroutine handlers not finished yet
        self._listener: socket.socket | None = None
        self._ssl: ssl.SSLContext | None = None
        self._adopting: set[asyncio.Task[None]] = set()  # accepted, transport not made yet
        self._fd_threshold = 1 << 62  # set by start()
        self._fd_cap = 1 << 62  # connections the descriptors allow; set by start()
        self._accept_batch = ACCEPT_BATCH

    def route(self, req: Request) -> Handler:
        h = self.routes.get((req.method, req.path))
        if h is not None:
            return h
        if req.path in self.paths:
            allowed = ", ".join(sorted(m for m, p in self.routes if p == req.path))
            return lambda _r: json_response(
                {"Error": f"method {req.method} not allowed on {req.path} (use {allowed})"}, 405)
        return lambda _r: json_response({"Error": f"no such path: {req.path}"}, 404)

    def make_room(self, fd: int = -1) -> bool:
        """Whether a new connection (on descriptor ``fd``) may stay. Below ``max_connections``
        and below the descriptor cap, yes; otherwise after closing the connection that waits
        longest while idle, lingering or stalled mid-request. ``False`` when
        ``max_connections`` are all answering.

        The descriptor cap is the threshold (the limit less the headroom) less the descriptors
        open at :meth:`start`. Descriptors are handed out lowest first, so a new one at ``fd``
        means at least ``fd`` are open: one at the threshold or above says others opened more
        than counted, and the cap comes down to the connections open now."""
        if fd >= self._fd_threshold:
            self._fd_cap = min(self._fd_cap, max(1, len(self.connections)))
        full = len(self.connections) >= self.max_connections
        if not full and len(self.connections) < self._fd_cap:
            return True
        victim = self._victim()
        if victim is None:
            return not full  # descriptors short but nothing to shed: the headroom serves it
        if full:
            self.evicted += 1
        else:
            self.shed += 1
        self._drop(victim)
        return True

    def _victim(self) -> _Connection | None:
        """The connection to close for room: lingering ones first, then the longest idle or
        stalled mid-request; ``None`` when every connection is answering."""
        now = asyncio.get_running_loop().time()
        victims = [c for c in self.connections
                   if c.idle or c.lingering is not None
                   or (c.request_started is not None and c.task is None
                       and now - c.last_activity > 1.0)]
        if not victims:
            return None
        return min(victims, key=lambda c: (c.lingering is None, c.last_activity))

    @staticmethod
    def _drop(c: _Connection) -> None:
        c.closing = True
        c.server.connections.discard(c)
        if c.transport is not None:
            c.transport.close()

    async def _reap(self) -> None:
        """Once a second: close connections idle too long and requests arriving too slowly."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout / 2, self.request_timeout / 2,
                                    self.linger_time / 2))
            now = loop.time()
            for c in list(self.connections):
                if c.lingering is not None:
                    if now - c.lingering > self.linger_time:
                        self._drop(c)
                elif c.idle and now - c.last_activity > self.idle_timeout:
                    self.closed_idle += 1
                    self._drop(c)
                elif (c.request_started is not None and c.task is None
                      and now - c.request_started > self.request_timeout):
                    self.timed_out += 1
                    c.time_out()

    def crashed(self, req: Request, e: Exception) -> Response:
        log.exception("%s %s failed", req.method, req.path)
        return json_response({"Error": f"internal error: {type(e).__name__}: {e}"}, 500)

    async def start(self, host: str = "127.0.0.1", port: int = 0,
                    ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen; returns the port (useful with ``port=0``)."""
        loop = asyncio.get_running_loop()
        limit = self.fd_limit if self.fd_limit is not None else descriptor_limit()
        headroom = self.fd_headroom if self.fd_headroom is not None else \
            default_headroom(limit)
        self._fd_threshold = limit - headroom
        self._fd_cap = max(1, self._fd_threshold - open_descriptors())
        self._accept_batch = max(1, min(ACCEPT_BATCH, headroom // 2))
        family, kind, proto, _, address = (await loop.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        self._ssl = ssl_context
        loop.add_reader(sock.fileno(), self._accept)
        self._reaper = loop.create_task(self._reap())
        return int(sock.getsockname()[1])

    def _accept(self) -> None:
        """Accept a few waiting connections (a few per turn of the loop: a burst cannot take
        the descriptors before the ones accepted have shed idle connections). Out of
        descriptors (EMFILE): shed an idle connection and accept again on the loop's next
        turn; with nothing to shed, wait a moment."""
        sock = self._listener
        if sock is None:
            return
        loop = asyncio.get_running_loop()
        for _ in range(self._accept_batch):
            try:
                conn, _addr = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:
                if e.errno not in _OUT_OF_RESOURCES:
                    log.warning("accept() failed: %s", e)
                    return
                self.out_of_descriptors += 1
                victim = self._victim()
                if victim is None:
                    log.warning("accept() failed (%s) and no idle connection to close: "
                                "retrying in %.1f s", e.strerror, ACCEPT_RETRY)
                    loop.remove_reader(sock.fileno())
                    loop.call_later(ACCEPT_RETRY, self._resume_accepting)
                    return
                self.shed += 1
                self._drop(victim)
                return  # its descriptor is freed once the loop runs its close: accept then
            conn.setblocking(False)
            task = loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _resume_accepting(self) -> None:
        if self._listener is not None:
            asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)

    async def _adopt(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(
                lambda: _Connection(self), conn, ssl=self._ssl,
                ssl_handshake_timeout=self.request_timeout if self._ssl else None)
        except (TimeoutError, OSError, ssl.SSLError) as e:
            log.debug("connection dropped before its first byte: %s", e)
            conn.close()

    async def close(self, grace: float = 10.0) -> None:
        """Stop listening, let running handlers finish (cancelled after ``grace`` seconds),
        close every connection."""
        sock = self._listener
        if sock is None:
            return
        self._listener = None
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for t in list(self._adopting):
            t.cancel()
        if self.running:
            _, late = await asyncio.wait(set(self.running), timeout=grace)
            for t in late:
                t.cancel()
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.close()
        await asyncio.sleep(0)  # let the transports finish closing
