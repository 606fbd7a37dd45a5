"""Real Kubernetes nodes on this machine for sharegpu's end-to-end tests.

:class:`RealNodeCluster` puts beside the test control plane (controlplane.py):

- **kube-proxy** (iptables mode, the pinned one of the control plane binary), so pods reach the
  API server and Services through their ClusterIPs;
- **ClusterDNS**, a stand-in for the cluster's DNS: it answers A queries for
  ``<service>.<namespace>.svc.cluster.local`` with the Service's ClusterIP, read from the API
  server (nothing else: no pod records, no forwarding);
- one or more :class:`RealNode`: the upstream **kubelet** (v1.37.2, the control plane binary's
  ``kubelet``) and **containerd** v2.4.2 with **runc** v1.5.2 (scripts/build-node.sh), on a
  **bridge** CNI network of its own (Debian's containernetworking-plugins).

Each node lives in a mount namespace of its own (a holder process made with ``unshare``; the
kubelet and containerd enter it with ``nsenter``) where the host paths a GPU node's software uses
are bind mounts of the node's own root directory: ``/var/lib/kubelet``, ``/var/lib/sharegpu``,
``/usr/local/vgpu``, ``/run/nvidia`` (the driver root ``/run/nvidia/driver`` holding the fake
``libnvidia-ml.so.1``, a fake ``libcuda.so.1`` and the stand-in ``nvidia-cuda-mps-control``, as a
driver container would put them, and ``fakenvml/procs``, the GPU processes the fake NVML reports:
:meth:`RealNode.set_gpu_processes`), ``/var/log/nvidia-mps``, ``/run/cdi``, ``/var/log/pods``,
``/tmp/sharegpu-vgpu`` and ``/tmp/vgpulock`` (and ``/run/containerd``, the shims' sockets). So
the chart's default host paths serve every node unchanged, and nodes never share a file. Each
node has its own cgroup parent (``cgroupRoot``), ports, containerd root, state and socket, CNI
bridge and subnet (10.244.<i>.0/24).

containerd's runtime is a stand-in for NVIDIA's container runtime
(standins/nvidia-container-runtime.py) in front of runc: a container whose env names GPUs gets
the driver's files mounted, as NVIDIA's runtime does.

Teardown (``stop()``, also at exit) is by PID: the kubelet, every process in the node's cgroups
(pods), every process in the node's mount namespace (containerd, shims), then the holder; the
namespace's mounts go with it; then the cgroups, the bridge and the node's directory are removed,
kube-proxy's rules are cleaned (``kube-proxy --cleanup``) and the kubelet's chains removed.
A piece that cannot start raises :class:`NodeError` (the tests fail, never skip).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .controlplane import ControlPlane, _die_with_parent, _kill_group, free_port

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / ".tools"
NODE_BIN = Path(os.environ.get("SHAREGPU_NODE_BIN_DIR", TOOLS / "node" / "bin"))
IMAGES = Path(os.environ.get("SHAREGPU_IMAGES_DIR", TOOLS / "images"))
STANDINS = Path(__file__).resolve().parent / "standins"
CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
CLUSTER_CIDR = "10.244.0.0/16"
CLUSTER_DOMAIN = "cluster.local"
CGROUP_FS = Path("/sys/fs/cgroup")
# host paths bound to the node's own directories inside its mount namespace
NODE_MOUNTS = {
    "/var/lib/kubelet": "kubelet",
    "/var/lib/sharegpu": "sharegpu",
    "/usr/local/vgpu": "vgpu",
    "/run/nvidia": "run-nvidia",
    "/var/log/nvidia-mps": "log-nvidia-mps",
    "/run/cdi": "cdi",
    "/var/log/pods": "pod-logs",
    "/tmp/sharegpu-vgpu": "vgpu-cache",
    "/tmp/vgpulock": "vgpu-lock",  # HAMi-core's lock directory
    "/run/containerd": "run-containerd",  # the shims' sockets, fifos and runc state
}
IMAGE_ARCHIVES = ("pause", "sharegpu", "hami", "hami-nolib", "kube-scheduler")


class NodeError(RuntimeError):
    """A real node's tool could not be built, or a piece of the node could not start."""


def _run(argv: Sequence[str], what: str, timeout: float = 3600, **kw: Any) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if proc.returncode != 0:
        raise NodeError(f"{what}: {' '.join(argv)} exited {proc.returncode}:\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def build_tools() -> dict[str, str]:
    """Install the Debian packages, build containerd/runc and make the images (each script is a
    no-op when up to date); return the image references (refs.env). Raises NodeError."""
    if os.geteuid() != 0:
        raise NodeError("real nodes need root (the kubelet, containerd, mounts, cgroups)")
    for script in ("install-node-packages.sh", "build-node.sh", "build-node-images.sh"):
        _run(["bash", str(REPO / "scripts" / script)], script, cwd=REPO)
    refs = {}
    for line in (IMAGES / "refs.env").read_text().splitlines():
        k, _, v = line.partition("=")
        refs[k] = v
    return refs


def host_address() -> str:
    """This machine's address on its default route (where pods reach the API server)."""
    out = _run(["ip", "-4", "-o", "route", "get", "198.51.100.1"], "the default route's source")
    words = out.split()
    if "src" not in words:
        raise NodeError(f"no source address in `ip route get`: {out!r}")
    return words[words.index("src") + 1]


def _launch(argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        out.flush()
        return subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _wait(what: str, probe: Callable[[], bool], timeout: float,
          alive: Callable[[], str | None] = lambda: None, every: float = 0.2) -> float:
    """Poll ``probe`` until true; ``alive()`` names a dead piece (then fail at once). Returns
    the seconds it took; raises NodeError on time-out."""
    t0 = time.monotonic()
    while True:
        dead = alive()
        if dead:
            raise NodeError(f"{what}: {dead}")
        with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
            if probe():
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise NodeError(f"{what}: not after {timeout:.0f}s")
        time.sleep(every)


# ---------------------------------------------------------------------------------------------
# Cluster DNS stand-in


class ClusterDNS:
    """A stand-in for the cluster's DNS: UDP on the given addresses, port 53. An A query for
    ``<svc>.<ns>.svc.cluster.local`` is answered with the Service's ClusterIP (asked of the API
    server each time); other names under cluster.local are NXDOMAIN, names outside it REFUSED."""

    def __init__(self, cp: ControlPlane, addresses: Sequence[str]) -> None:
        self.cp = cp
        self.socks: list[socket.socket] = []
        for addr in addresses:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, 53))
            s.settimeout(0.5)
            self.socks.append(s)
        self.queries = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, args=(s,), daemon=True,
                                          name=f"cluster-dns-{i}")
                         for i, s in enumerate(self.socks)]
        for t in self._threads:
            t.start()

    def lookup(self, name: str) -> str | None:
        labels = name.rstrip(".").lower().split(".")
        suffix = ["svc", *CLUSTER_DOMAIN.split(".")]
        if len(labels) != 2 + len(suffix) or labels[2:] != suffix:
            return None
        status, body = self.cp.request("GET", f"/api/v1/namespaces/{labels[1]}/services/"
                                              f"{labels[0]}", timeout=5)
        if status != 200:
            return None
        ip = json.loads(body).get("spec", {}).get("clusterIP")
        return ip if ip and ip != "None" else None

    def answer(self, query: bytes) -> bytes | None:
        if len(query) < 12:
            return None
        qid, flags, qdcount = struct.unpack("!HHH", query[:6])
        if qdcount != 1 or flags & 0x8000:
            return None
        pos, labels = 12, []
        while pos < len(query) and query[pos]:
            n = query[pos]
            labels.append(query[pos + 1:pos + 1 + n].decode(errors="replace"))
            pos += 1 + n
        pos += 1
        if pos + 4 > len(query):
            return None
        qtype, _qclass = struct.unpack("!HH", query[pos:pos + 4])
        question = query[12:pos + 4]
        name = ".".join(labels)
        rd = flags & 0x0100
        ip = None
        if name.lower().endswith("." + CLUSTER_DOMAIN) or name.lower() == CLUSTER_DOMAIN:
            ip = self.lookup(name)
            rcode = 0 if ip else 3  # NOERROR / NXDOMAIN
        else:
            rcode = 5  # REFUSED
        answers = b""
        if ip and qtype == 1:
            answers = (b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4)
                       + socket.inet_aton(ip))
        header = struct.pack("!HHHHHH", qid, 0x8400 | rd | rcode, 1, 1 if answers else 0, 0, 0)
        return header + question + answers

    def _serve(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                data, peer = sock.recvfrom(1500)
            except (TimeoutError, OSError):
                continue
            self.queries += 1
            with contextlib.suppress(Exception):
                reply = self.answer(data)
                if reply:
                    sock.sendto(reply, peer)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        for s in self.socks:
            s.close()


# ---------------------------------------------------------------------------------------------
# cgroups (v1 here; the kubelet runs with failCgroupV1: false)


def _cgroup_dirs(path: str) -> list[Path]:
    """The directories of cgroup ``path`` in every mounted v1 hierarchy (or the v2 one)."""
    if (CGROUP_FS / "cgroup.controllers").exists():
        return [CGROUP_FS / path.lstrip("/")]
    out = []
    for h in sorted(CGROUP_FS.iterdir()):
        if h.is_dir() and not h.is_symlink():
            out.append(h / path.lstrip("/"))
    return out


def make_cgroup(path: str) -> None:
    for d in _cgroup_dirs(path):
        d.mkdir(parents=True, exist_ok=True)
        if (d / "cpuset.cpus").exists():
            # a v1 cpuset child starts empty: copy its parent's CPUs and memory nodes
            for f in ("cpuset.cpus", "cpuset.mems"):
                if not (d / f).read_text().strip():
                    (d / f).write_text((d.parent / f).read_text())


def cgroup_pids(path: str) -> set[int]:
    pids: set[int] = set()
    for d in _cgroup_dirs(path):
        if not d.exists():
            continue
        for procs in d.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.update(int(x) for x in procs.read_text().split())
    return pids


def remove_cgroup(path: str) -> None:
    for d in _cgroup_dirs(path):
        if not d.exists():
            continue
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            d.rmdir()


def _kill_pids(pids: set[int]) -> None:
    me = os.getpid()
    for pid in pids - {me}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _mnt_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def pids_in_mount_ns(ns: str) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _mnt_ns(int(entry)) == ns:
            out.add(int(entry))
    return out


# the chains the kubelet makes in this machine's tables (its iptables canary, and the rule
# dropping outside traffic to 127.0.0.0/8); kube-proxy --cleanup removes only its own
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT")


def remove_kubelet_chains() -> None:
    for ipt in ("iptables", "ip6tables"):
        if not shutil.which(ipt):
            continue
        for chain in ("INPUT", "OUTPUT"):
            for _ in range(10):
                if subprocess.run([ipt, "-t", "filter", "-D", chain, "-j", "KUBE-FIREWALL"],
                                  capture_output=True).returncode != 0:
                    break
        for table in ("mangle", "nat", "filter"):
            for c in KUBELET_CHAINS:
                subprocess.run([ipt, "-t", table, "-F", c], capture_output=True)
                subprocess.run([ipt, "-t", table, "-X", c], capture_output=True)


# ---------------------------------------------------------------------------------------------
# kube-proxy


class KubeProxy:
    """kube-proxy (iptables mode) in this machine's network namespace, for every node."""

    def __init__(self, cp: ControlPlane, node_name: str, workdir: Path) -> None:
        self.cp, self.workdir = cp, workdir
        self.kubeconfig = cp.kubeconfig_for("system:kube-proxy")
        self.healthz = free_port()
        self.args = [
            "kube-proxy", f"--kubeconfig={self.kubeconfig}", f"--hostname-override={node_name}",
            "--proxy-mode=iptables", f"--cluster-cidr={CLUSTER_CIDR}",
            f"--healthz-bind-address=127.0.0.1:{self.healthz}",
            f"--metrics-bind-address=127.0.0.1:{free_port()}",
            # leave this machine's conntrack and localhost settings as they are
            "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0", "--iptables-localhost-nodeports=false",
            "--v=2",
        ]
        self.log = workdir / "logs" / "kube-proxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        self.proc = _launch([str(self.cp.binary), *self.args], self.log)

        def probe() -> bool:
            import urllib.request

            url = f"http://127.0.0.1:{self.healthz}/healthz"
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200

        def alive() -> str | None:
            if self.proc is not None and self.proc.poll() is not None:
                return f"kube-proxy exited {self.proc.returncode}:\n{_tail(self.log)}"
            return None

        return _wait("kube-proxy /healthz", probe, 60, alive)

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc, grace=5)  # type: ignore[arg-type]
            self.proc = None
        subprocess.run([str(self.cp.binary), "kube-proxy", "--cleanup"],
                       capture_output=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# a node


@dataclass
class NodeTimes:
    containerd_s: float = 0.0
    images_s: float = 0.0
    kubelet_ready_s: float = 0.0
    restarts: dict[str, list[float]] = field(default_factory=dict)


class RealNode:
    """The kubelet and containerd of node ``name`` (index ``index``: its subnet, bridge and
    cgroup parent), in a mount namespace of its own under ``workdir``. ``gpus`` is the fake
    NVML's GPU list (``NAME:MIB,...``); ``labels`` go to ``--node-labels``."""

    def __init__(self, cp: ControlPlane, name: str, index: int, workdir: Path, *,
                 gpus: str = "Tesla T4:15109,Tesla T4:15109",
                 labels: Mapping[str, str] | None = None, run_id: str = "") -> None:
        self.cp, self.name, self.index = cp, name, index
        self.dir = workdir / name
        self.gpus = gpus
        self.labels = dict(labels or {})
        self.run_id = run_id or f"{os.getpid()}"
        self.bridge = f"sg{self.run_id[-6:]}n{index}"[:15]
        self.subnet = f"10.244.{index}.0/24"
        self.gateway = f"10.244.{index}.1"
        self.cgroup_root = f"/sharegpu-e2e-{self.run_id}-{name}"
        self.state = self.dir / "state"
        self.socket = self.state / "containerd.sock"
        self.kubelet_port = free_port()
        self.kubelet_healthz = free_port()
        self.holder: subprocess.Popen[bytes] | None = None
        self.containerd: subprocess.Popen[bytes] | None = None
        self.kubelet: subprocess.Popen[bytes] | None = None
        self.mnt_ns: str | None = None
        self.times = NodeTimes()
        self._created_targets: list[Path] = []
        self._prepared = False
        self.env = {
            "PATH": f"{NODE_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "LANG": "C.UTF-8",
        }

    # -- paths ---------------------------------------------------------------------------------

    def host_path(self, node_path: str) -> Path:
        """Where a path of the node's mount namespace lies on this machine."""
        for target, sub in NODE_MOUNTS.items():
            if node_path == target or node_path.startswith(target + "/"):
                return self.dir / sub / node_path[len(target):].lstrip("/")
        return Path(node_path)

    @property
    def driver_root(self) -> Path:
        return self.host_path("/run/nvidia/driver")

    def log(self, component: str) -> Path:
        return self.dir / "logs" / f"{component}.log"

    # -- set-up --------------------------------------------------------------------------------

    def _prepare(self) -> None:
        if self._prepared:
            return
        self._prepared = True
        for sub in ("logs", "state", "containerd", "cni/net.d", "cni/ipam", *NODE_MOUNTS.values()):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._install_driver()
        self._write_runtime_wrapper()
        self._write_containerd_config()
        self._write_cni_config()
        self._make_bridge()
        make_cgroup(self.cgroup_root)

    def _install_driver(self) -> None:
        """The fake driver where a driver container puts it: /run/nvidia/driver/{lib,bin}."""
        from isolation.clibs import build_fake_cuda

        lib, bin_ = self.driver_root / "lib", self.driver_root / "bin"
        lib.mkdir(parents=True, exist_ok=True)
        bin_.mkdir(parents=True, exist_ok=True)
        fakenvml = REPO / "tests" / "agent" / "fakenvml" / "fakenvml.c"
        _run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib / "libnvidia-ml.so.1"),
              str(fakenvml)], "compiling the fake libnvidia-ml.so.1")
        build_fake_cuda(lib)
        # the GPU processes the fake NVML reports (set_gpu_processes), none to begin with
        (self.driver_root / "fakenvml").mkdir(exist_ok=True)
        (self.driver_root / "fakenvml" / "procs").write_text("")
        mps = REPO / "tests" / "agent" / "standins" / "nvidia-cuda-mps-control"
        shutil.copy2(mps, bin_ / "nvidia-cuda-mps-control")
        (bin_ / "nvidia-cuda-mps-control").chmod(0o755)

    def set_gpu_processes(self, procs: Sequence[tuple[int, int, int]]) -> None:
        """What the node's fake NVML reports as the compute processes on its GPUs: ``(GPU
        index, PID in the host's PID namespace, MiB used)`` each, as a driver sees every process
        on the node. The list is replaced whole (the runtime stand-in mounts its directory into
        every GPU container)."""
        d = self.driver_root / "fakenvml"
        tmp = d / ".procs.new"
        tmp.write_text("".join(f"{gpu} {pid} {mib}\n" for gpu, pid, mib in procs))
        os.replace(tmp, d / "procs")

    def _write_runtime_wrapper(self) -> None:
        wrapper = self.dir / "nvidia-container-runtime"
        wrapper.write_text(
            "#!/bin/sh\n"
            f"exec {sys.executable} {STANDINS / 'nvidia-container-runtime.py'} "
            f"--runc {NODE_BIN / 'runc'} --driver-root /run/nvidia/driver "
            f"--gpus '{self.gpus}' -- \"$@\"\n")
        wrapper.chmod(0o755)

    def _write_containerd_config(self) -> None:
        cni_bins = [d for d in CNI_BIN_DIRS if Path(d, "bridge").exists()]
        if not cni_bins:
            raise NodeError(f"no CNI bridge plugin in {CNI_BIN_DIRS} "
                            "(scripts/install-node-packages.sh: containernetworking-plugins)")
        refs = _refs()
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        cfg = f"""version = 3
root = "{self.dir / 'containerd'}"
state = "{self.state}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[debug]
  level = "info"
[{runtime}]
  enable_cdi = true
  cdi_spec_dirs = ["/run/cdi"]
  restrict_oom_score_adj = true
  tolerate_missing_hugetlb_controller = true
  netns_mounts_under_state_dir = true
[{runtime}.containerd]
  default_runtime_name = "runc"
[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{runtime}.containerd.runtimes.runc.options]
  BinaryName = "{self.dir / 'nvidia-container-runtime'}"
  SystemdCgroup = false
[{runtime}.cni]
  bin_dirs = {json.dumps(cni_bins)}
  conf_dir = "{self.dir / 'cni' / 'net.d'}"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{refs['PAUSE_REF']}"
"""
        (self.dir / "containerd.toml").write_text(cfg)

    def _write_cni_config(self) -> None:
        conf = {
            "cniVersion": "1.0.0", "name": f"sharegpu-{self.name}",
            "plugins": [
                {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(self.dir / "cni" / "ipam"),
                          "ranges": [[{"subnet": self.subnet, "gateway": self.gateway}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (self.dir / "cni" / "net.d" / "10-sharegpu.conflist").write_text(json.dumps(conf))

    def _make_bridge(self) -> None:
        """The bridge with its gateway address, before any pod (the cluster DNS listens there)."""
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        _run(["ip", "link", "add", self.bridge, "type", "bridge"], "creating the bridge")
        _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge], "bridge address")
        _run(["ip", "link", "set", self.bridge, "up"], "bridge up")

    def _start_holder(self) -> None:
        script = ["set -e"]
        for target, sub in NODE_MOUNTS.items():
            t = Path(target)
            if not t.exists():
                t.mkdir(parents=True)
                self._created_targets.append(t)
            script.append(f"mount --bind '{self.dir / sub}' '{target}'")
        script += [f"touch '{self.dir / 'mounted'}'", "exec sleep infinity"]
        self.holder = _launch(["unshare", "--mount", "--propagation", "slave", "sh", "-c",
                               "\n".join(script)], self.log("holder"))
        holder = self.holder

        def alive() -> str | None:
            if holder.poll() is not None:
                return f"the mount namespace holder exited:\n{_tail(self.log('holder'))}"
            return None

        _wait(f"{self.name}: node mounts", (self.dir / "mounted").exists, 30, alive)
        self.mnt_ns = _mnt_ns(holder.pid)

    def _enter(self, argv: Sequence[str]) -> list[str]:
        assert self.holder is not None
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--", *argv]

    def start_containerd(self) -> float:
        self.containerd = _launch(
            self._enter([str(NODE_BIN / "containerd"), "--config",
                         str(self.dir / "containerd.toml")]),
            self.log("containerd"), env=self.env)
        proc = self.containerd

        def alive() -> str | None:
            if proc.poll() is not None:
                return f"containerd exited {proc.returncode}:\n{_tail(self.log('containerd'))}"
            return None

        return _wait(f"{self.name}: containerd", lambda: self.ctr("version") is not None, 60,
                     alive, every=0.3)

    def ctr(self, *args: str, timeout: float = 300) -> str | None:
        proc = subprocess.run([str(NODE_BIN / "ctr"), "--address", str(self.socket),
                               "--namespace", "k8s.io", *args], capture_output=True, text=True,
                              timeout=timeout)
        return proc.stdout if proc.returncode == 0 else None

    def import_images(self, names: Sequence[str] = IMAGE_ARCHIVES) -> float:
        t0 = time.monotonic()
        for name in names:
            archive = IMAGES / f"{name}.tar"
            if not archive.is_file():
                raise NodeError(f"{archive} is missing (scripts/build-node-images.sh)")
            _run([str(NODE_BIN / "ctr"), "--address", str(self.socket), "--namespace", "k8s.io",
                  "images", "import", "--snapshotter", "overlayfs", str(archive)],
                 f"{self.name}: importing {archive.name}", timeout=600)
        return time.monotonic() - t0

    def _kubelet_config(self) -> Path:
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": "0.0.0.0", "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.kubelet_healthz,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.cp.ca_path)}},
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDomain": CLUSTER_DOMAIN, "clusterDNS": [self.gateway],
            "resolvConf": "/etc/resolv.conf", "failSwapOn": False,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False, "podLogsDir": "/var/log/pods",
            "nodeStatusUpdateFrequency": "5s", "syncFrequency": "10s",
            "fileCheckFrequency": "10s", "rotateCertificates": False,
            "registerNode": True, "maxPods": 110,
        }
        path = self.dir / "kubelet-config.json"
        path.write_text(json.dumps(cfg, indent=1))
        return path

    def start_kubelet(self) -> float:
        if not hasattr(self, "_kubeconfig"):
            self._kubeconfig = self.cp.kubeconfig_for(f"system:node:{self.name}",
                                                      ["system:nodes"])
        args = [str(self.cp.binary), "kubelet", f"--config={self._kubelet_config()}",
                f"--kubeconfig={self._kubeconfig}", f"--hostname-override={self.name}",
                "--root-dir=/var/lib/kubelet", "--v=2"]
        if self.labels:
            args.append("--node-labels=" + ",".join(f"{k}={v}" for k, v in self.labels.items()))
        self.kubelet = _launch(self._enter(args), self.log("kubelet"), env=self.env)
        return self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> float:
        proc = self.kubelet
        assert proc is not None

        def alive() -> str | None:
            if proc.poll() is not None:
                return f"the kubelet exited {proc.returncode}:\n{_tail(self.log('kubelet'))}"
            return None

        def ready() -> bool:
            status, body = self.cp.request("GET", f"/api/v1/nodes/{self.name}", timeout=5)
            if status != 200:
                return False
            conds = json.loads(body).get("status", {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        return _wait(f"{self.name}: Node Ready", ready, timeout, alive, every=0.25)

    def start(self) -> RealNode:
        atexit.register(self.stop)
        try:
            self._prepare()
            self._start_holder()
            self.times.containerd_s = self.start_containerd()
            self.times.images_s = self.import_images()
            self.times.kubelet_ready_s = self.start_kubelet()
        except BaseException:
            self.stop()
            raise
        return self

    # -- faults --------------------------------------------------------------------------------

    def stop_kubelet(self) -> None:
        if self.kubelet is not None:
            _kill_group(self.kubelet, grace=10)  # type: ignore[arg-type]
            self.kubelet = None

    def restart_kubelet(self) -> float:
        self.stop_kubelet()
        t = self.start_kubelet()
        self.times.restarts.setdefault("kubelet", []).append(t)
        return t

    def restart_containerd(self) -> float:
        """SIGTERM containerd and start it again; shims and containers keep running."""
        if self.containerd is not None:
            # containerd only: its shims are other processes of the namespace and must live on
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.containerd.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.containerd.wait(timeout=20)
            if self.containerd.poll() is None:
                os.kill(self.containerd.pid, signal.SIGKILL)
                self.containerd.wait(timeout=10)
        t = self.start_containerd()
        self.times.restarts.setdefault("containerd", []).append(t)
        return t

    def _logged_after(self, since: float, matches: Callable[[str], bool]) -> float | None:
        """The wall-clock time of the kubelet's first klog line after ``since`` (time.time())
        that ``matches``; None before there is one."""
        import datetime as dt

        year = dt.datetime.now().year
        for line in _tail(self.log("kubelet"), 5000).splitlines():
            if len(line) < 21 or not matches(line):
                continue
            try:
                stamp = dt.datetime.strptime(f"{year}{line[1:21]}", "%Y%m%d %H:%M:%S.%f")
            except ValueError:
                continue
            t = stamp.replace(tzinfo=dt.UTC).timestamp()
            if t >= since:
                return t
        return None

    def plugin_registered_after(self, since: float, resource: str = "") -> float | None:
        """The wall-clock time of the kubelet's first device-plugin registration logged after
        ``since`` (time.time()), from its klog lines; None before there is one. With
        ``resource``: the time the kubelet had that plugin's devices ("State pushed")."""
        if resource:
            return self._logged_after(since, lambda line: (
                "State pushed for device plugin" in line and f'resource="{resource}"' in line
                and "resourceCapacity=0" not in line))
        return self._logged_after(since, lambda line: any(m in line for m in (
            "Got registration request from device plugin", "Connected to new client")))

    def api_synced_after(self, since: float) -> float | None:
        """The wall-clock time of the kubelet's first pods from the API server after ``since``
        (its "SyncLoop ADD" source="api"); None before. Until then, after a restart, the
        kubelet still counts the devices of pods deleted while it was down (it frees them only
        once its sources are ready), so a pod it admits then may be refused by the kubelet."""
        return self._logged_after(since, lambda line: '"SyncLoop ADD" source="api"' in line)

    # -- teardown ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Kill everything of this node by PID; remove its mounts (with its namespace), cgroups,
        bridge and directory. Idempotent."""
        self.stop_kubelet()
        for _ in range(3):
            _kill_pids(cgroup_pids(self.cgroup_root))
            if self.mnt_ns:
                _kill_pids(pids_in_mount_ns(self.mnt_ns))
            time.sleep(0.2)
        for proc in (self.containerd, self.holder):
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        self.containerd = self.holder = None
        self.mnt_ns = None
        self._prepared = False
        remove_cgroup(self.cgroup_root)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        for t in reversed(self._created_targets):
            with contextlib.suppress(OSError):
                t.rmdir()
        self._created_targets.clear()
        if self.dir.exists() and not os.environ.get("SHAREGPU_E2E_KEEP"):
            shutil.rmtree(self.dir, ignore_errors=True)


def _refs() -> dict[str, str]:
    refs = {}
    path = IMAGES / "refs.env"
    if not path.is_file():
        raise NodeError(f"{path} is missing (scripts/build-node-images.sh)")
    for line in path.read_text().splitlines():
        k, _, v = line.partition("=")
        refs[k] = v
    return refs


# ---------------------------------------------------------------------------------------------
# the cluster


class RealNodeCluster:
    """The control plane (advertised on this machine's address), kube-proxy, the cluster DNS
    stand-in and ``nodes`` real nodes (name, labels, fake GPUs)."""

    def __init__(self, binary: Path, nodes: Sequence[tuple[str, Mapping[str, str], str]],
                 workdir: Path | None = None) -> None:
        import tempfile

        self.address = host_address()
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="sgpu-nodes-"))
        self.refs: dict[str, str] = {}
        self.cp = ControlPlane(binary, advertise_address=self.address)
        self.node_specs = list(nodes)
        self.nodes: list[RealNode] = []
        self.proxy: KubeProxy | None = None
        self.dns: ClusterDNS | None = None
        self.seconds: dict[str, float] = {}

    def start(self) -> RealNodeCluster:
        atexit.register(self.stop)
        try:
            t0 = time.monotonic()
            self.refs = build_tools()
            self.seconds["tools"] = time.monotonic() - t0
            t0 = time.monotonic()
            self.cp.start()
            self.seconds["controlplane"] = time.monotonic() - t0
            run_id = f"{os.getpid()}"
            self.nodes = [RealNode(self.cp, name, i, self.workdir, gpus=gpus, labels=labels,
                                   run_id=run_id)
                          for i, (name, labels, gpus) in enumerate(self.node_specs)]
            for node in self.nodes:
                node._prepare()
            self.dns = ClusterDNS(self.cp, [n.gateway for n in self.nodes])
            for node in self.nodes:
                t0 = time.monotonic()
                node.start()
                self.seconds[node.name] = time.monotonic() - t0
            # after the nodes registered: kube-proxy reads its node's address from its Node
            self.proxy = KubeProxy(self.cp, self.nodes[0].name, self.workdir)
            self.seconds["kube-proxy"] = self.proxy.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        if self.dns is not None:
            self.dns.stop()
            self.dns = None
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        remove_kubelet_chains()
        self.cp.stop()
        if self.workdir.exists() and not os.environ.get("SHAREGPU_E2E_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)
