"""The DRA kubelet plugin on its own port (:class:`DraNode`), with no agent behind it: it
prepares a claim from what the port gives (the claim reader, the guard, the grant) and nothing
else, and a grant the port refuses leaves no spec and no record."""

from __future__ import annotations

import json
import os

from agent_helpers import short_dir  # noqa: F401
from dra_kubelet import TestDraKubelet
from test_agent_dra import claim, result

from sharegpu.agent.allocate import Allocator, Candidate, Grant, Guard, IsolationUnavailable
from sharegpu.agent.devices import DeviceMap
from sharegpu.agent.dracheckpoint import CHECKPOINT_FILE
from sharegpu.agent.draplugin import DraConfig, DraNode, DraPlugin
from sharegpu.agent.isolation import Backend
from sharegpu.agent.nvml import FakeNvml
from sharegpu.dra import driver as dra

NODE = "gpu-node-1"


def port(directory: str, claims: dict, *, refuse: bool = False) -> tuple[DraNode, list]:
    gpus = FakeNvml([("Tesla-T4", 15), ("A100-SXM4-40GB", 40)]).gpus()
    allocator = Allocator(NODE, DeviceMap(gpus))
    calls: list = []

    def no_check(backend: Backend, c: Candidate) -> None:
        calls.append(("guard", backend))

    async def guard() -> Guard:
        return no_check

    async def read_claim(namespace: str, name: str) -> dict:
        calls.append(("read", namespace, name))
        return claims[name]

    def grant(c: Candidate, g: Guard) -> Grant:
        calls.append(("grant", c.container_name, dict(c.mem), g is no_check))
        if refuse:
            raise IsolationUnavailable("no back-end here", c)
        return allocator.grant(c, Backend.NONE, {}, g)

    return DraNode(node_name=NODE, state_dir=f"{directory}/state", gpus=gpus,
                   read_claim=read_claim, isolation_guard=guard, grant=grant), calls


async def run(directory: str, node: DraNode, *claims: dict) -> dict:
    config = DraConfig(registry_dir=f"{directory}/registry",
                       plugin_dir=f"{directory}/plugins/{dra.DRIVER}", cdi_dir=f"{directory}/cdi")
    os.makedirs(node.state_dir, exist_ok=True)
    plugin = DraPlugin(node, config)
    kubelet = TestDraKubelet(config.registry_dir)
    await plugin.start()
    try:
        await kubelet.discover()
        refs = [(c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"]["uid"])
                for c in claims]
        return await kubelet.prepare(dra.DRIVER, refs)
    finally:
        await kubelet.close()
        await plugin.stop()


async def test_a_claim_is_prepared_through_the_port_alone(short_dir):
    c = claim("one", [result("gpu-1", "4Gi")])
    node, calls = port(short_dir, {"one": c})
    answers = await run(short_dir, node, c)
    assert not answers["uid-one"].error, answers["uid-one"].error
    assert [i for d in answers["uid-one"].devices for i in d.cdi_device_ids] == [
        dra.cdi_device_id("uid-one", "gpu-1")]
    assert calls == [("read", "default", "one"), ("grant", "gpu", {1: 4}, True)]
    assert len(os.listdir(f"{short_dir}/cdi")) == 1
    with open(f"{short_dir}/state/{CHECKPOINT_FILE}") as f:
        assert list(json.load(f)["claims"]) == ["uid-one"]


async def test_a_grant_the_port_refuses_leaves_nothing(short_dir):
    c = claim("one", [result("gpu-1", "4Gi")])
    node, calls = port(short_dir, {"one": c}, refuse=True)
    answers = await run(short_dir, node, c)
    assert answers["uid-one"].error == (
        f"{dra.DRIVER}: claim default/one (uid-one) not prepared: no back-end here")
    assert calls == [("read", "default", "one"), ("grant", "gpu", {1: 4}, True)]
    assert os.listdir(f"{short_dir}/cdi") == []
    assert not os.path.exists(f"{short_dir}/state/{CHECKPOINT_FILE}")
