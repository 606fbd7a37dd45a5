package main

// kubelet-devicemanager: the kubelet's device manager (k8s.io/kubernetes/pkg/kubelet/cm/
// devicemanager, v1.37.2) wired as the kubelet wires it, without the rest of the kubelet, so the
// end-to-end tests drive a device plugin through the kubelet's own code:
//
//	sharegpu-controlplane kubelet-devicemanager --node NODE --kubeconfig FILE --expect-pods N \
//	    [--device-plugin-dir DIR] [--wait-resources R,...] [--pod-resources-socket PATH] \
//	    [--output FILE] [--timeout D]
//
//  1. devicemanager.NewManagerImpl with a "none"-policy topology manager
//     (topologymanager.NewManager with the kubelet's default policy) and the device manager added
//     to it as a hint provider, as pkg/kubelet/cm/container_manager_linux.go does; Start serves
//     the Registration service on kubelet.sock (after removing, as the kubelet does, every
//     socket in the directory, so running plugins see a kubelet restart).
//     With --pod-resources-socket it then serves the kubelet's pod-resources API (v1 and
//     v1alpha1, upstream's server; podresources.go) on PATH, its pods the pod manager's (a pod is
//     added to it before its admission, as HandlePodAdditions does; rejected and terminal pods
//     are not active) and its devices the device manager's.
//  2. Plugins register; it waits until every --wait-resources resource (at least one) has
//     healthy devices from ListAndWatch.
//  3. The pods come from the kubelet's own pod source (pkg/kubelet/config: NewSourceApiserver, a
//     reflector on the pods with spec.nodeName=NODE, merged by PodConfig): pods already bound
//     arrive as one ADD update (what a kubelet (re)start sees), pods bound later one watch event
//     at a time. Each ADD is handled as HandlePodAdditions does: sort.Sort with
//     sliceutils.PodsByCreationTime, then one pod at a time added to the pod manager and
//     admitted through the topology manager's Admit (the kubelet's resource-allocating admit
//     handler), which calls the device manager's Allocate for each init and app container:
//     GetPreferredAllocation and Allocate over gRPC to the plugin. (--pods-file: one ADD with the
//     file's pods instead.) The kubelet's other admit handlers (node resources fit, etc.) do not
//     run.
//  4. Each admitted pod then starts in its own goroutine as a pod worker would, beside the
//     admission of later pods: GetDeviceRunContainerOptions per container, in order.
//  5. Once --expect-pods pods were handled it prints one JSON report: the ADD batches, the
//     admission order, per container the merged run options (envs, mounts, devices,
//     annotations), the plugin device IDs per resource and each resource's own
//     ContainerAllocateResponse, read back from the device manager's checkpoint.
//
// The device manager only knows the fixed socket path /var/lib/kubelet/device-plugins/
// kubelet.sock (pluginapi.KubeletSocket; the kubelet's --root-dir does not move it). With another
// --device-plugin-dir the component re-executes itself in a private mount namespace (root only)
// where that directory is bind-mounted on /var/lib/kubelet/device-plugins (over a tmpfs on
// /var/lib, so nothing on the host changes); sockets it creates there are the directory's on the
// host, and a plugin outside the namespace reaches them at DIR.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/checkpointmanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/checkpoint"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
	kubetypes "k8s.io/kubernetes/pkg/kubelet/types"
	"k8s.io/kubernetes/pkg/kubelet/util/sliceutils"
)

const (
	kubeletCheckpoint = "kubelet_internal_checkpoint" // the device manager's checkpoint file
	namespacedEnv     = "SHAREGPU_DEVICEMANAGER_NAMESPACED"
)

type dmOptions struct {
	node          string
	kubeconfig    string
	podsFile      string
	pluginDir     string
	expectPods    int
	waitResources string
	timeout       time.Duration
	output        string
	linger        time.Duration
	podResources  string
}

// dmContainer is what one container got.
type dmContainer struct {
	Name        string                     `json:"name"`
	Init        bool                       `json:"init,omitempty"`
	Envs        map[string]string          `json:"envs"`
	Mounts      []dmMount                  `json:"mounts"`
	Devices     []string                   `json:"devices"` // host paths of device nodes
	Annotations map[string]string          `json:"annotations"`
	DeviceIDs   map[string][]string        `json:"device_ids"` // resource -> plugin device IDs
	Responses   map[string]json.RawMessage `json:"responses"`  // resource -> ContainerAllocateResponse
	Error       string                     `json:"error,omitempty"`
}

type dmMount struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	ReadOnly      bool   `json:"read_only"`
}

type dmPod struct {
	Namespace  string        `json:"namespace"`
	Name       string        `json:"name"`
	UID        string        `json:"uid"`
	Created    string        `json:"created"`
	Admitted   bool          `json:"admitted"`
	Reason     string        `json:"reason,omitempty"`
	Message    string        `json:"message,omitempty"`
	AdmitMs    float64       `json:"admit_ms"`
	Containers []dmContainer `json:"containers"`
}

type dmReport struct {
	Node           string             `json:"node"`
	SocketDir      string             `json:"socket_dir"`
	Order          string             `json:"order"`
	Capacity       map[string]int64   `json:"capacity"`    // resource -> devices (healthy + not)
	Allocatable    map[string]int64   `json:"allocatable"` // resource -> healthy devices
	AdmissionOrder []string           `json:"admission_order"`
	Batches        [][]string         `json:"batches"` // the pods of each ADD update, as delivered
	Pods           []dmPod            `json:"pods"`
	Seconds        map[string]float64 `json:"seconds"`
	PodResources   string             `json:"pod_resources_socket,omitempty"` // where the pod-resources API was served
}

func runKubeletDeviceManager(args []string) int {
	fs := flag.NewFlagSet("kubelet-devicemanager", flag.ContinueOnError)
	o := dmOptions{}
	fs.StringVar(&o.node, "node", "", "the node whose pods are admitted (required)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig to list the node's pods with")
	fs.StringVar(&o.podsFile, "pods-file", "", "a JSON PodList (or list of pods) instead of the API server")
	fs.StringVar(&o.pluginDir, "device-plugin-dir", pluginapi.DevicePluginPath,
		"the device-plugin directory (kubelet.sock, the plugins' sockets, the checkpoint)")
	fs.IntVar(&o.expectPods, "expect-pods", 0, "report once this many pods were admitted or rejected (required)")
	fs.StringVar(&o.waitResources, "wait-resources", "",
		"comma-separated resources that must have healthy devices before the pods are taken (default: any one)")
	fs.DurationVar(&o.timeout, "timeout", 120*time.Second, "give up waiting for devices or pods after this long")
	fs.StringVar(&o.output, "output", "", "write the JSON report here (default: stdout)")
	fs.DurationVar(&o.linger, "linger", 0, "keep serving kubelet.sock this long after the report")
	fs.StringVar(&o.podResources, "pod-resources-socket", "",
		"serve the kubelet's pod-resources API (v1) on this unix socket, from before the pods are taken")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	fs.Var(klogFlagValue{klogFlags, "v"}, "v", "log verbosity (klog)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if o.node == "" || o.expectPods < 1 || (o.kubeconfig == "") == (o.podsFile == "") || fs.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "kubelet-devicemanager: --node, --expect-pods and exactly one of --kubeconfig and --pods-file are required")
		fs.Usage()
		return 2
	}
	dir, err := filepath.Abs(o.pluginDir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-devicemanager: --device-plugin-dir: %v\n", err)
		return 2
	}
	if o.podResources != "" {
		if o.podResources, err = filepath.Abs(o.podResources); err != nil {
			fmt.Fprintf(os.Stderr, "kubelet-devicemanager: --pod-resources-socket: %v\n", err)
			return 2
		}
		// the private namespace of another --device-plugin-dir has a tmpfs on /var/lib: a
		// socket there would be out of every client's sight
		varLib := filepath.Dir(filepath.Dir(filepath.Clean(pluginapi.DevicePluginPath)))
		if filepath.Clean(dir) != filepath.Clean(pluginapi.DevicePluginPath) &&
			strings.HasPrefix(o.podResources, varLib+string(filepath.Separator)) {
			fmt.Fprintf(os.Stderr, "kubelet-devicemanager: --pod-resources-socket %s: must not be under %s "+
				"with --device-plugin-dir %s (a private tmpfs covers %s there)\n", o.podResources, varLib, dir, varLib)
			return 2
		}
	}
	if filepath.Clean(dir) != filepath.Clean(pluginapi.DevicePluginPath) && os.Getenv(namespacedEnv) == "" {
		return reexecNamespaced(dir)
	}
	if os.Getenv(namespacedEnv) != "" {
		if err := bindPluginDir(os.Getenv(namespacedEnv)); err != nil {
			fmt.Fprintf(os.Stderr, "kubelet-devicemanager: %v\n", err)
			return 1
		}
	}
	o.pluginDir = dir
	if err := runDeviceManager(o); err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-devicemanager: %v\n", err)
		return 1
	}
	return 0
}

// klogFlagValue exposes one klog flag in another FlagSet.
type klogFlagValue struct {
	fs   *flag.FlagSet
	name string
}

func (k klogFlagValue) String() string {
	if k.fs == nil {
		return ""
	}
	return k.fs.Lookup(k.name).Value.String()
}

func (k klogFlagValue) Set(s string) error { return k.fs.Set(k.name, s) }

// reexecNamespaced runs this command again in a new mount namespace (os/exec makes the child's
// mounts private) and passes its exit status on; SIGTERM and SIGINT are forwarded.
func reexecNamespaced(dir string) int {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-devicemanager: %v\n", err)
		return 1
	}
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), namespacedEnv+"="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-devicemanager: a private mount namespace for --device-plugin-dir %s "+
			"needs root (CAP_SYS_ADMIN), or use the kubelet's own %s: %v\n", dir, pluginapi.DevicePluginPath, err)
		return 1
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()
	err := cmd.Wait()
	signal.Stop(sigs)
	if exit, ok := err.(*exec.ExitError); ok {
		return exit.ExitCode()
	} else if err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-devicemanager: %v\n", err)
		return 1
	}
	return 0
}

// bindPluginDir puts dir on the kubelet's fixed device-plugin path inside this (private) mount
// namespace: a tmpfs on /var/lib holds the mount point, so the host's /var/lib is untouched.
func bindPluginDir(dir string) error {
	target := filepath.Clean(pluginapi.DevicePluginPath)
	varLib := filepath.Dir(filepath.Dir(target)) // /var/lib
	if err := os.MkdirAll(varLib, 0o755); err != nil {
		return err
	}
	if err := syscall.Mount("tmpfs", varLib, "tmpfs", 0, "mode=0755"); err != nil {
		return fmt.Errorf("mounting a tmpfs on %s in the private namespace: %w", varLib, err)
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return err
	}
	if err := syscall.Mount(dir, target, "", syscall.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind-mounting %s on %s: %w", dir, target, err)
	}
	return nil
}

func runDeviceManager(o dmOptions) error {
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	logger := klog.FromContext(ctx)
	t0 := time.Now()
	seconds := map[string]float64{}

	// As pkg/kubelet/cm/container_manager_linux.go: the topology manager (default policy
	// "none"), the device manager with it as affinity store, the device manager as hint provider.
	tm, err := topologymanager.NewManager(logger, nil, topologymanager.PolicyNone, topologymanager.ContainerTopologyScope, nil)
	if err != nil {
		return fmt.Errorf("topology manager: %w", err)
	}
	dm, err := devicemanager.NewManagerImpl(logger, nil, tm)
	if err != nil {
		return fmt.Errorf("device manager: %w", err)
	}
	tm.AddHintProvider(logger, dm)

	// The pod manager: every pod the source delivered is active unless admission rejected it.
	pm := &podManager{pods: map[string]*v1.Pod{}, rejected: sets.New[string]()}
	if err := dm.Start(logger, devicemanager.ActivePodsFunc(pm.active), readySources{},
		containermap.NewContainerMap(), sets.New[string]()); err != nil {
		return fmt.Errorf("starting the device manager: %w", err)
	}
	defer func() { _ = dm.Stop(logger) }()
	fmt.Fprintf(os.Stderr, "kubelet-devicemanager: serving %s (device-plugin dir %s)\n", pluginapi.KubeletSocket, o.pluginDir)
	if o.podResources != "" {
		stop, err := servePodResources(ctx, o.podResources, pm, dm)
		if err != nil {
			return err
		}
		defer stop()
		fmt.Fprintf(os.Stderr, "kubelet-devicemanager: serving the pod-resources API on %s\n", o.podResources)
	}

	// The plugins register and list their devices before the pods come (the kubelet gives no
	// such guarantee after a restart: a pod admitted before its plugin is back is rejected).
	deadline := time.Now().Add(o.timeout)
	want := sets.New[string]()
	for _, r := range strings.Split(o.waitResources, ",") {
		if r = strings.TrimSpace(r); r != "" {
			want.Insert(r)
		}
	}
	for {
		ready := sets.New[string]()
		for r, devs := range dm.GetAllocatableDevices(logger) {
			if len(devs) > 0 {
				ready.Insert(r)
			}
		}
		if ready.IsSuperset(want) && ready.Len() > 0 {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("no healthy devices for %v after %v (registered with devices: %v)",
				sets.List(want.Difference(ready)), o.timeout, sets.List(ready))
		}
		time.Sleep(50 * time.Millisecond)
	}
	seconds["devices_ready"] = time.Since(t0).Seconds()
	capacity, allocatable, _ := dm.GetCapacity(logger)
	fmt.Fprintf(os.Stderr, "kubelet-devicemanager: devices ready %v; taking the pods of node %s\n", quantities(allocatable), o.node)

	// The kubelet's pod source: a reflector on the node's pods feeding PodConfig, whose ADD
	// updates go to HandlePodAdditions. The pods already bound come as one ADD (a kubelet
	// (re)start); pods bound later come one watch event at a time.
	updates, err := podUpdates(ctx, o)
	if err != nil {
		return err
	}
	report := dmReport{
		Node: o.node, SocketDir: o.pluginDir,
		Order:    "the kubelet's: each ADD update from its pod source sorted with sort.Sort(sliceutils.PodsByCreationTime) and admitted one pod at a time (topology manager Admit -> device manager Allocate); admitted pods start concurrently (GetDeviceRunContainerOptions)",
		Capacity: quantities(capacity), Allocatable: quantities(allocatable), Seconds: seconds,
		PodResources: o.podResources,
	}
	var results []*dmPod
	var admitted []*v1.Pod
	var wg sync.WaitGroup
	var tFirst time.Time
	synced := false
	var admitting time.Duration
	for len(results) < o.expectPods {
		var u kubetypes.PodUpdate
		select {
		case u = <-updates:
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Until(deadline)):
			return fmt.Errorf("%d of %d pods of node %s admitted after %v", len(results), o.expectPods, o.node, o.timeout)
		}
		if !synced {
			// the source's first update: the pods bound so far (an empty ADD when none)
			synced = true
			fmt.Fprintf(os.Stderr, "kubelet-devicemanager: pod source synced with %d pod(s) bound to %s\n", len(u.Pods), o.node)
		}
		switch u.Op {
		case kubetypes.ADD:
		case kubetypes.UPDATE, kubetypes.RECONCILE:
			pm.update(u.Pods)
			continue
		default:
			continue
		}
		if len(u.Pods) == 0 {
			continue
		}
		if tFirst.IsZero() {
			tFirst = time.Now()
		}
		// HandlePodAdditions
		start := time.Now()
		pods := u.Pods
		sort.Sort(sliceutils.PodsByCreationTime(pods))
		batch := make([]string, 0, len(pods))
		for _, pod := range pods {
			pm.add(pod)
			batch = append(batch, pod.Namespace+"/"+pod.Name)
			if pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
				continue
			}
			report.AdmissionOrder = append(report.AdmissionOrder, pod.Namespace+"/"+pod.Name)
			t := time.Now()
			res := tm.Admit(ctx, &lifecycle.PodAdmitAttributes{Pod: pod, OtherPods: admitted, Operation: lifecycle.AddOperation})
			r := &dmPod{
				Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID),
				Created: pod.CreationTimestamp.UTC().Format(time.RFC3339), Admitted: res.Admit,
				Reason: res.Reason, Message: res.Message, AdmitMs: float64(time.Since(t).Microseconds()) / 1000,
			}
			results = append(results, r)
			if !res.Admit {
				pm.reject(pod)
				fmt.Fprintf(os.Stderr, "kubelet-devicemanager: pod %s/%s rejected: %s: %s\n", pod.Namespace, pod.Name, res.Reason, res.Message)
				continue
			}
			admitted = append(admitted, pod)
			// the pod worker: starts the pod's containers in order, beside the other pods
			wg.Add(1)
			go func(r *dmPod, pod *v1.Pod) {
				defer wg.Done()
				var cs []dmContainer
				for _, c := range pod.Spec.InitContainers {
					cs = append(cs, runOptions(ctx, dm, pod, c, true))
				}
				for _, c := range pod.Spec.Containers {
					cs = append(cs, runOptions(ctx, dm, pod, c, false))
				}
				r.Containers = cs
			}(r, pod)
		}
		admitting += time.Since(start)
		report.Batches = append(report.Batches, batch)
	}
	wg.Wait()
	seconds["admission"] = admitting.Seconds()
	seconds["first_pod_to_last_started"] = time.Since(tFirst).Seconds()

	if err := addResponses(o.pluginDir, results); err != nil {
		return fmt.Errorf("reading the device manager's checkpoint: %w", err)
	}
	for _, r := range results {
		report.Pods = append(report.Pods, *r)
	}
	seconds["total"] = time.Since(t0).Seconds()

	out := io.Writer(os.Stdout)
	if o.output != "" {
		f, err := os.Create(o.output + ".tmp")
		if err != nil {
			return err
		}
		defer f.Close()
		out = f
	}
	enc := json.NewEncoder(out)
	enc.SetIndent("", " ")
	if err := enc.Encode(report); err != nil {
		return err
	}
	if o.output != "" {
		if err := os.Rename(o.output+".tmp", o.output); err != nil {
			return err
		}
	}
	if o.linger > 0 {
		select {
		case <-ctx.Done():
		case <-time.After(o.linger):
		}
	}
	return nil
}

type readySources struct{}

func (readySources) AddSource(string) {}
func (readySources) AllReady() bool   { return true }

// podManager is the kubelet's pod manager as far as the device manager (activePods) and the
// pod-resources server (podresources.PodsProvider) see it; safe for concurrent use.
type podManager struct {
	mu       sync.Mutex
	pods     map[string]*v1.Pod
	order    []string
	rejected sets.Set[string]
}

func (m *podManager) add(p *v1.Pod) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.pods[string(p.UID)]; !ok {
		m.order = append(m.order, string(p.UID))
	}
	m.pods[string(p.UID)] = p
}

func (m *podManager) update(pods []*v1.Pod) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range pods {
		if _, ok := m.pods[string(p.UID)]; ok {
			m.pods[string(p.UID)] = p
		}
	}
}

func (m *podManager) reject(p *v1.Pod) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.rejected.Insert(string(p.UID))
}

func (m *podManager) active() []*v1.Pod {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]*v1.Pod, 0, len(m.order))
	for _, uid := range m.order {
		p := m.pods[uid]
		if m.rejected.Has(uid) || p.Status.Phase == v1.PodSucceeded || p.Status.Phase == v1.PodFailed {
			continue
		}
		out = append(out, p)
	}
	return out
}

// GetActivePods is the kubelet's GetActivePods: the pods added, less the rejected and terminal.
func (m *podManager) GetActivePods() []*v1.Pod { return m.active() }

// GetPods is every pod added, in the order added.
func (m *podManager) GetPods() []*v1.Pod {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]*v1.Pod, 0, len(m.order))
	for _, uid := range m.order {
		out = append(out, m.pods[uid])
	}
	return out
}

// GetPodByName finds an active pod, as the kubelet's pods provider does.
func (m *podManager) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, p := range m.active() {
		if p.Namespace == namespace && p.Name == name {
			return p, true
		}
	}
	return nil, false
}

type noSLI struct{}

func (noSLI) ObservedPodOnWatch(klog.Logger, *v1.Pod, time.Time) {}

// podUpdates is the kubelet's pod configuration: its API-server source (a reflector on the
// pods with spec.nodeName=NODE) merged by PodConfig; or the file's pods as one ADD.
func podUpdates(ctx context.Context, o dmOptions) (<-chan kubetypes.PodUpdate, error) {
	if o.podsFile != "" {
		data, err := os.ReadFile(o.podsFile)
		if err != nil {
			return nil, err
		}
		var items []v1.Pod
		var list v1.PodList
		if err := json.Unmarshal(data, &list); err == nil && list.Items != nil {
			items = list.Items
		} else if err := json.Unmarshal(data, &items); err != nil {
			return nil, fmt.Errorf("%s: neither a PodList nor a list of pods: %v", o.podsFile, err)
		}
		u := kubetypes.PodUpdate{Op: kubetypes.ADD, Source: kubetypes.FileSource}
		for i := range items {
			if items[i].Spec.NodeName == o.node {
				u.Pods = append(u.Pods, &items[i])
			}
		}
		ch := make(chan kubetypes.PodUpdate, 1)
		ch <- u
		return ch, nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig: %w", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	pc := config.NewPodConfig(&record.FakeRecorder{}, noSLI{})
	config.NewSourceApiserver(klog.FromContext(ctx), client, types.NodeName(o.node),
		func() bool { return true }, pc.Channel(ctx, kubetypes.ApiserverSource))
	return pc.Updates(), nil
}

func runOptions(ctx context.Context, dm *devicemanager.ManagerImpl, pod *v1.Pod, c v1.Container, init bool) dmContainer {
	out := dmContainer{Name: c.Name, Init: init, Envs: map[string]string{}, Mounts: []dmMount{},
		Devices: []string{}, Annotations: map[string]string{}, DeviceIDs: map[string][]string{},
		Responses: map[string]json.RawMessage{}}
	opts, err := dm.GetDeviceRunContainerOptions(ctx, pod, &c)
	if err != nil {
		out.Error = err.Error()
		return out
	}
	if opts != nil {
		for _, e := range opts.Envs {
			out.Envs[e.Name] = e.Value
		}
		for _, m := range opts.Mounts {
			out.Mounts = append(out.Mounts, dmMount{m.ContainerPath, m.HostPath, m.ReadOnly})
		}
		for _, d := range opts.Devices {
			out.Devices = append(out.Devices, d.PathOnHost)
		}
		for _, a := range opts.Annotations {
			out.Annotations[a.Name] = a.Value
		}
	}
	for resource, devs := range dm.GetDevices(string(pod.UID), c.Name) {
		ids := make([]string, 0, len(devs))
		for id := range devs {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		out.DeviceIDs[resource] = ids
	}
	return out
}

// addResponses fills in each resource's own ContainerAllocateResponse from the device manager's
// checkpoint (the run options merge them, hiding a conflict between two resources' answers).
func addResponses(dir string, pods []*dmPod) error {
	cm, err := checkpointmanager.NewCheckpointManager(dir)
	if err != nil {
		return err
	}
	cp := checkpoint.New(nil, nil)
	if err := cm.GetCheckpoint(kubeletCheckpoint, cp); err != nil {
		return err
	}
	entries, _ := cp.GetData()
	type key struct{ pod, container, resource string }
	byKey := map[key][]byte{}
	for _, e := range entries {
		byKey[key{e.PodUID, e.ContainerName, e.ResourceName}] = e.AllocResp
	}
	for i := range pods {
		for j := range pods[i].Containers {
			c := &pods[i].Containers[j]
			for resource := range c.DeviceIDs {
				blob, ok := byKey[key{pods[i].UID, c.Name, resource}]
				if !ok {
					continue
				}
				resp := &pluginapi.ContainerAllocateResponse{}
				if err := proto.Unmarshal(blob, resp); err != nil {
					return fmt.Errorf("pod %s container %s resource %s: %w", pods[i].Name, c.Name, resource, err)
				}
				raw, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(resp)
				if err != nil {
					return err
				}
				c.Responses[resource] = raw
			}
		}
	}
	return nil
}

func quantities(l v1.ResourceList) map[string]int64 {
	out := map[string]int64{}
	for k, v := range l {
		out[string(k)] = v.Value()
	}
	return out
}
