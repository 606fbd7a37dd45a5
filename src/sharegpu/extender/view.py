"""The extender's view of the cluster: the core's ClusterState fed by Node and Pod objects, and
the answers kube-scheduler asks of it. One class, :class:`ClusterView`, made of one room per
concept:

- :mod:`.cache` (:class:`~.cache.ClusterCache`): the cluster cache, nodes and pods as the
  informer's lists and events show them, the in-flight reservations, the host ledger;
- :mod:`.reader` (:class:`~.reader.PlacementReader`): pod objects read into requests and
  placements, memoised;
- :mod:`.workload` (:class:`~.workload.LearnedWorkload`): the policy's target workload, learnt
  from the pods seen and refreshed;
- :mod:`.answers` (:class:`~.answers.SchedulingAnswers`): filter, the policy's pick (held
  until the bind, :class:`~.picks.HeldPicks`), prioritize's scores and the bind's reservation;
- :mod:`.early_prioritize` (:class:`~.early_prioritize.EarlyPrioritize`): the prioritize
  answered right after its filter and kept while nothing it read changed;
- :mod:`.gangs` (:class:`~.gangs.GangScheduling`): pod groups placed all together or not at
  all, with their GPU shares held while they wait (wraps the verbs and the pod events).

Everything is synchronous and free of I/O; the informer feeds it events and the HTTP handlers
ask it questions, all on one event loop, so every method runs atomically.
"""

from __future__ import annotations

from ..placement.fragmentation import TargetWorkload
from ..request import Kind
from .answers import SchedulingAnswers, request_key
from .cache import ROW_LOCAL_POLICIES, UNKNOWN_NODE, ClusterCache
from .early_prioritize import EarlyPrioritize
from .gangs import GangScheduling
from .picks import DEFAULT_TIMEOUT_S, HeldPicks
from .reader import Placed, PlacementReader
from .workload import default_workload, shape_of


class ClusterView(GangScheduling, EarlyPrioritize, SchedulingAnswers, ClusterCache):
    def __init__(self, policy: str = "default", *, workload_refresh: int = 50,
                 graded: bool = False, workload: TargetWorkload | None = None,
                 hold_timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """``workload``: a fixed target workload for the policy (e.g. the history a simulation
        ran with), never re-learnt; by default it is learnt from the pods seen. ``graded``:
        prioritize scores every feasible node, not only the policy's pick. ``hold_timeout``:
        seconds a pick filter answered with stays held without its bind."""
        self._init_answers(graded, HeldPicks(hold_timeout))
        self._init_early()
        self._init_gangs()
        ClusterCache.__init__(self, policy, workload_refresh=workload_refresh, workload=workload)


__all__ = [
    "ROW_LOCAL_POLICIES", "UNKNOWN_NODE", "ClusterView", "Kind", "Placed", "PlacementReader",
    "default_workload", "request_key", "shape_of",
]
