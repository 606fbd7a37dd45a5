"""The extender's one write against the REAL kube-apiserver: a Binding whose metadata carries
the decision's annotations, with the pod's uid and resourceVersion as preconditions.

- a stale resourceVersion (or another uid) is refused with 409 and changes nothing;
- the pod gets ``nodeName`` and the annotations in one update: a watch never shows one without
  the other;
- what reads decisions reads them unchanged, for a pod bound this way and for one bound as the
  extender did before (annotation PATCH, then a plain Binding; a rolling upgrade has both): the
  agent (:func:`pending_candidates`), ``kubectl inspect cgpu``'s model, the extender's rebuild
  from a list and its watch (:class:`ClusterView`);
The fake API server's store answers the same Bindings the same way
(tests/test_extender_picks.py::test_fake_api_server_binds_like_the_real_one).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from lightkube import Client
from lightkube.resources.core_v1 import Pod

from sharegpu.agent.allocate import pending_candidates
from sharegpu.core import names
from sharegpu.core.annotations import Allocation, decode, encode
from sharegpu.extender.kube import ApiError, KubeApi
from sharegpu.extender.view import ClusterView
from sharegpu.inspect_cgpu import model as inspect_model

from .controlplane import ControlPlane
from .realcluster import cleanup, gpu_node, gpu_pod, make_namespace, node_dicts, pod_dicts


def _alloc(gpu: int, mem: int) -> Allocation:
    return Allocation(mem={0: {gpu: mem}})


async def _bind_and_watch(api: KubeApi, ns: str, name: str, uid: str, node: str,
                          anns: dict[str, str], rv: str) -> list[dict[str, Any]]:
    """Bind with the annotations; every watch event of the pod from ``rv`` until it shows
    ``nodeName``."""
    seen: list[dict[str, Any]] = []

    async def watch() -> None:
        path = f"/api/v1/namespaces/{ns}/pods"
        async for _type, obj in api.watch(path, rv, timeout_s=30):
            if obj.get("metadata", {}).get("name") != name:
                continue
            seen.append(obj)
            if (obj.get("spec") or {}).get("nodeName"):
                return

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.3)
    await api.bind(ns, name, uid, node, annotations=anns, resource_version=rv)
    await asyncio.wait_for(task, 30)
    return seen


def test_binding_carries_the_decision_atomically(controlplane: ControlPlane,
                                                 admin: Client) -> None:
    run = f"bind-{uuid.uuid4().hex[:6]}"
    ns = make_namespace(admin, "bindmeta")
    node = gpu_node(admin, f"{run}-n", "cgpu", [16, 16], run)
    try:
        asyncio.run(_check(controlplane, admin, ns, node, run))
    finally:
        cleanup(admin, ns, [node])


async def _check(cp: ControlPlane, admin: Client, ns: str, node: str, run: str) -> None:
    api = KubeApi.from_config(str(cp.admin_kubeconfig))
    try:
        new = admin.create(Pod.from_dict({**gpu_pod("new", run, mem=4),
                                          "metadata": {"name": "new", "namespace": ns,
                                                       "labels": {"e2e.sharegpu.io/run": run}}}))
        old = admin.create(Pod.from_dict({**gpu_pod("old", run, mem=6),
                                          "metadata": {"name": "old", "namespace": ns,
                                                       "labels": {"e2e.sharegpu.io/run": run}}}))
        new_anns = encode(_alloc(0, 4), assume_time_ns=1, gpu_capacity={0: 16, 1: 16})
        old_anns = encode(_alloc(1, 6), assume_time_ns=2, gpu_capacity={0: 16, 1: 16})
        uid, rv = str(new.metadata.uid), str(new.metadata.resourceVersion)

        # refused: a stale resourceVersion, another uid; the pod is unchanged
        for bad_uid, bad_rv in ((uid, str(int(rv) - 1)), ("00000000-0000-0000-0000-000000000000",
                                                         rv)):
            try:
                await api.bind(ns, "new", bad_uid, node, annotations=new_anns,
                               resource_version=bad_rv)
            except ApiError as e:
                assert e.status == 409, e
            else:
                raise AssertionError("a Binding with a failed precondition was accepted")
        cur = admin.get(Pod, "new", namespace=ns).to_dict()
        assert not cur["spec"].get("nodeName")
        assert decode(cur["metadata"].get("annotations") or {}) is None
        assert cur["metadata"]["resourceVersion"] == rv

        # accepted: nodeName and the annotations in the same update
        events = await _bind_and_watch(api, ns, "new", uid, node, new_anns, rv)
        for obj in events:
            bound = bool((obj.get("spec") or {}).get("nodeName"))
            has = decode((obj.get("metadata") or {}).get("annotations") or {}) is not None
            assert bound == has, f"nodeName and annotations apart: {obj['metadata']}"
        assert events and events[-1]["spec"]["nodeName"] == node
        stored = admin.get(Pod, "new", namespace=ns).to_dict()
        for k, v in new_anns.items():
            assert stored["metadata"]["annotations"][k] == v

        # the previous extender's two writes, for the other pod
        orv = str(old.metadata.resourceVersion)
        await api.patch_pod_annotations(ns, "old", old_anns, orv)
        await api.bind(ns, "old", str(old.metadata.uid), node)

        pods, nodes = pod_dicts(admin, ns), node_dicts(admin, run)
        # the agent: both pods are pending on the node with their recorded GPUs
        got = {c.name: dict(c.mem) for c in pending_candidates(pods, node)}
        assert got == {"new": {0: 4}, "old": {1: 6}}, got
        # kubectl inspect cgpu: the node's per-GPU use
        usage = inspect_model.build(nodes, pods)
        (n,) = [x for x in usage.nodes if x.name == node]
        assert [g.mem_allocated for g in n.gpus] == [4, 6], n
        # the extender's rebuild from the lists, and its watch
        rebuilt = ClusterView()
        rebuilt.reset(nodes, pods)
        watched = ClusterView()
        watched.reset(nodes, [])
        for p in pods:
            watched.upsert_pod(p)
        for view in (rebuilt, watched):
            held = {k.split("/")[1]: (r.node, r.alloc.per_gpu_mem())
                    for k, r in view.state.pods.items()}
            assert held == {"new": (node, {0: 4}), "old": (node, {1: 6})}, held
            assert view.drift() == []
            assert not [k for k in view.problems if k.startswith(f"{ns}/")], view.problems
        assert names.ANN_ASSIGNED in stored["metadata"]["annotations"]
    finally:
        await api.close()
