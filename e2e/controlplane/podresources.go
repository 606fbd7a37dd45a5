package main

// The kubelet's pod-resources API (v1, and v1alpha1 beside it as the kubelet serves both) for
// kubelet-devicemanager --pod-resources-socket: upstream's server
// (k8s.io/kubernetes/pkg/kubelet/apis/podresources NewV1PodResourcesServer) behind the same
// gRPC server as pkg/kubelet/server ListenAndServePodResources (its rate limiter: 100 QPS, burst
// 10, ResourceExhausted beyond), on a unix socket made by the kubelet's listener helper. Its
// providers are the harness's: the pod manager for the pods (List uses GetActivePods, as the
// kubelet's default KubeletPodResourcesListUseActivePods gate does), the device manager for the
// devices, and none for CPUs, memory and dynamic resources (no such managers run here).

import (
	"context"
	"fmt"
	"os"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/cri-client/pkg/util"
	"k8s.io/klog/v2"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
	podresourcesapiv1alpha1 "k8s.io/kubelet/pkg/apis/podresources/v1alpha1"
	apisgrpc "k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

// servePodResources serves the pod-resources API on the unix socket at path (an existing file
// there is replaced, as the kubelet does) until stop is called.
func servePodResources(ctx context.Context, path string, pods podresources.PodsProvider,
	dm *devicemanager.ManagerImpl) (stop func(), err error) {
	providers := podresources.PodResourcesProviders{
		Pods:             pods,
		Devices:          devicesProvider{dm},
		Cpus:             noResources{},
		Memory:           noResources{},
		DynamicResources: noResources{},
	}
	server := grpc.NewServer(apisgrpc.WithRateLimiter(ctx, "podresources", podresources.DefaultQPS, podresources.DefaultBurstTokens))
	podresourcesapiv1alpha1.RegisterPodResourcesListerServer(server, podresources.NewV1alpha1PodResourcesServer(providers))
	podresourcesapi.RegisterPodResourcesListerServer(server, podresources.NewV1PodResourcesServer(ctx, providers))
	l, err := util.CreateListener("unix://" + path)
	if err != nil {
		return nil, fmt.Errorf("--pod-resources-socket %s: %w", path, err)
	}
	go func() {
		if err := server.Serve(l); err != nil {
			fmt.Fprintf(os.Stderr, "kubelet-devicemanager: serving the pod-resources API on %s: %v\n", path, err)
		}
	}()
	return func() {
		server.Stop()
		_ = os.Remove(path)
	}, nil
}

// devicesProvider is the device manager seen as the container manager shows it to the
// pod-resources server (pkg/kubelet/cm containerManagerImpl GetDevices, GetAllocatableDevices,
// UpdateAllocatedDevices).
type devicesProvider struct{ dm *devicemanager.ManagerImpl }

func (d devicesProvider) UpdateAllocatedDevices(logger klog.Logger) {
	d.dm.UpdateAllocatedDevices(logger)
}

func (d devicesProvider) GetDevices(podUID, containerName string) []*podresourcesapi.ContainerDevices {
	return containerDevices(d.dm.GetDevices(podUID, containerName))
}

func (d devicesProvider) GetAllocatableDevices(logger klog.Logger) []*podresourcesapi.ContainerDevices {
	return containerDevices(d.dm.GetAllocatableDevices(logger))
}

// containerDevices is pkg/kubelet/cm's containerDevicesFromResourceDeviceInstances (unexported
// there): one entry per device, or per device and NUMA node when the plugin gave a topology.
func containerDevices(devs devicemanager.ResourceDeviceInstances) []*podresourcesapi.ContainerDevices {
	var out []*podresourcesapi.ContainerDevices
	for resourceName, resourceDevs := range devs {
		for devID, dev := range resourceDevs {
			topo := dev.GetTopology()
			if topo == nil {
				out = append(out, &podresourcesapi.ContainerDevices{ResourceName: resourceName, DeviceIds: []string{devID}})
				continue
			}
			for _, node := range topo.GetNodes() {
				out = append(out, &podresourcesapi.ContainerDevices{
					ResourceName: resourceName,
					DeviceIds:    []string{devID},
					Topology:     &podresourcesapi.TopologyInfo{Nodes: []*podresourcesapi.NUMANode{{ID: node.GetID()}}},
				})
			}
		}
	}
	return out
}

// noResources is the CPU, memory and dynamic-resources provider of a node without those managers.
type noResources struct{}

func (noResources) GetCPUs(*v1.Pod, *v1.Container) []int64 { return nil }
func (noResources) GetPodCPUs(string) []int64              { return nil }
func (noResources) GetAllocatableCPUs() []int64            { return nil }

func (noResources) GetMemory(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesapi.ContainerMemory {
	return nil
}
func (noResources) GetPodMemory(klog.Logger, string) []*podresourcesapi.ContainerMemory { return nil }
func (noResources) GetAllocatableMemory(klog.Logger) []*podresourcesapi.ContainerMemory {
	return nil
}

func (noResources) GetDynamicResources(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesapi.DynamicResource {
	return nil
}
