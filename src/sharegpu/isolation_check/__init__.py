"""``sharegpu isolation-check``: start CUDA probes with the environment the node agent gives a
container and measure whether its memory and compute limits hold.

Modules: ``probe`` (the CUDA process; standard library only, run as
``python -m sharegpu.isolation_check.probe``), ``check`` (scenarios, tolerances and the pass/fail
decisions), ``render`` (the table). Nothing is imported here, so the probe starts fast.
"""
