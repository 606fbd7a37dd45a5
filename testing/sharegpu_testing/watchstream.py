"""One watch request of the fake API server, streamed as kube-apiserver does: HTTP 200, then
one JSON event per line (chunked), BOOKMARKs when allowed, an ERROR event carrying a 410
``Status`` when the requested resourceVersion is gone, and the end of the stream at
``timeoutSeconds`` (or when a fault closes it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from . import status as st
from .faults import Faults
from .routing import Call, truthy
from .selectors import parse_field_selector, parse_label_selector
from .store import CLOSE, INITIAL_EVENTS_END, Obj, Store

BOOKMARK = "__BOOKMARK__"


def _line(kind: str, obj: Any) -> bytes:
    return json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"


async def serve_watch(
    request: web.Request,
    call: Call,
    store: Store,
    faults: Faults,
    *,
    bookmark_interval: float,
    watch_timeout: float | None,
    on_open: Callable[[], None],
) -> web.StreamResponse:
    q = request.query
    rtype = call.rtype
    labels = parse_label_selector(q.get("labelSelector"))
    fields = parse_field_selector(q.get("fieldSelector"), rtype.supported_fields)
    bookmarks = truthy(q.get("allowWatchBookmarks")) is True
    timeout = watch_timeout
    if q.get("timeoutSeconds"):
        try:
            asked = float(q["timeoutSeconds"])
        except ValueError:
            raise st.bad_request(f"invalid timeoutSeconds {q['timeoutSeconds']!r}") from None
        timeout = asked if timeout is None else min(asked, timeout)
    loop = asyncio.get_running_loop()
    resp = web.StreamResponse(status=200)
    resp.content_type = "application/json"
    resp.enable_chunked_encoding()
    try:
        opened = store.watch(
            rtype,
            call.namespace if rtype.namespaced else None,
            labels,
            fields,
            loop,
            resource_version=q.get("resourceVersion"),
            send_initial_events=truthy(q.get("sendInitialEvents")),
        )
    except st.StatusError as e:
        if e.code != 410:
            raise
        # The real server opens the stream, then sends the 410 as an ERROR event.
        on_open()
        await resp.prepare(request)
        await resp.write(_line("ERROR", e.body()))
        await resp.write_eof()
        return resp
    watcher = opened.watcher
    on_open()
    await resp.prepare(request)

    def bookmark(rv: int, initial_events_end: bool = False) -> Obj:
        m: dict[str, Any] = {"resourceVersion": str(rv)}
        if initial_events_end:
            m["annotations"] = {INITIAL_EVENTS_END: "true"}
        return {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": m}

    def ask_bookmark() -> None:
        # Queued behind every event already pushed to this watch, so a client that resumes
        # from the bookmark's resourceVersion misses nothing.
        store.push_progress(watcher, BOOKMARK)

    abrupt = False
    try:
        for kind, obj in opened.backlog:
            await resp.write(_line(kind, obj))
        if opened.initial_events and bookmarks:
            await resp.write(_line("BOOKMARK", bookmark(opened.resource_version, True)))
        deadline = loop.time() + timeout if timeout is not None else None
        next_bookmark = loop.time() + bookmark_interval
        closing = False
        while True:
            now = loop.time()
            waits = []
            if deadline is not None and not closing:
                waits.append(deadline - now)
            if bookmarks and not closing:
                waits.append(next_bookmark - now)
            wait = max(0.0, min(waits)) if waits else None
            try:
                kind, obj = await asyncio.wait_for(watcher.queue.get(), wait)
            except TimeoutError:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    if not bookmarks:
                        break
                    closing = True  # send a last bookmark, then end the stream
                    ask_bookmark()
                elif bookmarks and now >= next_bookmark:
                    next_bookmark = now + bookmark_interval
                    ask_bookmark()
                continue
            if kind == CLOSE:
                abrupt = bool(obj)
                break
            if kind == BOOKMARK:
                await resp.write(_line("BOOKMARK", bookmark(int(obj))))
                if closing:
                    break
                continue
            await resp.write(_line(kind, obj))
            cut = faults.cut_after_event(call.resource)
            if cut is not None:
                abrupt = cut == "abrupt"
                break
    finally:
        store.unwatch(watcher)
    if abrupt:
        if request.transport is not None:
            request.transport.abort()
        return resp
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp
