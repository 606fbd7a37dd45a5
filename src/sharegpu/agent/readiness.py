"""Is the node's isolation back-end usable? The agent answers this before it hands a container
an isolated GPU, and refuses (fails closed) when the answer is no.

- ``hami``: the library the agent hands out exists, is an ELF shared object for this machine's
  architecture, and loads in a child process (its dependencies, ``libcuda.so.1`` and
  ``libnvidia-ml.so.1``, resolve).
- ``mps``: the MPS control daemon answers ``get_server_list`` on its pipe directory.
- ``hami-mps``: both, the library first; the reason names the part that is missing and the fix
  says how to provide that part.
- ``none``: always usable (it isolates nothing).

Each check returns a :class:`Readiness` whose ``reason`` says what is wrong and ``fix`` what the
operator does about it; the exact sentences are part of the interface (tests name them).
"""

from __future__ import annotations

import contextlib
import os
import platform
import struct
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .isolation import Backend, preload_list_text

# ELF e_machine values of the architectures Kubernetes GPU nodes run on.
ELF_MACHINES = {62: "x86_64", 183: "aarch64", 21: "ppc64le", 40: "arm", 3: "i386"}
HOST_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21}
ET_DYN = 3

HAMI_FIX = (
    "install HAMi-core: keep the chart's agent.hami.install=true (an init container copies "
    "libvgpu.so from HAMi's image), or point agent.hamiLibrary at a libvgpu.so installed on the "
    "node; pods that may run without isolation can opt out with CGPU_DISABLE=true or the node "
    "label cgpu.disable.isolation=true"
)
MPS_FIX = (
    "start the MPS control daemon: enable the chart's agent.mps.enabled (the mps-control "
    "container runs nvidia-cuda-mps-control on mps and hami-mps nodes), or run "
    "`nvidia-cuda-mps-control -d` with CUDA_MPS_PIPE_DIRECTORY={pipe}; pods that may run "
    "without isolation can opt out with CGPU_DISABLE=true or the node label "
    "cgpu.disable.isolation=true"
)


@dataclass(frozen=True)
class Readiness:
    backend: Backend
    ready: bool
    reason: str = ""
    fix: str = ""

    def message(self, node: str) -> str:
        """The sentence a refused Allocate, the pod's Event and the node condition carry."""
        if self.ready:
            return f"node {node}: isolation back-end {self.backend.value} is ready"
        return (f"node {node}: isolation back-end {self.backend.value} is not usable: "
                f"{self.reason}; fix: {self.fix}")


READY_NONE = Readiness(Backend.NONE, True)


def host_machine() -> int | None:
    return HOST_MACHINES.get(platform.machine().lower())


def elf_problem(path: str, machine: int | None = None) -> str | None:
    """Why ``path`` is not an ELF shared object this machine can load, or ``None``."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except FileNotFoundError:
        return f"the HAMi-core library {path} does not exist"
    except IsADirectoryError:
        return f"the HAMi-core library {path} is a directory, not a file"
    except OSError as e:
        return f"the HAMi-core library {path} cannot be read ({e.strerror or e})"
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return f"{path} is not an ELF file"
    is64 = head[4] == 2
    little = head[5] == 1
    fmt = "<HH" if little else ">HH"
    e_type, e_machine = struct.unpack(fmt, head[16:20])
    if e_type != ET_DYN:
        return f"{path} is not an ELF shared object (e_type {e_type}, a library has {ET_DYN})"
    want = host_machine() if machine is None else machine
    if want is not None and e_machine != want:
        built = ELF_MACHINES.get(e_machine, f"machine {e_machine}")
        return (f"{path} is built for {built}, but this node is "
                f"{ELF_MACHINES.get(want, f'machine {want}')}")
    if (sys.maxsize > 2**32) != is64:
        return f"{path} is a {'64' if is64 else '32'}-bit library; this node runs the other size"
    return None


# HAMi-core's dlsym hook answers a CUDA name with the same name looked up in HAMi-core itself,
# so its hooks must be exported symbols of the library (its build.sh builds them so): a build
# with hidden symbols loads, answers with the driver's own functions and limits nothing (as
# measured on an H200).
HAMI_HOOKS = ("cuMemAlloc_v2", "cuMemGetInfo_v2")

# Loads the library and names each hook it does not export itself (a symbol found in a library
# it depends on, the driver, does not count).
_LOAD = """import ctypes, os, sys
path = sys.argv[1]
lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
class Info(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
dladdr = ctypes.CDLL(None).dladdr
dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(Info)]
missing = []
for name in sys.argv[2:]:
    try:
        f = getattr(lib, name)
    except AttributeError:
        missing.append(name)
        continue
    info = Info()
    at = ctypes.cast(f, ctypes.c_void_p).value
    if not dladdr(at, ctypes.byref(info)) or not info.fname or \\
            os.path.realpath(info.fname.decode()) != os.path.realpath(path):
        missing.append(name)
if missing:
    print("MISSING " + " ".join(missing))
    sys.exit(3)
"""


def load_problem(path: str, timeout_s: float = 20.0) -> str | None:
    """Load ``path`` in a child process (a library that crashes its loader cannot take the
    agent with it); why it failed, or ``None``."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    try:
        r = subprocess.run([sys.executable, "-c", _LOAD, path, *HAMI_HOOKS],
                           capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"{path} did not finish loading within {timeout_s:.0f}s"
    except OSError as e:
        return f"a child process to load {path} could not start ({e})"
    if r.returncode == 0:
        return None
    if r.returncode == 3 and r.stdout.startswith("MISSING "):
        names = ", ".join(r.stdout.split()[1:])
        return (f"{path} loads but does not export HAMi-core's CUDA hooks ({names}): built with "
                "hidden symbols it would limit nothing; use the libvgpu.so HAMi's image ships "
                "(built by HAMi-core's build.sh)")
    lines = [ln.strip() for ln in (r.stderr or "").splitlines() if ln.strip()]
    detail = lines[-1] if lines else f"exit status {r.returncode}"
    if r.returncode < 0:
        detail = f"the loader died with signal {-r.returncode}"
    detail = detail.removeprefix("OSError: ")
    return f"{path} cannot be loaded: {detail}"


def write_preload_list(path: str) -> str | None:
    """Make the host file ``path`` hold what containers get as ``/etc/ld.so.preload`` (written
    whole, and only when it differs); why it could not be, or ``None``."""
    want = preload_list_text()
    if os.path.isdir(path):
        return (f"the preload list {path} is a directory (a container runtime makes one when a "
                "mount's source is missing): remove it")
    try:
        with open(path) as f:
            if f.read() == want:
                return None
    except FileNotFoundError:
        pass
    except OSError as e:
        return f"the preload list {path} cannot be read ({e.strerror or e})"
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            f.write(want)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return f"the preload list {path} cannot be written ({e.strerror or e})"
    return None


def check_hami(path: str, *, machine: int | None = None, load: bool = True) -> Readiness:
    problem = elf_problem(path, machine) or (load_problem(path) if load else None)
    if problem:
        return Readiness(Backend.HAMI, False, problem, HAMI_FIX)
    return Readiness(Backend.HAMI, True)


def check_hami_mps(
    hami: Readiness, pipe_dir: str, control: Sequence[str] = ("nvidia-cuda-mps-control",),
    timeout_s: float = 5.0,
) -> Readiness:
    """``hami-mps``: HAMi-core's part (``hami``, as :func:`check_hami` or the agent's own
    checks of the library answered), then the MPS control daemon."""
    if not hami.ready:
        return Readiness(Backend.HAMI_MPS, False, f"memory limit (HAMi-core): {hami.reason}",
                         hami.fix)
    mps = check_mps(pipe_dir, control, timeout_s)
    if not mps.ready:
        return Readiness(Backend.HAMI_MPS, False, f"compute limit (MPS): {mps.reason}",
                         mps.fix)
    return Readiness(Backend.HAMI_MPS, True)


def check_mps(
    pipe_dir: str, control: Sequence[str] = ("nvidia-cuda-mps-control",), timeout_s: float = 5.0
) -> Readiness:
    """Ask the control daemon for its server list through its pipe directory."""
    fix = MPS_FIX.format(pipe=pipe_dir)
    if not os.path.isdir(pipe_dir):
        return Readiness(Backend.MPS, False,
                         f"the MPS pipe directory {pipe_dir} does not exist", fix)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir)
    try:
        r = subprocess.run(list(control), input="get_server_list\n", capture_output=True,
                           text=True, timeout=timeout_s, env=env)
    except FileNotFoundError:
        return Readiness(Backend.MPS, False,
                         f"{control[0]} is not installed where the agent runs", fix)
    except subprocess.TimeoutExpired:
        return Readiness(Backend.MPS, False,
                         f"the MPS control daemon did not answer on {pipe_dir} within "
                         f"{timeout_s:.0f}s", fix)
    except OSError as e:
        return Readiness(Backend.MPS, False, f"{control[0]} could not be run ({e})", fix)
    if r.returncode != 0:
        out = (r.stderr or r.stdout or "").strip().splitlines()
        detail = out[-1] if out else f"exit status {r.returncode}"
        return Readiness(Backend.MPS, False,
                         f"the MPS control daemon does not answer on {pipe_dir} ({detail})", fix)
    return Readiness(Backend.MPS, True)
