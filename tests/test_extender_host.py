"""The extender's view tracks host CPU and memory: every GPU node's allocatable and the requests
of every pod bound there (GPU pods and all others), from the same watch events, kept through
relists, rebuilds and the consistency check; the learnt workload carries CPU and memory; and
with them the view decides as the simulator does."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

from sharegpu.core.annotations import Allocation, encode
from sharegpu.core.nodes import spec_from_node
from sharegpu.core.placement.base import get_policy
from sharegpu.core.scheduler import Scheduler
from sharegpu.core.state import ClusterState
from sharegpu.extender.informer import Informer
from sharegpu.extender.kube import KubeApi
from sharegpu.extender.metrics import Metrics
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects


def node(name: str, cpu: str = "16", memory: str = "64Gi", gpus: int = 2) -> dict[str, Any]:
    n = kobjects.node(name, [16] * gpus, "cgpu")
    n["status"]["allocatable"].update({"cpu": cpu, "memory": memory})
    return n


def plain(name: str, node_name: str, cpu: str = "4", memory: str = "8Gi",
          **spec: Any) -> dict[str, Any]:
    """A pod without GPUs, bound by kube-scheduler."""
    p = kobjects.pod(name, containers=[{}], cpu=cpu, memory=memory, node_name=node_name)
    p["spec"].update(spec)
    p["status"]["phase"] = "Running"
    return p


def gpu_bound(name: str, node_name: str, gpu: int, mem: int, cpu: str,
              memory: str = "1Gi") -> dict[str, Any]:
    p = kobjects.pod(name, mem=mem, cpu=cpu, memory=memory, node_name=node_name)
    p["metadata"]["annotations"] = encode(Allocation(mem={0: {gpu: mem}}), assume_time_ns=1)
    return p


def free(v: ClusterView, name: str) -> tuple[int, int]:
    i = v.state.index[name]
    return int(v.state.cpu_free[i]), int(v.state.mem_free[i])


def test_pods_without_gpus_use_the_cpu_and_memory_of_their_node() -> None:
    v = ClusterView()
    v.reset([node("a"), node("b")], [])
    assert free(v, "a") == (16000, 65536)
    v.upsert_pod(plain("web", "a", cpu="14", memory="8Gi"))
    assert free(v, "a") == (2000, 57344)
    req = v.reader.request(kobjects.pod("g", mem=4, cpu="4"))
    assert (req.cpu_milli, req.mem_mib) == (4000, 0)
    passed, failed, _ = v.filter(req, ["a", "b"])
    assert passed == ["b"] and failed == {"a": "insufficient CPU"}
    # an update of the same pod changes nothing; its end gives the CPU back
    v.upsert_pod(plain("web", "a", cpu="14", memory="8Gi"))
    assert free(v, "a") == (2000, 57344)
    done = plain("web", "a", cpu="14", memory="8Gi")
    done["status"]["phase"] = "Succeeded"
    v.upsert_pod(done)
    assert free(v, "a") == (16000, 65536) and not v.host
    v.upsert_pod(plain("web2", "a", cpu="1"))
    v.delete_pod(plain("web2", "a", cpu="1"))
    assert free(v, "a") == (16000, 65536) and not v.host_sum
    # not bound yet: uses nothing
    v.upsert_pod(kobjects.pod("pending", containers=[{}], cpu="8"))
    assert free(v, "a") == (16000, 65536)


def test_init_containers_sidecars_and_overhead_count_as_kube_scheduler_counts_them() -> None:
    v = ClusterView()
    v.reset([node("a")], [])
    p = plain("x", "a", cpu="1", memory="1Gi", overhead={"cpu": "500m", "memory": "256Mi"},
              initContainers=[{"name": "i", "resources": {"requests": {"cpu": "6"}}},
                              {"name": "s", "restartPolicy": "Always",
                               "resources": {"limits": {"cpu": "2", "memory": "1Gi"}}}])
    v.upsert_pod(p)
    # cpu: max(1 + 2 sidecar, 6 init) + 0.5 overhead; memory: 1 + 1 sidecar + 0.25
    assert free(v, "a") == (16000 - 6500, 65536 - 2304)
    # a GPU pod with an init container and overhead, placed by the extender
    g = kobjects.pod("g", mem=4, cpu="1")
    g["spec"]["initContainers"] = [{"name": "i", "resources": {"requests": {"cpu": "3"}}}]
    g["spec"]["overhead"] = {"cpu": "1"}
    req = v.reader.request(g)
    assert req.cpu_milli == 4000
    v.bound(v.reserve(req, "a").request.key)
    assert free(v, "a") == (16000 - 10500, 65536 - 2304)


def test_gpu_pods_carry_their_cpu_and_are_never_counted_twice() -> None:
    v = ClusterView()
    v.reset([node("a")], [])
    g = gpu_bound("g", "a", 0, 4, cpu="3")
    v.upsert_pod(g)
    assert "default/g" in v.state.pods and "default/g" not in v.host
    assert free(v, "a") == (13000, 64512)
    v.upsert_pod(g)
    assert free(v, "a") == (13000, 64512)
    # bound annotated pods are held even when CPU is over-committed (they run)
    v.upsert_pod(plain("hog", "a", cpu="15"))
    v.upsert_pod(gpu_bound("h", "a", 1, 4, cpu="2"))
    assert "default/h" in v.state.pods and free(v, "a")[0] == -4000
    v.delete_pod(gpu_bound("h", "a", 1, 4, cpu="2"))
    v.delete_pod(plain("hog", "a", cpu="15"))
    v.delete_pod(g)
    assert free(v, "a") == (16000, 65536)


def test_a_node_that_becomes_a_gpu_node_brings_what_runs_there() -> None:
    v = ClusterView()
    v.reset([node("a")], [])
    bare = kobjects.node("later", [], "cgpu")
    v.upsert_node(bare)
    v.upsert_pod(plain("daemon", "later", cpu="2", memory="1Gi"))
    assert "later" not in v.state.index and v.host_sum["later"] == [2000, 1024]
    v.upsert_node(node("later"))  # the agent annotated its GPUs
    assert free(v, "later") == (14000, 64512)
    v.upsert_node(node("later", cpu="32"))  # allocatable grew
    assert free(v, "later") == (30000, 64512)
    v.delete_node("later")
    v.upsert_node(node("later"))
    assert free(v, "later") == (14000, 64512)


def test_malformed_values_never_break_the_view(caplog: Any) -> None:
    v = ClusterView()
    bad = node("bad")
    bad["status"]["allocatable"]["cpu"] = "sixteen"
    with caplog.at_level("WARNING"):
        v.reset([bad, node("ok")], [])
        v.upsert_node(bad)  # its next status update: kept, the problem not logged again
    assert "node/bad" in v.problems and "unknown" in v.problems["node/bad"]
    assert sum("sixteen" in r.getMessage() for r in caplog.records) == 1
    assert "bad" in v.state.index
    v.upsert_pod(plain("web", "bad", cpu="100"))  # unknown CPU never refuses
    req = v.reader.request(kobjects.pod("g", mem=4, cpu="8"))
    assert v.filter(req, ["bad", "ok"])[0] == ["bad", "ok"]
    # a pod with an unreadable CPU request (an API server would not store it): its CPU and
    # memory count as none, it is reported, its GPUs are still held
    g = gpu_bound("g", "ok", 0, 4, cpu="1")
    g["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "1 core"
    v.upsert_pod(g)
    assert "default/g" in v.state.pods and "CPU/memory" in v.problems["default/g"]
    assert free(v, "ok") == (16000, 65536)


def _objects(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = random.Random(seed)
    nodes = [node(f"n{i}", cpu=str(rng.choice([8, 16, 32])), gpus=rng.choice([1, 2, 4]))
             for i in range(6)]
    names = [n["metadata"]["name"] for n in nodes]
    pods: list[dict[str, Any]] = []
    for i in range(40):
        where = rng.choice(names)
        if rng.random() < 0.4:
            pods.append(plain(f"w{i}", where, cpu=str(rng.choice([1, 2])),
                              overhead={"cpu": "100m"}))
        else:
            gpu = rng.randrange(4)
            pods.append(gpu_bound(f"g{i}", where, gpu, rng.choice([1, 2]), cpu="500m"))
    done = plain("done", names[0], cpu="100")
    done["status"]["phase"] = "Failed"
    return nodes, [*pods, done]


def test_rebuild_equals_the_incremental_view() -> None:
    nodes, pods = _objects(3)
    live = ClusterView()
    live.reset(nodes, [])
    for p in pods:
        live.upsert_pod(p)
    rebuilt = ClusterView()
    rebuilt.reset(nodes, pods)
    assert rebuilt.fingerprint() == live.fingerprint()
    assert rebuilt.host == live.host and rebuilt.host_sum == live.host_sum
    assert any(int(live.state.cpu_other[i]) for i in range(live.state.n))
    # a relist (reset on the live view) keeps the same counts
    live.reset(nodes, pods)
    assert live.fingerprint() == rebuilt.fingerprint()


def test_relist_and_consistency_check_keep_cpu_and_memory(fake_api: Any) -> None:
    nodes, pods = _objects(5)
    for n in nodes:
        fake_api.create(n)
    for p in pods:
        fake_api.create(p)

    async def go() -> None:
        view, metrics = ClusterView(), Metrics()
        api = KubeApi.from_url(fake_api.url)
        inf = Informer(api, view, metrics, check_every=0, backoff=0.05)
        await inf.start()
        try:
            before = view.fingerprint()
            assert view.host and await inf.check(settle_s=1) == []
            # history compacted: the informer relists; CPU and memory are the same after
            fake_api.faults.compact()
            fake_api.faults.drop_watches()
            fake_api.create(plain("late", "n1", cpu="1"))
            deadline = asyncio.get_running_loop().time() + 10
            while "default/late" not in view.host:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.02)
            i = view.state.index["n1"]
            assert int(view.state.cpu_free[i]) == before["n1"][3] - 1000  # type: ignore[index]
            assert await inf.check(settle_s=1) == []
            # the live count drifts somehow: the check finds the node and repairs it
            view.state.charge_host("n2", 3000, 0)
            assert await inf.check(settle_s=1) == ["node/n2"]
            fresh = ClusterView()
            fresh.reset(fake_api.objects("nodes"), fake_api.objects("pods"))
            assert view.fingerprint() == fresh.fingerprint()
        finally:
            await inf.stop()
            await api.close()

    asyncio.run(go())


def test_the_learnt_workload_has_the_cpu_and_memory_of_gpu_pods() -> None:
    v = ClusterView(workload_refresh=4)
    v.reset([node(f"n{i}", cpu="64", memory="256Gi", gpus=4) for i in range(4)], [])
    for i in range(6):
        g = kobjects.pod(f"p{i}", mem=4, cpu="6", memory=f"{8 + 8 * (i % 2)}Gi")
        v.bound(v.reserve(v.reader.request(g), f"n{i % 4}").request.key)
    v.maybe_refresh_workload()
    w = v.workload
    assert w is not None and list(w.cpu) == [6000] and list(w.gpu) == [4]
    assert w.mem is not None and list(w.mem) == [12288.0]  # the mean, as the simulator's
    full = w.full or w
    assert sorted(full.mem.tolist()) == [8192.0, 16384.0]  # type: ignore[union-attr]


def _simulate(node_objs: list[dict[str, Any]], pods: list[dict[str, Any]],
              policy: str = "strand") -> list[str | None]:
    """The simulator's way: the core Scheduler places every pod, those without GPUs too."""
    state = ClusterState([spec_from_node(n) for n in node_objs])  # type: ignore[misc]
    pol = get_policy(policy)
    v = ClusterView(policy)
    v.reset(node_objs, [])
    pol.prepare(state, v.workload)
    sched = Scheduler(state, pol, tie_break="order")
    out = []
    for p in pods:
        req = v.reader.request(p)
        d = sched.schedule(req)
        out.append(d.node_name if d else None)
    return out


@pytest.mark.parametrize("policy", ["strand", "strandlp", "strandfill"])
def test_strand_in_the_view_decides_as_the_simulator_with_cpu_and_memory(policy: str) -> None:
    """Pods without GPUs placed by kube-scheduler where the simulator put them; GPU pods by the
    view's filter and prioritize. The same decisions; with CPU and memory hidden, others."""
    rng = random.Random(11)
    node_objs = [node(f"n{i:02d}", cpu=str(rng.choice([16, 32, 48])),
                      memory=f"{rng.choice([64, 128])}Gi", gpus=rng.choice([2, 4, 8]))
                 for i in range(20)]
    pods = []
    for i in range(300):
        if rng.random() < 0.15:
            pods.append(kobjects.pod(f"c{i}", containers=[{}], cpu=str(rng.choice([4, 8, 12])),
                                     memory=f"{rng.choice([8, 32])}Gi"))
        else:
            pods.append(kobjects.pod(f"g{i}", mem=rng.choice([2, 4, 8, 16]),
                                     cpu=str(rng.choice([1, 2, 4, 8])),
                                     memory=f"{rng.choice([4, 16, 48])}Gi"))
    sim = _simulate(node_objs, pods, policy)
    names = [n["metadata"]["name"] for n in node_objs]

    def extender(hide: bool) -> list[str | None]:
        objs = [kobjects.node(n["metadata"]["name"], [16] * len(spec_from_node(n).gpu_mem))  # type: ignore[union-attr]
                for n in node_objs] if hide else node_objs
        v = ClusterView(policy, workload_refresh=10**9)
        v.reset(objs, [])
        out: list[str | None] = []
        for p, want in zip(pods, sim, strict=True):
            req = v.reader.request(p)
            if not req.wants_gpu:  # kube-scheduler's decision, seen through the watch
                if want is not None:
                    bound = dict(p, spec=dict(p["spec"], nodeName=want),
                                 status={"phase": "Running"})
                    v.upsert_pod(bound if not hide else plain(p["metadata"]["name"], want,
                                                              cpu="0", memory="0"))
                out.append(want)
                continue
            if hide:
                req = v.reader.request(kobjects.pod(p["metadata"]["name"],
                                                    mem=req.containers[0].gpu_mem))
            passed, _, _ = v.filter(req, names)
            if not passed:
                out.append(None)
                continue
            scores = v.prioritize(req, passed)
            best = max(passed, key=lambda n: scores[n])
            v.bound(v.reserve(req, best).request.key)
            out.append(best)
        return out

    assert sum(x is not None for x in sim) > 80
    assert extender(hide=False) == sim
    assert np.mean([a != b for a, b in zip(extender(hide=True), sim, strict=True)]) > 0.1
