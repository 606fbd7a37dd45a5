"""A real Kubernetes control plane on loopback for sharegpu's end-to-end tests.

``ControlPlane`` runs etcd, kube-apiserver, kube-controller-manager and kube-scheduler from the
multi-call binary that ``scripts/build-controlplane.sh`` builds (upstream k8s.io/kubernetes and
etcd, pinned in ``e2e/controlplane/go.mod``). Everything listens on 127.0.0.1 on free ports; the
CA, serving and client certificates, the service-account signing key and the kubeconfigs are
made per run in a temporary directory. Each component runs in its own process group, and
``stop()`` (also registered with ``atexit``) kills those groups, leaving no process behind.

    cp = ControlPlane(extra_args={"kube-scheduler": ["--v=4"]})
    cp.start()
    client = lightkube.Client(lightkube.KubeConfig.from_file(cp.admin_kubeconfig))
    ...
    cp.restart_scheduler(config={"profiles": [...]}, feature_gates={"SomeGate": True})
    cp.stop()
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BINARY = REPO / ".tools" / "bin" / "sharegpu-controlplane"
BUILD_SCRIPT = REPO / "scripts" / "build-controlplane.sh"

APISERVER = "kube-apiserver"
CONTROLLER_MANAGER = "kube-controller-manager"
SCHEDULER = "kube-scheduler"
ETCD = "etcd"
COMPONENTS = (ETCD, APISERVER, CONTROLLER_MANAGER, SCHEDULER)

# A small service range; nothing routes to it (there is no kube-proxy), the API server only
# allocates ClusterIPs from it.
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
SCHEDULER_CONFIG_API = "kubescheduler.config.k8s.io/v1"


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached."""


def build(timeout: float = 3600) -> Path:
    """Run scripts/build-controlplane.sh (a no-op when the binary is up to date); return the
    binary's path. Raises ControlPlaneError with the script's output if the build fails."""
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise ControlPlaneError(
            f"{BUILD_SCRIPT.relative_to(REPO)} exited {proc.returncode}:\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    binary = Path(os.environ.get("SHAREGPU_CONTROLPLANE_BIN", DEFAULT_BINARY))
    if not binary.is_file():
        raise ControlPlaneError(f"build succeeded but {binary} does not exist")
    return binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Certificates


@dataclass(frozen=True)
class KeyPair:
    cert: Path  # PEM certificate
    key: Path  # PEM private key (PKCS8, unencrypted)


class _CA:
    """A throwaway CA (EC P-256) that signs serving and client certificates for one run."""

    def __init__(
        self, directory: Path, stem: str = "ca", name: str = "sharegpu-e2e-ca", days: int = 2
    ) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.directory = directory
        self.days = days
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )  # fmt: skip
        self.files = KeyPair(directory / f"{stem}.crt", directory / f"{stem}.key")
        _write_pem(self.files.cert, self.cert_pem)
        _write_pem(self.files.key, _key_pem(self.key))

    @property
    def cert_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        stem: str,
        common_name: str,
        *,
        organizations: Sequence[str] = (),
        hosts: Sequence[str] = (),
        server: bool = False,
        client: bool = False,
    ) -> tuple[KeyPair, bytes, bytes]:
        """Sign a leaf certificate; write ``<stem>.crt``/``<stem>.key``; return the files and
        the PEM bytes of certificate and key."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        )
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_encipherment=False, key_cert_sign=False,
                    crl_sign=False, content_commitment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )  # fmt: skip
        if hosts:
            names: list[x509.GeneralName] = []
            for h in hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(h)))
                except ValueError:
                    names.append(x509.DNSName(h))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        from cryptography.hazmat.primitives import serialization

        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        key_pem = _key_pem(key)
        files = KeyPair(self.directory / f"{stem}.crt", self.directory / f"{stem}.key")
        _write_pem(files.cert, cert_pem)
        _write_pem(files.key, key_pem)
        return files, cert_pem, key_pem


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_pem(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def _write_service_account_keys(directory: Path) -> KeyPair:
    """The key pair that signs (and verifies) service-account tokens."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    files = KeyPair(directory / "sa.pub", directory / "sa.key")
    _write_pem(
        files.cert,
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )
    _write_pem(files.key, _key_pem(key))
    return files


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kubeconfig(server: str, ca_pem: bytes, user: str, **credentials: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "sharegpu-e2e",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": user, "context": {"cluster": "sharegpu-e2e", "user": user}}],
        "current-context": user,
    }


def _write_yaml(path: Path, data: Mapping[str, Any]) -> Path:
    # JSON is YAML: every Kubernetes component and lightkube read it.
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------------------------------------
# Processes


@dataclass
class _Component:
    name: str
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes]
    port: int

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies (Linux), so a
    test run killed with SIGKILL leaves no component behind either."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the process group led by ``proc``, wait up to ``grace`` seconds, then SIGKILL it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    # SIGKILL whatever is left in the group (also children that outlived the leader).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1.

    ``extra_args`` maps a component name (``"etcd"``, ``"kube-apiserver"``,
    ``"kube-controller-manager"``, ``"kube-scheduler"``) to arguments appended after the
    defaults (so a scalar flag given there wins). ``feature_gates`` goes to the API server, the
    controller manager and the scheduler as ``--feature-gates``. ``scheduler_config`` is a
    KubeSchedulerConfiguration as a mapping (``clientConnection.kubeconfig`` is filled in) or the
    path of a complete file (which must name a kubeconfig: with ``--config`` the scheduler ignores
    ``--kubeconfig``; use ``scheduler_kubeconfig``). ``advertise_address`` (a non-loopback address
    of this machine) makes the API server listen on every address and publish that one as the
    ``kubernetes`` Service's endpoint, so pods on real nodes reach it through the Service; by
    default it listens on 127.0.0.1 only and publishes no endpoint.
    """

    def __init__(
        self,
        binary: Path | str | None = None,
        *,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        feature_gates: Mapping[str, bool] | None = None,
        scheduler_config: Mapping[str, Any] | Path | str | None = None,
        workdir: Path | str | None = None,
        verbosity: int = 1,
        start_timeout: float = 120.0,
        advertise_address: str | None = None,
    ) -> None:
        self.advertise_address = advertise_address
        self.binary = Path(
            binary or os.environ.get("SHAREGPU_CONTROLPLANE_BIN", "") or DEFAULT_BINARY
        )
        unknown = set(extra_args or {}) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"extra_args for unknown components {sorted(unknown)}")
        self.extra_args = {k: list(v) for k, v in (extra_args or {}).items()}
        self.feature_gates = dict(feature_gates or {})
        self.scheduler_config = scheduler_config
        self.verbosity = verbosity
        self.start_timeout = start_timeout
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="sharegpu-controlplane-"))
        self.components: dict[str, _Component] = {}
        self.startup_seconds: dict[str, float] = {}
        self._started = False
        self._atexit_registered = False
        self._users = 0
        self._component_ssl: ssl.SSLContext | None = None

    # -- public surface -----------------------------------------------------------------------

    @property
    def server(self) -> str:
        """The API server's URL, ``https://127.0.0.1:PORT``."""
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def ca_path(self) -> Path:
        """The CA (PEM) that signed the API server's certificate and every client certificate."""
        return self._ca.files.cert

    @property
    def admin_kubeconfig(self) -> Path:
        """A kubeconfig for a ``system:masters`` user."""
        return self._admin_kubeconfig

    @property
    def scheduler_kubeconfig(self) -> Path:
        """The scheduler's own kubeconfig (``system:kube-scheduler``), for a --config file."""
        return self._scheduler_kubeconfig

    @property
    def controller_manager_kubeconfig(self) -> Path:
        return self._kcm_kubeconfig

    def log_path(self, component: str) -> Path:
        return self.workdir / "logs" / f"{component}.log"

    def kubeconfig_for(self, user: str, groups: Sequence[str] = ()) -> Path:
        """Write a kubeconfig authenticating as ``user`` (in ``groups``) with a client
        certificate signed by the cluster's CA; return its path."""
        self._users += 1
        stem = f"user-{self._users}"
        _, cert_pem, key_pem = self._ca.issue(stem, user, organizations=groups, client=True)
        return _write_yaml(
            self.workdir / "kubeconfigs" / f"{stem}.kubeconfig",
            _kubeconfig(
                self.server,
                self._ca.cert_pem,
                user,
                **{"client-certificate-data": _b64(cert_pem), "client-key-data": _b64(key_pem)},
            ),
        )

    def service_account_kubeconfig(
        self,
        namespace: str,
        name: str,
        *,
        expiration_seconds: int = 3600,
        create: bool = True,
        bound_pod: Mapping[str, Any] | None = None,
    ) -> Path:
        """Mint a token for ServiceAccount ``namespace/name`` through the TokenRequest API (with
        the admin credentials; the ServiceAccount is created first if missing and ``create``) and
        write a bearer-token kubeconfig for it. ``bound_pod`` (a Pod of that ServiceAccount, as
        the API server returned it) binds the token to the pod, as a pod's projected token is:
        bound to a pod on a node, it carries ``authentication.kubernetes.io/node-name``."""
        base = f"/api/v1/namespaces/{namespace}/serviceaccounts"
        if create:
            status, body = self.request("GET", f"{base}/{name}")
            if status == 404:
                status, body = self.request(
                    "POST",
                    base,
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
                )
                if status not in (201, 409):
                    raise ControlPlaneError(f"creating ServiceAccount {namespace}/{name}: {body}")
        status, body = self.request(
            "POST",
            f"{base}/{name}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": expiration_seconds, **({"boundObjectRef": {
                    "apiVersion": "v1", "kind": "Pod", "name": bound_pod["metadata"]["name"],
                    "uid": bound_pod["metadata"]["uid"]}} if bound_pod else {})},
            },
        )
        if status != 201:
            raise ControlPlaneError(f"TokenRequest for {namespace}/{name}: HTTP {status}: {body}")
        token = json.loads(body)["status"]["token"]
        return _write_yaml(
            self.workdir / "kubeconfigs" / (f"sa-{namespace}-{name}" + (
                f"-{bound_pod['metadata']['name']}" if bound_pod else "") + ".kubeconfig"),
            _kubeconfig(
                self.server, self._ca.cert_pem, f"system:serviceaccount:{namespace}:{name}",
                token=token,
            ),
        )  # fmt: skip

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = 10
    ) -> tuple[int, str]:
        """One HTTP request to the API server as the admin; returns (status, body text)."""
        status, _, text = self.request_with_warnings(method, path, body, timeout)
        return status, text

    def request_with_warnings(
        self, method: str, path: str, body: Any = None, timeout: float = 10
    ) -> tuple[int, list[str], str]:
        """As :meth:`request`, with the ``Warning`` headers of the answer (admission webhooks'
        warnings, as kubectl prints them). A ``bytes`` body is sent as it is (JSON that
        ``json.dumps`` would write otherwise, e.g. non-ASCII text unescaped, as kubectl does)."""
        data = None if body is None else body if isinstance(body, bytes) else \
            json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self._admin_ssl, timeout=timeout) as resp:
                return (resp.status, resp.headers.get_all("Warning") or [],
                        resp.read().decode(errors="replace"))
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get_all("Warning") or [], e.read().decode(errors="replace")

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        """Start etcd, the API server, the controller manager and the scheduler; wait until each
        is healthy. On failure everything started is stopped and ControlPlaneError raised (with
        the tail of the failing component's log)."""
        if self._started:
            raise ControlPlaneError("already started")
        if not self.binary.is_file():
            raise ControlPlaneError(
                f"{self.binary} does not exist: run scripts/build-controlplane.sh"
            )
        self._started = True
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        t0 = time.monotonic()
        try:
            self._prepare()
            self._start_etcd()
            self._start_apiserver()
            self._start_controller_manager()
            self._start_scheduler(self.scheduler_config, self.extra_args.get(SCHEDULER, []))
            self._wait_controller_manager()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds["total"] = time.monotonic() - t0
        return self

    def restart_scheduler(
        self,
        config: Mapping[str, Any] | Path | str | None = None,
        *,
        extra_args: Sequence[str] | None = None,
        feature_gates: Mapping[str, bool] | None = None,
    ) -> None:
        """Stop the scheduler and start it again with another ``config`` (see the class doc),
        ``extra_args`` (replacing those given at construction) and, if given, ``feature_gates``
        (for the scheduler only; merged over the control plane's). Waits until it is healthy."""
        self.stop_scheduler()
        args = list(self.extra_args.get(SCHEDULER, []) if extra_args is None else extra_args)
        self._start_scheduler(config, args, feature_gates)

    def stop_scheduler(self) -> None:
        """Stop the scheduler (nothing schedules until :meth:`restart_scheduler`); idempotent."""
        old = self.components.pop(SCHEDULER, None)
        if old is not None:
            _kill_group(old.proc, grace=10)

    def component_get(self, component: str, path: str, timeout: float = 10) -> tuple[int, str]:
        """GET ``path`` on a running component's secure port as the admin (client certificate,
        ``system:masters``: the component's delegated authorization allows ``/metrics``);
        returns (status, body text). The component's serving certificate is self-signed
        (``--cert-dir``), so it is not verified."""
        comp = self.components.get(component)
        if comp is None or component == ETCD:
            raise ControlPlaneError(f"{component} is not running (or has no secure port)")
        if self._component_ssl is None:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            certs = self.workdir / "certs"
            context.load_cert_chain(str(certs / "admin.crt"), str(certs / "admin.key"))
            self._component_ssl = context
        return self._https_get(comp.port, path, self._component_ssl, timeout)

    def stop(self) -> None:
        """Stop every component (newest first), leaving no process behind. Idempotent. The work
        directory is removed unless SHAREGPU_E2E_KEEP=1 (or it was passed in)."""
        for name in reversed(list(self.components)):
            comp = self.components.pop(name)
            _kill_group(comp.proc, grace=10)
        if self._own_workdir and self.workdir.exists() and not os.environ.get("SHAREGPU_E2E_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        self._started = False

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_alive(self) -> None:
        """Raise ControlPlaneError if a component has exited."""
        for comp in self.components.values():
            if comp.proc.poll() is not None:
                raise ControlPlaneError(
                    f"{comp.name} exited with {comp.proc.returncode}:\n{comp.log_tail()}"
                )

    def describe(self) -> str:
        """Each component's command line, for logs and reports."""
        return "\n".join(
            f"{c.name} (pid {c.proc.pid}): {' '.join(c.args)}" for c in self.components.values()
        )

    # -- internals ----------------------------------------------------------------------------

    def _prepare(self) -> None:
        for sub in ("certs", "kubeconfigs", "logs", "etcd", "kcm-certs", "scheduler-certs"):
            (self.workdir / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.etcd_client_port = free_port()
        self.etcd_peer_port = free_port()
        self.apiserver_port = free_port()
        certs = self.workdir / "certs"
        self._ca = _CA(certs)
        service_ip = str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))
        self._apiserver_cert, _, _ = self._ca.issue(
            "apiserver",
            "kube-apiserver",
            hosts=(
                "127.0.0.1", "localhost", service_ip, "kubernetes", "kubernetes.default",
                "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
                *([self.advertise_address] if self.advertise_address else []),
            ),
            server=True,
        )  # fmt: skip
        self._sa_keys = _write_service_account_keys(certs)
        # The aggregation layer's front proxy: its own CA and the API server's client certificate.
        self._front_proxy_ca = _CA(certs, "front-proxy-ca", "sharegpu-e2e-front-proxy-ca")
        self._front_proxy_client, _, _ = self._front_proxy_ca.issue(
            "front-proxy-client", "front-proxy-client", client=True
        )
        self._admin_kubeconfig = self._component_kubeconfig(
            "admin", "sharegpu-e2e-admin", ["system:masters"]
        )
        self._kcm_kubeconfig = self._component_kubeconfig(
            "kube-controller-manager", "system:kube-controller-manager"
        )
        self._scheduler_kubeconfig = self._component_kubeconfig(
            "kube-scheduler", "system:kube-scheduler"
        )
        admin = KeyPair(certs / "admin.crt", certs / "admin.key")
        self._admin_ssl = ssl.create_default_context(cafile=str(self._ca.files.cert))
        self._admin_ssl.load_cert_chain(str(admin.cert), str(admin.key))

    def _component_kubeconfig(self, stem: str, user: str, groups: Sequence[str] = ()) -> Path:
        _, cert_pem, key_pem = self._ca.issue(stem, user, organizations=groups, client=True)
        return _write_yaml(
            self.workdir / "kubeconfigs" / f"{stem}.kubeconfig",
            _kubeconfig(
                f"https://127.0.0.1:{self.apiserver_port}",
                self._ca.cert_pem,
                user,
                **{"client-certificate-data": _b64(cert_pem), "client-key-data": _b64(key_pem)},
            ),
        )

    def _feature_gate_args(self, override: Mapping[str, bool] | None = None) -> list[str]:
        gates = {**self.feature_gates, **(override or {})}
        if not gates:
            return []
        return [
            "--feature-gates=" + ",".join(f"{k}={str(v).lower()}" for k, v in sorted(gates.items()))
        ]

    def _launch(self, name: str, args: list[str], port: int) -> _Component:
        argv = [str(self.binary), name, *args]
        log = self.log_path(name)
        with log.open("ab") as out:
            out.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,  # own process group: stop() kills the whole group
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        comp = _Component(name, argv, log, proc, port)
        self.components[name] = comp
        return comp

    def _wait(self, comp: _Component, probe: Any, what: str, key: str | None = None) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.start_timeout
        last = ""
        while time.monotonic() < deadline:
            if comp.proc.poll() is not None:
                raise ControlPlaneError(
                    f"{comp.name} exited with {comp.proc.returncode} before {what}:\n"
                    f"{comp.log_tail()}"
                )
            try:
                ok, last = probe()
                if ok:
                    self.startup_seconds[key or comp.name] = time.monotonic() - t0
                    return
            except (OSError, ssl.SSLError, ValueError) as e:
                last = repr(e)
            time.sleep(0.2)
        raise ControlPlaneError(
            f"{comp.name}: no {what} after {self.start_timeout}s (last: {last}):\n{comp.log_tail()}"
        )

    def _https_get(self, port: int, path: str, context: ssl.SSLContext,
                   timeout: float = 5) -> tuple[int, str]:
        url = f"https://127.0.0.1:{port}{path}"
        try:
            with urllib.request.urlopen(url, context=context, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def _healthz_probe(self, port: int) -> Any:
        # The controller manager and scheduler serve /healthz with self-signed certificates
        # and let anyone read it (--authorization-always-allow-paths).
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE

        def probe() -> tuple[bool, str]:
            status, body = self._https_get(port, "/healthz", insecure)
            return status == 200, f"HTTP {status}: {body[:500]}"

        return probe

    def _start_etcd(self) -> None:
        args = [
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-url=http://127.0.0.1:{self.etcd_client_port}",
            f"--listen-peer-url=http://127.0.0.1:{self.etcd_peer_port}",
            "--quota-backend-bytes=2147483648",
            *self.extra_args.get(ETCD, []),
        ]
        comp = self._launch(ETCD, args, self.etcd_client_port)

        def probe() -> tuple[bool, str]:
            url = f"http://127.0.0.1:{self.etcd_client_port}/health"
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    body = resp.read().decode()
            except urllib.error.HTTPError as e:
                body = e.read().decode(errors="replace")
            return '"health":"true"' in body.replace(" ", ""), body

        self._wait(comp, probe, "/health")

    def _address_args(self) -> list[str]:
        if self.advertise_address:
            return ["--bind-address=0.0.0.0", f"--advertise-address={self.advertise_address}"]
        # The "kubernetes" Service's endpoints would be 127.0.0.1, which validation refuses.
        return ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none"]

    def _start_apiserver(self) -> None:
        certs = self.workdir / "certs"
        args = [
            f"--etcd-servers=http://127.0.0.1:{self.etcd_client_port}",
            *self._address_args(),
            f"--secure-port={self.apiserver_port}",
            f"--cert-dir={certs}",
            f"--tls-cert-file={self._apiserver_cert.cert}",
            f"--tls-private-key-file={self._apiserver_cert.key}",
            f"--client-ca-file={self._ca.files.cert}",
            f"--requestheader-client-ca-file={self._front_proxy_ca.files.cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-uid-headers=X-Remote-Uid",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={self._front_proxy_client.cert}",
            f"--proxy-client-key-file={self._front_proxy_client.key}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction,MutatingAdmissionWebhook,"
            "ValidatingAdmissionWebhook",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={self._sa_keys.cert}",
            f"--service-account-signing-key-file={self._sa_keys.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            f"--v={self.verbosity}",
            *self._feature_gate_args(),
            *self.extra_args.get(APISERVER, []),
        ]
        comp = self._launch(APISERVER, args, self.apiserver_port)

        def probe() -> tuple[bool, str]:
            status, body = self._https_get(self.apiserver_port, "/readyz", self._admin_ssl)
            return status == 200, f"HTTP {status}: {body[-1500:]}"

        self._wait(comp, probe, "/readyz")

    def _start_controller_manager(self) -> None:
        port = free_port()
        kubeconfig = self._kcm_kubeconfig
        args = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'kcm-certs'}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self._sa_keys.key}",
            f"--root-ca-file={self._ca.files.cert}",
            f"--cluster-signing-cert-file={self._ca.files.cert}",
            f"--cluster-signing-key-file={self._ca.files.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=true",
            "--profiling=false",
            f"--v={self.verbosity}",
            *self._feature_gate_args(),
            *self.extra_args.get(CONTROLLER_MANAGER, []),
        ]
        comp = self._launch(CONTROLLER_MANAGER, args, port)
        self._wait(comp, self._healthz_probe(port), "/healthz")

    def _wait_controller_manager(self) -> None:
        # /healthz answers before the controllers run; the "default" ServiceAccount of the
        # "default" namespace shows the service-account controller at work.
        comp = self.components[CONTROLLER_MANAGER]

        def probe() -> tuple[bool, str]:
            status, body = self.request(
                "GET", "/api/v1/namespaces/default/serviceaccounts/default", timeout=5
            )
            return status == 200, f"HTTP {status}: {body[:300]}"

        self._wait(comp, probe, "default ServiceAccount", key="default-serviceaccount")

    def _scheduler_config_path(self, config: Mapping[str, Any] | Path | str) -> Path:
        if isinstance(config, Path | str):
            return Path(config)
        cfg: dict[str, Any] = json.loads(json.dumps(config))  # deep copy
        cfg.setdefault("apiVersion", SCHEDULER_CONFIG_API)
        cfg.setdefault("kind", "KubeSchedulerConfiguration")
        cfg.setdefault("clientConnection", {}).setdefault(
            "kubeconfig", str(self._scheduler_kubeconfig)
        )
        cfg.setdefault("leaderElection", {}).setdefault("leaderElect", False)
        n = len(list(self.workdir.glob("scheduler-config-*.yaml"))) + 1
        return _write_yaml(self.workdir / f"scheduler-config-{n}.yaml", cfg)

    def _start_scheduler(
        self,
        config: Mapping[str, Any] | Path | str | None,
        extra_args: Sequence[str],
        feature_gates: Mapping[str, bool] | None = None,
    ) -> None:
        port = free_port()
        kubeconfig = self._scheduler_kubeconfig
        args = [
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'scheduler-certs'}",
            # One scheduler at a time: no lease to wait for when it is restarted.
            "--leader-elect=false",
            "--profiling=false",
            f"--v={self.verbosity}",
        ]
        if config is None:
            args.insert(0, f"--kubeconfig={kubeconfig}")
        else:
            args.insert(0, f"--config={self._scheduler_config_path(config)}")
        args += [*self._feature_gate_args(feature_gates), *extra_args]
        comp = self._launch(SCHEDULER, args, port)
        self._wait(comp, self._healthz_probe(port), "/healthz")
