"""The placement simulator: the core's scheduler replayed on a trace (openb format)."""
