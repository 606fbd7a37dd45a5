"""The sharegpu node agent (``sharegpu agent``): kubelet device plugins for every GPU resource,
live mode switching, card-model labels, per-container allocation and isolation, GPU health.

Modules: ``nvml`` (GPU discovery, fake and real), ``devices`` (what each resource advertises),
``allocate`` (matching kubelet requests to pod containers; pure), ``isolation`` (env and mounts
per back-end), ``kube`` (the API interface and an in-memory one), ``lightkube_api`` (production
API client), ``plugin`` (gRPC servers), ``service`` (the agent), ``metrics``; DRA mode's
kubelet plugin: ``draplugin`` (gRPC), ``draclaim`` (a claim's allocation; pure), ``cdi``
(CDI specs).
"""

from .service import Agent, AgentConfig

__all__ = ["Agent", "AgentConfig"]
