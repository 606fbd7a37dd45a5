"""Placement: choosing a node (policies) and GPUs inside it (:mod:`.gpus`)."""

from .base import Policy, available, get_policy, register

__all__ = ["Policy", "available", "get_policy", "register"]
