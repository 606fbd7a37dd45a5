"""DRA claims on a real node: what a container should get from its claims, and the comparison of
what it reports (nodepods.REPORTER) with the claim's allocation and the claim's CDI spec.

Two questions per container, each a mismatch when it fails:

- **the agent's answer**: the claim's CDI spec (written by the agent's kubelet plugin in the
  node's CDI directory) carries, for every device kube-scheduler allocated to the claim, the GPU
  the slice publishes for it and the limits the claim consumed (``consumedCapacity``) or asked
  for (``capacity.requests.cores``);
- **the runtime's application**: the container holds every edit of the CDI devices the kubelet
  passed for it (its env, each mount at its path from its host path, read-only as the spec says,
  each device node), the preload library is mapped into its process, the driver is there.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharegpu.agent.cdi import SPEC_PREFIX
from sharegpu.agent.isolation import HAMI_CONTAINER_LIBRARY, PRELOAD_LIST
from sharegpu.core import names
from sharegpu.dra import driver as dra

from .realnode import RealNode

CDI_DIR = "/run/cdi"  # containerd's cdi_spec_dirs on the node; the agent's /var/run/cdi
GIB = 1 << 30


@dataclass
class ClaimCheck:
    """One container against the claims it names."""

    pod: str
    container: str
    claims: list[str] = field(default_factory=list)
    cdi_ids: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def gib(quantity: str) -> int:
    if quantity.endswith("Gi"):
        return int(quantity[:-2])
    return int(quantity) // GIB


def claim_names(pod: Mapping[str, Any], index: int) -> list[str]:
    """The ResourceClaims container ``index`` of ``pod`` uses (templates resolved through the
    pod's ``status.resourceClaimStatuses``)."""
    spec = pod["spec"]
    by_name = {c["name"]: c for c in spec.get("resourceClaims") or []}
    generated = {s["name"]: s.get("resourceClaimName")
                 for s in pod.get("status", {}).get("resourceClaimStatuses") or []}
    out = []
    for ref in spec["containers"][index].get("resources", {}).get("claims") or []:
        entry = by_name[ref["name"]]
        out.append(entry.get("resourceClaimName") or generated.get(ref["name"]) or "")
    return out


def spec_path(node: RealNode, uid: str) -> Path:
    return node.host_path(f"{CDI_DIR}/{SPEC_PREFIX}{uid}.json")


def read_spec(node: RealNode, uid: str) -> dict[str, Any] | None:
    try:
        return json.loads(spec_path(node, uid).read_text())
    except FileNotFoundError:
        return None


def results(claim: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The claim's allocated devices of sharegpu's driver, in GPU order."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    res = [r for r in (alloc.get("devices") or {}).get("results") or []
           if r.get("driver") == dra.DRIVER]
    return sorted(res, key=lambda r: (r["request"], dra.device_index(r["device"]) or 0))


def requested_cores(claim: Mapping[str, Any], request: str) -> int | None:
    for r in claim["spec"]["devices"]["requests"]:
        if r["name"] == request:
            cores = (((r.get("exactly") or {}).get("capacity") or {}).get("requests") or {}).get(
                dra.CAPACITY_CORES)
            return int(cores) if cores is not None else None
    return None


def expected_env(claim: Mapping[str, Any], request: str, slice_uuids: Mapping[str, str]
                 ) -> dict[str, str | None]:
    """What the claim's allocation says a container of request ``request`` gets (HAMi-core on a
    cgpu node); ``None``: must be absent."""
    uid = claim["metadata"]["uid"]
    res = [r for r in results(claim) if r["request"] == request]
    mem = [gib(r["consumedCapacity"][dra.CAPACITY_MEMORY]) for r in res]
    cores = requested_cores(claim, request)
    capped = cores is not None and cores < names.CORE_PER_GPU
    want: dict[str, str | None] = {
        names.ENV_VISIBLE_DEVICES: ",".join(slice_uuids[r["device"]] for r in res),
        names.ENV_MEM_IDX: ",".join(str(dra.device_index(r["device"])) for r in res),
        names.ENV_MEM_CONTAINER: str(sum(mem)),
        "LD_PRELOAD": HAMI_CONTAINER_LIBRARY,
        "CUDA_DEVICE_SM_LIMIT": str(cores) if capped else None,
        "GPU_CORE_UTILIZATION_POLICY": "force" if capped else "disable",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/tmp/sharegpu-vgpu/{uid}.cache",
    }
    for j, m in enumerate(mem):
        want[f"CUDA_DEVICE_MEMORY_LIMIT_{j}"] = f"{m * 1024}m"
    want[f"CUDA_DEVICE_MEMORY_LIMIT_{len(mem)}"] = None
    return want


def _env_of(edits: Mapping[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in edits.get("env") or [])


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def check_mounts(node: RealNode, edits: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """Every mount of the CDI edits is in the container: at its path, from its host path (the
    mount's source root is that path's tail, a file has its content, a writable directory holds
    the container's marker on the node), read-only as the spec says."""
    bad = []
    mounts = got.get("mounts") or {}
    for m in edits.get("mounts") or []:
        path, host = m["containerPath"], node.host_path(m["hostPath"])
        seen = mounts.get(path)
        if seen is None:
            bad.append(f"mount {path} (from {m['hostPath']}) not in the container")
            continue
        if not str(host).endswith(seen["root"]):
            bad.append(f"mount {path}: source root {seen['root']!r} is not {host}")
        if seen["ro"] != ("ro" in m.get("options", [])):
            bad.append(f"mount {path}: read-only {seen['ro']}, spec options {m.get('options')}")
        if "error" in seen:
            bad.append(f"mount {path}: {seen['error']}")
        if host.is_file():
            if seen.get("sha256") != _file_sha256(host):
                bad.append(f"mount {path}: content differs from {m['hostPath']}")
        elif host.is_dir():
            if not seen.get("ro") and not (seen.get("marker") and (host / seen["marker"]).is_file()):
                bad.append(f"mount {path}: the container's marker {seen.get('marker')!r} is not "
                           f"in {m['hostPath']} on the node")
        else:
            bad.append(f"mount {path}: host path {m['hostPath']} missing on the node")
    return bad


def check_device_nodes(edits: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    devices = got.get("devices") or {}
    bad = []
    for d in edits.get("deviceNodes") or []:
        path = d.get("path")
        if path not in devices:
            bad.append(f"device node {path} not in the container")
        elif "major" in d and devices[path] != [d["major"], d.get("minor", 0)]:
            bad.append(f"device node {path}: {devices[path]}, spec {d['major']}:{d.get('minor')}")
    return bad


def compare_claims(node: RealNode, pod: Mapping[str, Any], index: int,
                   got: Mapping[str, Any] | None, claims: Mapping[str, Mapping[str, Any]],
                   specs: Mapping[str, Mapping[str, Any] | None],
                   slice_uuids: Mapping[str, str]) -> ClaimCheck:
    """Container ``index``'s report against its claims' allocations (``claims`` by name) and
    their CDI specs (``specs`` by claim UID, read while the pod runs)."""
    container = pod["spec"]["containers"][index]["name"]
    check = ClaimCheck(pod["metadata"]["name"], container)
    bad = check.mismatches
    names_ = claim_names(pod, index)
    check.claims = names_
    if got is None:
        bad.append("no report in the container's log")
        return check
    if not names_:
        bad.append("the container names no claim")
    env = got.get("env_all") or {}
    gpu_claims = 0
    for name in names_:
        claim = claims.get(name)
        if claim is None:
            bad.append(f"claim {name!r} not found")
            continue
        uid = claim["metadata"]["uid"]
        res = results(claim)
        if not res:
            bad.append(f"claim {name}: no allocation of {dra.DRIVER}")
            continue
        if any(r["pool"] != node.name for r in res):
            bad.append(f"claim {name}: allocated from pools {[r['pool'] for r in res]}")
        reserved = [r.get("uid") for r in claim["status"].get("reservedFor") or []]
        if pod["metadata"]["uid"] not in reserved:
            bad.append(f"claim {name}: not reserved for the pod ({reserved})")
        spec = specs.get(uid)
        if spec is None:
            bad.append(f"claim {name}: no CDI spec {SPEC_PREFIX}{uid}.json in {CDI_DIR}")
            continue
        devices = {d["name"]: d.get("containerEdits") or {} for d in spec.get("devices") or []}
        if spec.get("kind") != dra.CDI_KIND:
            bad.append(f"claim {name}: CDI spec kind {spec.get('kind')!r}")
        for request in sorted({r["request"] for r in res}):
            want = expected_env(claim, request, slice_uuids)
            for r in (r for r in res if r["request"] == request):
                dev = f"{uid}-{r['device']}"
                check.cdi_ids.append(dra.cdi_device_id(uid, r["device"]))
                edits = devices.get(dev)
                if edits is None:
                    bad.append(f"claim {name}: CDI spec has no device {dev}")
                    continue
                spec_env = _env_of(edits)
                # the agent's answer: the spec says what the allocation says
                for k, v in want.items():
                    if spec_env.get(k) != v:
                        bad.append(f"claim {name} {dev}: spec {k}={spec_env.get(k)!r}, the "
                                   f"allocation says {v!r}")
                # the runtime's application: the container holds every edit
                for k, v in spec_env.items():
                    if env.get(k) != v:
                        bad.append(f"{k}={env.get(k)!r} in the container, CDI device {dev} "
                                   f"says {v!r}")
                bad.extend(f"{dev}: {m}" for m in check_mounts(node, edits, got))
                bad.extend(f"{dev}: {m}" for m in check_device_nodes(edits, got))
            gpu_claims += 1
    if env.get("LD_PRELOAD") == HAMI_CONTAINER_LIBRARY:
        if not got.get("preload_file") or not got.get("preload_mapped"):
            bad.append(f"preload {HAMI_CONTAINER_LIBRARY}: file {got.get('preload_file')}, "
                       f"mapped {got.get('preload_mapped')}")
        if got.get("preload_list") != [HAMI_CONTAINER_LIBRARY]:
            bad.append(f"{PRELOAD_LIST}: {got.get('preload_list')}")
    if gpu_claims and not got.get("nvml"):
        bad.append("libnvidia-ml.so.1 not at its path (the runtime saw no GPU)")
    return check


def over_commit(claims: Iterable[Mapping[str, Any]], slice_: Mapping[str, Any]) -> list[str]:
    """GPUs whose claims consume more memory or cores than the slice publishes, and shares
    allocated twice."""
    cap = {d["name"]: d.get("capacity") or {} for d in slice_["spec"]["devices"]}
    used: dict[str, list[int]] = {}
    shares: set[tuple[str, str]] = set()
    bad = []
    for c in claims:
        for r in results(c):
            u = used.setdefault(r["device"], [0, 0])
            consumed = r.get("consumedCapacity") or {}
            u[0] += gib(consumed.get(dra.CAPACITY_MEMORY, "0"))
            u[1] += int(consumed.get(dra.CAPACITY_CORES, "0"))
            key = (r["device"], r.get("shareID") or "")
            if key in shares:
                bad.append(f"{r['device']} share {key[1]} allocated twice")
            shares.add(key)
    for dev, (mem, cores) in used.items():
        if mem > gib(cap[dev][dra.CAPACITY_MEMORY]["value"]) or \
                cores > int(cap[dev][dra.CAPACITY_CORES]["value"]):
            bad.append(f"{dev}: {mem} GiB / {cores} % consumed, slice capacity {cap[dev]}")
    return bad


def totals(checks: Sequence[ClaimCheck]) -> dict[str, int]:
    return {"containers": len(checks),
            "mismatches": sum(1 for c in checks if c.mismatches),
            "claims": len({n for c in checks for n in c.claims})}
