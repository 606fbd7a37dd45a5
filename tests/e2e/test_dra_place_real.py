"""DRA placement and inspect against the REAL control plane (kube-apiserver,
kube-controller-manager, kube-scheduler v1.37.2, default feature gates; docs/dra.md,
"Placement" and "inspect").

- kube-scheduler's DRA allocator picks, inside a node, the first GPU in the slice's device
  order whose remaining capacity holds the claim: on a node whose gpu-0 is a 32 GiB V100 and
  gpu-1 a 15 GiB T4, claims of 4, 20 and 12 GiB land on gpu-0, gpu-0, gpu-1 (best fit would
  take gpu-1, gpu-0, gpu-0) — exactly what the simulator's ``firstfit`` predicts
  (``sharegpu.core.gpuchoice.FIRSTFIT``, the ``--gpu-choice allocator`` of ``sharegpu simulate``).
- ``kubectl inspect cgpu`` on that cluster agrees with the claims' ``consumedCapacity`` per GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sharegpu.core.gpuchoice import FIRSTFIT, assign
from sharegpu.core.modes import Mode
from sharegpu.core.request import ContainerRequest, Kind, PodRequest
from sharegpu.core.state import ClusterState, NodeSpec
from sharegpu.inspect_cgpu.cli import main as inspect_main

from .components import SharegpuProcess, agent_kubeconfig, free_port, wait_for
from .test_chart_real import container_args, with_flags
from .test_dra_slices_real import DRIVER, RELEASE, RS, Dra, dra, dra_node, get  # noqa: F401

CLAIMS = [("a", "4Gi", "20"), ("b", "20Gi", "30"), ("c", "12Gi", "50")]


def start_agent(d: Dra, node: str, tmp: Path) -> SharegpuProcess:
    agent = f"{RELEASE}-agent"
    kubeconfig = agent_kubeconfig(d.cp, d.ns, agent, node)  # as its pod's: names the node
    args = with_flags(
        container_args(d.cp, d.ns, "DaemonSet", agent), node_name=node,
        kubeconfig=str(kubeconfig), nvml="fake",
        fake_gpus="Tesla-V100-SXM2-32GB:32,Tesla-T4:15", isolation="none",
        device_plugin_dir=str(tmp / "device-plugins"), state_dir=str(tmp / "state"),
        metrics_listen=f"127.0.0.1:{free_port()}", hami_installed=str(tmp / "hami-installed"),
        mps_pipe_dir=str(tmp / "mps"), mps_shm_dir=str(tmp / "mps-shm"))
    return SharegpuProcess(d.cp, "dra-agent-place", args).start()


def predicted() -> list[str]:
    """The simulator's first fit on the same node, claim after claim."""
    s = ClusterState([NodeSpec("n", [32, 15], mode=Mode.CGPU)])
    out = []
    for name, mem, cores in CLAIMS:
        c = ContainerRequest(0, "c", gpu_mem=int(mem[:-2]), gpu_core=int(cores))
        req = PodRequest("ns", name, Kind.SHARED_CORE, (c,))
        alloc = assign(s, req, 0, FIRSTFIT)
        assert alloc is not None
        ((gpu, _),) = alloc.mem[0].items()
        s.gpu_free[0, gpu] -= c.gpu_mem
        s.core_free[0, gpu] -= c.gpu_core
        s.gpu_pods[0, gpu] += 1
        out.append(f"gpu-{gpu}")
    return out


def test_allocator_takes_the_first_fitting_gpu_and_inspect_agrees(
        dra: Dra, tmp_path: Path, dra_node: str, capsys, monkeypatch) -> None:  # noqa: F811
    cp, ns, node = dra.cp, dra.ns, dra_node
    proc = start_agent(dra, node, tmp_path)
    try:
        wait_for("the slice", lambda: get(cp, f"{RS}/{node}-{DRIVER}"), timeout=60)
        allocations: list[dict[str, Any]] = []
        for name, mem, cores in CLAIMS:  # one at a time: each sees the previous allocation
            claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": f"place-{name}", "namespace": ns},
                     "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                         "deviceClassName": DRIVER,
                         "capacity": {"requests": {"memory": mem, "cores": cores}}}}]}}}
            code, body = cp.request(
                "POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims", claim)
            assert code == 201, body
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"place-{name}", "namespace": ns},
                   "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                            "resourceClaims": [{"name": "gpu",
                                                "resourceClaimName": f"place-{name}"}],
                            "containers": [{"name": "c", "image": "registry.invalid/x",
                                            "resources": {"claims": [{"name": "gpu"}]}}]}}
            code, body = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
            assert code == 201, body

            def allocated(n: str = name) -> dict[str, Any] | None:
                got = get(cp, f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/"
                              f"place-{n}")
                return (got or {}).get("status", {}).get("allocation")

            allocations.append(wait_for(f"claim place-{name} allocated", allocated,
                                        timeout=60))
        devices = [a["devices"]["results"][0]["device"] for a in allocations]
        assert devices == predicted() == ["gpu-0", "gpu-0", "gpu-1"]

        # kubectl inspect cgpu, live, against the claims' consumedCapacity per GPU
        monkeypatch.setenv("KUBECONFIG", str(cp.admin_kubeconfig))
        with capsys.disabled():
            print(f"\nallocator: {devices}, simulator first fit: {predicted()}")
        capsys.readouterr()
        deadline = time.monotonic() + 30
        while True:
            assert inspect_main(["-o", "json", node]) == 0
            doc = json.loads(capsys.readouterr().out)
            (n,) = doc["nodes"]
            if sum(g["pods"] for g in n["gpus"]) == len(CLAIMS) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        want = [0, 0]
        for a in allocations:
            r = a["devices"]["results"][0]
            want[int(r["device"][4:])] += int(r["consumedCapacity"]["memory"][:-2])
        got = [g["memAllocated"] for g in n["gpus"]]
        with capsys.disabled():
            print(f"inspect: {got} GiB per GPU; claims' consumedCapacity: {want}")
        assert n["dra"] and got == want == [24, 12]
        assert [g["memTotal"] for g in n["gpus"]] == [32, 15]
        assert sorted(p["name"] for p in n["pods"]) == [f"place-{c[0]}" for c in CLAIMS]
    finally:
        proc.stop()
