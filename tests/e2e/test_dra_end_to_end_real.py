"""DRA mode end to end on the REAL control plane (kube-apiserver, kube-controller-manager,
kube-scheduler v1.37.2, default feature gates; docs/dra.md, "End to end").

The chain, every sharegpu component with the chart's arguments and the chart's RBAC (its
ServiceAccounts, ClusterRoles and bindings created as ``helm template`` renders them with
``agent.dra.enabled=true``; no admin credentials for a sharegpu component):

1. 4 DRA nodes (``sharegpu.io/dra=true``, ``cgpu``; GPUs of 15, 15 / 16, 16 / 24 / 40, 40 GiB),
   each with a real ``sharegpu agent`` (the chart's DaemonSet arguments, ``--nvml fake``,
   HAMi-core isolation with a stand-in library, temporary plugin/CDI directories) publishing
   its ResourceSlice and serving its kubelet DRA plugin; the chart's DeviceClass.
2. The chart's mutating (and validating) pod webhook, ``sharegpu webhook`` with the chart's
   arguments, turning 50 ACK-spec pods (``aliyun.com/gpu-mem``, some ``gpu-core.percentage``,
   some ``aliyun.com/gpu-count: 2``, a nodeSelector on the pool label) into ResourceClaims.
3. Twice, on the same nodes, with the same 50 pods:
   - **without** the extender: ``schedulerName: default-scheduler``, the control plane's own
     kube-scheduler (default profile: the DynamicResources allocator's first fit);
   - **with** it: ``schedulerName: ack-co-scheduler``, kube-scheduler restarted with the chart's
     KubeSchedulerConfiguration (profile mode, the chart's scheduler ServiceAccount) calling
     ``sharegpu extender`` over TLS (the chart's arguments, certificate and ServiceAccount: it
     lists and watches slices and claims and ranks DRA pods with the policy).
   Each pass: per GPU, the sum of the claims' ``consumedCapacity`` within the slice's
   capacity, every gpu-count 2 pod on 2 distinct GPUs, ``sharegpu inspect -o json`` agreeing
   with the claims per GPU, every Pending pod verifiably fitting nowhere with kube-scheduler's
   FailedScheduling Event.
4. With the extender: a 48 GiB pod stays Pending with the scheduler's reason, and the
   extender's Warning Event ``GPUSharingDRAUnschedulable`` names the claim's field, the ACK
   resource it came from and the rule; the pods left Pending only because the pool is full
   get no such Event (they would fit an empty pool).
5. Per node, the kubelet's own DRA manager (``sharegpu-controlplane kubelet-dra``, as
   ``system:node:<node>``) prepares every bound pod's claims through that node's agent: every CDI
   spec carries its own claim's GPU UUID(s) and limits, 0 mismatches.

The numbers placed with and without the extender's ranking are printed; what must hold (no
over-commit, inspect agrees, reasons present, 0 mismatches) is asserted, not that ranking helps.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import random
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import Client
from lightkube.resources.core_v1 import Pod

from sharegpu.core import names
from sharegpu.dra import driver as dra
from sharegpu.inspect_cgpu.cli import main as inspect_main
from sharegpu_testing.tls import make_certificates

from .components import SharegpuProcess, create_node, free_port, wait_for
from .controlplane import ControlPlane
from .realcluster import (
    ChartRbac,
    Report,
    cleanup,
    make_namespace,
    render_chart,
    sa_client,
    scheduler_config_for,
    start_extender,
)
from .test_chart_real import with_flags
from .test_dra_prepare_real import KubeletDra
from .test_dra_webhook_real import (
    GIB,
    NODES,
    POOL,
    RA,
    claims_by_pod,
    get,
    gpu_pod,
    post,
    qty_bytes,
    scheduler_events,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from agent_helpers import standin_library
from dra_kubelet import cdi_registry, container_view

RELEASE = "sg-dra-e2e"
DRIVER = dra.DRIVER
MODELS = {15: "Tesla-T4", 16: "Tesla-V100-SXM2-16GB", 24: "NVIDIA-A10", 40: "A100-SXM4-40GB"}
DRA_REASONS = ("cannot allocate all claims",  # kube-scheduler's DynamicResources plugin
               "GPU memory")  # the extender's ("asks 48 GPU memory per GPU; ...")


def shapes() -> list[tuple[int, int | None, int | None]]:
    """(gpu-mem, gpu-core.percentage, gpu-count) of the 50 pods: exactly those of
    test_dra_webhook_real (1-4 GiB per GPU, 17 with cores 10-30 %, 8 with gpu-count 2)."""
    rnd = random.Random(21)
    out = []
    for i in range(50):
        count = 2 if i % 6 == 5 else None
        core = rnd.choice((10, 20, 25, 30)) if i % 3 == 1 else None
        out.append((rnd.choice((1, 2, 3, 4)) * (count or 1), core, count))
    return out


class Cluster:
    def __init__(self, cp: ControlPlane, admin: Client, release_ns: str,
                 docs: list[dict[str, Any]], nodes: dict[str, str], tmp: Path,
                 binary: Path) -> None:
        self.cp, self.admin, self.release_ns, self.docs = cp, admin, release_ns, docs
        self.nodes, self.tmp, self.binary = nodes, tmp, binary
        self.agents: dict[str, SharegpuProcess] = {}
        self.sa: dict[str, str] = {}


@pytest.fixture(scope="module")
def cluster(controlplane: ControlPlane, controlplane_binary: Path,
            admin: Client) -> Iterator[Cluster]:
    cp = controlplane
    release_ns = make_namespace(admin, "sg-drae2e")
    docs = render_chart(RELEASE, release_ns, {"agent.dra.enabled": "true"})
    rbac = ChartRbac(admin, docs, RELEASE)
    tmp = Path(tempfile.mkdtemp(prefix="sg-drae2e-"))  # unix socket paths stay short
    created: list[str] = []
    webhook: SharegpuProcess | None = None
    kubelets: _Kubelets | None = None
    probe_ns = make_namespace(admin, "drae2e-probe")
    c = Cluster(cp, admin, release_ns, docs, {}, tmp, controlplane_binary)
    try:
        c.sa = {k: rbac.apply(k) for k in ("agent", "extender", "scheduler", "webhook")}
        dc = next(d for d in docs if d["kind"] == "DeviceClass")
        code, body = post(cp, f"{RA}/deviceclasses", dc)
        assert code in (201, 409), body
        if code == 201:
            created.append(f"{RA}/deviceclasses/{DRIVER}")

        # the nodes and their agents, as the chart's DaemonSet runs them
        ds = next(d for d in docs if d["kind"] == "DaemonSet")
        agent_args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--dra=label" in agent_args, agent_args
        agent_kc = cp.service_account_kubeconfig(release_ns, c.sa["agent"], create=False)
        lib = standin_library()
        suffix = release_ns.rsplit("-", 1)[1]
        for key, sizes in NODES.items():
            name = create_node(admin, f"drae2e-{key}-{suffix}",
                               labels={names.LABEL_SCHEDULE: "cgpu", **POOL})
            c.nodes[key] = name
            d = tmp / key
            args = with_flags(
                agent_args, node_name=name, kubeconfig=str(agent_kc), nvml="fake",
                fake_gpus=",".join(f"{MODELS[g]}:{g}" for g in sizes), isolation="hami",
                hami_library=lib, hami_installed=None,  # the library itself, no installer's note
                device_plugin_dir=str(d / "dp"), state_dir=str(d / "state"),
                metrics_listen=f"127.0.0.1:{free_port()}", mps_pipe_dir=str(d / "mps"),
                mps_shm_dir=str(d / "mps-shm"), dra_plugins_registry=str(d / "registry"),
                dra_plugin_dir=str(d / "plugin"), cdi_dir=str(d / "cdi"))
            c.agents[key] = SharegpuProcess(cp, f"agent-{name}", args).start()
        for key, agent in c.agents.items():
            agent.wait_until(lambda k=key: (tmp / k / "registry" / f"{DRIVER}-reg.sock").exists(),
                             "its DRA registration socket")
            wait_for(f"the slice of {c.nodes[key]}", lambda k=key: cp.request(
                "GET", f"{RA}/resourceslices/{c.nodes[k]}-{DRIVER}")[0] == 200, timeout=60)
        # a running kubelet takes the agents' device plugins and DRA plugins at once; until then
        # each agent says on its Node that it does not serve (GPUAgentServing=False), and the
        # extender places nothing there
        kubelets = _Kubelets([tmp / key for key in c.agents])
        for key in c.agents:
            wait_for(f"{c.nodes[key]}'s agent to serve", lambda k=key: agent_serving(
                cp, c.nodes[k]), timeout=60)

        # the chart's pod webhooks (and, DRA, those of claims and templates), served by
        # `sharegpu webhook` with the chart's arguments
        mwc = next(d for d in docs if d["kind"] == "MutatingWebhookConfiguration")
        vwc = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
        hook = mwc["metadata"]["name"]
        dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == hook)
        certs = make_certificates(tmp / "webhook-tls", hosts=("127.0.0.1",))
        port = free_port()
        args = with_flags(dep["spec"]["template"]["spec"]["containers"][0]["args"],
                          listen=f"127.0.0.1:{port}", tls_cert=str(certs.cert),
                          tls_key=str(certs.key),
                          kubeconfig=str(cp.service_account_kubeconfig(
                              release_ns, c.sa["webhook"], create=False)))
        webhook = SharegpuProcess(cp, f"webhook-{suffix}", args).start()
        webhook.wait_http(f"https://127.0.0.1:{port}/healthz", timeout=30,
                          context=ssl.create_default_context(cafile=str(certs.ca_cert)))
        ca = base64.b64encode(certs.ca_cert.read_bytes()).decode()
        for cfg, path, kind in ((mwc, "/mutate", "mutatingwebhookconfigurations"),
                                (vwc, "/validate", "validatingwebhookconfigurations")):
            mine = copy.deepcopy(cfg)
            mine["webhooks"] = [w for w in mine["webhooks"] if w["name"].startswith(
                ("pods.", "resourceclaims.", "resourceclaimtemplates."))]
            for w in mine["webhooks"]:
                w["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
            base = f"/apis/admissionregistration.k8s.io/v1/{kind}"
            code, body = post(cp, base, mine)
            assert code == 201, body
            created.append(f"{base}/{mine['metadata']['name']}")
        probe = gpu_pod("probe", 1)
        wait_for("the API server to call the mutating webhook", lambda: (
            r := post(cp, f"/api/v1/namespaces/{probe_ns}/pods?dryRun=All", probe))[0] == 201
            and r[1]["spec"].get("resourceClaims"), timeout=30, every=0.2)
        yield c
    finally:
        if webhook is not None:
            webhook.stop()
        for agent in c.agents.values():
            agent.stop()
        if kubelets is not None:
            kubelets.close()
        for path in reversed(created):
            cp.request("DELETE", path)
        cleanup(admin, probe_ns)
        cleanup(admin, release_ns, c.nodes.values())
        rbac.delete()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------


def capacities(cp: ControlPlane, nodes: dict[str, str]) -> dict[tuple[str, str], tuple[int, int]]:
    """(node, device) -> (memory bytes, cores) as the nodes' ResourceSlices publish them."""
    out = {}
    for node in nodes.values():
        slc = get(cp, f"{RA}/resourceslices/{node}-{DRIVER}")
        for dv in slc["spec"]["devices"]:
            cap = dv["capacity"]
            out[(node, dv["name"])] = (qty_bytes(cap["memory"]["value"]),
                                       int(cap["cores"]["value"]))
    return out


def slice_uuids(cp: ControlPlane, node: str) -> dict[str, str]:
    slc = get(cp, f"{RA}/resourceslices/{node}-{DRIVER}")
    return {dv["name"]: dv["attributes"]["uuid"]["string"] for dv in slc["spec"]["devices"]}


# the test kubelets (device plugins, DRA plugin registration) of the nodes, in a process of
# their own: their gRPC threads must not be in the process that forks the control plane's
_KUBELETS = """
import asyncio, sys
from agent_kubelet import TestKubelet
from dra_kubelet import TestDraKubelet

async def main() -> None:
    for d in sys.argv[1:]:
        await TestKubelet(d + "/dp").start()
        assert await TestDraKubelet(d + "/registry").discover(), d
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


class _Kubelets:
    """The test kubelets of the nodes under ``dirs``, as one process."""

    def __init__(self, dirs: list[Path]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1] / "agent"),
             os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-c", _KUBELETS, *map(str, dirs)],
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == b"ready", f"the test kubelets did not start ({self.proc.poll()})"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def agent_serving(cp: ControlPlane, node: str) -> bool:
    """Whether ``node`` carries ``GPUAgentServing=True`` (the agent's own word that it serves)."""
    obj = get(cp, f"/api/v1/nodes/{node}")
    return any(
        c.get("type") == names.CONDITION_AGENT_SERVING and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or [])


def run_pass(c: Cluster, ns: str, scheduler: str, report: Report,
             label: str) -> dict[str, Any]:
    """Create the 50 pods in ``ns`` for ``scheduler``, wait until each is bound or refused, and
    check what must hold. Returns the pods, their claims and the per-GPU use."""
    cp = c.cp
    wanted: dict[str, tuple[int, int, int]] = {}
    t0 = time.monotonic()
    for i, (mem, core, count) in enumerate(shapes()):
        pod = gpu_pod(f"ack-{i:02d}", mem, core=core, count=count)
        pod["spec"]["schedulerName"] = scheduler
        code, body = post(cp, f"/api/v1/namespaces/{ns}/pods", pod)
        assert code == 201, body.get("message", body)
        (rc,) = body["spec"]["resourceClaims"]  # translated by the webhook
        assert rc["resourceClaimTemplateName"].startswith("sharegpu-")
        wanted[f"ack-{i:02d}"] = (mem // (count or 1), core or 0, count or 1)

    def settled() -> dict[str, Any] | None:
        pods = {p["metadata"]["name"]: p for p in get(
            cp, f"/api/v1/namespaces/{ns}/pods")["items"] if p["metadata"]["name"] in wanted}
        return pods if len(pods) == len(wanted) and all(
            p["spec"].get("nodeName") or scheduler_events(cp, ns, n)
            for n, p in pods.items()) else None

    # until every pod is bound or refused and no pod has been bound for 8 s (a refused pod is
    # retried after its back-off: an early refusal is not the last word)
    last: list[Any] = [None, time.monotonic()]

    def stable() -> dict[str, Any] | None:
        pods = settled()
        bound = None if pods is None else sorted(
            n for n, p in pods.items() if p["spec"].get("nodeName"))
        if bound != last[0]:
            last[:] = [bound, time.monotonic()]
            return None
        return pods if pods is not None and time.monotonic() - last[1] > 8 else None

    pods = wait_for(f"{scheduler} to place or refuse all 50 pods", stable, timeout=150,
                    every=0.5)
    took = time.monotonic() - t0
    capacity = capacities(cp, c.nodes)
    claims = claims_by_pod(cp, ns)
    used: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    per_node: dict[str, int] = defaultdict(int)
    pending = sorted(n for n, p in pods.items() if not p["spec"].get("nodeName"))
    for name, (gib, core, gpus) in wanted.items():
        (claim,) = claims[name]
        if name in pending:
            assert not claim.get("status", {}).get("allocation"), name
            continue
        results = claim["status"]["allocation"]["devices"]["results"]
        node = pods[name]["spec"]["nodeName"]
        per_node[node] += 1
        assert len(results) == gpus and len({r["device"] for r in results}) == gpus, \
            f"{name}: {gpus} distinct GPUs wanted, got {results}"
        assert {r["pool"] for r in results} == {node}, name
        for r in results:
            cc = r["consumedCapacity"]
            assert qty_bytes(cc["memory"]) == gib * GIB, name
            assert int(cc["cores"]) == (core or 5), name
            u = used[(node, r["device"])]
            u[0] += qty_bytes(cc["memory"])
            u[1] += int(cc["cores"])
            u[2] += 1
    # 1. no over-commit: per GPU, the claims' consumedCapacity within the slice's capacity
    over = {k: (u, capacity[k]) for k, u in used.items()
            if u[0] > capacity[k][0] or u[1] > capacity[k][1]}
    assert over == {}, f"over-committed GPUs: {over}"
    # 3. what stays Pending fits nowhere, with kube-scheduler's reason
    reasons = {}
    for name in pending:
        gib, core, gpus = wanted[name]
        ev = scheduler_events(cp, ns, name)[-1]
        for node in c.nodes.values():
            room = [k for k in capacity if k[0] == node
                    and capacity[k][0] - used[k][0] >= gib * GIB
                    and capacity[k][1] - used[k][1] >= (core or 5)]
            assert len(room) < gpus, (name, node, room, ev["message"])
        assert any(r in ev["message"] for r in DRA_REASONS), ev["message"]
        reasons[name] = ev["message"]
    # 2. sharegpu inspect (the CLI against the API server) agrees with the claims per GPU
    got_inspect = inspect_gpus(c)
    want_inspect = {k: (capacity[k][0] // GIB, used[k][0] // GIB if k in used else 0,
                        used[k][2] if k in used else 0) for k in capacity}
    assert got_inspect == want_inspect, (got_inspect, want_inspect)
    placed = 50 - len(pending)
    short = {v: k for k, v in c.nodes.items()}
    report(f"{label}: {placed} of 50 placed, {len(pending)} Pending "
           f"({', '.join(f'{n} {wanted[n][0]} GiB x{wanted[n][2]}' for n in pending) or '-'}); "
           f"settled {took:.1f}s after the first pod was created; pods per node "
           f"{ {short[n]: k for n, k in sorted(per_node.items())} }; per GPU GiB (cores %): "
           + ", ".join(f"{short[k[0]]}/{k[1]} {u[0] // GIB}/{capacity[k][0] // GIB} ({u[1]})"
                       for k, u in sorted(used.items())))
    for name, msg in reasons.items():
        report(f"  {name} Pending: {msg}")
    report(f"  inspect agrees with the claims on all {len(capacity)} GPUs")
    return {"pods": pods, "claims": claims, "wanted": wanted, "pending": pending,
            "placed": placed, "used": used}


def inspect_gpus(c: Cluster) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(node, device) -> (GiB total, GiB allocated, shares) from ``sharegpu inspect -o json``
    (the CLI's main, reading the API server with a user's kubeconfig)."""
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = inspect_main(["--kubeconfig", str(c.cp.admin_kubeconfig), "-o", "json",
                           *c.nodes.values()])
    assert rc == 0, buf.getvalue()
    doc = json.loads(buf.getvalue())
    out = {}
    for n in doc["nodes"]:
        assert n["dra"], n["name"]
        for i, g in enumerate(n["gpus"]):
            out[(n["name"], f"gpu-{i}")] = (g["memTotal"], g["memAllocated"], g["pods"])
    return out


def wait_claims_gone(c: Cluster, ns: str) -> None:
    for p in c.admin.list(Pod, namespace=ns):
        c.admin.delete(Pod, p.metadata.name, namespace=ns, grace_period=0)
    wait_for(f"the claims of {ns} deleted by the resourceclaim controller", lambda: not get(
        c.cp, f"{RA}/namespaces/{ns}/resourceclaims")["items"], timeout=60)


def prepare_everything(c: Cluster, run: dict[str, Any], report: Report) -> None:
    """Per node, the kubelet's own DRA manager prepares every bound pod's claims through that
    node's agent; every CDI spec must carry its own claim's GPU(s) and limits."""
    cp = c.cp
    pods, claims, wanted = run["pods"], run["claims"], run["wanted"]
    by_node: dict[str, list[str]] = defaultdict(list)
    for name, p in pods.items():
        if p["spec"].get("nodeName"):
            by_node[p["spec"]["nodeName"]].append(name)
    kubelets: dict[str, KubeletDra] = {}
    bad: list[str] = []
    t0 = time.monotonic()
    try:
        for key, node in c.nodes.items():
            if not by_node[node]:
                continue
            k = KubeletDra(c.binary, cp, node, c.tmp / key)
            k.argv = [a if not a.startswith("--expect-pods=") else
                      f"--expect-pods={len(by_node[node])}" for a in k.argv]
            kubelets[node] = k.start()
        prepared = 0
        for key, node in c.nodes.items():
            if node not in kubelets:
                continue
            rep = kubelets[node].wait_file(kubelets[node].out, timeout=120)
            uuids = slice_uuids(cp, node)  # the slice the agent put back after the wipe
            registry = cdi_registry(str(c.tmp / key / "cdi"))
            for name in by_node[node]:
                gib, core, gpus = wanted[name]
                (claim,) = claims[name]
                uid = claim["metadata"]["uid"]
                res = claim["status"]["allocation"]["devices"]["results"]
                devs = [r["device"] for r in res]
                got = next((p for p in rep["pods"] if p["name"] == name), None)
                cids = [f"sharegpu.io/gpu={uid}-{d}" for d in devs]
                if got is None or not got["prepared"] or \
                        sorted(got["containers"][0]["cdi_devices"]) != sorted(cids):
                    bad.append(f"{name}: {got} want {cids}")
                    continue
                prepared += 1
                env, mounts = container_view(registry, got["containers"][0]["cdi_devices"])
                order = sorted(devs, key=lambda d: int(d.removeprefix("gpu-")))
                expect = {
                    "NVIDIA_VISIBLE_DEVICES": ",".join(uuids[d] for d in order),
                    "CUDA_DEVICE_SM_LIMIT": str(core) if core else None,
                    "LD_PRELOAD": "/usr/local/vgpu/libvgpu.so",
                    **{f"CUDA_DEVICE_MEMORY_LIMIT_{i}": f"{gib * 1024}m" for i in range(gpus)},
                }
                wrong = {k: (env.get(k), v) for k, v in expect.items() if env.get(k) != v}
                if mounts.get("/tmp/sharegpu-vgpu", ("",))[0] != f"/tmp/sharegpu-vgpu/{uid}":
                    wrong["cache"] = (mounts.get("/tmp/sharegpu-vgpu"), uid)
                if wrong:
                    bad.append(f"{name} ({devs}, {gib} GiB x{gpus}, cores {core}): {wrong}")
        took = time.monotonic() - t0
        report(f"kubelet-dra on {len(kubelets)} nodes: {prepared} of {sum(map(len, by_node.values()))} "
               f"bound pods prepared through their node's agent in {took:.1f}s; "
               f"{len(bad)} mismatches")
        assert bad == [], "\n".join(bad[:20])
        assert prepared == run["placed"]
        for agent in c.agents.values():
            assert agent.alive(), agent.log_tail()
    finally:
        for k in kubelets.values():
            k.stop()


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Iterator[Report]:
    r = Report()
    yield r
    r.flush(capsys)


def test_fifty_ack_pods_through_webhook_extender_scheduler_and_kubelet(
        cluster: Cluster, report: Report) -> None:
    c, cp = cluster, cluster.cp
    ns_default = make_namespace(c.admin, "drae2e-default")
    ns_ext = make_namespace(c.admin, "drae2e-ext")
    ext = None
    try:
        # without the extender: the control plane's own kube-scheduler, default profile
        without = run_pass(c, ns_default, "default-scheduler", report,
                           "without the extender (default-scheduler)")
        wait_claims_gone(c, ns_default)

        # with it: kube-scheduler with the chart's configuration calling `sharegpu extender`
        ext_kc, _ = sa_client(cp, c.release_ns, c.sa["extender"])
        ext = start_extender(cp, c.docs, "sharegpu-extender-0", ext_kc)
        cfg = scheduler_config_for(cp, c.docs, RELEASE, c.release_ns, ext.url)
        assert [p["schedulerName"] for p in cfg["profiles"]] == [names.CO_SCHEDULER_NAME]
        assert "managedResources" not in cfg["extenders"][0]  # profile mode: every pod
        cp.restart_scheduler(config=cfg, extra_args=["--leader-elect=true", "--v=2"])
        with_ext = run_pass(c, ns_ext, names.CO_SCHEDULER_NAME, report,
                            "with the extender (ack-co-scheduler)")
        log = ext.proc.log.read_text(errors="replace")
        assert "DRA mode off" not in log, ext.proc.log_tail()

        # a pod that fits nowhere stays Pending with the scheduler's reason
        code, body = post(cp, f"/api/v1/namespaces/{ns_ext}/pods", {
            **gpu_pod("too-big", 48),
            "spec": {**gpu_pod("too-big", 48)["spec"],
                     "schedulerName": names.CO_SCHEDULER_NAME}})
        assert code == 201, body
        (ev,) = wait_for("too-big's FailedScheduling Event",
                         lambda: scheduler_events(cp, ns_ext, "too-big")[:1], timeout=60)
        report(f"too-big (48 GiB, ack-co-scheduler): {ev['message']}")
        assert any(r in ev["message"] for r in DRA_REASONS), ev["message"]
        assert get(cp, f"/api/v1/namespaces/{ns_ext}/pods/too-big")["spec"].get(
            "nodeName") is None
        # ... and the extender's reason, from its pod watch (docs/dra.md)
        (ours,) = wait_for("too-big's GPUSharingDRAUnschedulable Event", lambda: [
            e for e in get(cp, f"/api/v1/namespaces/{ns_ext}/events?fieldSelector="
                               "involvedObject.name=too-big")["items"]
            if e["reason"] == "GPUSharingDRAUnschedulable"], timeout=60)
        report(f"too-big, {ours['source']['component']}: {ours['message']}")
        assert ours["type"] == "Warning" and ours["source"]["component"] == "sharegpu-extender"
        assert "spec.devices.requests[0].exactly.capacity.requests.memory=48Gi (spec." \
               "containers[0] aliyun.com/gpu-mem=48): larger than every GPU of the DRA pool " \
               f"(largest: 40Gi, node {c.nodes['d']} gpu-0)" in ours["message"], ours["message"]
        # the pods Pending because the pool is full would fit an empty pool: no such Event
        said = {e["involvedObject"]["name"] for e in get(
            cp, f"/api/v1/namespaces/{ns_ext}/events")["items"]
            if e["reason"] == "GPUSharingDRAUnschedulable"}
        assert said == {"too-big"}, said

        # the kubelet's DRA manager on every node prepares the bound pods' claims
        prepare_everything(c, with_ext, report)
        report(f"placed: {without['placed']} of 50 without the extender's ranking, "
               f"{with_ext['placed']} of 50 with it")
        assert sum(1 for w in with_ext["wanted"].values() if w[2] == 2) == 8
    finally:
        cp.restart_scheduler()
        if ext is not None:
            ext.proc.stop()
        cleanup(c.admin, ns_default)
        cleanup(c.admin, ns_ext)
