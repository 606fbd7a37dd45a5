"""``kubectl-inspect-cgpu`` end to end: dump files, a live API server on 127.0.0.1, errors, and
the real kubectl plugin mechanism."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

import cgpu_cluster as cc
from sharegpu.inspect_cgpu.cli import main
from test_inspect_golden import BINPACK, DETAILS, SEED003_ALIGNED

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
BIN = Path(sys.executable).parent


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


# --- dump files ---------------------------------------------------------------------------


def test_file_summary_details_json_and_filter(capsys):
    assert run_cli(capsys, "--file", str(DATA / "binpack.json")) == (0, BINPACK, "")
    assert run_cli(capsys, "-d", "--file", str(DATA / "details.json"))[1] == DETAILS
    rc, out, _ = run_cli(capsys, "--file", str(DATA / "core_mem.json"), "-o", "json", "gpu-mem-1")
    assert rc == 0 and [n["name"] for n in json.loads(out)["nodes"]] == ["gpu-mem-1"]


def test_file_from_stdin_and_node_and_pod_lists(capsys, monkeypatch, tmp_path):
    doc = cc.seed003()
    nodes = {"kind": "NodeList", "items": [{k: v for k, v in i.items() if k != "kind"}
                                           for i in doc["items"] if i["kind"] == "Node"]}
    pods = {"kind": "PodList", "items": [i for i in doc["items"] if i["kind"] == "Pod"]}
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps([nodes, pods])))
    assert run_cli(capsys, "--file", "-") == (0, SEED003_ALIGNED, "")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read it"),
        ("{not json", "not JSON (line 1, column 2"),
        ('{"kind": "List", "items": []}', "holds no Node objects"),
        ('{"kind": "List", "items": 3}', "'items' must be a list"),
        ("[1]", "expected a JSON object"),
    ],
)
def test_bad_dump_files_get_one_clear_line(capsys, tmp_path, content, message):
    path = tmp_path / "dump.json"
    if content is not None:
        path.write_text(content)
    rc, out, err = run_cli(capsys, "--file", str(path))
    assert rc == 1 and out == ""
    assert err.startswith(f"kubectl inspect cgpu: error: --file {path}") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_unknown_node_and_bad_arguments(capsys):
    rc, _, err = run_cli(capsys, "--file", str(DATA / "binpack.json"), "nope")
    assert rc == 2 and "NODE='nope': no such node" in err
    with pytest.raises(SystemExit) as e:
        main(["-o", "yaml"])
    assert e.value.code == 2 and "invalid choice: 'yaml'" in capsys.readouterr().err


def test_warnings_go_to_stderr(capsys, tmp_path):
    doc = cc.binpack()
    doc["items"][1]["metadata"]["annotations"]["scheduler.framework.gpushare.allocation"] = "[]"
    path = tmp_path / "d.json"
    path.write_text(json.dumps(doc))
    rc, out, err = run_cli(capsys, "--file", str(path))
    assert rc == 0 and "PENDING(Allocated)" in out and "24/60 (40%)" in out
    assert "warning: pod default/infer-a on cn-shanghai.192.0.2.109" in err


# --- a live cluster (a small API server on 127.0.0.1) --------------------------------------


class FakeApi:
    """Answers GET /api/v1/nodes and /api/v1/pods like the API server (paged, `continue`)."""

    def __init__(self, doc: dict, status: int = 200):
        self.nodes = [i for i in doc["items"] if i["kind"] == "Node"]
        self.pods = [i for i in doc["items"] if i["kind"] == "Pod"]
        self.status = status
        self.paths: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                url = urlparse(self.path)
                api.paths.append(self.path)
                if api.status != 200:
                    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "message": 'nodes is forbidden: User "dev" cannot list resource',
                            "reason": "Forbidden", "code": api.status}
                    return self.reply(api.status, body)
                items = {"/api/v1/nodes": api.nodes, "/api/v1/pods": api.pods}.get(url.path)
                if items is None:
                    return self.reply(404, {"kind": "Status", "code": 404, "message": "nf"})
                # serve one item per page to exercise `continue`
                start = int(dict(p.split("=") for p in url.query.split("&") if "=" in p)
                            .get("continue", "0") or 0)
                page = items[start:start + 1]
                cont = str(start + 1) if start + 1 < len(items) else ""
                kind = "NodeList" if url.path.endswith("nodes") else "PodList"
                self.reply(200, {"kind": kind, "apiVersion": "v1",
                                 "metadata": {"resourceVersion": "1", "continue": cont},
                                 "items": page})

            def reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {"token": "t"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }))
    return path


def test_live_cluster_from_kubeconfig_env(capsys, tmp_path, monkeypatch):
    doc = cc.binpack()
    with FakeApi(doc) as api:
        monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}{os.pathsep}"
                           f"{kubeconfig(tmp_path, api.url)}")
        assert run_cli(capsys) == (0, BINPACK, "")
    assert any(p.startswith("/api/v1/pods") for p in api.paths)
    assert any("continue=" in p for p in api.paths)  # every page was read


def test_live_cluster_refusal_is_one_clear_line(capsys, tmp_path):
    with FakeApi(cc.binpack(), status=403) as api:
        rc, out, err = run_cli(capsys, "--kubeconfig", str(kubeconfig(tmp_path, api.url)))
    assert rc == 1 and out == ""
    assert f"the API server at {api.url} refused" in err and "forbidden" in err
    assert "get/list on nodes and pods" in err and "Traceback" not in err


def test_unreachable_cluster_is_one_clear_line(capsys, tmp_path, monkeypatch):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path, f"http://127.0.0.1:{port}")))
    rc, out, err = run_cli(capsys, "--request-timeout", "5")
    assert rc == 1 and out == ""
    assert f"cannot reach the API server at http://127.0.0.1:{port}" in err
    assert "--file DUMP" in err and err.count("\n") == 1


def test_no_kubeconfig_at_all(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nowhere"))
    rc, _, err = run_cli(capsys)
    assert rc == 1 and f"kubeconfig='{tmp_path / 'nowhere'}': no such file" in err
    assert "KUBECONFIG" in err


# --- the kubectl plugin mechanism ----------------------------------------------------------


def kubectl() -> str:
    found = shutil.which("kubectl") or shutil.which("kubectl", path=str(ROOT / ".tools" / "bin"))
    assert found, "kubectl is missing: scripts/install-tools.sh installs it"
    return found


def plugin_env(bindir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["PATH"] = f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    env.update(extra)
    return env


def test_kubectl_finds_the_plugin(tmp_path):
    env = plugin_env(BIN)
    r = subprocess.run([kubectl(), "inspect", "cgpu", "--file", str(DATA / "binpack.json")],
                       capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (0, BINPACK, "")
    r = subprocess.run([kubectl(), "inspect", "cgpu", "-d", "--file", str(DATA / "details.json")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout == DETAILS
    r = subprocess.run([kubectl(), "plugin", "list"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert str(BIN / "kubectl-inspect-cgpu") in r.stdout


def test_kubectl_plugin_reports_an_unreachable_cluster(tmp_path):
    cfg = kubeconfig(tmp_path, "http://127.0.0.1:9")
    r = subprocess.run([kubectl(), "inspect", "cgpu", "--request-timeout", "5"],
                       capture_output=True, text=True, timeout=60,
                       env=plugin_env(BIN, KUBECONFIG=str(cfg)))
    assert r.returncode == 1 and r.stdout == ""
    assert "kubectl inspect cgpu: error: cannot reach the API server at http://127.0.0.1:9" \
        in r.stderr


def test_pip_install_then_kubectl_inspect_cgpu(tmp_path):
    """A wheel built from this checkout and installed with pip gives a working plugin."""
    src = tmp_path / "src"  # a copy, so the build leaves the checkout alone
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.egg-info"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("sharegpu-*.whl")
    # --target: pip leaves this environment's own sharegpu alone (--prefix would uninstall it)
    target = tmp_path / "target"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    script = target / "bin" / "kubectl-inspect-cgpu"
    assert script.is_file()
    site = target
    # the installed copy, not this checkout, must be what runs
    env = plugin_env(target / "bin", PYTHONPATH=str(site), PYTHONSAFEPATH="1")
    r = subprocess.run([kubectl(), "inspect", "cgpu", "--file", str(DATA / "seed003.json")],
                       capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (0, SEED003_ALIGNED, "")
    probe = subprocess.run([sys.executable, "-c", "import sharegpu; print(sharegpu.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    assert probe.stdout.startswith(str(site))


def test_context_picks_another_cluster(capsys, tmp_path):
    """--context: the kubeconfig's current-context names a dead cluster, another context the
    live one."""
    with FakeApi(cc.binpack()) as api:
        path = tmp_path / "two-contexts"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "dead",
            "clusters": [{"name": "dead", "cluster": {"server": "http://127.0.0.1:1"}},
                         {"name": "live", "cluster": {"server": api.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "dead", "context": {"cluster": "dead", "user": "u"}},
                         {"name": "live", "context": {"cluster": "live", "user": "u"}}],
        }))
        assert run_cli(capsys, "--kubeconfig", str(path), "--context", "live") == (
            0, BINPACK, "")
        rc, _, err = run_cli(capsys, "--kubeconfig", str(path), "--context", "nope")
        assert rc == 1 and "no context named 'nope'" in err and "Traceback" not in err


@pytest.mark.parametrize("fixture", sorted(p.name for p in (ROOT / "tests" / "data").glob("*.json")))
def test_details_totals_agree_with_the_columns(capsys, fixture):
    """-d: in every node block, the pods' memory columns (GPUs and PENDING) add up to
    "Allocated", and their compute columns to "Allocated Core"."""
    rc, out, _ = run_cli(capsys, "--file", str(ROOT / "tests" / "data" / fixture), "-d")
    assert rc == 0
    for block in out.split("\nNAME:")[1:]:
        lines = block.splitlines()
        head = next(i for i, ln in enumerate(lines) if ln.startswith("NAME "))
        cols = lines[head].split()
        mem_cols = [i for i, c in enumerate(cols) if c.endswith("(Allocated)")]
        core_cols = [i for i, c in enumerate(cols) if c.endswith("(Core%)")]
        mem = core = 0
        for ln in lines[head + 1:]:
            if ln.startswith("Allocated :"):
                assert int(ln.split()[2]) == mem, block
            elif ln.startswith("Allocated Core :"):
                assert int(ln.split()[3]) == core, block
            elif ln and not ln.startswith(("Total", "-", "Allocated/Total")):
                cells = ln.split()
                mem += sum(int(cells[i]) for i in mem_cols)
                core += sum(int(cells[i]) for i in core_cols)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"kind": ["List"], "items": []}', "field 'kind' must be a string"),
        ('{"kind": "List", "items": [{"kind": {"k": "Node"}}]}',
         "field 'items[0].kind' must be a string (the object's kind, such as Node, Pod or "
         "List), not an object"),
        ('[{"kind": "List", "apiVersion": 1, "items": []}]',
         "field '[0].apiVersion' must be a string (such as v1 or resource.k8s.io/v1), not a "
         "number"),
        ('{"kind": "List", "items": [{"kind": "PodList", "items": [{"kind": true}]}]}',
         "field 'items[0].items[0].kind' must be a string"),
        ('{"kind": "List", "items": [{"kind": "Node"}, 7]}',
         "expected a JSON object of kind List, NodeList or PodList at 'items[1]'"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(capsys, tmp_path, content, message):
    path = tmp_path / "dump.json"
    path.write_text(content)
    rc, out, err = run_cli(capsys, "--file", str(path), "-d", "-o", "json")
    assert rc == 1 and out == ""
    assert message in err and "internal error" not in err, err
    assert err.count("\n") == 1


def test_no_field_of_the_wrong_type_is_an_internal_error(capsys, tmp_path):
    """Every field of a dump (nodes, pods, their labels, annotations, resources), in turn
    replaced by a value of each other JSON type: a clear error or a warning, never an
    internal error."""
    base = json.loads((DATA / "details.json").read_text())

    def paths(o: object, p: tuple = ()):
        yield p
        if isinstance(o, dict):
            for k, v in o.items():
                yield from paths(v, (*p, k))
        elif isinstance(o, list):
            for i, v in enumerate(o[:2]):
                yield from paths(v, (*p, i))

    path = tmp_path / "dump.json"
    tried = 0
    for p in list(paths(base))[1:]:
        for bad in ([], {}, 3, True, "x"):
            doc = json.loads(json.dumps(base))
            o = doc
            for k in p[:-1]:
                o = o[k]
            o[p[-1]] = bad
            path.write_text(json.dumps(doc))
            rc, _, err = run_cli(capsys, "--file", str(path), "-d", "-o", "json")
            assert rc in (0, 1) and "internal error" not in err, (p, bad, err)
            tried += 1
    assert tried > 300


def test_a_lone_surrogate_escape_is_read_as_go_reads_it(capsys, tmp_path):
    """``"\\ud800"`` without its pair is valid JSON that no text can encode: replaced by U+FFFD
    (as Go's decoder does) instead of failing when the table is printed."""
    doc = json.loads((DATA / "details.json").read_text())
    doc["items"][0]["metadata"]["name"] = "gpu-\ud800node"
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(doc))  # ensure_ascii: written as the escape \ud800
    assert "\\ud800" in path.read_text()
    for args in ((), ("-d",), ("-d", "-o", "json")):
        rc, out, err = run_cli(capsys, "--file", str(path), *args)
        assert rc == 0 and err == "", err
        assert "gpu-\ufffdnode" in out or "gpu-\\ufffdnode" in out
        out.encode("utf-8")  # printable
