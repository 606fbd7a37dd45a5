"""The chart's NetworkPolicy on the REAL node (realnode.py), enforced by kube-router's network
policy controller beside the bridge CNI (policyenforcer.py).

With the chart installed (nodepods.install_release) and kube-router running:

- probe pods try a TCP connection, once a second, to every extender pod's verb port (8888) and
  metrics port (8889) by pod address (bridged traffic), and to both through the extender
  Service's ClusterIP (kube-proxy's DNAT, routed traffic). A plain pod in another namespace and a pod in the release namespace without the
  scheduler's labels are refused on the verb port and reach the metrics port; a pod in the
  release namespace carrying the chart's scheduler labels reaches the verb port;
- the chart's kube-scheduler reaches the extender's verbs: a GPU pod is placed through the
  extender's filter and bind, and starts with its share;
- with ``extender.networkPolicy.enabled=false`` (helm upgrade) the same probe pods reach the verb
  port, so the refusals were the policy's, not a dead network; enabling it again refuses them
  again.

Every run of this file takes the real node: ``flock /tmp/realnode.lock`` around pytest.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from sharegpu.core import names

from .components import CHART, helm
from .nodepods import (
    NAMESPACE,
    RELEASE,
    WORKLOADS,
    compare,
    container_log,
    create,
    get_pod,
    gpu_pod,
    list_pods,
    node_uuids,
    ready,
    report,
    wait,
)
from .policyenforcer import KubeRouterFirewall, kube_router_rules
from .realnode import NodeError, RealNodeCluster

VERB_PORT, METRICS_PORT = 8888, 8889  # the chart's extender.port and extender.metricsPort
PROBE_TAG = "NETPOL-PROBE "
PROBE = r"""
import json, os, socket, time
targets = json.loads(os.environ["TARGETS"])
while True:
    got = {}
    for name, (host, port) in targets.items():
        s = socket.socket()
        s.settimeout(3)
        try:
            s.connect((host, port))
            got[name] = "open"
        except socket.timeout:
            got[name] = "timeout"
        except ConnectionRefusedError:
            got[name] = "refused"
        except OSError as e:
            got[name] = "error %s" % e.errno
        finally:
            s.close()
    print("NETPOL-PROBE " + json.dumps({"t": time.time(), "got": got}), flush=True)
    time.sleep(1)
"""
# the probes: (namespace, pod name, extra labels)
OUTSIDER = (WORKLOADS, "netpol-outsider", {})
UNLABELLED = (NAMESPACE, "netpol-unlabelled", {})
SCHEDULER_LABELS = {"app.kubernetes.io/name": "sharegpu", "app.kubernetes.io/instance": RELEASE,
                    "app.kubernetes.io/component": "scheduler"}
LABELLED = (NAMESPACE, "netpol-scheduler-labels", SCHEDULER_LABELS)
PROBES = (OUTSIDER, UNLABELLED, LABELLED)
CLOSED = ("refused", "timeout")
ROUNDS = 3  # consecutive probe rounds that must agree


class Netpol:
    """The release with kube-router enforcing, the probe pods and their targets."""

    def __init__(self, cluster: RealNodeCluster, firewall: KubeRouterFirewall,
                 extenders: list[dict[str, Any]], service_ip: str) -> None:
        self.cluster, self.firewall = cluster, firewall
        self.extenders, self.service_ip = extenders, service_ip
        self.verb = [f"verb {p['metadata']['name']}" for p in extenders] + ["verb service"]
        self.metrics = [f"metrics {p['metadata']['name']}" for p in extenders] + ["metrics service"]

    def targets(self) -> dict[str, tuple[str, int]]:
        out = {"verb service": (self.service_ip, VERB_PORT),
               "metrics service": (self.service_ip, METRICS_PORT)}
        for p in self.extenders:
            out[f"verb {p['metadata']['name']}"] = (p["status"]["podIP"], VERB_PORT)
            out[f"metrics {p['metadata']['name']}"] = (p["status"]["podIP"], METRICS_PORT)
        return out

    def rounds(self, probe: tuple[str, str, Mapping[str, str]]) -> list[dict[str, Any]]:
        pod = get_pod(self.cluster.cp, probe[0], probe[1])
        assert pod is not None, f"probe pod {probe[0]}/{probe[1]} is gone"
        out = []
        for line in container_log(self.cluster.nodes[0], pod, "c").splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[3].startswith(PROBE_TAG):
                out.append(json.loads(parts[3][len(PROBE_TAG):]))
        return out

    def settle(self, since: float, want: Callable[[tuple[str, str, Any], Mapping[str, str]], str],
               timeout: float = 120) -> dict[str, Mapping[str, str]]:
        """Wait until the last ROUNDS rounds (begun after ``since``) of every probe agree with
        ``want(probe, got)`` ('' when they do, else what differs); return each probe's last
        round."""
        last: dict[str, Any] = {}

        def agreed() -> bool:
            self.firewall.check_alive()
            for probe in PROBES:
                rounds = [r for r in self.rounds(probe) if r["t"] > since][-ROUNDS:]
                last[probe[1]] = rounds[-1]["got"] if rounds else None
                if len(rounds) < ROUNDS or any(want(probe, r["got"]) for r in rounds):
                    return False
            return True

        try:
            wait("the probes to agree", agreed, timeout, every=1)
        except BaseException:
            print(json.dumps(last, indent=1), file=sys.stderr)
            print("\n".join(kube_router_rules()), file=sys.stderr)
            raise
        return last

    def enforced(self, probe: tuple[str, str, Any], got: Mapping[str, str]) -> str:
        """'' when ``got`` is what the chart's policy admits for ``probe``."""
        verb_open = probe is LABELLED
        bad = [f"{t}={got.get(t)}" for t in self.verb
               if (got.get(t) == "open") != verb_open or got.get(t) not in ("open", *CLOSED)]
        bad += [f"{t}={got.get(t)}" for t in self.metrics if got.get(t) != "open"]
        return ", ".join(bad)

    def open_to_all(self, probe: tuple[str, str, Any], got: Mapping[str, str]) -> str:
        return ", ".join(f"{t}={got.get(t)}" for t in self.verb + self.metrics
                         if got.get(t) != "open")


def _probe_pod(name: str, labels: Mapping[str, str], image: str, node: str,
               targets: Mapping[str, tuple[str, int]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": dict(labels)},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": image, "imagePullPolicy": "Never",
                                     "command": ["python3", "-c", PROBE],
                                     "env": [{"name": "TARGETS",
                                              "value": json.dumps(targets)}]}]}}


def _set_policy(cluster: RealNodeCluster, enabled: bool) -> None:
    helm(cluster.cp, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "--reuse-values",
         "--set", f"extender.networkPolicy.enabled={str(enabled).lower()}", timeout=300)


def _policy(cluster: RealNodeCluster) -> dict[str, Any] | None:
    status, body = cluster.cp.request(
        "GET", f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies")
    assert status == 200, body
    items = json.loads(body)["items"]
    return items[0] if items else None


def _extenders(cluster: RealNodeCluster) -> list[dict[str, Any]]:
    return sorted(list_pods(cluster.cp, NAMESPACE, "app.kubernetes.io/component%3Dextender"),
                  key=lambda p: p["metadata"]["name"])


@pytest.fixture(scope="module")
def netpol(real_release: RealNodeCluster) -> Iterator[Netpol]:
    cluster = real_release
    cp, node = cluster.cp, cluster.nodes[0]
    firewall = KubeRouterFirewall(cp, node.name, cluster.workdir)
    created: list[tuple[str, str]] = []
    try:
        try:
            seconds = firewall.start()
        except NodeError as e:
            pytest.fail(f"kube-router did not start: {e}", pytrace=False)
        print(f"\nkube-router enforcing {seconds:.1f}s after launch", file=sys.stderr)
        status, body = cp.request(
            "GET", f"/api/v1/namespaces/{NAMESPACE}/services?labelSelector="
            "app.kubernetes.io/component%3Dextender")
        assert status == 200, body
        (svc,) = json.loads(body)["items"]
        schedulers = list_pods(cp, NAMESPACE, "app.kubernetes.io/component%3Dscheduler")
        assert schedulers and all(
            SCHEDULER_LABELS.items() <= p["metadata"]["labels"].items() for p in schedulers)
        np = Netpol(cluster, firewall, _extenders(cluster), svc["spec"]["clusterIP"])
        assert len(np.extenders) == 2 and all(p["status"].get("podIP") for p in np.extenders)
        for ns, name, labels in PROBES:
            status, body = create(cp, ns, _probe_pod(name, labels, cluster.refs["SHAREGPU_REF"],
                                                     node.name, np.targets()))
            assert status == 201, body
            created.append((ns, name))
        for ns, name in created:
            wait(f"probe {ns}/{name} running",
                 lambda ns=ns, name=name: (p := get_pod(cp, ns, name)) and ready(p), 120)
        yield np
    finally:
        for ns, name in created:
            cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}")
        if _policy(cluster) is None:
            _set_policy(cluster, True)
        firewall.stop()
    assert not kube_router_rules(), "kube-router's chains were left behind"


def test_only_pods_with_the_schedulers_labels_reach_the_extenders_verb_port(
        netpol: Netpol) -> None:
    assert _policy(netpol.cluster) is not None
    t0 = time.monotonic()
    last = netpol.settle(0, netpol.enforced)
    print(f"\npolicy enforced on the probes {time.monotonic() - t0:.1f}s after they ran; "
          f"last rounds:\n{json.dumps(last, indent=1)}", file=sys.stderr)
    # the rules that did it: a firewall chain for each extender pod
    rules = "\n".join(kube_router_rules())
    for p in netpol.extenders:
        assert f"POD name:{p['metadata']['name']} namespace: {NAMESPACE}" in rules, rules


def test_the_charts_scheduler_reaches_the_extenders_verbs_with_the_policy_enforced(
        netpol: Netpol) -> None:
    cluster = netpol.cluster
    cp, node = cluster.cp, cluster.nodes[0]
    netpol.settle(0, netpol.enforced)
    obj = gpu_pod("netpol-shared", [{names.RES_GPU_MEM: 3}], node=node.name,
                  image=cluster.refs["SHAREGPU_REF"])
    status, body = create(cp, WORKLOADS, obj)
    assert status == 201, body
    try:
        pod = wait("netpol-shared running",
                   lambda: (p := get_pod(cp, WORKLOADS, "netpol-shared")) and ready(p) and p, 120)
        got = report(node, pod, "c0")
        check = compare(pod, 0, got, "cgpu", node_uuids(node))
        assert not check.mismatches, (check, got)
    finally:
        cp.request("DELETE", f"/api/v1/namespaces/{WORKLOADS}/pods/netpol-shared")
        wait("netpol-shared gone", lambda: get_pod(cp, WORKLOADS, "netpol-shared") is None, 120)
    netpol.firewall.check_alive()


def test_without_the_policy_the_same_pods_reach_the_verb_port(netpol: Netpol) -> None:
    cluster = netpol.cluster
    netpol.settle(0, netpol.enforced)
    before = [p["metadata"]["uid"] for p in netpol.extenders]
    _set_policy(cluster, False)
    try:
        since = time.time()
        assert _policy(cluster) is None
        t0 = time.monotonic()
        netpol.settle(since, netpol.open_to_all)
        print(f"\nwithout the policy every probe reached the verb port "
              f"{time.monotonic() - t0:.1f}s after helm upgrade", file=sys.stderr)
        # the extender pods are the ones the probes target
        assert [p["metadata"]["uid"] for p in _extenders(cluster)] == before
    finally:
        _set_policy(cluster, True)
    since = time.time()
    assert _policy(cluster) is not None
    netpol.settle(since, netpol.enforced)
