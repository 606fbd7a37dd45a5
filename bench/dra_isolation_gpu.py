"""DRA mode's isolation on a real GPU: claims prepared by the agent's kubelet DRA plugin, their
CDI specs applied to processes as a container runtime would, and the limits measured
(bench/README.md, "DRA claims on a real GPU").

Run on a GPU node (no Kubernetes needed) with the HAMi-core library to measure:

    python bench/dra_isolation_gpu.py --hami-library /usr/local/vgpu/libvgpu.so \\
        --hami-commit COMMIT --json out.json

What runs is the agent's own code on the node's real GPUs: :class:`sharegpu.agent.service.Agent`
with NVML (``nvidia-ml-py``), the node labelled ``cgpu`` (HAMi-core), and its
:class:`~sharegpu.agent.draplugin.DraPlugin` on unix sockets. A test kubelet (the one the
suite uses, ``tests/agent/dra_kubelet.py``) registers the plugin and calls
``NodePrepareResources`` over gRPC for claims allocated as kube-scheduler allocates them: two
claims sharing one GPU, A with ``memory: 4Gi, cores: 30`` and B with ``memory: 8Gi`` (their
``consumedCapacity`` and ``shareID``), held in memory where the plugin reads claims. Each
claim's CDI devices are resolved against the spec files the plugin wrote, as a runtime resolves
CDI IDs; their ``containerEdits`` (variables and mounts) become the environment of a process on
the host, container paths replaced by the mounts' host paths, and ``NVIDIA_VISIBLE_DEVICES``
(the NVIDIA runtime's variable) given to CUDA as ``CUDA_VISIBLE_DEVICES``, as
``sharegpu isolation-check`` does for Allocate's answer. Then, per claim:

- the probes of ``sharegpu isolation-check``: the memory it sees, the largest allocation it
  reaches, an allocation past the limit fails, and it computes again afterwards;
- both claims' processes at once, each holding its largest allocation: each within its own
  limit, and the GPU's used memory (NVML) grew by about their sum;
- PyTorch in claim A's environment (hami; ``--no-torch`` leaves it out):
  ``torch.cuda.mem_get_info()``, the point of ``torch.OutOfMemoryError``, computing again
  after freeing;
- ``NodeUnprepareResources``: the specs and the claims' cache directories are gone.

``--backend mps`` does the same on an ``mps`` node, with a control daemon this script starts on
a pipe directory of its own; ``--backend hami-mps`` on a ``core_mem`` node whose agent gives
``core_mem`` hami-mps (HAMi-core's memory limit and MPS's compute share), with such a daemon.
Exit code 0 when every check held, 1 otherwise.
``tests/isolation/test_dra_isolation_bench.py`` runs this script in CI against the fake NVML,
the fake CUDA driver and the stand-in interposer, so what runs on the GPU is what CI runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "agent"))
sys.path.insert(0, str(ROOT / "bench"))

from agent_kubelet import TestKubelet  # noqa: E402
from dra_kubelet import TestDraKubelet, cdi_registry, container_view  # noqa: E402

from isolation_gpu import mps_daemon, nvml_process_mib, torch_checks, torch_run  # noqa: E402
from sharegpu.agent.builder import build_agent  # noqa: E402
from sharegpu.agent.config import AgentConfig  # noqa: E402
from sharegpu.agent.draplugin import DraConfig, DraPlugin  # noqa: E402
from sharegpu.agent.isolation import (  # noqa: E402
    HAMI_CONTAINER_LIBRARY,
    Backend,
    IsolationConfig,
    Mount,
)
from sharegpu.agent.kube import MemoryKube  # noqa: E402
from sharegpu.agent.nvml import RealNvml  # noqa: E402
from sharegpu.agent.service import Agent  # noqa: E402
from sharegpu.core import names  # noqa: E402
from sharegpu.dra import driver as dra  # noqa: E402
from sharegpu.isolation_check.check import (  # noqa: E402
    Check,
    DeviceMemory,
    Request,
    Runner,
    clean_env,
    decide_fill_within,
    held_usage,
    mem_checks,
    mem_tolerance_mib,
    overall_ok,
    process_env,
)

NODE = "gpu-node"
NS = "bench"


@dataclass(frozen=True)
class ClaimPlan:
    name: str
    mem_gib: int
    cores: int | None

    def obj(self, gpu: int) -> dict[str, Any]:
        """The claim as kube-scheduler leaves it: its request and its allocation on
        ``gpu-<gpu>`` of this node's pool."""
        cap = {dra.CAPACITY_MEMORY: f"{self.mem_gib}Gi"}
        if self.cores:
            cap[dra.CAPACITY_CORES] = str(self.cores)
        return {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": self.name, "namespace": NS, "uid": str(uuid.uuid4())},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": dra.DRIVER, "capacity": {"requests": dict(cap)}}}]}},
            "status": {"allocation": {"devices": {"results": [{
                "request": "gpu", "driver": dra.DRIVER, "pool": NODE, "device": f"gpu-{gpu}",
                "consumedCapacity": dict(cap), "shareID": f"share-{self.name}"}]}}},
        }


PLANS = (ClaimPlan("claim-a", 4, 30), ClaimPlan("claim-b", 8, None))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def check(key: str, name: str, asked: Any, measured: Any, ok: bool | None,
          unit: str = "", tolerance: str = "") -> Check:
    return Check(key, name, asked, measured, tolerance, ok, unit)


@dataclass
class Running:
    """What :func:`prepare` started: the device plugins' test kubelet, the agent, its DRA
    plugin and the test DRA kubelet; the claims it prepared."""

    dp: TestKubelet
    agent: Agent
    plugin: DraPlugin
    kubelet: TestDraKubelet
    refs: list[tuple[str, str, str]] = field(default_factory=list)

    async def close(self) -> None:
        await self.kubelet.close()
        await self.plugin.stop()
        await self.agent.stop()
        await self.dp.stop()


async def prepare(args: argparse.Namespace, root: str) -> tuple[dict[str, Any], Running]:
    """The agent and its DRA plugin on this node's GPUs; the claims prepared through the test
    kubelet; what each container would get."""
    kube = MemoryKube()
    mode = {"hami": "cgpu", "mps": "mps", "hami-mps": "core_mem"}[args.backend]
    kube.add_node(NODE, {names.LABEL_SCHEDULE: mode})
    claims = [p.obj(args.gpu) for p in PLANS]
    for c in claims:
        kube.claims[(NS, c["metadata"]["name"])] = c
    nvml = RealNvml()
    gpu = nvml.gpus()[args.gpu]
    dp = TestKubelet(f"{root}/dp")
    await dp.start()
    agent = build_agent(AgentConfig(
        node_name=NODE, device_plugin_dir=f"{root}/dp", state_dir=f"{root}/state",
        mps_control=(args.mps_control,), core_mem_isolation=Backend.HAMI_MPS,
        isolation_paths=IsolationConfig(hami_library=args.hami_library,
                                        hami_cache_dir=f"{root}/vgpu-cache",
                                        hami_lock_dir=f"{root}/vgpulock",
                                        # outside a container the host's /dev/shm is the one
                                        # the daemon and the clients share
                                        mps_pipe_dir=args.mps_pipe_dir or "/run/nvidia/mps",
                                        mps_shm_dir="/dev/shm")), nvml, kube)
    await agent.start()
    cfg = DraConfig(registry_dir=f"{root}/registry", plugin_dir=f"{root}/plugins/{dra.DRIVER}",
                    cdi_dir=f"{root}/cdi")
    run = Running(dp, agent, DraPlugin(agent.dra_node, cfg), TestDraKubelet(cfg.registry_dir))
    try:
        await run.plugin.start()
        regs = await run.kubelet.discover()
        run.refs = [(NS, c["metadata"]["name"], c["metadata"]["uid"]) for c in claims]
        answers = await run.kubelet.prepare(dra.DRIVER, run.refs)
        registry = cdi_registry(cfg.cdi_dir)
        out: dict[str, Any] = {"gpu": {"index": gpu.index, "name": gpu.name, "uuid": gpu.uuid,
                                       "nvml_mib": gpu.mem_mib, "advertised_gib": gpu.mem_gib},
                               "registered": [r.name for r in regs], "claims": {}}
        for plan, c in zip(PLANS, claims, strict=True):
            a = answers[c["metadata"]["uid"]]
            ids = [i for d in a.devices for i in d.cdi_device_ids]
            env, mounts = container_view(registry, ids) if not a.error else ({}, {})
            out["claims"][plan.name] = {"error": a.error, "cdi_ids": ids, "env": env,
                                        "mounts": {k: v[0] for k, v in mounts.items()}}
        out["root"] = root
        out["by_uuid"] = {g.uuid: g.index for g in nvml.gpus()}
        out["cdi_dir"] = cfg.cdi_dir
        out["cache_dir"] = f"{root}/vgpu-cache"
        out["specs_before_unprepare"] = sorted(os.listdir(cfg.cdi_dir))
        return out, run
    except BaseException:
        await run.close()
        raise


def claim_env(view: dict[str, Any], base: dict[str, str], root: str,
              by_uuid: dict[str, int]) -> dict[str, str]:
    """A container's CDI edits as a host process's environment, as ``sharegpu
    isolation-check`` turns Allocate's answer into one (the mounted folders under ``root`` that
    the agent leaves to the runtime, such as HAMi-core's lock folder, made)."""
    # the NVIDIA runtime shows the container the GPUs NVIDIA_VISIBLE_DEVICES names; on the host
    # CUDA is shown the same GPUs by their indexes
    visible = ",".join(str(by_uuid[u]) for u in view["env"]["NVIDIA_VISIBLE_DEVICES"].split(","))
    mounts = [Mount(c, h) for c, h in view["mounts"].items()]
    return process_env(view["env"], mounts, base=base, visible=visible, host_root=root + "/")


def edits_checks(plan: ClaimPlan, view: dict[str, Any], gpu: dict[str, Any],
                 args: argparse.Namespace) -> list[Check]:
    """What the claim's CDI edits give the container: its GPU and its limits."""
    env, mounts = view["env"], view["mounts"]
    want_cores = str(plan.cores) if plan.cores else None
    out = [
        check(f"{plan.name}.answer", "prepared", "no error", view["error"] or "no error",
              not view["error"]),
        check(f"{plan.name}.gpu", "GPU in the CDI edits", gpu["uuid"],
              env.get("NVIDIA_VISIBLE_DEVICES"), env.get("NVIDIA_VISIBLE_DEVICES") == gpu["uuid"]),
    ]
    wanted: list[tuple[str, str, str | None]] = []
    if args.backend in ("mps", "hami-mps"):
        limit = f"0={plan.mem_gib * 1024}M"
        pipe = mounts.get(env.get("CUDA_MPS_PIPE_DIRECTORY", ""))
        wanted += [("MPS memory limit", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limit),
                   ("MPS thread percentage", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", want_cores)]
        out.append(check(f"{plan.name}.pipe", "MPS pipe directory mounted", args.mps_pipe_dir,
                         pipe, pipe == args.mps_pipe_dir))
    if args.backend in ("hami", "hami-mps"):
        # hami-mps: compute is MPS's, HAMi-core's own throttle stays off
        sm = want_cores if args.backend == "hami" else None
        wanted += [("memory limit", "CUDA_DEVICE_MEMORY_LIMIT_0", f"{plan.mem_gib * 1024}m"),
                   ("SM limit", "CUDA_DEVICE_SM_LIMIT", sm)]
        lib = mounts.get(HAMI_CONTAINER_LIBRARY)
        out.append(check(f"{plan.name}.library", "library mounted", args.hami_library, lib,
                         lib == args.hami_library))
    for what, var, want in wanted:
        out.append(check(f"{plan.name}.{var}", f"{what} in the CDI edits ({var})", want,
                         env.get(var), env.get(var) == want))
    return out


def measure(args: argparse.Namespace, got: dict[str, Any]) -> list[dict[str, Any]]:
    base = clean_env()
    gpu = got["gpu"]
    runner = Runner("libcuda.so.1", 300)
    device = DeviceMemory(args.gpu)
    rows: list[dict[str, Any]] = []
    envs: dict[str, dict[str, str]] = {}
    try:
        upper = ["--upper-mib", str(gpu["nvml_mib"])]
        for plan in PLANS:
            view = got["claims"][plan.name]
            checks = edits_checks(plan, view, gpu, args)
            if not view["error"]:
                env = envs[plan.name] = claim_env(view, base, got["root"], got["by_uuid"])
                req = Request(backend=args.backend, mem_gib=plan.mem_gib, core=plan.cores,
                              gpu=args.gpu, hami_library=args.hami_library)
                log(f"{plan.name}: memory probes under {plan.mem_gib} GiB ({args.backend})")
                own = None  # hami, hami-mps: what a process sees used is its own
                if args.backend == "hami-mps":
                    runner.run("info", env)  # the first client starts the MPS server
                if args.backend == "mps":
                    # an MPS client sees the device's total: its own memory (its context,
                    # smaller with a smaller share of the SMs) is what the driver counts for
                    # it beyond its largest allocation, as sharegpu isolation-check takes it
                    runner.run("info", env)  # the first client starts the MPS server
                    grew, held = held_usage(runner, env, upper, device, 120)
                    if grew is not None and held.ok:
                        own = grew - held.data["largest_mib"]
                r = runner.run("mem", env, *upper)
                if r.ok:
                    checks += mem_checks(req, r.data, own)
                else:
                    checks.append(check(f"{plan.name}.mem", "memory probe", "runs", r.error,
                                        False))
            rows.append({"name": plan.name, "plan": asdict(plan), "checks": [
                asdict(c) for c in checks], "ok": overall_ok(checks)})
        if len(envs) == len(PLANS):
            log("both claims at once, each holding its largest allocation")
            before = device.used_mib()
            procs = [runner.start("fill", envs[p.name], *upper, "--timeout", "120")
                     for p in PLANS]
            ready = [runner.ready(p, 120) for p in procs]
            during = device.used_mib()
            counted = [nvml_process_mib(p.pid, args.gpu) for p in procs]
            for p in procs:
                runner.finish(p, 30)
            checks = []
            for plan, r, mine in zip(PLANS, ready, counted, strict=True):
                limit = plan.mem_gib * 1024
                if not r.ok:
                    checks.append(check(f"both.{plan.name}", "holds", "ready", r.error, False))
                    continue
                checks.append(decide_fill_within(limit, [r.data["largest_mib"]]))
                checks[-1].key = f"both.{plan.name}.largest"
                checks[-1].name = f"{plan.name}: largest allocation while the other holds its own"
                checks.append(check(f"both.{plan.name}.nvml", f"{plan.name}: driver's count of "
                                    "its process", f"≤ {limit} + its context", mine, None, "MiB"))
            want = sum(p.mem_gib * 1024 for p in PLANS)
            grew = None if before is None or during is None else during - before
            checks.append(check("both.grew", "GPU's used memory grew by (NVML)",
                                f"≈ {want} + two contexts", grew, None, "MiB"))
            rows.append({"name": "both at once", "checks": [asdict(c) for c in checks],
                         "ok": overall_ok(checks)})
        if len(envs) == len(PLANS) and args.backend == "hami" and args.torch:
            plan = PLANS[0]
            log(f"torch in {plan.name}'s environment")
            lim = torch_run(envs[plan.name], args.gpu, 300)
            bare = torch_run({**base, "CUDA_VISIBLE_DEVICES": str(args.gpu)}, args.gpu, 300)
            tc = torch_checks(plan.mem_gib * 1024, lim, bare)
            rows.append({"name": f"torch in {plan.name}", "checks": [asdict(c) for c in tc],
                         "ok": overall_ok(tc), "with_limit": lim, "without": bare,
                         "tolerance_mib": mem_tolerance_mib(plan.mem_gib * 1024)})
    finally:
        runner.close()
        device.close()
    return rows


async def unprepare(got: dict[str, Any], run: Running) -> dict[str, Any]:
    cdi_dir, cache = got["cdi_dir"], got["cache_dir"]
    answers = await run.kubelet.unprepare(dra.DRIVER, run.refs)
    left = sorted(os.listdir(cdi_dir))
    caches = sorted(os.listdir(cache)) if os.path.isdir(cache) else []
    checks = [check("unprepare.errors", "unprepare errors", [], [a.error for a in
                    answers.values() if a.error], not any(a.error for a in answers.values())),
              check("unprepare.specs", "CDI specs left", [], left, not left),
              check("unprepare.caches", "claim cache directories left", [], caches, not caches)]
    return {"name": "unprepare", "checks": [asdict(c) for c in checks],
            "ok": overall_ok(checks)}


def table(doc: dict[str, Any]) -> str:
    out = [f"GPU {doc['gpu']['name']} ({doc['gpu']['nvml_mib']:,} MiB), back-end "
           f"{doc['meta']['backend']}, HAMi-core {doc['meta']['hami_commit']}, "
           f"{doc['meta']['date']}", "",
           "| scenario | check | asked | measured | result |", "|---|---|---|---|---|"]
    for s in doc["scenarios"]:
        for c in s["checks"]:
            res = "info" if c["ok"] is None else "pass" if c["ok"] else "**FAIL**"
            out.append(f"| {s['name']} | {c['name']} | {c['asked']} | {c['measured']} | {res} |")
    return "\n".join(out) + "\n"


async def amain(args: argparse.Namespace) -> int:
    root = tempfile.mkdtemp(prefix="sg-dra-")  # short: unix socket paths
    doc: dict[str, Any] = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                    "backend": args.backend,
                                    "hami_commit": args.hami_commit,
                                    "hami_library": args.hami_library}}
    try:
        got, run = await prepare(args, root)
        try:
            doc["gpu"] = got["gpu"]
            doc["registered"] = got["registered"]
            doc["specs"] = got["specs_before_unprepare"]
            doc["claims"] = got["claims"]
            doc["scenarios"] = await asyncio.to_thread(measure, args, got)
            doc["scenarios"].append(await unprepare(got, run))
        finally:
            await run.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str))
    print(table(doc))
    return 0 if all(s["ok"] for s in doc["scenarios"]) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hami-library", required=True, help="HAMi-core's libvgpu.so")
    p.add_argument("--hami-commit", default="?", help="the HAMi-core commit it was built from")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--backend", choices=("hami", "mps", "hami-mps"), default="hami",
                   help="the node's isolation back-end: cgpu (HAMi-core), mps, or core_mem on "
                        "hami-mps")
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control")
    p.add_argument("--no-torch", dest="torch", action="store_false",
                   help="leave out the PyTorch scenario (a machine without PyTorch)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.hami_library = os.path.abspath(args.hami_library)
    args.mps_pipe_dir = ""
    with contextlib.suppress(KeyboardInterrupt):
        if args.backend == "hami":
            return asyncio.run(amain(args))
        control = shutil.which(args.mps_control)
        if control is None:
            print(f"{args.mps_control} is not on this machine: mps not measured", file=sys.stderr)
            return 2
        with mps_daemon(control) as (pipe, _logs):
            args.mps_pipe_dir = pipe
            return asyncio.run(amain(args))
    return 1


if __name__ == "__main__":
    sys.exit(main())
