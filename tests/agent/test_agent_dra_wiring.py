"""The DRA kubelet plugin wired into the agent (docs/dra.md, "The plugin in the agent"): served
while the node is in the DRA pool and only then, following the pool label live, started and
stopped with the agent; ``sharegpu agent`` flags for its directories, refused when wrong."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from agent_helpers import NODE, harness, short_dir  # noqa: F401
from agent_kubelet import wait_until
from dra_kubelet import TestDraKubelet, cdi_registry, container_view
from test_agent_dra import claim, result

from sharegpu.agent.builder import build_agent
from sharegpu.agent.draplugin import DraConfig
from sharegpu.agent.slicepublisher import MemorySlices, SlicePublisher
from sharegpu.core import names
from sharegpu.core.modes import Mode, advertised_resources
from sharegpu.dra import driver as dra

NOTHING = dict.fromkeys(names.ALL_GPU_RESOURCES, 0)
UID = "11111111-2222-4333-8444-555555555555"


def dirs(d: str) -> DraConfig:
    return DraConfig(registry_dir=f"{d}/registry", plugin_dir=f"{d}/plugins/{dra.DRIVER}",
                     cdi_dir=f"{d}/cdi")


def sockets(c: DraConfig) -> tuple[bool, bool]:
    return os.path.exists(c.registration_socket), os.path.exists(c.endpoint)


async def test_the_plugin_follows_the_pool_label_and_the_agent(harness, short_dir):
    api = MemorySlices()
    api.add_device_class(dra.DRIVER, uid="dc-1")
    c = dirs(short_dir)
    h = await harness(mode="cgpu", dra="label", dra_plugin=c,
                      slices=SlicePublisher(api, NODE, retry_s=0.05))
    # off the pool: device plugins advertise, no plugin socket in the kubelet's registry
    await asyncio.sleep(0.2)
    assert h.counts() == advertised_resources(Mode.CGPU, [15, 32])
    assert sockets(c) == (False, False) and not h.agent.dra_serving

    # into the pool: the kubelet's plugin watcher finds the plugin, which prepares a claim
    h.kube.set_node_labels(NODE, {"sharegpu.io/dra": "true"})
    await wait_until(lambda: sockets(c) == (True, True) and h.counts() == NOTHING)
    # not ready (the readiness probe's /readyz) until the kubelet registers the DRA plugin
    assert h.agent.unready() == ["the kubelet has not registered the DRA plugin yet"]
    kubelet = TestDraKubelet(c.registry_dir)
    try:
        assert [r.name for r in await kubelet.discover()] == [dra.DRIVER]
        assert h.agent.dra_plugin.registered is True
        assert h.agent.unready() == []
        h.kube.add_claim(claim("c1", [result("gpu-1", "6Gi", "30")], uid=UID))
        answers = await kubelet.prepare(dra.DRIVER, [("default", "c1", UID)])
        ids = [i for d in answers[UID].devices for i in d.cdi_device_ids]
        assert not answers[UID].error and ids == [f"sharegpu.io/gpu={UID}-gpu-1"]
        env, _ = container_view(cdi_registry(c.cdi_dir), ids)
        assert env["NVIDIA_VISIBLE_DEVICES"] == h.nvml.gpus()[1].uuid
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "6144m" and env["CUDA_DEVICE_SM_LIMIT"] == "30"
    finally:
        await kubelet.close()

    # out of the pool: the sockets go (the kubelet deregisters it), the claim's record stays
    h.kube.set_node_labels(NODE, {"sharegpu.io/dra": None})
    await wait_until(lambda: sockets(c) == (False, False)
                     and h.counts() == advertised_resources(Mode.CGPU, [15, 32]))
    assert not h.agent.dra_serving
    assert os.path.exists(f"{c.cdi_dir}/sharegpu.io-gpu_{UID}.json")

    # back in, then the agent stops: the sockets go with it; a new agent serves the same claim
    # from its checkpoint
    h.kube.set_node_labels(NODE, {"sharegpu.io/dra": "true"})
    await wait_until(lambda: sockets(c) == (True, True))
    await h.agent.stop()
    assert sockets(c) == (False, False)
    h.agent = None
    h.kube.claims.clear()  # no API read: answered from the checkpoint
    h.agent = build_agent(h.config(), h.nvml, h.kube, h.slices)
    await h.agent.start()
    await wait_until(lambda: sockets(c) == (True, True))
    kubelet = TestDraKubelet(c.registry_dir)
    try:
        await kubelet.discover()
        again = await kubelet.prepare(dra.DRIVER, [("default", "c1", UID)])
        assert [i for d in again[UID].devices for i in d.cdi_device_ids] == ids
        assert (await kubelet.unprepare(dra.DRIVER, [("default", "c1", UID)]))[UID].error == ""
        assert not os.listdir(c.cdi_dir)
    finally:
        await kubelet.close()


async def test_dra_on_serves_from_the_start_and_off_never(harness, short_dir):
    c = dirs(short_dir)
    h = await harness(mode="cgpu", dra="on", dra_plugin=c)
    assert sockets(c) == (True, True) and h.agent.dra_serving
    await h.agent.stop()
    h.agent = None
    off = dirs(f"{short_dir}/off")
    h.cfg.update(dra="off", dra_plugin=off)
    h.agent = build_agent(h.config(), h.nvml, h.kube, h.slices)
    await h.agent.start()
    await asyncio.sleep(0.2)
    assert h.agent.dra_plugin is None and not os.path.exists(off.registry_dir)


def _agent(tmp: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "sharegpu.cli", "agent", "--node-name", "n", "--nvml", "fake",
            "--standalone", "--mode", "cgpu", "--isolation", "none", "--metrics-listen", "",
            "--state-dir", f"{tmp}/state", "--device-plugin-dir", f"{tmp}/dp", *flags]


def test_sharegpu_agent_serves_the_plugin_until_sigterm(short_dir):
    c = dirs(short_dir)
    p = subprocess.Popen(_agent(short_dir, "--dra", "on", "--dra-plugins-registry",
                                c.registry_dir, "--dra-plugin-dir", c.plugin_dir,
                                "--cdi-dir", c.cdi_dir),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while sockets(c) != (True, True):
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "the plugin's sockets did not appear"
            time.sleep(0.05)

        async def register() -> list[str]:
            k = TestDraKubelet(c.registry_dir)
            try:
                return [r.endpoint for r in await k.discover()]
            finally:
                await k.close()

        assert asyncio.run(register()) == [c.endpoint]
    finally:
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=30)[0]
    assert p.returncode == 0, out
    assert sockets(c) == (False, False)
    assert f"DRA plugin {dra.DRIVER}: endpoint {c.endpoint}" in out


@pytest.mark.parametrize(("flags", "message"), [
    (["--dra", "on", "--cdi-dir", "cdi"], "--cdi-dir='cdi': must be an absolute path"),
    (["--dra", "on", "--dra-driver", "gpu.example.com"],
     "--dra-driver='gpu.example.com': the DRA kubelet plugin serves driver gpu.sharegpu.io"),
    (["--dra", "on", "--dra-plugin-dir", "/" + "d" * 120],
     "--dra-plugin-dir='/ddd"),
])
def test_agent_refuses_bad_plugin_flags(short_dir, flags, message):
    r = subprocess.run(_agent(short_dir, *flags), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert message in r.stderr, r.stderr


def test_another_driver_name_with_the_plugin_off_publishes_slices_only(short_dir):
    c = dirs(short_dir)
    p = subprocess.Popen(_agent(short_dir, "--dra", "on", "--dra-driver", "gpu.example.com",
                                "--dra-kubelet-plugin", "off",
                                "--dra-plugins-registry", c.registry_dir),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)
        assert p.poll() is None
        assert not os.path.exists(c.registry_dir)
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    assert p.returncode == 0
