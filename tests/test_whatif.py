"""``sharegpu whatif``: Today's figures, why pending pods wait, Headroom, the policy marked as
the cluster's, the errors of a bad dump (one line each), gzipped dumps, the outputs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sharegpu.cli import main as sharegpu
from sharegpu.core import names
from sharegpu.core.annotations import Allocation, encode
from sharegpu.core.nodeselector import NodeSelector, node_selector
from sharegpu.core.placement.base import get_policy
from sharegpu.core.scheduler import Scheduler
from sharegpu.whatif.analysis import Options, analyse
from sharegpu.whatif.cluster import read
from sharegpu.whatif.headroom import fits, parse_shape
from sharegpu_testing import kobjects


def bound(name: str, node: str, mem: int, gpu: int, *, cpu: str = "1", created: int = 0,
          owner: bool = True) -> dict:
    obj = kobjects.pod(name, mem=mem, node_name=node, cpu=cpu, memory="1Gi",
                       annotations=encode(Allocation(mem={0: {gpu: mem}}),
                                          assume_time_ns=1000 + created))
    obj["metadata"]["creationTimestamp"] = f"2026-01-01T00:00:{created:02d}Z"
    obj["status"]["phase"] = "Running"
    if owner:
        obj["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                               "name": "rs", "uid": "u", "controller": True}]
    return obj


def pending(name: str, mem: int, created: int = 30, **kw: object) -> dict:
    obj = kobjects.pod(name, mem=mem, cpu="1", memory="1Gi")
    obj["metadata"]["creationTimestamp"] = f"2026-01-01T00:00:{created:02d}Z"
    obj["spec"].update(kw)
    return obj


def small() -> dict:
    """a: 2 × 16 GiB T4 (12 held on GPU 0); b: 1 × 16 GiB A100 (8 held); c: core_mem 16."""
    items = [kobjects.node("a", [16, 16], model="T4"),
             kobjects.node("b", [16], model="A100"),
             kobjects.node("c", [16], "core_mem", model="A100"),
             kobjects.node("cpu-only", [], "cgpu"),
             bound("p1", "a", 12, 0, created=1), bound("p2", "b", 8, 0, created=2),
             pending("big", 20), pending("v100", 4, nodeSelector={names.LABEL_CARD_NAME: "V100"}),
             {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "x"},
              "spec": {"nodeName": "a", "containers": [{"name": "c", "resources": {
                  "requests": {"cpu": "60", "memory": "1Gi"}}}]}, "status": {"phase": "Running"}}]
    return {"apiVersion": "v1", "kind": "List", "items": items}


def test_today_allocated_free_stranded_and_why_pods_wait():
    doc = small()
    cluster = read([o for o in doc["items"] if o["kind"] == "Node"],
                   [o for o in doc["items"] if o["kind"] == "Pod"])
    a = analyse(cluster, Options(policies=["bestfit"]))
    t = a.today.figures.totals()
    # the shapes this cluster asks for: 12 and 8 GiB on one GPU; a's GPU 0 has 4 free
    assert t == {"gpus": 4, "mem_total": 64, "mem_allocated": 20, "mem_free": 44,
                 "mem_stranded": 4, "core_total": 100, "core_allocated": 0, "core_free": 100,
                 "core_stranded": 0, "gpus_free": 2}
    per = {n["node"]: n for n in a.today.per_node}
    assert per["a"]["per_gpu"] == [[12, 4, 0], [0, 0, 16]]
    assert per["b"]["mem_stranded"] == 0 and per["c"]["mode"] == "core_mem"
    why = {p.key: p for p in a.today.pending}
    assert why["default/big"].fits_now == 0
    assert why["default/big"].reasons == [
        ("asks 20 GPU memory per GPU; the largest GPU has 16", 3)]
    assert why["default/v100"].reasons == [
        ("the pod's node selector or affinity does not admit the node", 3)]
    # web's 60 CPUs are a's host CPU (64): a GPU pod asking 1 CPU still fits there
    assert cluster.host == {"a": [60000, 1024]}


def test_headroom_is_the_most_copies_that_fit():
    doc = small()
    cluster = read([o for o in doc["items"] if o["kind"] == "Node"],
                   [o for o in doc["items"] if o["kind"] == "Pod"])
    state, _ = cluster.state()
    shape = parse_shape("gpu-mem=8")
    assert fits(state, shape) == 2 + 1 + 2  # a: GPU 1; b: GPU 0; c: GPU 0
    assert fits(state, parse_shape("gpu-mem=8,model=A100")) == 3
    assert fits(state, parse_shape("gpu-mem=4,core=30")) == 3  # c only, by compute (3 × 30)
    assert fits(state, parse_shape("gpu-mem=8,gpus=2")) == 0  # a: GPU 0 has 4 free
    assert fits(state, parse_shape("gpu-mem=4,gpus=2")) == 1  # a: one copy holds GPU 0's 4
    assert fits(state, parse_shape("gpu-mem=4,cpu=3")) == 1 + 2 + 4  # a has 3 CPUs left
    assert fits(state, parse_shape("cards=1")) == 0  # no exclusive node
    # the count agrees with placing copies one by one until none fits
    sched = Scheduler(state, get_policy("bestfit"))
    n = 0
    while sched.schedule(shape.__class__(shape.namespace, f"copy-{n}", shape.kind,
                                         shape.containers)) is not None:
        n += 1
    assert n == 5


@pytest.mark.parametrize(("text", "field"), [
    ("gpu-mem=8,core=33", "--shape core"), ("gpus=2", "--shape"), ("gpu-mem=x", "--shape gpu-mem"),
    ("gpu-mem=8,cards=1", "--shape"), ("gpu-mem", "--shape"), ("color=red", "--shape"),
])
def test_bad_shapes_are_named(text, field):
    from sharegpu.core.errors import ValidationError

    with pytest.raises(ValidationError) as e:
        parse_shape(text)
    assert e.value.field == field


def test_node_selector_and_affinity():
    pod = {"spec": {"nodeSelector": {"zone": "z1"}, "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": names.LABEL_CARD_NAME, "operator": "In",
                                   "values": ["A100", "H100"]}]},
            {"matchExpressions": [{"key": "big", "operator": "Exists"},
                                  {"key": "gpus", "operator": "Gt", "values": ["4"]}]}]}}}}}
    sel = node_selector(pod)
    assert sel.matches({"zone": "z1", names.LABEL_CARD_NAME: "A100"})
    assert not sel.matches({"zone": "z2", names.LABEL_CARD_NAME: "A100"})
    assert not sel.matches({"zone": "z1", names.LABEL_CARD_NAME: "T4"})
    assert sel.matches({"zone": "z1", "big": "", "gpus": "8"})
    assert not sel.matches({"zone": "z1", "big": "", "gpus": "4"})
    assert NodeSelector().empty and node_selector({"spec": {}}).empty
    from sharegpu.core.errors import ValidationError

    with pytest.raises(ValidationError, match="operator"):
        node_selector({"spec": {"affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "k", "operator": "Near"}]}]}}}}})


def _write(tmp_path: Path, doc: object, gz: bool = False) -> Path:
    raw = json.dumps(doc).encode()
    path = tmp_path / ("dump.json.gz" if gz else "dump.json")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def test_cli_table_json_gzip_and_the_current_policy(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    doc = small()
    extender = kobjects.pod("sharegpu-extender-0", namespace="kube-system", node_name="cpu-only")
    extender["spec"]["containers"][0]["command"] = ["sharegpu", "extender", "--policy", "fgd"]
    extender["status"]["phase"] = "Running"
    doc["items"].append(extender)
    path = _write(tmp_path, doc, gz=True)
    assert sharegpu(["whatif", str(path), "--policy", "fgd", "--policy", "bestfit", "--json",
                     "--shape", "gpu-mem=8"]) == 0
    out = json.loads(capsys.readouterr().out)
    pols = {p["policy"]: p for p in out["replay"]["policies"]}
    assert out["replay"]["current_policy"] == "fgd" and pols["fgd"]["current"]
    assert not pols["bestfit"]["current"]
    assert "extender's Pod" in out["replay"]["current_policy_from"]
    assert out["headroom"]["now"] == 5 and set(out["headroom"]["after_replay"]) == {"fgd",
                                                                                  "bestfit"}
    assert out["today"]["totals"]["mem_stranded"] == 4
    # the flag wins over the dump; the table marks the policy
    assert sharegpu(["whatif", str(path), "--policy", "fgd", "--policy", "bestfit",
                     "--current-policy", "bestfit"]) == 0
    text = capsys.readouterr().out
    assert "bestfit (now)" in text and "fgd (now)" not in text and "Today" in text


def test_cli_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = _write(tmp_path, small())
    png = tmp_path / "w.png"
    assert sharegpu(["whatif", str(path), "--policy", "bestfit", "--policy", "spread",
                     "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("content", "message"), [
    (b"{not json", "not JSON (line 1, column 2"),
    (json.dumps({"kind": "DeploymentList", "items": [
        {"kind": "Deployment", "metadata": {"name": "d"}}] * 2}).encode(),
     "holds no Node objects (it holds 2 Deployment); write it with: kubectl get nodes,pods"),
    (json.dumps({"kind": "List", "items": [kobjects.node("a", [16])]}).encode(),
     "holds no Pod objects; write the dump with: kubectl get nodes,pods -A -o json"),
    (gzip.compress(b"{}")[:12], "a gzip file that does not decompress"),
    (b"\xff\xfe", "not UTF-8 text (nor gzip)"),
    (json.dumps({"kind": "List", "items": [kobjects.node("n", []), kobjects.pod("p")]}).encode(),
     "no node shares GPUs"),
])
def test_a_bad_dump_gets_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "dump"
    path.write_bytes(content)
    assert sharegpu(["whatif", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and message in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_bad_arguments_are_named(capsys, tmp_path):
    path = _write(tmp_path, small())
    assert sharegpu(["whatif", str(path), "--policy", "nope"]) == 2
    assert "policy='nope': must be one of" in capsys.readouterr().err
    assert sharegpu(["whatif", str(path), "--orderings", "0"]) == 2
    assert "--orderings" in capsys.readouterr().err


def test_inspect_reads_a_gzipped_dump(capsys, tmp_path):
    from sharegpu.inspect_cgpu.cli import main as inspect

    plain = _write(tmp_path, small())
    assert inspect(["--file", str(plain)]) == 0
    want = capsys.readouterr().out
    (tmp_path / "z").mkdir()
    zipped = _write(tmp_path / "z", small(), gz=True)
    assert inspect(["--file", str(zipped)]) == 0
    assert capsys.readouterr().out == want and "12/32" in want


def test_live_cluster(capsys, tmp_path):
    from test_inspect_cli import FakeApi, kubeconfig

    with FakeApi(small()) as api:
        rc = sharegpu(["whatif", "--kubeconfig", str(kubeconfig(tmp_path, api.url)),
                       "--policy", "bestfit", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["today"]["totals"]["mem_allocated"] == 20
    assert out["replay"]["bound_gpu_pods"] == 2 and out["replay"]["pending_gpu_pods"] == 2


def test_kubectl_inspect_cgpu_what_if_is_the_same_analysis(capsys, tmp_path):
    from sharegpu.inspect_cgpu.cli import main as inspect
    from sharegpu.whatif.plugin import main as plugin

    path = _write(tmp_path, small())
    assert plugin(["--what-if", "--file", str(path), "--policy", "bestfit", "--json"]) == 0
    via_kubectl = json.loads(capsys.readouterr().out)
    assert sharegpu(["whatif", str(path), "--policy", "bestfit", "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)
    for doc in (via_kubectl, direct):
        doc.pop("seconds")
        for p in doc["replay"]["policies"]:
            p.pop("cpu_seconds")
    assert via_kubectl == direct
    assert plugin(["--file", str(path)]) == 0  # without --what-if: inspect, as ever
    shown = capsys.readouterr().out
    assert inspect(["--file", str(path)]) == 0 and capsys.readouterr().out == shown
    assert plugin(["--what-if", f"--file={tmp_path / 'nowhere'}"]) == 1
    assert "kubectl inspect cgpu --what-if: error: --file" in capsys.readouterr().err


def test_whatif_reads_any_mutated_dump():
    """Objects of the wrong shape are left out with a warning; no exception escapes."""
    import copy

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from test_fuzz_entry_points import _paths

    base = small()["items"]
    paths = [p for p in _paths(base) if p]
    values = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.text(max_size=5),
                       st.just([]), st.just({}), st.just({"a": 1}), st.just(["x"]))

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.tuples(st.sampled_from(paths), values), min_size=1, max_size=3))
    def check(changes):
        items = copy.deepcopy(base)
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
        cluster = read(nodes, pods)
        a = analyse(cluster, Options(policies=["bestfit"], shape=(parse_shape("gpu-mem=4"),
                                                                  NodeSelector())))
        json.dumps(a.to_json())

    check()
