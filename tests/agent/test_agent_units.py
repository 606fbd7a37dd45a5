"""The agent's pure parts without gRPC: matching rules, ledger, devices, isolation, CLI errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from agent_helpers import NODE, make_pod

from sharegpu.agent.allocate import AllocationError, Allocator, pending_candidates
from sharegpu.agent.devices import DeviceMap, device_ids, devices_for
from sharegpu.agent.isolation import Backend, IsolationConfig, backend_for, isolation_env
from sharegpu.agent.nvml import FakeNvml, Gpu, parse_fake_gpus
from sharegpu.core import names
from sharegpu.core.errors import ValidationError
from sharegpu.core.modes import Mode

GPUS = FakeNvml([("T4", 15), ("V100", 32)]).gpus()


def allocator() -> Allocator:
    return Allocator(NODE, DeviceMap(GPUS))


def ids_on(gpu: int, n: int, start: int = 0) -> list[str]:
    return [f"{GPUS[gpu].uuid}-_-{j}" for j in range(start, start + n)]


def grant(a, cands, ids, resource=names.RES_GPU_MEM, backend=Backend.HAMI):  # type: ignore[no-untyped-def]
    return a.allocate(resource, ids, cands, backend=backend, node_labels={})


def test_pending_candidates_skip_assigned_terminated_other_nodes_and_plain_pods():
    assigned = make_pod("done", [{"mem": 1}], alloc={0: {0: 1}})
    assigned["metadata"]["annotations"][names.ANN_ASSIGNED] = "true"
    finished = make_pod("fin", [{"mem": 1}], alloc={0: {0: 1}})
    finished["status"]["phase"] = "Succeeded"
    elsewhere = make_pod("far", [{"mem": 1}], alloc={0: {0: 1}}, node="other")
    plain = make_pod("plain", [{"mem": 1}])
    live = make_pod("live", [{"mem": 1}, {"mem": 2}], alloc={0: {0: 1}, 1: {1: 2}})
    cands = pending_candidates([assigned, finished, elsewhere, plain, live], NODE)
    assert [(c.name, c.container, dict(c.mem)) for c in cands] == [
        ("live", 0, {0: 1}), ("live", 1, {1: 2})]
    assert all(c.pod_total_mem == 3 for c in cands)


def test_exact_match_beats_earlier_assume_time_and_total_match_is_the_fallback():
    early = make_pod("early", [{"mem": 2}], alloc={0: {0: 2}}, assume=1)
    late = make_pod("late", [{"mem": 2}], alloc={0: {1: 2}}, assume=2)
    cands = pending_candidates([early, late], NODE)
    a = allocator()
    g, done = grant(a, cands, ids_on(1, 2))
    assert g.candidate.name == "late" and done
    # devices on the "wrong" GPU still find the remaining pod by size; its GPU comes from the
    # annotation, not from the fake devices
    g, _ = grant(a, cands, ids_on(1, 2, 2))
    assert g.candidate.name == "early" and g.gpus == (0,)
    with pytest.raises(AllocationError):
        grant(a, cands, ids_on(1, 2, 4))


def test_next_container_of_a_started_pod_wins_over_an_earlier_pod():
    solo = make_pod("solo", [{"mem": 1}], alloc={0: {0: 1}}, assume=1)
    pair = make_pod("pair", [{"mem": 3}, {"mem": 1}], alloc={0: {0: 3}, 1: {0: 1}}, assume=5)
    cands = pending_candidates([solo, pair], NODE)
    a = allocator()
    g, _ = grant(a, cands, ids_on(0, 3))
    assert (g.candidate.name, g.candidate.container) == ("pair", 0)
    g, done = grant(a, cands, ids_on(0, 1, 3))  # the kubelet goes on with pair's container 1
    assert (g.candidate.name, g.candidate.container) == ("pair", 1) and done
    assert g.env.envs[names.ENV_MEM_POD] == "4"
    g, _ = grant(a, cands, ids_on(0, 1, 4))
    assert g.candidate.name == "solo"


def test_done_pod_is_never_handed_out_again_even_from_a_stale_list():
    pod = make_pod("p", [{"mem": 2}], alloc={0: {0: 2}})
    stale = pending_candidates([pod], NODE)
    a = allocator()
    grant(a, stale, ids_on(0, 2))
    with pytest.raises(AllocationError):
        grant(a, stale, ids_on(0, 2, 2))


def test_unknown_device_id_is_a_clear_refusal():
    with pytest.raises(AllocationError, match="names no GPU of this node"):
        grant(allocator(), [], ["GPU-gone-_-1"])


def test_preferred_steers_to_the_scheduler_gpus_and_falls_back_to_kubelet_order():
    pod = make_pod("p", [{"mem": 4}], alloc={0: {1: 2, 0: 2}}, gpu_count=2)
    cands = pending_candidates([pod], NODE)
    avail = ids_on(0, 15) + ids_on(1, 32)
    got = allocator().preferred(names.RES_GPU_MEM, cands, avail, [], 4)
    assert DeviceMap(GPUS).per_gpu(got) == {0: 2, 1: 2}
    assert allocator().preferred(names.RES_GPU_MEM, cands, avail, [], 5) == avail[:5]


def test_devices_per_mode_and_gpu_sizes():
    assert len(devices_for(names.RES_GPU_MEM, Mode.CGPU, GPUS)) == 47
    assert devices_for(names.RES_GPU_MEM, Mode.EXCLUSIVE, GPUS) == []
    assert len(devices_for(names.RES_GPU_CORE, Mode.CORE_MEM, GPUS)) == 200
    assert devices_for(names.RES_GPU_CORE, Mode.CGPU, GPUS) == []
    sick = devices_for(names.RES_NVIDIA_GPU, Mode.EXCLUSIVE, GPUS, unhealthy=[1])
    assert [d.healthy for d in sick] == [True, False]
    long_uuid = Gpu(0, "GPU-" + "f" * 36, "x", 80 * 1024)
    assert max(len(i) for i, _ in device_ids(names.RES_GPU_MEM, [long_uuid])) <= 63


def test_isolation_backends():
    assert backend_for("auto", Mode.CGPU) is Backend.HAMI
    assert backend_for("auto", Mode.CORE_MEM) is Backend.HAMI
    assert backend_for("auto", Mode.MPS) is Backend.MPS
    assert backend_for("auto", Mode.SHARE) is Backend.NONE
    assert backend_for("none", Mode.CGPU) is Backend.NONE
    with pytest.raises(ValidationError, match="--isolation"):
        backend_for("kvm", Mode.CGPU)
    env = isolation_env(Backend.HAMI, mem={3: 4, 1: 2}, core={1: 20, 3: 20}, pod_uid="u",
                        config=IsolationConfig())
    # limits follow the container's GPUs in ascending host order (0 = host GPU 1)
    assert env.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"
    assert env.envs["CUDA_DEVICE_MEMORY_LIMIT_1"] == "4096m"
    assert env.envs["CUDA_DEVICE_SM_LIMIT"] == "20"
    assert isolation_env(Backend.NONE, mem={0: 1}, core={}, pod_uid="u",
                         config=IsolationConfig()).envs == {}


def test_fake_gpu_spec():
    assert parse_fake_gpus("Tesla-T4:15,A100-SXM4-80GB:80") == [("Tesla-T4", 15),
                                                              ("A100-SXM4-80GB", 80)]
    assert parse_fake_gpus("3") == [("Tesla-T4", 15)] * 3
    for bad in ("", "T4", "T4:0", "T4:x", "0"):
        with pytest.raises(ValidationError, match="--fake-gpus"):
            parse_fake_gpus(bad)


@pytest.mark.parametrize("args, field", [
    (["agent", "--node-name", "", "--nvml", "fake"], "--node-name"),
    (["agent", "--node-name", "n", "--nvml", "fake", "--fake-gpus", "T4:zero"], "--fake-gpus"),
    (["agent", "--node-name", "n", "--nvml", "fake", "--metrics-listen", "nowhere"],
     "--metrics-listen"),
    (["agent", "--node-name", "n", "--nvml", "fake", "--metrics-listen", "",
      "--kubeconfig", "/nonexistent/kubeconfig"], "--kubeconfig"),
])
def test_cli_bad_arguments_get_a_clear_error(args, field):
    r = subprocess.run([sys.executable, "-m", "sharegpu.cli", *args], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    assert field in r.stderr and "Traceback" not in r.stderr
