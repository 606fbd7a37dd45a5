"""The fake API server, driven by real clients: lightkube (sync and async) and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time

import httpx2 as httpx
import pytest
from lightkube import ApiError, AsyncClient, Client, KubeConfig, operators
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.core_v1 import (
    Container,
    EventSource,
    NodeSpec,
    ObjectReference,
    PodSpec,
    PodStatus,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event, Node, Pod
from lightkube.resources.events_v1 import Event as EventV1
from lightkube.types import OnErrorAction, OnErrorResult, PatchType

from sharegpu_testing import FakeApiServer

pytestmark = pytest.mark.timeout(30)


def client(api: FakeApiServer) -> Client:
    return Client(KubeConfig.from_file(api.kubeconfig_path), field_manager="tests")


def pod(name: str, *, labels: dict[str, str] | None = None, ns: str = "default") -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace=ns, labels=labels),
        spec=PodSpec(containers=[Container(name="main", image="busybox")]),
    )


def raw(api: FakeApiServer, method: str, path: str, body=None, ctype="application/json"):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": ctype} if data is not None else {}
    r = httpx.request(method, api.url + path, content=data, headers=headers)
    return r.status_code, r.headers.get("content-type"), r.json() if r.content else None


def bind_body(name: str, node: str, **meta) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, **meta},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


# ------------------------------------------------------------------------------------ CRUD


def test_crud_with_lightkube(fake_api):
    c = client(fake_api)
    created = c.create(pod("p1", labels={"app": "x"}))
    assert created.metadata.uid and created.metadata.creationTimestamp
    assert created.metadata.generation == 1
    assert created.status.phase == "Pending"  # the server resets status on create
    assert created.spec.schedulerName == "default-scheduler"
    got = c.get(Pod, "p1")
    assert got.metadata.resourceVersion == created.metadata.resourceVersion

    got.metadata.labels["tier"] = "gpu"
    replaced = c.replace(got)
    assert int(replaced.metadata.resourceVersion) > int(created.metadata.resourceVersion)
    assert replaced.metadata.labels == {"app": "x", "tier": "gpu"}
    assert replaced.metadata.generation == 1  # metadata change: no new generation

    with pytest.raises(ApiError) as e:
        c.create(pod("p1"))
    assert e.value.status.code == 409 and e.value.status.reason == "AlreadyExists"

    c.delete(Pod, "p1")
    with pytest.raises(ApiError) as e:
        c.get(Pod, "p1")
    assert e.value.status.code == 404 and e.value.status.reason == "NotFound"
    assert e.value.status.message == 'pods "p1" not found'
    with pytest.raises(ApiError) as e:
        c.delete(Pod, "p1")
    assert e.value.status.code == 404


def test_resource_version_is_global_and_monotonic(fake_api):
    c = client(fake_api)
    rvs = [int(c.create(pod(f"p{i}")).metadata.resourceVersion) for i in range(3)]
    rvs.append(int(c.create(Node(metadata=ObjectMeta(name="n1"))).metadata.resourceVersion))
    assert rvs == sorted(rvs) and len(set(rvs)) == 4
    listed = c.list(Pod)
    items = list(listed)
    assert int(listed.resourceVersion) == rvs[-1]
    assert [p.metadata.name for p in items] == ["p0", "p1", "p2"]


def test_stale_update_is_a_conflict(fake_api):
    c = client(fake_api)
    c.create(pod("p1"))
    a = c.get(Pod, "p1")
    b = c.get(Pod, "p1")
    a.metadata.labels = {"writer": "a"}
    c.replace(a)
    b.metadata.labels = {"writer": "b"}
    with pytest.raises(ApiError) as e:
        c.replace(b)
    assert e.value.status.code == 409 and e.value.status.reason == "Conflict"
    assert "the object has been modified" in e.value.status.message
    assert c.get(Pod, "p1").metadata.labels == {"writer": "a"}


def test_noop_update_keeps_resource_version(fake_api):
    c = client(fake_api)
    p = c.create(pod("p1", labels={"a": "1"}))
    again = c.patch(Pod, "p1", {"metadata": {"labels": {"a": "1"}}}, patch_type=PatchType.MERGE)
    assert again.metadata.resourceVersion == p.metadata.resourceVersion


def test_generate_name_and_validation(fake_api):
    status, _, body = raw(
        fake_api,
        "POST",
        "/api/v1/namespaces/default/pods",
        {
            "metadata": {"generateName": "job-"},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        },
    )
    assert status == 201 and body["metadata"]["name"].startswith("job-")
    assert len(body["metadata"]["name"]) == len("job-") + 5
    status, _, body = raw(
        fake_api, "POST", "/api/v1/namespaces/default/pods", {"metadata": {"name": "nocontainers"}}
    )
    assert status == 422 and body["reason"] == "Invalid"
    assert body["details"]["causes"][0]["field"] == "spec.containers"
    status, _, body = raw(fake_api, "POST", "/api/v1/nodes", {"metadata": {"name": "Bad_Name"}})
    assert status == 422 and body["details"]["causes"][0]["field"] == "metadata.name"


# ------------------------------------------------------------------------------- selectors


def test_list_with_label_selectors(fake_api):
    c = client(fake_api)
    c.create(pod("a", labels={"app": "web", "tier": "fe"}))
    c.create(pod("b", labels={"app": "web", "tier": "be"}))
    c.create(pod("c", labels={"app": "db"}))
    c.create(pod("d", labels={"app": "web"}, ns="other"))

    def names(**kw):
        return sorted(p.metadata.name for p in c.list(Pod, **kw))

    assert names(labels={"app": "web"}) == ["a", "b"]
    assert names(namespace="*", labels={"app": "web"}) == ["a", "b", "d"]
    assert names(labels={"app": operators.not_equal("web")}) == ["c"]
    assert names(labels={"tier": operators.in_(["fe", "x"])}) == ["a"]
    assert names(labels={"tier": operators.not_in(["fe"])}) == ["b", "c"]  # no key matches
    assert names(labels={"tier": operators.exists()}) == ["a", "b"]
    assert names(labels={"tier": operators.not_exists()}) == ["c"]
    assert names(labels={"app": "web", "tier": "be"}) == ["b"]
    status, _, body = raw(fake_api, "GET", "/api/v1/pods?labelSelector=app%3D%3Dweb,tier!%3Dfe")
    assert status == 200 and sorted(i["metadata"]["name"] for i in body["items"]) == ["b", "d"]


def test_list_with_field_selectors(fake_api):
    c = client(fake_api)
    fake_api.create(
        {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"name": "run"},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running"},
        }
    )
    c.create(pod("wait"))

    def names(fields):
        return sorted(p.metadata.name for p in c.list(Pod, namespace="*", fields=fields))

    assert names({"spec.nodeName": "n1"}) == ["run"]
    assert names({"spec.nodeName": ""}) == ["wait"]
    assert names({"spec.nodeName": operators.not_equal("")}) == ["run"]
    assert names({"status.phase": "Pending"}) == ["wait"]
    assert names({"metadata.name": "run", "metadata.namespace": "default"}) == ["run"]
    with pytest.raises(ApiError) as e:
        list(c.list(Pod, fields={"spec.bogus": "x"}))
    assert e.value.status.code == 400 and "field label not supported" in e.value.status.message
    status, _, body = raw(fake_api, "GET", "/api/v1/pods?labelSelector=a%20in%20(x")
    assert status == 400 and body["reason"] == "BadRequest"


def test_paging_with_limit_and_continue(fake_api):
    c = client(fake_api)
    for i in range(7):
        c.create(pod(f"p{i}"))
    assert [p.metadata.name for p in c.list(Pod, chunk_size=3)] == [f"p{i}" for i in range(7)]
    status, _, first = raw(fake_api, "GET", "/api/v1/namespaces/default/pods?limit=3")
    assert status == 200 and len(first["items"]) == 3
    assert first["metadata"]["remainingItemCount"] == 4
    token = first["metadata"]["continue"]
    c.delete(Pod, "p4")  # the continuation is a consistent snapshot: p4 is still listed
    status, _, rest = raw(
        fake_api, "GET", f"/api/v1/namespaces/default/pods?limit=10&continue={token}"
    )
    assert [i["metadata"]["name"] for i in rest["items"]] == ["p3", "p4", "p5", "p6"]
    assert rest["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    fake_api.faults.compact()
    status, _, gone = raw(
        fake_api, "GET", f"/api/v1/namespaces/default/pods?limit=10&continue={token}"
    )
    assert status == 410 and gone["reason"] == "Expired"


# ----------------------------------------------------------------------------------- patch


def test_merge_strategic_and_json_patch(fake_api):
    c = client(fake_api)
    c.create(pod("p1", labels={"a": "1", "b": "2"}))
    p = c.patch(
        Pod, "p1", {"metadata": {"labels": {"a": None, "c": "3"}}}, patch_type=PatchType.MERGE
    )
    assert p.metadata.labels == {"b": "2", "c": "3"}
    p = c.patch(
        Pod,
        "p1",
        [
            {"op": "add", "path": "/metadata/annotations", "value": {"x/y": "1"}},
            {"op": "replace", "path": "/metadata/labels/b", "value": "22"},
            {"op": "copy", "from": "/metadata/labels/c", "path": "/metadata/labels/d"},
            {"op": "move", "from": "/metadata/labels/c", "path": "/metadata/labels/e"},
            {"op": "remove", "path": "/metadata/labels/d"},
            {"op": "test", "path": "/metadata/labels/e", "value": "3"},
        ],
        patch_type=PatchType.JSON,
    )
    assert p.metadata.labels == {"b": "22", "e": "3"}
    assert p.metadata.annotations == {"x/y": "1"}
    with pytest.raises(ApiError) as e:
        c.patch(
            Pod,
            "p1",
            [
                {"op": "test", "path": "/metadata/labels/b", "value": "nope"},
                {"op": "remove", "path": "/metadata/labels/b"},
            ],
            patch_type=PatchType.JSON,
        )
    assert e.value.status.code == 422 and e.value.status.reason == "Invalid"
    assert c.get(Pod, "p1").metadata.labels == {"b": "22", "e": "3"}  # atomic
    with pytest.raises(ApiError) as e:
        c.patch(Pod, "p1", [{"path": "/x"}], patch_type=PatchType.JSON)
    assert e.value.status.code == 400


def test_patch_with_resource_version_is_a_precondition(fake_api):
    c = client(fake_api)
    p = c.create(pod("p1"))
    old_rv = p.metadata.resourceVersion
    c.patch(Pod, "p1", {"metadata": {"labels": {"a": "1"}}}, patch_type=PatchType.MERGE)
    with pytest.raises(ApiError) as e:
        c.patch(
            Pod,
            "p1",
            {"metadata": {"resourceVersion": old_rv, "labels": {"a": "2"}}},
            patch_type=PatchType.MERGE,
        )
    assert e.value.status.code == 409 and e.value.status.reason == "Conflict"
    cur = c.get(Pod, "p1").metadata.resourceVersion
    ok = c.patch(
        Pod,
        "p1",
        {"metadata": {"resourceVersion": cur, "labels": {"a": "2"}}},
        patch_type=PatchType.MERGE,
    )
    assert ok.metadata.labels == {"a": "2"}


def test_strategic_merge_patch_merges_conditions_by_type(fake_api):
    c = client(fake_api)
    fake_api.create(
        {
            "kind": "Node",
            "metadata": {"name": "n1"},
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "True"},
                    {"type": "MemoryPressure", "status": "False"},
                ]
            },
        }
    )
    n = c.patch(
        Node.Status,
        "n1",
        {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
        patch_type=PatchType.STRATEGIC,
    )
    assert {(x.type, x.status) for x in n.status.conditions} == {
        ("Ready", "False"),
        ("MemoryPressure", "False"),
    }
    n = c.patch(
        Node.Status,
        "n1",
        {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
        patch_type=PatchType.MERGE,
    )
    assert [(x.type, x.status) for x in n.status.conditions] == [("Ready", "True")]


def test_status_subresource_separation(fake_api):
    c = client(fake_api)
    c.create(pod("p1"))
    # A status write through the main resource is ignored, as on the real server.
    p = c.patch(Pod, "p1", {"status": {"phase": "Running"}}, patch_type=PatchType.MERGE)
    assert p.status.phase == "Pending"
    p = c.patch(
        Pod.Status,
        "p1",
        {
            "status": {"phase": "Running"},
            "metadata": {"labels": {"x": "y"}},
            "spec": {"nodeName": "sneaky", "containers": [{"name": "other", "image": "i"}]},
        },
        patch_type=PatchType.MERGE,
    )
    # /status takes status (and labels), never spec
    assert p.status.phase == "Running" and p.metadata.labels == {"x": "y"}
    assert p.spec.nodeName is None and p.spec.containers[0].name == "main"
    cur = c.get(Pod, "p1")
    cur.status = PodStatus(phase="Succeeded")
    updated = c.replace(Pod.Status(metadata=cur.metadata, spec=cur.spec, status=cur.status))
    assert updated.status.phase == "Succeeded"
    # spec.nodeName may only be set through pods/binding
    with pytest.raises(ApiError) as e:
        c.patch(Pod, "p1", {"spec": {"nodeName": "n1"}}, patch_type=PatchType.MERGE)
    assert e.value.status.code == 422 and "pod updates may not change" in e.value.status.message


def test_apply_patch_creates_then_merges(fake_api):
    c = client(fake_api)
    n = c.apply(Node(metadata=ObjectMeta(name="n1", labels={"a": "1"})))
    assert n.metadata.labels == {"a": "1"}
    n = c.apply(Node(metadata=ObjectMeta(name="n1", labels={"b": "2"})))
    assert n.metadata.labels == {"a": "1", "b": "2"}


# --------------------------------------------------------------------------------- binding


def test_pod_binding_returns_status_and_binds_once(fake_api):
    c = client(fake_api)
    uid = c.create(pod("p1")).metadata.uid
    path = "/api/v1/namespaces/default/pods/p1/binding"
    status, ctype, body = raw(
        fake_api,
        "POST",
        path,
        bind_body("p1", "n1", uid=uid, annotations={"sharegpu.io/gpu-idx": "0"}),
    )
    assert status == 201 and ctype == "application/json"
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "code": 201,
    }
    p = c.get(Pod, "p1")
    assert p.spec.nodeName == "n1"
    assert p.metadata.annotations == {"sharegpu.io/gpu-idx": "0"}
    assert [(x.type, x.status) for x in p.status.conditions] == [("PodScheduled", "True")]

    status, _, body = raw(fake_api, "POST", path, bind_body("p1", "n2"))
    assert status == 409 and body["reason"] == "Conflict"
    assert body["message"] == (
        'Operation cannot be fulfilled on pods/binding "p1": '
        'pod p1 is already assigned to node "n1"'
    )
    assert c.get(Pod, "p1").spec.nodeName == "n1"

    status, _, body = raw(
        fake_api, "POST", "/api/v1/namespaces/default/pods/nope/binding", bind_body("nope", "n1")
    )
    assert status == 404 and body["reason"] == "NotFound"
    c.create(pod("p2"))
    status, _, body = raw(
        fake_api,
        "POST",
        "/api/v1/namespaces/default/pods/p2/binding",
        bind_body("p2", "n1", uid="not-the-uid"),
    )
    assert status == 409 and "Precondition failed: UID" in body["message"]
    status, _, body = raw(
        fake_api,
        "POST",
        "/api/v1/namespaces/default/pods/p2/binding",
        {"metadata": {"name": "p2"}, "target": {}},
    )
    assert status == 422
    # the legacy bindings collection does the same
    status, _, body = raw(
        fake_api, "POST", "/api/v1/namespaces/default/bindings", bind_body("p2", "n3")
    )
    assert status == 201 and c.get(Pod, "p2").spec.nodeName == "n3"
    assert [r.resource for r in fake_api.requests_for("create")][-1] == "bindings"


# ----------------------------------------------------------------------------------- watch


def take(events, n):
    out = []
    for ev in events:
        out.append(ev)
        if len(out) == n:
            return out
    return out


def test_watch_sees_changes_and_resumes(fake_api):
    c = client(fake_api)
    c.create(pod("p1"))
    stream = c.watch(Pod, namespace="default")
    first = take(stream, 1)
    assert [(t, o.metadata.name) for t, o in first] == [("ADDED", "p1")]
    c.patch(Pod, "p1", {"metadata": {"labels": {"x": "1"}}}, patch_type=PatchType.MERGE)
    c.delete(Pod, "p1")
    evs = take(stream, 2)
    assert [t for t, _ in evs] == ["MODIFIED", "DELETED"]
    assert evs[0][1].metadata.labels == {"x": "1"}
    rv_after_modify = evs[0][1].metadata.resourceVersion
    stream.close()

    # Resume from the MODIFIED event: only what came after it.
    c.create(pod("p2"))
    resumed = take(c.watch(Pod, namespace="default", resource_version=rv_after_modify), 2)
    assert [(t, o.metadata.name) for t, o in resumed] == [("DELETED", "p1"), ("ADDED", "p2")]


def test_watch_too_old_resource_version_is_410(fake_api):
    c = client(fake_api)
    rv = c.create(pod("p1")).metadata.resourceVersion
    c.create(pod("p2"))
    fake_api.faults.compact()
    with pytest.raises(ApiError) as e:
        take(c.watch(Pod, namespace="default", resource_version=rv), 1)
    assert e.value.status.code == 410 and e.value.status.reason == "Expired"
    assert "too old resource version" in e.value.status.message
    # The raw stream: HTTP 200, then one ERROR event carrying the Status.
    with httpx.stream("GET", f"{fake_api.url}/api/v1/pods?watch=1&resourceVersion={rv}") as r:
        assert r.status_code == 200
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert lines == [
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": lines[0]["object"]["message"],
                "reason": "Expired",
                "code": 410,
            },
        }
    ]
    # lightkube's retry handler restarts from scratch after a 410 and sees the current state.
    retry = take(
        c.watch(
            Pod,
            namespace="default",
            resource_version=rv,
            on_error=lambda e, n: OnErrorResult(OnErrorAction.RETRY),
        ),
        2,
    )
    assert sorted(o.metadata.name for _, o in retry) == ["p1", "p2"]


def test_watch_history_window_expires_old_versions(fake_api_factory):
    api = fake_api_factory(history_size=3)
    c = client(api)
    rv = c.create(Node(metadata=ObjectMeta(name="n0"))).metadata.resourceVersion
    for i in range(1, 5):
        c.create(Node(metadata=ObjectMeta(name=f"n{i}")))
    with pytest.raises(ApiError) as e:
        take(c.watch(Node, resource_version=rv), 1)
    assert e.value.status.code == 410
    recent = str(api.store.resource_version - 2)
    assert [o.metadata.name for _, o in take(c.watch(Node, resource_version=recent), 2)] == [
        "n3",
        "n4",
    ]


def test_watch_with_label_selector_sends_deleted_when_object_leaves(fake_api):
    c = client(fake_api)
    c.create(pod("p1", labels={"gpu": "yes"}))
    stream = c.watch(Pod, namespace="default", labels={"gpu": "yes"})
    assert [t for t, _ in take(stream, 1)] == ["ADDED"]
    c.patch(Pod, "p1", {"metadata": {"labels": {"gpu": "no"}}}, patch_type=PatchType.MERGE)
    c.patch(Pod, "p1", {"metadata": {"labels": {"gpu": "yes"}}}, patch_type=PatchType.MERGE)
    evs = take(stream, 2)
    assert [(t, o.metadata.labels["gpu"]) for t, o in evs] == [("DELETED", "yes"), ("ADDED", "yes")]
    stream.close()


def test_watch_bookmarks_and_timeout(fake_api_factory):
    api = fake_api_factory(bookmark_interval=0.1)
    api.create({"kind": "Node", "metadata": {"name": "n1"}})
    url = f"{api.url}/api/v1/nodes?watch=true&allowWatchBookmarks=true&timeoutSeconds=1"
    start = time.monotonic()
    with httpx.stream("GET", url, timeout=5) as r:
        events = [json.loads(x) for x in r.iter_lines() if x]
    assert 0.9 < time.monotonic() - start < 5
    assert events[0]["type"] == "ADDED"
    marks = [e for e in events if e["type"] == "BOOKMARK"]
    assert len(marks) >= 5
    assert marks[-1]["object"] == {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": api.resource_version},
    }


def test_async_client_against_in_loop_server():
    async def scenario():
        async with FakeApiServer() as api:
            c = AsyncClient(KubeConfig.from_file(api.kubeconfig_path))
            await c.create(pod("p1"))
            events = []

            async def watch():
                async for t, o in c.watch(Pod, namespace="default"):
                    events.append((t, o.metadata.name))
                    if len(events) == 2:
                        return

            task = asyncio.create_task(watch())
            await asyncio.sleep(0.05)
            await c.create(pod("p2"))
            await asyncio.wait_for(task, 5)
            await c.close()
            return events

    assert asyncio.run(scenario()) == [("ADDED", "p1"), ("ADDED", "p2")]


# ---------------------------------------------------------------------------- lease, events


def test_lease_create_update_and_conflict(fake_api):
    c = client(fake_api)
    lease = c.create(
        Lease(
            metadata=ObjectMeta(name="sharegpu-extender", namespace="kube-system"),
            spec=LeaseSpec(holderIdentity="a", leaseDurationSeconds=15),
        )
    )
    mine = c.get(Lease, "sharegpu-extender", namespace="kube-system")
    theirs = c.get(Lease, "sharegpu-extender", namespace="kube-system")
    mine.spec.holderIdentity = "b"
    mine.spec.leaseTransitions = 1
    won = c.replace(mine)
    assert won.spec.holderIdentity == "b"
    assert int(won.metadata.resourceVersion) > int(lease.metadata.resourceVersion)
    theirs.spec.holderIdentity = "c"
    with pytest.raises(ApiError) as e:
        c.replace(theirs)
    assert e.value.status.code == 409 and e.value.status.reason == "Conflict"
    assert 'leases.coordination.k8s.io "sharegpu-extender"' in e.value.status.message
    stored = fake_api.get("leases", "sharegpu-extender", namespace="kube-system")
    assert stored["spec"]["holderIdentity"] == "b"
    status, _, body = raw(
        fake_api,
        "POST",
        "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases",
        {"metadata": {"name": "bad"}, "spec": {"leaseDurationSeconds": 0}},
    )
    assert status == 422 and body["details"]["causes"][0]["field"] == "spec.leaseDurationSeconds"


def test_core_and_events_v1_events(fake_api):
    c = client(fake_api)
    c.create(
        Event(
            metadata=ObjectMeta(name="p1.1", namespace="default"),
            involvedObject=ObjectReference(kind="Pod", name="p1", namespace="default"),
            reason="Scheduled",
            message="bound to n1",
            type="Normal",
            source=EventSource(component="sharegpu"),
        )
    )
    c.create(
        Event(
            metadata=ObjectMeta(name="p2.1", namespace="default"),
            involvedObject=ObjectReference(kind="Pod", name="p2", namespace="default"),
            reason="FailedScheduling",
            message="no GPU",
            type="Warning",
        )
    )
    got = list(c.list(Event, fields={"involvedObject.name": "p1"}))
    assert [(e.reason, e.message) for e in got] == [("Scheduled", "bound to n1")]
    assert [e.metadata.name for e in c.list(Event, fields={"type": "Warning"})] == ["p2.1"]
    c.create(
        EventV1(
            metadata=ObjectMeta(name="n1.1", namespace="default"),
            eventTime="2026-01-01T00:00:00.000000Z",
            reportingController="sharegpu.io/agent",
            reportingInstance="n1",
            action="Advertise",
            reason="GPUsFound",
            type="Normal",
            regarding=ObjectReference(kind="Node", name="n1"),
            note="2 GPUs",
        )
    )
    v1 = list(c.list(EventV1, fields={"regarding.name": "n1"}))
    assert [(e.reason, e.note) for e in v1] == [("GPUsFound", "2 GPUs")]
    # One storage, two APIs (as upstream): each API sees every event in its own form.
    as_core = c.get(Event, "n1.1")
    assert (as_core.message, as_core.reportingComponent, as_core.involvedObject.name) == (
        "2 GPUs",
        "sharegpu.io/agent",
        "n1",
    )
    _, _, as_v1 = raw(fake_api, "GET", "/apis/events.k8s.io/v1/namespaces/default/events/p1.1")
    assert as_v1["apiVersion"] == "events.k8s.io/v1" and as_v1["eventTime"] is None
    assert (as_v1["note"], as_v1["regarding"]["name"], as_v1["deprecatedSource"]) == (
        "bound to n1",
        "p1",
        {"component": "sharegpu"},
    )
    assert sorted(e["reason"] for e in fake_api.objects("events.events.k8s.io")) == [
        "FailedScheduling",
        "GPUsFound",
        "Scheduled",
    ]
    _, _, by_source = raw(
        fake_api, "GET", "/apis/events.k8s.io/v1/events?fieldSelector=source%3Dsharegpu"
    )
    assert [e["metadata"]["name"] for e in by_source["items"]] == ["p1.1"]
    with pytest.raises(ApiError) as e:  # core spellings are not field labels of events.k8s.io
        list(c.list(EventV1, fields={"involvedObject.name": "n1"}))
    assert e.value.status.code == 400
    # events.k8s.io/v1 requires the new-style fields on create
    status, _, body = raw(
        fake_api,
        "POST",
        "/apis/events.k8s.io/v1/namespaces/default/events",
        {"metadata": {"name": "bad"}, "reason": "X", "type": "Normal"},
    )
    assert status == 422
    assert {c["field"] for c in body["details"]["causes"]} == {
        "eventTime",
        "reportingController",
        "reportingInstance",
        "action",
    }


# ----------------------------------------------------------------------------------- faults


def test_fault_error_rate_is_deterministic_with_seed(fake_api_factory):
    def run(seed):
        api = fake_api_factory(seed=seed)
        api.faults.fail(verbs="create", resources="pods", rate=0.3, code=500)
        c = client(api)
        outcome = []
        for i in range(40):
            try:
                c.create(pod(f"p{i}"))
                outcome.append(True)
            except ApiError as e:
                assert e.status.code == 500 and e.status.reason == "InternalError"
                outcome.append(False)
        assert len(api.objects("pods")) == sum(outcome)  # failed creates stored nothing
        return outcome

    a, b, other = run(7), run(7), run(8)
    assert a == b and a != other
    assert 4 <= a.count(False) <= 20


def test_fault_after_commit_conflict_latency_and_outage(fake_api):
    c = client(fake_api)
    c.create(pod("p1"))
    rule = fake_api.faults.fail(
        verbs="create", resources="pods/binding", code=504, after_commit=True, times=1
    )
    status, _, body = raw(
        fake_api, "POST", "/api/v1/namespaces/default/pods/p1/binding", bind_body("p1", "n1")
    )
    assert status == 504 and body["reason"] == "Timeout"
    assert fake_api.get("pods", "p1")["spec"]["nodeName"] == "n1"  # the write happened
    assert rule.fired == 1
    status, _, body = raw(
        fake_api, "POST", "/api/v1/namespaces/default/pods/p1/binding", bind_body("p1", "n1")
    )
    assert status == 409  # the retry sees the pod bound

    fake_api.faults.fail(verbs="update", resources="pods", code=409, times=1)
    p = c.get(Pod, "p1")
    p.metadata.labels = {"a": "b"}
    with pytest.raises(ApiError) as e:
        c.replace(p)
    assert e.value.status.reason == "Conflict"
    assert c.replace(p).metadata.labels == {"a": "b"}

    slow = fake_api.faults.delay(0.3, verbs="get", resources="nodes")
    fake_api.create({"kind": "Node", "metadata": {"name": "n1"}})
    start = time.monotonic()
    c.get(Node, "n1")
    assert time.monotonic() - start >= 0.3
    c.get(Pod, "p1")
    list(c.list(Node))
    assert slow.fired == 1  # only the get of a node was delayed

    fake_api.faults.unavailable()
    with pytest.raises(ApiError) as e:
        c.get(Pod, "p1")
    assert e.value.status.code == 503
    assert httpx.get(f"{fake_api.url}/version").status_code == 503
    fake_api.faults.available()
    assert c.get(Pod, "p1").metadata.name == "p1"
    assert [i.code for i in fake_api.faults.injected] == [504, 409]


def test_dropped_watch_resumes_without_losing_events(fake_api):
    c = client(fake_api)
    c.create(pod("p0"))
    stream = c.watch(Pod, namespace="default")
    assert take(stream, 1)[0][1].metadata.name == "p0"
    fake_api.wait_for(lambda: fake_api.store.open_watches == 1)
    assert fake_api.faults.drop_watches() == 1
    c.create(pod("p1"))  # written while no watch is open
    c.create(pod("p2"))
    evs = take(stream, 2)  # lightkube reconnects from its last resourceVersion
    assert [(t, o.metadata.name) for t, o in evs] == [("ADDED", "p1"), ("ADDED", "p2")]
    watches = fake_api.requests_for("watch", "pods")
    assert len(watches) == 2 and watches[1].query["resourceVersion"] != ""
    stream.close()


def test_abrupt_watch_drop_is_a_connection_error(fake_api):
    c = client(fake_api)
    c.create(pod("p0"))
    stream = c.watch(Pod, namespace="default")
    take(stream, 1)
    fake_api.wait_for(lambda: fake_api.store.open_watches == 1)
    fake_api.faults.drop_watches(abrupt=True)
    with pytest.raises(httpx.HTTPError):
        take(stream, 1)


def test_concurrent_writers_one_winner(fake_api):
    c = client(fake_api)
    c.create(Lease(metadata=ObjectMeta(name="l", namespace="default"), spec=LeaseSpec()))
    base = c.get(Lease, "l")
    results = []

    def contend(who):
        mine = Lease(
            metadata=ObjectMeta(
                name="l", namespace="default", resourceVersion=base.metadata.resourceVersion
            ),
            spec=LeaseSpec(holderIdentity=who),
        )
        try:
            client(fake_api).replace(mine)
            results.append(who)
        except ApiError as e:
            assert e.status.code == 409

    threads = [threading.Thread(target=contend, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 1
    assert c.get(Lease, "l").spec.holderIdentity == results[0]


# -------------------------------------------------------------------------- misc behaviour


def test_discovery_documents(fake_api):
    assert httpx.get(f"{fake_api.url}/version").json()["major"] == "1"
    assert httpx.get(f"{fake_api.url}/api").json()["versions"] == ["v1"]
    groups = {g["name"] for g in httpx.get(f"{fake_api.url}/apis").json()["groups"]}
    assert {"coordination.k8s.io", "events.k8s.io"} <= groups
    core = httpx.get(f"{fake_api.url}/api/v1").json()
    names = {r["name"] for r in core["resources"]}
    assert {"pods", "pods/binding", "pods/status", "nodes", "nodes/status", "events"} <= names
    assert httpx.get(f"{fake_api.url}/api/v1/widgets").status_code == 404


def test_finalizers_hold_deletion(fake_api):
    c = client(fake_api)
    c.create(
        Node(metadata=ObjectMeta(name="n1", finalizers=["sharegpu.io/cleanup"]), spec=NodeSpec())
    )
    c.delete(Node, "n1")
    held = c.get(Node, "n1")
    assert held.metadata.deletionTimestamp is not None
    c.patch(Node, "n1", {"metadata": {"finalizers": None}}, patch_type=PatchType.MERGE)
    with pytest.raises(ApiError) as e:
        c.get(Node, "n1")
    assert e.value.status.code == 404


def test_graceful_pod_deletion_waits_for_grace_zero(fake_api_factory):
    api = fake_api_factory(graceful_pod_deletion=True)
    c = client(api)
    c.create(pod("p1"))
    raw(api, "POST", "/api/v1/namespaces/default/pods/p1/binding", bind_body("p1", "n1"))
    c.delete(Pod, "p1")
    assert c.get(Pod, "p1").metadata.deletionGracePeriodSeconds == 30
    c.delete(Pod, "p1", grace_period=0)
    assert api.get("pods", "p1") is None
    c.create(pod("p2"))  # unscheduled pods go at once
    c.delete(Pod, "p2")
    assert api.get("pods", "p2") is None


def test_delete_preconditions(fake_api):
    c = client(fake_api)
    p = c.create(pod("p1"))
    path = "/api/v1/namespaces/default/pods/p1"
    status, _, body = raw(fake_api, "DELETE", path, {"preconditions": {"uid": "other"}})
    assert status == 409 and "Precondition failed: UID" in body["message"]
    status, _, body = raw(
        fake_api,
        "DELETE",
        path,
        {"preconditions": {"uid": p.metadata.uid, "resourceVersion": p.metadata.resourceVersion}},
    )
    assert status == 200 and body["kind"] == "Pod"  # pods answer with the deleted object


def test_state_helpers(fake_api):
    fake_api.create(
        {
            "kind": "Pod",
            "metadata": {"name": "x", "namespace": "ns1"},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running"},
        }
    )
    assert fake_api.get("pods", "x", "ns1")["status"]["phase"] == "Running"
    assert [p["metadata"]["name"] for p in fake_api.objects("Pod")] == ["x"]
    fake_api.patch("pods", "x", {"metadata": {"labels": {"a": "b"}}}, namespace="ns1")
    c = client(fake_api)
    assert c.get(Pod, "x", namespace="ns1").metadata.labels == {"a": "b"}
    fake_api.delete("pods", "x", "ns1")
    assert fake_api.objects("pods") == []


def test_send_initial_events_ends_with_annotated_bookmark(fake_api):
    fake_api.create({"kind": "Node", "metadata": {"name": "n1"}})
    fake_api.create({"kind": "Node", "metadata": {"name": "n2"}})
    rv = fake_api.resource_version
    url = (
        f"{fake_api.url}/api/v1/nodes?watch=1&sendInitialEvents=true&allowWatchBookmarks=true"
        "&resourceVersionMatch=NotOlderThan&timeoutSeconds=1"
    )
    with httpx.stream("GET", url, timeout=5) as r:
        lines = r.iter_lines()
        first = [json.loads(next(lines)) for _ in range(3)]
    assert [(e["type"], e["object"]["metadata"].get("name")) for e in first] == [
        ("ADDED", "n1"),
        ("ADDED", "n2"),
        ("BOOKMARK", None),
    ]
    assert first[2]["object"]["metadata"] == {
        "resourceVersion": rv,
        "annotations": {"k8s.io/initial-events-end": "true"},
    }


def test_events_v1_watch_sees_core_events_converted(fake_api):
    url = f"{fake_api.url}/apis/events.k8s.io/v1/namespaces/default/events?watch=true"
    with httpx.stream("GET", url, timeout=5) as r:
        fake_api.create(
            {
                "kind": "Event",
                "apiVersion": "v1",
                "metadata": {"name": "e1", "namespace": "default"},
                "involvedObject": {"kind": "Pod", "name": "p1", "namespace": "default"},
                "message": "hello",
                "reason": "Test",
            }
        )
        event = json.loads(next(r.iter_lines()))
    assert event["type"] == "ADDED"
    obj = event["object"]
    assert obj["apiVersion"] == "events.k8s.io/v1" and obj["note"] == "hello"
    assert obj["regarding"]["name"] == "p1" and "involvedObject" not in obj


def test_deletecollection_dry_run_and_retry_after(fake_api):
    c = client(fake_api)
    for i in range(4):
        c.create(pod(f"p{i}", labels={"batch": "a" if i < 3 else "b"}))
    status, _, body = raw(
        fake_api,
        "POST",
        "/api/v1/namespaces/default/pods?dryRun=All",
        {"metadata": {"name": "ghost"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
    )
    assert status == 201 and body["metadata"]["name"] == "ghost"
    assert fake_api.get("pods", "ghost") is None
    status, _, body = raw(
        fake_api, "DELETE", "/api/v1/namespaces/default/pods?labelSelector=batch%3Da"
    )
    assert status == 200 and body["kind"] == "PodList"
    assert sorted(i["metadata"]["name"] for i in body["items"]) == ["p0", "p1", "p2"]
    assert [p["metadata"]["name"] for p in fake_api.objects("pods")] == ["p3"]
    fake_api.faults.fail(verbs="list", code=429, times=1)
    r = httpx.get(f"{fake_api.url}/api/v1/pods")
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert r.json()["reason"] == "TooManyRequests"
    assert httpx.get(f"{fake_api.url}/api/v1/pods").status_code == 200


def test_node_agent_style_watch_by_node_name_sees_binding(fake_api):
    c = client(fake_api)
    c.create(pod("p1"))
    c.create(pod("p2"))
    stream = c.watch(Pod, namespace="*", fields={"spec.nodeName": "n1"})
    raw(fake_api, "POST", "/api/v1/namespaces/default/pods/p2/binding", bind_body("p2", "n1"))
    t, o = take(stream, 1)[0]
    assert (t, o.metadata.name, o.spec.nodeName) == ("ADDED", "p2", "n1")  # matches from now on
    c.delete(Pod, "p2")
    assert [(t, o.metadata.name) for t, o in take(stream, 1)] == [("DELETED", "p2")]
    stream.close()


def test_flaky_watches_lose_no_event(fake_api):
    fake_api.faults.flaky_watches(0.3, resources="pods")
    c = client(fake_api)
    # from a known version, so the writer cannot race the first watch request
    stream = c.watch(Pod, namespace="default", resource_version=fake_api.resource_version)

    def writer():
        c2 = client(fake_api)
        for i in range(30):
            c2.create(pod(f"p{i}"))
            c2.patch(
                Pod, f"p{i}", {"metadata": {"labels": {"n": str(i)}}}, patch_type=PatchType.MERGE
            )

    t = threading.Thread(target=writer)
    t.start()
    events = take(stream, 60)
    t.join()
    stream.close()
    # every change exactly once, in order, across the reconnections
    assert [(k, o.metadata.name) for k, o in events] == [
        (k, f"p{i}") for i in range(30) for k in ("ADDED", "MODIFIED")
    ]
    rvs = [int(o.metadata.resourceVersion) for _, o in events]
    assert rvs == sorted(rvs) and len(set(rvs)) == 60
    assert len(fake_api.requests_for("watch", "pods")) > 3  # it did reconnect


def test_timed_outage_ends_by_itself(fake_api):
    c = client(fake_api)
    fake_api.faults.unavailable(seconds=0.3)
    with pytest.raises(ApiError) as e:
        c.list(Pod).__iter__().__next__()
    assert e.value.status.code == 503
    time.sleep(0.35)
    assert list(c.list(Pod)) == []


def test_stop_with_open_watch_is_prompt(fake_api_factory):
    api = fake_api_factory()
    api.create({"kind": "Node", "metadata": {"name": "n1"}})
    with httpx.stream("GET", f"{api.url}/api/v1/nodes?watch=1", timeout=5) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines))["type"] == "ADDED"
        start = time.monotonic()
        api.stop()
        assert time.monotonic() - start < 2
        assert list(lines) == []  # the stream ends cleanly


def test_requests_are_recorded_with_client_identity(fake_api):
    c = client(fake_api)
    c.create(pod("p1"))
    rec = fake_api.requests_for("create", "pods")[-1]
    assert rec.method == "POST" and rec.status == 201 and rec.namespace == "default"
    assert rec.authorization == "Bearer fake-token"
    assert rec.body["metadata"]["name"] == "p1"


def test_label_and_resource_validation_like_the_real_server(fake_api):
    c = client(fake_api)
    c.create(Node(metadata=ObjectMeta(name="n1")))
    with pytest.raises(ApiError) as e:  # a card model with spaces is not a label value
        c.patch(
            Node,
            "n1",
            {"metadata": {"labels": {"gpu-model": "NVIDIA A100 80GB"}}},
            patch_type=PatchType.MERGE,
        )
    assert e.value.status.code == 422 and e.value.status.details.causes[0].field == (
        "metadata.labels"
    )
    ok = c.patch(
        Node,
        "n1",
        {"metadata": {"labels": {"gpu-model": "NVIDIA-A100-80GB"}}},
        patch_type=PatchType.MERGE,
    )
    assert ok.metadata.labels == {"gpu-model": "NVIDIA-A100-80GB"}
    with pytest.raises(ApiError) as e:  # extended resources are whole numbers
        c.patch(
            Node.Status,
            "n1",
            {"status": {"capacity": {"aliyun.com/gpu-mem": "15.5"}}},
            patch_type=PatchType.MERGE,
        )
    assert e.value.status.code == 422 and "must be an integer" in e.value.status.message
    n = c.patch(
        Node.Status,
        "n1",
        {"status": {"capacity": {"aliyun.com/gpu-mem": "30", "memory": "64Gi"}}},
        patch_type=PatchType.MERGE,
    )
    assert n.status.capacity == {"aliyun.com/gpu-mem": "30", "memory": "64Gi"}

    def gpu_pod(name, resources):
        return {
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "i", "resources": resources}]},
        }

    path = "/api/v1/namespaces/default/pods"
    status, _, body = raw(
        fake_api,
        "POST",
        path,
        gpu_pod("ok", {"limits": {"aliyun.com/gpu-mem": "3", "cpu": "500m"}}),
    )
    assert status == 201  # requests default to the limits
    assert body["spec"]["containers"][0]["resources"]["requests"] == {
        "aliyun.com/gpu-mem": "3",
        "cpu": "500m",
    }
    status, _, body = raw(
        fake_api, "POST", path, gpu_pod("half", {"limits": {"aliyun.com/gpu-mem": "0.5"}})
    )
    assert status == 422 and "must be an integer" in body["message"]
    status, _, body = raw(
        fake_api,
        "POST",
        path,
        gpu_pod(
            "over", {"requests": {"aliyun.com/gpu-mem": "2"}, "limits": {"aliyun.com/gpu-mem": "3"}}
        ),
    )
    assert status == 422 and "must be equal to aliyun.com/gpu-mem limit" in body["message"]
    status, _, body = raw(
        fake_api, "POST", path, gpu_pod("nolimit", {"requests": {"aliyun.com/gpu-mem": "2"}})
    )
    assert status == 422 and "Limit must be set" in body["message"]
    status, _, body = raw(fake_api, "POST", path, gpu_pod("bad", {"limits": {"memory": "lots"}}))
    assert status == 422 and "must be a valid quantity" in body["message"]


def test_default_client_config_finds_the_fake_through_kubeconfig_env(fake_api_env):
    fake_api_env.create({"kind": "Node", "metadata": {"name": "n1"}})
    assert [n.metadata.name for n in Client().list(Node)] == ["n1"]  # in-cluster, else $KUBECONFIG


def test_tls_and_token(fake_api_factory):
    api = fake_api_factory(tls=True, token="s3cret")
    assert api.url.startswith("https://") and api.ca_cert_path.is_file()
    trust = ssl.create_default_context(cafile=str(api.ca_cert_path))
    c = client(api)  # the kubeconfig names the CA and carries the token
    c.create(Node(metadata=ObjectMeta(name="n1")))
    assert [n.metadata.name for n in c.list(Node)] == ["n1"]
    assert httpx.get(f"{api.url}/version", verify=trust).status_code == 200
    r = httpx.get(f"{api.url}/api/v1/nodes", verify=trust)
    assert r.status_code == 401 and r.json()["reason"] == "Unauthorized"
    r = httpx.get(
        f"{api.url}/api/v1/nodes",
        verify=trust,
        headers={"Authorization": "Bearer wrong"},
    )
    assert r.status_code == 401
    with pytest.raises(httpx.ConnectError):  # not trusted without the CA
        httpx.get(f"{api.url}/version")


def test_malformed_requests_get_status_errors(fake_api):
    url = f"{fake_api.url}/api/v1/namespaces/default/pods"
    r = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["reason"] == "BadRequest"
    r = httpx.post(url, content=b"\xff\xfe\xfa", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(url, content=b"<pod/>", headers={"Content-Type": "application/xml"})
    assert r.status_code == 415 and r.json()["reason"] == "UnsupportedMediaType"
    r = httpx.patch(f"{url}/x", content=b"{}", headers={"Content-Type": "application/json"})
    assert r.status_code == 415
    r = httpx.get(f"{url}?limit=many")
    assert r.status_code == 400
    r = httpx.get(f"{url}?watch=1&resourceVersion=abc")
    assert r.status_code == 400
    r = httpx.put(f"{url}/x", json={"metadata": {"name": "y"}})
    assert r.status_code == 400 and "does not match the name on the URL" in r.json()["message"]
    r = httpx.post(f"{fake_api.url}/api/v1/pods", json={"metadata": {"name": "x"}})
    assert r.status_code == 405
    r = httpx.get(f"{fake_api.url}/api/v1/namespaces/default/pods/x/binding")
    assert r.status_code == 405
    assert all(rec.status >= 400 for rec in fake_api.requests)
