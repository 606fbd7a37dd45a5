"""Why no node of the DRA pool can take a pod whose GPUs are ResourceClaims of sharegpu's driver
and which kube-scheduler found unschedulable: each reason (a request larger than every GPU, a
node selector or affinity naming no node of the pool, device taints the claim does not
tolerate, requests that fit no node together, a request that cannot be read) names the field
and the rule. Every reason fails on an empty pool, so a pod Pending only because the pool is
full gets none. Pure: the extender (:mod:`sharegpu.extender.drastate`) feeds it and posts the
Event.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core import names
from ..core.nodeselector import requirement_holds
from . import driver as dra
from .draclaims import CLAIM_PREFIX, SHAREABLE
from .drashares import DeviceTaint, DraRequest, SliceGpus

AFFINITY = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
BLOCKING = ("NoSchedule", "NoExecute")  # device taint effects that keep new claims off
SHOWN = 4  # nodes named in a list before "and N more"

ISOLATION_WHY = (
    "the node's GPU isolation back-end (HAMi-core or MPS) is not usable, so its agent keeps new "
    "claims off its GPUs until it is")
ISOLATION_FIX = (
    f"{ISOLATION_WHY}; the node condition {names.CONDITION_ISOLATION} and the agent's log say "
    "why; fix: "
    "install HAMi-core (the chart's agent.hami.install=true, or agent.hamiLibrary "
    "naming a libvgpu.so on the node) or start the MPS daemon (agent.mps.enabled), or opt the "
    "node out with the label cgpu.disable.isolation=true")
UNHEALTHY_FIX = (
    "the GPU had a critical XID error (the agent's log names it); the agent lifts the taint "
    "when it finds the GPU healthy again: drain the node, reset or replace the GPU")


@dataclass(frozen=True)
class PoolGpu:
    """One GPU of a DRA node as its slice publishes it."""

    index: int
    mem_gib: int
    cores: int = dra.CORES_PER_GPU
    shared: bool = True  # allowMultipleAllocations
    taints: tuple[DeviceTaint, ...] = ()


@dataclass(frozen=True)
class PoolNode:
    """A node of the DRA pool: a Node with a ResourceSlice of the driver."""

    name: str
    labels: Mapping[str, str]
    gpus: tuple[PoolGpu, ...]
    isolation: str = ""  # the message of its GPUIsolationReady=False condition, if any


def pool_node(name: str, labels: Mapping[str, str], gpus: SliceGpus,
              isolation: str = "") -> PoolNode:
    """A DRA node from its Node's labels and its slice as :func:`~.drashares.slice_gpus`
    reads it."""
    return PoolNode(name, dict(labels), tuple(
        PoolGpu(i, mem, gpus.cores.get(i, dra.CORES_PER_GPU), gpus.shared.get(i, True),
                gpus.taints.get(i, ())) for i, mem in gpus.mem_gib.items()), isolation)


@dataclass(frozen=True)
class OtherNode:
    """A node outside the pool (named when the pod's node selection picks it)."""

    name: str
    labels: Mapping[str, str]
    device_plugin: bool = False  # it serves GPUs through the device plugins


class ClaimFacts(Protocol):
    """What the extender knows of a claim (``drastate.ClaimRecord``)."""

    @property
    def requests(self) -> tuple[DraRequest, ...]: ...

    @property
    def problem(self) -> str: ...

    @property
    def allocated(self) -> bool: ...


@dataclass(frozen=True)
class _Asked:
    """One request of one of the pod's claims, with where it is written."""

    claim: str  # namespace/name
    req: DraRequest
    source: Mapping[str, str] = field(default_factory=dict)  # the ACK fields it came from

    @property
    def at(self) -> str:
        return f"ResourceClaim {self.claim} spec.devices.requests[{self.req.index}].exactly"

    def written(self, what: str) -> str:
        """``(spec.containers[0] aliyun.com/gpu-mem=48)`` for a translated claim."""
        got = self.source.get(what) or self.source.get("")
        return f" ({got})" if got else ""

    def short(self) -> str:
        r = self.req
        parts = [f"memory={r.memory or f'{r.mem_gib}Gi'}" if r.mem_gib is not None else
                 "a whole GPU"]
        if r.core:
            parts.append(f"cores={r.core}")
        if r.count > 1:
            parts.append(f"count={r.count}")
        return f"ResourceClaim {self.claim} requests[{r.index}] ({', '.join(parts)})"


# -- the pod's claims ---------------

def is_unschedulable(pod: Mapping[str, Any]) -> bool:
    """kube-scheduler said so: condition ``PodScheduled=False``, reason ``Unschedulable``."""
    status = pod.get("status")
    conds = status.get("conditions") if isinstance(status, Mapping) else None
    return any(isinstance(c, Mapping) and c.get("type") == "PodScheduled"
               and c.get("status") == "False" and c.get("reason") == "Unschedulable"
               for c in (conds if isinstance(conds, list) else []))


def generated_claims(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The claims the claim controller made from the pod's templates:
    ``status.resourceClaimStatuses`` as {pod claim name: ResourceClaim name (or None)}."""
    status = pod.get("status")
    made = status.get("resourceClaimStatuses") if isinstance(status, Mapping) else None
    return {s["name"]: s.get("resourceClaimName") for s in
            (made if isinstance(made, list) else [])
            if isinstance(s, Mapping) and isinstance(s.get("name"), str)}


def pod_claims(pod: Mapping[str, Any]) -> list[tuple[int, str, str | None]]:
    """``(index in spec.resourceClaims, its name, the ResourceClaim's name)`` per entry; the
    claim's name is ``None`` while a template's claim is not generated yet. Malformed entries
    are left out (the API server refuses them)."""
    spec = pod.get("spec")
    entries = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    generated = generated_claims(pod)
    out: list[tuple[int, str, str | None]] = []
    for i, e in enumerate(entries if isinstance(entries, list) else []):
        if not isinstance(e, Mapping) or not isinstance(e.get("name"), str):
            continue
        claim = e.get("resourceClaimName")
        if not claim and e.get("resourceClaimTemplateName"):
            claim = generated.get(e["name"])
        out.append((i, e["name"], claim if isinstance(claim, str) and claim else None))
    return out


def _sources(pod: Mapping[str, Any], entry: str, req: DraRequest) -> dict[str, str]:
    """The ACK fields a webhook-translated claim came from, by what a reason names ('' any,
    'memory', 'cores', 'count')."""
    meta = pod.get("metadata")
    notes = meta.get("annotations") if isinstance(meta, Mapping) else None
    note = notes.get(names.ANN_DRA_CLAIMS) if isinstance(notes, Mapping) else None
    try:
        translated = json.loads(note) if isinstance(note, str) else {}
    except ValueError:
        translated = {}
    if not isinstance(translated, Mapping) or entry not in translated:
        return {}
    spec = pod.get("spec")
    containers = spec.get("containers") if isinstance(spec, Mapping) else None
    index: int | None = None
    for i, c in enumerate(containers if isinstance(containers, list) else []):
        res = c.get("resources") if isinstance(c, Mapping) else None
        claims = res.get("claims") if isinstance(res, Mapping) else None
        if any(isinstance(x, Mapping) and x.get("name") == entry
               for x in (claims if isinstance(claims, list) else [])):
            index = i
            break
    if index is None and entry.startswith(CLAIM_PREFIX) and entry[len(CLAIM_PREFIX):].isdigit():
        index = int(entry[len(CLAIM_PREFIX):])
    if index is None or req.mem_gib is None:
        return {}
    at = f"spec.containers[{index}]"
    mem = f"{at} {names.RES_GPU_MEM}={req.mem_gib * req.count}"
    count = f"metadata.labels[{names.POD_LABEL_GPU_COUNT}]={req.count}"
    out = {"": mem, "memory": mem + (f" over {count}" if req.count > 1 else ""),
           "count": f"{count}, {mem}"}
    if req.core:
        out["cores"] = f"{at} {names.RES_GPU_CORE}={req.core}"
    return out


# -- node selection ---------------

def _str_map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _expr_ok(e: Any, node: str, labels: Mapping[str, str], fields: bool = False) -> bool:
    """One ``matchExpressions`` (or, ``fields``, ``matchFields``) requirement; a malformed one
    matches (the API server refuses it; never a false reason)."""
    if not isinstance(e, Mapping) or not isinstance(e.get("key"), str):
        return True
    key, op, values = e["key"], e.get("operator"), e.get("values")
    values = [v for v in values if isinstance(v, str)] if isinstance(values, list) else []
    if fields:
        if key != "metadata.name":
            return True
        have: str | None = node
    else:
        have = labels.get(key)
    return requirement_holds(op, have, values)


def _term_parts(term: Any) -> list[tuple[str, str, Any, bool]]:
    """(field, text, requirement, is a matchFields one) of a nodeSelectorTerm."""
    t = _str_map(term)
    out = []
    for kind, is_field in (("matchExpressions", False), ("matchFields", True)):
        items = t.get(kind)
        for j, e in enumerate(items if isinstance(items, list) else []):
            e = _str_map(e)
            vals = e.get("values")
            text = f"{e.get('key')} {e.get('operator')}" + (
                f" [{', '.join(map(str, vals))}]" if isinstance(vals, list) and vals else "")
            out.append((f"{kind}[{j}]", text, e, is_field))
    return out


def _term_ok(term: Any, node: str, labels: Mapping[str, str]) -> bool:
    parts = _term_parts(term)
    return bool(parts) and all(_expr_ok(e, node, labels, f) for _, _, e, f in parts)


def _terms(pod: Mapping[str, Any]) -> list[Any] | None:
    spec = _str_map(pod.get("spec"))
    aff = _str_map(_str_map(spec.get("affinity")).get("nodeAffinity"))
    req = _str_map(aff.get("requiredDuringSchedulingIgnoredDuringExecution"))
    terms = req.get("nodeSelectorTerms")
    return terms if isinstance(terms, list) and terms else None


Match = Callable[[str, Mapping[str, str]], bool]


def node_selection(pod: Mapping[str, Any]) -> list[tuple[str, Match]]:
    """The pod's node constraints, each ``(field, test of a node)``: ``spec.nodeName``, each
    ``spec.nodeSelector`` entry, the required node affinity (its terms ORed)."""
    spec = _str_map(pod.get("spec"))
    out: list[tuple[str, Match]] = []
    name = spec.get("nodeName")
    if isinstance(name, str) and name:
        out.append((f"spec.nodeName={name}", lambda n, _l, want=name: n == want))
    for k, v in _str_map(spec.get("nodeSelector")).items():
        out.append((f"spec.nodeSelector[{k}]={v}",
                    lambda _n, labels, k=k, v=v: labels.get(k) == v))
    terms = _terms(pod)
    if terms is not None:
        out.append((f"{AFFINITY}.nodeSelectorTerms",
                    lambda n, labels: any(_term_ok(t, n, labels) for t in terms)))
    return out


def selects(pod: Mapping[str, Any], node: str, labels: Mapping[str, str]) -> bool:
    """Whether the pod's node constraints allow ``node``."""
    return all(ok(node, labels) for _, ok in node_selection(pod))


def _listed(items: Sequence[str], shown: int = SHOWN) -> str:
    more = len(items) - shown
    return ", ".join(items[:shown]) + (f" and {more} more" if more > 0 else "")


def _outside(others: Iterable[OtherNode], ok: Match) -> str:
    picked = [o for o in others if ok(o.name, o.labels)]
    if not picked:
        return ""
    gpu = [o.name for o in picked if o.device_plugin]
    rest = [o.name for o in picked if not o.device_plugin]
    parts = []
    if gpu:
        parts.append(f"{_listed(gpu, 3)} {'serves' if len(gpu) == 1 else 'serve'} "
                     "its GPUs through the device plugins")
    if rest:
        parts.append(f"{_listed(rest, 3)} {'is' if len(rest) == 1 else 'are'} not in the DRA "
                     "pool")
    return "; " + "; ".join(parts)


def _selection_reasons(pod: Mapping[str, Any], pool: Sequence[PoolNode],
                       others: Sequence[OtherNode]) -> list[str]:
    what = f"selects no node of the DRA pool ({pool_text(pool)})"
    parts = node_selection(pod)
    out = []
    for fld, ok in parts:
        if any(ok(p.name, p.labels) for p in pool):
            continue
        if fld.startswith(AFFINITY):
            terms = _terms(pod) or []
            why = []
            for i, t in enumerate(terms):
                bad = [f"[{i}].{f} ({text})" for f, text, e, is_field in _term_parts(t)
                       if not any(_expr_ok(e, p.name, p.labels, is_field) for p in pool)]
                why.append(bad[0] if bad else f"[{i}] (its requirements together)")
            out.append(f"{fld}: no term selects a node of the DRA pool ({pool_text(pool)}): "
                       + "; ".join(
                f"nodeSelectorTerms{w}" for w in why) + _outside(others, ok))
        else:
            out.append(f"{fld}: {what}{_outside(others, ok)}")
    if not out and parts:
        fields = sorted({"spec.affinity.nodeAffinity" if f.startswith(AFFINITY) else
                         f.split("[")[0].split("=")[0] for f, _ in parts})
        out.append(f"{' and '.join(fields)} together select no node of the DRA pool "
                   f"({pool_text(pool)})")
    return out


def pool_text(pool: Sequence[PoolNode]) -> str:
    return (f"nodes with a ResourceSlice of {dra.DRIVER}: "
            f"{_listed(sorted(p.name for p in pool))}")


# -- capacity and taints ---------------

def _fits(a: _Asked, g: PoolGpu) -> bool:
    r = a.req
    return ((r.mem_gib is None or g.mem_gib >= r.mem_gib) and g.cores >= r.core
            and (g.shared or not r.shared_only))


def _tolerated(a: _Asked, g: PoolGpu) -> bool:
    return all(t.effect not in BLOCKING or any(tol.tolerates(t) for tol in a.req.tolerations)
               for t in g.taints)


def _need(a: _Asked) -> int:
    return a.req.count if a.req.distinct else 1


def _holders(a: _Asked, nodes: Sequence[PoolNode], usable: Callable[[_Asked, PoolGpu], bool]
             ) -> list[str]:
    return [n.name for n in nodes if sum(1 for g in n.gpus if usable(a, g)) >= _need(a)]


def _capacity_reason(a: _Asked, nodes: Sequence[PoolNode], scope: str) -> str | None:
    r = a.req
    gpus = [(n.name, g) for n in nodes for g in n.gpus if g.shared or not r.shared_only]
    if not gpus:
        return (f"{a.at}.selectors ({SHAREABLE}): no GPU of {scope} is shared "
                "(allowMultipleAllocations: their nodes give whole GPUs only)")
    kind = "shared GPU" if r.shared_only and any(
        not g.shared for n in nodes for g in n.gpus) else "GPU"
    if r.mem_gib is not None:
        node, g = max(gpus, key=lambda x: (x[1].mem_gib, -x[1].index))
        if g.mem_gib < r.mem_gib:
            return (f"{a.at}.capacity.requests.memory={r.memory or f'{r.mem_gib}Gi'}"
                    f"{a.written('memory')}: larger than every {kind} of {scope} (largest: "
                    f"{g.mem_gib}Gi, node {node} {dra.device_name(g.index)})")
    node, g = max(gpus, key=lambda x: (x[1].cores, -x[1].index))
    if g.cores < r.core:
        return (f"{a.at}.capacity.requests.cores={r.core}{a.written('cores')}: more than every "
                f"{kind} of {scope} has (most: {g.cores}, node {node} "
                f"{dra.device_name(g.index)})")
    if _holders(a, nodes, _fits):
        return None
    most = max(nodes, key=lambda n: sum(1 for g in n.gpus if _fits(a, g)))
    have = sum(1 for g in most.gpus if _fits(a, g))
    size = f" of at least {r.mem_gib}Gi" if r.mem_gib is not None else ""
    return (f"{a.at}.count={r.count}{a.written('count')} with distinctAttribute: more "
            f"{kind}s{size} than any node of {scope} has (most: {have}, node {most.name})")


def _taint_reason(a: _Asked, nodes: Sequence[PoolNode]) -> str:
    by_key: dict[str, dict[str, list[str]]] = {}
    isolation: dict[str, dict[str, None]] = {}  # what the agent says -> nodes
    for n in nodes:
        for g in n.gpus:
            if not _fits(a, g):
                continue
            for t in g.taints:
                if t.effect in BLOCKING and not any(x.tolerates(t) for x in a.req.tolerations):
                    by_key.setdefault(t.key, {}).setdefault(n.name, []).append(
                        dra.device_name(g.index))
                    if t.key == dra.TAINT_ISOLATION and n.isolation:
                        said = n.isolation.removeprefix(f"node {n.name}: ")
                        isolation.setdefault(said, {})[n.name] = None
    taints = []
    for key, on in sorted(by_key.items()):
        where = [f"{node} ({', '.join(gpus)})" for node, gpus in sorted(on.items())]
        if key == dra.TAINT_ISOLATION:
            fix = ISOLATION_FIX
            if isolation:  # the agent's own words (its node condition): why, and the fix
                said, on = max(isolation.items(), key=lambda x: len(x[1]))
                fix = (f"{ISOLATION_WHY}; {names.CONDITION_ISOLATION} on {_listed(list(on), 2)}: "
                       f"{said}")
        elif key == dra.TAINT_UNHEALTHY:
            fix = UNHEALTHY_FIX
        else:
            fix = "a taint sharegpu does not set; tolerate it in the claim or remove it"
        taints.append(f"{key} on {_listed(where, 3)}: {fix}")
    return (f"{a.short()}{a.written('')}: every GPU of the DRA pool that could hold it carries "
            f"a device taint the claim does not tolerate: " + "; ".join(taints))


# -- all together ---------------

def diagnose(pod: Mapping[str, Any], claims: Mapping[str, ClaimFacts],
             pool: Sequence[PoolNode], others: Sequence[OtherNode] = ()) -> list[str]:
    """Why no node of ``pool`` can take ``pod`` (module doc); ``[]`` when it could fit some
    node of an empty pool, or when that cannot be told yet. ``claims``: the extender's claims
    by ``namespace/name``; ``others``: the nodes outside the pool."""
    meta = _str_map(pod.get("metadata"))
    ns = meta.get("namespace") if isinstance(meta.get("namespace"), str) else "default"
    asked: list[_Asked] = []
    problems: list[str] = []
    ours = False
    for i, entry, name in pod_claims(pod):
        if name is None:
            return []  # its claim is not generated yet
        key = f"{ns}/{name}"
        rec = claims.get(key)
        if rec is None:
            return []  # not seen yet
        if not rec.requests and not rec.problem:
            continue  # another driver's
        ours = True
        if rec.allocated:
            return []  # its node is decided
        if not all(r.ranked for r in rec.requests):
            return []  # firstAvailable or All: the allocator's own choices, not told here
        if rec.problem:
            problems.append(f"spec.resourceClaims[{i}] (ResourceClaim {key}): sharegpu cannot "
                            f"read its request: {rec.problem}")
            continue
        asked += [_Asked(key, r, _sources(pod, entry, r)) for r in rec.requests]
    if not ours:
        return []
    if not pool:
        return [*problems, f"the DRA pool has no node (no Node with a ResourceSlice of "
                           f"{dra.DRIVER}): no GPU to allocate the pod's claims from"]
    out = list(problems)
    chosen = [p for p in pool if selects(pod, p.name, p.labels)]
    if not chosen:
        out += _selection_reasons(pod, pool, others)
    nodes = chosen or list(pool)
    scope = "the DRA pool" if len(nodes) == len(pool) else \
        f"the DRA nodes the pod's node selection allows ({_listed([n.name for n in nodes])})"
    blocked = False
    for a in asked:
        why = _capacity_reason(a, nodes, scope)
        if why is not None:
            out.append(why)
            blocked = True
    if blocked or not chosen:
        return out
    holders = []
    for a in asked:
        h = _holders(a, nodes, lambda x, g: _fits(x, g) and _tolerated(x, g))
        if not h:
            out.append(_taint_reason(a, nodes))
            blocked = True
        holders.append(set(h))
    if not blocked and len(asked) > 1 and not set.intersection(*holders):
        out.append("its claims fit no single node together (a pod's claims are allocated on "
                   "the node it runs on): " + "; ".join(
                       f"{a.short()} only on {_listed(sorted(h), 3)}"
                       for a, h in zip(asked, holders, strict=True)))
    return out


def message(reasons: Sequence[str]) -> str:
    """The Event's text."""
    return (f"no node of the DRA pool (driver {dra.DRIVER}) can take this pod as it is: "
            + "; ".join(reasons))


__all__ = ["OtherNode", "PoolGpu", "PoolNode", "diagnose", "is_unschedulable", "message",
           "node_selection", "pod_claims", "pool_node", "selects"]
