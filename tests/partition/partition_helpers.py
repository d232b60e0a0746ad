"""Small access graphs with planted structure, shared by the partition tests."""

from __future__ import annotations

import numpy as np

from tgdist.data.graph import TemporalGraph


def planted_weights(num_nodes: int, num_parts: int, seed: int, *, hot_frac: float = 0.05, aligned: bool = False,
                    locality: float = 0.7) -> np.ndarray:
    """int64 ``[num_nodes, num_parts]``: each vertex has a home trainer that makes ``locality`` of its
    accesses (Poisson, heavy-tailed activity), a few hot vertices are needed by everyone.
    ``aligned``: homes are contiguous id blocks (range partitioning then matches the plant)."""
    rng = np.random.default_rng(seed)
    n, m = num_nodes, num_parts
    home = (np.arange(n) * m) // n if aligned else rng.integers(0, m, n)
    activity = rng.pareto(1.5, n) * 4 + 1
    hot = rng.random(n) < hot_frac
    activity[hot] *= 20
    lam = np.tile(activity[:, None] * (1 - locality) / m, (1, m))
    lam[np.arange(n), home] += activity * locality
    lam[hot] = activity[hot, None] / m
    return rng.poisson(lam).astype(np.int64)


def tiny_graph(src, dst, t, num_nodes=None, bipartite=False, num_src_nodes=0) -> TemporalGraph:
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    n = int(max(src.max(), dst.max()) + 1) if num_nodes is None else num_nodes
    return TemporalGraph(src=src, dst=dst, t=np.asarray(t, dtype=np.int64), num_nodes=n,
                         node_map=np.arange(n, dtype=np.int64), bipartite=bipartite, num_src_nodes=num_src_nodes,
                         name="tiny", source_hash="tiny-hash")
