// Command sharegpu-controlplane is a multi-call binary (the old hyperkube pattern) holding the
// parts of a Kubernetes control plane that sharegpu's end-to-end tests run on loopback:
//
//	sharegpu-controlplane etcd --data-dir DIR --listen-client-url http://127.0.0.1:PORT --listen-peer-url http://127.0.0.1:PORT
//	sharegpu-controlplane kube-apiserver [flags]
//	sharegpu-controlplane kube-controller-manager [flags]
//	sharegpu-controlplane kube-scheduler [flags]
//	sharegpu-controlplane kubelet [flags]
//	sharegpu-controlplane kube-proxy [flags]
//	sharegpu-controlplane kubelet-devicemanager [flags]
//	sharegpu-controlplane kubelet-dra [flags]
//	sharegpu-controlplane version
//
// The first argument picks the component (or the binary's own name, when it is invoked through a
// symlink of that name); the remaining arguments go to the component unchanged.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"sort"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format, as upstream mains
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as upstream mains
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric, as upstream mains
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

// components maps a component name to the function that runs it with its own arguments and
// returns the process exit code.
var components = map[string]func(args []string) int{
	"etcd":                    runEtcd,
	"kube-apiserver":          cobraMain(apiserver.NewAPIServerCommand),
	"kube-controller-manager": cobraMain(controllermanager.NewControllerManagerCommand),
	"kube-proxy":              cobraMain(proxy.NewProxyCommand),
	"kube-scheduler":          cobraMain(func() *cobra.Command { return scheduler.NewSchedulerCommand() }),
	"kubelet": cobraMain(func() *cobra.Command {
		return kubelet.NewKubeletCommand(context.Background())
	}),
	"kubelet-devicemanager": runKubeletDeviceManager,
	"kubelet-dra":           runKubeletDRA,
	"version":               runVersion,
}

func cobraMain(newCommand func() *cobra.Command) func(args []string) int {
	return func(args []string) int {
		cmd := newCommand()
		cmd.SetArgs(args)
		return cli.Run(cmd)
	}
}

func runVersion([]string) int {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range info.Deps {
			switch dep.Path {
			case "k8s.io/kubernetes", "go.etcd.io/etcd/server/v3":
				fmt.Printf("%s %s\n", dep.Path, dep.Version)
			}
		}
		fmt.Printf("go %s\n", info.GoVersion)
	}
	return 0
}

func usage() {
	names := make([]string, 0, len(components))
	for name := range components {
		names = append(names, name)
	}
	sort.Strings(names)
	fmt.Fprintf(os.Stderr, "usage: %s COMPONENT [ARGS...]\ncomponents: %v\n",
		filepath.Base(os.Args[0]), names)
}

func main() {
	name, args := filepath.Base(os.Args[0]), os.Args[1:]
	run, ok := components[name]
	if !ok {
		if len(args) == 0 {
			usage()
			os.Exit(2)
		}
		name, args = args[0], args[1:]
		if run, ok = components[name]; !ok {
			fmt.Fprintf(os.Stderr, "unknown component %q\n", name)
			usage()
			os.Exit(2)
		}
	}
	os.Exit(run(args))
}
