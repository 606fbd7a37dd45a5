"""docs/quickstart.md: its manifests are valid, its sample job asks for what the seed's does,
and the `kubectl inspect cgpu` output it shows is what the tool prints for that cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import cgpu_cluster as cc
from sharegpu.core.request import Kind, parse_pod
from sharegpu.inspect_cgpu import render
from sharegpu.inspect_cgpu.model import build

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "quickstart.md").read_text()


def blocks(lang: str) -> list[str]:
    """Contents of the fenced code blocks tagged ``lang`` ('' for untagged ones)."""
    out: list[str] = []
    current: list[str] | None = None
    tag = ""
    for line in DOC.splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, tag = [], line[3:].strip()
            else:
                if tag == lang:
                    out.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return out


def jobs() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in (yaml.safe_load(b) for b in blocks("yaml"))
            if d.get("kind") == "Job"}


def test_sample_job_is_valid_and_asks_for_2_gib_and_30_percent():
    assert sorted(jobs()) == ["cuda-sample", "gang-train"]
    job = jobs()["cuda-sample"]
    kubernetes_validate.validate(job, "1.30.0", strict=True)
    template = job["spec"]["template"]
    req = parse_pod({"metadata": {"name": "cuda-sample-x", **template["metadata"]},
                     "spec": template["spec"]})
    assert req.kind is Kind.SHARED_CORE
    (c,) = req.containers
    assert (c.gpu_mem, c.gpu_core, c.gpus) == (2, 30, 1)
    assert template["spec"]["schedulerName"] == "ack-co-scheduler"


def test_gang_job_is_valid_and_one_group_of_four():
    from sharegpu.core.gang import gang_labels

    job = jobs()["gang-train"]
    kubernetes_validate.validate(job, "1.30.0", strict=True)
    template = job["spec"]["template"]
    g = gang_labels(template["metadata"]["labels"])
    assert g is not None and (g.name, g.min_available) == ("gang-train", 4)
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == 4
    req = parse_pod({"metadata": {"name": "gang-train-0", **template["metadata"]},
                     "spec": template["spec"]})
    assert req.kind is Kind.SHARED and template["spec"]["schedulerName"] == "ack-co-scheduler"
    assert "kubectl apply -f gang-train.yaml" in "\n".join(blocks("bash"))


def test_inspect_output_in_the_doc_is_the_tools_output():
    doc = cc.quickstart()
    items = doc["items"]
    nodes = [i for i in items if i["kind"] == "Node"]
    view = build(nodes, [i for i in items if i["kind"] == "Pod"])
    plain = blocks("")
    assert render.summary(view) in plain
    assert render.details(view) in plain


def test_doc_covers_install_label_check_inspect_upgrade_uninstall():
    bash = "\n".join(blocks("bash"))
    for cmd in ["helm install sharegpu charts/sharegpu", "ack.node.gpu.schedule=core_mem",
                "ack.node.gpu.schedule=default --overwrite",
                "grep -E 'aliyun\\.com/gpu-core\\.percentage|aliyun\\.com/gpu-mem'",
                "kubectl apply -f cuda-sample.yaml", "kubectl inspect cgpu",
                "kubectl get nodes,pods -A -o json > cluster-dump.json",
                "kubectl inspect cgpu -d --file cluster-dump.json",
                "helm upgrade sharegpu charts/sharegpu", "helm uninstall sharegpu"]:
        assert cmd in bash, cmd
    # every example values file the doc names exists
    for name in re.findall(r"`([a-z-]+\.yaml)`", DOC):
        if name not in ("cuda-sample.yaml", "gang-train.yaml"):
            assert (ROOT / "charts" / "sharegpu" / "examples" / name).is_file(), name


def test_readme_points_to_the_quickstart():
    readme = (ROOT / "README.md").read_text()
    assert "docs/quickstart.md" in readme and "kubectl inspect cgpu" in readme


def test_resourcepolicy_example_is_accepted_by_the_crd_and_the_extender():
    import jsonschema

    from sharegpu.core.resourcepolicy import TIMEOUT_OR_MAX, parse_policy
    from test_chart import _policy_schema, render

    (rp,) = [d for d in map(yaml.safe_load, blocks("yaml")) if d["kind"] == "ResourcePolicy"]
    jsonschema.validate(rp, _policy_schema(render(None)))
    p = parse_policy(rp)
    assert [u.max for u in p.units] == [10, 10, None]
    assert (p.when, p.timeout_s) == (TIMEOUT_OR_MAX, 300.0)
    for doc in ((ROOT / "docs" / "resourcepolicy.md").read_text(),
                (ROOT / "docs" / "extender.md").read_text()):
        text = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
        parse_policy(yaml.safe_load(text))


# --- the docs say what the code does ---------------------------------------------------------


def section(title: str, text: str = DOC) -> str:
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_every_extender_metric_is_in_the_extenders_doc():
    from sharegpu.extender.metrics import Metrics

    names = {fam.name + ("_total" if fam.type == "counter" else "")
             for fam in Metrics().registry.collect()}
    assert len(names) >= 12
    doc = (ROOT / "docs" / "extender.md").read_text()
    missing = sorted(n for n in names if f"`{n}" not in doc)
    assert not missing, missing


def test_uninstall_removes_every_mark_the_agent_leaves_on_a_node():
    from sharegpu.core import names

    text = section("Uninstall")
    marks = [v for k, v in vars(names).items()
             if k.startswith(("ANN_NODE_", "LABEL_CARD_"))] + [names.LABEL_SCHEDULE]
    assert len(marks) >= 8
    for mark in marks:
        assert f" {mark}-" in text, mark
    assert names.CONDITION_ISOLATION in text and '"op": "remove"' in text


def test_the_main_values_table_gives_the_charts_defaults():
    """Each row's default is values.yaml's; the values that open the node to the agent
    (hostPID, a hostPath) and the opt-in mutating webhook are among the rows."""
    values = yaml.safe_load((ROOT / "charts" / "sharegpu" / "values.yaml").read_text())
    rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", DOC, flags=re.M)
    keys = [k for k, _ in rows]
    assert {"agent.usageMetrics", "agent.podResourcesDir", "webhook.setSchedulerName"} <= set(keys)
    for key, default in rows:
        v = values
        for part in key.split("."):
            v = v[part]
        if isinstance(v, bool):
            shown = "true" if v else "false"
        elif isinstance(v, list) or v == "":
            shown = json.dumps(v)
        else:
            shown = str(v)
        assert default == shown, (key, default, v)


def test_hamis_image_is_not_called_pinned_while_it_has_no_digest():
    hami = yaml.safe_load((ROOT / "charts" / "sharegpu" / "values.yaml").read_text())[
        "agent"]["hami"]["image"]
    mentions = [p for p in re.split(r"\n\s*\n|\n- ", DOC) if "projecthami/hami`" in p]
    assert mentions
    for p in mentions:
        if not hami["digest"]:
            assert "pinned in" not in p and "agent.hami.image.digest" in p, p


@pytest.mark.parametrize("backend", ["hami", "hami-mps"])
def test_the_notes_say_what_core_mem_holds(backend):
    from test_chart import CHART, NS, run_helm

    r = run_helm("install", "sharegpu", str(CHART), "-n", NS, "--dry-run=client",
                 "--set", f"coreMemIsolation={backend}")
    assert r.returncode == 0, r.stderr
    notes = " ".join(r.stdout.split("NOTES:", 1)[1].split())
    clause = notes.split("core_mem:", 1)[1].split(";", 1)[0]
    if backend == "hami":  # README: compute "not held" on hami
        assert "NOT capped" in clause, clause
    else:
        assert "capped per process by MPS" in clause, clause


def test_the_sizing_figures_are_the_benchmarks():
    """Every MiB figure of the quickstart's sizing paragraph is in bench/README.md, with the
    benchmark that made it."""
    sizing = DOC.split("**Sizing.**", 1)[1].split("\n\n", 1)[0]
    figures = re.findall(r"(\d[\d,.]*) MiB", sizing)
    assert figures
    bench = (ROOT / "bench" / "README.md").read_text()
    for f in figures:
        assert re.search(rf"\b{re.escape(f)}(\.\d)? MiB", bench), f
    for script in re.findall(r"`(bench/\w+\.py)`", sizing):
        assert (ROOT / script).is_file() and script in bench, script


def test_the_support_matrix_names_the_versions_the_tests_pin():
    matrix = DOC.split("**What it has been run on**", 1)[1].split("\n\n", 2)[1]
    k8s = re.search(r"^\s*k8s\.io/kubernetes v(\S+)$",
                    (ROOT / "e2e" / "controlplane" / "go.mod").read_text(), flags=re.M).group(1)
    node = (ROOT / "e2e" / "node" / "go.mod").read_text()
    containerd = re.search(r"github\.com/containerd/containerd/v2 v(\S+)", node).group(1)
    runc = re.search(r"github\.com/opencontainers/runc v(\S+)", node).group(1)
    assert f"| Kubernetes | {k8s} " in matrix
    assert f"containerd {containerd} with runc {runc}" in matrix
    chart_test = (ROOT / "tests" / "test_chart.py").read_text()
    rendered = re.search(r'parametrize\("kube", \[([^\]]*)\]\)', chart_test).group(1)
    for v in re.findall(r'"(\d+\.\d+)\.0"', rendered):
        assert v in matrix.split("renders and validates for", 1)[1].split("|", 1)[0], v
    bench = (ROOT / "bench" / "README.md").read_text()
    driver = re.search(r"driver (\d+\.\d+\.\d+), CUDA (\d+\.\d+)", matrix)
    assert driver and f"driver {driver.group(1)}, CUDA {driver.group(2)}" in bench
