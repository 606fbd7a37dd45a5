"""Allocate: which pod container a kubelet request belongs to, and what that container gets.

The kubelet's Allocate names devices, never the pod: each ``ContainerAllocateRequest`` is matched
to the pending pod container on this node whose recorded decision holds the same on each GPU,
under one lock with a ledger so that no container is handed out twice. The matching rules and
their order: docs/agent.md ("How Allocate finds the pod").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import names
from ..core.annotations import assume_time, decode, is_assigned
from ..core.errors import ShareGpuError, ValidationError
from ..core.pods import is_terminated
from ..core.request import Kind, parse_pod
from .devices import DeviceMap
from .isolation import (
    COMPUTE_ENVS,
    LIMIT_RULE,
    Backend,
    ContainerEnv,
    IsolationConfig,
    disabled,
    isolation_env,
    other_user,
    own_limit_routes,
)
from .podresources import Named

log = logging.getLogger(__name__)

WHOLE_RESOURCES = frozenset({names.RES_NVIDIA_GPU, names.RES_TOPOLOGY_GPU})
ANN_GRANT = "sharegpu.io/allocated-to"  # container annotation in the Allocate response


class AllocationError(ShareGpuError):
    """A container cannot be given devices; the message is the reason the kubelet reports."""


class IsolationUnavailable(AllocationError):
    """The container needs isolation and the node's back-end cannot give it (fail closed)."""

    def __init__(self, message: str, candidate: Candidate) -> None:
        super().__init__(message)
        self.candidate = candidate


# Called with the back-end a container is about to get and the container; raises
# IsolationUnavailable when that back-end is not usable.
Guard = Callable[["Backend", "Candidate"], None]


@dataclass(frozen=True)
class Candidate:
    """One GPU container of a pending pod on this node, as the scheduler recorded it."""

    namespace: str
    name: str
    uid: str
    container: int
    container_name: str
    mem: Mapping[int, int]  # GPU index -> GiB (whole cards: the card's GiB)
    core: Mapping[int, int]  # GPU index -> percent
    whole: bool
    pod_total_mem: int
    assume_time: int
    required: frozenset[str] = frozenset()  # resources the kubelet allocates for it
    container_spec: Mapping[str, Any] = field(default_factory=dict, compare=False)
    pod_spec: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.uid or f"{self.namespace}/{self.name}", self.container)

    @property
    def pod_key(self) -> str:
        return self.uid or f"{self.namespace}/{self.name}"

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}/{self.container_name or self.container}"

    def signature(self, resource: str) -> dict[int, int]:
        if resource in WHOLE_RESOURCES or resource == names.RES_GPU_COUNT:
            return {g: 1 for g in self.mem}
        if resource == names.RES_GPU_CORE:
            return {g: v for g, v in self.core.items() if v}
        return dict(self.mem)

    def order(self) -> tuple[int, str, str, int]:
        return (self.assume_time, self.namespace, self.name, self.container)


@dataclass(frozen=True)
class Grant:
    """What one container gets."""

    candidate: Candidate | None  # None: whole cards the kubelet chose, no scheduler decision
    gpus: tuple[int, ...]
    uuids: tuple[str, ...]
    env: ContainerEnv
    annotations: dict[str, str]


def pending_candidates(pods: Iterable[Mapping[str, Any]], node: str, *,
                       assigned: bool = False) -> list[Candidate]:
    """Every GPU container of every pod bound to ``node`` whose decision is recorded but not yet
    assigned (``assigned``: assigned too). A pod with a malformed spec or annotation is skipped
    (logged), never fatal."""
    out: list[Candidate] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        if spec.get("nodeName") != node or is_terminated(pod):
            continue
        ann = meta.get("annotations") or {}
        if is_assigned(ann) and not assigned:
            continue
        try:
            alloc = decode(ann)
            if alloc is None:
                continue
            req = parse_pod(pod)
        except ValidationError as e:
            log.warning("pod %s/%s skipped: %s", meta.get("namespace"), meta.get("name"), e)
            continue
        mem = {int(c): dict(gs) for c, gs in alloc.mem.items()}
        containers = {c.index: c for c in req.containers}
        # A first-generation annotation records the pod, not its containers: split it over the
        # GPU containers by their requests when the pod sits on one GPU.
        if set(mem) == {0} and (len(containers) > 1 or 0 not in containers):
            gpus = list(mem[0])
            if len(gpus) == 1:
                mem = {i: {gpus[0]: c.total_mem} for i, c in containers.items()}
        total = sum(v for gs in mem.values() for v in gs.values())
        specs = spec.get("containers") or []
        for c, gs in sorted(mem.items()):
            if not gs:
                continue
            cspec = specs[c] if 0 <= c < len(specs) and isinstance(specs[c], Mapping) else {}
            out.append(
                Candidate(
                    namespace=str(meta.get("namespace") or "default"),
                    name=str(meta.get("name") or ""),
                    uid=str(meta.get("uid") or ""),
                    container=c,
                    container_name=str(cspec.get("name") or ""),
                    mem=gs,
                    core=dict(alloc.core.get(c, {})),
                    whole=req.kind in (Kind.EXCLUSIVE, Kind.TOPOLOGY),
                    pod_total_mem=total,
                    assume_time=assume_time(ann),
                    required=_required(req.kind, bool(alloc.core.get(c))),
                    container_spec=cspec,
                    pod_spec=spec,
                )
            )
    return out


class Ledger:
    """What was handed out: (pod, container) → resources already allocated for it, and the pods
    fully handed out (excluded from matching until ``done_memory_s`` passed, so a pod list read
    before the pod was marked assigned cannot hand it out again)."""

    def __init__(self, done_memory_s: float = 600.0) -> None:
        self._given: dict[tuple[str, int], set[str]] = {}
        self._since: dict[str, float] = {}  # pod -> when its first container was handed out
        self._done: dict[str, float] = {}
        self.done_memory_s = done_memory_s

    def has(self, c: Candidate, resource: str) -> bool:
        return c.pod_key in self._done or resource in self._given.get(c.key, set())

    def finish(self, pod_key: str, now: float) -> None:
        """The pod is fully handed out: forget its containers, remember the pod."""
        self._done[pod_key] = now
        self._since.pop(pod_key, None)
        for k in [k for k in self._given if k[0] == pod_key]:
            del self._given[k]
        for k in [k for k, t in self._done.items() if now - t > self.done_memory_s]:
            del self._done[k]

    def is_done(self, pod_key: str) -> bool:
        return pod_key in self._done

    def resources(self, c: Candidate) -> set[str]:
        return self._given.get(c.key, set())

    def pod_started(self, c: Candidate) -> bool:
        return any(k[0] == c.pod_key for k in self._given)

    def record(self, c: Candidate, resource: str, now: float) -> None:
        self._given.setdefault(c.key, set()).add(resource)
        self._since.setdefault(c.pod_key, now)

    def prune(self, present: set[str], now: float) -> None:
        """Forget partly handed-out pods that left the node long ago (deleted mid-start)."""
        old = [p for p, t in self._since.items()
               if p not in present and now - t > self.done_memory_s]
        for p in old:
            del self._since[p]
            for k in [k for k in self._given if k[0] == p]:
                del self._given[k]

    def sync(self, pod_key: str, held: Mapping[tuple[str, int], frozenset[str]],
             now: float) -> None:
        """The kubelet's listing shows what each container of the pod holds (``held``, by
        ``Candidate.key``): that, and nothing else, is what the pod was handed. A pod the kubelet
        admits again (a restart that lost its device checkpoint) is open again."""
        self._done.pop(pod_key, None)
        for k in [k for k in self._given if k[0] == pod_key]:
            del self._given[k]
        for k, rs in held.items():
            if rs:
                self._given[k] = set(rs)
                self._since.setdefault(pod_key, now)

    def pod_done(self, candidates: Sequence[Candidate], pod_key: str) -> bool:
        """Whether every GPU container of the pod has had all its resources handed out."""
        mine = [c for c in candidates if c.pod_key == pod_key]
        return bool(mine) and all(c.required <= self.resources(c) for c in mine)



class Allocator:
    """Pure allocation logic for one node. Thread-safe: one lock around match-and-record."""

    def __init__(
        self, node: str, devices: DeviceMap, *, isolation: IsolationConfig | None = None
    ) -> None:
        self.node = node
        self.devices = devices
        self.isolation = isolation or IsolationConfig()
        self.ledger = Ledger()
        self._lock = threading.Lock()

    # --- matching ---
    def _in_turn(self, candidates: Sequence[Candidate], resource: str) -> list[Candidate]:
        """The pending containers the kubelet can be asking about now for ``resource``: the
        pod it has begun, if any, else every pod's first GPU container."""
        free = [c for c in candidates if not self.ledger.has(c, resource)]
        begun = [c for c in free if self.ledger.pod_started(c)]
        if begun:
            return begun
        first: dict[str, int] = {}
        for c in candidates:
            if c.container < first.get(c.pod_key, c.container + 1):
                first[c.pod_key] = c.container
        return [c for c in free if first[c.pod_key] == c.container]

    def _match(
        self, candidates: Sequence[Candidate], resource: str, want: Mapping[int, int],
        sure: bool = True,
    ) -> Candidate | None:
        """Exact matches (the devices :meth:`preferred` steered to) first, among the containers
        in turn, then any; then matches by totals, in turn, then any. Not ``sure`` (the node
        promised the scheduler to name each pod, and could not name this one): refuse rather
        than pick among pods that would get different GPUs or limits."""
        turn = self._in_turn(candidates, resource)
        if not sure:  # the devices were steered by a guess too: any look-alike may be asking
            self._refuse_a_guess(candidates, self._pool(turn, resource, want, False)
                                 or self._pool(candidates, resource, want, False), resource)
        for exact in (True, False):
            for among in (turn, candidates):
                pool = self._pool(among, resource, want, exact)
                if pool:
                    return min(pool, key=self._rank)
        return None

    def _refuse_a_guess(self, candidates: Sequence[Candidate], pool: Sequence[Candidate],
                        resource: str) -> None:
        pods = {c.pod_key for c in pool}
        grants = {tuple(sorted((c.container, tuple(sorted(c.mem.items())),
                                tuple(sorted(c.core.items())), c.pod_total_mem)
                               for c in candidates if c.pod_key == p)) for p in pods}
        if len(grants) > 1:
            refs = ", ".join(sorted({f"{c.namespace}/{c.name}" for c in pool}))
            raise AllocationError(
                f"{resource}: the kubelet's pod-resources API did not name the pod being "
                f"admitted on node {self.node}, and the pods it may be ({refs}) were placed "
                "differently; refusing to guess: the kubelet fails this pod's admission "
                "(UnexpectedAdmissionError) and its controller makes a new one")

    def _pool(self, candidates: Sequence[Candidate], resource: str, want: Mapping[int, int],
              exact: bool) -> list[Candidate]:
        free = [c for c in candidates if not self.ledger.has(c, resource)]
        if resource in WHOLE_RESOURCES:
            free = [c for c in free if c.whole]
        elif resource in (names.RES_GPU_MEM, names.RES_GPU_CORE):
            free = [c for c in free if not c.whole]
        if exact:
            return [c for c in free if c.signature(resource) == dict(want)]
        if resource in WHOLE_RESOURCES:
            return []  # cards are the kubelet's to give: a decision on other cards does not match
        total = sum(want.values())
        return [c for c in free if sum(c.signature(resource).values()) == total
                and len(c.signature(resource)) == len(want)]

    def _rank(self, c: Candidate) -> tuple[int, int, tuple[int, str, str, int]]:
        """Order among equal matches: the other half of a container already matched for another
        resource, then the next container of a pod already partly handed out, then assume-time."""
        other_half = 0 if self.ledger.resources(c) else 1
        same_pod = 0 if self.ledger.pod_started(c) else 1
        return (other_half, same_pod, c.order())

    def preferred(
        self,
        resource: str,
        candidates: Sequence[Candidate],
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        named: Named | None = None,
    ) -> list[str]:
        """Devices to steer the kubelet to: those on the GPUs the scheduler chose for the pod
        container this request most likely belongs to (of pod ``named``, the pod the kubelet's
        pod-resources listing names, when known); the kubelet's own order otherwise, for whole
        cards of a named pod without a decision first the cards no pending decision names."""
        everyone = candidates
        if named is not None:
            candidates = [c for c in candidates if c.pod_key == named.key]
        order = list(available)
        if named is not None and not candidates and resource in WHOLE_RESOURCES:
            order.sort(key=lambda d: self._decided_card(d, everyone, resource))
        fallback = list(must_include) + [d for d in order if d not in set(must_include)]
        fallback = fallback[:size]
        with self._lock:
            if named is not None:
                self._sync(named, candidates, time.monotonic())
            def sized(cs: Sequence[Candidate]) -> list[Candidate]:
                return sorted((
                    c for c in cs
                    if not self.ledger.has(c, resource)
                    and sum(c.signature(resource).values()) == size
                    and (c.whole == (resource in WHOLE_RESOURCES)
                         or resource == names.RES_GPU_COUNT)), key=self._rank)

            pool = sized(self._in_turn(candidates, resource)) or sized(candidates)
        for c in pool:
            try:
                picked = self.devices.pick(available, must_include, c.signature(resource))
            except ValidationError:
                picked = None
            if picked is not None:
                return picked
        return fallback

    def _decided_card(self, device_id: str, candidates: Sequence[Candidate],
                      resource: str) -> bool:
        """Whether the card of ``device_id`` is in a decision not yet handed out."""
        try:
            g = self.devices.gpu_of(device_id)
        except ValidationError:
            return False
        return any(c.whole and g in c.mem and not self.ledger.has(c, resource)
                   for c in candidates)

    def allocate(
        self,
        resource: str,
        device_ids: Sequence[str],
        candidates: Sequence[Candidate],
        *,
        backend: Backend,
        node_labels: Mapping[str, str],
        guard: Guard | None = None,
        named: Named | None = None,
        sure: bool = True,
    ) -> tuple[Grant, bool]:
        """The grant for one container request, and whether its pod is now fully handed out
        (time to mark it assigned). Raises :class:`AllocationError` with the reason, and
        :class:`IsolationUnavailable` (nothing recorded) when ``guard`` refuses the back-end.
        ``named``: the pod the kubelet's pod-resources listing names (only its containers
        match, and it alone); ``sure``: as :meth:`_match`. Whole cards are exactly the cards
        the kubelet's device IDs name."""
        if not device_ids:
            raise AllocationError(f"{resource}: the kubelet asked for no devices")
        try:
            want = self.devices.per_gpu(device_ids)
        except ValidationError as e:
            raise AllocationError(f"{resource}: {e}") from None
        done = False
        grant: Grant | None = None
        with self._lock:
            now = time.monotonic()
            self.ledger.prune({k.pod_key for k in candidates}, now)
            mine = candidates
            if named is not None:
                mine = [c for c in candidates if c.pod_key == named.key]
                self._sync(named, mine, now)
            c = self._match(mine, resource, want, sure)
            if c is not None:
                # build the answer first: a decision that cannot be served is not handed out
                grant = self._grant(c, resource, backend, node_labels, guard)
                self.ledger.record(c, resource, now)
                done = self.ledger.pod_done(candidates, c.pod_key)
                if done:
                    self.ledger.finish(c.pod_key, now)
        if c is None:
            unit = "%" if resource == names.RES_GPU_CORE else " GiB"
            if resource in WHOLE_RESOURCES:
                unit = " card"
            shape = ", ".join(f"GPU {g}: {v}{unit}" for g, v in sorted(want.items()))
            if named is not None and any(resource in c.required for c in mine):
                raise AllocationError(self._cannot_carry(resource, named, mine, shape))
            if resource in WHOLE_RESOURCES or resource == names.RES_GPU_COUNT:
                gpus = tuple(sorted(want))
                return self._plain_grant(gpus), False
            if named is not None:
                raise AllocationError(
                    f"{resource}: pod {named.ref}, which the kubelet is admitting on node "
                    f"{self.node} (its pod-resources listing names it), carries no sharegpu "
                    "decision for this node, and a shared GPU is given only by one; refusing "
                    "it: schedule it with the sharegpu extender (its scheduler, not "
                    "spec.nodeName), or ask for whole cards")
            raise AllocationError(
                f"{resource}: no pending pod on node {self.node} has a container that the "
                f"scheduler placed like this request ({shape}); was the pod scheduled by the "
                "sharegpu extender, and are its annotations intact?"
            )
        assert grant is not None
        return grant, done

    def _sync(self, named: Named, mine: Sequence[Candidate], now: float) -> None:
        """Make the ledger of the pod the kubelet is admitting what the kubelet's listing shows
        its containers hold."""
        self.ledger.sync(named.key, {
            c.key: named.held.get(c.container_name, frozenset()) & c.required for c in mine
        }, now)

    def _cannot_carry(self, resource: str, named: Named, mine: Sequence[Candidate],
                      shape: str) -> str:
        decided = "; ".join(
            f"{c.container_name or c.container}: "
            + ", ".join(f"GPU {g}" for g in sorted(c.signature(resource)))
            for c in mine if resource in c.required)
        held = [c for c in mine if resource in c.required and self.ledger.has(c, resource)]
        if held and len(held) == len([c for c in mine if resource in c.required]):
            why = (f"the kubelet's listing shows every container of it already holding "
                   f"{resource}")
        elif resource in WHOLE_RESOURCES:
            why = ("whole cards are only the cards the kubelet gives (giving others would put "
                   "two pods on one card); the kubelet offered other cards because it holds the "
                   "decided ones for another pod, or it lost its device checkpoint and did not "
                   "follow the preference")
        else:
            why = ("the kubelet's devices differ from the decision in size (did the pod's "
                   "requests change?)")
        return (f"{resource}: pod {named.ref}, which the kubelet is admitting on node "
                f"{self.node}, carries sharegpu's decision ({decided}), but the kubelet's "
                f"devices ({shape}) cannot carry it: {why}; refusing: the kubelet fails this "
                "pod's admission (UnexpectedAdmissionError) and its controller makes a new one")

    # --- responses ---
    def grant(
        self,
        c: Candidate,
        backend: Backend,
        node_labels: Mapping[str, str],
        guard: Guard | None = None,
    ) -> Grant:
        """Everything ``c`` gets (its GPUs, and for a shared container the isolation
        back-end's environment and mounts, memory and compute limits together), without
        matching or recording anything: the DRA kubelet plugin's answer for a claim."""
        resource = names.RES_NVIDIA_GPU if c.whole else names.RES_GPU_MEM
        return self._grant(c, resource, backend, node_labels, guard)

    def _uuids(self, gpus: Sequence[int]) -> tuple[str, ...]:
        out = []
        for g in gpus:
            if not 0 <= g < len(self.devices.gpus):
                raise AllocationError(
                    f"the scheduler placed the container on GPU {g}, but node {self.node} has "
                    f"{len(self.devices.gpus)} GPU(s); refusing to start it without a GPU"
                )
            out.append(self.devices.uuid(g))
        return tuple(out)

    def _plain_grant(self, gpus: tuple[int, ...]) -> Grant:
        uuids = self._uuids(gpus)
        env = ContainerEnv({names.ENV_VISIBLE_DEVICES: ",".join(uuids)})
        return Grant(None, gpus, uuids, env, {})

    def _grant(
        self,
        c: Candidate,
        resource: str,
        backend: Backend,
        node_labels: Mapping[str, str],
        guard: Guard | None = None,
    ) -> Grant:
        gpus = tuple(sorted(c.mem))
        uuids = self._uuids(gpus)
        notes = {ANN_GRANT: c.ref}
        b = Backend.NONE if c.whole or disabled(c.container_spec, node_labels) else backend
        if b is not Backend.NONE and guard is not None:
            guard(b, c)  # fail closed: no isolated GPU without a usable back-end
        own = own_limit_routes(b, c.container_spec, self.isolation)
        if own:
            raise IsolationUnavailable(
                f"node {self.node}: isolation back-end {b.value} refuses {c.ref}: the container "
                f"could set its own limits, replacing those the agent gives it: "
                f"{'; '.join(own)}. Rule: {LIMIT_RULE}; fix: remove them (its limits come from "
                "its gpu-mem and gpu-core.percentage; an envFrom prefix that cannot begin those "
                "variables is fine), or opt it out of isolation with CGPU_DISABLE=true", c)
        user = other_user(c.container_spec, c.pod_spec, self.isolation.mps_user) \
            if b.uses_mps else None
        if user:
            raise IsolationUnavailable(
                f"node {self.node}: isolation back-end {b.value} refuses {c.ref}: the container "
                f"{user}, but the MPS control daemon serves UID {self.isolation.mps_user} and MPS "
                "serves one user at a time: its CUDA calls would wait until the daemon's server "
                f"exits; fix: run it as UID {self.isolation.mps_user} (securityContext.runAsUser), "
                "or opt it out of isolation with CGPU_DISABLE=true", c)
        gpu_mem = {g: self.devices.gpus[g].mem_gib for g in gpus}
        if resource == names.RES_GPU_CORE:
            # The memory side sets the full environment; compute only repeats its own limit.
            iso = isolation_env(b, mem=c.mem, core=c.core, pod_uid=c.uid, config=self.isolation,
                                gpu_mem=gpu_mem)
            env = {k: v for k, v in iso.envs.items() if k in COMPUTE_ENVS}
            env[names.ENV_VISIBLE_DEVICES] = ",".join(uuids)
            return Grant(c, gpus, uuids, ContainerEnv(env), notes)
        envs = {names.ENV_VISIBLE_DEVICES: ",".join(uuids)}
        mounts: tuple = ()
        if not c.whole:
            envs[names.ENV_MEM_IDX] = ",".join(str(g) for g in gpus)
            envs[names.ENV_MEM_POD] = str(c.pod_total_mem)
            envs[names.ENV_MEM_CONTAINER] = str(sum(c.mem.values()))
            envs[names.ENV_MEM_DEV] = str(self.devices.gpus[gpus[0]].mem_gib)
            iso = isolation_env(b, mem=c.mem, core=c.core, pod_uid=c.uid, config=self.isolation,
                                gpu_mem=gpu_mem)
            envs.update(iso.envs)
            mounts = iso.mounts
        return Grant(c, gpus, uuids, ContainerEnv(envs, mounts), notes)


def _required(kind: Kind, has_core: bool) -> frozenset[str]:
    """The resources the kubelet allocates for a container of this kind: all of them handed out
    means the container is fully allocated."""
    if kind is Kind.EXCLUSIVE:
        return frozenset({names.RES_NVIDIA_GPU})
    if kind is Kind.TOPOLOGY:
        return frozenset({names.RES_TOPOLOGY_GPU})
    if has_core:
        return frozenset({names.RES_GPU_MEM, names.RES_GPU_CORE})
    return frozenset({names.RES_GPU_MEM})
