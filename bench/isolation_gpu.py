"""Isolation measured on a real GPU: every scenario of ``sharegpu isolation-check`` for the
hami, mps and hami-mps back-ends, and PyTorch under a limit, in one run, as tables
(bench/README.md, "Isolation on a real GPU").

Run on a GPU node (no Kubernetes needed) with the HAMi-core library to measure:

    python bench/isolation_gpu.py --hami-library /usr/local/vgpu/libvgpu.so \\
        --hami-release v2.10.0 --hami-commit COMMIT --json out.json --markdown out.md

Scenarios, each through :func:`sharegpu.isolation_check.check.run_check` (so with the
environment the node agent's Allocate returns):

- hami: 2 GiB (with ``--compare``: launch and allocation rates over the bare GPU); 20 GiB, then
  the GPU filled with as many 20 GiB pods as the scheduler places on it; 2 GiB + 30 % compute
  beside a 70 % pod, measured with the arithmetic kernel and again with the clock kernel. Each
  run includes two processes of one pod sharing the limit, and (with NVML) the driver's count
  of what a pod takes.
- mps, when ``nvidia-cuda-mps-control`` is on the PATH: the same, with a control daemon this
  script starts (and quits) on a pipe directory of its own.
- hami-mps (HAMi-core's memory limit per container, MPS's compute share), with such a daemon
  too: 2 GiB with ``--compare`` (launch overhead over the bare GPU); 2 GiB + 30 % beside 70 %
  and 2 GiB + 10 % beside 90 % (each share ±5 points; each run also holds two processes of one
  pod to the limit together, ±1 %); the 30 % split again with the clock kernel; 2 GiB + 30 %
  with ``--crash`` (a pod killed mid-kernel, then one hitting a fatal fault, beside a 70 %
  neighbour: what the neighbour and a later pod get); 20 GiB, filled. Only this group:
  ``--only hami-mps``.
- torch: a PyTorch process in the hami container environment for 4 GiB: what
  ``torch.cuda.mem_get_info()`` reports, what it can allocate before
  ``torch.OutOfMemoryError`` (and what NVML sees the process use then), and that it computes
  again after freeing; the same process without the library, for comparison.

Every scenario's result is written to ``--json`` as soon as it is known, so an interrupted run
keeps what it measured. Exit code 0 when every limit held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sharegpu.agent.isolation import ComputePolicy, IsolationConfig  # noqa: E402
from sharegpu.isolation_check.check import (  # noqa: E402
    MIB,
    Check,
    DeviceMemory,
    Request,
    Runner,
    baseline_info,
    clean_env,
    container_env,
    decide_seen,
    mem_tolerance_mib,
    overall_ok,
    run_check,
)
from sharegpu.isolation_check.render import value_text  # noqa: E402

TORCH_GIB = 4

# A PyTorch process under the limit. It prints a line when it has hit the out-of-memory error
# (holding everything it got, so the parent can read NVML), waits for a line on stdin, then
# frees, computes again and prints its result.
TORCH_PROBE = r"""
import json, sys, torch
MIB = 1 << 20
def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n"); sys.stdout.flush()
free0, total0 = torch.cuda.mem_get_info()
blocks, oom, message = [], None, ""
for step in (256 * MIB, 16 * MIB, 2 * MIB):
    while True:
        try:
            blocks.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            oom, message = type(e).__name__, str(e).splitlines()[0][:300]
            break
        except RuntimeError as e:
            oom, message = type(e).__name__, str(e).splitlines()[0][:300]
            break
        if step * len(blocks) > 4 * total0:
            break
free1, total1 = torch.cuda.mem_get_info()
say(at_oom=True, free0=free0, total0=total0, free1=free1, total1=total1,
    allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
    error=oom, message=message, name=torch.cuda.get_device_name(0),
    torch=torch.__version__, cuda=torch.version.cuda)
sys.stdin.readline()
del blocks
torch.cuda.empty_cache()
x = torch.ones((1024, 1024), device="cuda")
y = (x @ x).sum().item()
say(done=True, survived=(y == 1024.0 ** 3))
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def nvml_process_mib(pid: int, gpu: int) -> float | None:
    """The GPU memory NVML sees process ``pid`` use (None when NVML cannot tell)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(gpu)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory is not None:
                    return p.usedGpuMemory / MIB
            return None
        finally:
            pynvml.nvmlShutdown()
    except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError):
        # the latter: an NVML without the per-process call nvidia-ml-py asks for
        return None


def torch_run(env: dict[str, str], gpu: int, timeout: float) -> dict[str, Any]:
    """Runs the PyTorch probe in ``env``; its two lines, NVML's reading at the OOM point."""
    device = DeviceMemory(gpu)
    before = device.used_mib()
    p = subprocess.Popen([sys.executable, "-c", TORCH_PROBE], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdin is not None
        line = p.stdout.readline()
        if not line:
            err = p.stderr.read() if p.stderr else ""
            return {"error": (err.strip().splitlines() or ["no output"])[-1]}
        first = json.loads(line)
        first["nvml_process_mib"] = nvml_process_mib(p.pid, gpu)
        during = device.used_mib()
        first["nvml_device_delta_mib"] = (None if before is None or during is None
                                          else during - before)
        p.stdin.write("go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=timeout)
        last = json.loads(out.strip().splitlines()[-1]) if out.strip() else {
            "error": (err.strip().splitlines() or ["no output"])[-1]}
        return {**first, **last, "returncode": p.returncode}
    finally:
        device.close()
        if p.poll() is None:
            p.kill()
            p.communicate()


def torch_checks(limit_mib: float, lim: dict[str, Any], bare: dict[str, Any]) -> list[Check]:
    tol = mem_tolerance_mib(limit_mib)
    if "at_oom" not in lim:
        return [Check("torch.seen", "torch: mem_get_info total", limit_mib, "probe failed", "",
                      False, "MiB", str(lim.get("error", "")))]
    seen = decide_seen(limit_mib, lim["total0"] / MIB)
    seen.key, seen.name = "torch.seen", "torch: mem_get_info total"
    used = (lim["total1"] - lim["free1"]) / MIB
    checks = [
        seen,
        Check("torch.used", "torch: used at OOM (its own view)", limit_mib, round(used, 1),
              f"±1 % (±{tol:.0f} MiB)", abs(used - limit_mib) <= tol, "MiB",
              f"reserved by PyTorch {lim['reserved'] / MIB:.0f} MiB"),
    ]
    nv = lim.get("nvml_process_mib")
    if nv is None:
        nv = lim.get("nvml_device_delta_mib")
    checks.append(Check("torch.nvml", "torch: used at OOM (NVML)", limit_mib,
                        None if nv is None else round(nv, 1), f"±1 % (±{tol:.0f} MiB)",
                        None if nv is None else abs(nv - limit_mib) <= tol, "MiB",
                        "the driver's own count of the process's memory"))
    checks.append(Check("torch.error", "torch: error at the limit", "OutOfMemoryError",
                        lim.get("error") or "none", "exact",
                        lim.get("error") == "OutOfMemoryError", "", lim.get("message", "")))
    checks.append(Check("torch.survives", "torch: computes after freeing", "True",
                        str(bool(lim.get("survived"))), "exact", bool(lim.get("survived"))))
    if "at_oom" in bare:
        checks.append(Check("torch.bare", "torch without the library: total", "—",
                            round(bare["total0"] / MIB, 1), "no target", None, "MiB",
                            f"reserved at OOM {bare['reserved'] / MIB:,.0f} MiB"))
    return checks


class Results:
    def __init__(self, path: str | None, meta: dict[str, Any]) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"meta": meta, "scenarios": []}

    def add(self, scenario: dict[str, Any]) -> None:
        self.doc["scenarios"].append(scenario)
        self.save()

    def save(self) -> None:
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.doc, f, indent=2, default=str)
            os.replace(tmp, self.path)


def scenario_row(name: str, backend: str, req: Request | None, checks: list[Check],
                 extra: dict[str, Any] | None = None, error: str = "") -> dict[str, Any]:
    return {"name": name, "backend": backend,
            "request": None if req is None else {**asdict(req), "limit_mib": req.limit_mib},
            "checks": [asdict(c) for c in checks], "ok": overall_ok(checks) and not error,
            "error": error, **(extra or {})}


def run_scenario(results: Results, name: str, req: Request) -> None:
    log(f"{name}: {req.backend} {req.mem_gib} GiB"
        + (f" + {req.core} % ({req.kernel})" if req.core else "")
        + (" fill" if req.fill else "") + (" compare" if req.compare else "")
        + (" crash" if req.crash else ""))
    t0 = time.monotonic()
    try:
        rep = run_check(req, progress=lambda m: log(f"  {m}"))
    except Exception as e:
        log(f"  failed: {type(e).__name__}: {e}")
        results.add(scenario_row(name, req.backend, req, [], error=f"{type(e).__name__}: {e}"))
        return
    results.doc["meta"].setdefault("gpu", rep.gpu)
    results.add(scenario_row(name, req.backend, req, rep.checks,
                             {"env": rep.env, "compare": rep.compare,
                              "seconds": round(time.monotonic() - t0, 1)}))
    for c in rep.checks:
        log(f"  {c.name}: asked {c.asked} measured {c.measured} -> {c.ok}")


def run_torch(results: Results, args: argparse.Namespace) -> None:
    req = Request(backend="hami", mem_gib=TORCH_GIB, gpu=args.gpu,
                  hami_library=args.hami_library)
    log(f"torch: hami {TORCH_GIB} GiB")
    base = clean_env()
    bare = {**base, "CUDA_VISIBLE_DEVICES": str(args.gpu)}
    try:
        info = baseline_info(Runner(req.cuda_library, 120), req, bare)
        gib = max(1, (int(info["total_mib"]) + 512) // 1024)
        with tempfile.TemporaryDirectory(prefix="sharegpu-torch-") as tmp:
            cfg = IsolationConfig(hami_library=req.hami_library, hami_cache_dir=f"{tmp}/cache",
                                  hami_lock_dir=f"{tmp}/lock",
                                  compute_policy=ComputePolicy.NATIVE)
            env = container_env(req, cfg, pod_uid=f"torch-{uuid.uuid4().hex[:8]}", core=None,
                                gpu_gib=gib, base=base, host_root=tmp)
            lim = torch_run(env, args.gpu, 300)
        no_lib = torch_run(bare, args.gpu, 300)
    except Exception as e:
        log(f"  failed: {type(e).__name__}: {e}")
        results.add(scenario_row("torch", "hami", req, [], error=f"{type(e).__name__}: {e}"))
        return
    checks = torch_checks(req.limit_mib, lim, no_lib)
    results.add(scenario_row("torch 4 GiB", "hami", req, checks,
                             {"with_library": lim, "without_library": no_lib}))
    for c in checks:
        log(f"  {c.name}: asked {c.asked} measured {c.measured} -> {c.ok}")


@contextlib.contextmanager
def mps_daemon(control: str):
    """An MPS control daemon on a pipe directory of its own; quit on the way out."""
    root = tempfile.mkdtemp(prefix="sharegpu-mps-")
    pipe, logs = f"{root}/pipe", f"{root}/log"
    os.makedirs(pipe)
    os.makedirs(logs)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logs)
    subprocess.run([control, "-d"], env=env, check=True, timeout=30)
    try:
        for _ in range(100):
            if os.path.exists(f"{pipe}/control"):
                break
            time.sleep(0.05)
        yield pipe, logs
    finally:
        with contextlib.suppress(Exception):
            subprocess.run([control], input="quit\n", text=True, env=env, timeout=30)
        with contextlib.suppress(OSError):
            for f in sorted(Path(logs).glob("*.log")):
                log(f"  {f.name}: " + " | ".join(f.read_text().strip().splitlines()[-3:]))


def markdown(doc: dict[str, Any]) -> str:
    m = doc["meta"]
    gpu = m.get("gpu", {})
    out = [
        f"GPU: {gpu.get('name', '?')} ({gpu.get('total_mib', 0):,} MiB, "
        f"{gpu.get('multiprocessors', '?')} SMs); driver {m.get('driver', '?')}, CUDA "
        f"{gpu.get('driver_version', '?')} (driver API), nvcc {m.get('nvcc', '?')}; HAMi-core "
        f"{m.get('hami_release', '?')} at commit {m.get('hami_commit', '?')}; "
        f"{m.get('date', '?')}.",
        "",
    ]
    for backend in ("hami", "mps", "hami-mps"):
        rows = [s for s in doc["scenarios"] if s["backend"] == backend]
        if not rows:
            continue
        out += [f"**{backend}**", "",
                "| scenario | check | asked | measured | tolerance | result |",
                "|---|---|---|---|---|---|"]
        for s in rows:
            if s["error"]:
                out.append(f"| {s['name']} | — | — | {s['error']} | — | **could not run** |")
            for c in s["checks"]:
                res = "info" if c["ok"] is None else "pass" if c["ok"] else "**FAIL**"
                out.append(f"| {s['name']} | {c['name']} | {value_text(c['asked'], c['unit'])} | "
                           f"{value_text(c['measured'], c['unit'])} | {c['tolerance'] or '—'} | "
                           f"{res} |")
        out.append("")
    if m.get("mps_absent"):
        out.append(f"mps, hami-mps: {m['mps_absent']}")
    return "\n".join(out) + "\n"


def meta(args: argparse.Namespace) -> dict[str, Any]:
    def first_line(cmd: list[str], pick: str = "") -> str:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return "?"
        lines = [ln for ln in r.stdout.splitlines() if pick in ln] or ["?"]
        return lines[-1].strip()

    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "driver": first_line(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"]),
        "nvcc": first_line(["nvcc", "--version"], "release"),
        "hami_release": args.hami_release, "hami_commit": args.hami_commit,
        "hami_library": args.hami_library, "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hami-library", required=True, help="HAMi-core's libvgpu.so")
    p.add_argument("--hami-release", default="?", help="the HAMi release it was built for")
    p.add_argument("--hami-commit", default="?", help="the HAMi-core commit it was built from")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--seconds", type=float, default=5.0, help="compute probes' length")
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control")
    p.add_argument("--only", action="append", default=[],
                   help="run only these scenario groups (hami, torch, mps, hami-mps)")
    p.add_argument("--scenario", action="append", default=[],
                   help="run only these hami/mps/hami-mps scenarios (by name, e.g. "
                        "'20 GiB, filled')")
    p.add_argument("--json", default=None, help="write the results here (as they come)")
    p.add_argument("--markdown", default=None, help="write the tables here at the end")
    args = p.parse_args(argv)
    args.hami_library = os.path.abspath(args.hami_library)
    groups = set(args.only or ["hami", "torch", "mps", "hami-mps"])
    results = Results(args.json, meta(args))
    common = dict(gpu=args.gpu, seconds=args.seconds, hami_library=args.hami_library)
    plans = [
        ("2 GiB", dict(mem_gib=2, compare=True)),
        ("20 GiB, filled", dict(mem_gib=20, fill=True)),
        ("2 GiB + 30 %", dict(mem_gib=2, core=30)),
        ("2 GiB + 30 %, clock kernel", dict(mem_gib=2, core=30, kernel="spin")),
    ]
    both = [
        ("2 GiB", dict(mem_gib=2, compare=True)),
        ("2 GiB + 30 %", dict(mem_gib=2, core=30)),
        ("2 GiB + 10 %", dict(mem_gib=2, core=10)),
        ("2 GiB + 30 %, clock kernel", dict(mem_gib=2, core=30, kernel="spin")),
        ("2 GiB + 30 %, a pod crashes", dict(mem_gib=2, core=30, crash=True)),
        ("20 GiB, filled", dict(mem_gib=20, fill=True)),
    ]
    if args.scenario:
        plans = [(n, kw) for n, kw in plans if n in args.scenario]
        both = [(n, kw) for n, kw in both if n in args.scenario]
    if "hami" in groups:
        for name, kw in plans:
            run_scenario(results, name, Request(backend="hami", **common, **kw))
    if "torch" in groups:
        run_torch(results, args)
    mps_groups = [("mps", plans), ("hami-mps", both)]
    if any(g in groups for g, _ in mps_groups):
        control = shutil.which(args.mps_control)
        if control is None:
            results.doc["meta"]["mps_absent"] = (f"{args.mps_control} is not on this machine: "
                                                 "the mps and hami-mps back-ends were not "
                                                 "measured")
            log(results.doc["meta"]["mps_absent"])
        else:
            try:
                with mps_daemon(control) as (pipe, _logs):
                    for backend, group in mps_groups:
                        if backend not in groups:
                            continue
                        for name, kw in group:
                            run_scenario(results, name, Request(
                                backend=backend, mps_pipe_dir=pipe, **common, **kw))
            except (OSError, subprocess.SubprocessError) as e:
                results.doc["meta"]["mps_absent"] = f"the MPS control daemon did not start: {e}"
                log(results.doc["meta"]["mps_absent"])
    results.save()
    text = markdown(results.doc)
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)
    return 0 if all(s["ok"] for s in results.doc["scenarios"]) else 1


if __name__ == "__main__":
    sys.exit(main())
