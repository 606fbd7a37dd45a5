"""A pod's CPU and memory as kube-scheduler counts them (containers, init containers, sidecars,
overhead, pod-level requests, limits as defaults), a node's allocatable, and malformed values."""

from __future__ import annotations

from typing import Any

import pytest

from sharegpu.core.errors import ValidationError
from sharegpu.core.hostresources import charges_node, node_allocatable, pod_request, pod_request_key
from sharegpu.core.nodes import spec_from_node
from sharegpu_testing import kobjects


def c(cpu: str | None = None, mem: str | None = None, *, limits: bool = False,
      restart: str | None = None) -> dict[str, Any]:
    res = {k: v for k, v in (("cpu", cpu), ("memory", mem)) if v is not None}
    out: dict[str, Any] = {"name": "x", "resources": {"limits" if limits else "requests": res}}
    if restart:
        out["restartPolicy"] = restart
    return out


def pod(containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None,
        **spec: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"containers": containers, **spec}
    if init is not None:
        s["initContainers"] = init
    return {"metadata": {"name": "p", "namespace": "d"}, "spec": s}


def test_app_containers_add_up_and_limits_stand_in_for_requests() -> None:
    assert pod_request(pod([c("500m", "1Gi"), c("1.5", "512Mi")])) == (2000, 1536)
    assert pod_request(pod([c("2", "3Gi", limits=True)])) == (2000, 3072)
    both = pod([{"name": "x", "resources": {"requests": {"cpu": "1"},
                                            "limits": {"cpu": "4", "memory": "1Gi"}}}])
    assert pod_request(both) == (1000, 1024)  # the request wins; memory from its limit
    assert pod_request(pod([{"name": "x"}])) == (0, 0)


def test_init_containers_count_by_their_largest_and_sidecars_add_up() -> None:
    # an init container asking for more than the app containers sets the pod's request
    assert pod_request(pod([c("1", "1Gi")], [c("3", "512Mi"), c("2", "2Gi")])) == (3000, 2048)
    # upstream's example: sidecars run beside everything started after them
    p = pod([c("1", "1Gi")], [c("2", "1Gi"), c("1", "1Gi", restart="Always"),
                              c("3", "1Gi"), c("500m", "1Gi", restart="Always")])
    # app + sidecars = 1 + 1 + 0.5 = 2.5; init 3 after one sidecar = 4 (the largest)
    assert pod_request(p) == (4000, 3072)


def test_overhead_and_pod_level_requests() -> None:
    p = pod([c("1", "1Gi")], overhead={"cpu": "250m", "memory": "120Mi"})
    assert pod_request(p) == (1250, 1144)
    level = pod([c("1", "1Gi"), c("1", "1Gi")], resources={"requests": {"cpu": "3"}})
    assert pod_request(level) == (3000, 2048)


def test_rounding_is_up_for_pods_and_down_for_nodes() -> None:
    assert pod_request(pod([c("0.0001", "1")])) == (1, 1)  # 0.1 millicore, one byte
    node = kobjects.node("n", [16])
    node["status"]["allocatable"].update({"cpu": "3999999u", "memory": "1048575"})
    assert node_allocatable(node)[:2] == (3999, 0)


@pytest.mark.parametrize("res, field", [
    ({"requests": {"cpu": "lots"}}, 'spec.containers[0].resources.requests["cpu"]'),
    ({"limits": {"memory": "1Gb"}}, 'spec.containers[0].resources.limits["memory"]'),
    ({"requests": {"cpu": "-1"}}, 'spec.containers[0].resources.requests["cpu"]'),
    ({"requests": ["cpu"]}, "spec.containers[0].resources"),
])
def test_malformed_pod_quantities_name_the_field(res: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        pod_request(pod([{"name": "x", "resources": res}]))
    assert e.value.field == field


def test_malformed_allocatable_is_unknown_with_a_reason() -> None:
    node = kobjects.node("n", [16, 16])
    node["status"]["allocatable"].update({"cpu": "many", "memory": "-5Gi"})
    cpu, mem, problems = node_allocatable(node)
    assert (cpu, mem) == (None, None) and len(problems) == 2
    assert 'status.allocatable["cpu"]' in problems[0] and "unknown" in problems[0]
    spec = spec_from_node(node)
    assert spec is not None and spec.cpu_milli is None and spec.mem_mib is None
    good = spec_from_node(kobjects.node("n", [16]))
    assert good is not None and (good.cpu_milli, good.mem_mib) == (64000, 262144)
    del node["status"]["allocatable"]
    assert node_allocatable(node) == (None, None, [])


def test_only_bound_live_pods_charge_a_node() -> None:
    p = kobjects.pod("p", cpu="1", node_name="n")
    assert charges_node(p) == "n"
    p["status"]["phase"] = "Succeeded"
    assert charges_node(p) == ""
    assert charges_node(kobjects.pod("q", cpu="1")) == ""


def test_request_key_tells_apart_what_counts_differently() -> None:
    a = pod([c("1", "1Gi")], [c("2", "1Gi")])
    b = pod([c("1", "1Gi")], [c("2", "1Gi", restart="Always")])
    d = pod([c("1", "1Gi")], overhead={"cpu": "1"})
    keys = {pod_request_key(x) for x in (a, b, d, pod([c("1", "1Gi")]))}
    assert len(keys) == 4
    assert pod_request_key(a) == pod_request_key(pod([c("1", "1Gi")], [c("2", "1Gi")]))
