"""The committed device-plugin modules match our proto, and the wire format is the kubelet's
v1beta1 (package, services, and the field numbers the kubelet uses)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sharegpu.agent.proto import api_pb2 as pb

PROTO = Path(__file__).resolve().parents[2] / "src" / "sharegpu" / "agent" / "proto"


def fields(message) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_wire_format_is_v1beta1():
    d = pb.DESCRIPTOR
    assert d.package == "v1beta1"
    assert [m.name for m in d.services_by_name["Registration"].methods] == ["Register"]
    assert [m.name for m in d.services_by_name["DevicePlugin"].methods] == [
        "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
        "PreStartContainer"]
    assert d.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"].server_streaming
    assert fields(pb.RegisterRequest) == {"version": 1, "endpoint": 2, "resource_name": 3,
                                          "options": 4}
    assert fields(pb.DevicePluginOptions) == {"pre_start_required": 1,
                                              "get_preferred_allocation_available": 2}
    assert fields(pb.Device) == {"ID": 1, "health": 2, "topology": 3}
    assert fields(pb.ListAndWatchResponse) == {"devices": 1}
    assert fields(pb.ContainerPreferredAllocationRequest) == {
        "available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}
    assert fields(pb.ContainerPreferredAllocationResponse) == {"deviceIDs": 1}
    assert fields(pb.ContainerAllocateRequest) == {"devices_ids": 1}
    assert fields(pb.AllocateRequest) == {"container_requests": 1}
    assert fields(pb.ContainerAllocateResponse) == {"envs": 1, "mounts": 2, "devices": 3,
                                                    "annotations": 4, "cdi_devices": 5}
    assert fields(pb.Mount) == {"container_path": 1, "host_path": 2, "read_only": 3}
    assert fields(pb.PreStartContainerRequest) == {"devices_ids": 1}


def test_committed_modules_are_generated_from_the_proto(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"--python_out={tmp_path}",
         str(PROTO / "api.proto")],
        check=True,
    )
    fresh = (tmp_path / "api_pb2.py").read_text()
    committed = (PROTO / "api_pb2.py").read_text()

    def descriptor_line(text: str) -> str:
        return next(line for line in text.splitlines() if "AddSerializedFile" in line)

    assert descriptor_line(fresh) == descriptor_line(committed), (
        "api_pb2.py is stale: run scripts/gen_proto.sh")


def test_dra_wire_format_is_the_kubelets():
    """dra_v1.proto and pluginregistration_v1.proto are upstream's (k8s.io/kubelet v0.37.2):
    the packages give the gRPC method paths the kubelet calls."""
    from sharegpu.agent.proto import dra_v1_pb2 as dra
    from sharegpu.agent.proto import pluginregistration_v1_pb2 as reg

    assert dra.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    svc = dra.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert svc.full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert [m.name for m in svc.methods] == ["NodePrepareResources", "NodeUnprepareResources"]
    assert fields(dra.Claim) == {"namespace": 1, "uid": 2, "name": 3}
    assert fields(dra.NodePrepareResourcesRequest) == {"claims": 1}
    assert fields(dra.NodePrepareResourcesResponse) == {"claims": 1}
    assert fields(dra.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
    assert fields(dra.Device) == {"request_names": 1, "pool_name": 2, "device_name": 3,
                                  "cdi_device_ids": 4, "share_id": 5}
    assert fields(dra.NodeUnprepareResourceResponse) == {"error": 1}
    assert reg.DESCRIPTOR.package == "pluginregistration"
    rsvc = reg.DESCRIPTOR.services_by_name["Registration"]
    assert [m.name for m in rsvc.methods] == ["GetInfo", "NotifyRegistrationStatus"]
    assert fields(reg.PluginInfo) == {"type": 1, "name": 2, "endpoint": 3,
                                      "supported_versions": 4}
    assert fields(reg.RegistrationStatus) == {"plugin_registered": 1, "error": 2}


def test_pod_resources_wire_format_is_the_kubelets():
    """podresources_v1.proto is upstream's (k8s.io/kubelet v0.37.2): the method paths the
    kubelet serves on its pod-resources socket, and the fields the agent reads."""
    from sharegpu.agent.proto import podresources_v1_pb2 as pr

    assert pr.DESCRIPTOR.package == "v1"
    svc = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert svc.full_name == "v1.PodResourcesLister"
    assert [m.name for m in svc.methods] == ["List", "GetAllocatableResources", "Get"]
    assert fields(pr.ListPodResourcesResponse) == {"pod_resources": 1}
    assert {k: v for k, v in fields(pr.PodResources).items() if v <= 3} == {
        "name": 1, "namespace": 2, "containers": 3}
    assert {k: v for k, v in fields(pr.ContainerResources).items() if v <= 2} == {
        "name": 1, "devices": 2}
    assert {k: v for k, v in fields(pr.ContainerDevices).items() if v <= 2} == {
        "resource_name": 1, "device_ids": 2}


def test_committed_dra_modules_are_generated_from_the_protos(tmp_path):
    for name in ("dra_v1", "pluginregistration_v1", "podresources_v1"):
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"--python_out={tmp_path}",
             str(PROTO / f"{name}.proto")],
            check=True,
        )
        fresh = (tmp_path / f"{name}_pb2.py").read_text()
        committed = (PROTO / f"{name}_pb2.py").read_text()
        line = lambda text: next(ln for ln in text.splitlines() if "AddSerializedFile" in ln)  # noqa: E731
        assert line(fresh) == line(committed), f"{name}_pb2.py is stale: run scripts/gen_proto.sh"
