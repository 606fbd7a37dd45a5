"""The sharegpu node agent (``sharegpu agent``): kubelet device plugins for every GPU resource,
live mode switching, card-model labels, per-container allocation and isolation, GPU health, and
in DRA mode a ResourceSlice and the DRA kubelet plugin. :mod:`.builder` builds it from its
parts (docs/architecture.md names each part's module). Importing the package loads nothing:
its command starts without gRPC until it runs.
"""
