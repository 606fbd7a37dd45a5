"""What a ResourceClaim's allocation gives this node's GPUs: the results of sharegpu's driver
(read by :mod:`sharegpu.dra.allocation`), held to what this node can prepare, grouped by
request. Every refusal is a :class:`~sharegpu.core.errors.ValidationError` naming the field
(with the result's index) and the rule. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..core.errors import ValidationError
from ..dra import driver as dra
from ..dra.allocation import RESULTS, AllocatedGpu, allocated_results, read_result

# Kubernetes UIDs are RFC 4122 strings; the claim's UID names files, so nothing else is taken.
_UID = re.compile(r"[0-9a-zA-Z][0-9a-zA-Z-]{0,62}", re.ASCII)


@dataclass(frozen=True)
class ClaimDevice:
    """One GPU of a claim: a result of sharegpu's driver."""

    index: int  # position in status.allocation.devices.results
    request: str
    pool: str
    device: str
    gpu: int
    mem_gib: int | None  # None: the whole GPU
    core: int | None  # percent; None: not capped by the claim
    share_id: str | None

    @property
    def whole(self) -> bool:
        return self.mem_gib is None


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    uid: str
    devices: tuple[ClaimDevice, ...]

    def requests(self) -> dict[str, list[ClaimDevice]]:
        """The claim's devices by request, in result order."""
        out: dict[str, list[ClaimDevice]] = {}
        for d in self.devices:
            out.setdefault(d.request, []).append(d)
        return out


def check_uid(uid: Any) -> str:
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise ValidationError("claim.uid", uid, "must be a Kubernetes UID (letters, digits and "
                                                "'-', at most 63 characters)")
    return uid


def parse_claim(
    obj: Mapping[str, Any], *, uid: str, node: str, gpu_mem: Sequence[int]
) -> Claim:
    """The GPUs ``obj`` (a ResourceClaim) was allocated on ``node``, whose GPU ``i`` has
    ``gpu_mem[i]`` GiB. ``uid`` is the claim the kubelet asked to prepare."""
    check_uid(uid)
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    meta = meta if isinstance(meta, Mapping) else {}
    if meta.get("uid") != uid:
        raise ValidationError(
            "metadata.uid", meta.get("uid"),
            f"must be the claim the kubelet prepares ({uid}): the claim was deleted and "
            "re-created under the same name")
    results = allocated_results(obj)
    if results is None:
        status = obj.get("status")
        raise ValidationError("status.allocation", status.get("allocation") if isinstance(
            status, Mapping) else None, "must be set: the claim is not allocated (the scheduler "
            "allocates a claim before the kubelet prepares it)")
    mine: list[ClaimDevice] = []
    seen: dict[str, int] = {}
    asked = _asked_cores(obj.get("spec"))
    for i, r in enumerate(results):
        at = f"{RESULTS}[{i}]"
        if not isinstance(r, Mapping):
            raise ValidationError(at, r, "must be an object")
        if r.get("driver") != dra.DRIVER:
            continue
        d = _on_node(read_result(r, at, i), r, at, node, gpu_mem)
        if d.core is not None and not asked(d.request):
            # consumed by the request policy's default (every claim consumes at least 5 %, so
            # that at most 20 share a GPU), not asked for: accounting, no limit
            d = replace(d, core=None)
        mine.append(d)
        d = mine[-1]
        if d.device in seen:
            raise ValidationError(
                f"{at}.device", d.device,
                f"must appear once per claim (results[{seen[d.device]}] names it too)")
        seen[d.device] = i
    if not mine:
        drivers = sorted({str(r.get("driver")) for r in results if isinstance(r, Mapping)})
        raise ValidationError(f"{RESULTS}[].driver", drivers,
                              f"no result names the driver {dra.DRIVER}: the claim holds "
                              "no sharegpu GPU")
    for request, ds in Claim("", "", uid, tuple(mine)).requests().items():
        if len({d.whole for d in ds}) > 1:
            raise ValidationError(
                f"{RESULTS}[{ds[-1].index}].consumedCapacity", request,
                "the devices of one request are all whole GPUs or all shared")
    return Claim(str(meta.get("namespace") or ""), str(meta.get("name") or ""), uid,
                 tuple(mine))


def _asked_cores(spec: Any) -> Callable[[str], bool]:
    """Whether a request (``req`` or ``req/sub`` of ``firstAvailable``) named ``cores`` in its
    ``capacity.requests``. A result's ``consumedCapacity`` has ``cores`` either way: kube-scheduler
    consumes the request policy's default (5) for a claim that does not ask, which is not a
    compute limit. A claim whose spec does not list the request (not one the API server would
    store) is taken at its word: what it consumed is its limit."""
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    requests = devices.get("requests") if isinstance(devices, Mapping) else None
    found: dict[str, bool] = {}

    def names_cores(body: Any) -> bool:
        cap = body.get("capacity") if isinstance(body, Mapping) else None
        reqs = cap.get("requests") if isinstance(cap, Mapping) else None
        return isinstance(reqs, Mapping) and dra.CAPACITY_CORES in reqs

    for r in requests if isinstance(requests, list) else []:
        if not isinstance(r, Mapping) or not isinstance(r.get("name"), str):
            continue
        found[r["name"]] = names_cores(r.get("exactly"))
        for sub in r.get("firstAvailable") or []:
            if isinstance(sub, Mapping) and isinstance(sub.get("name"), str):
                found[f"{r['name']}/{sub['name']}"] = names_cores(sub)
    return lambda request: found.get(request, True)


def _on_node(got: AllocatedGpu, r: Mapping[str, Any], at: str, node: str,
             gpu_mem: Sequence[int]) -> ClaimDevice:
    """Result ``r``, read as ``got``, held to what this node can prepare: its pool, one of its
    GPUs, memory in whole GiB that fits the GPU, cores a whole percent."""
    if got.pool != dra.pool_name(node):
        raise ValidationError(f"{at}.pool", got.pool,
                              f"must be this node's pool {dra.pool_name(node)!r} (the driver "
                              "publishes one pool per node, named after it)")
    if got.gpu >= len(gpu_mem):
        have = (f"{dra.device_name(0)} to {dra.device_name(len(gpu_mem) - 1)}" if gpu_mem
                else "none")
        raise ValidationError(f"{at}.device", got.device,
                              f"must name a GPU of node {node} ({have})")
    mem, core = (None, None) if got.whole else _capacity(
        got, r["consumedCapacity"], f"{at}.consumedCapacity", gpu_mem[got.gpu])
    return ClaimDevice(got.index, got.request, got.pool, got.device, got.gpu, mem, core,
                       got.share_id)


def _capacity(got: AllocatedGpu, cap: Mapping[str, Any], at: str,
              size_gib: int) -> tuple[int, int | None]:
    field = f"{at}.{dra.CAPACITY_MEMORY}"
    if got.memory is None:
        raise ValidationError(field, None, "must be set on a shared GPU (memory is what "
                              "isolation limits)")
    if got.memory <= 0 or got.memory % dra.MEMORY_STEP:
        raise ValidationError(field, cap[dra.CAPACITY_MEMORY],
                              "must be a whole number of GiB, more than 0 (the driver's "
                              "memory is consumed in steps of 1Gi)")
    gib = int(got.memory // dra.MEMORY_STEP)
    if gib > size_gib:
        raise ValidationError(field, cap[dra.CAPACITY_MEMORY],
                              f"must be at most the GPU's {size_gib}Gi")
    if got.cores is None:
        return gib, None
    if got.cores.denominator != 1 or not 1 <= got.cores <= dra.CORES_PER_GPU:
        raise ValidationError(f"{at}.{dra.CAPACITY_CORES}", cap[dra.CAPACITY_CORES],
                              f"must be a whole percent of the GPU, 1 to {dra.CORES_PER_GPU}")
    return gib, int(got.cores)
