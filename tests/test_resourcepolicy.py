"""ResourcePolicy: the core's model, validation and decisions (sharegpu.core.resourcepolicy), and
the
extender's counts per unit fed by pod events (sharegpu.extender.resourcepolicies)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sharegpu.core import resourcepolicy as rp
from sharegpu.core.errors import ValidationError
from sharegpu.extender.kube import NODES, PODS
from sharegpu.extender.resourcepolicies import ResourcePolicies


def policy_obj(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "selector": {"app": "web"},
        "units": [{"nodeSelector": {"pool": "a"}, "max": 2},
                  {"nodeSelector": {"pool": "b"}, "max": 2},
                  {"nodeSelector": {"pool": "c"}}],
    }
    base.update(spec)
    return {"apiVersion": rp.API_VERSION, "kind": "ResourcePolicy",
            "metadata": {"name": "web", "namespace": "default",
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": base}


class Counts(rp.Usage):
    def __init__(self, counts: dict[int, int], terminating: set[int] = frozenset()) -> None:
        self.c, self.t = counts, terminating

    def count(self, unit: int) -> int:
        return self.c.get(unit, 0)

    def terminating(self, unit: int) -> bool:
        return unit in self.t


def test_a_full_policy_parses_with_acks_defaults():
    p = rp.parse_policy(policy_obj(
        matchLabelKeys=["pod-template-hash"],
        whenTryNextUnits={"policy": "TimeoutOrExceedMax", "timeout": "1m30s"}))
    assert p.key == "default/web" and p.strategy == "prefer"
    assert [u.max for u in p.units] == [2, 2, None]
    assert p.ignore_terminating_pod is True and p.ignore_previous_pod is False
    assert p.preempt_policy == "AfterAllUnits"
    assert p.when == rp.TIMEOUT_OR_MAX and p.timeout_s == 90.0
    assert p.created == 1767225600.0
    assert rp.parse_policy(policy_obj()).when == rp.LACK_OR_MAX
    assert rp.parse_policy(policy_obj()).timeout_s == 900.0  # 15m


@pytest.mark.parametrize(("change", "field", "rule"), [
    ({"units": []}, "spec.units", "non-empty"),
    ({"selector": {}}, "spec.selector", "at least one label"),
    ({"selector": {"app": 3}}, "spec.selector.app", "must be a string"),
    ({"strategy": "required"}, "spec.strategy", "must be one of prefer"),
    ({"units": [{"max": -1}]}, "spec.units[0].max", "from 0"),
    ({"units": [{"max": True}]}, "spec.units[0].max", "integer"),
    ({"units": [{"max": "3"}]}, "spec.units[0].max", "integer"),
    ({"units": [{"resource": "elastic"}]}, "spec.units[0].resource", "not supported"),
    ({"units": [{"resource": "gpu"}]}, "spec.units[0].resource", "ecs, eci"),
    ({"units": [{"nodeSelector": {"pool": ["a"]}}]}, "spec.units[0].nodeSelector.pool",
     "string"),
    ({"units": [{"podLabels": {"app": "other"}}]}, "spec.units[0].podLabels.app",
     "label the policy selects"),
    ({"units": [{"podAnnotations": {rp.ANN_UNIT: "x"}}]},
     f"spec.units[0].podAnnotations.{rp.ANN_UNIT}", "written by the scheduler"),
    ({"units": [{"nodeSelectr": {}}]}, "spec.units[0].nodeSelectr", "unknown field"),
    ({"preemptPolicy": "Never"}, "spec.preemptPolicy", "AfterAllUnits, BeforeNextUnit"),
    ({"ignorePreviousPod": "yes"}, "spec.ignorePreviousPod", "true or false"),
    ({"matchLabelKeys": ["a", "a"]}, "spec.matchLabelKeys", "repeat"),
    ({"matchLabelKeys": ["bad key"]}, "spec.matchLabelKeys[0]", "alphanumeric"),
    ({"whenTryNextUnits": {"policy": "Sometimes"}}, "spec.whenTryNextUnits.policy",
     "LackResourceOrExceedMax"),
    ({"whenTryNextUnits": {"policy": "TimeoutOrExceedMax", "timeout": "15 minutes"}},
     "spec.whenTryNextUnits.timeout", "duration"),
    ({"whenTryNextUnits": {"timeout": "0s"}}, "spec.whenTryNextUnits.timeout",
     "longer than 0"),
    ({"extra": 1}, "spec.extra", "unknown field"),
])
def test_invalid_policies_are_refused_naming_the_field_and_the_rule(change, field, rule):
    with pytest.raises(ValidationError) as e:
        rp.parse_policy(policy_obj(**change))
    assert e.value.field == field
    assert rule in e.value.rule


def test_not_an_object_is_refused_without_a_traceback():
    for bad in (None, [], "x", {"spec": []}, {"spec": {"units": [3]}}):
        with pytest.raises(ValidationError):
            rp.parse_policy(bad)


def test_durations():
    assert rp.parse_duration("15m", "t") == 900
    assert rp.parse_duration("1h30m", "t") == 5400
    assert rp.parse_duration("250ms", "t") == 0.25
    for bad in ("", "15", "m", "-1s", "1d"):
        with pytest.raises(ValidationError):
            rp.parse_duration(bad, "t")


def test_reachable_units_under_each_when_policy():
    p = rp.parse_policy(policy_obj())
    # LackResourceOrExceedMax: every unit not full, in order
    assert rp.reachable_units(p, Counts({}), 0) == [0, 1, 2]
    assert rp.reachable_units(p, Counts({0: 2}), 0) == [1, 2]
    assert rp.reachable_units(p, Counts({0: 2, 1: 5}), 0) == [2]
    # ExceedMax: only the first unit not full
    p = rp.parse_policy(policy_obj(whenTryNextUnits={"policy": "ExceedMax"}))
    assert rp.reachable_units(p, Counts({}), 1e9) == [0]
    assert rp.reachable_units(p, Counts({0: 2}), 0) == [1]
    # TimeoutOrExceedMax: one more unit per timeout waited
    p = rp.parse_policy(policy_obj(whenTryNextUnits={"policy": "TimeoutOrExceedMax",
                                                     "timeout": "60s"}))
    assert rp.reachable_units(p, Counts({}), 59.9) == [0]
    assert rp.reachable_units(p, Counts({}), 60) == [0, 1]
    assert rp.reachable_units(p, Counts({}), 500) == [0, 1, 2]
    assert rp.reachable_units(p, Counts({0: 2}), 0) == [1]  # full: moves on at once
    # LackResourceAndNoTerminating: not past a unit where a pod is terminating
    p = rp.parse_policy(policy_obj(whenTryNextUnits={"policy": "LackResourceAndNoTerminating"}))
    assert rp.reachable_units(p, Counts({}, {0}), 0) == [0]
    assert rp.reachable_units(p, Counts({}, {1}), 0) == [0, 1]
    assert rp.choose_unit([0, 1, 2], lambda u: u == 1) == 1
    assert rp.choose_unit([0], lambda u: False) is None


def test_deletion_cost_falls_unit_by_unit_and_eci_units_are_virtual_nodes():
    p = rp.parse_policy(policy_obj(units=[{"nodeSelector": {"pool": "a"}},
                                          {"resource": "eci"}]))
    assert p.deletion_cost(0) > p.deletion_cost(1) > 0
    assert p.unit_of_node({"pool": "a"}) == 0
    assert p.unit_of_node({"type": "virtual-kubelet"}) == 1
    assert p.unit_of_node({"pool": "z"}) is None


def test_the_oldest_selecting_policy_governs_a_pod():
    a = rp.parse_policy(policy_obj())
    b_obj = policy_obj()
    b_obj["metadata"].update(name="older", creationTimestamp="2025-01-01T00:00:00Z")
    b = rp.parse_policy(b_obj)
    assert rp.pick_policy([a, b], {"app": "web"}) is b
    assert rp.pick_policy([a, b], {"app": "db"}) is None


# --------------------------------------------------------------- the extender's counts


def node(name: str, pool: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"pool": pool}}}


def pod(name: str, node_name: str = "", unit: str | None = None, *, labels=None,
        created: str = "2026-02-01T00:00:00Z", terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "default",
                            "labels": labels or {"app": "web"}, "creationTimestamp": created}
    if unit is not None:
        meta["annotations"] = {rp.ANN_UNIT: unit}
    if terminating:
        meta["deletionTimestamp"] = "2026-02-02T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node_name}, "status": {}}


NODES_ABC = [node("a1", "a"), node("b1", "b"), node("c1", "c")]


def counter(obj: dict[str, Any] | None = None, pods=(), clock=lambda: 1.8e9) -> ResourcePolicies:
    u = ResourcePolicies(clock=clock)
    u.set_policies([obj or policy_obj()])
    u.reset(NODES_ABC, list(pods))
    return u


def test_counts_follow_pod_events_and_rebuild_from_annotations():
    u = counter(pods=[pod("p0", "a1", "web/0"), pod("p1", "a1", "web/0"),
                      pod("p2", "b1", "web/1"), pod("pending")])
    assert u.unit_counts("default/web") == {0: 2, 1: 1}
    u.on_event(PODS, "MODIFIED", pod("pending", "b1", "web/1"))
    assert u.unit_counts("default/web") == {0: 2, 1: 2}
    u.on_event(PODS, "DELETED", pod("p0", "a1", "web/0"))
    assert u.unit_counts("default/web") == {0: 1, 1: 2}
    # ended pods and annotated pods not (yet) bound count nothing
    done = pod("p1", "a1", "web/0")
    done["status"]["phase"] = "Succeeded"
    u.on_event(PODS, "MODIFIED", done)
    u.on_event(PODS, "ADDED", pod("annotated-unbound", "", "web/0"))
    assert u.unit_counts("default/web") == {1: 2}
    # a pod another policy name annotated, or a label the policy does not select: not counted
    u.on_event(PODS, "ADDED", pod("x", "a1", "other/0"))
    u.on_event(PODS, "ADDED", pod("y", "a1", "web/0", labels={"app": "db"}))
    assert u.unit_counts("default/web") == {1: 2}
    # the same pods listed again give the same counts
    again = counter(pods=[pod("p2", "b1", "web/1"), pod("pending", "b1", "web/1"), done])
    assert again.unit_counts("default/web") == u.unit_counts("default/web")


def test_previous_pods_count_by_their_node_unless_ignored():
    old = pod("old", "b1", created="2025-06-01T00:00:00Z")  # before the policy, no annotation
    assert counter(pods=[old]).unit_counts("default/web") == {1: 1}
    ignoring = counter(policy_obj(ignorePreviousPod=True), pods=[old])
    assert ignoring.unit_counts("default/web") == {}
    newer = pod("newer", "b1", created="2026-06-01T00:00:00Z")
    assert counter(policy_obj(ignorePreviousPod=True), pods=[newer]).unit_counts(
        "default/web") == {1: 1}


def test_terminating_pods_count_only_when_the_policy_says_so():
    pods = [pod("p0", "a1", "web/0"), pod("p1", "a1", "web/0", terminating=True)]
    ignoring = counter(pods=pods)
    counting = counter(policy_obj(ignoreTerminatingPod=False), pods=pods)
    passed = ["a1", "b1", "c1"]
    # max 2 in unit 0: one live pod and one terminating one
    assert ignoring.restrict(pod("new"), passed, {}) == ["a1"]
    assert counting.restrict(pod("new"), passed, {}) == ["b1"]
    # LackResourceAndNoTerminating: a unit where a pod terminates is not left
    waiting = counter(policy_obj(whenTryNextUnits={"policy": "LackResourceAndNoTerminating"}),
                      pods=pods)
    unres: dict[str, str] = {}
    assert waiting.restrict(pod("new"), ["b1", "c1"], unres) == []
    assert "default/web" in unres["b1"]


def test_match_label_keys_count_each_revision_apart():
    obj = policy_obj(matchLabelKeys=["rev"])
    old = {"app": "web", "rev": "1"}
    new = {"app": "web", "rev": "2"}
    u = counter(obj, pods=[pod("o0", "a1", "web/0", labels=old),
                           pod("o1", "a1", "web/0", labels=old)])
    assert u.restrict(pod("o2", labels=old), ["a1", "b1"], {}) == ["b1"]  # rev 1 filled unit 0
    assert u.restrict(pod("n0", labels=new), ["a1", "b1"], {}) == ["a1"]  # rev 2 starts over


def test_claims_count_at_once_and_are_released_on_failure():
    u = counter(pods=[pod("p0", "a1", "web/0"), pod("q1"), pod("q2")])
    c = u.claim("default", "q1", {"app": "web"}, "a1")
    assert c is not None and c.unit == 0
    assert c.annotations[rp.ANN_UNIT] == "web/0"
    assert c.annotations[rp.ANN_DELETION_COST] == "300"
    # unit 0 is full now (1 bound + 1 claimed): the next pod may not bind there
    with pytest.raises(ValidationError) as e:
        u.claim("default", "q2", {"app": "web"}, "a1")
    # the bind's reason says what happened: the unit filled after the filter (a race with
    # other binds), and where the retried pod goes now
    assert "unit 0 became full (max 2, binds in flight counted) after this pod was filtered" \
        in str(e.value)
    assert "may use unit 1, 2 now" in str(e.value)
    assert "no node of unit" not in str(e.value)
    assert u.restrict(pod("q2"), ["a1", "b1"], {}) == ["b1"]
    u.release("default", "q1")
    assert u.restrict(pod("q2"), ["a1", "b1"], {}) == ["a1"]
    # a claim is replaced by the pod's bound event
    u.claim("default", "q1", {"app": "web"}, "a1")
    u.on_event(PODS, "MODIFIED", pod("q1", "a1", "web/0"))
    assert u.claims == {} and u.unit_counts("default/web") == {0: 2}
    # pods no policy selects are not claimed
    assert u.claim("default", "free", {"app": "db"}, "a1") is None


def test_bind_refusals_name_what_changed_since_the_filter():
    u = counter(policy_obj(whenTryNextUnits={"policy": "ExceedMax"}), pods=[pod("q")])
    # ExceedMax: unit 1 is not full but the pod may not go there before unit 0 is
    with pytest.raises(ValidationError) as e:
        u.claim("default", "q", {"app": "web"}, "b1")
    msg = str(e.value)
    assert "unit 1 may not be used by this pod now" in msg, msg
    assert "whenTryNextUnits ExceedMax does not allow unit 1 yet" in msg, msg
    assert "may use unit 0 now" in msg, msg
    # a node of no unit
    u.on_event(NODES, "ADDED", {"metadata": {"name": "z1", "labels": {"pool": "z"}}})
    with pytest.raises(ValidationError) as e:
        u.claim("default", "q", {"app": "web"}, "z1")
    assert "the node is in no unit of the policy" in str(e.value)
    assert u.claims == {}


def test_timeout_counts_from_creation_with_an_injected_clock():
    now = [rp.parse_time("2026-02-01T00:00:30Z")]
    obj = policy_obj(whenTryNextUnits={"policy": "TimeoutOrExceedMax", "timeout": "60s"})
    u = counter(obj, clock=lambda: now[0])
    unres: dict[str, str] = {}
    assert u.restrict(pod("p"), ["b1", "c1"], unres) == []  # unit 0 has no node that fits
    assert "does not allow unit 1 yet" in unres["b1"]
    now[0] += 31  # 61 s after creation
    assert u.restrict(pod("p"), ["b1", "c1"], {}) == ["b1"]


def test_policy_changes_recount_and_invalid_ones_are_ignored():
    u = counter(pods=[pod("p0", "a1", "web/0")])
    bad = policy_obj(units=[])
    bad["metadata"]["name"] = "broken"
    u.upsert_policy(bad)
    assert "spec.units" in u.problems["default/broken"]
    assert u.unit_counts("default/web") == {0: 1}
    u.delete_policy(policy_obj())
    assert u.unit_counts("default/web") == {}
    assert u.restrict(pod("x"), ["a1", "b1"], {}) == ["a1", "b1"]  # no policy: untouched
    u.upsert_policy(policy_obj())
    assert u.unit_counts("default/web") == {0: 1}
    # nodes learnt from events
    u.on_event(NODES, "ADDED", node("a2", "a"))
    assert u.restrict(pod("x"), ["a2", "b1"], {}) == ["a2"]


def test_malformed_pods_do_not_break_the_counts():
    u = counter()
    for weird in ({}, {"metadata": None}, {"metadata": {"labels": "x"}},
                  {"metadata": {"name": "w", "annotations": {rp.ANN_UNIT: "nonsense"}},
                   "spec": {"nodeName": "a1"}}):
        u.on_event(PODS, "ADDED", copy.deepcopy(weird))
    assert u.restrict({"metadata": {"labels": ["x"]}}, ["a1"], {}) == ["a1"]
    assert u.unit_counts("default/web") == {}


# --------------------------------------------------------------- the admission webhook


def policy_review(obj: Any, operation: str = "CREATE") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "operation": operation, "namespace": "team-a",
                        "kind": {"group": rp.GROUP, "version": rp.VERSION, "kind": rp.KIND},
                        "object": obj}}


def test_webhook_refuses_invalid_policies_naming_the_field():
    from sharegpu.webhook import review

    ok = review(policy_review(policy_obj()))["response"]
    assert ok["allowed"] is True
    bad = review(policy_review(policy_obj(whenTryNextUnits={"policy": "Never"}),
                               "UPDATE"))["response"]
    assert bad["allowed"] is False
    assert bad["status"]["code"] == 422
    msg = bad["status"]["message"]
    assert msg.startswith("ResourcePolicy refused: spec.whenTryNextUnits.policy='Never'")
    assert "LackResourceOrExceedMax" in msg
    # deleting is never refused; a review that is no object is a 400 (the API server refuses)
    assert review(policy_review(policy_obj(units=[]), "DELETE"))["response"]["allowed"]
    with pytest.raises(ValidationError):
        review(policy_review("nonsense"))


def test_webhook_http_answers_a_policy_review():
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from sharegpu.webhook import app

    async def go() -> None:
        async with TestClient(TestServer(app())) as client:
            r = await client.post("/validate", json=policy_review(policy_obj(units=[{"max": -2}])))
            assert r.status == 200
            body = await r.json()
            assert body["response"]["allowed"] is False
            assert "spec.units[0].max" in body["response"]["status"]["message"]
            r = await client.post("/validate", json=policy_review(["x"]))
            assert r.status == 400

    asyncio.run(go())


def test_a_refused_watch_is_a_warning_with_growing_backoff_and_lists_still_apply(
        monkeypatch: Any, caplog: Any) -> None:
    """403 on the watch (RBAC allows list, not watch): warned, listed again after 2x, 4x, ...
    the retry (capped), and each list still brings the policies in."""
    import asyncio as aio
    import logging

    from sharegpu.extender.kube import ApiError, Gone
    from sharegpu.extender.resourcepolicies import ResourcePolicies

    sleeps: list[float] = []
    lists = 0

    class Api:
        async def list(self, path: str) -> tuple[list[Any], str]:
            nonlocal lists
            lists += 1
            if lists == 6:
                raise aio.CancelledError
            return [], "7"

        async def watch(self, path: str, rv: str) -> Any:
            if lists == 2:
                raise Gone(410, "Expired", "too old")
            raise ApiError(403, "Forbidden", "cannot watch resourcepolicies")
            yield  # pragma: no cover

    async def fake_sleep(s: float) -> None:
        sleeps.append(s)

    monkeypatch.setattr("sharegpu.extender.resourcepolicies.asyncio.sleep", fake_sleep)
    rp = ResourcePolicies(retry_s=1.0)
    with caplog.at_level(logging.WARNING), pytest.raises(aio.CancelledError):
        aio.run(rp.run(Api()))  # type: ignore[arg-type]
    assert rp.synced
    # list 1: 403 → 2 s; list 2: 410 → at once; lists 3, 4, 5: 403 → 4, 8, 16 s
    assert sleeps == [2.0, 4.0, 8.0, 16.0]
    assert sum("watching ResourcePolicies refused" in r.message for r in caplog.records) == 4
