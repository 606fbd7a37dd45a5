"""No hand-written manifest can break a cluster: the only manifests are the chart's. A raw
manifest kept beside the chart drifted from it (an empty caBundle with failurePolicy Fail and no
matchConditions refused every pod outside kube-system; a second scheduler elected on a Lease its
role could not update). Plain YAML is `helm template` of the chart, checked in test_chart.py."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SKIP = {".venv", ".tools", ".git", "charts", "tests", "node_modules", ".ruff_cache",
        ".pytest_cache", "__pycache__"}
KINDS = {"Deployment", "DaemonSet", "ValidatingWebhookConfiguration",
         "MutatingWebhookConfiguration", "ClusterRole", "Role", "ConfigMap", "Service"}


def manifests_outside_the_chart() -> list[str]:
    found = []
    for path in ROOT.rglob("*.y*ml"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or any(p in SKIP for p in rel.parts):
            continue
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        except yaml.YAMLError:
            continue
        if any(d.get("kind") in KINDS for d in docs):
            found.append(str(rel))
    return sorted(found)


def test_no_hand_written_manifests_beside_the_chart() -> None:
    assert manifests_outside_the_chart() == []
    assert not (ROOT / "deploy").exists()


def test_docs_point_to_the_chart_for_plain_manifests() -> None:
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "kubectl apply -f deploy/" not in doc.read_text(), doc
    assert "helm template sharegpu charts/sharegpu" in (ROOT / "docs" / "extender.md").read_text()
