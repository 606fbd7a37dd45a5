package main

import (
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// runEtcd runs a single-member embedded etcd until SIGTERM or SIGINT. It only listens on
// loopback addresses: a non-loopback URL is refused.
func runEtcd(args []string) int {
	fs := flag.NewFlagSet("etcd", flag.ContinueOnError)
	dataDir := fs.String("data-dir", "", "directory for etcd's data (required)")
	clientURL := fs.String("listen-client-url", "http://127.0.0.1:2379", "URL to serve clients on (loopback)")
	peerURL := fs.String("listen-peer-url", "http://127.0.0.1:2380", "URL to serve the (only) peer on (loopback)")
	name := fs.String("name", "sharegpu-e2e", "member name")
	logLevel := fs.String("log-level", "warn", "debug, info, warn or error")
	quotaBytes := fs.Int64("quota-backend-bytes", 2<<30, "backend size quota in bytes")
	startTimeout := fs.Duration("start-timeout", 60*time.Second, "how long to wait for the server to be ready")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *dataDir == "" || fs.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "etcd: --data-dir is required and no positional arguments are taken")
		fs.Usage()
		return 2
	}
	client, err := loopbackURL(*clientURL)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: --listen-client-url: %v\n", err)
		return 2
	}
	peer, err := loopbackURL(*peerURL)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: --listen-peer-url: %v\n", err)
		return 2
	}

	cfg := embed.NewConfig()
	cfg.Name = *name
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*client}
	cfg.AdvertiseClientUrls = []url.URL{*client}
	cfg.ListenPeerUrls = []url.URL{*peer}
	cfg.AdvertisePeerUrls = []url.URL{*peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.ListenMetricsUrls = nil
	cfg.Logger = "zap"
	cfg.LogLevel = *logLevel
	cfg.LogOutputs = []string{"stderr"}
	cfg.QuotaBackendBytes = *quotaBytes

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: start: %v\n", err)
		return 1
	}
	defer e.Close()

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)

	select {
	case <-e.Server.ReadyNotify():
		fmt.Fprintf(os.Stderr, "etcd: ready, serving clients on %s\n", client.String())
	case <-time.After(*startTimeout):
		fmt.Fprintf(os.Stderr, "etcd: not ready after %s\n", *startTimeout)
		e.Server.Stop()
		return 1
	case sig := <-signals:
		fmt.Fprintf(os.Stderr, "etcd: %s before ready, stopping\n", sig)
		return 0
	}

	select {
	case err := <-e.Err():
		fmt.Fprintf(os.Stderr, "etcd: %v\n", err)
		return 1
	case <-e.Server.StopNotify():
		fmt.Fprintln(os.Stderr, "etcd: server stopped")
		return 1
	case sig := <-signals:
		fmt.Fprintf(os.Stderr, "etcd: %s, stopping\n", sig)
		return 0
	}
}

// loopbackURL parses an http URL whose host is a loopback IP address.
func loopbackURL(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, err
	}
	if u.Scheme != "http" {
		return nil, fmt.Errorf("%q: only http:// is supported", raw)
	}
	host, _, err := net.SplitHostPort(u.Host)
	if err != nil {
		return nil, fmt.Errorf("%q: %w", raw, err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return nil, fmt.Errorf("%q: host must be a loopback IP address", raw)
	}
	return u, nil
}
