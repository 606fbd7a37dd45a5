"""Helpers of the tests that run sharegpu's components against the real control plane.

- :func:`render_chart` / :class:`ChartRbac`: the chart rendered for a release and namespace, and
  its ServiceAccounts, (Cluster)Roles and (Cluster)RoleBindings of one component created in the
  real API server exactly as rendered (Deployments, DaemonSets and the webhook are not applied:
  nothing here runs pods, and a ``failurePolicy: Fail`` webhook without its Service would refuse
  every pod);
- :func:`start_extender`: ``sharegpu extender`` with the arguments of the chart's Deployment (its
  listen addresses on loopback, ``$(POD_NAME)``/``$(POD_IP)`` as the pod would have them, the
  chart's TLS Secret in files where the pod mounts it) and its ServiceAccount's token; it serves
  the verbs over TLS with the chart's certificate, which names only the Service: clients connect
  to 127.0.0.1 and verify the Service's name with the chart's CA (:class:`LocalExtender`);
- :func:`scheduler_config_for`: the chart's KubeSchedulerConfiguration (only ``urlPrefix``
  changed: its https, caData and serverName stay) with the chart's scheduler ServiceAccount as
  its client, as in the cluster;
- :class:`ServiceProxy`: a loopback TCP proxy standing in for the extender's Service: each new
  connection goes to a replica whose ``/readyz`` answers 200 (round robin; TLS passes through);
- :class:`PodWatch`: a watch on one namespace's pods recording, per pod, when it was seen bound
  (wall clock), to which node, and each decision annotation written on it;
  :class:`StandInKubelets` also marks bound pods assigned, as each node's kubelet and agent do;
- GPU nodes as the agent leaves them (:func:`gpu_node`) and GPU pods (:func:`gpu_pod`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from lightkube import ApiError, Client, KubeConfig, codecs
from lightkube.resources.core_v1 import Namespace, Node, Pod, ServiceAccount
from lightkube.types import PatchType

from sharegpu.core import names
from sharegpu.core.annotations import assigned_patch, is_assigned
from sharegpu.core.modes import Mode, advertised_resources

from .components import (
    CHART,
    SharegpuProcess,
    create_node_object,
    free_port,
    helm,
    node_object,
    wait_for,
)
from .controlplane import ControlPlane

T = TypeVar("T")

RUN_LABEL = "e2e.sharegpu.io/run"  # every node and pod of one test carries it
IMAGE = "registry.invalid/sharegpu/pause:never-pulled"  # no kubelet: never pulled
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


class Report:
    """Lines for the test report: collected, echoed to stderr (shown with a failure) and, by
    :meth:`flush`, printed past pytest's capture."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str) -> None:
        self.lines.append(text)
        print(text, file=sys.stderr)

    def flush(self, capsys: Any) -> None:
        if self.lines:
            with capsys.disabled():
                sys.stdout.write("\n" + "\n".join(self.lines) + "\n")
                sys.stdout.flush()
        self.lines = []




# ---------------------------------------------------------------------------------------------
# the chart


def render_chart(release: str, namespace: str,
                 values: Mapping[str, str] | None = None,
                 chart: Path | None = None) -> list[dict[str, Any]]:
    """``helm template RELEASE charts/sharegpu -n NAMESPACE`` (a release name of its own keeps
    the cluster-scoped names of two tests apart); ``chart``: another copy of the chart."""
    sets: list[str] = []
    for k, v in (values or {}).items():
        sets += ["--set", f"{k}={v}"]
    out = helm(None, "template", release, str(chart or CHART), "-n", namespace,
               "--kube-version", "1.37.2", *sets)
    return [d for d in yaml.safe_load_all(out) if d]


def fullname(release: str) -> str:
    return release if "sharegpu" in release else f"{release}-sharegpu"


class ChartRbac:
    """The chart's RBAC objects of one component (``agent``, ``extender``, ``scheduler``),
    created as rendered; :meth:`delete` removes them again."""

    def __init__(self, admin: Client, docs: Sequence[Mapping[str, Any]], release: str) -> None:
        self.admin, self.docs, self.prefix = admin, docs, fullname(release)
        self.created: list[Any] = []

    def objects(self, component: str) -> list[Mapping[str, Any]]:
        stem = f"{self.prefix}-{component}"
        return [d for d in self.docs if d["kind"] in RBAC_KINDS
                and (d["metadata"]["name"] == stem
                     or d["metadata"]["name"].startswith(stem + "-"))]

    def apply(self, component: str) -> str:
        """Create the component's objects; return its ServiceAccount's name."""
        sa = ""
        objs = self.objects(component)
        assert objs, f"the chart renders no RBAC for {component}"
        for d in objs:
            obj = codecs.from_dict(json.loads(json.dumps(d)))
            self.admin.create(obj)
            self.created.append(obj)
            if d["kind"] == "ServiceAccount":
                sa = d["metadata"]["name"]
        assert sa, f"the chart renders no ServiceAccount for {component}"
        return sa

    def delete(self) -> None:
        for obj in reversed(self.created):
            with contextlib.suppress(ApiError):
                self.admin.delete(type(obj), obj.metadata.name,
                                  namespace=obj.metadata.namespace)
        self.created = []


def sa_client(cp: ControlPlane, namespace: str, name: str) -> tuple[Path, Client]:
    path = cp.service_account_kubeconfig(namespace, name, create=False)
    return path, Client(KubeConfig.from_file(path))


def wait_allowed(what: str, call: Callable[[], object], timeout: float = 30.0) -> None:
    """Wait until the RBAC authorizer has seen new bindings (``call`` stops answering 403)."""
    def ok() -> bool:
        try:
            call()
        except ApiError as e:
            if e.status.code == 403:
                return False
            raise
        return True

    wait_for(f"RBAC to allow {what}", ok, timeout)


def make_namespace(admin: Client, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    admin.create(Namespace.from_dict({"metadata": {"name": name}}))
    wait_for(f"ServiceAccount {name}/default",
             lambda: admin.get(ServiceAccount, "default", namespace=name))
    return name


def cleanup(admin: Client, namespace: str | None, nodes: Iterable[str] = ()) -> None:
    """Force-delete the namespace's pods (no kubelet would confirm a graceful deletion), then
    the namespace (when given) and the nodes."""
    if namespace:
        with contextlib.suppress(ApiError):
            for p in admin.list(Pod, namespace=namespace):
                with contextlib.suppress(ApiError):
                    admin.delete(Pod, p.metadata.name, namespace=namespace, grace_period=0)
        with contextlib.suppress(ApiError):
            admin.delete(Namespace, namespace)
    for n in nodes:
        with contextlib.suppress(ApiError):
            admin.delete(Node, n)


# ---------------------------------------------------------------------------------------------
# sharegpu extender and kube-scheduler


def extender_args(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    for d in docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-extender"):
            return list(d["spec"]["template"]["spec"]["containers"][0]["args"])
    raise AssertionError("the chart renders no extender Deployment")


def extender_tls_secret(docs: Sequence[Mapping[str, Any]]) -> dict[str, bytes]:
    """The data of the chart's extender TLS Secret (ca.crt, tls.crt, tls.key), decoded."""
    for d in docs:
        if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-extender-tls"):
            return {k: base64.b64decode(v) for k, v in d["data"].items()}
    raise AssertionError("the chart renders no extender TLS Secret")


def extender_client_secret(docs: Sequence[Mapping[str, Any]]) -> dict[str, bytes] | None:
    """The data of the chart's Secret with kube-scheduler's client certificate for the
    extender (tls.crt, tls.key), decoded; None for a chart without one (an older version's,
    compared in bench/)."""
    for d in docs:
        if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-extender-client-tls"):
            return {k: base64.b64decode(v) for k, v in d["data"].items()}
    return None


def write_client_tls(directory: Path, docs: Sequence[Mapping[str, Any]]) -> Path | None:
    """kube-scheduler's client certificate from the chart's Secret, as its mount has it."""
    data = extender_client_secret(docs)
    return write_tls(directory, data, keys=("tls.crt", "tls.key")) if data else None


def write_tls(directory: Path, data: Mapping[str, bytes],
              keys: Sequence[str] = ("ca.crt", "tls.crt", "tls.key")) -> Path:
    """The Secret's files as the pod's mount has them (/tls; the scheduler's client
    certificate: ``keys`` tls.crt and tls.key)."""
    directory.mkdir(parents=True, exist_ok=True)
    for k in keys:
        (directory / k).write_bytes(data[k])
    (directory / "tls.key").chmod(0o600)
    return directory


class _VerifiedHTTPS(http.client.HTTPSConnection):
    """HTTPS to an address, the certificate verified under ``server_name`` (as kube-scheduler
    does with tlsConfig.serverName)."""

    def __init__(self, host: str, port: int, ctx: ssl.SSLContext, server_name: str,
                 timeout: float) -> None:
        super().__init__(host, port, context=ctx, timeout=timeout)
        self._ctx, self._server_name = ctx, server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._ctx.wrap_socket(self.sock, server_hostname=self._server_name)


@dataclass(frozen=True)
class LocalExtender:
    proc: SharegpuProcess
    url: str  # https://127.0.0.1:PORT: the verbs (and health, metrics), mutual TLS
    metrics_url: str  # http://127.0.0.1:PORT: GET /healthz, /readyz, /metrics only
    ca_pem: str  # the chart's CA
    server_name: str  # the Service's name the certificate carries
    # kube-scheduler's client certificate: tls.crt, tls.key (None: an older chart's, without)
    client_tls: Path | None

    def client(self) -> ssl.SSLContext:
        """As kube-scheduler connects: the chart's CA, and its client certificate."""
        ctx = ssl.create_default_context(cadata=self.ca_pem)
        if self.client_tls is not None:
            ctx.load_cert_chain(self.client_tls / "tls.crt", self.client_tls / "tls.key")
        return ctx

    def post(self, path: str, body: Any, timeout: float = 10.0) -> Any:
        """POST over mutual TLS, verified with the chart's CA under the Service's name,
        presenting kube-scheduler's client certificate."""
        host, port = self.url.removeprefix("https://").split(":")
        conn = _VerifiedHTTPS(host, int(port), self.client(), self.server_name, timeout)
        try:
            conn.request("POST", path, json.dumps(body).encode(),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200, (r.status, r.read()[:300])
            return json.loads(r.read())
        finally:
            conn.close()


def start_extender(cp: ControlPlane, docs: Sequence[Mapping[str, Any]], identity: str,
                   kubeconfig: Path, port: int | None = None,
                   env: Mapping[str, str] | None = None) -> LocalExtender:
    """``sharegpu extender`` as the chart's Deployment runs it, on 127.0.0.1, serving the
    chart's certificate over TLS; ready (/readyz on the metrics port). ``env``: more of its
    environment (``PYTHONPATH``: another copy of sharegpu)."""
    port = port or free_port()
    metrics = free_port()
    tls = write_tls(cp.workdir / f"extender-tls-{identity}", extender_tls_secret(docs))
    args = []
    server_name = ""
    for a in extender_args(docs):
        if a.startswith("--own-pod="):
            continue  # no pod to label here: the tests' proxy plays the Service
        if a.startswith("--listen="):
            a = f"--listen=127.0.0.1:{port}"
        elif a.startswith("--metrics-listen="):
            a = f"--metrics-listen=127.0.0.1:{metrics}"
        elif a.startswith("--tls-server-name="):
            server_name = a.split("=", 1)[1]
        args.append(a.replace("$(POD_NAME)", identity).replace("=/tls/", f"={tls}/"))
    assert server_name and f"--tls-cert={tls}/tls.crt" in args, args
    args.append(f"--kubeconfig={kubeconfig}")
    proc = SharegpuProcess(cp, f"extender-{identity}", args,
                           env={"POD_NAME": identity, "POD_IP": "127.0.0.1",
                                **(env or {})}).start()
    client = write_client_tls(cp.workdir / f"extender-client-tls-{identity}", docs)
    ext = LocalExtender(proc, f"https://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}",
                        (tls / "ca.crt").read_text(), server_name, client)
    proc.wait_http(ext.metrics_url + "/readyz", timeout=60)
    return ext


def scheduler_config_for(cp: ControlPlane, docs: Sequence[Mapping[str, Any]], release: str,
                         namespace: str, extender_url: str) -> dict[str, Any]:
    """The chart's KubeSchedulerConfiguration (only urlPrefix changed, and the client
    certificate's files where this machine has them); its client is the chart's scheduler
    ServiceAccount (in the cluster: in-cluster config of that ServiceAccount)."""
    from .components import scheduler_config

    client = write_client_tls(cp.workdir / f"scheduler-client-tls-{release}-{namespace}", docs)
    cfg = scheduler_config(docs, extender_url, client_tls=client)
    kubeconfig = cp.service_account_kubeconfig(namespace, f"{fullname(release)}-scheduler",
                                               create=False)
    cfg["clientConnection"] = {"kubeconfig": str(kubeconfig)}
    return cfg


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, repr(e)


def http_post(url: str, body: Any, timeout: float = 10.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metric(url: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of the samples of ``name`` on an extender's /metrics whose labels include
    ``labels`` (0 when there are none)."""
    _, text = http_get(url + "/metrics")
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in (labels or {}).items()):
            total += float(value)
    return total


# ---------------------------------------------------------------------------------------------
# a Service in front of the replicas


class ServiceProxy:
    """A loopback TCP proxy: each new connection goes to the next replica (round robin) whose
    ``/readyz`` answered 200 at the last probe (every ``probe_s``), as kube-proxy sends a Service's
    connections to ready endpoints; a replica that refuses the connection is skipped. Open
    connections stay with their replica (a crashed one resets them, as on a node)."""

    def __init__(self, backends: Sequence[str], probe_s: float = 0.2,
                 probes: Mapping[str, str] | None = None) -> None:
        self.backends = list(backends)  # http(s)://127.0.0.1:PORT
        self.probes = dict(probes or {})  # backend -> where its /readyz is (default: itself)
        self.probe_s = probe_s
        self.port = free_port()
        scheme = "https" if all(b.startswith("https://") for b in self.backends) else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"  # TLS passes through to the replicas
        self.ready: list[str] = []
        self.connections: dict[str, int] = dict.fromkeys(self.backends, 0)
        self._next = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="service-proxy", daemon=True)
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None

    def start(self) -> ServiceProxy:
        self._thread.start()
        assert self._started.wait(10), "the proxy did not start"
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        probe = asyncio.create_task(self._probe())
        self._started.set()
        await self._stop.wait()
        probe.cancel()
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)
        for t in asyncio.all_tasks() - {asyncio.current_task()}:
            t.cancel()

    async def _probe(self) -> None:
        while True:
            ready = []
            for b in self.backends:
                status, _ = await asyncio.to_thread(http_get,
                                                    self.probes.get(b, b) + "/readyz", 0.5)
                if status == 200:
                    ready.append(b)
            self.ready = ready
            await asyncio.sleep(self.probe_s)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = None
        ready = list(self.ready)
        for k in range(len(ready)):
            b = ready[(self._next + k) % len(ready)]
            host, port = b.split("://", 1)[-1].split(":")
            try:
                upstream = await asyncio.open_connection(host, int(port))
            except OSError:
                continue
            self._next = (self._next + k + 1) % max(1, len(ready))
            self.connections[b] += 1
            break
        if upstream is None:
            writer.close()
            return
        ur, uw = upstream

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        await asyncio.gather(pump(reader, uw), pump(ur, writer))


# ---------------------------------------------------------------------------------------------
# watching pods


class PodWatch:
    """Records, from a watch on ``namespace``'s pods: the wall-clock time each pod was first
    seen with ``spec.nodeName`` and that node (``bound``), every node name it was ever seen
    with (``nodes``), each distinct decision written on it (``decisions``: assume-time →
    allocation annotation) and whether its decision was on it when it was first seen bound
    (``annotated_at_bind``)."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from lightkube.config.client_adapter import Client as SyncAdapter
        from lightkube.config.client_adapter import ConnectionParams

        single = KubeConfig.from_file(kubeconfig).get()
        self.http = SyncAdapter(single, ConnectionParams())
        self.path = f"/api/v1/namespaces/{namespace}/pods"
        self.bound: dict[str, tuple[float, str]] = {}
        self.nodes: dict[str, set[str]] = {}
        self.decisions: dict[str, dict[str, str]] = {}
        self.annotated_at_bind: dict[str, bool] = {}
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> PodWatch:
        r = self.http.get(self.path)
        r.raise_for_status()
        body = r.json()
        for p in body.get("items") or []:
            self._see(p)
        self._rv = body["metadata"]["resourceVersion"]
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.http.close()

    def _see(self, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        name = meta.get("name", "")
        anns = meta.get("annotations") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        with self._lock:
            self.events += 1
            at = anns.get(names.ANN_ASSUME_TIME)
            if at:
                self.decisions.setdefault(name, {})[at] = anns.get(names.ANN_ALLOCATION, "")
            if node:
                self.nodes.setdefault(name, set()).add(node)
                if name not in self.bound:
                    self.bound[name] = (time.time(), node)
                    self.annotated_at_bind[name] = bool(at)

    def _run(self) -> None:
        while not self._stop.is_set():
            params = {"watch": "1", "resourceVersion": self._rv, "timeoutSeconds": "1",
                      "allowWatchBookmarks": "true"}
            try:
                with self.http.stream("GET", self.path, params=params, timeout=10) as r:
                    if r.status_code == 410:
                        r.read()
                        body = self.http.get(self.path).json()
                        for p in body.get("items") or []:
                            self._see(p)
                        self._rv = body["metadata"]["resourceVersion"]
                        continue
                    for line in r.iter_lines():
                        if not line.strip():
                            continue
                        ev = json.loads(line)
                        obj = ev.get("object") or {}
                        rv = (obj.get("metadata") or {}).get("resourceVersion")
                        if ev.get("type") == "ERROR":
                            break
                        if rv:
                            self._rv = rv
                        if ev.get("type") in ("ADDED", "MODIFIED"):
                            self._see(obj)
            except Exception:  # the watch is re-made; nothing is lost past self._rv
                time.sleep(0.1)


class StandInKubelets(PodWatch):
    """Plays every node's kubelet and sharegpu agent for ``namespace``'s pods: a pod seen bound
    with a sharegpu decision is marked ``assigned`` at once, as the agent marks it once the
    kubelet has allocated its devices (the extender binds a pod the kubelet could mistake for
    a starting one only after that, see sharegpu.core.startingpods)."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        super().__init__(kubeconfig, namespace)
        self.started: set[str] = set()

    def _see(self, pod: Mapping[str, Any]) -> None:
        super()._see(pod)
        meta = pod.get("metadata") or {}
        anns = meta.get("annotations") or {}
        name = meta.get("name", "")
        if (not (pod.get("spec") or {}).get("nodeName") or not anns.get(names.ANN_ALLOCATION)
                or is_assigned(anns) or name in self.started):
            return
        body = json.dumps({"metadata": {"annotations": assigned_patch()}})
        r = self.http.request("PATCH", f"{self.path}/{name}", content=body,
                              headers={"Content-Type": "application/merge-patch+json"})
        if r.status_code == 200:
            self.started.add(name)


# ---------------------------------------------------------------------------------------------
# nodes and pods


def gpu_node(client: Client, name: str, mode: str | None, gpus: Sequence[int], run: str, *,
             placement: str = "", model: str = "", links: list[list[str]] | None = None) -> str:
    """Create :func:`gpu_node_object` (and lift the not-ready taint); return its name."""
    return create_node_object(client, gpu_node_object(
        name, mode, gpus, run, placement=placement, model=model, links=links))


def gpu_node_object(name: str, mode: str | None, gpus: Sequence[int], run: str, *,
                    placement: str = "", model: str = "",
                    links: list[list[str]] | None = None) -> dict[str, Any]:
    """A kubelet-less Node as the agent and the kubelet leave it: the mode label (absent for
    ``None``: exclusive), card-model labels, ``sharegpu.io/gpu-mem`` (and the link matrix),
    ``sharegpu.io/last-mode``, and in capacity/allocatable every GPU resource the agent's device
    plugins advertise in that mode (``modes.advertised_resources``)."""
    m = Mode(mode) if mode else Mode.EXCLUSIVE
    labels = {RUN_LABEL: run}
    if mode:
        labels[names.LABEL_SCHEDULE] = mode
    if placement:
        labels[names.LABEL_PLACEMENT] = placement
    model = model or f"Tesla-GPU-{gpus[0]}GB"
    labels.update({names.LABEL_CARD_NAME: model, names.LABEL_CARD_MEM: f"{gpus[0] * 1024}MiB",
                   names.LABEL_CARD_COUNT: str(len(gpus))})
    annotations = {names.ANN_NODE_GPU_MEM: ",".join(map(str, gpus))}
    if mode:
        annotations[names.ANN_NODE_LAST_MODE] = m.value
    if links:
        annotations[names.ANN_NODE_GPU_TOPOLOGY] = json.dumps(links)
    res = {k: str(v) for k, v in advertised_resources(m, list(gpus)).items()}
    return node_object(name, labels=labels, annotations=annotations, resources=res)


def gpu_pod(name: str, run: str, *, mem: int | None = None, core: int | None = None,
            cards: int | None = None, topology: int | None = None,
            gpu_count: int | None = None, containers: Sequence[Mapping[str, int]] | None = None,
            scheduler: str = names.CO_SCHEDULER_NAME) -> dict[str, Any]:
    """A Pod asking for GPU resources in its limits (the API server defaults the requests);
    ``containers`` gives each container's {resource: value}."""
    if containers is None:
        lim: dict[str, int] = {}
        for r, v in ((names.RES_GPU_MEM, mem), (names.RES_GPU_CORE, core),
                     (names.RES_NVIDIA_GPU, cards), (names.RES_TOPOLOGY_GPU, topology)):
            if v is not None:
                lim[r] = v
        containers = [lim]
    labels = {RUN_LABEL: run}
    if gpu_count is not None:
        labels[names.POD_LABEL_GPU_COUNT] = str(gpu_count)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "schedulerName": scheduler,
            "nodeSelector": {RUN_LABEL: run},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": f"c{i}", "image": IMAGE,
                 "resources": {"limits": {r: str(v) for r, v in lim.items()}}}
                for i, lim in enumerate(containers)
            ],
        },
    }


def node_dicts(client: Client, run: str) -> list[dict[str, Any]]:
    return [n.to_dict() for n in client.list(Node, labels={RUN_LABEL: run})]


def pod_dicts(client: Client, namespace: str) -> list[dict[str, Any]]:
    return [p.to_dict() for p in client.list(Pod, namespace=namespace)]


def set_node_label(client: Client, node: str, key: str, value: str | None) -> None:
    client.patch(Node, node, {"metadata": {"labels": {key: value}}}, patch_type=PatchType.MERGE)


__all__ = [
    "IMAGE",
    "RUN_LABEL",
    "ChartRbac",
    "LocalExtender",
    "PodWatch",
    "Report",
    "ServiceProxy",
    "StandInKubelets",
    "cleanup",
    "extender_args",
    "extender_client_secret",
    "extender_tls_secret",
    "gpu_node",
    "gpu_node_object",
    "gpu_pod",
    "http_get",
    "http_post",
    "make_namespace",
    "metric",
    "node_dicts",
    "pod_dicts",
    "render_chart",
    "sa_client",
    "scheduler_config_for",
    "set_node_label",
    "start_extender",
    "wait_allowed",
    "wait_for",
    "write_client_tls",
    "write_tls",
]
