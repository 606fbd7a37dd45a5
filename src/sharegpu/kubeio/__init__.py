"""What the adapters share to talk to Kubernetes: kubeconfig, Events, asyncio, logging."""
