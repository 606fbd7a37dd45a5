"""The probe of ``sharegpu isolation-check``: one CUDA process, driven through the driver API.

Run as ``python -m sharegpu.isolation_check.probe ACTION [options]``; it prints JSON lines on
stdout (the last one is the result) and exits 0, or prints ``{"error": ...}`` and exits 3.
Standard library only, with every driver function looked up through the ``libcuda.so.1``
handle, where interposers such as HAMi-core put their hooks. The actions: docs/agent.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import sys
import time

MIB = 1 << 20
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
ATTR_CLOCK_RATE = 13  # kHz
ATTR_MULTIPROCESSOR_COUNT = 16
ATTR_MAX_THREADS_PER_MULTIPROCESSOR = 39
THREADS_PER_BLOCK = 128
WAVES = 8  # a launch is this many waves of blocks filling every multiprocessor

# A busy loop: each thread spins on its SM's cycle counter until ``cycles`` have passed.
SPIN_PTX = b"""
.version 6.0
.target sm_50
.address_size 64

.visible .entry spin(
    .param .u64 cycles
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [cycles];
    mov.u64 %rd2, %clock64;
SPIN_LOOP:
    mov.u64 %rd3, %clock64;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra SPIN_LOOP;
    ret;
}
\x00"""

# Work, not time: two chains of multiply-adds, ``cycles / 64`` iterations per thread (about that
# many cycles when every multiprocessor is full). Kernels of two processes that share the SMs
# slow each other down, and a process held to part of the SMs (MPS) does less, so the kernels
# each completes (of the same grid) measure its share of the GPU.
BURN_PTX = b"""
.version 6.0
.target sm_50
.address_size 64

.visible .entry spin(
    .param .u64 cycles
)
{
    .reg .pred %p<3>;
    .reg .b64 %rd<4>;
    .reg .f32 %f<6>;

    ld.param.u64 %rd1, [cycles];
    shr.u64 %rd1, %rd1, 6;
    mov.u64 %rd2, 0;
    mov.f32 %f1, 0f3F800000;
    mov.f32 %f2, 0f3F7FFFFF;
    mov.f32 %f3, 0f3F800000;
    mov.f32 %f4, 0f3F7FFFFE;
    mov.f32 %f5, 0f00000000;
BURN_LOOP:
    setp.ge.u64 %p1, %rd2, %rd1;
    @%p1 bra BURN_DONE;
    fma.rn.f32 %f1, %f1, %f2, %f5;
    fma.rn.f32 %f3, %f3, %f4, %f5;
    add.u64 %rd2, %rd2, 1;
    bra BURN_LOOP;
BURN_DONE:
    add.f32 %f1, %f1, %f3;
    setp.eq.f32 %p2, %f1, 0fBF800000;
    @%p2 trap;
    ret;
}
\x00"""
# A fatal fault: one thread stores to address 0, so the context is lost with
# CUDA_ERROR_ILLEGAL_ADDRESS at the next synchronize (the marker below names it to fakes).
FAULT_PTX = b"""
.version 6.0
.target sm_50
.address_size 64

// sharegpu-fault
.visible .entry spin(
    .param .u64 cycles
)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<2>;

    mov.u64 %rd1, 0;
    mov.u32 %r1, 1;
    st.global.u32 [%rd1], %r1;
    ret;
}
\x00"""
KERNELS = {"spin": SPIN_PTX, "burn": BURN_PTX}

LIBRARY = "libcuda.so.1"


class ProbeError(Exception):
    def __init__(self, message: str, *, kind: str = "cuda", code: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.code = code


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Cuda:
    """The few driver functions the probe needs."""

    def __init__(self, library: str = LIBRARY) -> None:
        try:
            self.lib = ctypes.CDLL(library)
        except OSError as e:
            raise ProbeError(f"cannot load {library}: {e}", kind="library") from None
        lib = self.lib
        u64, sz, i32 = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
        vp, cp = ctypes.c_void_p, ctypes.c_char_p
        P = ctypes.POINTER
        sigs = {
            "cuInit": [ctypes.c_uint],
            "cuDriverGetVersion": [P(i32)],
            "cuDeviceGet": [P(i32), i32],
            "cuDeviceGetName": [cp, i32, i32],
            "cuDeviceTotalMem_v2": [P(sz), i32],
            "cuDeviceGetAttribute": [P(i32), i32, i32],
            "cuDevicePrimaryCtxRetain": [P(vp), i32],
            "cuDevicePrimaryCtxRelease_v2": [i32],
            "cuCtxSetCurrent": [vp],
            "cuCtxSynchronize": [],
            "cuMemGetInfo_v2": [P(sz), P(sz)],
            "cuMemAlloc_v2": [P(u64), sz],
            "cuMemFree_v2": [u64],
            "cuModuleLoadData": [P(vp), cp],
            "cuModuleGetFunction": [P(vp), vp, cp],
            "cuLaunchKernel": [vp, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                               ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, vp, P(vp), P(vp)],
            "cuGetErrorName": [i32, P(cp)],
        }
        self.fn = {}
        for name, args in sigs.items():
            try:
                f = getattr(lib, name)  # dlsym through the handle: interposers hook here
            except AttributeError:
                raise ProbeError(f"{library} has no {name}", kind="library") from None
            f.argtypes = args
            f.restype = i32
            self.fn[name] = f
        self.ctx = ctypes.c_void_p()
        self.dev = 0
        self.ptrs: list[int] = []

    def name_of(self, code: int) -> str:
        s = ctypes.c_char_p()
        if self.fn["cuGetErrorName"](code, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode(errors="replace")
        return f"CUDA error {code}"

    def call(self, name: str, *args) -> None:
        rc = self.fn[name](*args)
        if rc != CUDA_SUCCESS:
            raise ProbeError(f"{name} failed: {self.name_of(rc)} ({rc})", code=rc)

    def open(self, ordinal: int = 0) -> None:
        self.call("cuInit", 0)
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        self.dev = dev.value
        # the device's primary context, as the runtime API and every framework use it (an
        # interposer may treat contexts made with cuCtxCreate differently: HAMi-core built
        # against CUDA 13 does not count those against the limit)
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), self.dev)
        self.call("cuCtxSetCurrent", self.ctx)

    def close(self) -> None:
        for p in self.ptrs:
            self.fn["cuMemFree_v2"](p)
        self.ptrs.clear()
        if self.ctx.value:
            self.fn["cuDevicePrimaryCtxRelease_v2"](self.dev)
            self.ctx = ctypes.c_void_p()

    def attribute(self, attr: int) -> int:
        v = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(v), attr, self.dev)
        return v.value

    def attribute_or(self, attr: int, default: int) -> int:
        try:
            return self.attribute(attr) or default
        except ProbeError:
            return default

    def device_info(self) -> dict:
        buf = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", buf, 256, self.dev)
        total = ctypes.c_size_t()
        self.call("cuDeviceTotalMem_v2", ctypes.byref(total), self.dev)
        ver = ctypes.c_int()
        self.call("cuDriverGetVersion", ctypes.byref(ver))
        return {
            "name": buf.value.decode(errors="replace"),
            "total_bytes": total.value,
            "total_mib": total.value // MIB,
            "multiprocessors": self.attribute(ATTR_MULTIPROCESSOR_COUNT),
            "driver_version": f"{ver.value // 1000}.{ver.value % 1000 // 10}",
            "driver_version_int": ver.value,
        }

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def try_alloc(self, nbytes: int) -> tuple[int, int]:
        """(CUresult, device pointer)."""
        ptr = ctypes.c_uint64()
        rc = self.fn["cuMemAlloc_v2"](ctypes.byref(ptr), nbytes)
        return rc, ptr.value

    def alloc_free(self, nbytes: int) -> int:
        """Allocate ``nbytes`` and free them again at once: the CUresult of the allocation."""
        rc, ptr = self.try_alloc(nbytes)
        if rc == CUDA_SUCCESS:
            self.free(ptr)
        return rc

    def free(self, ptr: int) -> None:
        self.call("cuMemFree_v2", ctypes.c_uint64(ptr))

    def fits(self, mib: int) -> bool:
        """Whether ``mib`` MiB can be allocated now (freed again at once)."""
        if mib <= 0:
            return True
        rc, ptr = self.try_alloc(mib * MIB)
        if rc == CUDA_SUCCESS:
            self.free(ptr)
            return True
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            return False
        raise ProbeError(f"cuMemAlloc_v2({mib} MiB) failed: {self.name_of(rc)} ({rc})", code=rc)


def grid_blocks(multiprocessors: int, threads_per_multiprocessor: int = 2048) -> int:
    """A launch's grid: WAVES waves of blocks, each wave filling every multiprocessor. Sized from
    what the bare process sees, it is the same work in every pod: an MPS client is shown only its
    share of the SMs, and a grid sized from that would be less work (on an H200 a 30/70 split
    then completed equal kernel counts)."""
    per_wave = max(1, multiprocessors) * max(1, threads_per_multiprocessor // THREADS_PER_BLOCK)
    return per_wave * WAVES


class Kernel:
    def __init__(self, cuda: Cuda, kind: str = "spin") -> None:
        self.cuda = cuda
        self.module = ctypes.c_void_p()
        cuda.call("cuModuleLoadData", ctypes.byref(self.module), KERNELS[kind])
        self.func = ctypes.c_void_p()
        cuda.call("cuModuleGetFunction", ctypes.byref(self.func), self.module, b"spin")
        sms = cuda.attribute(ATTR_MULTIPROCESSOR_COUNT)
        threads = cuda.attribute_or(ATTR_MAX_THREADS_PER_MULTIPROCESSOR, 2048)
        self.clock_khz = cuda.attribute_or(ATTR_CLOCK_RATE, 1_000_000)
        # a grid that fills every multiprocessor WAVES times over: a process held to a part of
        # the SMs (MPS) needs more waves, and so more time, for one launch
        self.grid = grid_blocks(sms, threads)
        self.cycles = ctypes.c_uint64(0)
        self.arg = ctypes.cast(ctypes.pointer(self.cycles), ctypes.c_void_p)
        self.params = (ctypes.c_void_p * 1)(self.arg)

    def cycles_for(self, kernel_ms: float) -> int:
        return max(0, int(self.clock_khz * kernel_ms / WAVES))

    def launch(self, cycles: int, blocks: int) -> None:
        self.cycles.value = cycles
        self.cuda.call("cuLaunchKernel", self.func, blocks, 1, 1, THREADS_PER_BLOCK, 1, 1, 0,
                       None, self.params, None)
        self.cuda.call("cuCtxSynchronize")


def stdin_line(timeout: float) -> bool:
    """Whether a line arrived on stdin within ``timeout`` seconds (False on EOF)."""
    r, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout))
    return bool(r) and bool(sys.stdin.readline())


def act_info(cuda: Cuda, args) -> dict:
    out = cuda.device_info()
    free, total = cuda.mem_info()
    out.update(ctx_free_bytes=free, ctx_total_bytes=total, threads_per_multiprocessor=(
        cuda.attribute_or(ATTR_MAX_THREADS_PER_MULTIPROCESSOR, 2048)))
    return out


def largest_mib(cuda: Cuda, upper: int) -> int:
    """The largest allocation, in whole MiB up to ``upper``, that succeeds now (binary search;
    nothing is kept)."""
    lo, hi = 0, upper + 1  # lo fits; hi is not known to fit
    if cuda.fits(upper):
        lo = hi = upper
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cuda.fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_now(cuda: Cuda, args) -> tuple[int, int, int, int]:
    """(free, total at start, the upper bound searched, the largest allocation that succeeds)."""
    free0, total = cuda.mem_info()
    upper = max(args.upper_mib, total // MIB, free0 // MIB)
    return free0, total, upper, largest_mib(cuda, upper)


def wait_stdin_closed(timeout: float) -> None:
    """Hold on until stdin closes (the check lets go of the probe) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([sys.stdin], [], [], max(0.0, deadline - time.monotonic()))
        if r and not sys.stdin.readline():
            break


def act_mem(cuda: Cuda, args) -> dict:
    free0, total, upper, largest = largest_now(cuda, args)
    single_rc = cuda.alloc_free((largest + 1) * MIB)
    # hold the largest, then ask for 1 MiB more
    rc, held = cuda.try_alloc(largest * MIB) if largest else (CUDA_SUCCESS, 0)
    over_rc = None
    if rc == CUDA_SUCCESS:
        over_rc = cuda.alloc_free(MIB)
        if held:
            cuda.free(held)
    # still alive: a small allocation works again
    after_rc = cuda.alloc_free(MIB)
    free1, _ = cuda.mem_info()
    return {
        "total_bytes": total, "free_bytes": free0, "upper_mib": upper,
        "largest_mib": largest,
        "past_single_code": single_rc, "past_single_name": cuda.name_of(single_rc),
        "hold_largest_code": rc,
        "past_code": over_rc, "past_name": None if over_rc is None else cuda.name_of(over_rc),
        "after_code": after_rc, "after_name": cuda.name_of(after_rc),
        "free_after_bytes": free1,
    }


def act_hold(cuda: Cuda, args) -> dict:
    free0, total = cuda.mem_info()
    rc, ptr = cuda.try_alloc(args.mib * MIB)
    if rc != CUDA_SUCCESS:
        raise ProbeError(f"cuMemAlloc_v2({args.mib} MiB) failed: {cuda.name_of(rc)} ({rc})",
                         code=rc)
    cuda.ptrs.append(ptr)
    free1, _ = cuda.mem_info()
    emit({"ready": True, "held_mib": args.mib, "total_bytes": total, "free_bytes": free0,
          "free_held_bytes": free1})
    wait_stdin_closed(args.timeout)
    cuda.close()
    return {"released": True}


def act_fill(cuda: Cuda, args) -> dict:
    """Take the largest allocation there is and hold it: one pod of a GPU being filled. The ready
    line says what it got and what 1 MiB more gave; it lets go when stdin closes, then checks
    that 1 MiB can be had again."""
    free0, total, _, largest = largest_now(cuda, args)
    rc, held = cuda.try_alloc(largest * MIB) if largest else (CUDA_SUCCESS, 0)
    if rc != CUDA_SUCCESS:
        raise ProbeError(f"cuMemAlloc_v2({largest} MiB) failed: {cuda.name_of(rc)} ({rc})",
                         code=rc)
    if held:
        cuda.ptrs.append(held)
    past_rc = cuda.alloc_free(MIB)
    free1, _ = cuda.mem_info()
    emit({"ready": True, "total_bytes": total, "free_bytes": free0, "largest_mib": largest,
          "free_held_bytes": free1, "past_code": past_rc, "past_name": cuda.name_of(past_rc)})
    wait_stdin_closed(args.timeout)
    for p in cuda.ptrs:
        cuda.free(p)
    cuda.ptrs.clear()
    after_rc = cuda.alloc_free(MIB)
    return {"released": True, "after_code": after_rc, "after_name": cuda.name_of(after_rc)}


def act_spin(cuda: Cuda, args) -> dict:
    k = Kernel(cuda, args.kernel)
    cycles = args.cycles if args.cycles is not None else k.cycles_for(args.kernel_ms)
    blocks = args.blocks or k.grid
    k.launch(cycles, blocks)  # warm-up (module upload, first launch)
    if args.wait_go:
        emit({"ready": True})
        if not stdin_line(args.timeout):
            raise ProbeError("no go line on stdin", kind="usage")
    # settle first (not counted): a throttle that let credit pile up while the probes got
    # ready spends it here
    settle_end = time.monotonic() + args.settle
    while time.monotonic() < settle_end:
        k.launch(cycles, blocks)
    n = 0
    t0 = time.monotonic()
    end = t0 + args.seconds
    now = t0
    while now < end:
        k.launch(cycles, blocks)
        n += 1
        now = time.monotonic()
    elapsed = now - t0
    return {"kernels": n, "elapsed_s": elapsed, "rate": n / elapsed if elapsed else 0.0,
            "cycles": cycles, "blocks": blocks, "threads": THREADS_PER_BLOCK,
            "kernel": args.kernel}


def act_fault(cuda: Cuda, args) -> dict:
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    cuda.call("cuModuleLoadData", ctypes.byref(module), FAULT_PTX)
    cuda.call("cuModuleGetFunction", ctypes.byref(func), module, b"spin")
    if args.wait_go:
        emit({"ready": True})
        if not stdin_line(args.timeout):
            raise ProbeError("no go line on stdin", kind="usage")
    time.sleep(max(0.0, args.seconds))
    cycles = ctypes.c_uint64(0)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(cycles), ctypes.c_void_p))
    code = cuda.fn["cuLaunchKernel"](func, 1, 1, 1, 1, 1, 1, 0, None, params, None)
    if code == CUDA_SUCCESS:
        code = cuda.fn["cuCtxSynchronize"]()
    return {"fault_code": code, "fault_name": cuda.name_of(code)}


def act_allocspeed(cuda: Cuda, args) -> dict:
    nbytes = args.mib * MIB
    pairs = 0
    t0 = time.monotonic()
    end = t0 + args.seconds
    now = t0
    while now < end:
        rc, ptr = cuda.try_alloc(nbytes)
        if rc != CUDA_SUCCESS:
            raise ProbeError(f"cuMemAlloc_v2({args.mib} MiB) failed: {cuda.name_of(rc)} ({rc})",
                             code=rc)
        cuda.free(ptr)
        pairs += 1
        now = time.monotonic()
    elapsed = now - t0
    return {"pairs": pairs, "elapsed_s": elapsed,
            "ops_per_s": 2 * pairs / elapsed if elapsed else 0.0}


ACTIONS = {"info": act_info, "mem": act_mem, "hold": act_hold, "fill": act_fill,
           "spin": act_spin, "allocspeed": act_allocspeed, "fault": act_fault}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sharegpu.isolation_check.probe")
    p.add_argument("action", choices=sorted(ACTIONS))
    p.add_argument("--device", type=int, default=0, help="CUDA ordinal (default 0)")
    p.add_argument("--library", default=LIBRARY)
    p.add_argument("--upper-mib", type=int, default=0, help="mem: search up to this many MiB")
    p.add_argument("--mib", type=int, default=1, help="hold/allocspeed: MiB per allocation")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--kernel", choices=sorted(KERNELS), default="spin",
                   help="spin: the busy loop (clock time); burn: multiply-adds (work)")
    p.add_argument("--kernel-ms", type=float, default=1.0, help="spin: length of one launch")
    p.add_argument("--cycles", type=int, default=None, help="spin: cycles per block")
    p.add_argument("--blocks", type=int, default=0, help="spin: grid size (default: fill)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="spin: launch this many seconds first without counting")
    p.add_argument("--wait-go", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = None
    try:
        cuda = Cuda(args.library)
        cuda.open(args.device)
        out = ACTIONS[args.action](cuda, args)
        out.update(action=args.action, pid=os.getpid())
        emit(out)
        return 0
    except ProbeError as e:
        emit({"error": str(e), "kind": e.kind, "code": e.code, "action": args.action})
        return 3
    finally:
        if cuda is not None:
            with contextlib.suppress(Exception):
                cuda.close()


if __name__ == "__main__":
    sys.exit(main())
