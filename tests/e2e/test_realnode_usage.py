"""GPU memory in use per container on the REAL node (realnode.py), with the chart installed as
released (``agent.usageMetrics: true``, its default: the agent pod shares the host's PID
namespace and reads ``/proc``).

A GPU pod with two containers runs on the node. The fake NVML is told (``set_gpu_processes``,
as a driver sees every process on the node) that each container's own process, by its PID in the
host's PID namespace (found through containerd, and checked in its ``/proc/PID/cgroup``), uses
some memory on the GPU its pod was given, and that a process outside any pod (this test's)
uses some too. The agent's ``/metrics``, scraped from the agent pod's IP as Prometheus would,
must then show each container's memory labelled with its pod UID, container and GPU,
beside the container's allocation, and the GPU's total counting every process. When the
processes end, their series go.
"""

from __future__ import annotations

import os
import re
import sys
import urllib.request
from collections.abc import Mapping
from typing import Any

from sharegpu.core import annotations, names

from .nodepods import NAMESPACE, WORKLOADS, create, get_pod, gpu_pod, list_pods, ready, wait
from .realnode import RealNode, RealNodeCluster
from .test_realnode_gpu import set_mode

MEM = names.RES_GPU_MEM
POD = "usage"
MIB = 1 << 20
GIB = 1 << 30
# MiB in use that the fake NVML reports for each container's process, and for a host process
USED = {"c0": 1500, "c1": 700}
HOST_USED = 100
_SAMPLE = re.compile(r'^(\w+)\{(.*)\} (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric ``name`` in a Prometheus text exposition: (labels, value)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m[1] == name:
            out.append((dict(_LABEL.findall(m[2])), float(m[3])))
    return out


def agent_pod(cluster: RealNodeCluster) -> dict[str, Any]:
    (agent,) = list_pods(cluster.cp, NAMESPACE, "app.kubernetes.io/component%3Dagent")
    return agent


def scrape(agent: Mapping[str, Any]) -> str:
    """The agent's /metrics, from its pod IP and the chart's metrics port."""
    (port,) = [p["containerPort"] for c in agent["spec"]["containers"] if c["name"] == "agent"
               for p in c.get("ports", []) if p.get("name") == "metrics"]
    url = f"http://{agent['status']['podIP']}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=20) as r:
        assert r.status == 200
        return r.read().decode()


def host_pid(node: RealNode, container_id: str) -> int:
    """The PID of a container's process in the host's PID namespace, as containerd knows it
    (``ctr task ls``), checked against its ``/proc/PID/cgroup``."""
    out = node.ctr("task", "ls")
    assert out is not None, "ctr task ls failed"
    pids = [int(cols[1]) for line in out.splitlines()[1:]
            if (cols := line.split()) and cols[0] == container_id]
    assert len(pids) == 1, out
    with open(f"/proc/{pids[0]}/cgroup") as f:
        assert container_id in f.read()
    return pids[0]


def test_the_agent_shows_each_containers_gpu_memory_in_use_beside_its_allocation(
        real_release: RealNodeCluster) -> None:
    cluster, cp = real_release, real_release.cp
    node = cluster.nodes[0]
    agent = agent_pod(cluster)
    # usageMetrics as the chart ships it: the host's PID namespace, its /proc read
    assert agent["spec"].get("hostPID") is True, agent["spec"]
    (args,) = [c["args"] for c in agent["spec"]["containers"] if c["name"] == "agent"]
    assert "--host-proc=/proc" in args, args
    set_mode(cluster, node, "cgpu")
    status, body = create(cp, WORKLOADS, gpu_pod(
        POD, [{MEM: 2}, {MEM: 1}], node=node.name, image=cluster.refs["SHAREGPU_REF"]))
    assert status == 201, body
    try:
        pod = wait(f"{POD} running", lambda: (p := get_pod(cp, WORKLOADS, POD)) and ready(p)
                   and p, 180)
        alloc = annotations.decode(pod["metadata"].get("annotations") or {})
        assert alloc is not None, pod["metadata"]
        ids = {s["name"]: s["containerID"].rpartition("://")[2]
               for s in pod["status"]["containerStatuses"]}
        gpu = {f"c{i}": next(iter(alloc.mem[i])) for i in range(2)}
        pids = {c: host_pid(node, ids[c]) for c in USED}
        print(f"\n{POD}: containers {pids} (host PIDs) on GPUs {gpu}", file=sys.stderr)
        node.set_gpu_processes([*[(gpu[c], pids[c], USED[c]) for c in USED],
                                (0, os.getpid(), HOST_USED)])

        pod_uid = pod["metadata"]["uid"]

        def shown() -> str | None:
            text = scrape(agent)
            got = samples(text, "sharegpu_agent_container_gpu_memory_used_bytes")
            mine = [s for s in got if s[0].get("pod_uid") == pod_uid]
            return text if len(mine) == len(USED) else None

        text = wait("the agent to show the containers' GPU memory in use", shown, 90, every=2)
        print("\n".join(line for line in text.splitlines()
                        if "memory_used_bytes" in line or "memory_allocated_bytes" in line),
              file=sys.stderr)
        used = samples(text, "sharegpu_agent_container_gpu_memory_used_bytes")
        allocated = samples(text, "sharegpu_agent_container_gpu_memory_allocated_bytes")
        per_gpu = {int(lb["gpu"]): v for lb, v in
                   samples(text, "sharegpu_agent_gpu_memory_used_bytes")}
        uuids = {int(lb["gpu"]): lb["uuid"] for lb, _ in
                 samples(text, "sharegpu_agent_gpu_memory_used_bytes")}
        # the chart's default names a container's pod by its UID only (agent.metricsPodNames)
        uid = get_pod(cp, WORKLOADS, POD)["metadata"]["uid"]
        for c, mib in USED.items():
            want = {"node": node.name, "pod_uid": uid, "container": c,
                    "gpu": str(gpu[c]), "uuid": uuids[gpu[c]]}
            assert (want, float(mib * MIB)) in used, (c, used)
            asked = {"c0": 2, "c1": 1}[c]
            assert ({"node": node.name, "pod_uid": uid, "container": c},
                    float(asked * GIB)) in allocated, (c, allocated)
        # every process counts in its GPU's total, the host's (outside any pod) too
        totals: dict[int, int] = {0: HOST_USED}
        for c, mib in USED.items():
            totals[gpu[c]] = totals.get(gpu[c], 0) + mib
        assert per_gpu == {g: float(m * MIB) for g, m in totals.items()}, per_gpu
        # the processes end: their series go
        node.set_gpu_processes([])
        text = scrape(agent)
        assert not samples(text, "sharegpu_agent_container_gpu_memory_used_bytes"), text
        assert not samples(text, "sharegpu_agent_gpu_memory_used_bytes"), text
    finally:
        node.set_gpu_processes([])
        cp.request("DELETE", f"/api/v1/namespaces/{WORKLOADS}/pods/{POD}")
        wait(f"{POD} gone", lambda: get_pod(cp, WORKLOADS, POD) is None, 120)
