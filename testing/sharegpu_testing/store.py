"""The fake API server's storage: objects, one global resourceVersion, a bounded change
history (for watch resume and consistent paging) and the open watches.

Every method is thread-safe (one re-entrant lock) and synchronous, so tests may read and seed
state from any thread while the HTTP server runs in its own event loop. Watches are fed
through ``loop.call_soon_threadsafe`` into an ``asyncio.Queue`` per watch.

Semantics follow the real kube-apiserver where clients can observe them:

- each write bumps one global, monotonically increasing resourceVersion (a decimal string);
  a write that changes nothing is a no-op (no new resourceVersion, no watch event);
- create answers 409 AlreadyExists; update with a stale ``metadata.resourceVersion`` (or a
  different ``metadata.uid``) answers 409 Conflict;
- resources with a status subresource keep ``status`` on writes to the main resource; writes
  through ``/status`` keep ``spec`` and ``ownerReferences`` (labels, annotations and status may
  change, as pods/status and nodes/status allow); ``metadata.generation`` moves on spec changes;
- pods: create resets status to ``Pending``, fills a few spec defaults, checks containers;
  updates may not change ``spec`` beyond the fields the real server allows (``spec.nodeName``
  only through ``pods/binding``);
- finalizers hold an object after DELETE (``deletionTimestamp`` set) until they are removed;
  with ``graceful_pod_deletion`` a bound pod is only marked until deleted with grace 0;
- the history keeps the last ``history_size`` changes: a watch or an exact list from an older
  resourceVersion answers 410 Expired, like the real server after an etcd compaction.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from . import status as st
from .jsonobj import clone, same_content
from .resources import EVENT, EVENTS_V1, LEASE, NAMESPACE, NODE, POD, STORAGE, ResourceType
from .selectors import FieldSelector, LabelSelector
from .validation import (
    default_pod_resources,
    pod_spec_update_causes,
    qos_class,
    validate_event,
    validate_event_v1_create,
    validate_lease,
    validate_metadata,
    validate_node_resources,
    validate_pod_containers,
    validate_pod_resources,
)

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace or "", name)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_CONTINUE_TOO_OLD = (
    "The provided continue parameter is too old to display a consistent list result. You can "
    "start a new list without the continue parameter, or use the continue token in this "
    "response to retrieve the remainder of the results. Continuing with the provided token "
    "results in an inconsistent list - objects that were created, modified, or deleted between "
    "the time the first chunk was returned and now may show up in the list."
)
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


def now_rfc3339(clock: Callable[[], float] = time.time, micro: bool = False) -> str:
    t = datetime.fromtimestamp(clock(), tz=UTC)
    if micro:
        return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def meta(obj: Obj) -> dict[str, Any]:
    m = obj.get("metadata")
    if not isinstance(m, dict):
        m = {}
        obj["metadata"] = m
    return m


def view(rtype: ResourceType, obj: Obj, *, share: bool = False) -> Obj:
    """A copy of a stored object as ``rtype`` presents it (events.k8s.io/v1 events are stored
    as core/v1 events). ``share`` returns the stored object itself when no conversion is needed:
    stored objects are never changed in place, so watches may serialize them as they are."""
    if share and rtype.from_storage is None:
        return obj
    out = clone(obj)
    if rtype.from_storage is not None:
        out = rtype.from_storage(out)
    out["kind"] = rtype.kind
    out["apiVersion"] = rtype.api_version
    return out


def to_storage(rtype: ResourceType, obj: Obj) -> Obj:
    return rtype.to_storage(obj) if rtype.to_storage is not None else obj


def key_of(obj: Obj) -> Key:
    m = obj.get("metadata") or {}
    return (m.get("namespace") or "", m.get("name") or "")


@dataclass(frozen=True)
class Change:
    rv: int
    resource: str  # ResourceType.key
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj  # the new state; for DELETED the last state, carrying the deletion's resourceVersion
    old: Obj | None


CLOSE = "__CLOSE__"


@dataclass(frozen=True)
class OpenedWatch:
    watcher: Watcher
    backlog: list[tuple[str, Obj]]
    resource_version: int
    initial_events: bool


class Watcher:
    """One open watch: a filter and a queue owned by the event loop that serves it."""

    def __init__(
        self,
        rtype: ResourceType,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.rtype = rtype
        self.namespace = namespace
        self.labels = labels
        self.fields = fields
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.closed = False

    def passes(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        m = obj.get("metadata") or {}
        if self.namespace is not None and (m.get("namespace") or "") != self.namespace:
            return False
        return self.labels.matches(m.get("labels")) and self.fields.matches_object(self.rtype, obj)

    def convert(self, change: Change) -> tuple[str, Obj] | None:
        """The event this watch sees for a change: an object that stops matching a selector
        is DELETED for this watch, one that starts matching is ADDED (as the watch cache does)."""
        if change.resource != self.rtype.storage_key:
            return None
        rtype = self.rtype
        if change.type == "DELETED":
            if not self.passes(change.obj):
                return None
            return ("DELETED", view(rtype, change.obj, share=True))
        now_p = self.passes(change.obj)
        if change.type == "ADDED":
            return ("ADDED", view(rtype, change.obj, share=True)) if now_p else None
        old_p = self.passes(change.old)
        if now_p and old_p:
            return ("MODIFIED", view(rtype, change.obj, share=True))
        if now_p:
            return ("ADDED", view(rtype, change.obj, share=True))
        if old_p and change.old is not None:
            # the previous state, carrying this change's resourceVersion (as the watch cache)
            gone = dict(change.old)
            gone["metadata"] = {**change.old["metadata"], "resourceVersion": str(change.rv)}
            return ("DELETED", view(rtype, gone, share=True))
        return None

    def push(self, item: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the watch is gone
            self.closed = True

    def close(self, abrupt: bool = False) -> None:
        if not self.closed:
            self.closed = True
            self.push((CLOSE, abrupt))


def _encode_continue(rv: int, last: Key) -> str:
    raw = json.dumps({"rv": rv, "start": list(last)}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_continue(token: str) -> tuple[int, Key]:
    try:
        pad = "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(token + pad))
        return int(data["rv"]), (str(data["start"][0]), str(data["start"][1]))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise st.bad_request(f"continue key is not valid: {e}") from None


class Store:
    def __init__(
        self,
        *,
        history_size: int = 1000,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        graceful_pod_deletion: bool = False,
        strict_namespaces: bool = False,
    ) -> None:
        self._lock = threading.RLock()
        self._rv = 0
        self._objects: dict[str, dict[Key, Obj]] = {key: {} for key in STORAGE}
        self._history: deque[Change] = deque()
        self.history_size = history_size
        self._compacted_rv = 0  # changes at or below this resourceVersion are forgotten
        self._watchers: set[Watcher] = set()
        self._rng = random.Random(seed)
        self.clock = clock
        self.graceful_pod_deletion = graceful_pod_deletion
        self.strict_namespaces = strict_namespaces
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.seed(NAMESPACE, {"metadata": {"name": ns}, "status": {"phase": "Active"}})

    # ------------------------------------------------------------------ state access

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    @property
    def oldest_resource_version(self) -> int:
        """The oldest resourceVersion a watch may still resume from."""
        with self._lock:
            return self._compacted_rv

    def _table(self, rtype: ResourceType) -> dict[Key, Obj]:
        return self._objects[rtype.storage_key]

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj:
        with self._lock:
            obj = self._table(rtype).get((namespace or "", name))
            if obj is None:
                raise st.not_found(rtype.plural, name, rtype.group)
            return view(rtype, obj)

    def find(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj | None:
        with self._lock:
            obj = self._table(rtype).get((namespace or "", name))
            return view(rtype, obj) if obj is not None else None

    def all(self, rtype: ResourceType, namespace: str | None = None) -> list[Obj]:
        with self._lock:
            items = [
                view(rtype, o)
                for (ns, _), o in sorted(self._table(rtype).items())
                if namespace is None or ns == namespace
            ]
        return items

    def history(self) -> list[Change]:
        with self._lock:
            return list(self._history)

    # ------------------------------------------------------------------ commit

    def _uid(self) -> str:
        return str(uuid.UUID(int=self._rng.getrandbits(128), version=4))

    def _commit(self, rtype: ResourceType, kind: str, new: Obj, old: Obj | None) -> Obj:
        self._rv += 1
        storage = STORAGE[rtype.storage_key]
        new = clone(new)
        new["kind"] = storage.kind
        new["apiVersion"] = storage.api_version
        meta(new)["resourceVersion"] = str(self._rv)
        table = self._table(rtype)
        if kind == "DELETED":
            table.pop(key_of(new), None)
        else:
            table[key_of(new)] = new
        change = Change(self._rv, storage.key, kind, new, old)
        self._history.append(change)
        while len(self._history) > self.history_size:
            self._compacted_rv = self._history.popleft().rv
        for w in list(self._watchers):
            if w.closed:
                self._watchers.discard(w)
                continue
            ev = w.convert(change)
            if ev is not None:
                w.push(ev)
        return view(rtype, new)

    def seed(self, rtype: ResourceType, obj: Obj) -> Obj:
        """Store an object as given (no API defaulting or validation), creating or replacing it;
        fills name-independent metadata (uid, creationTimestamp, generation) when missing."""
        new = to_storage(rtype, clone(obj))
        m = meta(new)
        if not m.get("name"):
            raise ValueError("seeded objects need metadata.name")
        if rtype.namespaced:
            m.setdefault("namespace", "default")
        else:
            m.pop("namespace", None)
        with self._lock:
            old = self._table(rtype).get(key_of(new))
            if old is not None:
                om = old["metadata"]
                m.setdefault("uid", om.get("uid"))
                m.setdefault("creationTimestamp", om.get("creationTimestamp"))
            m.setdefault("uid", self._uid())
            m.setdefault("creationTimestamp", now_rfc3339(self.clock))
            m.setdefault("generation", 1)
            m.pop("resourceVersion", None)
            return self._commit(rtype, "MODIFIED" if old else "ADDED", new, old)

    def remove(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj:
        """Delete an object at once, ignoring finalizers and grace periods."""
        with self._lock:
            old = self._table(rtype).get((namespace or "", name))
            if old is None:
                raise st.not_found(rtype.plural, name, rtype.group)
            return self._commit(rtype, "DELETED", old, old)

    def compact(self) -> int:
        """Forget the whole change history: every resume from an older resourceVersion is 410."""
        with self._lock:
            self._history.clear()
            self._compacted_rv = self._rv
            return self._rv

    # ------------------------------------------------------------------ validation

    def _check_name(self, rtype: ResourceType, name: str) -> None:
        pattern = _DNS_LABEL if rtype is NAMESPACE else _DNS_SUBDOMAIN
        what = "label" if rtype is NAMESPACE else "subdomain"
        if not name or len(name) > 253 or not pattern.match(name):
            why = (
                f'Invalid value: "{name}": a lowercase RFC 1123 {what} must consist of lower '
                "case alphanumeric characters, '-' or '.', and must start and end with an "
                "alphanumeric character"
            )
            raise st.invalid(rtype.kind, name, [("metadata.name", why)], rtype.group)

    def _check_kind(self, rtype: ResourceType, body: Obj) -> None:
        kind = body.get("kind")
        if kind and kind != rtype.kind:
            raise st.bad_request(
                f"the API version in the data ({body.get('apiVersion')}) does not match the "
                f"expected API version ({rtype.api_version}) or kind {kind!r} is not {rtype.kind!r}"
            )

    def _check_namespace_exists(self, rtype: ResourceType, namespace: str) -> None:
        if (
            rtype.namespaced
            and self.strict_namespaces
            and (("", namespace) not in self._objects[NAMESPACE.key])
        ):
            raise st.not_found("namespaces", namespace)

    @staticmethod
    def _validate(rtype: ResourceType, obj: Obj, *, creating: bool) -> None:
        """The rules the real server checks on every create and update of these objects
        (see :mod:`sharegpu_testing.validation`); pods get requests defaulted on create."""
        causes = validate_metadata(meta(obj))
        if rtype is POD:
            if creating:
                causes += validate_pod_containers(obj)
                default_pod_resources(obj)
            causes += validate_pod_resources(obj)
        elif rtype is NODE:
            causes += validate_node_resources(obj)
        elif rtype is EVENT and creating:
            causes += validate_event(obj)
        elif rtype is LEASE:
            causes += validate_lease(obj)
        if causes:
            raise st.invalid(rtype.kind, meta(obj).get("name", ""), causes, rtype.group)

    # ------------------------------------------------------------------ create

    def create(
        self, rtype: ResourceType, namespace: str | None, body: Obj, *, dry_run: bool = False
    ) -> Obj:
        if not isinstance(body, dict):
            raise st.bad_request("the request body must be a JSON object")
        self._check_kind(rtype, body)
        if rtype is EVENTS_V1 and (causes := validate_event_v1_create(body)):
            raise st.invalid("Event", meta(body).get("name", ""), causes, "events.k8s.io")
        obj = to_storage(rtype, clone(body))
        m = meta(obj)
        if rtype.namespaced:
            ns = namespace or m.get("namespace") or "default"
            if m.get("namespace") and m["namespace"] != ns:
                raise st.namespace_mismatch()
            m["namespace"] = ns
        else:
            m.pop("namespace", None)
        with self._lock:
            if not m.get("name"):
                prefix = m.get("generateName")
                if not prefix:
                    raise st.invalid(
                        rtype.kind,
                        "",
                        [("metadata.name", "Required value: name or generateName is required")],
                        rtype.group,
                    )
                alphabet = "bcdfghjklmnpqrstvwxz2456789"
                m["name"] = prefix + "".join(self._rng.choice(alphabet) for _ in range(5))
            self._check_name(rtype, m["name"])
            self._check_namespace_exists(rtype, m.get("namespace", ""))
            if key_of(obj) in self._table(rtype):
                raise st.already_exists(rtype.plural, m["name"], rtype.group)
            for k in (
                "resourceVersion",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "selfLink",
            ):
                m.pop(k, None)
            m["uid"] = self._uid()
            m["creationTimestamp"] = now_rfc3339(self.clock)
            m["generation"] = 1
            self._validate(rtype, obj, creating=True)
            if rtype is POD:
                spec = obj["spec"]
                spec.setdefault("schedulerName", "default-scheduler")
                spec.setdefault("restartPolicy", "Always")
                spec.setdefault("terminationGracePeriodSeconds", 30)
                spec.setdefault("dnsPolicy", "ClusterFirst")
                spec.setdefault("priority", 0)
                obj["status"] = {"phase": "Pending", "qosClass": qos_class(obj)}
            elif rtype is NAMESPACE:
                obj["status"] = {"phase": "Active"}
            if dry_run:
                return view(rtype, obj)
            return self._commit(rtype, "ADDED", obj, None)

    # ------------------------------------------------------------------ update / patch

    def update(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        mutate: Callable[[Obj | None], Obj],
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        create_missing: bool = False,
    ) -> tuple[Obj, bool]:
        """Read-modify-write under the lock: ``mutate`` gets a copy of the stored object (or None
        when missing and ``create_missing``) and returns the desired object. Returns the stored
        result and whether it was created."""
        ns = (namespace or "") if rtype.namespaced else ""
        with self._lock:
            cur = self._table(rtype).get((ns, name))
            if cur is None:
                if not (create_missing or rtype.create_on_update) or subresource:
                    raise st.not_found(rtype.plural, name, rtype.group)
                body = mutate(None)
                meta(body).setdefault("name", name)
                if meta(body)["name"] != name:
                    raise st.name_mismatch(meta(body)["name"], name)
                return self.create(rtype, ns or None, body, dry_run=dry_run), True
            new = mutate(view(rtype, cur))
            if not isinstance(new, dict):
                raise st.bad_request("the request body must be a JSON object")
            self._check_kind(rtype, new)
            result = self._prepare_update(rtype, cur, to_storage(rtype, new), subresource)
            if same_content(result, cur):
                return view(rtype, cur), False  # no-op: no new resourceVersion, no event
            if dry_run:
                return view(rtype, result), False
            rm = meta(result)
            if (
                rm.get("deletionTimestamp")
                and not rm.get("finalizers")
                and not (
                    rtype is POD
                    and self.graceful_pod_deletion
                    and rm.get("deletionGracePeriodSeconds")
                )
            ):
                return self._commit(rtype, "DELETED", result, cur), False
            return self._commit(rtype, "MODIFIED", result, cur), False

    def _prepare_update(
        self, rtype: ResourceType, cur: Obj, new: Obj, subresource: str | None
    ) -> Obj:
        cm, nm = cur["metadata"], meta(new)
        name = cm["name"]
        if nm.get("name") and nm["name"] != name:
            raise st.name_mismatch(nm["name"], name)
        if rtype.namespaced and nm.get("namespace") and nm["namespace"] != cm.get("namespace"):
            raise st.namespace_mismatch()
        rv = nm.get("resourceVersion")
        if rv and str(rv) != cm["resourceVersion"]:
            raise st.conflict(rtype.plural, name, group=rtype.group)
        if nm.get("uid") and nm["uid"] != cm["uid"]:
            raise st.uid_precondition(rtype.plural, name, nm["uid"], cm["uid"], rtype.group)
        result = clone(new)
        if subresource == "status":
            # As pods/status and nodes/status: spec and ownerReferences stay as stored;
            # status, labels, annotations and finalizers may change.
            for part in ("spec",):
                if part in cur:
                    result[part] = clone(cur[part])
                else:
                    result.pop(part, None)
            if "ownerReferences" in cm:
                meta(result)["ownerReferences"] = clone(cm["ownerReferences"])
            else:
                meta(result).pop("ownerReferences", None)
        elif rtype.status_subresource:
            if "status" in cur:
                result["status"] = clone(cur["status"])
            else:
                result.pop("status", None)
        if (
            rtype is POD
            and subresource is None
            and (causes := pod_spec_update_causes(cur.get("spec"), result.get("spec")))
        ):
            raise st.invalid("Pod", name, causes)
        rm = meta(result)
        for k in (
            "uid",
            "creationTimestamp",
            "namespace",
            "name",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if k in cm:
                rm[k] = cm[k]
            else:
                rm.pop(k, None)
        if rm.get("deletionTimestamp") and set(rm.get("finalizers") or []) - set(
            cm.get("finalizers") or []
        ):
            raise st.invalid(
                rtype.kind,
                name,
                [
                    (
                        "metadata.finalizers",
                        "Forbidden: no new finalizers can be added if the object is being deleted",
                    )
                ],
                rtype.group,
            )
        self._validate(rtype, result, creating=False)
        gen = int(cm.get("generation") or 1)
        rm["generation"] = gen + 1 if result.get("spec") != cur.get("spec") else gen
        rm["resourceVersion"] = cm["resourceVersion"]
        storage = STORAGE[rtype.storage_key]
        result["kind"], result["apiVersion"] = storage.kind, storage.api_version
        return result

    # ------------------------------------------------------------------ binding

    def bind(self, namespace: str, name: str, binding: Obj, *, dry_run: bool = False) -> Obj:
        """POST pods/{name}/binding: set spec.nodeName once, merge the binding's annotations,
        mark PodScheduled. Returns the updated pod."""
        if not isinstance(binding, dict):
            raise st.bad_request("the request body must be a JSON object")
        bm = binding.get("metadata") or {}
        if bm.get("name") and bm["name"] != name:
            raise st.bad_request("the name of the object does not match the name on the URL")
        target = binding.get("target") or {}
        if not isinstance(target, dict) or not target.get("name"):
            raise st.invalid("Binding", name, [("target.name", "Required value")])
        if target.get("kind") not in (None, "", "Node"):
            raise st.invalid(
                "Binding",
                name,
                [("target.kind", f"Invalid value: \"{target['kind']}\": must be empty or 'Node'")],
            )
        with self._lock:
            cur = self._objects[POD.key].get((namespace, name))
            if cur is None:
                raise st.not_found("pods", name)
            cm = cur["metadata"]
            if bm.get("uid") and bm["uid"] != cm["uid"]:
                raise st.uid_precondition("pods", name, bm["uid"], cm["uid"])
            if bm.get("resourceVersion") and str(bm["resourceVersion"]) != cm["resourceVersion"]:
                raise st.conflict("pods", name)
            if cm.get("deletionTimestamp"):
                raise st.conflict(
                    "pods/binding",
                    name,
                    f"pod {name} is being deleted, cannot be assigned to a host",
                )
            node = (cur.get("spec") or {}).get("nodeName")
            if node:
                raise st.conflict(
                    "pods/binding", name, f'pod {name} is already assigned to node "{node}"'
                )
            pod = clone(cur)
            pod.setdefault("spec", {})["nodeName"] = target["name"]
            if bm.get("annotations"):
                meta(pod).setdefault("annotations", {}).update(bm["annotations"])
            status = pod.setdefault("status", {})
            conditions = [
                c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"
            ]
            conditions.append(
                {
                    "type": "PodScheduled",
                    "status": "True",
                    "lastProbeTime": None,
                    "lastTransitionTime": now_rfc3339(self.clock),
                }
            )
            status["conditions"] = conditions
            if dry_run:
                return pod
            return self._commit(POD, "MODIFIED", pod, cur)

    # ------------------------------------------------------------------ delete

    def delete(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        *,
        preconditions: dict[str, Any] | None = None,
        grace_period: int | None = None,
        dry_run: bool = False,
    ) -> tuple[Obj, bool]:
        """DELETE: returns (object, deleted now). Finalizers (and, with graceful pod deletion, a
        bound pod's grace period) only mark the object with a deletionTimestamp."""
        ns = (namespace or "") if rtype.namespaced else ""
        with self._lock:
            cur = self._table(rtype).get((ns, name))
            if cur is None:
                raise st.not_found(rtype.plural, name, rtype.group)
            cm = cur["metadata"]
            pre = preconditions or {}
            if pre.get("uid") and pre["uid"] != cm["uid"]:
                raise st.uid_precondition(rtype.plural, name, pre["uid"], cm["uid"], rtype.group)
            if pre.get("resourceVersion") and str(pre["resourceVersion"]) != cm["resourceVersion"]:
                raise st.rv_precondition(
                    rtype.plural,
                    name,
                    str(pre["resourceVersion"]),
                    cm["resourceVersion"],
                    rtype.group,
                )
            graceful = bool(
                rtype is POD
                and self.graceful_pod_deletion
                and (cur.get("spec") or {}).get("nodeName")
                and (cur.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            )
            grace = 0
            if graceful:
                default = (cur.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                grace = int(grace_period if grace_period is not None else default)
            if not cm.get("finalizers") and grace == 0:
                if dry_run:
                    return view(rtype, cur), True
                return self._commit(rtype, "DELETED", cur, cur), True
            if (
                cm.get("deletionTimestamp")
                and int(cm.get("deletionGracePeriodSeconds") or 0) <= grace
            ):
                return view(rtype, cur), False  # already being deleted, no shorter grace asked
            marked = clone(cur)
            mm = marked["metadata"]
            mm["deletionTimestamp"] = now_rfc3339(lambda: self.clock() + grace)
            mm["deletionGracePeriodSeconds"] = grace
            if dry_run:
                return view(rtype, marked), False
            return self._commit(rtype, "MODIFIED", marked, cur), False

    # ------------------------------------------------------------------ list

    def _snapshot(self, rtype: ResourceType, rv: int) -> dict[Key, Obj]:
        """The objects of one resource as they were at ``rv`` (rv within the history window)."""
        objs = dict(self._table(rtype))
        for change in reversed(self._history):
            if change.rv <= rv:
                break
            if change.resource != rtype.storage_key:
                continue
            k = key_of(change.obj)
            if change.type == "ADDED":
                objs.pop(k, None)
            elif change.old is not None:
                objs[k] = change.old
        return objs

    def list(
        self,
        rtype: ResourceType,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        *,
        limit: int | None = None,
        continue_token: str | None = None,
        resource_version: str | None = None,
        resource_version_match: str | None = None,
    ) -> Obj:
        with self._lock:
            start_after: Key | None = None
            if continue_token:
                snap_rv, start_after = _decode_continue(continue_token)
                if snap_rv < self._compacted_rv:
                    raise st.expired(_CONTINUE_TOO_OLD)
            elif resource_version not in (None, "", "0"):
                try:
                    wanted = int(str(resource_version))
                except ValueError:
                    raise st.bad_request(f"invalid resourceVersion {resource_version!r}") from None
                if wanted > self._rv:
                    raise st.timeout(f"Too large resource version: {wanted}, current: {self._rv}")
                if resource_version_match == "Exact":
                    if wanted < self._compacted_rv:
                        raise st.gone_resource_version(wanted, self._compacted_rv + 1)
                    snap_rv = wanted
                else:
                    snap_rv = self._rv
            else:
                snap_rv = self._rv
            objs = self._snapshot(rtype, snap_rv) if snap_rv != self._rv else self._table(rtype)
            keys = sorted(
                k
                for k, o in objs.items()
                if (namespace is None or k[0] == namespace)
                and labels.matches((o.get("metadata") or {}).get("labels"))
                and fields.matches_object(rtype, o)
            )
            if start_after is not None:
                keys = [k for k in keys if k > start_after]
            page = keys if not limit or limit <= 0 else keys[:limit]
            items = []
            for k in page:
                item = view(rtype, objs[k])
                item.pop("kind", None)
                item.pop("apiVersion", None)
                items.append(item)
            list_meta: dict[str, Any] = {"resourceVersion": str(snap_rv)}
            if len(page) < len(keys):
                list_meta["continue"] = _encode_continue(snap_rv, page[-1])
                list_meta["remainingItemCount"] = len(keys) - len(page)
        return {
            "kind": f"{rtype.kind}List",
            "apiVersion": rtype.api_version,
            "metadata": list_meta,
            "items": items,
        }

    def matching(
        self,
        rtype: ResourceType,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
    ) -> list[Key]:
        with self._lock:
            return sorted(
                k
                for k, o in self._table(rtype).items()
                if (namespace is None or k[0] == namespace)
                and labels.matches((o.get("metadata") or {}).get("labels"))
                and fields.matches_object(rtype, o)
            )

    # ------------------------------------------------------------------ watch

    def watch(
        self,
        rtype: ResourceType,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        loop: asyncio.AbstractEventLoop,
        *,
        resource_version: str | None = None,
        send_initial_events: bool | None = None,
    ) -> OpenedWatch:
        """Open a watch: the watcher, the events it must send first, the resourceVersion they
        bring the client to, and whether they are the initial state asked for with
        sendInitialEvents. Raises 410 Expired for a resourceVersion older than the history."""
        w = Watcher(rtype, namespace, labels, fields, loop)
        with self._lock:
            initial = send_initial_events or resource_version in (None, "", "0")
            if send_initial_events is False and resource_version in (None, "", "0"):
                initial = False
            backlog: list[tuple[str, Obj]] = []
            if initial:
                for k in sorted(self._table(rtype)):
                    obj = self._table(rtype)[k]
                    if w.passes(obj):
                        backlog.append(("ADDED", view(rtype, obj, share=True)))
            if resource_version not in (None, "", "0"):
                try:
                    since = int(str(resource_version))
                except ValueError:
                    raise st.bad_request(f"invalid resourceVersion {resource_version!r}") from None
                if since < self._compacted_rv:
                    raise st.gone_resource_version(since, self._compacted_rv + 1)
                if since > self._rv:
                    raise st.timeout(f"Too large resource version: {since}, current: {self._rv}")
                if not initial:
                    for change in self._history:
                        if change.rv > since:
                            ev = w.convert(change)
                            if ev is not None:
                                backlog.append(ev)
            self._watchers.add(w)
            return OpenedWatch(w, backlog, self._rv, bool(initial and send_initial_events))

    def push_progress(self, w: Watcher, marker: str) -> None:
        """Queue ``(marker, current resourceVersion)`` behind every event already pushed to
        ``w``: a bookmark taken from it never runs ahead of what the watch has delivered."""
        with self._lock:
            w.push((marker, self._rv))

    def unwatch(self, w: Watcher) -> None:
        with self._lock:
            w.closed = True
            self._watchers.discard(w)

    def close_watches(self, resources: Iterable[str] | None = None, *, abrupt: bool = False) -> int:
        """Close open watches (all, or those of the given resource keys); returns how many."""
        wanted = set(resources) if resources is not None else None
        n = 0
        with self._lock:
            for w in list(self._watchers):
                if wanted is None or w.rtype.key in wanted or w.rtype.plural in wanted:
                    w.close(abrupt)
                    self._watchers.discard(w)
                    n += 1
        return n

    @property
    def open_watches(self) -> int:
        with self._lock:
            return sum(1 for w in self._watchers if not w.closed)
