"""kube-scheduler's extender wire format: CamelCase keys, names or full nodes, clear errors."""

from __future__ import annotations

import json

import pytest

from sharegpu.core.errors import ValidationError
from sharegpu.extender import wire
from sharegpu_testing import kobjects


def test_node_names_request() -> None:
    pod = kobjects.pod("p", mem=4)
    a = wire.parse_args({"Pod": pod, "Nodes": None, "NodeNames": ["a", "b"]})
    assert a.names == ["a", "b"] and a.nodes is None and a.node_cache_capable
    out = wire.filter_result(a, ["b"], {"a": "full"}, {})
    assert out == {"Nodes": None, "NodeNames": ["b"], "FailedNodes": {"a": "full"},
                   "FailedAndUnresolvableNodes": {}, "Error": ""}


@pytest.mark.parametrize(("passed", "failed", "unres"), [
    (["b"], {"a": "full"}, {}),
    ([], {"a": 'says "no"'}, {"c": "wrong mode"}),
    ([f"node-{i:04d}.zone-1" for i in range(500)], {}, {}),
    (['we"ird', "ok"], {}, {}),  # a name that needs escaping takes the general path
])
def test_filter_result_json_is_the_filter_result(
    passed: list[str], failed: dict[str, str], unres: dict[str, str]
) -> None:
    a = wire.parse_args({"Pod": kobjects.pod("p"), "NodeNames": passed + list(failed)
                         + list(unres)})
    assert json.loads(wire.filter_result_json(a, passed, failed, unres)) == wire.filter_result(
        a, passed, failed, unres)
    nodes = [kobjects.node("a", [16]), kobjects.node("b", [16])]
    full = wire.parse_args({"Pod": kobjects.pod("p"), "Nodes": {"items": nodes}})
    assert json.loads(wire.filter_result_json(full, ["b"], {"a": "x"}, {})) == (
        wire.filter_result(full, ["b"], {"a": "x"}, {}))


def test_full_nodes_request_answers_with_nodes() -> None:
    nodes = [kobjects.node("a", [16]), kobjects.node("b", [16])]
    a = wire.parse_args({"Pod": kobjects.pod("p", mem=4), "Nodes": {"items": nodes}})
    assert a.names == ["a", "b"] and not a.node_cache_capable
    out = wire.filter_result(a, ["b"], {}, {"a": "wrong mode"})
    assert out["NodeNames"] is None
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["b"]
    assert out["FailedAndUnresolvableNodes"] == {"a": "wrong mode"}


def test_keys_match_case_insensitively_like_go() -> None:
    a = wire.parse_args({"pod": kobjects.pod("p"), "nodenames": ["x"]})
    assert a.names == ["x"]
    b = wire.parse_binding({"podName": "p", "podNamespace": "ns", "podUID": "u", "node": "n"})
    assert (b.pod_name, b.pod_namespace, b.pod_uid, b.node, b.key) == ("p", "ns", "u", "n", "ns/p")


@pytest.mark.parametrize(("body", "field"), [
    ([], "body"),
    ({}, "Pod"),
    ({"Pod": "x"}, "Pod"),
    ({"Pod": {"metadata": {}}, "NodeNames": []}, "Pod.metadata.name"),
    ({"Pod": kobjects.pod("p")}, "NodeNames"),
    ({"Pod": kobjects.pod("p"), "NodeNames": "a,b"}, "NodeNames"),
    ({"Pod": kobjects.pod("p"), "NodeNames": [1]}, "NodeNames"),
    ({"Pod": kobjects.pod("p"), "Nodes": {"items": "x"}}, "Nodes.items"),
    ({"Pod": kobjects.pod("p"), "Nodes": {"items": [{"metadata": {}}]}},
     "Nodes.items[0].metadata.name"),
])
def test_malformed_args_name_the_field(body: object, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        wire.parse_args(body)
    assert e.value.field == field


@pytest.mark.parametrize(("body", "field"), [
    ("x", "body"),
    ({"PodNamespace": "ns", "Node": "n"}, "PodName"),
    ({"PodName": "p", "Node": "n"}, "PodNamespace"),
    ({"PodName": "p", "PodNamespace": "ns"}, "Node"),
    ({"PodName": 3, "PodNamespace": "ns", "Node": "n"}, "PodName"),
])
def test_malformed_binding_names_the_field(body: object, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        wire.parse_binding(body)
    assert e.value.field == field


SUBDOMAIN_RULE = "must be a DNS-1123 subdomain"
LABEL_RULE = "must be a DNS-1123 label"
GOOD_BINDING = {"PodName": "p-1.a", "PodNamespace": "team-a", "PodUID": "0f-3a", "Node": "n1.x"}


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("PodName", "../../nodes/n1", SUBDOMAIN_RULE),
    ("PodName", "P", SUBDOMAIN_RULE),
    ("PodName", "a/b", SUBDOMAIN_RULE),
    ("PodName", "a?x=1", SUBDOMAIN_RULE),
    ("PodName", "-a", SUBDOMAIN_RULE),
    ("PodName", "a" * 254, SUBDOMAIN_RULE),
    ("PodNamespace", "kube-system/pods", LABEL_RULE),
    ("PodNamespace", "a.b", LABEL_RULE),
    ("PodNamespace", "a" * 64, LABEL_RULE),
    ("PodNamespace", "%2e%2e", LABEL_RULE),
    ("Node", "n1/../../x", SUBDOMAIN_RULE),
    ("Node", "N1", SUBDOMAIN_RULE),
    ("Node", "n1 ", SUBDOMAIN_RULE),
    ("Node", "a..b", SUBDOMAIN_RULE),
    ("PodUID", "u/../x", "must be a pod UID"),
    ("PodUID", "u" * 129, "must be a pod UID"),
])
def test_binding_names_are_dns_1123_before_any_path_is_built(
        field: str, value: str, rule: str) -> None:
    """Names that would change the API path the bind writes to (or that the API server would
    never have given an object) are refused with the field and the rule."""
    assert wire.parse_binding(GOOD_BINDING).node == "n1.x"
    with pytest.raises(ValidationError) as e:
        wire.parse_binding({**GOOD_BINDING, field: value})
    assert e.value.field == field and rule in str(e.value), str(e.value)


@pytest.mark.parametrize(("meta", "field", "rule"), [
    ({"name": "../x"}, "Pod.metadata.name", SUBDOMAIN_RULE),
    ({"name": "p", "namespace": "a/b"}, "Pod.metadata.namespace", LABEL_RULE),
    ({"name": "p", "namespace": "A"}, "Pod.metadata.namespace", LABEL_RULE),
])
def test_a_filtered_pod_names_are_dns_1123(meta: dict[str, str], field: str, rule: str) -> None:
    """The pod's name and namespace name its Events' paths: checked as well."""
    pod = {**kobjects.pod("p"), "metadata": meta}
    with pytest.raises(ValidationError) as e:
        wire.parse_args({"Pod": pod, "NodeNames": ["n1"]})
    assert e.value.field == field and rule in str(e.value), str(e.value)


def test_priority_list_and_binding_result() -> None:
    assert wire.priority_list({"a": 10, "b": 3, "c": 0}) == [{"Host": "a", "Score": 10},
                                                             {"Host": "b", "Score": 3}]
    many = {f"node-{i:04d}": i % 11 for i in range(500)}
    for scores in ({"node-1.zone": 10, "n_2:x": 4, "z": 0}, {'we"ird\\name': 7, "ok": 1}, {},
                   many):
        # the same hosts and scores, in any order (kube-scheduler sums per host)
        got = json.loads(wire.priority_list_json(scores))
        key = lambda h: h["Host"]  # noqa: E731
        assert sorted(got, key=key) == sorted(wire.priority_list(scores), key=key)
        assert len(got) == len({h["Host"] for h in got})
    assert wire.binding_result() == {"Error": ""}
    assert wire.binding_result("boom") == {"Error": "boom"}


def test_names_json_and_the_prioritize_body_expected_after_a_filter() -> None:
    assert wire.names_json(["a", "b-1.x"]) == b'["a","b-1.x"]'
    assert wire.names_json([]) == b"[]"
    assert wire.names_json(['we"ird']) is None
    pod = kobjects.pod("p", mem=4)
    cand, passed = ["a", "b", "c"], ["a", "c"]
    body = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": cand},
                      separators=(",", ":")).encode()
    expected = wire.prioritize_body(body, wire.names_json(passed) or b"")
    # what kube-scheduler sends: the same args marshalled with the names it got back
    assert expected == json.dumps({"Pod": pod, "Nodes": None, "NodeNames": passed},
                                  separators=(",", ":")).encode()
    # other layouts are not guessed at
    for other in (json.dumps({"NodeNames": cand, "Pod": pod}).encode(),  # names not last
                  json.dumps({"Pod": pod, "NodeNames": cand}, indent=1).encode(),
                  json.dumps({"Pod": {}, 'a"NodeNames': ["a"]},  # a key's escaped quote
                             separators=(",", ":")).encode(),
                  b'{"Pod":{},"NodeNames":["a"]} '):  # trailing space
        assert wire.prioritize_body(other, b'["a"]') is None



def test_no_percent_sign_reaches_kube_scheduler():
    """kube-scheduler formats the extender's Error (fmt.Errorf) and the per-node reasons (the
    event's format string): a bare % would show as %!o(MISSING). Reasons say "percent"."""
    from sharegpu.extender.wire import (
        binding_result,
        error_filter_result,
        filter_result,
        filter_result_json,
        go_safe,
        parse_args,
    )

    assert go_safe("needs 10% on 1 GPU") == "needs 10 percent on 1 GPU"
    assert go_safe("100 %") == "100 percent"
    assert go_safe("plain") == "plain"
    args = parse_args({"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["a", "b"]})
    failed = {"b": "insufficient GPU compute: needs 30% on 1 GPU(s)"}
    for body in (json.dumps(filter_result(args, ["a"], failed, {}, "x 5%")).encode(),
                 filter_result_json(args, ["a"], failed, {}),
                 json.dumps(error_filter_result("50% bad")).encode(),
                 json.dumps(binding_result("GPU 0 has 40% compute free")).encode()):
        assert b"%" not in body
    out = json.loads(filter_result_json(args, ["a"], failed, {}))
    assert out["FailedNodes"]["b"] == "insufficient GPU compute: needs 30 percent on 1 GPU(s)"


def test_reasons_are_encoded_once_each_and_made_go_safe() -> None:
    import json

    from sharegpu.extender import wire

    reasons = {f"n{i}": ("needs 10% on one GPU" if i % 2 else 'a "quoted" reason')
               for i in range(6)}
    got = wire.reasons_json(reasons)
    assert got is not None
    assert json.loads(got) == {k: wire.go_safe(v) for k, v in reasons.items()}
    assert b"%" not in got
    assert wire.reasons_json({}) == b"{}"
    assert wire.reasons_json({'odd"name': "x"}) is None  # the caller encodes it in full
