"""The paper's workload protocol (SPEC §9): shuffle per seed, inflate to 1.3 × capacity.

The originals are shuffled with the seed's generator, then copies drawn uniformly with
replacement from the original list are appended until the next draw would push the total GPU
demand past ``inflation × capacity``. As in the paper's simulator, the stop test adds the drawn
pod's per-GPU share (not ``num_gpu × share``), while the running total counts ``num_gpu × share``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.placement.fragmentation import TargetWorkload
from .trace import GPU_UNITS, TracePod

DEFAULT_INFLATION = 1.3
DEFAULT_COVERAGE = 0.95


def stream(
    pods: Sequence[TracePod], capacity_gpus: int, seed: int, inflation: float = DEFAULT_INFLATION
) -> list[TracePod]:
    rng = np.random.default_rng(seed)
    ordered = sorted(pods, key=lambda p: p.name)
    out = [ordered[i] for i in rng.permutation(len(ordered))]
    budget = inflation * capacity_gpus * GPU_UNITS
    total = sum(p.gpu_demand for p in out)
    if total > budget:
        # trim: drop random pods while the demand exceeds the budget
        while total > budget and out:
            p = out.pop(int(rng.integers(len(out))))
            total -= p.gpu_demand
        return out
    i = 0
    while True:
        pick = ordered[int(rng.integers(len(ordered)))]
        if total + pick.gpu_milli > budget:
            break
        total += pick.gpu_demand
        out.append(TracePod(f"{pick.name}-tuned-{i}", pick.cpu_milli, pick.mem_mib,
                            pick.num_gpu, pick.gpu_milli, pick.gpu_spec))
        i += 1
    return out


def target_workload(pods: Sequence[TracePod], coverage: float = DEFAULT_COVERAGE) -> TargetWorkload:
    """The FGD target workload: the trace's own pod shapes (memory is not part of a shape;
    each shape carries its pods' mean memory for policies that watch host memory)."""
    return TargetWorkload.from_shapes(
        [p.shape for p in pods], coverage, mem=[p.mem_mib for p in pods]
    )
