"""Clusters for the ``kubectl inspect cgpu`` tests, built the way a live one is: Node objects as
the node agent leaves them, pods placed by the core scheduler (the code the extender runs) with
the decision written to their annotations, then written out as ``kubectl get nodes,pods -A -o
json`` would. ``python tests/cgpu_cluster.py`` rewrites the dumps in tests/data/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from sharegpu.core import names  # noqa: E402
from sharegpu.core.annotations import encode  # noqa: E402
from sharegpu.core.modes import advertised_resources, card_model_labels, parse_mode  # noqa: E402
from sharegpu.core.nodes import spec_from_node  # noqa: E402
from sharegpu.core.placement import get_policy  # noqa: E402
from sharegpu.core.request import parse_pod  # noqa: E402
from sharegpu.core.scheduler import Scheduler  # noqa: E402
from sharegpu.core.state import ClusterState  # noqa: E402

DATA = ROOT / "data"
ASSUME_NS = 1_700_000_000_000_000_000


def node(
    name: str, address: str, gpu_mem: list[int], mode: str = "cgpu",
    placement: str | None = None, annotate: bool = True,
) -> dict[str, Any]:
    labels = {names.LABEL_SCHEDULE: mode, "kubernetes.io/hostname": name}
    if placement:
        labels[names.LABEL_PLACEMENT] = placement
    labels.update(card_model_labels("Tesla T4", 15360, len(gpu_mem)))
    res = {k: str(v) for k, v in advertised_resources(parse_mode(mode), gpu_mem).items()}
    alloc = {"cpu": "16", "memory": "64Gi", "pods": "110", **res}
    ann = {names.ANN_NODE_GPU_MEM: ",".join(map(str, gpu_mem))} if annotate else {}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": ann},
        "status": {
            "addresses": [{"type": "InternalIP", "address": address},
                          {"type": "Hostname", "address": name}],
            "allocatable": alloc, "capacity": dict(alloc),
        },
    }


def pod(
    name: str, mem: int, core: int = 0, namespace: str = "default", phase: str = "Running",
    gpu_count: int | None = None,
) -> dict[str, Any]:
    limits: dict[str, str] = {names.RES_GPU_MEM: str(mem)}
    if core:
        limits[names.RES_GPU_CORE] = str(core)
    labels = {"app": name.rsplit("-", 1)[0]}
    if gpu_count:
        labels[names.POD_LABEL_GPU_COUNT] = str(gpu_count)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels,
                     "uid": f"uid-{namespace}-{name}", "annotations": {}},
        "spec": {"schedulerName": names.CO_SCHEDULER_NAME,
                 "containers": [{"name": "main", "image": "sample:1",
                                 "resources": {"limits": limits}}]},
        "status": {"phase": "Pending"},
        "_phase": phase,
    }


def schedule(nodes: list[dict[str, Any]], pods: list[dict[str, Any]],
             policy: str = "binpack") -> list[dict[str, Any]]:
    """Place the pods in order with the core scheduler; write nodeName, the annotations of both
    generations and the phase each pod is meant to have. Pods that fit nowhere stay Pending."""
    specs = [s for s in (spec_from_node(n) for n in nodes) if s is not None]
    state = ClusterState(specs)
    sched = Scheduler(state, get_policy(policy))
    out = []
    for p in pods:
        p = json.loads(json.dumps(p))
        phase = p.pop("_phase")
        d = sched.schedule(parse_pod(p))
        if d is not None:
            p["metadata"]["annotations"].update(
                encode(d.alloc, assume_time_ns=ASSUME_NS,
                       gpu_capacity=state.gpu_capacity(d.node_name)))
            p["spec"]["nodeName"] = d.node_name
            p["status"]["phase"] = phase
        out.append(p)
    return out


def dump(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": [*nodes, *pods],
            "metadata": {"resourceVersion": ""}}


SEED_NODE = ("cn-shanghai.192.0.2.109", "192.0.2.109")


def binpack() -> dict[str, Any]:
    """Seed 000, binpack: 15/15 9/15 0/15 0/15 on one node with 4 GPUs x 15 GiB."""
    n = node(*SEED_NODE, [15, 15, 15, 15], placement="binpack")
    pods = [pod("infer-a", 8), pod("infer-b", 7), pod("infer-c", 9)]
    return dump([n], schedule([n], pods))


def spread() -> dict[str, Any]:
    """Seed 000, spread: four 4 GiB pods spread over the 4 GPUs; the one on GPU2 has finished,
    so it no longer counts: 4/15 4/15 0/15 4/15."""
    n = node(*SEED_NODE, [15, 15, 15, 15], placement="spread")
    pods = [pod("web-a", 4), pod("web-b", 4), pod("web-c", 4, phase="Succeeded"), pod("web-d", 4)]
    return dump([n], schedule([n], pods))


def seed002() -> dict[str, Any]:
    """Seed 002: one node, one GPU of 15 GiB, nothing allocated."""
    return dump([node("cn-shanghai.192.168.6.104", "192.168.6.104", [15])], [])


def seed003() -> dict[str, Any]:
    """Seed 003: the gpu-share-sample job (3 GiB) on a one-GPU node."""
    n = node("cn-zhangjiakou.192.168.66.139", "192.168.66.139", [15], mode="share")
    return dump([n], schedule([n], [pod("gpu-share-sample-7xk2p", 3)]))


def details() -> dict[str, Any]:
    """SPEC §7's ``-d`` sample: 8 of a node's 15 GiB allocated (53 %)."""
    n = node(*SEED_NODE, [15])
    return dump([n], schedule([n], [pod("sample-a", 5), pod("sample-b", 3)]))


def core_mem() -> dict[str, Any]:
    """Seed 001: a core_mem node with 4 GPUs x 15 GiB running the cuda-sample job (2 GiB, 30 %)
    twice, plus one pod not placed yet (PENDING) and a cgpu node beside it."""
    a = node("gpu-core-1", "10.0.0.11", [15, 15, 15, 15], mode="core_mem", placement="binpack")
    b = node("gpu-mem-1", "10.0.0.12", [15, 15], mode="cgpu")
    pods = schedule([a, b], [pod("cuda-sample-m1", 2, 30), pod("cuda-sample-m2", 2, 30),
                             pod("infer-x", 6)])
    waiting = pod("cuda-sample-m3", 2, 30)
    waiting.pop("_phase")
    waiting["spec"]["nodeName"] = "gpu-core-1"  # bound, not yet given a GPU index
    return dump([a, b], [*pods, waiting])


def quickstart() -> dict[str, Any]:
    """docs/quickstart.md: a core_mem node with 4 GPUs x 15 GiB running seed 001's cuda-sample
    job (2 GiB, 30 %)."""
    n = node("gpu-node-1", "10.0.0.21", [15, 15, 15, 15], mode="core_mem", placement="binpack")
    p = pod("cuda-sample-m5x2q", 2, 30)
    p["metadata"]["labels"] = {"app": "cuda-sample", "batch.kubernetes.io/job-name": "cuda-sample"}
    return dump([n], schedule([n], [p]))


DUMPS = {"binpack": binpack, "spread": spread, "seed002": seed002, "seed003": seed003,
         "details": details, "core_mem": core_mem, "quickstart": quickstart}


if __name__ == "__main__":
    for key, make in DUMPS.items():
        path = DATA / f"{key}.json"
        path.write_text(json.dumps(make(), indent=2) + "\n")
        print(path)
