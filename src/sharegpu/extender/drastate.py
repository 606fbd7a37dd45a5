"""DRA in the extender: the GPUs of DRA nodes from their ResourceSlices, the shares allocated
ResourceClaims hold on them, and a DRA pod's claims read as the GPU request the policy scores.
One feature object, :class:`DraState`, over the cluster cache (:mod:`.cache`: it is the cache's
``gpus`` port); synchronous and free of I/O (the informer feeds it ``resourceslices`` and
``resourceclaims`` events). How nodes, claims, DRA pods and the pods kube-scheduler cannot place
are read: docs/dra.md ("The extender and DRA pods").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core import names
from ..core.annotations import Allocation
from ..core.errors import PlacementError, ValidationError
from ..core.hostresources import node_allocatable
from ..core.modes import Mode, node_placement, parse_mode
from ..core.request import ContainerRequest, Kind, PodRequest
from ..core.state import ClusterState, NodeSpec
from ..dra import dradiagnosis
from ..dra import driver as dra
from ..dra.drashares import DraRequest, SliceGpus, claim_requests, claim_shares, slice_gpus
from .cache import ClusterCache

CLAIM_KEY = "claim:"  # state keys of claims: <namespace>/claim:<name>
NOT_IN_POOL = (f"node has no ResourceSlice of driver {dra.DRIVER}: a pod whose GPUs are "
               "ResourceClaims can only go to a node of the DRA pool")
IN_POOL = (f"node serves its GPUs through DRA (ResourceSlice of {dra.DRIVER}): it has no "
           "device-plugin GPU resources for this pod")


@dataclass(frozen=True, slots=True)
class DraPodRequest(PodRequest):
    """A DRA pod's claims as a GPU request: one container per claim request (``count`` GPUs of
    ``memory`` GiB and ``cores`` percent each). Feasible only on DRA nodes."""


@dataclass(frozen=True)
class ClaimRecord:
    uid: str
    requests: tuple[DraRequest, ...]
    problem: str  # why a request of the driver cannot be read ('' when all can)
    allocated: bool
    # held shares: (node, GPU index, GiB, cores percent); GiB None = the whole GPU
    shares: tuple[tuple[str, int, int | None, int], ...]


def _strip_node(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What building a node's spec reads (not its images, conditions ...), and the agent's
    ``GPUIsolationReady`` condition when it is not ``True`` (its message says why and the fix:
    the diagnosis of a DRA pod quotes it)."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    out = {"metadata": {k: meta.get(k) for k in ("name", "labels", "annotations")},
           "status": {k: status.get(k) for k in ("allocatable", "capacity", "addresses")}}
    conds = status.get("conditions") if isinstance(status, Mapping) else None
    for c in conds if isinstance(conds, list) else []:
        if isinstance(c, Mapping) and c.get("type") == names.CONDITION_ISOLATION \
                and c.get("status") != "True" and isinstance(c.get("message"), str):
            out["isolation"] = c["message"]
    if isinstance(obj.get("isolation"), str):  # stripped before
        out["isolation"] = obj["isolation"]
    return out


class DraState:
    """DRA slices and claims over the cluster cache ``ledger``: the nodes' GPUs it reads from
    their slices, the claims it holds in the ledger's state, the DRA pods it diagnoses."""

    def __init__(self, ledger: ClusterCache, driver: str = dra.DRIVER) -> None:
        self.ledger = ledger
        self.dra_driver = driver
        self.slices: dict[str, tuple[str, dict[int, int], str]] = {}  # node -> (slice, GiB, mode)
        self._slice_node: dict[str, str] = {}  # slice name -> node
        self._node_objs: dict[str, dict[str, Any]] = {}  # every node, stripped
        self.dra_slots: dict[str, dict[int, int]] = {}  # DRA node -> {GPU index: state slot}
        self.claims: dict[str, ClaimRecord] = {}  # namespace/name -> record
        self.claim_held: dict[str, tuple[PodRequest, str, Allocation]] = {}  # state key ->
        self._claims_on: dict[str, set[str]] = {}  # node -> keys of claims allocated there
        self._pool: tuple[Any, ...] | None = None
        self.slice_gpus: dict[str, SliceGpus] = {}  # DRA node -> its slice as read
        # DRA pods kube-scheduler found unschedulable: key -> (pod, the message last given)
        self.dra_waiting: dict[str, tuple[Mapping[str, Any], str]] = {}
        self._waiting_on: dict[str, set[str]] = {}  # claim key -> keys of such pods
        # told (pod, message) when such a pod fits no node of the pool (the replica's Event)
        self.on_dra_unschedulable: Callable[[Mapping[str, Any], str], None] | None = None

    # -- nodes ---------------
    def node_spec(self, obj: Mapping[str, Any], spec: NodeSpec | None) -> NodeSpec | None:
        """``spec`` (from the Node's device-plugin resources) or, for a node with a slice of
        the driver, the node's GPUs from the slice."""
        name = str((obj.get("metadata") or {}).get("name") or "")
        if name:
            self._node_objs[name] = _strip_node(obj)
        got = self.slices.get(name)
        if got is None:
            self.dra_slots.pop(name, None)
            return spec
        sname, mem, mode_attr = got
        labels = (obj.get("metadata") or {}).get("labels") or {}
        try:
            mode = parse_mode(mode_attr) if mode_attr else Mode.CGPU
            cpu, mem_mib, _ = node_allocatable(obj)
            indexes = sorted(mem)
            out = NodeSpec(name=name, gpu_mem=[mem[g] for g in indexes], mode=mode,
                           placement=node_placement(labels, mode),
                           model=str(labels.get(names.LABEL_CARD_NAME, "")),
                           cpu_milli=cpu, mem_mib=mem_mib,
                           address=spec.address if spec is not None else "")
        except ValidationError as e:
            self.ledger.problem(f"node/{name}", f"ResourceSlice {sname} not used: {e}")
            self.dra_slots.pop(name, None)
            return spec
        self.dra_slots[name] = {g: j for j, g in enumerate(indexes)}
        return out

    def nodes_reset(self) -> None:
        """A rebuild reads every node again."""
        self._node_objs, self.dra_slots = {}, {}

    def node_added(self, name: str) -> None:
        self._hold_node_claims(name)

    def node_removed(self, name: str, keys: list[str], *, forget: bool) -> None:
        """The node left the state with ``keys``; ``forget``: the Node is gone (else it only
        has no GPUs now; a ResourceSlice may give it some)."""
        for key in keys:
            self.claim_held.pop(key, None)  # held again if the node comes back
        if forget:
            self._node_objs.pop(name, None)
            self.dra_slots.pop(name, None)

    def _refresh_node(self, node: str) -> None:
        obj = self._node_objs.get(node)
        if obj is None:
            return  # applied when the Node appears
        self.ledger.upsert_node(obj)
        if node in self.ledger.state.index:
            self._hold_node_claims(node)

    # -- slices ---------------
    def _read_slice(self, obj: Mapping[str, Any]) -> tuple[str, str | None]:
        """(slice name, node it publishes for this driver or None)."""
        sname = str((obj.get("metadata") or {}).get("name") or "")
        got, warnings = slice_gpus(obj, self.dra_driver)
        for w in warnings:
            self.ledger.problem(f"resourceslice/{sname}", w)
        if got is None or not got.mem_gib:
            return sname, None
        self.slices[got.node] = (sname, dict(got.mem_gib), got.mode)
        self.slice_gpus[got.node] = got
        return sname, got.node

    def upsert_slice(self, obj: Mapping[str, Any]) -> None:
        old = self._slice_node.get(str((obj.get("metadata") or {}).get("name") or ""))
        sname, node = self._read_slice(obj)
        if node is None:
            self.delete_slice(obj)
            return
        self._slice_node[sname] = node
        if old is not None and old != node:
            self._drop_slice(sname, old)
        self._refresh_node(node)
        self.dra_recheck()

    def delete_slice(self, obj: Mapping[str, Any]) -> None:
        sname = str((obj.get("metadata") or {}).get("name") or "")
        node = self._slice_node.pop(sname, None)
        if node is not None:
            self._drop_slice(sname, node)
            self.dra_recheck()

    def _drop_slice(self, sname: str, node: str) -> None:
        got = self.slices.get(node)
        if got is not None and got[0] == sname:
            del self.slices[node]
            self.slice_gpus.pop(node, None)
            obj = self._node_objs.get(node)
            if obj is not None:
                self.ledger.upsert_node(obj)  # back to its device-plugin view (or none)
                if node in self.ledger.state.index:
                    self._hold_node_claims(node)

    # -- claims ---------------
    def _read_claim(self, obj: Mapping[str, Any]) -> tuple[str, ClaimRecord]:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
        reqs, warnings = claim_requests(obj, self.dra_driver)
        shares, share_warnings = claim_shares(obj, self.dra_driver)
        for w in share_warnings:
            self.ledger.problem(f"resourceclaim/{key}", w)
        status = obj.get("status")
        alloc = status.get("allocation") if isinstance(status, Mapping) else None
        return key, ClaimRecord(
            uid=str(meta.get("uid") or ""), requests=tuple(reqs), problem="; ".join(warnings),
            allocated=isinstance(alloc, Mapping),
            shares=tuple((s.node, s.gpu, s.mem_gib, s.core or 0) for s in shares))

    def upsert_claim(self, obj: Mapping[str, Any]) -> None:
        key, rec = self._read_claim(obj)
        old = self.claims.get(key)
        self.claims[key] = rec
        if key in self._waiting_on and old != rec:
            for pod in list(self._waiting_on[key]):
                self._diagnose(pod)
        if old is not None and old.shares == rec.shares and old.uid == rec.uid:
            return
        self._index_claim(key, old, rec)
        self._release_claim(key)
        self._hold_claim(key, rec)

    def _index_claim(self, key: str, old: ClaimRecord | None, new: ClaimRecord | None) -> None:
        for rec, add in ((old, False), (new, True)):
            for node in {s[0] for s in rec.shares} if rec is not None else ():
                on = self._claims_on.setdefault(node, set())
                if add:
                    on.add(key)
                else:
                    on.discard(key)
                    if not on:
                        del self._claims_on[node]

    def delete_claim(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
        self._index_claim(key, self.claims.pop(key, None), None)
        self._release_claim(key)

    @staticmethod
    def _state_key(key: str) -> tuple[str, str]:
        ns, _, name = key.partition("/")
        return ns, CLAIM_KEY + name

    def _claim_hold(self, key: str, rec: ClaimRecord, state: ClusterState
                    ) -> list[tuple[PodRequest, str, Allocation]]:
        """What ``rec`` holds, per node known to ``state`` (a claim's results are on one
        node: its pool)."""
        by_node: dict[str, list[tuple[int, int | None, int]]] = {}
        for node, gpu, mem, core in rec.shares:
            by_node.setdefault(node, []).append((gpu, mem, core))
        ns, name = self._state_key(key)
        out = []
        for node, shares in by_node.items():
            slots = self.dra_slots.get(node)
            i = state.index.get(node)
            if slots is None or i is None:
                continue  # held when the node's slice and Node are both known
            containers, mem_of, core_of = [], {}, {}
            for j, (gpu, mem, core) in enumerate(shares):
                slot = slots.get(gpu)
                if slot is None:
                    self.ledger.problem(f"resourceclaim/{key}", f"allocated on {node} gpu-{gpu}, "
                                  "which the node's ResourceSlice does not list; not counted")
                    continue
                if mem is None:  # the whole GPU
                    mem, core = int(state.gpu_total[i, slot]), dra.CORES_PER_GPU
                containers.append(ContainerRequest(j, gpu_mem=mem, gpu_core=core))
                mem_of[j] = {slot: mem}
                if core:
                    core_of[j] = {slot: core}
            if containers:
                req = PodRequest(ns, name, Kind.SHARED, tuple(containers), uid=rec.uid)
                out.append((req, node, Allocation(mem=mem_of, core=core_of)))
        return out

    def _hold_claim(self, key: str, rec: ClaimRecord) -> None:
        state = self.ledger.state
        for req, node, alloc in self._claim_hold(key, rec, state)[:1]:
            try:
                state.hold(req, node, alloc)
            except PlacementError as e:
                self.ledger.problem(f"resourceclaim/{key}", f"not counted: {e}")
                continue
            self.claim_held[req.key] = (req, node, alloc)

    def _release_claim(self, key: str) -> None:
        skey = "/".join(self._state_key(key))
        held = self.claim_held.pop(skey, None)
        if held is None:
            return
        if skey in self.ledger.state.pods:
            self.ledger.scheduler.release(skey)

    def _hold_node_claims(self, node: str) -> None:
        """After a node (re)appears: hold the claims allocated there. O(claims) once per node
        that joins; events of one claim touch that claim alone."""
        for key in list(self._claims_on.get(node, ())):
            skey = "/".join(self._state_key(key))
            if skey not in self.ledger.state.pods:
                self.claim_held.pop(skey, None)
                self._hold_claim(key, self.claims[key])

    # -- rebuild ---------------
    def load(self, slices: Iterable[Mapping[str, Any]],
                  claims: Iterable[Mapping[str, Any]]) -> None:
        """Start a rebuild from listed slices and claims (nodes are read next)."""
        self.slices, self._slice_node, self.slice_gpus = {}, {}, {}
        for obj in slices:
            sname, node = self._read_slice(obj)
            if node is not None:
                self._slice_node[sname] = node
        self.claims, self._claims_on = {}, {}
        for obj in claims:
            key, rec = self._read_claim(obj)
            self._index_claim(key, self.claims.get(key), rec)
            self.claims[key] = rec

    def hold_all(self, state: ClusterState) -> None:
        """Hold every allocated claim in a rebuilt ``state`` (after the pods' records)."""
        self.claim_held = {}
        for key, rec in self.claims.items():
            for req, node, alloc in self._claim_hold(key, rec, state)[:1]:
                try:
                    state.hold(req, node, alloc)
                except PlacementError as e:
                    self.ledger.problem(f"resourceclaim/{key}", f"not counted: {e}")
                    continue
                self.claim_held[req.key] = (req, node, alloc)

    def dra_holds(self) -> list[tuple[PodRequest, str, Allocation]]:
        """Every claim the state holds (the consistency check adds them to its rebuild)."""
        return list(self.claim_held.values())

    # -- a DRA pod's request ---------------
    def dra_request(self, pod: Mapping[str, Any], base: PodRequest) -> DraPodRequest | None:
        """The GPU request of a pod whose GPUs are ResourceClaims of the driver, or ``None``
        when it is not ranked (no such claim, a claim not seen yet or already allocated, a
        whole-GPU request). Raises ValidationError naming the field when a claim of the
        driver cannot be read."""
        spec = pod.get("spec") if isinstance(pod, Mapping) else None
        entries = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
        if not entries or not self.slices:
            return None
        if not isinstance(entries, list):
            raise ValidationError("spec.resourceClaims", entries, "must be a list")
        generated = dradiagnosis.generated_claims(pod)
        ns = base.namespace
        containers: list[ContainerRequest] = []
        for i, e in enumerate(entries):
            if not isinstance(e, Mapping):
                raise ValidationError(f"spec.resourceClaims[{i}]", e, "must be an object")
            claim = e.get("resourceClaimName")
            if not claim and e.get("resourceClaimTemplateName"):
                claim = generated.get(e.get("name")) if isinstance(e.get("name"), str) else None
                if not claim:
                    return None  # the claim controller has not made it yet
            if not isinstance(claim, str) or not claim:
                continue
            rec = self.claims.get(f"{ns}/{claim}")
            if rec is None:
                return None  # not seen yet: kube-scheduler waits for it; not ranked
            if rec.problem:
                raise ValidationError(f"spec.resourceClaims[{i}] (ResourceClaim {ns}/{claim})",
                                      claim, rec.problem)
            if rec.allocated:
                return None  # its node is decided; DynamicResources keeps the pod there
            for r in rec.requests:
                if r.mem_gib is None:
                    return None  # a whole GPU, firstAvailable or All: not ranked
                containers.append(ContainerRequest(
                    len(containers), name=f"{claim}/{r.request}", gpu_mem=r.mem_gib,
                    gpu_core=dra.consumed_cores(r.core), gpus=r.count))
        if not containers:
            return None
        return DraPodRequest(base.namespace, base.name, Kind.SHARED, tuple(containers),
                             base.uid, base.cpu_milli, base.mem_mib, labels=base.labels)

    # -- DRA pods kube-scheduler cannot place ---------------
    def dra_pod_event(self, key: str, obj: Mapping[str, Any] | None,
                      said: str | None = None) -> None:
        """A pod's event (``None``: deleted). Cheap for every pod that names no claim.
        ``said``: the message last given for it (default: what this view gave)."""
        spec = obj.get("spec") if obj is not None else None
        if obj is None or not isinstance(spec, Mapping) or not spec.get("resourceClaims") \
                or spec.get("nodeName") or not dradiagnosis.is_unschedulable(obj):
            if key in self.dra_waiting:
                self._stop_waiting(key)
            return
        if said is None:
            old = self.dra_waiting.get(key)
            said = old[1] if old is not None else ""
        self._stop_waiting(key)
        ns = (obj.get("metadata") or {}).get("namespace") or "default"
        self.dra_waiting[key] = (obj, said)
        for _, _, claim in dradiagnosis.pod_claims(obj):
            if claim:
                self._waiting_on.setdefault(f"{ns}/{claim}", set()).add(key)
        self._diagnose(key)

    def dra_waiting_reset(self, pods: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
        """After a rebuild: the unbound pods with claims, from the list."""
        old = self.dra_waiting
        self.dra_waiting, self._waiting_on = {}, {}
        for key, obj in pods:
            self.dra_pod_event(key, obj, old[key][1] if key in old else "")

    def dra_recheck(self, *, again: bool = False) -> None:
        """Ask again for every waiting pod (a slice changed; ``again``: tell even an unchanged
        message, for a replica that has just become the leader). The pool is read once:
        O(nodes + waiting pods)."""
        if not self.dra_waiting:
            return
        pool = self.dra_pool()
        for key in list(self.dra_waiting):
            self._diagnose(key, again=again, pool=pool)

    def _stop_waiting(self, key: str) -> None:
        got = self.dra_waiting.pop(key, None)
        if got is None:
            return
        ns = (got[0].get("metadata") or {}).get("namespace") or "default"
        for _, _, claim in dradiagnosis.pod_claims(got[0]):
            on = self._waiting_on.get(f"{ns}/{claim}")
            if on is not None:
                on.discard(key)
                if not on:
                    del self._waiting_on[f"{ns}/{claim}"]

    def dra_pool(self) -> tuple[list[dradiagnosis.PoolNode], list[dradiagnosis.OtherNode]]:
        """The DRA pool as this view knows it (nodes with a slice and a Node), and the other
        nodes."""
        pool, others = [], []
        for name, obj in self._node_objs.items():
            labels = (obj.get("metadata") or {}).get("labels") or {}
            got = self.slice_gpus.get(name)
            if got is not None:
                pool.append(dradiagnosis.pool_node(name, labels, got,
                                                   str(obj.get("isolation") or "")))
            else:
                others.append(dradiagnosis.OtherNode(name, labels, name in self.ledger.specs))
        return pool, others

    def _diagnose(self, key: str, *, again: bool = False,
                  pool: tuple[list[dradiagnosis.PoolNode], list[dradiagnosis.OtherNode]]
                  | None = None) -> None:
        got = self.dra_waiting.get(key)
        if got is None:
            return
        pod, said = got
        try:
            reasons = dradiagnosis.diagnose(pod, self.claims, *(pool or self.dra_pool()))
        except Exception as e:  # never let one odd pod stop the watch
            self.ledger.problem(key, f"DRA diagnosis failed: {type(e).__name__}: {e}")
            return
        text = dradiagnosis.message(reasons) if reasons else ""
        self.dra_waiting[key] = (pod, text)
        if text and (text != said or again):
            self.ledger.problem(key, text)
            if self.on_dra_unschedulable is not None:
                self.on_dra_unschedulable(pod, text)

    # -- the pool ---------------
    def pool_mask(self, req: PodRequest, slots: Any) -> Any:
        """Which node ``slots`` can serve ``req`` by how they serve GPUs: a DRA request only
        DRA nodes, a device-plugin request only the others (``None``: all, no DRA node)."""
        import numpy as np

        if not self.dra_slots:
            return None
        state = self.ledger.state
        stamp = (id(state), self.ledger.nodes_version, state.n)
        if self._pool is None or self._pool[0] != stamp:
            mask = np.zeros(state.n + 1, dtype=bool)  # the last: unknown names
            index = state.index
            for node in self.dra_slots:
                i = index.get(node)
                if i is not None:
                    mask[i] = True
            self._pool = (stamp, mask)
        mask = self._pool[1][slots]
        return mask if isinstance(req, DraPodRequest) else ~mask

    def pool_reason(self, req: PodRequest) -> str:
        return NOT_IN_POOL if isinstance(req, DraPodRequest) else IN_POOL
