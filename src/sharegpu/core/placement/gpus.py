"""Choosing GPUs inside one node: :mod:`sharegpu.core.gpuchoice`, re-exported here for the
policies (the state asks the GPU choice whether a pod fits, so it lives below the state)."""

from ..gpuchoice import STRATEGIES, GpuRows, Order, assign, node_strategy, request_strategy

__all__ = ["STRATEGIES", "GpuRows", "Order", "assign", "node_strategy", "request_strategy"]
