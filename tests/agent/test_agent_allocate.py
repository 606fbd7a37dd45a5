"""Allocate through the test kubelet: the right pod container, its GPUs and limits, isolation
per back-end, and clear refusals."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from agent_helpers import MPS_STANDIN, NODE, harness, make_pod, mps_daemon, short_dir  # noqa: F401
from agent_kubelet import wait_until

from sharegpu.agent.allocate import ANN_GRANT
from sharegpu.agent.isolation import HAMI_CONTAINER_LIBRARY
from sharegpu.core import names
from sharegpu.core.annotations import is_assigned

MIXED = [("Tesla-T4", 15), ("Tesla-T4", 15), ("Tesla-V100-SXM2-32GB", 32),
         ("Tesla-V100-SXM2-32GB", 32)]


def free_pool(h) -> dict[int, list[str]]:  # type: ignore[no-untyped-def]
    pool: dict[int, list[str]] = {}
    for i, _ in h.kubelet.devices[names.RES_GPU_MEM]:
        pool.setdefault(h.agent.devices.gpu_of(i), []).append(i)
    return pool


def take(pool: dict[int, list[str]], want: dict[int, int]) -> list[str]:
    out = []
    for g, n in want.items():
        out += [pool[g].pop() for _ in range(n)]
    return out


def uuids(h, gpus) -> str:  # type: ignore[no-untyped-def]
    return ",".join(h.agent.gpus[g].uuid for g in sorted(gpus))


def expected_env(h, pod, c) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """What container ``c`` must get, read from its pod's annotations alone."""
    from sharegpu.core.annotations import decode

    alloc = decode(pod["metadata"]["annotations"])
    mem = alloc.mem[c]
    gpus = sorted(mem)
    env = {
        names.ENV_VISIBLE_DEVICES: uuids(h, gpus),
        names.ENV_MEM_IDX: ",".join(map(str, gpus)),
        names.ENV_MEM_CONTAINER: str(sum(mem.values())),
        names.ENV_MEM_DEV: str(h.agent.gpus[gpus[0]].mem_gib),
    }
    for i, g in enumerate(gpus):
        env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{mem[g] * 1024}m"
    return env


def place_50(seed: int = 7) -> list[dict]:
    """50 pods placed like the scheduler would on a node of four 15 GiB and four 32 GiB GPUs:
    single-container, multi-container (containers possibly on different GPUs) and multi-GPU
    shared pods."""
    rng = random.Random(seed)
    free = [15] * 4 + [32] * 4
    pods: list[dict] = []
    for _ in range(10_000):
        if len(pods) == 50:
            break
        kind = rng.choice(["single"] * 3 + ["multi", "multigpu"])
        if kind == "single":
            reqs = [{"mem": rng.randint(1, 2)}]
            count = None
        elif kind == "multi":
            reqs = [{"mem": rng.randint(1, 2)} for _ in range(rng.randint(2, 3))]
            count = None
        else:
            count = 2
            reqs = [{"mem": 2 * rng.randint(1, 2)}]
        trial = list(free)
        alloc = {}
        for c, r in enumerate(reqs):
            k = count or 1
            per = r["mem"] // k
            fits = [g for g in range(8) if trial[g] >= per]
            if len(fits) < k:
                break
            gpus = rng.sample(fits, k)
            for g in gpus:
                trial[g] -= per
            alloc[c] = {g: per for g in gpus}
        else:
            free = trial
            pods.append(make_pod(f"p{len(pods):02d}", reqs, alloc=alloc, gpu_count=count,
                                 assume=1_000 + rng.randint(0, 20)))
    assert len(pods) == 50 and min(free) >= 0
    return pods


@pytest.mark.parametrize("seed", [7, 11, 23])
async def test_50_pods_concurrently_zero_mismatches(harness, seed):
    h = await harness(gpus=[("Tesla-T4", 15)] * 4 + [("Tesla-V100-SXM2-32GB", 32)] * 4,
                      mode="cgpu")
    pods = place_50(seed)
    kinds = {"multi-container": 0, "multi-gpu": 0}
    for p in pods:
        h.kube.add_pod(p)
        kinds["multi-container"] += len(p["spec"]["containers"]) > 1
        kinds["multi-gpu"] += names.POD_LABEL_GPU_COUNT in p["metadata"]["labels"]
    assert kinds["multi-container"] >= 5 and kinds["multi-gpu"] >= 5
    pool = free_pool(h)
    assert {g: len(v) for g, v in pool.items()} == {g: 15 if g < 4 else 32 for g in range(8)}

    got: dict[tuple[str, int], dict[str, str]] = {}
    granted_to: list[str] = []

    async def start_pod(pod):  # type: ignore[no-untyped-def]
        from sharegpu.core.annotations import decode

        alloc = decode(pod["metadata"]["annotations"])
        for c in sorted(alloc.mem):  # the kubelet allocates a pod's containers in order
            ids = take(pool, dict(alloc.mem[c]))
            resp = await h.kubelet.allocate(names.RES_GPU_MEM, ids)
            got[(pod["metadata"]["name"], c)] = dict(resp.envs)
            granted_to.append(resp.annotations[ANN_GRANT])

    await asyncio.gather(*(start_pod(p) for p in pods))

    containers = [(p, c) for p in pods for c in range(len(p["spec"]["containers"]))]
    assert len(got) == len(containers) > 50
    mismatches = []
    for p, c in containers:
        env = got[(p["metadata"]["name"], c)]
        want = expected_env(h, p, c)
        if any(env.get(k) != v for k, v in want.items()):
            mismatches.append((p["metadata"]["name"], c, want, env))
        assert env["LD_PRELOAD"] == HAMI_CONTAINER_LIBRARY
    assert mismatches == []
    # every pod container was handed out exactly once
    assert sorted(granted_to) == sorted(f"default/{p['metadata']['name']}/c{c}"
                                        for p, c in containers)
    # and every pod is marked assigned (both generations)
    await wait_until(lambda: all(is_assigned(p["metadata"]["annotations"])
                                 for p in h.kube.pods.values()))
    ann = h.kube.pods[("default", "p00")]["metadata"]["annotations"]
    assert ann[names.ANN_ASSIGNED] == ann[names.ANN_MEM_ASSIGNED] == "true"


async def test_serial_kubelet_steered_by_preferred_allocation(harness):
    """Pods with the same container size but different GPUs and pod totals, started one by one
    in assume-time order from the kubelet's whole free list: GetPreferredAllocation steers each
    container to its scheduler-chosen GPU and Allocate names the right pod."""
    h = await harness(gpus=MIXED, mode="cgpu")
    pods = [
        make_pod("a", [{"mem": 2}], alloc={0: {3: 2}}, assume=10),
        make_pod("b", [{"mem": 2}, {"mem": 2}], alloc={0: {1: 2}, 1: {2: 2}}, assume=20),
        make_pod("c", [{"mem": 2}], alloc={0: {0: 2}}, assume=30),
        make_pod("d", [{"mem": 4}], alloc={0: {2: 2, 3: 2}}, gpu_count=2, assume=40),
    ]
    for p in pods:
        h.kube.add_pod(p)
    free = [i for i, _ in h.kubelet.devices[names.RES_GPU_MEM]]
    for p in pods:
        for c in range(len(p["spec"]["containers"])):
            size = int(p["spec"]["containers"][c]["resources"]["limits"][names.RES_GPU_MEM])
            ids = await h.kubelet.preferred(names.RES_GPU_MEM, free, size)
            assert len(ids) == size
            free = [i for i in free if i not in ids]
            resp = await h.kubelet.allocate(names.RES_GPU_MEM, ids)
            assert resp.annotations[ANN_GRANT] == f"default/{p['metadata']['name']}/c{c}"
            env = dict(resp.envs)
            for k, v in expected_env(h, p, c).items():
                assert env[k] == v, (p["metadata"]["name"], c, k)
            total = sum(int(x["resources"]["limits"][names.RES_GPU_MEM])
                        for x in p["spec"]["containers"])
            assert env[names.ENV_MEM_POD] == str(total)
    # steered: each GPU lost exactly what the scheduler put there
    left = {}
    for i in free:
        g = h.agent.devices.gpu_of(i)
        left[g] = left.get(g, 0) + 1
    assert left == {0: 13, 1: 13, 2: 28, 3: 28}


async def test_core_mem_pairs_memory_and_compute(harness):
    h = await harness(gpus=MIXED, mode="core_mem")
    h.kube.add_pod(make_pod("x", [{"mem": 4, "core": 30}], alloc={0: {1: 4}},
                            core={0: {1: 30}}, assume=1))
    h.kube.add_pod(make_pod("y", [{"mem": 4, "core": 50}], alloc={0: {1: 4}},
                            core={0: {1: 50}}, assume=2))
    core_ids = {}
    for i, _ in h.kubelet.devices[names.RES_GPU_CORE]:
        core_ids.setdefault(h.agent.devices.gpu_of(i), []).append(i)
    pool = free_pool(h)
    # x: memory first, then compute; y: compute first, then memory
    r1 = await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {1: 4}))
    r2 = await h.kubelet.allocate(names.RES_GPU_CORE, [core_ids[1].pop() for _ in range(30)])
    r3 = await h.kubelet.allocate(names.RES_GPU_CORE, [core_ids[1].pop() for _ in range(50)])
    r4 = await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {1: 4}))
    assert r1.annotations[ANN_GRANT] == r2.annotations[ANN_GRANT] == "default/x/c0"
    assert r3.annotations[ANN_GRANT] == r4.annotations[ANN_GRANT] == "default/y/c0"
    assert r1.envs["CUDA_DEVICE_SM_LIMIT"] == r2.envs["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert r3.envs["CUDA_DEVICE_SM_LIMIT"] == r4.envs["CUDA_DEVICE_SM_LIMIT"] == "50"
    assert r1.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
    await wait_until(lambda: all(is_assigned(p["metadata"]["annotations"])
                                 for p in h.kube.pods.values()))


async def test_no_matching_pod_fails_with_reason(harness):
    h = await harness(gpus=MIXED, mode="cgpu")
    pool = free_pool(h)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {0: 3}))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no pending pod on node gpu-node-1" in e.value.details()
    assert "GPU 0: 3 GiB" in e.value.details()
    assert h.agent.allocation_failures == 1


async def test_gpu_index_beyond_node_is_refused_not_started_without_gpu(harness):
    h = await harness(gpus=MIXED, mode="cgpu")
    # a stale decision naming GPU 7 on a 4-GPU node; its size matches the request
    h.kube.add_pod(make_pod("stale", [{"mem": 2}], alloc={0: {7: 2}}))
    pool = free_pool(h)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {0: 2}))
    assert "GPU 7" in e.value.details() and "has 4 GPU(s)" in e.value.details()


async def test_malformed_pod_does_not_disturb_others(harness):
    h = await harness(gpus=MIXED, mode="cgpu")
    bad = make_pod("bad", [{"mem": 2}], alloc={0: {0: 2}})
    bad["metadata"]["annotations"][names.ANN_ALLOCATION] = "{not json"
    h.kube.add_pod(bad)
    h.kube.add_pod(make_pod("good", [{"mem": 2}], alloc={0: {0: 2}}, assume=5))
    resp = await h.kubelet.allocate(names.RES_GPU_MEM, take(free_pool(h), {0: 2}))
    assert resp.annotations[ANN_GRANT] == "default/good/c0"


async def test_first_generation_annotations_multi_container(harness):
    h = await harness(gpus=MIXED, mode="cgpu")
    h.kube.add_pod(make_pod("old", [{"mem": 1}, {"mem": 3}], alloc={0: {2: 4}},
                            first_gen_only=True))
    pool = free_pool(h)
    r0 = await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {2: 1}))
    r1 = await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {2: 3}))
    assert r0.envs[names.ENV_MEM_CONTAINER] == "1" and r1.envs[names.ENV_MEM_CONTAINER] == "3"
    assert r0.envs[names.ENV_MEM_POD] == r1.envs[names.ENV_MEM_POD] == "4"
    assert r0.envs[names.ENV_VISIBLE_DEVICES] == uuids(h, [2])
    assert r1.envs[names.ENV_VISIBLE_DEVICES] == uuids(h, [2])
    old = h.kube.pods[("default", "old")]
    await wait_until(lambda: is_assigned(old["metadata"]["annotations"]))


async def test_mps_env_and_pipe_mount(harness, mps_daemon):
    h = await harness(gpus=MIXED, mode="mps", mps_control=(MPS_STANDIN,))
    h.kube.add_pod(make_pod("m", [{"mem": 4}], alloc={0: {0: 2, 3: 2}}, gpu_count=2))
    r = await h.kubelet.allocate(names.RES_GPU_MEM, take(free_pool(h), {0: 2, 3: 2}))
    assert r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M,1=2048M"
    assert r.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert "LD_PRELOAD" not in r.envs
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in r.envs  # memory only: compute shared
    assert [(m.container_path, m.host_path) for m in r.mounts] == [
        ("/tmp/nvidia-mps", mps_daemon), ("/dev/shm", h.agent.config.isolation_paths.mps_shm_dir)]


async def test_share_mode_sets_no_isolation(harness):
    h = await harness(gpus=MIXED, mode="share")
    h.kube.add_pod(make_pod("s", [{"mem": 3}], alloc={0: {2: 3}}))
    r = await h.kubelet.allocate(names.RES_GPU_MEM, take(free_pool(h), {2: 3}))
    assert r.envs[names.ENV_VISIBLE_DEVICES] == uuids(h, [2])
    assert not any(k.startswith(("CUDA_", "LD_")) for k in r.envs)
    assert list(r.mounts) == []


async def test_cgpu_disable_per_container_and_per_node(harness):
    h = await harness(gpus=MIXED, mode="cgpu")
    h.kube.add_pod(make_pod("off", [{"mem": 1}], alloc={0: {0: 1}},
                            env={0: {names.ENV_CGPU_DISABLE: "true"}}, assume=1))
    h.kube.add_pod(make_pod("on", [{"mem": 1}], alloc={0: {1: 1}}, assume=2))
    pool = free_pool(h)
    r_off = await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {0: 1}))
    r_on = await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {1: 1}))
    assert r_off.annotations[ANN_GRANT] == "default/off/c0"
    assert "LD_PRELOAD" not in r_off.envs and "LD_PRELOAD" in r_on.envs

    h.kube.set_node_labels(NODE, {names.LABEL_DISABLE_ISOLATION: "true"})
    await wait_until(lambda: h.agent.labels.get(names.LABEL_DISABLE_ISOLATION) == "true")
    h.kube.add_pod(make_pod("node-off", [{"mem": 1}], alloc={0: {1: 1}}, assume=3))
    r = await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {1: 1}))
    assert r.annotations[ANN_GRANT] == "default/node-off/c0"
    assert "LD_PRELOAD" not in r.envs and "CUDA_DEVICE_MEMORY_LIMIT_0" not in r.envs


async def test_exclusive_without_decision_gets_kubelet_cards(harness):
    h = await harness(gpus=MIXED, mode="default")
    ids = [i for i, _ in h.kubelet.devices[names.RES_NVIDIA_GPU]][1:3]
    r = await h.kubelet.allocate(names.RES_NVIDIA_GPU, ids)
    assert r.envs[names.ENV_VISIBLE_DEVICES] == ",".join(ids)


async def test_topology_uses_the_scheduler_set(harness):
    h = await harness(gpus=MIXED, mode="topology")
    h.kube.add_pod(make_pod("t", [{"cards": 2}], alloc={0: {1: 15, 3: 32}},
                            whole=names.RES_TOPOLOGY_GPU))
    all_ids = [i for i, _ in h.kubelet.devices[names.RES_TOPOLOGY_GPU]]
    pref = await h.kubelet.preferred(names.RES_TOPOLOGY_GPU, all_ids, 2)
    assert sorted(pref) == sorted([h.agent.gpus[1].uuid, h.agent.gpus[3].uuid])
    # where the kubelet picks other cards, the container gets the kubelet's: cards it gave
    # nobody else, where the scheduler's set may be held by another pod (issue 40, attack 4)
    r = await h.kubelet.allocate(names.RES_TOPOLOGY_GPU, all_ids[:2])
    assert r.envs[names.ENV_VISIBLE_DEVICES] == ",".join(all_ids[:2])
    assert ANN_GRANT not in r.annotations
    # the kubelet following the preference: the scheduler's set, and the pod is marked
    r = await h.kubelet.allocate(names.RES_TOPOLOGY_GPU, pref)
    assert r.envs[names.ENV_VISIBLE_DEVICES] == uuids(h, [1, 3])
    assert r.annotations[ANN_GRANT] == "default/t/c0"
    await wait_until(lambda: is_assigned(h.kube.pods[("default", "t")]["metadata"]["annotations"]))


async def test_concurrent_calls_share_lists_but_never_read_an_older_one(harness):
    h = await harness(gpus=MIXED, mode="cgpu")
    h.kube.latency_s = 0.05
    h.agent.config.allocate_retries = 0  # a stale list would fail the late pod outright
    for i in range(8):
        h.kube.add_pod(make_pod(f"q{i}", [{"mem": 1}], alloc={0: {2: 1}}, assume=i))
    pool = free_pool(h)
    before = h.kube.lists
    first = [asyncio.ensure_future(h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {2: 1})))
             for _ in range(8)]
    await asyncio.sleep(0.02)  # a list is now in flight; this pod is bound after it began
    h.kube.add_pod(make_pod("late", [{"mem": 5}], alloc={0: {3: 5}}, assume=100))
    late = await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {3: 5}))
    done = await asyncio.gather(*first)
    assert late.annotations[ANN_GRANT] == "default/late/c0"
    assert sorted(r.annotations[ANN_GRANT] for r in done) == [f"default/q{i}/c0" for i in range(8)]
    assert h.kube.lists - before <= 4  # 9 calls, a handful of lists


async def test_a_container_that_could_set_its_limits_by_envfrom_or_a_mount_is_refused(harness):
    """Issue 40, attack 5: ``envFrom`` of a ConfigMap (the agent cannot read its keys) or a
    mount over the loader's preload list would replace HAMi-core's limits: refused by the
    agent, naming the field and the rule; a prefix that cannot begin a limit variable passes."""
    h = await harness(gpus=MIXED, mode="cgpu")
    pool = free_pool(h)
    bad = make_pod("envfrom", [{"mem": 2}], alloc={0: {0: 2}}, assume=1)
    bad["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "limits"}}]
    h.kube.add_pod(bad)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {0: 2}))
    assert "refuses default/envfrom/c0" in e.value.details()
    assert "envFrom[0] (configMapRef limits, no prefix" in e.value.details()
    assert "Rule: a container under isolation gets its limits from the agent alone" \
        in e.value.details()
    h.kube.pods.pop(("default", "envfrom"))

    mount = make_pod("mount", [{"mem": 2}], alloc={0: {1: 2}}, assume=2)
    mount["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "mine", "mountPath": "/etc/ld.so.preload", "subPath": "empty"}]
    h.kube.add_pod(mount)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {1: 2}))
    assert "volumeMounts[0] at /etc/ld.so.preload" in e.value.details()
    h.kube.pods.pop(("default", "mount"))

    ok = make_pod("prefixed", [{"mem": 2}], alloc={0: {2: 2}}, assume=3)
    ok["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "app"},
                                               "prefix": "APP_"}]
    h.kube.add_pod(ok)
    r = await h.kubelet.allocate(names.RES_GPU_MEM, take(pool, {2: 2}))
    assert r.annotations[ANN_GRANT] == "default/prefixed/c0"
    assert r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"
