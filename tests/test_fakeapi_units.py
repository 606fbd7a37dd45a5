"""The fake API server's pure parts: patch formats, selectors, the store without HTTP."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest

from sharegpu_testing import status as st
from sharegpu_testing.patches import PatchError, json_patch, merge_patch, strategic_merge_patch
from sharegpu_testing.resources import EVENT, LEASE, NODE, POD, resolve
from sharegpu_testing.selectors import (
    SelectorError,
    parse_field_selector,
    parse_label_selector,
)
from sharegpu_testing.store import Store
from sharegpu_testing.validation import is_extended_resource, parse_quantity

# ------------------------------------------------------------------------------- merge patch


def test_merge_patch_rfc7386_examples():
    assert merge_patch({"a": "b"}, {"a": "c"}) == {"a": "c"}
    assert merge_patch({"a": "b"}, {"b": "c"}) == {"a": "b", "b": "c"}
    assert merge_patch({"a": "b"}, {"a": None}) == {}
    assert merge_patch({"a": "b", "b": "c"}, {"a": None}) == {"b": "c"}
    assert merge_patch({"a": ["b"]}, {"a": "c"}) == {"a": "c"}
    assert merge_patch({"a": "c"}, {"a": ["b"]}) == {"a": ["b"]}
    assert merge_patch({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}) == {"a": {"b": "d"}}
    assert merge_patch({"a": [{"b": "c"}]}, {"a": [1]}) == {"a": [1]}
    assert merge_patch({"e": None}, {"a": 1}) == {"e": None, "a": 1}
    assert merge_patch({}, {"a": {"bb": {"ccc": None}}}) == {"a": {"bb": {}}}


def test_merge_patch_does_not_mutate_inputs():
    target = {"a": {"b": [1, 2]}}
    patch = {"a": {"c": {"d": 1}}}
    out = merge_patch(target, patch)
    out["a"]["b"].append(3)
    out["a"]["c"]["d"] = 2
    assert target == {"a": {"b": [1, 2]}} and patch == {"a": {"c": {"d": 1}}}


# --------------------------------------------------------------------- strategic merge patch


def test_strategic_merge_patch_merges_keyed_lists_and_replaces_others():
    pod = {
        "spec": {
            "containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}],
            "tolerations": [{"key": "x"}],
        },
        "metadata": {"finalizers": ["f1"]},
    }
    out = strategic_merge_patch(
        pod,
        {
            "spec": {
                "containers": [{"name": "b", "image": "3"}, {"name": "c", "image": "4"}],
                "tolerations": [{"key": "y"}],
            },
            "metadata": {"finalizers": ["f2", "f1"]},
        },
    )
    assert out["spec"]["containers"] == [
        {"name": "a", "image": "1"},
        {"name": "b", "image": "3"},
        {"name": "c", "image": "4"},
    ]
    assert out["spec"]["tolerations"] == [{"key": "y"}]  # no merge key: replaced
    assert out["metadata"]["finalizers"] == ["f1", "f2"]  # merged as a set


def test_strategic_merge_patch_directives():
    cur = {"status": {"conditions": [{"type": "A", "status": "x"}, {"type": "B", "status": "y"}]}}
    out = strategic_merge_patch(
        cur, {"status": {"conditions": [{"type": "A", "$patch": "delete"}]}}
    )
    assert out["status"]["conditions"] == [{"type": "B", "status": "y"}]
    out = strategic_merge_patch({"spec": {"a": 1, "b": 2}}, {"spec": {"$patch": "replace", "c": 3}})
    assert out == {"spec": {"c": 3}}
    out = strategic_merge_patch(
        {"metadata": {"finalizers": ["a", "b", "c"]}},
        {"metadata": {"$deleteFromPrimitiveList/finalizers": ["b"]}},
    )
    assert out == {"metadata": {"finalizers": ["a", "c"]}}
    out = strategic_merge_patch(
        {"spec": {"containers": [{"name": "a"}]}},
        {"spec": {"$setElementOrder/containers": [{"name": "a"}], "x": 1}},
    )
    assert out == {"spec": {"containers": [{"name": "a"}], "x": 1}}
    with pytest.raises(PatchError) as e:
        strategic_merge_patch({}, {"spec": {"containers": [{"image": "no-name"}]}})
    assert e.value.malformed


# -------------------------------------------------------------------------------- JSON patch


def test_json_patch_operations_and_pointer_escapes():
    doc = {"a/b": {"m~n": 1}, "list": [1, 2, 3]}
    out = json_patch(
        doc,
        [
            {"op": "replace", "path": "/a~1b/m~0n", "value": 2},
            {"op": "add", "path": "/list/1", "value": 9},
            {"op": "add", "path": "/list/-", "value": 4},
            {"op": "remove", "path": "/list/0"},
            {"op": "copy", "from": "/list", "path": "/copy"},
            {"op": "move", "from": "/copy/0", "path": "/first"},
            {"op": "test", "path": "/first", "value": 9},
        ],
    )
    assert out == {"a/b": {"m~n": 2}, "list": [9, 2, 3, 4], "copy": [2, 3, 4], "first": 9}
    assert doc == {"a/b": {"m~n": 1}, "list": [1, 2, 3]}  # atomic, input untouched


@pytest.mark.parametrize(
    "ops",
    [
        [{"op": "test", "path": "/a", "value": 2}],
        [{"op": "test", "path": "/missing", "value": None}],
        [{"op": "test", "path": "/t", "value": 1}],  # true is not 1
        [{"op": "remove", "path": "/missing"}],
        [{"op": "replace", "path": "/missing", "value": 1}],
        [{"op": "add", "path": "/no/such/parent", "value": 1}],
        [{"op": "add", "path": "/l/5", "value": 1}],
        [{"op": "remove", "path": "/l/01"}],
        [{"op": "move", "from": "/o", "path": "/o/x"}],
    ],
)
def test_json_patch_failures_do_not_apply(ops):
    with pytest.raises(PatchError) as e:
        json_patch({"a": 1, "t": True, "l": [0], "o": {}}, ops)
    assert not e.value.malformed


@pytest.mark.parametrize(
    "ops",
    [
        {"op": "add"},
        [{"path": "/a"}],
        [{"op": "jump", "path": "/a"}],
        [{"op": "add", "path": "a", "value": 1}],
        [{"op": "add", "path": "/a"}],
        [{"op": "move", "path": "/a"}],
    ],
)
def test_json_patch_malformed(ops):
    with pytest.raises(PatchError) as e:
        json_patch({"a": 1}, ops)
    assert e.value.malformed


# --------------------------------------------------------------------------------- selectors


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("", {}, True),
        ("a=b", {"a": "b"}, True),
        ("a==b", {"a": "c"}, False),
        ("a!=b", {}, True),
        ("a!=b", {"a": "b"}, False),
        ("a in (x, y)", {"a": "y"}, True),
        ("a in (x,y)", {}, False),
        ("a notin (x,y)", {}, True),
        ("a notin (x,y)", {"a": "x"}, False),
        ("a", {"a": ""}, True),
        ("!a", {"a": ""}, False),
        ("!a", {"b": "1"}, True),
        ("a>5", {"a": "7"}, True),
        ("a<5", {"a": "7"}, False),
        ("a>5", {"a": "x"}, False),
        (
            "example.com/gpu=true,tier in (fe),!legacy",
            {"example.com/gpu": "true", "tier": "fe"},
            True,
        ),
        ("a=", {"a": ""}, True),
    ],
)
def test_label_selector_semantics(selector, labels, expected):
    assert parse_label_selector(selector).matches(labels) is expected


@pytest.mark.parametrize(
    "selector", ["a in (x", "a=b)", "a=b,,c=d", "-bad=1", "a=in valid", "a>x", "a in x", "a=b=c"]
)
def test_label_selector_errors(selector):
    with pytest.raises(SelectorError):
        parse_label_selector(selector)


def test_field_selector_parsing_and_matching():
    sel = parse_field_selector("spec.nodeName=n1,status.phase!=Failed", POD.supported_fields)
    assert sel.matches(
        POD.field_values({"spec": {"nodeName": "n1"}, "status": {"phase": "Running"}})
    )
    assert not sel.matches(
        POD.field_values({"spec": {"nodeName": "n1"}, "status": {"phase": "Failed"}})
    )
    assert not sel.matches(POD.field_values({"spec": {}}))
    esc = parse_field_selector(r"metadata.name=a\,b")
    assert esc.terms[0].value == "a,b"
    assert parse_field_selector("spec.unschedulable=true", NODE.supported_fields).matches(
        NODE.field_values({"spec": {"unschedulable": True}})
    )
    with pytest.raises(SelectorError, match="field label not supported"):
        parse_field_selector("spec.nodeName=x", LEASE.supported_fields)
    with pytest.raises(SelectorError):
        parse_field_selector("justakey", POD.supported_fields)


def test_resolve_resource_names():
    assert resolve("pods") is POD and resolve("Pod") is POD and resolve("po") is POD
    assert resolve("leases.coordination.k8s.io") is LEASE and resolve("Lease") is LEASE
    assert resolve("events") is EVENT
    assert resolve("Event", "events.k8s.io/v1").group == "events.k8s.io"
    with pytest.raises(KeyError):
        resolve("widgets")


# ------------------------------------------------------------------------------------- store


def pod(name: str, **extra) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
        **extra,
    }


def test_store_exact_list_reconstructs_history():
    s = Store()
    s.create(POD, "default", pod("a"))
    rv = s.resource_version
    s.update(
        POD, "default", "a", lambda o: {**o, "metadata": {**o["metadata"], "labels": {"x": "1"}}}
    )
    s.create(POD, "default", pod("b"))
    s.delete(POD, "default", "a")
    everything = parse_label_selector("")
    no_fields = parse_field_selector("")
    then = s.list(
        POD, None, everything, no_fields, resource_version=str(rv), resource_version_match="Exact"
    )
    assert [(i["metadata"]["name"], i["metadata"].get("labels")) for i in then["items"]] == [
        ("a", None)
    ]
    assert then["metadata"]["resourceVersion"] == str(rv)
    now = s.list(POD, None, everything, no_fields)
    assert [i["metadata"]["name"] for i in now["items"]] == ["b"]
    s.compact()
    with pytest.raises(st.StatusError) as e:
        s.list(
            POD,
            None,
            everything,
            no_fields,
            resource_version=str(rv),
            resource_version_match="Exact",
        )
    assert e.value.code == 410
    with pytest.raises(st.StatusError) as e:
        s.list(POD, None, everything, no_fields, resource_version=str(s.resource_version + 5))
    assert e.value.code == 504


def test_store_watch_backlog_filters_and_rejects_old_versions():
    s = Store(history_size=4)
    loop = asyncio.new_event_loop()
    try:
        start = s.resource_version
        s.create(POD, "default", pod("a", metadata={"name": "a", "labels": {"g": "1"}}))
        s.create(POD, "other", pod("b", metadata={"name": "b", "labels": {"g": "1"}}))
        sel = parse_label_selector("g=1")
        opened = s.watch(
            POD, "default", sel, parse_field_selector(""), loop, resource_version=str(start)
        )
        assert [(t, o["metadata"]["name"]) for t, o in opened.backlog] == [("ADDED", "a")]
        assert opened.resource_version == s.resource_version
        for i in range(5):
            s.create(NODE, None, {"metadata": {"name": f"n{i}"}})
        with pytest.raises(st.StatusError) as e:
            s.watch(POD, None, sel, parse_field_selector(""), loop, resource_version=str(start))
        assert e.value.code == 410 and e.value.reason == "Expired"
        assert s.open_watches == 1
        assert s.close_watches() == 1 and s.open_watches == 0
    finally:
        loop.close()


def test_store_rejects_stale_and_foreign_writes():
    s = Store()
    created = s.create(POD, "default", pod("a"))
    stale = dict(created)
    s.update(
        POD, "default", "a", lambda o: {**o, "metadata": {**o["metadata"], "labels": {"v": "1"}}}
    )
    with pytest.raises(st.StatusError) as e:
        s.update(POD, "default", "a", lambda _o: stale)
    assert e.value.code == 409 and e.value.reason == "Conflict"
    with pytest.raises(st.StatusError) as e:
        s.update(POD, "default", "a", lambda o: {**o, "metadata": {**o["metadata"], "uid": "x"}})
    assert e.value.code == 409 and "UID in precondition" in e.value.message
    with pytest.raises(st.StatusError) as e:
        s.update(POD, "default", "a", lambda o: {**o, "metadata": {**o["metadata"], "name": "b"}})
    assert e.value.code == 400
    with pytest.raises(st.StatusError) as e:
        s.create(POD, "default", {"metadata": {"name": "x", "namespace": "other"}, "spec": {}})
    assert e.value.code == 400


def test_strict_namespaces():
    s = Store(strict_namespaces=True)
    with pytest.raises(st.StatusError) as e:
        s.create(POD, "nope", pod("a"))
    assert e.value.code == 404 and e.value.message == 'namespaces "nope" not found'
    assert s.create(POD, "kube-system", pod("a"))["metadata"]["namespace"] == "kube-system"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", Decimal(1)),
        ("500m", Decimal("0.5")),
        ("15Gi", Decimal(15 * 2**30)),
        ("1k", Decimal(1000)),
        ("1e3", Decimal(1000)),
        ("1E", Decimal(10**18)),
        (".5", Decimal("0.5")),
        (3, Decimal(3)),
        ("1.5.2", None),
        ("lots", None),
        ("1 Gi", None),
        (True, None),
    ],
)
def test_parse_quantity(text, value):
    assert parse_quantity(text) == value


def test_extended_resource_names():
    assert is_extended_resource("aliyun.com/gpu-mem")
    assert is_extended_resource("nvidia.com/gpu")
    assert not is_extended_resource("cpu")
    assert not is_extended_resource("kubernetes.io/something")
    assert not is_extended_resource("hugepages-2Mi")


def test_update_without_kind_that_changes_nothing_is_a_noop():
    s = Store()
    created = s.create(NODE, None, {"metadata": {"name": "n1", "labels": {"a": "b"}}})
    body = {k: v for k, v in created.items() if k not in ("kind", "apiVersion")}
    same, _ = s.update(NODE, None, "n1", lambda _cur: body)
    assert same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert s.resource_version == int(created["metadata"]["resourceVersion"])
