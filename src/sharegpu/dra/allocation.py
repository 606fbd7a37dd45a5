"""A ResourceClaim's allocation result (``resource.k8s.io/v1``): the GPU each result of
sharegpu's driver names and what it consumed there, read by one set of rules.

``status.allocation.devices.results[]`` holds {request, driver, pool, device,
consumedCapacity, shareID} (k8s.io/api ``DeviceRequestAllocationResult``). The kubelet plugin
refuses a claim with a result it cannot read (``agent/draclaim.py``); the counting readers
(:mod:`sharegpu.dra.drashares`) leave such a result out with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..core.errors import ValidationError
from ..core.quantity import parse
from . import driver as dra

RESULTS = "status.allocation.devices.results"
CAPACITIES = (dra.CAPACITY_MEMORY, dra.CAPACITY_CORES)


@dataclass(frozen=True)
class AllocatedGpu:
    """One result of sharegpu's driver: a GPU of the node the pool is named after.

    ``whole``: the result consumed no capacity (``consumedCapacity`` absent or empty), so the
    claim holds the whole GPU. Otherwise ``memory`` (bytes) and ``cores`` (percent) are the
    quantities consumed, ``None`` where the result does not name that capacity."""

    index: int  # position in status.allocation.devices.results
    request: str
    pool: str
    device: str
    gpu: int
    whole: bool
    memory: Fraction | None
    cores: Fraction | None
    share_id: str | None


def allocated_results(obj: Any) -> list[Any] | None:
    """The results of a ResourceClaim's allocation, of every driver; ``None`` when the claim is
    not allocated."""
    status = obj.get("status") if isinstance(obj, Mapping) else None
    alloc = status.get("allocation") if isinstance(status, Mapping) else None
    if not isinstance(alloc, Mapping):
        return None
    devices = alloc.get("devices")
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if not isinstance(results, list):
        raise ValidationError(RESULTS, results, "must be a list of allocation results")
    return results


def _name(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationError(field, value, "must be a non-empty string")
    return value


def _amount(field: str, value: Any) -> Fraction:
    q = parse(field, value)
    if q < 0:
        raise ValidationError(field, value, "must not be negative")
    return q


def read_result(r: Any, at: str, index: int) -> AllocatedGpu:
    """Result ``index`` of sharegpu's driver; ``at`` is its field path, for the errors."""
    if not isinstance(r, Mapping):
        raise ValidationError(at, r, "must be an object")
    request = _name(f"{at}.request", r.get("request"))
    pool = r.get("pool")
    if not isinstance(pool, str) or not pool:
        raise ValidationError(f"{at}.pool", pool, "must name a node (the driver publishes one "
                              "pool per node, named after it)")
    device = r.get("device")
    gpu = dra.device_index(device) if isinstance(device, str) else None
    if gpu is None:
        raise ValidationError(f"{at}.device", device, "must be gpu-<index>")
    share = r.get("shareID")
    if share is not None:
        share = _name(f"{at}.shareID", share)
    cap = r.get("consumedCapacity")
    if cap is None or cap == {}:
        return AllocatedGpu(index, request, pool, device, gpu, True, None, None, share)
    if not isinstance(cap, Mapping):
        raise ValidationError(f"{at}.consumedCapacity", cap,
                              "must be a map of capacity name to quantity")
    unknown = sorted(set(cap) - set(CAPACITIES))
    if unknown:
        raise ValidationError(f"{at}.consumedCapacity.{unknown[0]}", cap[unknown[0]],
                              f"unknown capacity: the driver's GPUs have {dra.CAPACITY_MEMORY} "
                              f"and {dra.CAPACITY_CORES}")
    memory, cores = (
        _amount(f"{at}.consumedCapacity.{name}", cap[name]) if name in cap else None
        for name in CAPACITIES)
    return AllocatedGpu(index, request, pool, device, gpu, False, memory, cores, share)
