"""Routes by which a GPU container under isolation could set its own limits, and the rule that
refuses them at admission.

The node agent hands a shared-GPU container its limits as environment variables (HAMi-core's
``CUDA_DEVICE_MEMORY_LIMIT_<i>``, MPS's ``CUDA_MPS_*``...) and makes the loader preload HAMi-core
(``LD_PRELOAD`` and a ``/etc/ld.so.preload`` mounted over the image's). The kubelet puts the
pod's own variables after the device plugin's, so a container that names one of them by any
route replaces its limit: ``env``, ``envFrom`` (a ConfigMap or Secret can hold any key when the
pod is admitted, so an ``envFrom`` whose prefix could begin such a name is refused), or a
volume mounted at or over the preload list or the library. A container opted out of isolation
(``CGPU_DISABLE=true``) gets no limits, so nothing of it is refused here.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Mapping
from typing import Any

from . import names
from .request import isolation_opted_out

# the variables the agent sets for an isolated container (sharegpu.agent.isolation, whichever
# back-end: admission does not know the node) and its device grant
EXACT: tuple[str, ...] = (
    "LD_PRELOAD", "CUDA_DEVICE_ORDER", "CUDA_DEVICE_SM_LIMIT", "GPU_CORE_UTILIZATION_POLICY",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE", "CUDA_DISABLE_CONTROL", names.ENV_VISIBLE_DEVICES,
)
# families of variables: every name that starts so
PREFIXES: tuple[str, ...] = ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_MPS_")
# files the loader and HAMi-core read: no volume may be mounted at or over them
PROTECTED_PATHS: tuple[str, ...] = ("/etc/ld.so.preload", "/usr/local/vgpu/libvgpu.so")

RULE_ENV = ("a container using a shared GPU under isolation may not set {name} itself: the "
            "agent sets it to enforce the container's limits, and the pod's value would "
            "replace the agent's; remove it (the limits come from aliyun.com/gpu-mem and "
            "gpu-core.percentage), or opt the container out of isolation with CGPU_DISABLE=true")
RULE_ENV_FROM = ("a container using a shared GPU under isolation may not take variables from a "
                 "{source} {how}: its keys could set {name}, which the agent sets to enforce "
                 "the container's limits; give envFrom a prefix no isolation variable starts "
                 "with (e.g. APP_; not a prefix of {all}), or opt the container out of "
                 "isolation with CGPU_DISABLE=true")
RULE_MOUNT = ("a container using a shared GPU under isolation may not mount a volume at or over "
              "{path}: the agent mounts it there to enforce the container's limits; mount the "
              "volume elsewhere, or opt the container out of isolation with CGPU_DISABLE=true")


def _shared(container: Mapping[str, Any]) -> bool:
    """Whether the container asks for shared GPU memory or compute (requests or limits)."""
    res = container.get("resources")
    if not isinstance(res, Mapping):
        return False
    for part in ("limits", "requests"):
        got = res.get(part)
        if isinstance(got, Mapping) and (names.RES_GPU_MEM in got or names.RES_GPU_CORE in got):
            return True
    return False


def guarded_name(name: str) -> bool:
    """Whether ``name`` is a variable the agent sets for an isolated container."""
    return name in EXACT or name.startswith(PREFIXES)


def reachable_by_prefix(prefix: str) -> str | None:
    """A guarded variable whose name an ``envFrom`` with ``prefix`` could produce (the prefix
    followed by any key), or ``None``."""
    for name in EXACT:
        if name.startswith(prefix):
            return name
    for fam in PREFIXES:
        if fam.startswith(prefix) or prefix.startswith(fam):
            return fam + "*" if fam.startswith(prefix) else prefix + "*"
    return None


def _over(mount_path: str) -> str | None:
    """The protected path a volume mounted at ``mount_path`` covers, or ``None``."""
    path = "/" + posixpath.normpath("/" + mount_path.strip()).lstrip("/")
    for p in PROTECTED_PATHS:
        if p == path or p.startswith(path.rstrip("/") + "/"):
            return p
    return None


def _containers(spec: Mapping[str, Any], base: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for part in ("initContainers", "containers"):
        items = spec.get(part)
        if isinstance(items, list):
            for i, c in enumerate(items):
                if isinstance(c, Mapping):
                    yield f"{base}.{part}[{i}]", c


def problems(pod_spec: Mapping[str, Any], base: str = "spec") -> list[str]:
    """Each way a shared-GPU container of ``pod_spec`` (at field path ``base``) could set its
    own limits, as ``<field path>: <rule>``; empty when there is none."""
    out: list[str] = []
    for path, c in _containers(pod_spec, base):
        if not _shared(c) or isolation_opted_out(c):
            continue
        for j, e in enumerate(c.get("env") or []):
            name = e.get("name") if isinstance(e, Mapping) else None
            if isinstance(name, str) and guarded_name(name):
                out.append(f"{path}.env[{j}].name={name!r}: " + RULE_ENV.format(name=name))
        for j, src in enumerate(c.get("envFrom") or []):
            if not isinstance(src, Mapping):
                continue
            prefix = src.get("prefix") or ""
            hit = reachable_by_prefix(str(prefix))
            if hit is None:
                continue
            source = "Secret" if "secretRef" in src else "ConfigMap"
            how = f"with prefix {prefix!r}" if prefix else "without a prefix"
            field = f"{path}.envFrom[{j}]" + (".prefix" if prefix else "")
            out.append(f"{field}: " + RULE_ENV_FROM.format(
                source=source, how=how, name=hit,
                all=", ".join((*EXACT, *(p + "*" for p in PREFIXES)))))
        for j, m in enumerate(c.get("volumeMounts") or []):
            mp = m.get("mountPath") if isinstance(m, Mapping) else None
            covered = _over(mp) if isinstance(mp, str) else None
            if covered:
                out.append(f"{path}.volumeMounts[{j}].mountPath={mp!r}: "
                           + RULE_MOUNT.format(path=covered))
    return out
