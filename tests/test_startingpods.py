"""The starting-pods rule (sharegpu.core.startingpods) and why it is needed: the agent matches the
kubelet's device-plugin calls, which name no pod, to pending pods; pods kept apart by the rule
get their own pod's GPUs and limits in ANY admission order, pods that break it do not.

The kubelet is played as its device manager works: pods one after another in an order of its
choosing, each pod's containers in order, each container's resources in map order (random);
per resource a GetPreferredAllocation over the devices still free, then Allocate of what it
returned."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

from sharegpu.agent.allocate import Allocator, pending_candidates
from sharegpu.agent.devices import DeviceMap, device_ids
from sharegpu.agent.isolation import Backend
from sharegpu.agent.nvml import FakeNvml
from sharegpu.core import names
from sharegpu.core.annotations import Allocation, decode
from sharegpu.core.request import parse_pod
from sharegpu.core.startingpods import StartingPods, kubelet_requests

sys.path.insert(0, str(Path(__file__).resolve().parent / "agent"))
from agent_helpers import NODE, make_pod

GPUS = FakeNvml([("T4", 15), ("T4", 15), ("V100", 32), ("V100", 32)]).gpus()


def _pod(name: str, containers: list[dict[str, int]], alloc: dict[int, dict[int, int]],
         core: dict[int, dict[int, int]] | None = None, *, assume: int = 1,
         gpu_count: int | None = None, env: dict[int, dict[str, str]] | None = None,
         whole: str | None = None) -> dict[str, Any]:
    return make_pod(name, containers, alloc=alloc, core=core, assume=assume,
                    gpu_count=gpu_count, env=env, whole=whole)


def _add(sp: StartingPods, pod: dict[str, Any]) -> None:
    req = parse_pod(pod)
    alloc = decode(pod["metadata"]["annotations"])
    assert alloc is not None
    sp.add(req.key, NODE, req, alloc)


def _conflict(sp: StartingPods, pod: dict[str, Any]) -> str | None:
    req = parse_pod(pod)
    alloc = decode(pod["metadata"]["annotations"])
    assert alloc is not None
    c = sp.conflict(NODE, req, alloc)
    return None if c is None else c.pod


# -- the rule ------------------------------------------------------------------------------


def test_same_request_other_gpu_conflicts_same_gpu_does_not():
    sp = StartingPods()
    _add(sp, _pod("a", [{"mem": 4}], {0: {0: 4}}))
    assert _conflict(sp, _pod("b", [{"mem": 4}], {0: {1: 4}})) == "default/a"
    assert _conflict(sp, _pod("c", [{"mem": 4}], {0: {0: 4}})) is None
    assert _conflict(sp, _pod("d", [{"mem": 3}], {0: {1: 3}})) is None  # another request


def test_equal_totals_of_other_shapes_conflict():
    sp = StartingPods()
    _add(sp, _pod("one-gpu", [{"mem": 4}], {0: {2: 4}}))
    # 2 GPUs x 2 GiB: the kubelet asks for 4 gpu-mem devices as for the 1-GPU pod
    assert _conflict(sp, _pod("two-gpus", [{"mem": 4}], {0: {2: 2, 3: 2}}, gpu_count=2)) \
        == "default/one-gpu"
    # the same memory but another compute share, or another pod total, or an opt-out
    sp2 = StartingPods()
    _add(sp2, _pod("c30", [{"mem": 2, "core": 30}], {0: {0: 2}}, core={0: {0: 30}}))
    assert _conflict(sp2, _pod("c50", [{"mem": 2, "core": 50}], {0: {0: 2}},
                               core={0: {0: 50}})) == "default/c30"
    sp3 = StartingPods()
    _add(sp3, _pod("solo", [{"mem": 2}], {0: {0: 2}}))
    assert _conflict(sp3, _pod("pair", [{"mem": 2}, {"mem": 1}], {0: {0: 2}, 1: {1: 1}})) \
        == "default/solo"
    assert _conflict(sp3, _pod("off", [{"mem": 2}], {0: {0: 2}},
                               env={0: {names.ENV_CGPU_DISABLE: "true"}})) == "default/solo"


def test_whole_cards_of_one_count_conflict_on_other_cards():
    sp = StartingPods()
    _add(sp, _pod("x", [{"cards": 1}], {0: {0: 15}}))
    assert _conflict(sp, _pod("y", [{"cards": 1}], {0: {1: 15}})) == "default/x"
    assert _conflict(sp, _pod("z", [{"cards": 2}], {0: {1: 15, 2: 32}})) is None


def test_a_pods_own_containers_may_differ_and_twins_of_it_are_allowed():
    sp = StartingPods()
    p = _pod("p", [{"mem": 2}, {"mem": 2}], {0: {0: 2}, 1: {1: 2}})
    assert _conflict(sp, p) is None
    _add(sp, p)
    assert _conflict(sp, _pod("twin", [{"mem": 2}, {"mem": 2}], {0: {0: 2}, 1: {1: 2}})) is None
    assert _conflict(sp, _pod("swapped", [{"mem": 2}, {"mem": 2}], {0: {1: 2}, 1: {0: 2}})) \
        == "default/p"


def test_discard_and_re_add_and_other_nodes():
    sp = StartingPods()
    _add(sp, _pod("a", [{"mem": 4}], {0: {0: 4}}))
    b = _pod("b", [{"mem": 4}], {0: {1: 4}})
    assert _conflict(sp, b) == "default/a"
    req = parse_pod(b)
    assert sp.conflict("other-node", req, Allocation(mem={0: {1: 4}})) is None
    sp.discard("default/a")
    assert _conflict(sp, b) is None and len(sp) == 0 and sp.on(NODE) == set()
    sp.discard("default/a")  # twice: nothing
    _add(sp, b)
    _add(sp, b)  # again: replaces, not duplicates
    assert sp.on(NODE) == {"default/b"} and len(sp) == 1


def test_kubelet_requests_name_the_resource_and_device_count():
    req = parse_pod(_pod("m", [{"mem": 6, "core": 20}], {0: {0: 3, 1: 3}}, gpu_count=2))
    assert kubelet_requests(req) == {0: ((names.RES_GPU_CORE, 20), (names.RES_GPU_MEM, 6))}
    req = parse_pod(_pod("t", [{"cards": 2}], {0: {0: 15, 1: 15}},
                         whole=names.RES_TOPOLOGY_GPU))
    assert kubelet_requests(req) == {0: ((names.RES_TOPOLOGY_GPU, 2),)}


# -- the agent under any admission order -----------------------------------------------------


def _kubelet_admits(pods: list[dict[str, Any]], order: list[int], rng: random.Random
                    ) -> list[str]:
    """Admit ``pods`` in ``order`` through the agent's Allocator as the kubelet's device manager
    does; return every way a container's answer differs from its own pod's decision."""
    a = Allocator(NODE, DeviceMap(GPUS))
    cands = pending_candidates(pods, NODE)
    free = {r: [d for d, _ in device_ids(r, GPUS)] for r in
            (names.RES_GPU_MEM, names.RES_GPU_CORE, names.RES_NVIDIA_GPU)}
    bad: list[str] = []
    for k in order:
        pod = pods[k]
        req = parse_pod(pod)
        alloc = decode(pod["metadata"]["annotations"])
        assert alloc is not None
        for c in req.containers:
            asks = list(kubelet_requests(req)[c.index])
            rng.shuffle(asks)  # the kubelet walks a container's resources in map order
            for res, n in asks:
                want = a.preferred(res, cands, free[res], [], n)
                free[res] = [d for d in free[res] if d not in set(want)]
                g, _ = a.allocate(res, want, cands, backend=Backend.HAMI, node_labels={})
                mine = sorted(alloc.mem[c.index])
                vis = ",".join(GPUS[i].uuid for i in mine)
                where = f"{req.key}/{c.index} {res}"
                if g.env.envs.get(names.ENV_VISIBLE_DEVICES) != vis:
                    bad.append(f"{where}: GPUs {g.gpus}, decision {mine}")
                if res == names.RES_GPU_MEM:
                    for j, gpu in enumerate(mine):
                        lim = g.env.envs.get(f"CUDA_DEVICE_MEMORY_LIMIT_{j}")
                        if c.isolation_off:
                            if lim is not None:
                                bad.append(f"{where}: isolated though it opted out")
                        elif lim != f"{alloc.mem[c.index][gpu] * 1024}m":
                            bad.append(f"{where}: limit {lim}")
                    if g.env.envs.get(names.ENV_MEM_POD) != str(alloc.total_mem):
                        bad.append(f"{where}: pod total {g.env.envs.get(names.ENV_MEM_POD)}")
                if res == names.RES_GPU_CORE:
                    cap = None if c.isolation_off else str(min(alloc.core[c.index].values()))
                    if g.env.envs.get("CUDA_DEVICE_SM_LIMIT") != cap:
                        bad.append(f"{where}: SM limit {g.env.envs.get('CUDA_DEVICE_SM_LIMIT')}")
    return bad


def _random_pods(rng: random.Random, n: int, *, keep_rule: bool) -> list[dict[str, Any]]:
    """Up to ``n`` pods bound to one node, none of them started, placed at random on free GPU
    room; with ``keep_rule`` only placements the extender's binder lets through (no
    conflict)."""
    free = [g.mem_gib for g in GPUS]
    cores = [100] * len(GPUS)
    sp = StartingPods()
    out: list[dict[str, Any]] = []
    core_mode = rng.random() < 0.5
    for t in range(20_000):
        if len(out) == n:
            break
        kind = rng.choice(["single", "single", "multi-container", "multi-gpu", "opt-out"])
        count = None
        env = None
        if kind == "multi-container":
            cs = [{"mem": rng.randint(1, 2)} for _ in range(rng.randint(2, 3))]
        elif kind == "multi-gpu" and not core_mode:
            count = 2
            cs = [{"mem": 2 * rng.randint(1, 2)}]
        else:
            cs = [{"mem": rng.randint(1, 3)}]
            if kind == "opt-out":
                env = {0: {names.ENV_CGPU_DISABLE: "true"}}
        if core_mode:
            for c in cs:
                c["core"] = rng.choice(range(5, 35, 5))
        mem, cr = list(free), list(cores)
        alloc: dict[int, dict[int, int]] = {}
        core: dict[int, dict[int, int]] = {}
        for i, c in enumerate(cs):
            k = count or 1
            per = c["mem"] // k
            fits = [g for g in range(len(GPUS)) if mem[g] >= per and cr[g] >= c.get("core", 0)]
            if len(fits) < k:
                break
            for g in (chosen := rng.sample(fits, k)):
                mem[g] -= per
                cr[g] -= c.get("core", 0)
            alloc[i] = {g: per for g in chosen}
            if c.get("core"):
                core[i] = {g: c["core"] for g in chosen}
        else:
            pod = _pod(f"p{len(out):02d}", cs, alloc, core, assume=t, gpu_count=count, env=env)
            if keep_rule and _conflict(sp, pod) is not None:
                continue
            _add(sp, pod)
            free, cores = mem, cr
            out.append(pod)
    # the rule lets fewer pods start together where many share a compute percentage
    assert len(out) >= n // 2
    return out


@pytest.mark.parametrize("seed", range(12))
def test_pods_that_keep_the_rule_get_their_own_decision_in_any_admission_order(seed: int):
    rng = random.Random(seed)
    pods = _random_pods(rng, 16, keep_rule=True)
    for _ in range(20):
        order = list(range(len(pods)))
        rng.shuffle(order)
        assert _kubelet_admits(pods, order, rng) == []


def test_pods_that_break_the_rule_get_other_pods_decisions_in_some_order():
    rng = random.Random(1)
    wrong = 0
    for _ in range(10):
        pods = _random_pods(rng, 16, keep_rule=False)
        order = list(range(len(pods)))
        rng.shuffle(order)
        wrong += bool(_kubelet_admits(pods, order, rng))
    assert wrong >= 5


def test_only_the_first_gpu_container_is_compared():
    sp = StartingPods()
    _add(sp, _pod("big-first", [{"mem": 3}, {"mem": 2}], {0: {0: 3}, 1: {1: 2}}))
    # its second container asks what this one's first does: the agent knows a pod it has begun,
    # so only first containers can be mistaken for each other
    assert _conflict(sp, _pod("two", [{"mem": 2}], {0: {2: 2}})) is None
    assert _conflict(sp, _pod("three", [{"mem": 3}], {0: {0: 3}})) == "default/big-first"
