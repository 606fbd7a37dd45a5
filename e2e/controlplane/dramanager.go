package main

// kubelet-dra: the kubelet's DRA manager (k8s.io/kubernetes/pkg/kubelet/cm/dra, v1.37.2) and its
// plugin watcher (pkg/kubelet/pluginmanager) wired as the kubelet wires them, without the rest of
// the kubelet, so the end-to-end tests drive a DRA kubelet plugin through the kubelet's own code:
//
//	sharegpu-controlplane kubelet-dra --node NODE --kubeconfig FILE --expect-pods N \
//	    --plugins-registry DIR --state-dir DIR [--driver NAME] [--output FILE] \
//	    [--unprepare-trigger FILE --unprepare-output FILE] [--timeout D]
//
//  1. dra.NewManager with a kube client and the checkpoint directory; Start (as
//     pkg/kubelet/cm/container_manager_linux.go does) with the active pods, the node getter and
//     ready sources: this creates the kubelet's DRAPluginManager, which wipes the node's
//     ResourceSlices at start as the kubelet does.
//  2. pluginmanager.NewPluginManager on --plugins-registry with the DRA manager's watcher handler
//     for type DRAPlugin (as pkg/kubelet/kubelet.go does): the plugin watcher finds the
//     registration socket, calls GetInfo, validates and registers the plugin
//     (DRAPluginManager.RegisterPlugin dials the endpoint) and NotifyRegistrationStatus.
//     It waits until --driver is registered.
//  3. The pods bound to NODE come from the kubelet's pod source (podUpdates, as
//     kubelet-devicemanager). Each pod is prepared in its own goroutine as a pod worker does
//     before it starts containers: Manager.PrepareResources (reads the pod's ResourceClaims,
//     checks ReservedFor, calls NodePrepareResources over the plugin's socket, records the
//     answer in the claim-info checkpoint), retried every --retry while it fails (a pod worker
//     retries its sync), then per container Manager.GetResources (the CDI device IDs the
//     runtime gets) and GetContainerClaimInfos (per claim: pool, device, share ID, CDI IDs).
//  4. Once --expect-pods pods are prepared (or --timeout passed) it writes the JSON report.
//  5. With --unprepare-trigger, it then waits for that file, marks the pods terminated and calls
//     Manager.UnprepareResources for each (NodeUnprepareResources over the socket) and writes
//     the second report to --unprepare-output.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	pluginwatcherapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	kubeletdra "k8s.io/kubernetes/pkg/kubelet/cm/dra"
	draplugin "k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	kubetypes "k8s.io/kubernetes/pkg/kubelet/types"
)

type draOptions struct {
	node             string
	kubeconfig       string
	registryDir      string
	stateDir         string
	driver           string
	expectPods       int
	timeout          time.Duration
	retry            time.Duration
	output           string
	unprepareTrigger string
	unprepareOutput  string
}

type draDevice struct {
	Pool         string   `json:"pool"`
	Device       string   `json:"device"`
	ShareID      string   `json:"share_id,omitempty"`
	RequestNames []string `json:"request_names"`
	CDIDeviceIDs []string `json:"cdi_device_ids"`
}

type draClaim struct {
	Name    string      `json:"name"`
	UID     string      `json:"uid"`
	Devices []draDevice `json:"devices"`
}

type draContainer struct {
	Name       string     `json:"name"`
	CDIDevices []string   `json:"cdi_devices"` // what the container runtime is given
	Claims     []draClaim `json:"claims"`
	Error      string     `json:"error,omitempty"`
}

type draPod struct {
	Namespace      string         `json:"namespace"`
	Name           string         `json:"name"`
	UID            string         `json:"uid"`
	Prepared       bool           `json:"prepared"`
	Attempts       int            `json:"attempts"`
	Errors         []string       `json:"errors,omitempty"` // distinct errors of failed attempts
	PrepareMs      float64        `json:"prepare_ms"`       // first attempt to success
	Containers     []draContainer `json:"containers"`
	Unprepared     bool           `json:"unprepared,omitempty"`
	UnprepareError string         `json:"unprepare_error,omitempty"`
}

type draReport struct {
	Node         string             `json:"node"`
	Driver       string             `json:"driver"`
	Registered   string             `json:"registered"` // the driver name the plugin manager holds
	RegisteredMs float64            `json:"registered_ms"`
	Pods         []draPod           `json:"pods"`
	Seconds      map[string]float64 `json:"seconds"`
}

func runKubeletDRA(args []string) int {
	fs := flag.NewFlagSet("kubelet-dra", flag.ContinueOnError)
	o := draOptions{}
	fs.StringVar(&o.node, "node", "", "the node whose pods are prepared (required)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig (required)")
	fs.StringVar(&o.registryDir, "plugins-registry", "/var/lib/kubelet/plugins_registry",
		"the plugin watcher's directory (registration sockets)")
	fs.StringVar(&o.stateDir, "state-dir", "", "the DRA manager's checkpoint directory (required)")
	fs.StringVar(&o.driver, "driver", "gpu.sharegpu.io", "wait for this DRA driver to register")
	fs.IntVar(&o.expectPods, "expect-pods", 0, "report once this many pods were prepared (required)")
	fs.DurationVar(&o.timeout, "timeout", 120*time.Second, "give up after this long")
	fs.DurationVar(&o.retry, "retry", 200*time.Millisecond, "pause between prepare attempts of a pod")
	fs.StringVar(&o.output, "output", "", "write the JSON report here (default: stdout)")
	fs.StringVar(&o.unprepareTrigger, "unprepare-trigger", "", "after the report, wait for this file, then unprepare every pod")
	fs.StringVar(&o.unprepareOutput, "unprepare-output", "", "the report after unprepare")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	fs.Var(klogFlagValue{klogFlags, "v"}, "v", "log verbosity (klog)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if o.node == "" || o.kubeconfig == "" || o.stateDir == "" || o.expectPods < 1 || fs.NArg() != 0 ||
		(o.unprepareTrigger == "") != (o.unprepareOutput == "") {
		fmt.Fprintln(os.Stderr, "kubelet-dra: --node, --kubeconfig, --state-dir and --expect-pods are required; "+
			"--unprepare-trigger and --unprepare-output go together")
		fs.Usage()
		return 2
	}
	if err := runDRAManager(o); err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-dra: %v\n", err)
		return 1
	}
	return 0
}

func runDRAManager(o draOptions) error {
	t0 := time.Now()
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, o.timeout)
	defer cancelTimeout()
	logger := klog.FromContext(ctx)

	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(o.stateDir, 0o750); err != nil {
		return err
	}
	mgr, err := kubeletdra.NewManager(logger, client, o.stateDir)
	if err != nil {
		return err
	}
	pods := &podManager{pods: map[string]*v1.Pod{}, rejected: sets.New[string]()}
	getNode := func(ctx context.Context) (*v1.Node, error) {
		return client.CoreV1().Nodes().Get(ctx, o.node, metav1.GetOptions{})
	}
	if err := mgr.Start(ctx, pods.active, getNode, readySources{}); err != nil {
		return fmt.Errorf("DRA manager: %w", err)
	}
	defer mgr.Stop()

	// the kubelet's plugin watcher, with the DRA manager's handler for DRA plugins
	pm := pluginmanager.NewPluginManager(o.registryDir, &record.FakeRecorder{})
	pm.AddHandler(pluginwatcherapi.DRAPlugin, mgr.GetWatcherHandler())
	go pm.Run(ctx, readySources{}, ctx.Done())

	plugins, ok := mgr.GetWatcherHandler().(*draplugin.DRAPluginManager)
	if !ok {
		return fmt.Errorf("the DRA watcher handler is a %T, not a DRAPluginManager", mgr.GetWatcherHandler())
	}
	report := draReport{Node: o.node, Driver: o.driver, Seconds: map[string]float64{}}
	for {
		if p, err := plugins.GetPlugin(o.driver); err == nil {
			report.Registered = p.DriverName()
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("DRA driver %s did not register through %s within %s", o.driver, o.registryDir, o.timeout)
		case <-time.After(50 * time.Millisecond):
		}
	}
	report.RegisteredMs = float64(time.Since(t0).Microseconds()) / 1000
	fmt.Fprintf(os.Stderr, "kubelet-dra: DRA driver %s registered (%.0f ms)\n", o.driver, report.RegisteredMs)

	updates, err := podUpdates(ctx, dmOptions{node: o.node, kubeconfig: o.kubeconfig})
	if err != nil {
		return err
	}
	var (
		mu      sync.Mutex
		results = map[string]*draPod{}
		wg      sync.WaitGroup
		done    = make(chan struct{}, 1024)
	)
	prepare := func(pod *v1.Pod) {
		defer wg.Done()
		r := &draPod{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID)}
		start := time.Now()
		seen := sets.New[string]()
		for {
			r.Attempts++
			err := mgr.PrepareResources(ctx, pod)
			if err == nil {
				r.Prepared = true
				break
			}
			if !seen.Has(err.Error()) {
				seen.Insert(err.Error())
				r.Errors = append(r.Errors, err.Error())
			}
			select {
			case <-ctx.Done():
			case <-time.After(o.retry):
				continue
			}
			break
		}
		r.PrepareMs = float64(time.Since(start).Microseconds()) / 1000
		if r.Prepared {
			for i := range pod.Spec.Containers {
				r.Containers = append(r.Containers, containerClaims(mgr, pod, &pod.Spec.Containers[i]))
			}
		}
		mu.Lock()
		results[r.UID] = r
		mu.Unlock()
		done <- struct{}{}
	}
	started := sets.New[string]()
	finished := 0
	var tFirst time.Time
wait:
	for finished < o.expectPods {
		select {
		case <-ctx.Done():
			break wait
		case <-done:
			finished++
		case u := <-updates:
			switch u.Op {
			case kubetypes.ADD, kubetypes.UPDATE, kubetypes.RECONCILE:
			default:
				continue
			}
			for _, pod := range u.Pods {
				if started.Has(string(pod.UID)) || len(pod.Spec.ResourceClaims) == 0 {
					pods.update([]*v1.Pod{pod})
					continue
				}
				if tFirst.IsZero() {
					tFirst = time.Now()
				}
				started.Insert(string(pod.UID))
				pods.add(pod)
				wg.Add(1)
				go prepare(pod)
			}
		}
	}
	wg.Wait()
	if !tFirst.IsZero() {
		report.Seconds["first_pod_to_last_prepared"] = time.Since(tFirst).Seconds()
	}
	report.Pods = sortedPods(results)
	if err := writeJSON(o.output, report); err != nil {
		return err
	}
	if o.unprepareTrigger == "" {
		return nil
	}
	for {
		if _, err := os.Stat(o.unprepareTrigger); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s did not appear within %s", o.unprepareTrigger, o.timeout)
		case <-time.After(50 * time.Millisecond):
		}
	}
	tUnprepare := time.Now()
	all := pods.active()
	for _, pod := range all {
		pods.reject(pod) // terminated: no longer active
	}
	for _, pod := range all {
		wg.Add(1)
		go func(pod *v1.Pod) {
			defer wg.Done()
			err := mgr.UnprepareResources(ctx, pod)
			mu.Lock()
			defer mu.Unlock()
			r := results[string(pod.UID)]
			if r == nil {
				return
			}
			if err != nil {
				r.UnprepareError = err.Error()
			} else {
				r.Unprepared = true
			}
		}(pod)
	}
	wg.Wait()
	report.Seconds["unprepare"] = time.Since(tUnprepare).Seconds()
	report.Pods = sortedPods(results)
	return writeJSON(o.unprepareOutput, report)
}

// containerClaims is what the kubelet hands the runtime for one container (its CDI devices) and
// the claims behind them, from the DRA manager's claim-info cache.
func containerClaims(mgr *kubeletdra.Manager, pod *v1.Pod, c *v1.Container) draContainer {
	out := draContainer{Name: c.Name, CDIDevices: []string{}, Claims: []draClaim{}}
	info, err := mgr.GetResources(pod, c)
	if err != nil {
		out.Error = err.Error()
		return out
	}
	for _, d := range info.CDIDevices {
		out.CDIDevices = append(out.CDIDevices, d.Name)
	}
	claims, err := mgr.GetContainerClaimInfos(pod, c)
	if err != nil {
		out.Error = err.Error()
		return out
	}
	for _, ci := range claims {
		dc := draClaim{Name: ci.ClaimName, UID: string(ci.ClaimUID), Devices: []draDevice{}}
		drivers := make([]string, 0, len(ci.DriverState))
		for name := range ci.DriverState {
			drivers = append(drivers, name)
		}
		sort.Strings(drivers)
		for _, name := range drivers {
			for _, d := range ci.DriverState[name].Devices {
				dd := draDevice{Pool: d.PoolName, Device: d.DeviceName, RequestNames: d.RequestNames,
					CDIDeviceIDs: d.CDIDeviceIDs}
				if d.ShareID != nil {
					dd.ShareID = string(*d.ShareID)
				}
				dc.Devices = append(dc.Devices, dd)
			}
		}
		out.Claims = append(out.Claims, dc)
	}
	return out
}

func sortedPods(results map[string]*draPod) []draPod {
	out := make([]draPod, 0, len(results))
	for _, r := range results {
		out = append(out, *r)
	}
	sort.Slice(out, func(i, j int) bool {
		return out[i].Namespace+"/"+out[i].Name < out[j].Namespace+"/"+out[j].Name
	})
	return out
}

// writeJSON writes v to path (through a temporary file and a rename), or to stdout.
func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", " ")
	if err != nil {
		return err
	}
	data = append(data, '\n')
	if path == "" {
		_, err = os.Stdout.Write(data)
		return err
	}
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
