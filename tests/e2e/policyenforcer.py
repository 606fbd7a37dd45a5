"""A NetworkPolicy enforcer for the real node (realnode.py): **kube-router**'s network policy
controller, run as a host process with only its firewall beside the node's bridge CNI.

Debian's bridge plugin gives pods addresses but enforces no NetworkPolicy. kube-router
(v2, the version pinned in e2e/tools/kube-router/go.mod, built by scripts/build-kube-router.sh)
runs here with ``--run-firewall=true --run-router=false --run-service-proxy=false``: it watches
pods, namespaces and NetworkPolicies through the test API server and writes iptables chains and
ipsets for the pods whose ``status.hostIP`` is its node's address. The nodes share this machine's
network namespace (as kube-proxy does), so the rules are in this machine's filter table; they
match pod addresses only (10.244.0.0/16). Traffic between two pods on the bridge passes
iptables' FORWARD chain through br_netfilter (``net.bridge.bridge-nf-call-iptables=1``), which
kube-router's ``physdev`` rules catch; traffic through a Service's ClusterIP is routed and caught
by its FORWARD rules too.

kube-router authenticates as ``system:kube-router``, bound to a ClusterRole that reads what its
informers list. :meth:`KubeRouterFirewall.stop` kills it by PID and removes its chains and ipsets
(its own ``--cleanup-config`` also resets the router and proxy parts that never ran).
A piece that cannot start raises :class:`~.realnode.NodeError`.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from .controlplane import SERVICE_CIDR, ControlPlane, _kill_group, free_port
from .realnode import NODE_BIN, REPO, NodeError, _launch, _run, _tail, _wait

KUBE_ROUTER = NODE_BIN / "kube-router"
USER = "system:kube-router"
ROLE = "sharegpu-e2e:kube-router"
# what kube-router's informers list and watch (it starts them all, whichever controllers run)
READ = [
    ("", ["pods", "namespaces", "nodes", "services", "endpoints"]),
    ("discovery.k8s.io", ["endpointslices"]),
    ("networking.k8s.io", ["networkpolicies"]),
]
# kube-router's filter chains and ipsets (pkg/controllers/netpol)
CHAIN_PREFIXES = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-")
IPSET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-")
BUILTIN_CHAINS = ("INPUT", "FORWARD", "OUTPUT")


def build() -> None:
    """scripts/build-kube-router.sh (a no-op while up to date). Raises NodeError."""
    _run(["bash", str(REPO / "scripts" / "build-kube-router.sh")], "build-kube-router.sh",
         cwd=REPO)


def _in(netns: str | None, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv] if netns else argv


def filter_rules(netns: str | None = None) -> list[str]:
    """The filter table (``iptables-save -t filter``) of this machine or of network namespace
    ``netns``, one rule or chain a line."""
    return _run(_in(netns, ["iptables-save", "-t", "filter"]), "iptables-save").splitlines()


def kube_router_rules(netns: str | None = None) -> list[str]:
    """The lines of the filter table that are kube-router's (its chains and the jumps to them)."""
    return [line for line in filter_rules(netns)
            if any(p in line for p in CHAIN_PREFIXES)]


def remove_rules(netns: str | None = None) -> None:
    """Remove kube-router's jumps from the built-in chains, then its chains, then its ipsets."""
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(_in(netns, list(argv)), capture_output=True, text=True)

    lines = filter_rules(netns)
    for line in lines:
        words = shlex.split(line)
        if len(words) >= 4 and words[0] == "-A" and words[1] in BUILTIN_CHAINS and \
                "-j" in words and words[words.index("-j") + 1].startswith(CHAIN_PREFIXES):
            run("iptables", "-t", "filter", "-D", *words[1:])
    chains = [line[1:].split()[0] for line in lines
              if line.startswith(":") and line[1:].startswith(CHAIN_PREFIXES)]
    for chain in chains:
        run("iptables", "-t", "filter", "-F", chain)
    for chain in chains:
        run("iptables", "-t", "filter", "-X", chain)
    if shutil.which("ipset"):
        for name in run("ipset", "list", "-n").stdout.split():
            if name.startswith(IPSET_PREFIXES):
                run("ipset", "destroy", name)


class KubeRouterFirewall:
    """kube-router's network policy controller for node ``node_name``: a host process, or one in
    network namespace ``netns`` reaching the API server at ``api_address`` (the control plane's
    advertised address) and answering health checks at ``health_address``."""

    def __init__(self, cp: ControlPlane, node_name: str, workdir: Path, *,
                 netns: str | None = None, api_address: str = "",
                 health_address: str = "127.0.0.1") -> None:
        self.cp, self.node_name = cp, node_name
        self.netns, self.api_address, self.health_address = netns, api_address, health_address
        self.log = workdir / "logs" / "kube-router.log"
        self.health = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def _grant(self) -> None:
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": ROLE},
                "rules": [{"apiGroups": [g], "resources": r, "verbs": ["get", "list", "watch"]}
                          for g, r in READ]}
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": ROLE},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": ROLE},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                 "name": USER}]}
        for kind, obj in (("clusterroles", role), ("clusterrolebindings", binding)):
            status, body = self.cp.request(
                "POST", f"/apis/rbac.authorization.k8s.io/v1/{kind}", obj)
            if status not in (201, 409):
                raise NodeError(f"creating the {kind[:-1]} {ROLE}: {status} {body}")

    def start(self) -> float:
        """Build (when out of date), grant, launch; wait for its health endpoint and its
        top-level chains. Returns the seconds from launch to both."""
        for tool in ("iptables", "iptables-save", "iptables-restore", "ipset"):
            if not shutil.which(tool):
                raise NodeError(f"kube-router needs {tool} (scripts/install-node-packages.sh)")
        build()
        self._grant()
        kubeconfig = self.cp.kubeconfig_for(USER)
        if self.api_address:
            kubeconfig.write_text(kubeconfig.read_text().replace(
                "https://127.0.0.1:", f"https://{self.api_address}:"))
        t0 = time.monotonic()
        self.proc = _launch(_in(self.netns, [
            str(KUBE_ROUTER), f"--kubeconfig={kubeconfig}",
            f"--hostname-override={self.node_name}",
            "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--health-port={self.health}", "--metrics-port=0", "--v=1",
        ]), self.log)
        proc = self.proc

        def alive() -> str | None:
            if proc.poll() is not None:
                return f"kube-router exited {proc.returncode}:\n{_tail(self.log)}"
            return None

        def healthy() -> bool:
            url = f"http://{self.health_address}:{self.health}/healthz"
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200

        _wait("kube-router /healthz", healthy, 60, alive)
        _wait("kube-router's KUBE-ROUTER-FORWARD chain",
              lambda: any(line.startswith(":KUBE-ROUTER-FORWARD")
                          for line in filter_rules(self.netns)),
              60, alive)
        return time.monotonic() - t0

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise NodeError(f"kube-router is not running (exit {code}):\n{_tail(self.log)}")

    def syncs(self) -> int:
        """How many full syncs of its iptables rules kube-router has logged."""
        try:
            return self.log.read_text(errors="replace").count("sync iptables took")
        except OSError:
            return 0

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc, grace=5)  # type: ignore[arg-type]
            self.proc = None
        remove_rules(self.netns)
