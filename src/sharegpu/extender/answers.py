"""The scheduling answers: kube-scheduler's filter, the policy's pick, the scores of
prioritize and the reservation its bind makes, each read from the cluster cache (:mod:`.cache`)
through the core (feasibility, the policy's scores and GPU choice). The feasibility masks, the
reasons nodes fail and where a pod would fit an empty node are kept per request shape and
brought up to date row by row."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import compress
from operator import itemgetter
from typing import Any

import numpy as np

from ..core.errors import PlacementError
from ..core.placement.base import resolve
from ..core.placement.learned import LearnedWorkload
from ..core.placement.moves import has_fast_path
from ..core.placement.nodecache import ShapeCache
from ..core.placement.rowmemo import unique_keys
from ..core.request import PodRequest
from ..core.state import _KIND_MODES, _MODE_CODES, ClusterState, Reservation, without_host
from .cache import UNKNOWN_NODE, ClusterCache
from .drastate import DraState
from .pickholds import PickHolds

# policies whose score of a node reads that node's row alone (so scores keep until it changes)
ROW_LOCAL_POLICIES = frozenset({"fgd", "strand", "strandlp", "strandfill"})


def request_key(req: PodRequest) -> tuple[Any, ...]:
    return (
        req.kind, req.cpu_milli, req.mem_mib,
        tuple((c.gpu_mem, c.gpu_core, c.gpus, c.whole) for c in req.containers),
        tuple(sorted(req.models)) if req.models is not None else None,
    )


class SchedulingAnswers:
    """Filter, pick, prioritize's scores and the bind's reservation over the cluster cache
    ``ledger``, with the policy's ``learned`` workload, the DRA pool (``dra``) and the picks
    held until their binds (``holds``)."""

    def __init__(self, ledger: ClusterCache, learned: LearnedWorkload, dra: DraState,
                 holds: PickHolds, *, graded: bool = False,
                 agents_down: Callable[[], dict[str, str]] = dict) -> None:
        """``agents_down``: the nodes whose agent does not serve GPU pods now, with why
        (:mod:`sharegpu.core.agentserving`): no GPU pod passes or is bound there."""
        self.ledger = ledger
        self.learned = learned
        self.dra = dra
        self.holds = holds
        self.graded = graded  # prioritize scores every feasible node, not only the pick
        self.agents_down = agents_down
        # the last filter's passing names, their slots and the node set's version then
        self.passed: tuple[list[str], np.ndarray, int] = ([], np.zeros(0, dtype=np.int64), -1)
        # FGD, strand and strandlp score a node from that node's row alone, so scores can be kept
        # per request shape until the node changes (they cache their common shapes themselves;
        # this covers compute, whole-card and multi-container requests)
        self.row_local = resolve(ledger.policy_name) in ROW_LOCAL_POLICIES
        self._scores: ShapeCache | None = (
            ShapeCache({"score": np.float64}) if self.row_local else None
        )
        self._scores_epoch = learned.epoch  # the policy's preparation the kept scores are of
        self._reasons: OrderedDict[tuple[Any, ...], dict[int, tuple[int, str]]] = OrderedDict()
        self._empty_ok: dict[tuple[Any, ...], tuple[int, np.ndarray]] = {}
        # per request shape: the state it was computed on, the mask, each node's version then
        self._feasible: OrderedDict[tuple[Any, ...], tuple[ClusterState, np.ndarray, np.ndarray]]
        self._feasible = OrderedDict()

    def forget(self) -> None:
        """A rebuild made a new state: the kept masks and reasons are of the old one."""
        self._feasible.clear()
        self._reasons.clear()

    # -- decisions ---------------
    def slots(self, names: list[str]) -> np.ndarray:
        """Node slot of each name, -1 for names the view does not know."""
        index = self.ledger.state.index
        if len(names) > 1:
            try:  # all known: one C-level lookup
                return np.array(itemgetter(*names)(index), dtype=np.int64)
            except KeyError:
                pass
        get = index.get
        return np.fromiter((get(n, -1) for n in names), dtype=np.int64, count=len(names))

    def filter(
        self, req: PodRequest, names: list[str]
    ) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """(passing names, failed {name: reason}, unresolvable {name: reason})."""
        if not req.wants_gpu:
            return list(names), {}, {}
        ledger, holds = self.ledger, self.holds
        holds.expire()
        # filtered again (kube-scheduler retries it): what was held for it is free again
        holds.drop_one(req.key)
        self.learned.maybe_refresh(ledger.state)
        slots = self.slots(names)
        known = slots >= 0
        if known.all():
            ok = self.feasible_at(req, slots)
        else:
            ok = np.zeros(len(names), dtype=bool)
            ok[known] = self.feasible_at(req, slots[known])
        passed = list(compress(names, ok.tolist()))
        # the prioritize that follows asks for these names: their slots hold while no node
        # is added, changed or removed
        self.passed = (passed, slots[ok], ledger.nodes_version)
        failed: dict[str, str] = {}
        unres: dict[str, str] = {}
        bad = np.flatnonzero(~ok)
        if len(bad) == 0:
            return passed, failed, unres
        # reasons are kept per GPU request: where the host CPU and memory admit the pod, its
        # reason is the GPU request's (explain checks them before the GPUs)
        gpu_req = without_host(req)
        cache = self._reason_cache(gpu_req)
        st = ledger.state
        at = slots[bad]
        at_known = np.where(at >= 0, at, 0)
        version = st.version[at_known].tolist()
        cpu, mem = req.cpu_milli, req.mem_mib
        empty_ok = self.fits_empty(gpu_req)[at_known]
        host_short = np.zeros(len(at), dtype=bool)
        if cpu or mem:
            empty_ok &= (st.cpu_cap[at_known] >= cpu) & (st.mem_cap[at_known] >= mem)
            host_short = (st.cpu_free[at_known] < cpu) | (st.mem_free[at_known] < mem)
        pool = self.dra.pool_mask(req, at)  # DRA pods: DRA nodes only; others: the rest
        outside = (~pool).tolist() if pool is not None else [False] * len(at)
        down = self.agents_down()
        for j, i, v, empty, short, out in zip(bad.tolist(), at.tolist(), version,
                                              empty_ok.tolist(), host_short.tolist(), outside,
                                              strict=True):
            name = names[j]
            if i < 0:
                unres[name] = UNKNOWN_NODE
                continue
            if out:
                unres[name] = self.dra.pool_reason(req)
                continue
            why = down.get(name) if down else None
            if why is not None:  # its agent does not serve: preemption would not help
                unres[name] = why
                continue
            if short:
                reason = st.explain(req, i) or "does not fit"
            else:
                hit = cache.get(i)
                if hit is not None and hit[0] == v:
                    reason = hit[1]
                else:
                    reason = st.explain(gpu_req, i) or "does not fit"
                    cache[i] = (v, reason)
            (failed if empty else unres)[name] = reason
        return passed, failed, unres

    def feasible_at(self, req: PodRequest, slots: np.ndarray) -> np.ndarray:
        """The core's feasibility of node ``slots`` (known ones): the GPU request's, kept per
        GPU request (:meth:`feasible`), and the host CPU and memory's, read afresh (pods
        differ in CPU and memory far more than in GPU shape)."""
        st = self.ledger.state
        if not req.cpu_milli and not req.mem_mib:
            ok = self.feasible(req)[slots]
        else:
            ok = self.feasible(without_host(req))[slots]
            if req.cpu_milli:
                ok &= st.cpu_free[slots] >= req.cpu_milli
            if req.mem_mib:
                ok &= st.mem_free[slots] >= req.mem_mib
        pool = self.dra.pool_mask(req, slots)
        if pool is not None:
            ok &= pool
        down = self.agents_down()
        if down:
            ok &= self.serving_mask(down)[slots]
        return ok

    def serving_mask(self, down: dict[str, str]) -> np.ndarray:
        """Over every node slot (and a last one for unknown names): whether its agent serves."""
        index = self.ledger.state.index
        mask = np.ones(self.ledger.state.n + 1, dtype=bool)
        for node in down:
            i = index.get(node)
            if i is not None:
                mask[i] = False
        return mask

    def feasible(self, req: PodRequest) -> np.ndarray:
        """The core's feasibility mask over every node, kept per request shape and brought up
        to date row by row: a node's feasibility reads that node's row alone, so only nodes
        whose version moved since are checked again. Do not modify the returned array."""
        st = self.ledger.state
        n = st.n
        k = request_key(req)
        hit = self._feasible.get(k)
        if hit is not None and hit[0] is st and len(hit[1]) == n:
            _, mask, ver = hit
            self._feasible.move_to_end(k)
            stale = np.flatnonzero(ver != st.version[:n])
            if len(stale) == 0:
                return mask
            if len(stale) <= n // 8:
                mask[stale] = st.feasible(req, stale)
                ver[stale] = st.version[stale]
                return mask
        mask = st.feasible(req)
        self._feasible[k] = (st, mask, st.version[:n].copy())
        self._feasible.move_to_end(k)
        while len(self._feasible) > 64:
            self._feasible.popitem(last=False)
        return mask

    def _reason_cache(self, req: PodRequest) -> dict[int, tuple[int, str]]:
        k = request_key(req)
        c = self._reasons.get(k)
        if c is None:
            c = self._reasons[k] = {}
            while len(self._reasons) > 64:
                self._reasons.popitem(last=False)
        else:
            self._reasons.move_to_end(k)
        return c

    def fits_empty(self, req: PodRequest) -> np.ndarray:
        """Nodes where the pod would fit if they were empty (else no preemption can help);
        kept per request shape until a node is added, changed or removed."""
        k = request_key(req)
        hit = self._empty_ok.get(k)
        version = self.ledger.nodes_version
        if hit is not None and hit[0] == version:
            return hit[1]
        ok = self._fits_empty(req)
        if len(self._empty_ok) > 256:
            self._empty_ok.clear()
        self._empty_ok[k] = (version, ok)
        return ok

    def _fits_empty(self, req: PodRequest) -> np.ndarray:
        st = self.ledger.state
        n = st.n
        ok = st.active[:n].copy()
        if req.cpu_milli:
            ok &= st.cpu_cap[:n] >= req.cpu_milli
        if req.mem_mib:
            ok &= st.mem_cap[:n] >= req.mem_mib
        modes = _KIND_MODES[req.kind]
        codes = np.array([_MODE_CODES[m] for m in modes if m in _MODE_CODES], dtype=np.int8)
        ok &= np.isin(st.mode[:n], codes)
        if req.models is not None:
            ids = [st.models[m] for m in req.models if m in st.models]
            ok &= np.isin(st.model[:n], np.array(ids, dtype=np.int32))
        for c in req.containers:
            if c.whole:
                ok &= st.gpu_count[:n] >= c.gpus
            else:
                ok &= (st.gpu_exists[:n] & (st.gpu_total[:n] >= c.gpu_mem)).sum(axis=1) >= c.gpus
        return ok

    # -- the policy's pick, held ---------------
    def pick(self, req: PodRequest, names: list[str], *, hold: bool) -> str | None:
        """The node among ``names`` (nodes that passed filter) the policy picks, the one
        prioritize would score 10; None when none is feasible. With ``hold``, the pod's GPUs
        there are chosen and held in flight (:mod:`.pickholds`) until its bind confirms them,
        so the next pod's filter sees them taken: only for a pod the informer shows waiting
        (:meth:`~.pickholds.PickHolds.may_hold_for`)."""
        if not names:
            return None
        slots = self.slots_of(names)
        best = self._best(req, slots)
        if best is None:
            return None
        node = names[int(np.flatnonzero(slots == best)[0])]
        if hold and self.holds.may_hold_for(req.key, req.uid):
            try:
                self.reserve(req, node)
            except PlacementError:  # the bind finds (and reports) the same
                return node
            self.holds.hold(req.key, node)
        return node

    def slots_of(self, names: list[str]) -> np.ndarray:
        """:meth:`slots`, taken from the last filter's answer when ``names`` is its list."""
        p_names, p_slots, p_version = self.passed
        if names is p_names and p_version == self.ledger.nodes_version:
            return p_slots  # the filter's own answer: its slots are known
        return self.slots(names)

    def _best(self, req: PodRequest, slots: np.ndarray) -> int | None:
        """The slot the policy picks among the feasible ones of ``slots`` (in their order)."""
        known = slots[slots >= 0]
        nodes = known[self.feasible_at(req, known)]
        if len(nodes) == 0:
            return None
        scores = self.scores(req, nodes)
        if self.ledger.policy.integer_scores:
            scores = np.floor(scores)
        return self.ledger.scheduler.pick(nodes, scores)

    def prioritize(self, req: PodRequest, names: list[str], slots: np.ndarray
                   ) -> dict[str, int]:
        """Scores 0..10 of ``names`` (at node ``slots``) for a GPU pod (see
        :meth:`~.early_prioritize.EarlyPrioritize.prioritize`)."""
        held = self.holds.held_pick(req.key)
        if held is not None:  # its GPUs are held there: the state counts them already
            return {n: 10 if n == held else 0 for n in names}
        known = slots[slots >= 0]
        nodes = known[self.feasible_at(req, known)]
        if len(nodes) == 0:
            return dict.fromkeys(names, 0)
        scores = self.scores(req, nodes)
        if self.ledger.policy.integer_scores:
            scores = np.floor(scores)
        best = self.ledger.scheduler.pick(nodes, scores)
        if not self.graded:
            out = dict.fromkeys(names, 0)
            out[names[int(np.flatnonzero(slots == best)[0])]] = 10
            return out
        lo, hi = float(scores.min()), float(scores.max())
        if hi > lo:
            scaled = np.floor(9.0 * (scores - lo) / (hi - lo)).astype(np.int64)
        else:
            scaled = np.full(len(nodes), 9, dtype=np.int64)
        by_slot = np.zeros(self.ledger.state.n + 1, dtype=np.int64)  # the last one: unknown names
        by_slot[nodes] = np.minimum(scaled, 9)
        by_slot[best] = 10
        return dict(zip(names, by_slot[slots].tolist(), strict=True))

    def scores(self, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        """The policy's scores for feasible ``nodes``."""
        scheduler = self.ledger.scheduler
        if self._scores is None or has_fast_path(req):
            return scheduler.scores(req, nodes)
        if self._scores_epoch != self.learned.epoch:  # the policy was prepared afresh
            self._scores = ShapeCache({"score": np.float64})
            self._scores_epoch = self.learned.epoch
        cache = self._scores
        st = self.ledger.state
        col = cache.column(request_key(req))
        stale = cache.stale(st, nodes, col)
        if len(stale) > 16:
            # nodes whose rows are equal score equally (the policy reads only the node's row):
            # score one of each kind (most nodes of a fresh cluster look alike)
            rows = np.concatenate(
                [st.gpu_total[stale], st.gpu_free[stale], st.core_free[stale],
                 st.gpu_pods[stale].astype(np.int64),
                 np.stack([st.model[stale].astype(np.int64), st.cpu_free[stale],
                           st.mem_free[stale]], axis=1)], axis=1)
            first, inverse = unique_keys(np.ascontiguousarray(rows))
            score = scheduler.scores(req, stale[first])[inverse]
            cache.store(st, stale, col, score=score)
        elif len(stale):
            cache.store(st, stale, col, score=scheduler.scores(req, stale))
        return cache.get("score", nodes, col)

    def reserve(self, req: PodRequest, node: str) -> Reservation:
        """Choose GPUs on ``node`` with the core policy and hold them, in flight. Raises
        PlacementError with the one clear reason when the pod does not fit there (any more)."""
        key = req.key
        ledger, holds = self.ledger, self.holds
        holds.expire()
        held = holds.take(key)
        down = self.agents_down().get(node)
        if held is not None:
            r = ledger.inflight.get(key)
            if held == node and r is not None and r.request.uid == req.uid and down is None:
                return r  # the bind confirms what its filter held
            ledger.give_back(key)  # chosen elsewhere (or its agent stopped since): afresh
        st = ledger.state
        i = st.index.get(node)
        if i is None:
            raise PlacementError(f"{key} on {node}: {UNKNOWN_NODE}")
        self.learned.maybe_refresh(st)
        holding = st.pods.get(key)
        if holding is not None:
            raise PlacementError(f"{key}: already holds GPUs on {holding.node}")
        reason = down or st.explain(req, i)
        if reason is not None:
            raise PlacementError(f"{key} on {node}: {reason}")
        alloc = ledger.policy.select(st, req, i)
        if alloc is None:
            raise PlacementError(f"{key} on {node}: no GPU choice fits")
        r = st.reserve(req, i, alloc)
        ledger.policy.placed(st, req, i, r.alloc)
        ledger.inflight[key] = r
        ledger.touch(key)
        return r
