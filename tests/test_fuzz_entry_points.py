"""Seeded, bounded fuzzing of the entry points that read objects a client controls: whatever
the shape, the answer is a value or a refusal naming the field (ValidationError, HTTP 400) —
never another exception, a traceback or a 5xx — and the server keeps answering."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.core.errors import ValidationError
from sharegpu.core.request import parse_pod
from sharegpu.webhook import review
from sharegpu_testing import kobjects

KEYS = st.sampled_from(["metadata", "spec", "containers", "initContainers", "resources",
                        "limits", "requests", "name", "namespace", "labels", "uid",
                        "aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage",
                        "aliyun.com/gpu-count", "nvidia.com/gpu", "kind", "object",
                        "operation", "request", "apiVersion", "env", "value"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30),
                    st.floats(allow_nan=True), st.text(max_size=12),
                    st.sampled_from(["4", "²", "٤", "4Gi", "500m", "1e3", "-1", "30"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=5)), max_leaves=25)


def mutated_pod(draw_path: list, value: object) -> dict:
    pod = kobjects.pod("p", mem=4, core=30, gpu_count=2)
    obj: object = pod
    for k in draw_path[:-1]:
        obj = obj[k] if isinstance(obj, dict) else obj[0]  # type: ignore[index]
    if isinstance(obj, dict):
        obj[draw_path[-1]] = value
    return pod


PATHS = st.sampled_from([
    ["metadata"], ["metadata", "labels"], ["metadata", "labels", "aliyun.com/gpu-count"],
    ["metadata", "name"], ["spec"], ["spec", "containers"], ["spec", "initContainers"],
    ["spec", "containers", 0, "resources"], ["spec", "containers", 0, "name"],
    ["spec", "containers", 0, "resources", "limits"],
    ["spec", "containers", 0, "resources", "limits", "aliyun.com/gpu-mem"],
])


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(JSON, st.builds(mutated_pod, PATHS, JSON)))
def test_parse_pod_refuses_with_a_field(obj):
    try:
        parse_pod(obj)  # type: ignore[arg-type]
    except ValidationError as e:
        assert e.field and e.rule


def envelope(req: object) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    JSON,
    st.builds(envelope, JSON),
    st.builds(lambda k, op, o: envelope({"uid": "u", "kind": k, "operation": op, "object": o}),
              JSON, JSON, st.one_of(JSON, st.builds(mutated_pod, PATHS, JSON))),
))
def test_admission_review_answers_or_refuses(body):
    try:
        out = review(body)
    except ValidationError as e:
        assert e.field and e.rule
    else:
        assert out["kind"] == "AdmissionReview" and isinstance(out["response"]["allowed"], bool)
        json.dumps(out)


async def test_webhook_http_never_5xx_and_keeps_answering():
    from aiohttp.test_utils import TestClient, TestServer

    from sharegpu.webhook import app

    deep = "[" * 100000 + "]" * 100000
    good = envelope({"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE",
                     "object": kobjects.pod("ok", mem=4)})
    async with TestClient(TestServer(app())) as client:
        cases = [
            (deep.encode(), "application/json"),
            (b'{"kind": "AdmissionReview"', "application/json"),
            (json.dumps(good).encode(), "application/json; charset=bogus"),
            (b"\xff\xfe\x00garbage", "application/json"),
            (json.dumps(envelope({"uid": "u", "kind": "Pod", "object": {}})).encode(),
             "application/json"),
            (json.dumps(envelope({"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE",
                                  "object": {"spec": "x"}})).encode(), "application/json"),
        ]
        for body, ctype in cases:
            r = await client.post("/validate", data=body, headers={"Content-Type": ctype})
            assert r.status < 500, (r.status, body[:40])
            assert "Traceback" not in await r.text()
        r = await client.post("/validate", json=good)
        assert r.status == 200 and (await r.json())["response"]["allowed"] is True


def _dump_items() -> list:
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / "core_mem.json").read_text())["items"]


def _paths(o: object, p: tuple = ()):  # type: ignore[no-untyped-def]
    yield p
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _paths(v, (*p, k))
    elif isinstance(o, list):
        for i, v in enumerate(o[:3]):
            yield from _paths(v, (*p, i))


DUMP_PATHS = [p for p in _paths(_dump_items()) if p]
BIG = st.sampled_from([10**5000, "9" * 5000, [[[[[]]]]], {"a": {"b": {"c": {}}}}])


@settings(max_examples=800, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(DUMP_PATHS), st.one_of(JSON, BIG)), min_size=1,
                max_size=3))
def test_inspect_reads_any_mutated_dump(changes):
    """Objects that cannot be read are left out with a warning naming the object and the
    field; the others are shown; no other exception."""
    import copy

    from sharegpu.inspect_cgpu import render
    from sharegpu.inspect_cgpu.model import build

    items = copy.deepcopy(_dump_items())
    for path, value in changes:
        obj: object = items
        try:
            for k in path[:-1]:
                obj = obj[k]  # type: ignore[index]
            obj[path[-1]] = value  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            continue
    nodes = [x for x in items if isinstance(x, dict) and x.get("kind") == "Node"]
    pods = [x for x in items if isinstance(x, dict) and x.get("kind") == "Pod"]
    try:
        view = build(nodes, pods)
    except ValidationError as e:
        assert e.field and e.rule
        return
    render.summary(view)
    render.details(view)
    json.loads(render.to_json(view))
    for w in view.warnings:
        assert "left out" in w or ":" in w


def test_inspect_file_edges_exit_codes(tmp_path):
    import subprocess
    import sys

    def inspect(*args: str) -> subprocess.CompletedProcess:
        code = "import sys\nfrom sharegpu.inspect_cgpu.cli import main\nsys.exit(main())"
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=60)

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    r = inspect("--file", str(deep))
    assert r.returncode == 1 and "nested too deeply" in r.stderr and "Traceback" not in r.stderr
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"kind": "List", "items": [kobjects.node("n1", [1] * 1000, "cgpu")]}))
    r = inspect("--file", str(big), "-d")
    assert r.returncode == 0 and "GPU999(Allocated)" in r.stdout, r.stderr
    bad = tmp_path / "bad.json"
    items = _dump_items()
    items[0]["metadata"]["labels"] = "not a map"
    bad.write_text(json.dumps({"kind": "List", "items": items}))
    r = inspect("--file", str(bad))
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "left out: metadata.labels must be an object of strings" in r.stderr


def _extender_app():  # type: ignore[no-untyped-def]
    from sharegpu.extender.bind import Binder
    from sharegpu.extender.metrics import Metrics
    from sharegpu.extender.server import ExtenderApp
    from sharegpu.extender.view import ClusterView
    from sharegpu_testing.memapi import MemoryApi

    view = ClusterView()
    view.reset([kobjects.node("a", [16, 16], "cgpu"), kobjects.node("b", [16, 16], "core_mem")],
               [])
    return ExtenderApp(view, Binder(MemoryApi([]), lambda: view), Metrics(lambda: view))


EXT_PATHS = st.sampled_from([
    ["Pod"], ["Pod", "metadata"], ["Pod", "spec"], ["Pod", "metadata", "labels"],
    ["Pod", "spec", "containers"], ["NodeNames"], ["Nodes"], ["Pod", "metadata", "name"],
    ["Pod", "metadata", "uid"], ["Pod", "spec", "nodeName"]])


def _ext_body(path: list, value: object) -> dict:
    body: dict = {"Pod": kobjects.pod("p", mem=4), "NodeNames": ["a", "b"]}
    obj: object = body
    for k in path[:-1]:
        obj = obj[k]  # type: ignore[index]
    obj[path[-1]] = value  # type: ignore[index]
    return body


@settings(max_examples=600, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(JSON, st.builds(_ext_body, EXT_PATHS, JSON)))
def test_extender_verbs_never_5xx(body):
    import asyncio

    from sharegpu.extender.httpserver import Request

    raw = json.dumps(body).encode()
    app = _extender_app()  # its binder's locks belong to this example's event loop

    async def verbs() -> None:  # handlers run inside the server's event loop
        for verb in ("filter", "prioritize"):
            r = getattr(app, verb)(Request("POST", f"/{verb}", body=raw))
            assert r.status < 500
            json.loads(r.body)
        r = await app.bind(Request("POST", "/bind", body=raw))
        assert r.status < 500 and "Error" in json.loads(r.body)

    asyncio.run(verbs())


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400), st.binary(max_size=400))
def test_trace_reader_reads_or_refuses_any_bytes(tmp_path_factory, nodes, pods):
    from sharegpu.sim.trace import read_nodes, read_pods

    d = tmp_path_factory.mktemp("trace")
    (d / "n.csv").write_bytes(b"sn,cpu_milli,memory_mib,gpu,model\n" + nodes)
    (d / "p.csv").write_bytes(b"name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + pods)
    for reader, f in ((read_nodes, "n.csv"), (read_pods, "p.csv")):
        try:
            reader(d / f)
        except ValidationError as e:
            assert e.field and e.rule


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_a_huge_body_leaves_memory_bounded():
    """A 50 MB body (declared, or chunked without a length) is refused with 413 once it passes
    the 16 MiB limit; the extender's memory grows by far less than the body, and it still
    answers."""
    import asyncio

    from sharegpu.extender.httpserver import MAX_BODY, HttpServer, Response

    async def go() -> float:
        server = HttpServer({("POST", "/x"): lambda r: Response(200, b"{}"),
                             ("GET", "/x"): lambda r: Response(200, b"{}")})
        port = await server.start()
        before = _rss_mib()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n")
            assert b" 413 " in await r.readline()
            w.close()
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n" % (1 << 20) + b"a" * (1 << 20) + b"\r\n"
            status = b""
            for _ in range(50):
                try:
                    w.write(chunk)
                    await w.drain()
                except (ConnectionResetError, BrokenPipeError):
                    break
            try:  # the 413, unless our later chunks crossed the close and reset the connection
                status = await r.readline()
            except ConnectionResetError:
                status = b"HTTP/1.1 413 (reset)"
            assert b" 413 " in status
            w.close()
            grown = _rss_mib() - before
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b" 200 " in await r.readline()
            w.close()
            return grown
        finally:
            await server.close()

    grown = asyncio.run(go())
    assert grown < 3 * MAX_BODY / (1 << 20), grown
