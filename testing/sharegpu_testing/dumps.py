"""A ``kubectl get nodes,pods -A -o json`` dump synthesised from an openb-format cluster and
workload: the simulator places the seed's pod stream under one policy, and each pod is written
as the extender would have left it (its decision's annotations, both generations, with the
decision's time as assume-time; ``nodeName``; a ``nodeSelector`` or node affinity on the card
model for a pod the trace pins to models). Nodes are named so that listed by name they come in
the seed's node order (:func:`sharegpu_testing.replay.node_names`), as the simulator ranks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sharegpu.core import names
from sharegpu.core.annotations import encode
from sharegpu.core.errors import ValidationError
from sharegpu.core.placement.fragmentation import TargetWorkload
from sharegpu.core.scheduler import Decision
from sharegpu.core.state import NodeSpec
from sharegpu.sim.engine import run_one
from sharegpu.sim.trace import TracePod
from sharegpu.sim.workload import stream

from .replay import NAMESPACE, node_names, node_object, pod_object


@dataclass
class Dump:
    doc: dict[str, Any]  # the List
    seq: list[TracePod]  # the seed's stream, in order
    decisions: list[Decision | None]  # each pod's, under the placing policy
    to_k8s: dict[str, str]  # trace node name -> Node name

    @staticmethod
    def key(i: int) -> str:
        """The state key of the stream's ``i``-th pod."""
        return f"{NAMESPACE}/p{i:05d}"


def gpu_target(seq: Sequence[TracePod]) -> TargetWorkload:
    """The target the extender learns from the placed GPU pods ``seq``: each pod's
    (CPU, GPU per GPU, GPUs) with its host memory, no card models (the extender's requests
    carry none: kube-scheduler applies node selectors before asking it)."""
    gpu = [tp for tp in seq if tp.num_gpu]
    return TargetWorkload.from_shapes([(tp.cpu_milli, tp.gpu_milli, tp.num_gpu, "")
                                       for tp in gpu], mem=[tp.mem_mib for tp in gpu])


def place(nodes: Sequence[NodeSpec], pods: Sequence[TracePod], policy: str, seed: int,
          target: TargetWorkload, inflation: float) -> list[Decision | None]:
    """``sharegpu simulate``'s decisions for the seed's stream (:func:`run_one`). A stream
    below the cluster's capacity has no headline, and run_one says so once every pod is
    decided: the decisions are what is wanted here."""
    decisions: list[Decision | None] = []
    try:
        run_one(nodes, pods, policy, seed, "synthesised", target, inflation,
                decisions=decisions)
    except ValidationError as e:
        if "never reaches 100 %" not in str(e):
            raise
    return decisions


def _pin(obj: dict[str, Any], spec: str) -> None:
    models = sorted(spec.split("|"))
    if len(models) == 1:
        obj["spec"]["nodeSelector"] = {names.LABEL_CARD_NAME: models[0]}
        return
    obj["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": names.LABEL_CARD_NAME, "operator": "In",
                                   "values": models}]}]}}}


def synthesise(nodes: Sequence[NodeSpec], pods: Sequence[TracePod], *, policy: str,
               seed: int = 0, inflation: float = 0.7, target: TargetWorkload | None = None,
               same_second: int = 1, assume_time: bool = True) -> Dump:
    """The dump of ``nodes`` after ``policy`` placed the seed's stream of ``pods`` (see the
    module). ``same_second``: that many consecutive pods share a creation second;
    ``assume_time=False`` leaves the decision times out (then the order is the creation
    order). Without ``target`` the policy is prepared with the target the extender would learn
    from the pods it placed (found by placing again until they stay the same)."""
    capacity = sum(len(n.gpu_mem) for n in nodes)
    seq = stream(pods, capacity, seed, inflation)
    if target is not None:
        decisions = place(nodes, pods, policy, seed, target, inflation)
    else:  # the target learnt from the pods it places: until the placed pods stay the same
        placed = list(seq)
        for _ in range(8):
            decisions = place(nodes, pods, policy, seed, gpu_target(placed), inflation)
            now = [tp for tp, d in zip(seq, decisions, strict=True) if d is not None]
            if now == placed:
                break
            placed = now
        else:
            raise RuntimeError("the placed pods do not settle; pass a target")
    to_k8s = node_names(nodes, seed)
    by_name = {n.name: n for n in nodes}
    node_objs = sorted((node_object(n, to_k8s[n.name], False) for n in nodes),
                       key=lambda o: o["metadata"]["name"])
    items: list[dict[str, Any]] = list(node_objs)
    for i, (tp, d) in enumerate(zip(seq, decisions, strict=True)):
        node = to_k8s[d.node_name] if d is not None else ""
        obj = pod_object(i, tp, False, node)
        sec = i // same_second
        obj["metadata"]["creationTimestamp"] = (
            f"2026-01-{1 + sec // 86400:02d}T{sec // 3600 % 24:02d}:{sec // 60 % 60:02d}:"
            f"{sec % 60:02d}Z")
        if tp.gpu_spec:
            _pin(obj, tp.gpu_spec)
        if d is not None and tp.num_gpu:
            cap = {g: int(m) for g, m in enumerate(by_name[d.node_name].gpu_mem)}
            anns = encode(d.alloc, assume_time_ns=1_000_000 + i, gpu_capacity=cap)
            if not assume_time:
                anns.pop(names.ANN_ASSUME_TIME)
                anns.pop(names.ANN_MEM_ASSUME_TIME)
            obj["metadata"]["annotations"].update(anns)
        items.append(obj)
    doc = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
           "items": items}
    return Dump(doc, seq, decisions, to_k8s)
