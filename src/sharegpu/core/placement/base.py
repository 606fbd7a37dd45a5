"""The placement-policy interface and the registry of policies.

A policy is a small plugin, in the manner of kube-scheduler's framework: the core filters nodes
(:meth:`ClusterState.feasible`), the policy scores the feasible ones (:meth:`Policy.score`),
the scheduler picks the best (ties at random), and the policy picks GPUs inside the chosen node
(:meth:`Policy.select`). A new policy is one file under ``sharegpu/core/placement/`` that subclasses
:class:`Policy` and is decorated with :func:`register`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..annotations import Allocation
from ..gpuchoice import assign, node_strategy, request_strategy
from ..request import PodRequest
from ..state import ClusterState

_REGISTRY: dict[str, type[Policy]] = {}
ALIASES: dict[str, str] = {"default": "strandfill"}  # the least stranded on the openb traces


class Policy:
    """Base class: subclasses set ``name`` and implement :meth:`score`."""

    name: ClassVar[str] = ""
    #: GPU choice inside a node when the node has no ``ack.node.gpu.placement`` label
    gpu_strategy: ClassVar[str] = "bestfit"
    #: scores are compared as integers (as kube-scheduler's are) when set
    integer_scores: ClassVar[bool] = True

    def __init__(self, **options: object) -> None:
        self.options = options
        #: the scheduler hands over its seeded generator (policies that draw use this one)
        self.rng = np.random.default_rng(0)

    def prepare(self, state: ClusterState, workload: object | None = None) -> None:
        """Called once before a run (simulator) or when the cluster view is rebuilt."""

    def score(self, state: ClusterState, req: PodRequest, nodes: np.ndarray) -> np.ndarray:
        """Scores (higher is better) for the feasible node slots ``nodes``."""
        raise NotImplementedError

    def select(self, state: ClusterState, req: PodRequest, node: int) -> Allocation | None:
        """GPUs inside ``node`` for every container of ``req``."""
        strategy = request_strategy(req, node_strategy(state, node, self.gpu_strategy))
        return assign(state, req, node, strategy)

    def placed(self, state: ClusterState, req: PodRequest, node: int, alloc: Allocation) -> None:
        """Called after a placement was reserved (policies with memory update it here)."""

    def removed(self, state: ClusterState, req: PodRequest, node: int) -> None:
        """Called after a placement was released."""


def register(cls: type[Policy]) -> type[Policy]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def resolve(name: str) -> str:
    return ALIASES.get(name, name)


def get_policy(name: str, **options: object) -> Policy:
    _load_all()
    real = resolve(name)
    if real not in _REGISTRY:
        from ..errors import ValidationError

        raise ValidationError(
            "policy", name, "must be one of: " + ", ".join(["default", *sorted(_REGISTRY)])
        )
    return _REGISTRY[real](**options)


def _load_all() -> None:
    from . import policies  # noqa: F401  (registers every built-in policy)
