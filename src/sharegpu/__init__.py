"""sharegpu: GPU sharing for Kubernetes.

The core (domain, cluster state, placement) is pure: it does no I/O. Adapters at the edge
(simulator, extender, device plugin, CLI) drive the same core code.
"""

__version__ = "0.2.0.dev0"
