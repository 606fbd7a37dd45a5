"""Shared test helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sharegpu_testing.fixtures import fake_api, fake_api_env, fake_api_factory  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
OPENB = Path(os.environ.get("SHAREGPU_OPENB", ROOT.parent / "shared" / "traces" / "openb"))


@pytest.fixture
def openb() -> Path:
    """The public openb trace (never shipped with the project); CI has it beside the clone."""
    if not (OPENB / "openb_node_list_gpu_node.csv").is_file():
        pytest.skip(f"openb trace not found at {OPENB} (set SHAREGPU_OPENB)")
    return OPENB


def pod(
    name: str = "p",
    containers: list[dict] | None = None,
    labels: dict[str, str] | None = None,
    namespace: str = "default",
    annotations: dict[str, str] | None = None,
    node: str | None = None,
    phase: str | None = None,
) -> dict:
    """A pod object as the API server returns it."""
    obj: dict = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                     "annotations": annotations or {}, "uid": f"uid-{name}"},
        "spec": {"containers": containers or [{"name": "main"}]},
        "status": {},
    }
    if node:
        obj["spec"]["nodeName"] = node
    if phase:
        obj["status"]["phase"] = phase
    return obj


def limits(name: str = "main", **res: object) -> dict:
    """A container with GPU limits; keyword names use '_' for '/' and '.' (see RES)."""
    return {"name": name, "resources": {"limits": {RES[k]: v for k, v in res.items()}}}


RES = {
    "mem": "aliyun.com/gpu-mem",
    "core": "aliyun.com/gpu-core.percentage",
    "count": "aliyun.com/gpu-count",
    "nvidia": "nvidia.com/gpu",
    "topo": "aliyun.com/gpu",
}
