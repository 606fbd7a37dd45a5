"""The early prioritize: kube-scheduler asks prioritize right after its filter, with the names
the filter passed. The server computes the answer as soon as the filter is answered, keeps it
with what it read (the pod, the names, the policy's epoch and the versions of the nodes it
scored), and gives it again while all of it is unchanged (:meth:`EarlyPrioritize.still_current`),
so the prioritize that follows is a lookup."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.placement.learned import LearnedWorkload
from ..core.request import PodRequest
from .answers import SchedulingAnswers, request_key
from .cache import ClusterCache


class EarlyPrioritize:
    """Prioritize's answer (from ``answers``), kept while nothing it read in the cluster cache
    ``ledger`` or the ``learned`` workload's epoch changed."""

    def __init__(self, ledger: ClusterCache, learned: LearnedWorkload,
                 answers: SchedulingAnswers) -> None:
        self.ledger = ledger
        self.learned = learned
        self.answers = answers
        # the last prioritize: (pod asked about, names, their slots, what it read, answer)
        self._last_scores: tuple[
            tuple[Any, ...], list[str], np.ndarray, tuple[tuple[Any, ...], np.ndarray],
            dict[str, int],
        ] | None = None

    def prioritize(self, req: PodRequest, names: list[str]) -> dict[str, int]:
        """Scores 0..10: the node the core policy would pick gets 10; with ``graded`` the other
        feasible nodes get 0..9 in the order of the policy's scores, else 0 (with the extender's
        weight above kube-scheduler's own scores, only the 10 ever decides); infeasible nodes 0.

        The last answer is kept with what it read (the pod, the names, the policy's epoch and
        the version of every node it scored, or of the whole cluster for policies that read
        more than a node's row), and given again while all of it is unchanged: the server asks
        right after answering the filter, so the prioritize that follows is a lookup. Do not
        modify the returned dict."""
        if not req.wants_gpu or not names:
            return dict.fromkeys(names, 0)
        self.learned.maybe_refresh(self.ledger.state)
        asked = (req.key, req.uid, request_key(req))
        last = self._last_scores
        if last is not None and last[0] == asked and last[1] == names and self._unchanged(last):
            return last[4]
        slots = self.answers.slots_of(names)
        out = self.answers.prioritize(req, names, slots)
        self._last_scores = (asked, list(names), slots, self._read_now(slots), out)
        return out

    def still_current(self, scores: dict[str, int]) -> bool:
        """Whether ``scores``, the last answer :meth:`prioritize` gave, would be given again
        for the same pod and names now (nothing it read has changed)."""
        last = self._last_scores
        if last is None or last[4] is not scores:
            return False
        self.learned.maybe_refresh(self.ledger.state)
        return self._unchanged(last)

    def _read_now(self, slots: np.ndarray) -> tuple[tuple[Any, ...], np.ndarray]:
        """What a prioritize over node ``slots`` reads, as it is now: the state, its node set
        and the policy's epoch, and the versions of the nodes it scores."""
        st = self.ledger.state
        return ((id(st), st.n, self.ledger.nodes_version, self.learned.epoch),
                self._versions_read(slots))

    def _unchanged(self, last: tuple[Any, ...]) -> bool:
        (stamp, versions), now = last[3], self._read_now(last[2])
        return stamp == now[0] and bool(np.array_equal(versions, now[1]))

    def _versions_read(self, slots: np.ndarray) -> np.ndarray:
        st = self.ledger.state
        if not self.answers.row_local:  # the policy may read any node: the whole cluster's
            return np.array([st.version[: st.n].sum()])
        return st.version[slots[slots >= 0]]
