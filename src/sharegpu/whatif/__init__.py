"""``sharegpu whatif``: a cluster (a dump, or the live one) replayed through every placement
policy: what its GPUs hold today, what each policy would make of the same pods, and how many
more pods of a shape fit (docs/whatif.md)."""
