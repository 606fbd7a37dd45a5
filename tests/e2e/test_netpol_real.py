"""The chart's NetworkPolicy enforced by kube-router (policyenforcer.py) on pods that are network
namespaces on a bridge, with the real API server: the enforcement path of
test_realnode_netpol.py without a kubelet, so it runs while the real node is taken.

A network namespace of its own plays the node: a bridge with br_netfilter on, and kube-router in
it reaching the test control plane over a veth pair (the control plane advertises the host end).
Four more namespaces play pods on that bridge: the extender (listening on the verb port 8888 and
the metrics port 8889), a pod with the chart's scheduler labels, a pod of the release namespace
without them and a pod of another namespace. Their Pod objects carry those addresses in their
status (``hostIP`` the node's), and the NetworkPolicy is the one ``helm template`` renders from
charts/sharegpu. Each probe is a TCP connect from the pod's namespace.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .components import chart_docs
from .controlplane import ControlPlane
from .policyenforcer import KubeRouterFirewall, kube_router_rules
from .realnode import NodeError

RELEASE_NS, OTHER_NS = "sharegpu-system", "gpu-workloads"
VERB_PORT, METRICS_PORT = 8888, 8889
TAG = f"np{os.getpid() % 100000}"
NODE_NS = f"{TAG}-node"
HOST_IF, NODE_IF = f"{TAG}h", f"{TAG}n"
HOST_IP, NODE_IP = "10.250.7.1", "10.250.7.2"
SUBNET = "10.244.250"
SELECTOR = {"app.kubernetes.io/name": "sharegpu", "app.kubernetes.io/instance": "sharegpu"}
# pod: (namespace, address, labels)
PODS = {
    "extender": (RELEASE_NS, f"{SUBNET}.5", {**SELECTOR, "app.kubernetes.io/component": "extender"}),
    "scheduler": (RELEASE_NS, f"{SUBNET}.6",
                  {**SELECTOR, "app.kubernetes.io/component": "scheduler"}),
    "unlabelled": (RELEASE_NS, f"{SUBNET}.7", {}),
    "outsider": (OTHER_NS, f"{SUBNET}.8", {}),
}
PROBE = """
import socket, sys
s = socket.socket()
s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("open")
except ConnectionRefusedError:
    print("refused")
except socket.timeout:
    print("timeout")
"""


def _sh(*argv: str, netns: str | None = None) -> str:
    full = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
    proc = subprocess.run(full, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise NodeError(f"{' '.join(full)} exited {proc.returncode}: {proc.stderr}")
    return proc.stdout


def _pod_ns(name: str) -> str:
    return f"{TAG}-{name}"


class Network:
    """The node's namespace, its bridge, the pods' namespaces and the extender's listeners."""

    def __init__(self) -> None:
        self.servers: list[subprocess.Popen[bytes]] = []

    def up(self) -> None:
        _sh("ip", "netns", "add", NODE_NS)
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NODE_IF,
            "netns", NODE_NS)
        _sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        for cmd in (["ip", "addr", "add", f"{NODE_IP}/30", "dev", NODE_IF],
                    ["ip", "link", "set", NODE_IF, "up"], ["ip", "link", "set", "lo", "up"],
                    ["ip", "link", "add", "br0", "type", "bridge"],
                    ["ip", "addr", "add", f"{SUBNET}.1/24", "dev", "br0"],
                    ["ip", "link", "set", "br0", "up"],
                    ["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"]):
            _sh(*cmd, netns=NODE_NS)
        for i, (name, (_, ip, _)) in enumerate(PODS.items()):
            ns, veth = _pod_ns(name), f"v{i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
                netns=NODE_NS)
            _sh("ip", "link", "set", veth, "master", "br0", netns=NODE_NS)
            _sh("ip", "link", "set", veth, "up", netns=NODE_NS)
            for cmd in (["ip", "addr", "add", f"{ip}/24", "dev", "eth0"],
                        ["ip", "link", "set", "eth0", "up"], ["ip", "link", "set", "lo", "up"]):
                _sh(*cmd, netns=ns)
        ext = PODS["extender"][1]
        for port in (VERB_PORT, METRICS_PORT):
            self.servers.append(subprocess.Popen(
                ["ip", "netns", "exec", _pod_ns("extender"), "python3", "-m", "http.server",
                 "--bind", ext, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def probe(self, src: str, port: int) -> str:
        return _sh("python3", "-c", PROBE, PODS["extender"][1], str(port),
                   netns=_pod_ns(src)).strip()

    def down(self) -> None:
        for s in self.servers:
            s.kill()
            s.wait(timeout=10)
        for ns in [NODE_NS, *(_pod_ns(n) for n in PODS)]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)


def _merge_patch(cp: ControlPlane, path: str, body: dict[str, Any]) -> None:
    import json

    req = urllib.request.Request(cp.server + path, data=json.dumps(body).encode(),
                                 method="PATCH")
    req.add_header("Content-Type", "application/merge-patch+json")
    with urllib.request.urlopen(req, context=cp._admin_ssl, timeout=10) as r:
        assert r.status == 200


def _policy() -> dict[str, Any]:
    (np,) = [d for d in chart_docs(RELEASE_NS) if d["kind"] == "NetworkPolicy"]
    return np


POLICY_PATH = f"/apis/networking.k8s.io/v1/namespaces/{RELEASE_NS}/networkpolicies"


@pytest.fixture(scope="module")
def enforced(controlplane_binary: Path) -> Iterator[tuple[Network, KubeRouterFirewall]]:
    if os.geteuid() != 0:
        pytest.fail("needs root (network namespaces, iptables)", pytrace=False)
    net = Network()
    cp = ControlPlane(controlplane_binary, advertise_address=HOST_IP)
    fw: KubeRouterFirewall | None = None
    try:
        net.up()
        cp.start()
        for ns in (RELEASE_NS, OTHER_NS):
            status, body = cp.request("POST", "/api/v1/namespaces", {
                "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            assert status == 201, body
        status, body = cp.request("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": "netpol-node"}})
        assert status == 201, body
        _merge_patch(cp, "/api/v1/nodes/netpol-node/status", {"status": {
            "addresses": [{"type": "InternalIP", "address": NODE_IP}]}})
        for name, (ns, ip, labels) in PODS.items():
            ports = [{"name": "https", "containerPort": VERB_PORT},
                     {"name": "metrics", "containerPort": METRICS_PORT}]
            status, body = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": labels},
                "spec": {"nodeName": "netpol-node",
                         "containers": [{"name": "c", "image": "none", "ports": ports}]}})
            assert status == 201, body
            _merge_patch(cp, f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": {
                "phase": "Running", "hostIP": NODE_IP, "podIP": ip, "podIPs": [{"ip": ip}]}})
        status, body = cp.request("POST", POLICY_PATH, _policy())
        assert status == 201, body
        fw = KubeRouterFirewall(cp, "netpol-node", cp.workdir, netns=NODE_NS,
                                api_address=HOST_IP, health_address=NODE_IP)
        fw.start()
        yield net, fw
    except NodeError as e:
        pytest.fail(f"setting up the policy network failed: {e}", pytrace=False)
    finally:
        left: list[str] = []
        if fw is not None:
            fw.stop()
            left = kube_router_rules(NODE_NS)
        cp.stop()
        net.down()
    assert not left, f"kube-router's rules were left behind: {left}"


def _matrix(net: Network) -> dict[str, str]:
    return {f"{src} -> {port}": net.probe(src, port)
            for src in ("scheduler", "unlabelled", "outsider")
            for port in (VERB_PORT, METRICS_PORT)}


def _settle(net: Network, fw: KubeRouterFirewall, want: dict[str, str],
            timeout: float = 60) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        fw.check_alive()
        got = _matrix(net)
        if all((got[k] in ("refused", "timeout")) if v == "closed" else got[k] == v
               for k, v in want.items()):
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"want {want}, got {got}:\n" + "\n".join(kube_router_rules(NODE_NS)))
        time.sleep(1)


def test_only_the_scheduler_reaches_the_verb_port_and_anyone_the_metrics_port(
        enforced: tuple[Network, KubeRouterFirewall]) -> None:
    net, fw = enforced
    _settle(net, fw, {
        f"scheduler -> {VERB_PORT}": "open", f"scheduler -> {METRICS_PORT}": "open",
        f"unlabelled -> {VERB_PORT}": "closed", f"unlabelled -> {METRICS_PORT}": "open",
        f"outsider -> {VERB_PORT}": "closed", f"outsider -> {METRICS_PORT}": "open",
    })


def test_without_the_policy_every_pod_reaches_the_verb_port(
        enforced: tuple[Network, KubeRouterFirewall]) -> None:
    net, fw = enforced
    name = _policy()["metadata"]["name"]
    status, body = fw.cp.request("DELETE", f"{POLICY_PATH}/{name}")
    assert status == 200, body
    _settle(net, fw, {k: "open" for k in _matrix(net)})
