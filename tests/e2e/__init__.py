"""End-to-end tests against a real Kubernetes control plane (kube-apiserver, etcd,
kube-controller-manager, kube-scheduler built from their Go modules)."""
