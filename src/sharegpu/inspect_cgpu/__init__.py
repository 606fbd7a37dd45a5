"""``kubectl inspect cgpu``: who holds which GPU.

``model`` turns Node and Pod objects into per-GPU usage (pure), ``render`` writes the summary,
``-d`` and JSON forms (pure), ``source`` reads a dump file or a live cluster, ``cli`` is the
``kubectl-inspect-cgpu`` command that kubectl runs as a plugin.
"""
