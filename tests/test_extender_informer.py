"""List + watch feeding the view: incremental updates, resume after a dropped watch, relist
after 410 Gone, and the consistency check that finds and repairs drift."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sharegpu.core.annotations import Allocation, encode
from sharegpu.extender.informer import Informer
from sharegpu.extender.kube import KubeApi
from sharegpu.extender.metrics import Metrics
from sharegpu.extender.view import ClusterView
from sharegpu_testing import kobjects


def bound(name: str, node: str, gpu: int, mem: int) -> dict[str, Any]:
    p = kobjects.pod(name, mem=mem, node_name=node)
    p["metadata"]["annotations"] = encode(Allocation(mem={0: {gpu: mem}}), assume_time_ns=1)
    return p


async def until(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.02)


def relists(m: Metrics) -> float:
    return m.registry.get_sample_value("sharegpu_extender_relists_total", {"resource": "all"})


def test_watch_resume_and_relist_after_gone(fake_api: Any) -> None:
    fake_api.create(kobjects.node("n1", [16, 16], "cgpu"))
    fake_api.create(bound("a", "n1", 0, 4))

    async def go() -> None:
        view, metrics = ClusterView(), Metrics()
        api = KubeApi.from_url(fake_api.url)
        inf = Informer(api, view, metrics, check_every=0, backoff=0.05)
        await inf.start()
        try:
            assert set(view.state.pods) == {"default/a"} and relists(metrics) == 1
            # incremental: a new node and a new bound pod
            fake_api.create(kobjects.node("n2", [32], "cgpu"))
            fake_api.create(bound("b", "n2", 0, 8))
            await until(lambda: "default/b" in view.state.pods)
            # a dropped watch resumes from its resourceVersion: no relist, nothing missed
            fake_api.faults.drop_watches()
            fake_api.create(bound("c", "n1", 1, 2))
            await until(lambda: "default/c" in view.state.pods)
            assert relists(metrics) == 1
            # history compacted: resuming gets 410 Gone, the informer relists and rebuilds (a
            # write it does not watch first, so that no watch has seen the newest
            # resourceVersion even through a bookmark)
            fake_api.create({"apiVersion": "v1", "kind": "ConfigMap",
                             "metadata": {"name": "unwatched", "namespace": "default"}})
            fake_api.faults.compact()
            fake_api.faults.drop_watches()
            fake_api.delete("pods", "a")
            fake_api.create(bound("d", "n2", 0, 8))
            await until(lambda: "default/d" in view.state.pods
                        and "default/a" not in view.state.pods)
            assert relists(metrics) >= 2
            fresh = ClusterView()
            fresh.reset(fake_api.objects("nodes"), fake_api.objects("pods"))
            assert view.fingerprint() == fresh.fingerprint()
            # a deleted node frees its pods
            fake_api.delete("nodes", "n2")
            await until(lambda: "n2" not in view.state.index)
            assert set(view.state.pods) == {"default/c"}
        finally:
            await inf.stop()
            await api.close()

    asyncio.run(go())


def test_consistency_check_finds_and_repairs_drift(fake_api: Any) -> None:
    fake_api.create(kobjects.node("n1", [16, 16], "cgpu"))
    fake_api.create(bound("a", "n1", 0, 4))

    async def go() -> None:
        view, metrics = ClusterView(), Metrics()
        api = KubeApi.from_url(fake_api.url)
        inf = Informer(api, view, metrics, check_every=0)
        await inf.start()
        try:
            assert await inf.check(settle_s=1) == []
            assert metrics.registry.get_sample_value("sharegpu_extender_state_drift_total") == 0
            view.scheduler.release("default/a")  # the live state loses a pod somehow
            assert await inf.check(settle_s=1) == ["default/a"]
            assert metrics.registry.get_sample_value("sharegpu_extender_state_drift_total") == 1
            assert "default/a" in view.state.pods  # repaired by a rebuild
            assert await inf.check(settle_s=1) == []
        finally:
            await inf.stop()
            await api.close()

    asyncio.run(go())
