"""A seeded synthetic event stream whose links a memory-based model can learn.

Structure:
  * activity: each node's weight is Pareto distributed, ``P(a > x) = x ** -activity_exponent`` for
    ``x >= 1`` (a few very active nodes, a long tail), and sources are drawn by activity;
  * communities: every node belongs to one of ``num_communities``; a new destination comes from the
    source's community with probability ``p_in_community``, else from anywhere, by activity;
  * repetition: with probability ``p_repeat`` the destination is one of the source's last
    ``RING`` partners (in both directions for general graphs, so replies are likely);
  * time: Poisson arrivals, one event per second on average, floored to int64 seconds (ties occur);
  * bipartite: sources ``0..num_src_nodes-1`` only send, destinations ``num_src_nodes..`` only receive;
  * features (optional): edge features are a community centre of the destination plus noise, node
    features the node's community centre plus noise, so both carry signal.

The sequential part (partner rings) is the numba kernel ``kernels.synth_events``; it draws its
random numbers from a counter-based hash, so the stream depends only on the parameters and the
seed, never on chunking. Every graph is described by ``source_hash``, a hash of the parameters.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tgdist.data.graph import TemporalGraph
from tgdist.errors import ConfigError
from tgdist.kernels import graph as kernels
from tgdist.kernels.graph import splitmix64

# Bump when the same parameters would produce a different stream.
GENERATOR_VERSION = 1
RING = 8  # partners remembered per node for repeat interactions
CHUNK = 1 << 20  # events per kernel call, for progress reports


@dataclass
class Layout:
    """Node-level structure of a synthetic graph (the inputs of ``kernels.synth_events``).

    ``activity`` float64 ``[num_nodes]`` (Pareto weights); ``comm`` int64 ``[num_nodes]``;
    ``src_cum`` ``[num_src]`` running activity of the source side ``0..num_src-1``;
    ``dst_nodes`` ``[num_dst]`` the destination side sorted by community, ``dst_cum`` their running
    activity; ``comm_ptr`` ``[num_communities + 1]`` community c's range in ``dst_nodes``.
    """

    activity: np.ndarray
    comm: np.ndarray
    src_cum: np.ndarray
    dst_nodes: np.ndarray
    dst_cum: np.ndarray
    comm_ptr: np.ndarray


def _layout(rng: np.random.Generator, num_nodes: int, num_communities: int, activity_exponent: float,
            num_src_nodes: int) -> Layout:
    """``num_src_nodes > 0``: bipartite, sources ``0..num_src_nodes-1`` and destinations after them."""
    activity = (1.0 - rng.random(num_nodes)) ** (-1.0 / activity_exponent)  # Pareto, >= 1
    comm = rng.integers(0, num_communities, size=num_nodes, dtype=np.int64)
    num_src = num_src_nodes or num_nodes
    first_dst = num_src_nodes
    dst_nodes = first_dst + np.argsort(comm[first_dst:], kind="stable").astype(np.int64)
    comm_ptr = np.zeros(num_communities + 1, dtype=np.int64)
    comm_ptr[1:] = np.cumsum(np.bincount(comm[first_dst:], minlength=num_communities))
    return Layout(activity, comm, np.cumsum(activity[:num_src]), dst_nodes, np.cumsum(activity[dst_nodes]), comm_ptr)


def layout(num_nodes: int, num_communities: int = 20, activity_exponent: float = 1.5, bipartite: bool = False,
           num_src_nodes: int = 0, seed: int = 0, **_ignored) -> Layout:
    """The ``Layout`` that ``generate`` uses for these parameters (extra keywords are ignored)."""
    if bipartite and not num_src_nodes:
        num_src_nodes = default_num_src_nodes(int(num_nodes))
    return _layout(np.random.default_rng(int(seed)), int(num_nodes), int(num_communities), float(activity_exponent),
                   int(num_src_nodes) if bipartite else 0)


def default_num_src_nodes(num_nodes: int) -> int:
    """Bipartite default: 90% sources (users), 10% destinations (items), like JODIE's data."""
    return max(1, num_nodes - max(1, num_nodes // 10))


def _bytes_needed(num_events: int, num_nodes: int, edge_dim: int, node_dim: int) -> int:
    """About the peak memory of ``generate``: src, dst and t (int64) plus the exponential gaps
    (float64) per event, the feature rows, and the repeat-partner rings per node."""
    return num_events * (32 + 4 * edge_dim) + num_nodes * (8 * RING + 16 + 4 * node_dim + 64)


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return None


def _validate(num_events, num_nodes, num_communities, p_in_community, p_repeat, activity_exponent,
              edge_dim, node_dim, bipartite, num_src_nodes, seed) -> None:
    if seed < 0:
        raise ConfigError(f"synthetic seed must be >= 0, got {seed}")
    if num_events < 1:
        raise ConfigError(f"synthetic num_events must be >= 1, got {num_events}")
    if num_nodes < 2:
        raise ConfigError(f"synthetic num_nodes must be >= 2, got {num_nodes}")
    most = max(num_nodes, 20)  # the default 20 stays valid for small graphs (some communities empty)
    if not 1 <= num_communities <= most:  # each is a table row: a billion of them took 16 GB
        raise ConfigError(f"synthetic num_communities must be in [1, max(num_nodes, 20)] = [1, {most:,}], "
                          f"got {num_communities:,}")
    for name, p in (("p_in_community", p_in_community), ("p_repeat", p_repeat)):
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"synthetic {name} must be in [0, 1], got {p}")
    if not 0 < activity_exponent < math.inf:
        raise ConfigError(f"synthetic activity_exponent must be a finite number > 0, got {activity_exponent}")
    if edge_dim < 0 or node_dim < 0:
        raise ConfigError(f"synthetic edge_dim and node_dim must be >= 0, got {edge_dim}, {node_dim}")
    if bipartite and num_src_nodes and not 0 < num_src_nodes < num_nodes:
        raise ConfigError(f"synthetic num_src_nodes must be in [1, num_nodes - 1] = [1, {num_nodes - 1}], got {num_src_nodes}")
    if not bipartite and num_src_nodes:
        raise ConfigError("synthetic num_src_nodes is only meaningful with bipartite=true")
    need, have = _bytes_needed(num_events, num_nodes, edge_dim, node_dim), _physical_memory()
    if have and need > have:
        raise ConfigError(f"a synthetic graph of {num_events:,} events and {num_nodes:,} nodes needs about "
                          f"{need / 2**30:,.1f} GiB, more than this machine's {have / 2**30:,.1f} GiB of memory")


def generate(num_events: int, num_nodes: int, num_communities: int = 20, p_in_community: float = 0.8,
             p_repeat: float = 0.5, activity_exponent: float = 1.5, edge_dim: int = 0, node_dim: int = 0,
             bipartite: bool = False, num_src_nodes: int = 0, seed: int = 0,
             progress: Callable[[int, int], None] | None = None) -> TemporalGraph:
    """A synthetic ``TemporalGraph`` of ``num_events`` events over ``num_nodes`` nodes.

    Deterministic for given parameters and ``seed``. ``num_src_nodes=0`` with ``bipartite`` picks
    ``default_num_src_nodes``. ``progress(done, total)`` is called after each chunk of events.
    Every node id lies in ``[0, num_nodes)`` (some low-activity nodes may have no event).
    """
    num_events, num_nodes, num_communities = int(num_events), int(num_nodes), int(num_communities)
    edge_dim, node_dim, num_src_nodes, seed = int(edge_dim), int(node_dim), int(num_src_nodes), int(seed)
    p_in_community, p_repeat, activity_exponent = float(p_in_community), float(p_repeat), float(activity_exponent)
    bipartite = bool(bipartite)
    _validate(num_events, num_nodes, num_communities, p_in_community, p_repeat, activity_exponent,
              edge_dim, node_dim, bipartite, num_src_nodes, seed)
    if bipartite and not num_src_nodes:
        num_src_nodes = default_num_src_nodes(num_nodes)
    params = {"num_events": num_events, "num_nodes": num_nodes, "num_communities": num_communities,
              "p_in_community": p_in_community, "p_repeat": p_repeat, "activity_exponent": activity_exponent,
              "edge_dim": edge_dim, "node_dim": node_dim, "bipartite": bipartite,
              "num_src_nodes": num_src_nodes if bipartite else 0, "seed": seed}
    digest = hashlib.blake2b(json.dumps({"generator": GENERATOR_VERSION, **params}, sort_keys=True).encode(),
                             digest_size=16).hexdigest()

    rng = np.random.default_rng(seed)
    lay = _layout(rng, num_nodes, num_communities, activity_exponent, num_src_nodes if bipartite else 0)
    src_cum, dst_nodes, dst_cum, comm_ptr, comm = lay.src_cum, lay.dst_nodes, lay.dst_cum, lay.comm_ptr, lay.comm

    key = np.uint64(splitmix64(seed & ((1 << 64) - 1)))
    recent = np.full((num_nodes, RING), -1, dtype=np.int64)
    recent_count = np.zeros(num_nodes, dtype=np.int64)
    recent_pos = np.zeros(num_nodes, dtype=np.int64)
    src = np.empty(num_events, dtype=np.int64)
    dst = np.empty(num_events, dtype=np.int64)
    for start in range(0, num_events, CHUNK):
        stop = min(start + CHUNK, num_events)
        kernels.synth_events(start, stop, key, src_cum, dst_nodes, dst_cum, comm_ptr, comm, p_in_community,
                             p_repeat, bipartite, recent, recent_count, recent_pos, src[start:stop], dst[start:stop])
        if progress is not None:
            progress(stop, num_events)
    del recent

    # Poisson arrivals at rate 1/s: exponential gaps, cumulated, floored to whole seconds.
    t = np.floor(np.cumsum(rng.standard_exponential(num_events))).astype(np.int64)

    edge_feat = node_feat = None
    if edge_dim:
        centres = rng.standard_normal((num_communities, edge_dim), dtype=np.float32)
        edge_feat = np.empty((num_events, edge_dim), dtype=np.float32)
        for start in range(0, num_events, CHUNK):
            stop = min(start + CHUNK, num_events)
            block = rng.standard_normal((stop - start, edge_dim), dtype=np.float32)
            block *= 0.5
            block += centres[comm[dst[start:stop]]]
            edge_feat[start:stop] = block
    if node_dim:
        centres = rng.standard_normal((num_communities, node_dim), dtype=np.float32)
        node_feat = centres[comm] + 0.5 * rng.standard_normal((num_nodes, node_dim), dtype=np.float32)

    return TemporalGraph(src=src, dst=dst, t=t, num_nodes=num_nodes, node_map=np.arange(num_nodes, dtype=np.int64),
                         edge_feat=edge_feat, node_feat=node_feat, bipartite=bipartite,
                         num_src_nodes=num_src_nodes if bipartite else 0, name="synthetic", source_hash=digest)
