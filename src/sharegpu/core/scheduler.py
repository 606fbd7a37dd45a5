"""One scheduling decision: filter → score → pick → select GPUs → reserve.

The simulator and the extender both call this, so what the benchmark measures is what runs in a
cluster.

Ties between equally scored nodes go, by default, to the node that comes first in the state's
node order (:meth:`ClusterState.set_order`). This is what the FGD paper's simulator does in
effect (its node list is in a per-seed random order and the first best node wins), and it
matters: picking among ties uniformly at random (``tie_break="random"``, kube-scheduler's
``selectHost``) spreads pods over every equally scored node and strands about twice as much GPU
under FGD on the openb trace (see bench/README.md).

The GPUs inside the chosen node are, by default, the policy's own (:meth:`Policy.select`).
``gpu_choice="allocator"`` takes instead what kube-scheduler's DRA allocator takes for a claim
on that node — the first GPUs in device order that fit (:data:`sharegpu.core.gpuchoice.FIRSTFIT`) —
with the node still the policy's: DRA mode, where the extender ranks nodes and the
DynamicResources plugin picks devices (docs/dra.md, "Placement").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .annotations import Allocation
from .errors import PlacementError
from .gpuchoice import FIRSTFIT, assign
from .placement.base import Policy
from .request import PodRequest
from .state import ClusterState


@dataclass(frozen=True)
class Decision:
    node: int
    node_name: str
    alloc: Allocation


GPU_CHOICES = ("policy", "allocator")


class Scheduler:
    def __init__(
        self, state: ClusterState, policy: Policy, seed: int | None = 0, tie_break: str = "order",
        gpu_choice: str = "policy",
    ) -> None:
        if tie_break not in ("order", "random"):
            raise ValueError("tie_break must be 'order' or 'random'")
        if gpu_choice not in GPU_CHOICES:
            raise ValueError("gpu_choice must be 'policy' or 'allocator'")
        self.gpu_choice = gpu_choice
        self.state = state
        self.policy = policy
        self.tie_break = tie_break
        self.rng = np.random.default_rng(seed)
        policy.rng = self.rng

    def candidates(self, req: PodRequest, among: np.ndarray | None = None) -> np.ndarray:
        """Feasible node slots, optionally restricted to the boolean mask ``among``."""
        mask = self.state.feasible(req)
        if among is not None:
            mask &= among
        return np.flatnonzero(mask)

    def scores(self, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        if len(nodes) == 0:
            return np.zeros(0)
        return np.asarray(self.policy.score(self.state, req, nodes), dtype=np.float64)

    def pick(self, nodes: np.ndarray, scores: np.ndarray) -> int:
        if self.policy.integer_scores:
            scores = np.floor(scores)
        best = np.flatnonzero(scores >= scores.max())
        if len(best) == 1:
            return int(nodes[best[0]])
        if self.tie_break == "order":
            tied = nodes[best]
            return int(tied[np.argmin(self.state.rank[tied])])
        return int(nodes[best[self.rng.integers(len(best))]])

    def decide(self, req: PodRequest, among: np.ndarray | None = None) -> Decision | None:
        """The node and GPUs the policy chooses, without changing the state."""
        nodes = self.candidates(req, among)
        while len(nodes):
            node = self.pick(nodes, self.scores(req, nodes))
            alloc = self.select(req, node)
            if alloc is not None:
                spec = self.state.specs[node]
                assert spec is not None
                return Decision(node, spec.name, alloc)
            nodes = nodes[nodes != node]  # cannot happen for well-behaved policies
        return None

    def select(self, req: PodRequest, node: int) -> Allocation | None:
        """GPUs inside ``node``: the policy's, or the DRA allocator's first fit."""
        if self.gpu_choice == "allocator":
            return assign(self.state, req, node, FIRSTFIT)
        return self.policy.select(self.state, req, node)

    def reserve(self, req: PodRequest, decision: Decision) -> None:
        self.state.reserve(req, decision.node, decision.alloc)
        self.policy.placed(self.state, req, decision.node, decision.alloc)

    def schedule(self, req: PodRequest, among: np.ndarray | None = None) -> Decision | None:
        """Decide and reserve; ``None`` when the pod fits nowhere."""
        d = self.decide(req, among)
        if d is None:
            return None
        try:
            self.reserve(req, d)
        except PlacementError:
            return None
        return d

    def release(self, key: str) -> None:
        r = self.state.release(key)
        if r is not None and r.node in self.state.index:
            self.policy.removed(self.state, r.request, self.state.index[r.node])
