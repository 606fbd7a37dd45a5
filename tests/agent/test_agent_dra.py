"""The agent's DRA kubelet plugin over real gRPC on unix sockets, driven by a test kubelet that
registers it as the kubelet's plugin watcher does and prepares claims as its DRA manager does:
each claim's CDI devices carry its own GPU and limits (50 prepares at once, 0 mismatches), an
agent restart in the middle loses nothing, malformed claims get a refusal naming the field and
the rule and disturb nothing else, and isolation fails closed as in device-plugin mode."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import stat

import grpc
import pytest
from agent_helpers import (  # noqa: F401
    MPS_STANDIN,
    NODE,
    Harness,
    mps_daemon,
    short_dir,
    standin_library,
)
from agent_kubelet import wait_until
from dra_kubelet import TestDraKubelet, cdi_registry, container_view

from sharegpu.agent.cdi import spec_path
from sharegpu.agent.draclaim import parse_claim
from sharegpu.agent.draplugin import CHECKPOINT_FILE, DraConfig, DraPlugin
from sharegpu.agent.isolation import HAMI_CONTAINER_LIBRARY, PRELOAD_LIST, IsolationConfig
from sharegpu.core.errors import ValidationError
from sharegpu.dra import driver as dra

GPUS = (("Tesla-T4", 15), ("Tesla-V100-SXM2-32GB", 32), ("A100-SXM4-40GB", 40),
        ("H100-80GB", 80))
DRIVER = dra.DRIVER


def result(device: str = "gpu-0", mem: str | None = "4Gi", cores: str | None = None, *,
           request: str = "gpu", driver: str = DRIVER, pool: str = NODE,
           share: str | None = "auto") -> dict:
    r: dict = {"request": request, "driver": driver, "pool": pool, "device": device}
    cap = {}
    if mem is not None:
        cap[dra.CAPACITY_MEMORY] = mem
    if cores is not None:
        cap[dra.CAPACITY_CORES] = cores
    if cap:
        r["consumedCapacity"] = cap
    if share == "auto" and cap:
        share = f"share-{device}-{mem}"
    if share and share != "auto":
        r["shareID"] = share
    return r


def claim(name: str, results: list[dict] | None, *, uid: str | None = None,
          ns: str = "default") -> dict:
    status: dict = {}
    if results is not None:
        status["allocation"] = {"devices": {"results": results}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": ns, "uid": uid or f"uid-{name}"},
            "spec": {"devices": {"requests": spec_requests(results)}}, "status": status}


def spec_requests(results: list[dict] | None) -> list[dict]:
    """The claim's requests as kube-scheduler allocated ``results`` from: each asks for the
    capacity its results consumed (so a result's ``cores`` is one its request asked for)."""
    out: dict[str, dict] = {}
    for r in results or []:
        if not isinstance(r, dict) or not isinstance(r.get("request"), str):
            continue
        req = out.setdefault(r["request"], {"name": r["request"], "exactly": {
            "deviceClassName": DRIVER}})
        if isinstance(r.get("consumedCapacity"), dict):
            req["exactly"]["capacity"] = {"requests": dict(r["consumedCapacity"])}
    return list(out.values()) or [{"name": "gpu"}]


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def ref(c: dict) -> tuple[str, str, str]:
    m = c["metadata"]
    return (m["namespace"], m["name"], m["uid"])


class Dra:
    """An agent (with its device plugins and their test kubelet), its DRA plugin and a test
    DRA kubelet, all on sockets under one short directory."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        d = h.dir
        self.config = DraConfig(registry_dir=f"{d}/registry", plugin_dir=f"{d}/plugins/{DRIVER}",
                                cdi_dir=f"{d}/cdi")
        self.kubelet = TestDraKubelet(self.config.registry_dir)
        self.plugin: DraPlugin | None = None

    @property
    def kube(self):  # type: ignore[no-untyped-def]
        return self.h.kube

    @property
    def checkpoint(self) -> dict:
        with open(os.path.join(self.h.dir, "state", CHECKPOINT_FILE)) as f:
            return json.load(f)["claims"]

    def uuid(self, gpu: int) -> str:
        return self.h.nvml.gpus()[gpu].uuid

    async def start(self) -> None:
        await self.h.start()
        await self.start_plugin()

    async def start_plugin(self) -> None:
        assert self.h.agent is not None
        self.plugin = DraPlugin(self.h.agent.dra_node, self.config)
        await self.plugin.start()
        regs = await self.kubelet.discover()
        assert [r.name for r in regs] == [DRIVER]

    async def restart(self) -> None:
        """The agent (and with it the plugin) stops and starts again."""
        assert self.plugin is not None
        await self.plugin.stop()
        await self.h.restart_agent()
        await self.start_plugin()

    async def prepare(self, *claims: dict) -> dict:
        return await self.kubelet.prepare(DRIVER, [ref(c) for c in claims])

    async def unprepare(self, *claims: dict) -> dict:
        return await self.kubelet.unprepare(DRIVER, [ref(c) for c in claims])

    def view(self, ids):  # type: ignore[no-untyped-def]
        return container_view(cdi_registry(self.config.cdi_dir), ids)

    async def close(self) -> None:
        await self.kubelet.close()
        if self.plugin is not None:
            await self.plugin.stop()
        await self.h.close()


@pytest.fixture
async def make_dra(short_dir):
    made: list[Dra] = []

    async def make(mode: str = "cgpu", gpus=GPUS, **cfg) -> Dra:  # type: ignore[no-untyped-def]
        x = Dra(Harness(short_dir, list(gpus), mode, **cfg))
        made.append(x)
        await x.start()
        return x

    yield make
    for x in made:
        await x.close()


def mismatches(x: Dra, want: dict[str, tuple[int, int, int | None]], answers: dict) -> list:
    """Claims whose answer or CDI edits are not their own: ``want[uid] = (gpu, GiB, cores)``."""
    bad = []
    registry = cdi_registry(x.config.cdi_dir)
    for uid, (gpu, gib, cores) in want.items():
        a = answers[uid]
        ids = [i for d in a.devices for i in d.cdi_device_ids]
        if a.error or [d.device_name for d in a.devices] != [f"gpu-{gpu}"] \
                or ids != [f"sharegpu.io/gpu={uid}-gpu-{gpu}"]:
            bad.append((uid, "answer", a))
            continue
        env, mounts = container_view(registry, ids)
        ok = (env["NVIDIA_VISIBLE_DEVICES"] == x.uuid(gpu)
              and env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{gib * 1024}m"
              and "CUDA_DEVICE_MEMORY_LIMIT_1" not in env
              and env.get("CUDA_DEVICE_SM_LIMIT") == (str(cores) if cores else None)
              and env["GPU_CORE_UTILIZATION_POLICY"] == ("force" if cores else "disable")
              and env["LD_PRELOAD"] == HAMI_CONTAINER_LIBRARY
              and env["ALIYUN_COM_GPU_MEM_IDX"] == str(gpu)
              and env["ALIYUN_COM_GPU_MEM_CONTAINER"] == str(gib)
              and env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == f"/tmp/sharegpu-vgpu/{uid}.cache"
              and mounts[HAMI_CONTAINER_LIBRARY][0] == standin_library()
              and mounts[PRELOAD_LIST][0] == f"{x.h.dir}/state/ld.so.preload"
              and mounts["/tmp/sharegpu-vgpu"][0] == f"{x.h.dir}/vgpu-cache/{uid}"
              and os.path.isdir(f"{x.h.dir}/vgpu-cache/{uid}"))
        if not ok:
            bad.append((uid, env, mounts))
    return bad


def fifty(seed: int) -> tuple[list[dict], dict[str, tuple[int, int, int | None]]]:
    rng = random.Random(seed)
    claims, want = [], {}
    for i in range(50):
        gpu = rng.randrange(len(GPUS))
        gib = rng.randint(1, GPUS[gpu][1])
        cores = rng.choice([None, None, rng.randint(5, 95)])
        c = claim(f"c{i:02d}", [result(f"gpu-{gpu}", f"{gib}Gi",
                                       None if cores is None else str(cores))],
                  uid=f"0000{i:04d}-aaaa-4bbb-8ccc-{seed:012d}")
        claims.append(c)
        want[c["metadata"]["uid"]] = (gpu, gib, cores)
    return claims, want


# --------------------------------------------------------------------------- registration

async def test_registers_as_the_kubelet_plugin_watcher_expects(make_dra):
    x = await make_dra()
    reg = x.kubelet.plugins[DRIVER]
    assert reg.service == "v1.DRAPlugin" and reg.versions == ["v1.DRAPlugin"]
    assert reg.endpoint == x.config.endpoint and os.path.isabs(reg.endpoint)
    assert os.path.exists(x.config.registration_socket)
    assert x.plugin.registered is True and x.plugin.registration_error == ""
    # the kubelet refusing it is heard too
    async with grpc.aio.insecure_channel(f"unix://{x.config.registration_socket}") as ch:
        from sharegpu.agent.proto import pluginregistration_v1_pb2 as reg_pb
        from sharegpu.agent.proto import pluginregistration_v1_pb2_grpc as reg_grpc
        await reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
            reg_pb.RegistrationStatus(plugin_registered=False, error="endpoint taken"))
    assert x.plugin.registered is False and x.plugin.registration_error == "endpoint taken"
    await x.plugin.stop()
    assert not os.path.exists(x.config.registration_socket)
    assert not os.path.exists(x.config.endpoint)
    x.plugin = None


# --------------------------------------------------------------------------- prepare

async def test_fifty_prepares_at_once_each_get_their_own_gpu_and_limits(make_dra):
    x = await make_dra()
    claims, want = fifty(1)
    for c in claims:
        x.kube.add_claim(c)
    x.kube.claim_latency_s = 0.01
    # one call per pod, all at once, as the kubelet's workers do
    answers: dict = {}
    for part in await asyncio.gather(*(x.prepare(c) for c in claims)):
        answers.update(part)
    assert len(answers) == 50
    assert mismatches(x, want, answers) == []
    assert len(os.listdir(x.config.cdi_dir)) == 50 and len(x.checkpoint) == 50
    assert sum(1 for v in want.values() if v[2]) > 5  # some capped, some not
    assert len({g for g, _, _ in want.values()}) == len(GPUS)
    # shareID and request travel to the kubelet
    a = answers[claims[0]["metadata"]["uid"]]
    assert a.devices[0].request_names == ["gpu"] and a.devices[0].pool_name == NODE
    assert a.devices[0].share_id.startswith("share-gpu-")

    # unprepare (also all at once) removes every spec, record and cache directory
    gone: dict = {}
    for part in await asyncio.gather(*(x.unprepare(c) for c in claims)):
        gone.update(part)
    assert sorted(gone) == sorted(want) and not any(v.error for v in gone.values())
    assert os.listdir(x.config.cdi_dir) == [] and x.checkpoint == {}
    assert os.listdir(f"{x.h.dir}/vgpu-cache") == []
    # unprepare again, and of a claim never seen: success
    again = await x.unprepare(claims[0], claim("never", []))
    assert [v.error for v in again.values()] == ["", ""]


async def test_a_claims_writable_directories_are_open_to_any_container_user(make_dra):
    """A container that does not run as root writes HAMi-core's shared cache into the claim's
    own directory and its locks into the node's lock directory: the plugin makes the first
    0777 (whatever the umask) and keeps the second 1777, as /tmp; unprepare removes only the
    claim's own."""
    x = await make_dra()
    lock = f"{x.h.dir}/vgpulock"
    os.makedirs(lock, exist_ok=True)
    os.chmod(lock, 0o755)  # as a runtime makes a missing mount source: root's, closed to others
    c = claim("c0", [result("gpu-0", "2Gi")], uid="0000aaaa-aaaa-4bbb-8ccc-000000000001")
    uid = c["metadata"]["uid"]
    x.kube.add_claim(c)
    old = os.umask(0o077)
    try:
        answers = await x.prepare(c)
    finally:
        os.umask(old)
    assert not answers[uid].error
    _, mounts = x.view([f"sharegpu.io/gpu={uid}-gpu-0"])
    own = f"{x.h.dir}/vgpu-cache/{uid}"
    gpu_lock = f"{lock}/gpu-0"  # shared only by the containers on GPU 0
    assert mounts["/tmp/sharegpu-vgpu"][0] == own and mounts["/tmp/vgpulock"][0] == gpu_lock
    assert stat.S_IMODE(os.stat(own).st_mode) == 0o777
    assert stat.S_IMODE(os.stat(gpu_lock).st_mode) == 0o1777
    await x.unprepare(c)
    assert not os.path.exists(own) and stat.S_IMODE(os.stat(gpu_lock).st_mode) == 0o1777


async def test_agent_restart_in_the_middle_loses_nothing(make_dra):
    x = await make_dra()
    claims, want = fifty(2)
    for c in claims:
        x.kube.add_claim(c)
    # API round trips of 0 to 0.8 s, so that the restart finds prepares in every stage
    read = x.kube.get_resource_claim
    delay = {c["metadata"]["name"]: 0.02 * (i % 40) for i, c in enumerate(claims)}

    async def slow_read(namespace: str, name: str) -> dict:
        await asyncio.sleep(delay[name])
        return await read(namespace, name)

    x.kube.get_resource_claim = slow_read
    answers: dict = {}
    cut: list[str] = []

    async def kubelet_prepare(c: dict) -> None:
        """The kubelet's retry: a call that fails (the plugin went away) is made again."""
        while True:
            try:
                answers.update(await x.prepare(c))
                return
            except grpc.aio.AioRpcError:
                cut.append(c["metadata"]["uid"])
                await asyncio.sleep(0.05)

    calls = [asyncio.create_task(kubelet_prepare(c)) for c in claims[:40]]
    await wait_until(lambda: x.plugin.prepared >= 10, timeout=10)
    before = {u: [list(d.cdi_device_ids) for d in a.devices] for u, a in dict(answers).items()}
    await x.restart()  # calls in flight are cut; the kubelet calls again
    assert x.plugin.checkpoint.loaded and len(x.plugin.checkpoint.claims) >= len(before)
    calls += [asyncio.create_task(kubelet_prepare(c)) for c in claims[40:]]
    await asyncio.wait_for(asyncio.gather(*calls), 30)
    assert len(answers) == 50
    assert len(set(cut)) >= 10, cut  # calls were in flight when the agent stopped
    print(f"restart: {len(before)} answered before, {len(set(cut))} cut and retried")
    assert mismatches(x, {u: want[u] for u in answers}, answers) == []
    assert {u: [list(d.cdi_device_ids) for d in answers[u].devices] for u in before} == before
    # nothing half-done is left: one spec and one record per claim
    assert len(os.listdir(x.config.cdi_dir)) == 50 and len(x.checkpoint) == 50

    # another restart, with the API unreachable: every claim is answered from the checkpoint,
    # with the same devices, without reading the API
    await x.restart()
    x.kube.claims.clear()
    reads = x.kube.claim_reads
    again = await x.kubelet.prepare(DRIVER, [ref(c) for c in claims])
    assert x.kube.claim_reads == reads
    assert {u: list(a.devices) for u, a in again.items()} == \
        {u: list(a.devices) for u, a in answers.items()}
    assert mismatches(x, want, again) == []

    gone = await x.kubelet.unprepare(DRIVER, [ref(c) for c in claims])
    assert not any(v.error for v in gone.values())
    assert os.listdir(x.config.cdi_dir) == [] and x.checkpoint == {}


async def test_restart_removes_specs_no_answer_was_given_for_and_keeps_the_others(make_dra):
    x = await make_dra()
    c = claim("kept", [result("gpu-1", "2Gi")])
    x.kube.add_claim(c)
    assert not (await x.prepare(c))["uid-kept"].error
    # a spec written by a prepare that never answered (stopped between spec and checkpoint)
    orphan = spec_path(x.config.cdi_dir, "uid-orphan")
    shutil.copy(spec_path(x.config.cdi_dir, "uid-kept"), orphan)
    await x.restart()
    assert not os.path.exists(orphan)
    assert os.path.exists(spec_path(x.config.cdi_dir, "uid-kept"))
    # an unreadable checkpoint: set aside, no spec removed (running containers need them),
    # claims prepared again from the API with the same devices
    with open(os.path.join(x.h.dir, "state", CHECKPOINT_FILE), "w") as f:
        f.write("{not json")
    shutil.copy(spec_path(x.config.cdi_dir, "uid-kept"), orphan)
    await x.restart()
    assert os.path.exists(orphan) and not x.plugin.checkpoint.loaded
    a = (await x.prepare(c))["uid-kept"]
    assert list(a.devices[0].cdi_device_ids) == ["sharegpu.io/gpu=uid-kept-gpu-1"]
    assert x.kube.claim_reads == 2


async def test_one_request_over_two_gpus_and_a_whole_gpu(make_dra):
    x = await make_dra()
    two = claim("two", [result("gpu-3", "8Gi", "40", share="s1"),
                        result("gpu-1", "4Gi", "40", share="s2"),
                        result("gpu-2", None, request="other", driver="other.example.com")])
    whole = claim("whole", [result("gpu-0", None, request="card")])
    x.kube.add_claim(two)
    x.kube.add_claim(whole)
    answers = await x.prepare(two, whole)
    a = answers["uid-two"]
    assert not a.error and [d.device_name for d in a.devices] == ["gpu-3", "gpu-1"]
    assert [d.share_id for d in a.devices] == ["s1", "s2"]
    # each device carries the request's complete edits: its GPUs in index order
    for d in a.devices:
        env, _ = x.view(d.cdi_device_ids)
        assert env["NVIDIA_VISIBLE_DEVICES"] == f"{x.uuid(1)},{x.uuid(3)}"
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
        assert env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "8192m"
        assert env["CUDA_DEVICE_SM_LIMIT"] == "40"
    env, mounts = x.view(answers["uid-whole"].devices[0].cdi_device_ids)
    assert env == {"NVIDIA_VISIBLE_DEVICES": x.uuid(0)} and mounts == {}


async def test_mps_claims_get_the_pipe_and_client_limits(make_dra, mps_daemon):
    x = await make_dra(mode="mps", mps_control=(MPS_STANDIN,))
    c = claim("m", [result("gpu-2", "6Gi", "30")])
    x.kube.add_claim(c)
    a = (await x.prepare(c))["uid-m"]
    assert not a.error, a.error
    env, mounts = x.view(a.devices[0].cdi_device_ids)
    assert env["NVIDIA_VISIBLE_DEVICES"] == x.uuid(2)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert mounts["/tmp/nvidia-mps"][0] == mps_daemon
    assert mounts["/dev/shm"][0] == f"{x.h.dir}/mps-shm"
    assert "LD_PRELOAD" not in env


# --------------------------------------------------------------------------- refusals

BAD = {
    "unallocated": (None, "status.allocation=None: must be set: the claim is not allocated"),
    "otherdriver": ([result(driver="gpu.nvidia.com")],
                    "status.allocation.devices.results[].driver=['gpu.nvidia.com']: no result "
                    "names the driver gpu.sharegpu.io"),
    "offstep": ([result(mem="1536Mi")],
                "status.allocation.devices.results[0].consumedCapacity.memory='1536Mi': must be "
                "a whole number of GiB, more than 0 (the driver's memory is consumed in steps "
                "of 1Gi)"),
    "unknowndevice": ([result(driver="x.example.com"), result("gpu-9")],
                      "status.allocation.devices.results[1].device='gpu-9': must name a GPU of "
                      f"node {NODE} (gpu-0 to gpu-3)"),
    "otherpool": ([result(pool="gpu-node-2")],
                  "status.allocation.devices.results[0].pool='gpu-node-2': must be this node's "
                  f"pool '{NODE}'"),
    "toomuch": ([result("gpu-0", "16Gi")],
                "results[0].consumedCapacity.memory='16Gi': must be at most the GPU's 15Gi"),
    "cores": ([result(cores="150")],
              "results[0].consumedCapacity.cores='150': must be a whole percent of the GPU, 1 "
              "to 100"),
    "nomemory": ([{**result(), "consumedCapacity": {"cores": "10"}}],
                 "results[0].consumedCapacity.memory=None: must be set on a shared GPU"),
    "twice": ([result("gpu-1", "1Gi", share="a"), result("gpu-1", "2Gi", share="b")],
              "results[1].device='gpu-1': must appear once per claim (results[0] names it too)"),
}


async def test_malformed_claims_are_refused_by_field_and_rule_and_disturb_nothing(make_dra):
    x = await make_dra()
    first = claim("first", [result("gpu-1", "3Gi")])
    x.kube.add_claim(first)
    assert not (await x.prepare(first))["uid-first"].error
    spec_before = read(spec_path(x.config.cdi_dir, "uid-first"))
    record_before = x.checkpoint["uid-first"]

    good = claim("good", [result("gpu-2", "5Gi", "20")])
    bad = [claim(name, results) for name, (results, _) in BAD.items()]
    for c in [good, *bad]:
        x.kube.add_claim(c)
    recreated = claim("recreated", [result()], uid="uid-new")
    x.kube.add_claim(recreated)
    stale = ("default", "recreated", "uid-old")  # the kubelet's claim was deleted and re-made
    missing = ("default", "missing", "uid-missing")
    evil = ("default", "evil", "../../etc/passwd")
    answers = await x.kubelet.prepare(DRIVER, [ref(good), *map(ref, bad), stale, missing, evil])

    assert not answers["uid-good"].error
    assert mismatches(x, {"uid-good": (2, 5, 20)}, answers) == []
    for name, (_, rule) in BAD.items():
        err = answers[f"uid-{name}"].error
        assert err.startswith(f"{DRIVER}: claim default/{name} (uid-{name}) not prepared: "), err
        assert rule in err, (name, err)
        assert not answers[f"uid-{name}"].devices
    assert ("metadata.uid='uid-new': must be the claim the kubelet prepares (uid-old)"
            in answers["uid-old"].error)
    assert ('reading ResourceClaim default/missing failed: resourceclaims.resource.k8s.io '
            '"missing" not found' in answers["uid-missing"].error)
    assert "claim.uid='../../etc/passwd': must be a Kubernetes UID" in answers[
        "../../etc/passwd"].error
    # nothing of the refused claims was written; the earlier claim is as it was
    assert sorted(os.listdir(x.config.cdi_dir)) == sorted(
        os.path.basename(spec_path(x.config.cdi_dir, u)) for u in ("uid-first", "uid-good"))
    assert sorted(x.checkpoint) == ["uid-first", "uid-good"]
    assert sorted(os.listdir(f"{x.h.dir}/vgpu-cache")) == ["uid-first", "uid-good"]
    assert read(spec_path(x.config.cdi_dir, "uid-first")) == spec_before
    assert x.checkpoint["uid-first"] == record_before
    # a refused claim fixed by the scheduler is prepared on the next call
    x.kube.add_claim(claim("offstep", [result(mem="2Gi")]))
    assert not (await x.kubelet.prepare(DRIVER, [ref(bad[2])]))["uid-offstep"].error


@pytest.mark.parametrize("name", sorted(BAD))
def test_claim_rules(name):
    results, rule = BAD[name]
    with pytest.raises(ValidationError) as e:
        parse_claim(claim(name, results), uid=f"uid-{name}", node=NODE,
                    gpu_mem=[g for _, g in GPUS])
    assert rule in str(e.value)


def test_cores_are_a_limit_only_where_the_request_asked_for_them():
    """kube-scheduler consumes the request policy's default (5 %) of ``cores`` for a claim that
    does not ask (found on the real scheduler, tests/e2e/test_dra_prepare_real.py): that is
    accounting, not a compute limit; cores the request names are its limit."""
    mem = [g for _, g in GPUS]
    consumed = [result("gpu-0", "2Gi", "5", request="gpu")]
    unasked = claim("unasked", consumed, uid="uid-u")
    unasked["spec"]["devices"]["requests"] = [{"name": "gpu", "exactly": {
        "deviceClassName": DRIVER, "capacity": {"requests": {"memory": "2Gi"}}}}]
    assert parse_claim(unasked, uid="uid-u", node=NODE, gpu_mem=mem).devices[0].core is None
    plain = claim("plain", consumed, uid="uid-p")  # no capacity at all: 1Gi / 5 % by default
    plain["spec"]["devices"]["requests"] = [{"name": "gpu", "exactly": {
        "deviceClassName": DRIVER}}]
    assert parse_claim(plain, uid="uid-p", node=NODE, gpu_mem=mem).devices[0].core is None
    asked = claim("asked", consumed, uid="uid-a")
    assert parse_claim(asked, uid="uid-a", node=NODE, gpu_mem=mem).devices[0].core == 5
    sub = claim("sub", [result("gpu-1", "4Gi", "30", request="gpu/big")], uid="uid-s")
    sub["spec"]["devices"]["requests"] = [{"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": DRIVER,
         "capacity": {"requests": {"memory": "4Gi", "cores": "30"}}}]}]
    assert parse_claim(sub, uid="uid-s", node=NODE, gpu_mem=mem).devices[0].core == 30


async def test_isolation_unavailable_refuses_and_writes_nothing(make_dra, short_dir):
    lib = f"{short_dir}/hami/libvgpu.so"
    x = await make_dra(isolation_paths=IsolationConfig(
        hami_library=lib, hami_cache_dir=f"{short_dir}/vgpu-cache",
        hami_lock_dir=f"{short_dir}/vgpulock", mps_pipe_dir=f"{short_dir}/mps"))
    shared = claim("shared", [result("gpu-1", "4Gi")])
    whole = claim("whole", [result("gpu-0", None)])
    x.kube.add_claim(shared)
    x.kube.add_claim(whole)
    refusals = x.h.agent.isolation_refusals
    answers = await x.prepare(shared, whole)
    assert answers["uid-shared"].error == (
        f"{DRIVER}: claim default/shared (uid-shared) not prepared: node {NODE}: isolation "
        f"back-end hami is not usable: the HAMi-core library {lib} does not exist; fix: "
        "install HAMi-core: keep the chart's agent.hami.install=true (an init container copies "
        "libvgpu.so from HAMi's image), or point agent.hamiLibrary at a libvgpu.so installed on "
        "the node; pods that may run without isolation can opt out with CGPU_DISABLE=true or "
        "the node label cgpu.disable.isolation=true")
    assert x.h.agent.isolation_refusals == refusals + 1
    # a whole GPU needs no isolation (as in device-plugin mode); nothing of the shared claim
    assert not answers["uid-whole"].error
    assert os.listdir(x.config.cdi_dir) == [os.path.basename(spec_path("", "uid-whole"))]
    assert list(x.checkpoint) == ["uid-whole"]
    assert not os.path.exists(f"{short_dir}/vgpu-cache/uid-shared")
    # the library arrives: the next prepare (the kubelet retries) checks again and succeeds
    os.makedirs(os.path.dirname(lib))
    shutil.copy(standin_library(), lib)
    await asyncio.sleep(1.1)  # a refused back-end is checked again at most once a second
    a = (await x.prepare(shared))["uid-shared"]
    assert not a.error, a.error
    env, mounts = x.view(a.devices[0].cdi_device_ids)
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m" and mounts[HAMI_CONTAINER_LIBRARY][0] == lib


async def test_node_opt_out_gives_only_the_gpu(make_dra):
    x = await make_dra()
    x.kube.set_node_labels(NODE, {"cgpu.disable.isolation": "true"})
    await wait_until(lambda: x.h.agent.labels.get("cgpu.disable.isolation") == "true")
    c = claim("optout", [result("gpu-3", "10Gi")])
    x.kube.add_claim(c)
    a = (await x.prepare(c))["uid-optout"]
    env, mounts = x.view(a.devices[0].cdi_device_ids)
    assert env["NVIDIA_VISIBLE_DEVICES"] == x.uuid(3) and "LD_PRELOAD" not in env
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in env and mounts == {}


# --------------------------------------------------------------------------- the API path

async def test_claims_read_from_the_api_server_through_lightkube(fake_api, short_dir):
    """The production path: lightkube reads resource.k8s.io/v1 resourceclaims from the (fake)
    API server, consumedCapacity and shareID included."""
    from sharegpu.agent.lightkube_api import LightkubeApi, make_client

    client = make_client(str(fake_api.kubeconfig_path))
    try:
        api = LightkubeApi(client)
        c = claim("api", [result("gpu-2", "7Gi", "25", share="abc")], ns="team-a")
        fake_api.create(c)
        got = await api.get_resource_claim("team-a", "api")
        assert got["status"]["allocation"]["devices"]["results"][0] == {
            "request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-2",
            "consumedCapacity": {"memory": "7Gi", "cores": "25"}, "shareID": "abc"}
        parsed = parse_claim(got, uid="uid-api", node=NODE, gpu_mem=[15, 32, 40, 80])
        assert [(d.gpu, d.mem_gib, d.core, d.share_id) for d in parsed.devices] == [
            (2, 7, 25, "abc")]
        with pytest.raises(Exception, match="not found"):
            await api.get_resource_claim("team-a", "nope")
    finally:
        await client.close()
