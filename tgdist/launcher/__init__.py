"""Process starters, the layer above the runtime: ``tgdist launch`` (torchrun on this machine),
the torchrun wrapper that stops ranks with their agent, and DistTGL's choice of (i, j, k) for a
cluster (``tgdist plan``). Where a run executes and its process groups are ``tgdist.distributed``."""
