"""The scenarios of ``sharegpu isolation-check``, their tolerances and the pass/fail decisions.

The decisions (``decide_*``) are pure functions over what the probes measured; ``run_check``
starts the probes (:mod:`.probe`) with the environment the node agent's Allocate returns for the
request (:func:`sharegpu.agent.isolation.isolation_env`), translated to host paths. The checks,
what each measures and when it holds: docs/agent.md ("Checking it on a node").
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import ShareGpuError, ValidationError
from .probe import grid_blocks

MIB = 1 << 20
MEM_TOLERANCE = 0.01  # of the limit
SHARE_TOLERANCE_POINTS = 5.0
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
OOM_NAME = "CUDA_ERROR_OUT_OF_MEMORY"
PROBE_MODULE = "sharegpu.isolation_check.probe"
# Variables of the operator's shell that would change what a probe sees: the request's own are
# set from the agent's code, the rest are dropped.
ISOLATION_VARS = ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
                  "CUDA_DEVICE_ORDER", "CUDA_DEVICE_SM_LIMIT", "GPU_CORE_UTILIZATION_POLICY",
                  "CUDA_DEVICE_MEMORY_SHARED_CACHE", "CUDA_MPS_PIPE_DIRECTORY",
                  "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                  "CUDA_REDIRECT", "CUDA_DISABLE_CONTROL")


class CheckError(ShareGpuError):
    """The probes cannot run at all (exit code 2)."""


@dataclass(frozen=True)
class Request:
    backend: str  # "hami" | "mps" | "hami-mps"
    mem_gib: int
    core: int | None = None
    gpu: int = 0
    hami_library: str = "/usr/local/vgpu/libvgpu.so"
    mps_pipe_dir: str = "/run/nvidia/mps"
    compute_policy: int = 5
    seconds: float = 5.0
    compare: bool = False
    cuda_library: str = "libcuda.so.1"
    fill: bool = False
    kernel: str = "burn"  # the compute probes' kernel: burn (work) or spin (clock time)
    reserve_mib: int = 0  # the agent's --reserve-mib: what it keeps out of the advertised GiB
    crash: bool = False  # also a pod crashing beside a neighbour (--crash)

    @property
    def limit_mib(self) -> int:
        return self.mem_gib * 1024


@dataclass
class Check:
    key: str
    name: str
    asked: Any
    measured: Any
    tolerance: str
    ok: bool | None  # None: reported, no target
    unit: str = ""
    note: str = ""


@dataclass
class Report:
    request: Request
    gpu: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    compare: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return overall_ok(self.checks)

    def to_json(self) -> dict[str, Any]:
        req = asdict(self.request)
        req["limit_mib"] = self.request.limit_mib
        return {
            "request": req,
            "gpu": self.gpu,
            "env": self.env,
            "checks": [asdict(c) for c in self.checks],
            "compare": self.compare,
            "ok": self.ok,
        }


# ---- the decisions (pure) ----


def mem_tolerance_mib(limit_mib: float) -> float:
    return limit_mib * MEM_TOLERANCE


def _mib(x: float) -> float:
    return round(float(x), 1)


def _tol_text(limit_mib: float) -> str:
    return f"±1 % (±{mem_tolerance_mib(limit_mib):.0f} MiB)"


def decide_fits(limit_mib: float, gpu_mib: float) -> Check:
    """The limit must fit the GPU (±1 %): a 15,109 MiB T4 is a 15 GiB card to the scheduler, but
    15,360 MiB of it cannot be had."""
    ok = limit_mib <= gpu_mib + mem_tolerance_mib(limit_mib)
    return Check("mem.fits", "limit fits the GPU", limit_mib, _mib(gpu_mib),
                 f"GPU at least the limit -1 % (-{mem_tolerance_mib(limit_mib):.0f} MiB)", ok,
                 "MiB", "" if ok else "the GPU has less memory than the limit: the rest of the "
                 "limit cannot be had, whatever the back-end does")


def decide_seen(limit_mib: float, seen_mib: float, *, note: str = "") -> Check:
    ok = abs(seen_mib - limit_mib) <= mem_tolerance_mib(limit_mib)
    return Check("mem.seen", "memory seen", limit_mib, _mib(seen_mib), _tol_text(limit_mib), ok,
                 "MiB", note)


def decide_reachable(limit_mib: float, largest_mib: float, used_at_start_mib: float) -> Check:
    got = largest_mib + used_at_start_mib
    ok = abs(got - limit_mib) <= mem_tolerance_mib(limit_mib)
    return Check("mem.reachable", "limit reachable", limit_mib, _mib(got),
                 _tol_text(limit_mib), ok, "MiB",
                 f"largest allocation {largest_mib:.0f} MiB + {used_at_start_mib:.1f} MiB used "
                 "at start")


def decide_past_limit(single_code: int | None, past_code: int | None,
                      names: Mapping[int, str] | None = None) -> Check:
    """Both the allocation of largest + 1 MiB and 1 MiB more while holding the largest must fail
    with CUDA_ERROR_OUT_OF_MEMORY."""
    names = names or {}
    codes = [single_code, past_code]
    ok = all(c == CUDA_ERROR_OUT_OF_MEMORY for c in codes)
    if ok:
        measured = OOM_NAME
    else:
        bad = next(c for c in codes if c != CUDA_ERROR_OUT_OF_MEMORY)
        measured = ("not tried" if bad is None else
                    "succeeded" if bad == 0 else names.get(bad, f"CUDA error {bad}"))
    return Check("mem.past", "past the limit", OOM_NAME, measured, "exact", ok, "",
                 "largest + 1 MiB, and 1 MiB more while holding the largest")


def decide_survives(after_code: int | None, names: Mapping[int, str] | None = None) -> Check:
    ok = after_code == 0
    measured = ("1 MiB allocated" if ok else
                "not tried" if after_code is None else
                (names or {}).get(after_code, f"CUDA error {after_code}"))
    return Check("mem.survives", "survives", "1 MiB allocated", measured,
                 "exact", ok)


def decide_shared_free(limit_mib: float, a_used_mib: float, b_own_mib: float,
                       b_free_mib: float) -> Check:
    asked = limit_mib - a_used_mib - b_own_mib
    ok = abs(b_free_mib - asked) <= mem_tolerance_mib(limit_mib)
    return Check("shared.free", "shared: free", _mib(asked), _mib(b_free_mib),
                 _tol_text(limit_mib), ok, "MiB",
                 f"limit - A's {a_used_mib:.0f} MiB - B's own {b_own_mib:.1f} MiB")


def decide_shared_sum(limit_mib: float, a_used_mib: float, b_own_mib: float,
                      b_largest_mib: float) -> Check:
    got = a_used_mib + b_own_mib + b_largest_mib
    ok = got <= limit_mib + mem_tolerance_mib(limit_mib)
    return Check("shared.sum", "shared: sum", limit_mib, _mib(got),
                 f"at most +1 % (+{mem_tolerance_mib(limit_mib):.0f} MiB)", ok, "MiB",
                 f"A {a_used_mib:.0f} + B's own {b_own_mib:.1f} + B's largest "
                 f"{b_largest_mib:.0f} MiB")


def decide_each_within(key: str, name: str, limit_mib: float, usages_mib: Sequence[float],
                       what: str) -> Check:
    """No pod past its limit (+1 %): the most any of them used, ``what`` naming the count."""
    worst = max(usages_mib)
    ok = worst <= limit_mib + mem_tolerance_mib(limit_mib)
    return Check(key, name, limit_mib, _mib(worst),
                 f"at most +1 % (+{mem_tolerance_mib(limit_mib):.0f} MiB)", ok, "MiB",
                 what + ", ".join(f"{u:.0f}" for u in usages_mib) + " MiB")


def decide_fill_within(limit_mib: float, usages_mib: Sequence[float]) -> Check:
    return decide_each_within("fill.within", "fill: within limits", limit_mib, usages_mib,
                              f"the most any of {len(usages_mib)} pods used: ")


def decide_fill_reach(limit_mib: float, usages_mib: Sequence[float], gpu_mib: float) -> Check:
    least = min(usages_mib)
    ok = least >= limit_mib - mem_tolerance_mib(limit_mib)
    n = len(usages_mib)
    note = (f"the least any of {n} pods got; {n} x {limit_mib:.0f} = {n * limit_mib:,.0f} MiB "
            f"of the GPU's {gpu_mib:,.0f} MiB")
    if not ok:
        note += ("; the pods started last get what is left: the GPU has less free memory than "
                 "the limits the scheduler placed on it add up to")
    return Check("fill.reach", "fill: limit reached", limit_mib, _mib(least),
                 f"at least -1 % (-{mem_tolerance_mib(limit_mib):.0f} MiB)", ok, "MiB", note)


def decide_fill_codes(key: str, name: str, codes: Sequence[int | None], want: int,
                      names: Mapping[int, str] | None = None) -> Check:
    names = names or {}
    wanted = "1 MiB allocated" if want == 0 else names.get(want, OOM_NAME)
    bad = [(i, c) for i, c in enumerate(codes) if c != want]
    if not bad:
        return Check(key, name, wanted, f"{wanted} ({len(codes)} pods)", "exact", True)
    i, c = bad[0]
    what = ("not tried" if c is None else "succeeded" if c == 0 else
            names.get(c, f"CUDA error {c}"))
    return Check(key, name, wanted, f"pod {i + 1}: {what}", "exact", False, "",
                 f"{len(bad)} of {len(codes)} pods")


def share_percent(a: float, b: float) -> float | None:
    return None if a + b <= 0 else 100.0 * a / (a + b)


def decide_share(core: int, a_kernels: float, b_kernels: float) -> Check:
    share = share_percent(a_kernels, b_kernels)
    ok = share is not None and abs(share - core) <= SHARE_TOLERANCE_POINTS
    return Check("compute.share", "compute share", core,
                 None if share is None else round(share, 1), "±5 points", ok, "%",
                 f"{a_kernels:.0f} kernels at {core} % vs {b_kernels:.0f} at {100 - core} %")


def ratio(with_lib: float, without: float) -> float | None:
    return None if without <= 0 else with_lib / without


def decide_ratio(key: str, name: str, with_lib: float, without: float, unit: str) -> Check:
    r = ratio(with_lib, without)
    return Check(key, name, "—", None if r is None else round(r, 3), "no target", None, "×",
                 f"{with_lib:,.0f} vs {without:,.0f} {unit} without the limits")


def probe_failed(key: str, name: str, asked: Any, error: str, unit: str = "") -> Check:
    return Check(key, name, asked, "probe failed", "", False, unit, error)


def overall_ok(checks: Sequence[Check]) -> bool:
    return bool(checks) and all(c.ok is not False for c in checks)


# ---- the environment ----


def host_env(envs: Mapping[str, str], mounts: Sequence[Any]) -> dict[str, str]:
    """``envs`` with every container path that a mount brings in replaced by its host path.

    ``mounts`` have ``container_path`` and ``host_path``; a path is replaced where it is a whole
    path or a prefix of one (``/tmp/x`` in ``/tmp/x/y.cache``, not in ``/tmp/xy``), anywhere in a
    value (lists such as ``a:b`` too); the longest container path wins.
    """
    order = sorted(mounts, key=lambda m: len(m.container_path.rstrip("/")), reverse=True)
    out = {}
    for name, value in envs.items():
        out[name] = _translate(value, order)
    return out


_SEPARATORS = " :,;="


def _translate(value: str, mounts: Sequence[Any]) -> str:
    i, res = 0, []
    while i < len(value):
        if i == 0 or value[i - 1] in _SEPARATORS:
            for m in mounts:
                c = m.container_path.rstrip("/") or "/"
                if value.startswith(c, i):
                    j = i + len(c)
                    if j == len(value) or value[j] == "/" or value[j] in _SEPARATORS:
                        res.append(m.host_path.rstrip("/") or "/")
                        i = j
                        break
            else:
                res.append(value[i])
                i += 1
            continue
        res.append(value[i])
        i += 1
    return "".join(res)


def clean_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without any isolation variable (so the baseline is bare)."""
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k in ISOLATION_VARS or k.startswith("CUDA_DEVICE_MEMORY_LIMIT"):
            del env[k]
    src = str(Path(__file__).resolve().parents[2])  # the folder holding the sharegpu package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


# ---- the driver's count ----


class DeviceMemory:
    """The GPU's used memory as the driver counts it (NVML), for rows that do not take the
    interposer's or the client's word for it. Readings are ``None`` where NVML cannot be used
    (``error`` says why)."""

    def __init__(self, gpu: int) -> None:
        self.error = ""
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
            self._nvml = pynvml
        except Exception as e:  # no NVML library, no GPU: the rows are left out
            self.error = str(e) or type(e).__name__

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _reading(self, field: str) -> float | None:
        if self._nvml is None:
            return None
        try:
            return getattr(self._nvml.nvmlDeviceGetMemoryInfo(self._handle), field) / MIB
        except Exception:
            return None

    def used_mib(self) -> float | None:
        return self._reading("used")

    def total_mib(self) -> float | None:
        """The GPU's memory as NVML reports it: what the node agent advertises (in GiB)."""
        return self._reading("total")

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None


def decide_device(limit_mib: float, grew_mib: float, largest_mib: float,
                  uncounted_mib: float = 0.0) -> Check:
    """What the GPU's used memory grew by while one pod held its largest allocation, against
    the limit plus the part of the pod's own memory (its CUDA context) that the back-end does not
    count against the limit."""
    asked = limit_mib + uncounted_mib
    ok = abs(grew_mib - asked) <= mem_tolerance_mib(limit_mib)
    note = (f"NVML: the GPU's used memory grew by {grew_mib:.0f} MiB while one pod held its "
            f"largest allocation, {largest_mib:.0f} MiB")
    if uncounted_mib >= 1:
        note += (f"; the back-end does not count the process's CUDA context, "
                 f"{uncounted_mib:.0f} MiB, against the limit: the pod takes that much more")
    return Check("mem.device", "device usage (driver's count)", _mib(asked), _mib(grew_mib),
                 _tol_text(limit_mib), ok, "MiB", note)


def decide_fill_device(limit_mib: float, grew_mib: Sequence[float]) -> Check:
    return decide_each_within("fill.device", "fill: within limits (driver's count)", limit_mib,
                              grew_mib, "NVML: what the GPU's used memory grew by as each pod "
                              "took its share: ")


# ---- the probes ----


@dataclass
class ProbeResult:
    ok: bool
    data: dict[str, Any]
    error: str = ""
    kind: str = ""


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _probe_cmd(action: str, args: Sequence[str], library: str) -> list[str]:
    return [sys.executable, "-m", PROBE_MODULE, action, "--library", library, *args]


def _result(rc: int, out: str, err: str) -> ProbeResult:
    data = _last_json(out)
    if data is None:
        tail = (err.strip().splitlines() or [f"exit code {rc}, no output"])[-1]
        return ProbeResult(False, {}, f"probe exited with code {rc}: {tail}", "crash")
    if "error" in data:
        return ProbeResult(False, data, str(data["error"]), str(data.get("kind", "")))
    return ProbeResult(rc == 0, data, "" if rc == 0 else f"probe exited with code {rc}")


class Runner:
    """Starts probes; every process it starts is ended when it closes."""

    def __init__(self, library: str, timeout: float) -> None:
        self.library = library
        self.timeout = timeout
        self.procs: list[subprocess.Popen] = []

    def run(self, action: str, env: Mapping[str, str], *args: str,
            timeout: float | None = None) -> ProbeResult:
        try:
            r = subprocess.run(_probe_cmd(action, args, self.library), env=dict(env),
                               capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               timeout=timeout or self.timeout)
        except subprocess.TimeoutExpired:
            return ProbeResult(False, {}, f"probe {action} timed out", "timeout")
        except OSError as e:
            raise CheckError(f"cannot start the probe ({sys.executable}): {e}") from None
        return _result(r.returncode, r.stdout, r.stderr)

    def start(self, action: str, env: Mapping[str, str], *args: str) -> subprocess.Popen:
        try:
            p = subprocess.Popen(_probe_cmd(action, args, self.library), env=dict(env),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, bufsize=1)
        except OSError as e:
            raise CheckError(f"cannot start the probe ({sys.executable}): {e}") from None
        self.procs.append(p)
        return p

    @staticmethod
    def ready(p: subprocess.Popen, timeout: float) -> ProbeResult:
        """The probe's first line: ``{"ready": true, ...}`` or its error."""
        deadline = time.monotonic() + timeout
        assert p.stdout is not None
        while time.monotonic() < deadline:
            r, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                break
            line = p.stdout.readline()
            if not line:
                break
            data = _last_json(line)
            if data is None:
                continue
            if data.get("ready"):
                return ProbeResult(True, data)
            return ProbeResult(False, data, str(data.get("error", "probe not ready")),
                               str(data.get("kind", "")))
        if p.poll() is None:
            return ProbeResult(False, {}, "probe did not get ready in time", "timeout")
        err = p.stderr.read() if p.stderr else ""
        return _result(p.wait(), "", err)

    def finish(self, p: subprocess.Popen, timeout: float) -> ProbeResult:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            return ProbeResult(False, {}, "probe timed out", "timeout")
        return _result(p.returncode, out, err)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.communicate(timeout=5)
        self.procs.clear()


# ---- the scenarios ----


def _gpu_gib(total_mib: int, reserve_mib: int = 0) -> int:
    from ..agent.nvml import Gpu

    return Gpu(0, "", "", total_mib, reserve_mib).mem_gib


def baseline_info(runner: Runner, req: Request, env: Mapping[str, str]) -> dict[str, Any]:
    r = runner.run("info", env)
    if r.ok:
        return r.data
    if r.kind == "library":
        raise CheckError(
            f"cannot load {req.cuda_library} ({r.error.split(': ', 1)[-1]}): the probes need the "
            "NVIDIA driver's CUDA library; run this on a GPU node with the driver installed, or "
            f"add the folder holding {req.cuda_library} to LD_LIBRARY_PATH"
        )
    if r.kind == "cuda" and r.data.get("code") in (CUDA_ERROR_NO_DEVICE, CUDA_ERROR_INVALID_DEVICE):
        raise ValidationError("--gpu", req.gpu, f"no such GPU on this node ({r.error})")
    if r.kind == "cuda":
        raise CheckError(f"GPU {req.gpu} cannot be used (--gpu={req.gpu}): {r.error}")
    raise CheckError(f"the probe cannot run on GPU {req.gpu}: {r.error}")


def _names(*datas: Mapping[str, Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    for d in datas:
        for code_key, name_key in (("past_single_code", "past_single_name"),
                                   ("past_code", "past_name"), ("after_code", "after_name")):
            if d.get(code_key) is not None and d.get(name_key):
                out[int(d[code_key])] = str(d[name_key])
    return out


def mem_checks(req: Request, data: Mapping[str, Any], own_mib: float | None) -> list[Check]:
    """Checks 1-3 from a ``mem`` probe; ``own_mib`` is the probe's own usage at start where the
    back-end does not show it (mps), ``None`` where total - free is it (hami)."""
    limit = req.limit_mib
    total = data["total_bytes"] / MIB
    free = data["free_bytes"] / MIB
    used = total - free if own_mib is None else own_mib
    names = _names(data)
    note = "" if own_mib is None else (
        f"free at start + own context {own_mib:.1f} MiB (MPS shows the device's total; the "
        "context is taken as the GPU's used memory without limits, so run on an idle GPU)")
    return [
        decide_seen(limit, total if own_mib is None else free + own_mib, note=note),
        decide_reachable(limit, data["largest_mib"], used),
        decide_past_limit(data.get("past_single_code"), data.get("past_code"), names),
        decide_survives(data.get("after_code"), names),
    ]


def container_env(req: Request, config: Any, *, pod_uid: str, core: int | None, gpu_gib: int,
                  base: Mapping[str, str], host_root: str) -> dict[str, str]:
    """The environment a container with ``req``'s memory and ``core`` gets from the agent's
    Allocate (:func:`sharegpu.agent.isolation.isolation_env` with ``config``), its container
    paths turned into host paths; the folders it mounts from under ``host_root`` are made."""
    from ..agent.isolation import Backend, isolation_env

    ce = isolation_env(Backend(req.backend), mem={req.gpu: req.mem_gib},
                       core={req.gpu: core} if core else {}, pod_uid=pod_uid, config=config,
                       gpu_mem={req.gpu: gpu_gib})
    return process_env(ce.envs, ce.mounts, base=base, visible=str(req.gpu), host_root=host_root)


def process_env(envs: Mapping[str, str], mounts: Sequence[Any], *, base: Mapping[str, str],
                visible: str, host_root: str) -> dict[str, str]:
    """A container's variables and mounts (``container_path``, ``host_path``) as the
    environment of a process on the host: container paths replaced by host paths
    (:func:`host_env`), CUDA shown the GPUs ``visible`` (the NVIDIA runtime's part), and the
    mounted folders under ``host_root`` that do not exist yet made (the runtime's part)."""
    from ..agent.isolation import HAMI_CONTAINER_LIBRARY

    for m in mounts:
        if m.host_path.startswith(host_root) and not os.path.exists(m.host_path):
            Path(m.host_path).mkdir(parents=True)
    env = {**base, **host_env(envs, mounts), "CUDA_VISIBLE_DEVICES": visible}
    library = next((m for m in mounts if m.container_path == HAMI_CONTAINER_LIBRARY), None)
    if library is not None and library.host_path != HAMI_CONTAINER_LIBRARY:
        # HAMi-core opens the container's path to find its own hooks; outside a container the
        # same file is named to it with CUDA_REDIRECT
        env["CUDA_REDIRECT"] = library.host_path
    return env


def run_check(req: Request, *, base_env: Mapping[str, str] | None = None,
              progress: Any = None) -> Report:
    """Runs every scenario of ``req``; raises :class:`CheckError` when the probes cannot run."""
    from ..agent.isolation import Backend, ComputePolicy, IsolationConfig

    say = progress or (lambda _msg: None)
    backend = Backend(req.backend)
    base = clean_env(base_env)
    bare = {**base, "CUDA_VISIBLE_DEVICES": str(req.gpu)}
    timeout = 120.0 + 3 * req.seconds
    runner = Runner(req.cuda_library, timeout)
    report = Report(req)
    device = DeviceMemory(req.gpu)
    try:
        say("probing the GPU without limits")
        info = baseline_info(runner, req, bare)
        gpu_mib = int(info["total_mib"])
        report.gpu = {
            "index": req.gpu, "name": info["name"], "total_mib": gpu_mib,
            "total_bytes": info["total_bytes"], "multiprocessors": info["multiprocessors"],
            "driver_version": info["driver_version"],
            "used_without_limits_mib": round(
                (info["ctx_total_bytes"] - info["ctx_free_bytes"]) / MIB, 1),
        }
        # the GiB the agent advertises for this GPU: from NVML's total, as the agent reads it
        # (CUDA shows less: on an H100, 81,079 MiB of NVML's 81,559)
        nvml_total = device.total_mib()
        gib = _gpu_gib(int(nvml_total) if nvml_total else gpu_mib, req.reserve_mib)
        report.gpu["advertised_gib"] = gib
        if req.mem_gib > gib:
            raise ValidationError("--mem", req.mem_gib,
                                  f"must be at most the GPU's {gib} GiB ({gpu_mib} MiB)")
        ctx_mib = (info["ctx_total_bytes"] - info["ctx_free_bytes"]) / MIB
        with tempfile.TemporaryDirectory(prefix="sharegpu-isolation-check-") as tmp:
            cfg = IsolationConfig(
                hami_library=req.hami_library, hami_cache_dir=f"{tmp}/cache",
                hami_lock_dir=f"{tmp}/lock", mps_pipe_dir=req.mps_pipe_dir,
                compute_policy=ComputePolicy(req.compute_policy),
            )
            run_id = uuid.uuid4().hex[:8]

            def container(name: str, core: int | None, config: IsolationConfig = cfg
                          ) -> dict[str, str]:
                return container_env(req, config, pod_uid=f"isolation-check-{run_id}-{name}",
                                     core=core, gpu_gib=gib, base=base, host_root=tmp)

            own = None if backend.uses_hami else ctx_mib
            upper = ["--upper-mib", str(gpu_mib)]
            env1 = container("mem", req.core)
            report.env = {k: v for k, v in env1.items() if base.get(k) != v}

            fits = decide_fits(req.limit_mib, gpu_mib)
            if not fits.ok:
                report.checks.append(fits)
            if device.available:
                say("memory: one pod's usage as the driver counts it")
                if backend.uses_mps:
                    # the first client starts the MPS server, whose memory is not the pod's
                    runner.run("info", container("mps-server", req.core))
                grew, held = held_usage(runner, container("device", req.core), upper, device,
                                        timeout)
                if grew is not None and held.ok:
                    largest = held.data["largest_mib"]
                    if own is not None:
                        # an MPS client's own memory inside its limit (its context, which
                        # shrinks with its share of the SMs), as the driver counts it
                        own = grew - largest
                        uncounted = 0.0
                    else:
                        # what the interposer shows used before the first allocation, against
                        # what a process's context takes on this GPU
                        shown = (held.data["total_bytes"] - held.data["free_bytes"]) / MIB
                        uncounted = max(0.0, ctx_mib - shown)
                    report.checks.append(decide_device(req.limit_mib, grew, largest, uncounted))
                elif not held.ok:
                    report.checks.append(probe_failed("mem.device",
                                                      "device usage (driver's count)",
                                                      req.limit_mib, held.error, "MiB"))
            report.gpu["nvml"] = "used" if device.available else f"not used: {device.error}"
            say("memory: limit, largest allocation, allocation past the limit")
            r = runner.run("mem", env1, *upper)
            single_own: float | None = None
            if r.ok:
                report.checks += mem_checks(req, r.data, own)
                single_own = (r.data["total_bytes"] - r.data["free_bytes"]) / MIB \
                    if own is None else own
            else:
                for key, name in (("mem.seen", "memory seen"),
                                  ("mem.reachable", "limit reachable")):
                    report.checks.append(probe_failed(key, name, req.limit_mib, r.error, "MiB"))

            say("memory: two processes of one container")
            report.checks += shared_checks(runner, req, container("shared", req.core), upper,
                                           own, single_own, timeout)

            if req.core is not None and req.core < 100:
                say(f"compute: {req.core} % beside {100 - req.core} % for {req.seconds:g} s")
                report.checks.append(compute_check(
                    runner, req, container("compute-a", req.core),
                    container("compute-b", 100 - req.core), timeout,
                    blocks=grid_blocks(int(info["multiprocessors"]),
                                       int(info["threads_per_multiprocessor"]))))

            if req.crash:
                victim = 100 - req.core if req.core is not None and req.core < 100 else None
                say("a pod crashes beside a neighbour")
                report.checks += crash_checks(
                    runner, req, container("crash-neighbour", victim),
                    container("crash-pod", req.core), container("crash-after", req.core),
                    timeout, uses_mps=backend.uses_mps,
                    blocks=grid_blocks(int(info["multiprocessors"]),
                                       int(info["threads_per_multiprocessor"])))

            if req.fill:
                n = max(1, gib // req.mem_gib)
                say(f"memory: filling the GPU with {n} pods of {req.mem_gib} GiB")
                report.checks += fill_checks(
                    runner, req, n, lambda i: container(f"fill-{i}", req.core), upper,
                    single_own if single_own is not None else ctx_mib, gpu_mib, timeout,
                    device)

            if req.compare:
                say("comparing with the bare GPU")
                plain = IsolationConfig(
                    hami_library=cfg.hami_library, hami_cache_dir=cfg.hami_cache_dir,
                    hami_lock_dir=cfg.hami_lock_dir, mps_pipe_dir=cfg.mps_pipe_dir,
                    compute_policy=ComputePolicy.NATIVE,
                )
                checks, report.compare = compare_checks(
                    runner, req, container("compare", None, plain), bare)
                report.checks += checks
    finally:
        runner.close()
        device.close()
    return report


def shared_checks(runner: Runner, req: Request, env: Mapping[str, str], upper: list[str],
                  own: float | None, single_own: float | None, timeout: float) -> list[Check]:
    limit = req.limit_mib
    # A holds half of what is left once both processes have their contexts (one context is
    # about 0.5 GiB on an H100 or H200: with a 2 GiB limit, A holding 1 GiB left B no room for
    # its own)
    ctx = single_own if single_own is not None else 0.0
    hold_mib = max(1, int(limit - 2 * ctx) // 2)
    a = runner.start("hold", env, "--mib", str(hold_mib), "--timeout", str(timeout))
    try:
        ready = runner.ready(a, timeout)
        if not ready.ok:
            return [probe_failed("shared.free", "shared: free", limit - hold_mib,
                                 f"process A (hold {hold_mib} MiB): {ready.error}", "MiB")]
        d = ready.data
        # A's usage: everything it holds, its context included
        a_used = (d["total_bytes"] - d["free_held_bytes"]) / MIB if own is None else own + hold_mib
        b = runner.run("mem", env, *upper)
    finally:
        runner.finish(a, 30)  # closes A's stdin: it lets go and exits
    if not b.ok:
        return [probe_failed("shared.free", "shared: free", limit - a_used,
                             f"process B: {b.error}", "MiB")]
    b_free = b.data["free_bytes"] / MIB
    # B's own usage at start: its context, as the single process measured it (hami shows the
    # container's usage, A's included, as total - free)
    b_own = single_own if single_own is not None else 0.0
    checks = [
        decide_shared_free(limit, a_used, b_own, b_free),
        decide_shared_sum(limit, a_used, b_own, b.data["largest_mib"]),
    ]
    if req.backend == "mps":
        for c in checks:
            if c.ok is False:
                c.note += ("; MPS holds each client process to CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "
                           "not the container: its processes together can use more")
    return checks


def held_usage(runner: Runner, env: Mapping[str, str], upper: list[str], device: DeviceMemory,
               timeout: float) -> tuple[float | None, ProbeResult]:
    """One pod takes its largest allocation and holds it: what the GPU's used memory grew by
    (NVML), and the probe's ready line."""
    before = device.used_mib()
    p = runner.start("fill", env, *upper, "--timeout", str(timeout))
    try:
        r = runner.ready(p, timeout)
        during = device.used_mib() if r.ok else None
    finally:
        runner.finish(p, 30)
    grew = None if before is None or during is None else during - before
    return grew, r


def fill_checks(runner: Runner, req: Request, n: int, pod_env: Any, upper: list[str],
                own_mib: float, gpu_mib: float, timeout: float,
                device: DeviceMemory | None = None) -> list[Check]:
    """``n`` pods (``pod_env(i)``: each its own container) take the largest allocation each can
    get, one after another, and hold it until all have; then they let go.

    A pod's usage is its largest allocation plus its own usage at start (``own_mib``, its
    context, as the single-process probe measured it): near a full GPU the interposer's ``free``
    is the GPU's, so ``total - free`` would count other pods' memory."""
    limit = req.limit_mib
    procs: list[subprocess.Popen] = []
    ready: list[dict[str, Any]] = []
    grew: list[float | None] = []
    failed: Check | None = None
    try:
        for i in range(n):
            before = device.used_mib() if device else None
            p = runner.start("fill", pod_env(i), *upper, "--timeout", str(timeout))
            procs.append(p)
            r = runner.ready(p, timeout)
            if not r.ok:
                failed = probe_failed("fill.within", "fill: within limits", limit,
                                      f"pod {i + 1} of {n}: {r.error}", "MiB")
                break
            after = device.used_mib() if device else None
            grew.append(None if before is None or after is None else after - before)
            ready.append(r.data)
    finally:
        done = [runner.finish(p, 30) for p in procs]  # closes stdin: each lets go
    if failed is not None:
        return [failed]
    usages = [d["largest_mib"] + own_mib for d in ready]
    names = _names(*ready, *(r.data for r in done))
    checks = [decide_fill_within(limit, usages)]
    if grew and all(g is not None for g in grew):
        checks.append(decide_fill_device(limit, [g for g in grew if g is not None]))
    return [
        *checks,
        decide_fill_reach(limit, usages, gpu_mib),
        decide_fill_codes("fill.past", "fill: past the limit",
                          [d.get("past_code") for d in ready], CUDA_ERROR_OUT_OF_MEMORY, names),
        decide_fill_codes("fill.survives", "fill: survives",
                          [r.data.get("after_code") if r.ok else None for r in done], 0, names),
    ]


def compute_check(runner: Runner, req: Request, env_a: Mapping[str, str],
                  env_b: Mapping[str, str], timeout: float, blocks: int = 0) -> Check:
    assert req.core is not None
    settle = min(1.0, 0.2 * req.seconds)
    args = ("--seconds", str(req.seconds), "--settle", f"{settle:g}", "--wait-go",
            "--timeout", str(timeout), "--kernel", req.kernel, "--blocks", str(blocks))
    procs = [runner.start("spin", env_a, *args), runner.start("spin", env_b, *args)]
    for i, p in enumerate(procs):
        ready = runner.ready(p, timeout)
        if not ready.ok:
            which = f"pod {'AB'[i]} ({req.core if i == 0 else 100 - req.core} %)"
            return probe_failed("compute.share", "compute share", req.core,
                                f"{which}: {ready.error}", "%")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [runner.finish(p, timeout + settle + req.seconds) for p in procs]
    for i, r in enumerate(results):
        if not r.ok:
            return probe_failed("compute.share", "compute share", req.core,
                                f"pod {'AB'[i]}: {r.error}", "%")
    a, b = (r.data["kernels"] for r in results)
    return decide_share(req.core, a, b)


CRASH_CAUSES = {"kill": "SIGKILL mid-kernel", "fault": "CUDA_ERROR_ILLEGAL_ADDRESS"}
MPS_FAULT_NOTE = ("MPS: a client's fatal fault reaches every client on its GPU (NVIDIA's MPS "
                  "documentation); this row measures it, with no target")


def crash_checks(runner: Runner, req: Request, env_neighbour: Mapping[str, str],
                 env_pod: Mapping[str, str], env_after: Mapping[str, str], timeout: float, *,
                 uses_mps: bool, blocks: int = 0) -> list[Check]:
    """A pod dies a third of the way into its neighbour's ``req.seconds`` of kernels, killed and
    then by a fatal fault; what the neighbour and a pod started afterwards saw."""
    checks: list[Check] = []
    for how in ("kill", "fault"):
        checks += _crash(runner, req, how, env_neighbour, env_pod, env_after, timeout,
                         uses_mps=uses_mps, blocks=blocks)
    return checks


def _crash(runner: Runner, req: Request, how: str, env_neighbour: Mapping[str, str],
           env_pod: Mapping[str, str], env_after: Mapping[str, str], timeout: float, *,
           uses_mps: bool, blocks: int) -> list[Check]:
    seconds = req.seconds
    at = seconds / 3
    spin = ("--seconds", f"{seconds:g}", "--wait-go", "--timeout", str(timeout),
            "--kernel", req.kernel, "--blocks", str(blocks))
    neighbour = runner.start("spin", env_neighbour, *spin)
    pod = (runner.start("spin", env_pod, *spin) if how == "kill" else
           runner.start("fault", env_pod, "--seconds", f"{at:g}", "--wait-go",
                        "--timeout", str(timeout)))
    for name, p in (("neighbour", neighbour), ("crashing pod", pod)):
        ready = runner.ready(p, timeout)
        if not ready.ok:
            runner.finish(neighbour, 30)
            runner.finish(pod, 30)
            return [probe_failed(f"crash.{how}.cause", f"{how}: the crash", CRASH_CAUSES[how],
                                 f"{name}: {ready.error}")]
    for p in (neighbour, pod):
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    if how == "kill":
        time.sleep(at)
        pod.kill()
        runner.finish(pod, 30)
        happened = "SIGKILL mid-kernel" if pod.returncode == -9 else \
            f"exited with code {pod.returncode} before the kill"
        cause_ok = pod.returncode == -9
    else:
        r = runner.finish(pod, timeout + at)
        happened = str(r.data.get("fault_name") or r.error or "no fault")
        cause_ok = happened == CRASH_CAUSES["fault"]
    n = runner.finish(neighbour, timeout + seconds)
    after = runner.run("spin", env_after, "--seconds", "0.5", "--kernel", req.kernel,
                       "--blocks", str(blocks), "--timeout", str(timeout))
    informational = how == "fault" and uses_mps
    return [
        Check(f"crash.{how}.cause", f"{how}: the crash", CRASH_CAUSES[how], happened, "exact",
              cause_ok),
        Check(f"crash.{how}.neighbour", f"{how}: neighbour", "computes to its end",
              f"{n.data['kernels']} kernels" if n.ok else f"failed: {n.error}",
              "no target" if informational else "exact", None if informational else n.ok,
              note=MPS_FAULT_NOTE if informational else ""),
        Check(f"crash.{how}.after", f"{how}: a later pod", "computes",
              f"{after.data['kernels']} kernels" if after.ok else f"failed: {after.error}",
              "exact", after.ok),
    ]


def compare_checks(runner: Runner, req: Request, env_lib: Mapping[str, str],
                   bare: Mapping[str, str]) -> tuple[list[Check], dict[str, Any]]:
    seconds = str(min(req.seconds, 2.0))
    launch = ("--seconds", seconds, "--cycles", "0", "--blocks", "1")
    alloc = ("--seconds", seconds, "--mib", "1")
    out: dict[str, Any] = {}
    checks: list[Check] = []
    for key, name, action, args, field_, unit in (
        ("compare.launch", "launch rate", "spin", launch, "rate", "launches/s"),
        ("compare.alloc", "alloc rate", "allocspeed", alloc, "ops_per_s",
         "allocs+frees/s"),
    ):
        without = runner.run(action, bare, *args)
        with_lib = runner.run(action, env_lib, *args)
        if not (without.ok and with_lib.ok):
            err = with_lib.error or without.error
            checks.append(Check(key, name, "—", "probe failed", "no target", None, "×", err))
            out[key.split(".")[1]] = {"error": err}
            continue
        w, b = float(with_lib.data[field_]), float(without.data[field_])
        checks.append(decide_ratio(key, name, w, b, unit))
        out[key.split(".")[1]] = {"with_library": w, "baseline": b, "ratio": ratio(w, b),
                                  "unit": unit}
    return checks, out
