"""The simulator: trace reading, the workload protocol, the curve, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sharegpu.cli import main, parse_seeds
from sharegpu.core.errors import ValidationError
from sharegpu.sim import generate
from sharegpu.sim.engine import curve_points, run_one
from sharegpu.sim.trace import TracePod, read_nodes, read_pods
from sharegpu.sim.workload import stream, target_workload


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_trace_errors_name_the_file_line_and_column(tmp_path):
    p = write(tmp_path / "pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
              "a,1000,100,1,500\nb,1000,100,2,500\n")
    with pytest.raises(ValidationError) as e:
        read_pods(p)
    assert str(e.value) == "pods.csv:3: gpu_milli=500: must be 1000 when num_gpu > 1"
    p = write(tmp_path / "pods2.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,x,1,0,0\n")
    with pytest.raises(ValidationError, match=r"pods2.csv:2: cpu_milli='x': must be a whole"):
        read_pods(p)
    p = write(tmp_path / "pods3.csv", "name,cpu\n")
    with pytest.raises(ValidationError, match="needs columns cpu_milli, memory_mib"):
        read_pods(p)
    with pytest.raises(ValidationError, match="does not exist"):
        read_nodes(tmp_path / "missing.csv")


def test_trace_reader(tmp_path):
    p = write(tmp_path / "n.csv", "sn,cpu_milli,memory_mib,gpu,model\nx,1000,10,0,\ny,96000,100,8,G2\n")
    nodes = read_nodes(p)
    assert [(n.name, len(n.gpu_mem), n.model) for n in nodes] == [("y", 8, "G2")]
    p = write(tmp_path / "p.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
              "a,1000,10,1,460,V100M16|V100M32\nb,500,10,0,0,nan\n")
    a, b = read_pods(p)
    assert a.request().models == frozenset({"V100M16", "V100M32"})
    assert b.gpu_spec == "" and b.request().containers == ()


def test_stream_keeps_originals_and_inflates_to_the_budget():
    pods = [TracePod(f"p{i}", 1000, 10, 1, 500) for i in range(10)] + [
        TracePod("c", 1000, 10, 0, 0), TracePod("m", 1000, 10, 2, 1000)]
    seq = stream(pods, capacity_gpus=10, seed=1)
    assert sorted(p.name for p in seq[:12]) == sorted(p.name for p in pods)
    total = sum(p.gpu_demand for p in seq)
    assert total <= 1.3 * 10 * 1000 + 1000  # a 2-GPU copy may pass by its second GPU
    assert total > 1.3 * 10 * 1000 - 1000
    assert all("-tuned-" in p.name for p in seq[12:])
    assert stream(pods, 10, seed=1) == seq and stream(pods, 10, seed=2) != seq


def test_curve_points_average_the_events_that_round_to_each_percent():
    arrived = np.array([0.4, 99.6, 100.2, 100.4, 101.0])
    alloc = np.array([0.4, 95.0, 96.0, 97.0, 97.0])
    c = curve_points(arrived, alloc)
    assert c[100] == 96.0 and c[0] == 0.4
    assert c[50] is None and c[130] is None


def test_target_workload_covers_95_percent():
    pods = [TracePod(f"a{i}", 1000, 1, 1, 500) for i in range(90)] + [
        TracePod(f"b{i}", 2000, 1, 1, 200) for i in range(6)] + [
        TracePod(f"c{i}", 3000, 1, 0, 0) for i in range(4)]
    wl = target_workload(pods)
    assert wl.size == 2 and np.allclose(wl.p, [90 / 96, 6 / 96])


def test_a_run_on_the_generated_cluster():
    nodes, pods = generate.nodes(), generate.pods()
    r = run_one(nodes, pods, "bestfit", 42, "generated", target_workload(pods))
    assert 0 < r.unallocated_pct < 30
    assert r.placed > 0 and r.pods > len(pods)
    # allocation never exceeds what arrived, and at low load nearly everything is placed
    assert all(y <= x + 0.5 for x, y in enumerate(r.curve) if y is not None)
    assert r.curve[20] is not None and r.curve[20] > 19


def test_parse_seeds():
    assert parse_seeds("42..51") == list(range(42, 52))
    assert parse_seeds("1,3") == [1, 3]
    for bad in ("x", "5..1", ""):
        with pytest.raises(ValidationError):
            parse_seeds(bad)


def test_cli_json(capsys):
    assert main(["simulate", "--seeds", "42", "--policy", "bestfit", "--policy", "fgd",
                 "--json", "--jobs", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == ["bestfit", "fgd"]
    r = out["results"][1]
    assert set(r) >= {"policy", "workload", "seeds", "unallocated_pct", "curve", "pods_per_s"}
    assert set(r["unallocated_pct"]) == {"mean", "sd"} and r["workload"] == "generated"
    assert r["curve"][0]["arrived_pct"] == 0 and r["curve"][0]["allocated_pct"] <= 0.5


def test_cli_plot(tmp_path):
    png = tmp_path / "fig.png"
    assert main(["simulate", "--seeds", "42", "--policy", "bestfit", "--jobs", "1",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "message"), [
    (["simulate", "--seeds", "9..1"], "--seeds='9..1': a range N..M needs M >= N"),
    (["simulate", "--policy", "nope"], "policy='nope': must be one of"),
    (["simulate", "--trace", "/nonexistent"], "--trace='/nonexistent': must be a folder"),
    (["simulate", "--workload", "x"], "--workload='x': without --trace the only workload is"),
])
def test_cli_errors_are_one_clear_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_bad_trace_file_is_a_clear_error(tmp_path):
    write(tmp_path / "openb_node_list_gpu_node.csv", "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,x,\n")
    write(tmp_path / "openb_pod_list_default.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n")
    p = subprocess.run([sys.executable, "-m", "sharegpu.cli", "simulate", "--trace", str(tmp_path),
                        "--seeds", "1"], capture_output=True, text=True)
    assert p.returncode == 2
    assert "openb_node_list_gpu_node.csv:2: gpu='x': must be a whole number" in p.stderr
    assert "Traceback" not in p.stderr


def test_generate_writes_openb_files(tmp_path):
    assert main(["generate", "--out", str(tmp_path)]) == 0
    nodes = read_nodes(tmp_path / "openb_node_list_gpu_node.csv")
    pods = read_pods(tmp_path / "openb_pod_list_generated.csv")
    assert len(nodes) == generate.DEFAULT_NODES and len(pods) == generate.DEFAULT_PODS
    assert pods == generate.pods()


def test_cli_default_without_a_trace_is_the_quick_look(capsys):
    assert main(["simulate", "--seeds", "42", "--json", "--jobs", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == ["random", "bestfit", "fgd", "strandfill"]


def test_defaults_with_a_trace_are_the_papers_comparison():
    from sharegpu.commands.simulate import defaults

    assert defaults(True) == (
        ["random", "dotprod", "clustering", "packing", "bestfit", "fgd", "strandfill"], "42..51")
    assert defaults(False) == (["random", "bestfit", "fgd", "strandfill"], "42..44")


def test_an_unknown_workload_lists_the_ones_there(tmp_path, capsys):
    generate.write(tmp_path)
    (tmp_path / "openb_pod_list_other.csv").write_text(
        (tmp_path / "openb_pod_list_generated.csv").read_text())
    assert main(["simulate", "--trace", str(tmp_path), "--workload", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--workload='nope'" in err and "its workloads: generated, other" in err


def test_generate_says_how_to_use_what_it_wrote(tmp_path, capsys):
    assert main(["generate", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"sharegpu simulate --trace {tmp_path} --workload generated" in out
