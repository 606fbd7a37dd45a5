"""The core: the pure domain of GPU sharing (requests, cluster state, placement). No I/O."""
