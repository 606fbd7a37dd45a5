"""The scheduling answers: kube-scheduler's filter, the scores of prioritize, and the
reservation its bind makes, each read from the cluster cache (:mod:`.cache`) through the core
(feasibility, the policy's scores and GPU choice). The feasibility masks, the reasons nodes
fail and where a pod would fit an empty node are kept per request shape and brought up to date
row by row. A part of :class:`~.view.ClusterView`; the prioritize that follows a filter is
answered early by :mod:`.early_prioritize`."""

from __future__ import annotations

from collections import OrderedDict
from itertools import compress
from operator import itemgetter
from typing import Any

import numpy as np

from ..errors import PlacementError
from ..placement.moves import has_fast_path
from ..placement.rowmemo import unique_keys
from ..request import PodRequest
from ..state import _KIND_MODES, _MODE_CODES, ClusterState, Reservation, without_host
from .cache import UNKNOWN_NODE
from .picks import HeldPicks


def request_key(req: PodRequest) -> tuple[Any, ...]:
    return (
        req.kind, req.cpu_milli, req.mem_mib,
        tuple((c.gpu_mem, c.gpu_core, c.gpus, c.whole) for c in req.containers),
        tuple(sorted(req.models)) if req.models is not None else None,
    )


class SchedulingAnswers:
    """The answers of :class:`~.view.ClusterView` (the cache's attributes come from
    :class:`~.cache.ClusterCache`)."""

    def _init_answers(self, graded: bool, picks: HeldPicks | None = None) -> None:
        self.graded = graded  # prioritize scores every feasible node, not only the pick
        # the picks filter answered with, held in flight until their binds (:mod:`.picks`)
        self.picks = picks if picks is not None else HeldPicks()
        self._reasons: OrderedDict[tuple[Any, ...], dict[int, tuple[int, str]]] = OrderedDict()
        self._empty_ok: dict[tuple[Any, ...], tuple[int, np.ndarray]] = {}
        # per request shape: the state it was computed on, the mask, each node's version then
        self._feasible: OrderedDict[tuple[Any, ...], tuple[ClusterState, np.ndarray, np.ndarray]]
        self._feasible = OrderedDict()

    def _forget_answers(self) -> None:
        """A rebuild made a new state: the kept masks and reasons are of the old one."""
        self._feasible.clear()
        self._reasons.clear()

    # -- decisions ---------------
    def slots(self, names: list[str]) -> np.ndarray:
        """Node slot of each name, -1 for names the view does not know."""
        index = self.state.index
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
        self.expire_picks()
        # filtered again (kube-scheduler retries it): what was held for it is free again
        self._drop_pick(req.key)
        self.maybe_refresh_workload()
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
        self._passed = (passed, slots[ok], self._nodes_version)
        failed: dict[str, str] = {}
        unres: dict[str, str] = {}
        bad = np.flatnonzero(~ok)
        if len(bad) == 0:
            return passed, failed, unres
        # reasons are kept per GPU request: where the host CPU and memory admit the pod, its
        # reason is the GPU request's (explain checks them before the GPUs)
        gpu_req = without_host(req)
        cache = self._reason_cache(gpu_req)
        st = self.state
        at = slots[bad]
        at_known = np.where(at >= 0, at, 0)
        version = st.version[at_known].tolist()
        cpu, mem = req.cpu_milli, req.mem_mib
        empty_ok = self.fits_empty(gpu_req)[at_known]
        host_short = np.zeros(len(at), dtype=bool)
        if cpu or mem:
            empty_ok &= (st.cpu_cap[at_known] >= cpu) & (st.mem_cap[at_known] >= mem)
            host_short = (st.cpu_free[at_known] < cpu) | (st.mem_free[at_known] < mem)
        pool = self.pool_mask(req, at)  # DRA pods: DRA nodes only; others: the rest
        outside = (~pool).tolist() if pool is not None else [False] * len(at)
        for j, i, v, empty, short, out in zip(bad.tolist(), at.tolist(), version,
                                              empty_ok.tolist(), host_short.tolist(), outside,
                                              strict=True):
            name = names[j]
            if i < 0:
                unres[name] = UNKNOWN_NODE
                continue
            if out:
                unres[name] = self.pool_reason(req)
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
        st = self.state
        if not req.cpu_milli and not req.mem_mib:
            ok = self.feasible(req)[slots]
        else:
            ok = self.feasible(without_host(req))[slots]
            if req.cpu_milli:
                ok &= st.cpu_free[slots] >= req.cpu_milli
            if req.mem_mib:
                ok &= st.mem_free[slots] >= req.mem_mib
        pool = self.pool_mask(req, slots)
        if pool is not None:
            ok &= pool
        return ok

    def feasible(self, req: PodRequest) -> np.ndarray:
        """The core's feasibility mask over every node, kept per request shape and brought up
        to date row by row: a node's feasibility reads that node's row alone, so only nodes
        whose version moved since are checked again. Do not modify the returned array."""
        st, n = self.state, self.state.n
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
        if hit is not None and hit[0] == self._nodes_version:
            return hit[1]
        ok = self._fits_empty(req)
        if len(self._empty_ok) > 256:
            self._empty_ok.clear()
        self._empty_ok[k] = (self._nodes_version, ok)
        return ok

    def _fits_empty(self, req: PodRequest) -> np.ndarray:
        st, n = self.state, self.state.n
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
        there are chosen and held in flight (:mod:`.picks`) until its bind confirms them,
        so the next pod's filter sees them taken."""
        if not names:
            return None
        p_names, p_slots, p_version = self._passed
        if names is p_names and p_version == self._nodes_version:
            slots = p_slots  # the filter's own answer: its slots are known
        else:
            slots = self.slots(names)
        best = self._best(req, slots)
        if best is None:
            return None
        node = names[int(np.flatnonzero(slots == best)[0])]
        if hold and self.picks.may_hold():
            try:
                self.reserve(req, node)
            except PlacementError:  # the bind finds (and reports) the same
                return node
            self.picks.hold(req.key, node)
        return node

    def held_pick(self, key: str) -> str | None:
        """The node held for ``key`` since its filter, if any."""
        return self.picks.node(key) if key in self.inflight else None

    def expire_picks(self) -> list[str]:
        """Give back every pick whose timeout passed; their keys."""
        keys = self.picks.expired()
        for key in keys:
            self._release_held(key)
        return keys

    def drop_picks(self, node: str | None = None) -> list[str]:
        """Give back every pick held (on ``node`` only, when given); their keys."""
        keys = self.picks.keys() if node is None else self.picks.on_node(node)
        for key in keys:
            self._drop_pick(key)
        return keys

    def _drop_pick(self, key: str) -> None:
        if self.picks.take(key) is not None:
            self._release_held(key)

    def _release_held(self, key: str) -> None:
        if self._change_logs:
            self._touch(key)
        self.starting.discard(key)
        if self.inflight.pop(key, None) is not None and key in self.state.pods:
            self.scheduler.release(key)

    def _best(self, req: PodRequest, slots: np.ndarray) -> int | None:
        """The slot the policy picks among the feasible ones of ``slots`` (in their order)."""
        known = slots[slots >= 0]
        nodes = known[self.feasible_at(req, known)]
        if len(nodes) == 0:
            return None
        scores = self.scores(req, nodes)
        if self.policy.integer_scores:
            scores = np.floor(scores)
        return self.scheduler.pick(nodes, scores)

    def _prioritize(self, req: PodRequest, names: list[str], slots: np.ndarray) -> dict[str, int]:
        held = self.held_pick(req.key)
        if held is not None:  # its GPUs are held there: the state counts them already
            return {n: 10 if n == held else 0 for n in names}
        known = slots[slots >= 0]
        nodes = known[self.feasible_at(req, known)]
        if len(nodes) == 0:
            return dict.fromkeys(names, 0)
        scores = self.scores(req, nodes)
        if self.policy.integer_scores:
            scores = np.floor(scores)
        best = self.scheduler.pick(nodes, scores)
        if not self.graded:
            out = dict.fromkeys(names, 0)
            out[names[int(np.flatnonzero(slots == best)[0])]] = 10
            return out
        lo, hi = float(scores.min()), float(scores.max())
        if hi > lo:
            scaled = np.floor(9.0 * (scores - lo) / (hi - lo)).astype(np.int64)
        else:
            scaled = np.full(len(nodes), 9, dtype=np.int64)
        by_slot = np.zeros(self.state.n + 1, dtype=np.int64)  # the last one: unknown names
        by_slot[nodes] = np.minimum(scaled, 9)
        by_slot[best] = 10
        return dict(zip(names, by_slot[slots].tolist(), strict=True))

    def scores(self, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        """The policy's scores for feasible ``nodes``."""
        if self._scores is None or has_fast_path(req):
            return self.scheduler.scores(req, nodes)
        cache = self._scores
        col = cache.column(request_key(req))
        stale = cache.stale(self.state, nodes, col)
        if len(stale) > 16:
            # nodes whose rows are equal score equally (the policy reads only the node's row):
            # score one of each kind (most nodes of a fresh cluster look alike)
            st = self.state
            rows = np.concatenate(
                [st.gpu_total[stale], st.gpu_free[stale], st.core_free[stale],
                 st.gpu_pods[stale].astype(np.int64),
                 np.stack([st.model[stale].astype(np.int64), st.cpu_free[stale],
                           st.mem_free[stale]], axis=1)], axis=1)
            first, inverse = unique_keys(np.ascontiguousarray(rows))
            score = self.scheduler.scores(req, stale[first])[inverse]
            cache.store(self.state, stale, col, score=score)
        elif len(stale):
            cache.store(self.state, stale, col, score=self.scheduler.scores(req, stale))
        return cache.get("score", nodes, col)

    def reserve(self, req: PodRequest, node: str) -> Reservation:
        """Choose GPUs on ``node`` with the core policy and hold them, in flight. Raises
        PlacementError with the one clear reason when the pod does not fit there (any more)."""
        key = req.key
        self.expire_picks()
        held = self.picks.take(key)
        if held is not None:
            r = self.inflight.get(key)
            if held == node and r is not None and r.request.uid == req.uid:
                return r  # the bind confirms what its filter held
            self._release_held(key)  # chosen elsewhere: reserved afresh below
        i = self.state.index.get(node)
        if i is None:
            raise PlacementError(f"{key} on {node}: {UNKNOWN_NODE}")
        self.maybe_refresh_workload()
        held = self.state.pods.get(key)
        if held is not None:
            raise PlacementError(f"{key}: already holds GPUs on {held.node}")
        reason = self.state.explain(req, i)
        if reason is not None:
            raise PlacementError(f"{key} on {node}: {reason}")
        alloc = self.policy.select(self.state, req, i)
        if alloc is None:
            raise PlacementError(f"{key} on {node}: no GPU choice fits")
        r = self.state.reserve(req, i, alloc)
        self.policy.placed(self.state, req, i, r.alloc)
        self.inflight[key] = r
        if self._change_logs:
            self._touch(key)
        return r

    def release_inflight(self, key: str) -> None:
        self.picks.take(key)
        if self._change_logs:
            self._touch(key)
        self.starting.discard(key)
        if self.inflight.pop(key, None) is not None and key in self.state.pods:
            self.scheduler.release(key)

    def bound(self, key: str) -> None:
        """The binding was created: the reservation is now what the pod's annotations say."""
        if self._change_logs:
            self._touch(key)
        r = self.inflight.pop(key, None)
        if r is None or key not in self.state.pods:
            return
        self.state.bind(key)
        self.placed[key] = (r.request, r.node, r.alloc)
        self._count_shape(key, r.request, r.alloc)
