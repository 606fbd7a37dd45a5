"""The API resources the fake API server serves, with the per-resource rules of the real one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .selectors import dotted

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    # Writes to the main resource keep the stored status; status goes through /status.
    status_subresource: bool = False
    # DELETE answers with the deleted object (pods) rather than a Success Status.
    return_deleted_object: bool = False
    # PUT on a missing object creates it (events) rather than answering 404.
    create_on_update: bool = False
    # Extra field selector labels beyond metadata.name (and metadata.namespace if namespaced).
    field_labels: tuple[str, ...] = ()
    # Field-label aliases: selector label -> path in the stored object.
    field_paths: Mapping[str, str] = field(default_factory=dict)
    short_names: tuple[str, ...] = ()
    singular: str = ""
    verbs: tuple[str, ...] = ALL_VERBS
    # A view of another resource's storage (events.k8s.io/v1 events are core/v1 events):
    # the key of the stored resource and the conversions to and from its form.
    stored_as: str = ""
    to_storage: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    from_storage: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @property
    def storage_key(self) -> str:
        return self.stored_as or self.key

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """``pods`` for the core group, ``leases.coordination.k8s.io`` otherwise."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def supported_fields(self) -> frozenset[str]:
        base = {"metadata.name"} | ({"metadata.namespace"} if self.namespaced else set())
        return frozenset(base | set(self.field_labels))

    def field_value(self, obj: Mapping[str, Any], field: str) -> str:
        """The value of one field label (a selector's view of the stored object)."""
        return dotted(obj, self.field_paths.get(field, field))

    def field_values(self, obj: Mapping[str, Any]) -> dict[str, str]:
        return {f: self.field_value(obj, f) for f in self.supported_fields}


_EVENT_FIELDS = (
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
)

POD = ResourceType(
    "",
    "v1",
    "pods",
    "Pod",
    True,
    subresources=("status", "binding"),
    status_subresource=True,
    return_deleted_object=True,
    field_labels=(
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ),
    short_names=("po",),
    singular="pod",
)
NODE = ResourceType(
    "",
    "v1",
    "nodes",
    "Node",
    False,
    subresources=("status",),
    status_subresource=True,
    field_labels=("spec.unschedulable",),
    short_names=("no",),
    singular="node",
)
NAMESPACE = ResourceType(
    "",
    "v1",
    "namespaces",
    "Namespace",
    False,
    subresources=("status",),
    status_subresource=True,
    field_labels=("status.phase",),
    short_names=("ns",),
    singular="namespace",
)
EVENT = ResourceType(
    "",
    "v1",
    "events",
    "Event",
    True,
    create_on_update=True,
    field_labels=_EVENT_FIELDS,
    field_paths={"source": "source.component"},
    short_names=("ev",),
    singular="event",
)
CONFIGMAP = ResourceType(
    "", "v1", "configmaps", "ConfigMap", True, short_names=("cm",), singular="configmap"
)
BINDING = ResourceType("", "v1", "bindings", "Binding", True, singular="binding", verbs=("create",))
LEASE = ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True, singular="lease")
# the CRD of charts/sharegpu (served as kube-apiserver serves a custom resource: list, watch, get)
RESOURCEPOLICY = ResourceType(
    "scheduling.alibabacloud.com", "v1alpha1", "resourcepolicies", "ResourcePolicy", True,
    singular="resourcepolicy",
)
# ACK's gang PodGroup (a custom resource in a real cluster; the chart ships its CRD)
PODGROUP = ResourceType("scheduling.sigs.k8s.io", "v1alpha1", "podgroups", "PodGroup", True,
                        short_names=("pg",), singular="podgroup")
# DRA (resource.k8s.io/v1): the agent's kubelet plugin reads a claim's allocation
RESOURCECLAIM = ResourceType("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True,
                             subresources=("status",), status_subresource=True,
                             singular="resourceclaim")
# the agent's ResourceSlices (cluster-scoped; kubectl inspect cgpu lists them)
RESOURCESLICE = ResourceType("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False,
                             singular="resourceslice")
# events.k8s.io/v1 field names -> core/v1 field names (the upstream conversion).
EVENTS_V1_TO_CORE = {
    "regarding": "involvedObject",
    "note": "message",
    "reportingController": "reportingComponent",
    "deprecatedSource": "source",
    "deprecatedFirstTimestamp": "firstTimestamp",
    "deprecatedLastTimestamp": "lastTimestamp",
    "deprecatedCount": "count",
}
_CORE_TO_EVENTS_V1 = {v: k for k, v in EVENTS_V1_TO_CORE.items()}


def _events_v1_to_core(obj: dict[str, Any]) -> dict[str, Any]:
    out = {EVENTS_V1_TO_CORE.get(k, k): v for k, v in obj.items()}
    out["apiVersion"] = "v1"
    return out


def _core_to_events_v1(obj: dict[str, Any]) -> dict[str, Any]:
    out = {_CORE_TO_EVENTS_V1.get(k, k): v for k, v in obj.items()}
    out["apiVersion"] = "events.k8s.io/v1"
    out.setdefault("eventTime", None)  # never omitted upstream (a zero MicroTime is null)
    return out


_EVENTS_V1_FIELDS = {
    "regarding.kind": "involvedObject.kind",
    "regarding.namespace": "involvedObject.namespace",
    "regarding.name": "involvedObject.name",
    "regarding.uid": "involvedObject.uid",
    "regarding.apiVersion": "involvedObject.apiVersion",
    "regarding.resourceVersion": "involvedObject.resourceVersion",
    "regarding.fieldPath": "involvedObject.fieldPath",
    "reportingController": "reportingComponent",
    "source": "source.component",
    "reason": "reason",
    "type": "type",
}
EVENTS_V1 = ResourceType(
    "events.k8s.io",
    "v1",
    "events",
    "Event",
    True,
    create_on_update=True,
    field_labels=tuple(_EVENTS_V1_FIELDS),
    field_paths=_EVENTS_V1_FIELDS,
    short_names=("ev",),
    singular="event",
    stored_as=EVENT.key,
    to_storage=_events_v1_to_core,
    from_storage=_core_to_events_v1,
)

RESOURCES: tuple[ResourceType, ...] = (
    POD,
    NODE,
    NAMESPACE,
    EVENT,
    CONFIGMAP,
    BINDING,
    LEASE,
    EVENTS_V1,
    RESOURCEPOLICY,
    PODGROUP,
    RESOURCECLAIM,
    RESOURCESLICE,
)

# Resources kept in the store (bindings are an action on pods, not stored objects).
STORED: tuple[ResourceType, ...] = tuple(r for r in RESOURCES if r is not BINDING)
# The resource whose form each storage key holds.
STORAGE: dict[str, ResourceType] = {r.key: r for r in STORED if not r.stored_as}


def by_group_version(group: str, version: str) -> dict[str, ResourceType]:
    return {r.plural: r for r in RESOURCES if r.group == group and r.version == version}


def group_versions() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in RESOURCES:
        if r.group:
            versions = out.setdefault(r.group, [])
            if r.version not in versions:
                versions.append(r.version)
    return out


def resolve(name: str, api_version: str | None = None) -> ResourceType:
    """Find a resource by key, plural, kind, singular or short name (``pods``, ``Pod``, ``po``,
    ``leases.coordination.k8s.io``); ``api_version`` disambiguates (``events.k8s.io/v1``)."""
    candidates = []
    for r in STORED:
        names = {r.key, r.plural, r.kind, r.kind.lower(), r.singular, *r.short_names}
        if name in names and (api_version is None or r.api_version == api_version):
            candidates.append(r)
    if not candidates:
        raise KeyError(f"unknown resource {name!r}" + (f" in {api_version}" if api_version else ""))
    # Prefer the core group when a name is ambiguous (``events``).
    candidates.sort(key=lambda r: r.group != "")
    return candidates[0]
