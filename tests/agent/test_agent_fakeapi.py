"""The agent's Kubernetes API path (lightkube) against the fake API server: card-model labels and
node annotations patched, the mode label watched live, a pod marked assigned after Allocate."""

from __future__ import annotations

import contextlib

import grpc
from agent_helpers import NODE, make_pod, short_dir, standin_library  # noqa: F401
from agent_kubelet import TestKubelet, wait_until

from sharegpu.agent.builder import build_agent
from sharegpu.agent.config import AgentConfig
from sharegpu.agent.isolation import IsolationConfig
from sharegpu.agent.lightkube_api import LightkubeApi, make_client
from sharegpu.agent.nvml import FakeNvml
from sharegpu.core import names
from sharegpu.core.annotations import is_assigned
from sharegpu.core.modes import Mode, advertised_resources


@contextlib.asynccontextmanager
async def agent_on_fake_api(fake_api, short_dir, *, node_status, pod, gpus, **config):  # type: ignore[no-untyped-def]
    """A cgpu Node (with ``node_status``) and ``pod`` in the fake API server, a test kubelet,
    and an agent talking to the API through lightkube; yields (agent, kubelet)."""
    fake_api.create({"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": NODE, "labels": {names.LABEL_SCHEDULE: "cgpu"}},
                     "status": node_status})
    pod.update({"apiVersion": "v1", "kind": "Pod"})
    fake_api.create(pod)
    kubelet = TestKubelet(f"{short_dir}/dp")
    await kubelet.start()
    client = make_client(str(fake_api.kubeconfig_path))
    agent = build_agent(
        AgentConfig(node_name=NODE, device_plugin_dir=f"{short_dir}/dp",
                    state_dir=f"{short_dir}/state", kubelet_poll_s=0.05, **config),
        FakeNvml(gpus), LightkubeApi(client),
    )
    await agent.start()
    try:
        yield agent, kubelet
    finally:
        await agent.stop()
        await kubelet.stop()
        await client.close()


async def test_agent_against_fake_api_server(fake_api, short_dir):
    async with agent_on_fake_api(
            fake_api, short_dir, node_status={},
            pod=make_pod("w", [{"mem": 3}], alloc={0: {1: 3}}),
            gpus=[("Tesla-T4", 15), ("Tesla-V100-SXM2-32GB", 32)],
            isolation_paths=IsolationConfig(hami_library=standin_library())) as (agent, kubelet):
        def counts() -> dict[str, int]:
            return {r: kubelet.count(r) for r in names.ALL_GPU_RESOURCES}

        await wait_until(lambda: counts() == advertised_resources(Mode.CGPU, [15, 32]))
        meta = fake_api.get("nodes", NODE)["metadata"]
        assert meta["labels"][names.LABEL_CARD_NAME] == "Tesla-T4"
        assert meta["labels"][names.LABEL_CARD_COUNT] == "2"
        assert meta["annotations"][names.ANN_NODE_GPU_MEM] == "15,32"
        assert meta["annotations"][names.ANN_NODE_LAST_MODE] == "cgpu"
        # the isolation condition, through nodes/status (strategic merge by type)
        (cond,) = [c for c in fake_api.get("nodes", NODE)["status"]["conditions"]
                   if c["type"] == "GPUIsolationReady"]
        assert cond["status"] == "True" and cond["reason"] == "BackendReady"

        # Allocate reads the pod from the API and marks it assigned there
        ids = [i for i, _ in kubelet.devices[names.RES_GPU_MEM]
               if agent.devices.gpu_of(i) == 1][:3]
        resp = await kubelet.allocate(names.RES_GPU_MEM, ids)
        assert resp.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3072m"
        await wait_until(lambda: is_assigned(
            fake_api.get("pods", "w", "default")["metadata"]["annotations"]))

        # the label watch follows a live switch, and a removal keeps the mode
        fake_api.patch("nodes", NODE, {"metadata": {"labels": {names.LABEL_SCHEDULE: "core_mem"}}})
        await wait_until(lambda: counts() == advertised_resources(Mode.CORE_MEM, [15, 32]))
        await wait_until(lambda: fake_api.get("nodes", NODE)["metadata"]["annotations"]
                         [names.ANN_NODE_LAST_MODE] == "core_mem")
        fake_api.patch("nodes", NODE, {"metadata": {"labels": {names.LABEL_SCHEDULE: None}}})
        fake_api.patch("nodes", NODE, {"metadata": {"labels": {"touched": "yes"}}})
        await wait_until(lambda: agent.labels.get("touched") == "yes")
        assert agent.mode is Mode.CORE_MEM
        assert counts() == advertised_resources(Mode.CORE_MEM, [15, 32])


async def test_refusal_event_and_condition_through_the_api(fake_api, short_dir):
    """Fail closed against the API server: the node condition turns False through
    nodes/status and the refused pod gets a core/v1 Event."""
    missing = f"{short_dir}/none/libvgpu.so"
    async with agent_on_fake_api(
            fake_api, short_dir,
            node_status={"conditions": [{"type": "Ready", "status": "True"}]},
            pod=make_pod("w", [{"mem": 2}], alloc={0: {0: 2}}), gpus=[("Tesla-T4", 15)],
            allocate_retries=0,
            isolation_paths=IsolationConfig(hami_library=missing)) as (_agent, kubelet):
        conds = {c["type"]: c for c in fake_api.get("nodes", NODE)["status"]["conditions"]}
        assert conds["Ready"]["status"] == "True"  # the kubelet's conditions are kept
        assert conds["GPUIsolationReady"]["status"] == "False"
        assert missing in conds["GPUIsolationReady"]["message"]
        await wait_until(lambda: len(kubelet.devices.get(names.RES_GPU_MEM, [])) == 15)
        ids = [i for i, _ in kubelet.devices[names.RES_GPU_MEM]][:2]
        try:
            await kubelet.allocate(names.RES_GPU_MEM, ids)
            raise AssertionError("Allocate must be refused")
        except grpc.aio.AioRpcError as e:
            assert "isolation back-end hami is not usable" in e.details()
        await wait_until(lambda: fake_api.objects("events", "default"))
        (ev,) = fake_api.objects("events", "default")
        assert ev["reason"] == "GPUIsolationUnavailable" and ev["involvedObject"]["name"] == "w"
        assert not is_assigned(fake_api.get("pods", "w", "default")["metadata"]["annotations"])
