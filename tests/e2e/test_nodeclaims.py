"""nodeclaims.compare_claims, the real-node DRA test's comparison, on made-up reports: what it
must call a match, and each kind of mismatch it must see (no cluster needed)."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

from sharegpu.agent.isolation import HAMI_CONTAINER_LIBRARY

from .nodeclaims import compare_claims

UID = "0000aaaa-aaaa-4bbb-8ccc-000000000001"
UUIDS = {"gpu-0": "GPU-0", "gpu-1": "GPU-1"}


class FakeNode:
    def __init__(self, root: Path) -> None:
        self.name, self.root = "n0", root

    def host_path(self, p: str) -> Path:
        return self.root / p.lstrip("/")


def setup(tmp_path: Path) -> tuple[FakeNode, dict, dict, dict, dict]:
    node = FakeNode(tmp_path)
    lib = node.host_path("/usr/local/vgpu/real/libvgpu.so")
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"library")
    cache = node.host_path(f"/tmp/sharegpu-vgpu/{UID}")
    cache.mkdir(parents=True)
    (cache / ".report-p-c0").write_text("x")
    claim = {"metadata": {"name": "c", "uid": UID},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "capacity": {"requests": {"memory": "2Gi", "cores": "30"}}}}]}},
             "status": {"reservedFor": [{"uid": "pod-uid"}], "allocation": {"devices": {
                 "results": [{"request": "gpu", "driver": "gpu.sharegpu.io", "pool": "n0",
                              "device": "gpu-1", "shareID": "s",
                              "consumedCapacity": {"memory": "2Gi", "cores": "30"}}]}}}}
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "ALIYUN_COM_GPU_MEM_IDX": "1",
           "ALIYUN_COM_GPU_MEM_CONTAINER": "2", "LD_PRELOAD": HAMI_CONTAINER_LIBRARY,
           "CUDA_DEVICE_SM_LIMIT": "30", "GPU_CORE_UTILIZATION_POLICY": "force",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/tmp/sharegpu-vgpu/{UID}.cache",
           "CUDA_DEVICE_MEMORY_LIMIT_0": "2048m"}
    spec = {"kind": "sharegpu.io/gpu", "devices": [{"name": f"{UID}-gpu-1", "containerEdits": {
        "env": [f"{k}={v}" for k, v in env.items()],
        "mounts": [{"containerPath": HAMI_CONTAINER_LIBRARY,
                    "hostPath": "/usr/local/vgpu/real/libvgpu.so", "options": ["ro", "bind"]},
                   {"containerPath": "/tmp/sharegpu-vgpu",
                    "hostPath": f"/tmp/sharegpu-vgpu/{UID}", "options": ["rw", "bind"]}]}}]}
    got = {"env_all": {**env, "PATH": "/bin"}, "preload_file": True, "preload_mapped": True,
           "preload_list": [HAMI_CONTAINER_LIBRARY], "nvml": True, "devices": {},
           "mounts": {HAMI_CONTAINER_LIBRARY: {"root": str(lib), "ro": True,
                                               "sha256": hashlib.sha256(b"library").hexdigest()},
                      "/tmp/sharegpu-vgpu": {"root": str(cache), "ro": False,
                                             "marker": ".report-p-c0"}}}
    pod = {"metadata": {"name": "p", "uid": "pod-uid"},
           "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}],
                    "containers": [{"name": "c0", "resources": {"claims": [{"name": "gpu"}]}}]}}
    return node, claim, spec, got, pod


def run(node: FakeNode, claim: dict, spec: dict | None, got: dict | None, pod: dict) -> list[str]:
    check = compare_claims(node, pod, 0, got, {"c": claim}, {UID: spec}, UUIDS)  # type: ignore[arg-type]
    return check.mismatches


def test_a_container_that_holds_its_claims_edits_matches(tmp_path: Path) -> None:
    node, claim, spec, got, pod = setup(tmp_path)
    assert run(node, claim, spec, got, pod) == []


def test_each_kind_of_difference_is_a_mismatch(tmp_path: Path) -> None:
    node, claim, spec, got, pod = setup(tmp_path)

    def variant(change: Any) -> list[str]:
        c, s, g = copy.deepcopy(claim), copy.deepcopy(spec), copy.deepcopy(got)
        change(c, s, g)
        return run(node, c, s, g, pod)

    # the runtime did not apply a variable, a mount, the writable directory, the file's content
    assert variant(lambda c, s, g: g["env_all"].pop("CUDA_DEVICE_MEMORY_LIMIT_0"))
    assert variant(lambda c, s, g: g["mounts"].pop(HAMI_CONTAINER_LIBRARY))
    assert variant(lambda c, s, g: g["mounts"]["/tmp/sharegpu-vgpu"].update(marker="other"))
    assert variant(lambda c, s, g: g["mounts"][HAMI_CONTAINER_LIBRARY].update(sha256="0"))
    assert variant(lambda c, s, g: g["mounts"][HAMI_CONTAINER_LIBRARY].update(ro=False))
    assert variant(lambda c, s, g: g["mounts"][HAMI_CONTAINER_LIBRARY].update(root="/else"))
    assert variant(lambda c, s, g: g.update(preload_mapped=False))
    # the agent's spec disagrees with the allocation: another GPU, other limits
    assert variant(lambda c, s, g: c["status"]["allocation"]["devices"]["results"][0].update(
        consumedCapacity={"memory": "3Gi"}))
    assert variant(lambda c, s, g: c["spec"]["devices"]["requests"][0]["exactly"].update(
        capacity={"requests": {"memory": "2Gi"}}))
    assert variant(lambda c, s, g: c["status"]["allocation"]["devices"]["results"][0].update(
        device="gpu-0"))
    # not reserved for the pod, no spec, no report
    assert variant(lambda c, s, g: c["status"].update(reservedFor=[]))
    assert run(node, claim, None, got, pod)
    assert run(node, claim, spec, None, pod)
