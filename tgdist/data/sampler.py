"""T-CSR, the temporal neighbour sampler and negative sampling.

The sampler returns dense fixed-fanout tensors ``[num_roots, K]`` per hop instead of DGL blocks:
the attention layers then run as batched dense ops in plain torch.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from tgdist.data.graph import TemporalGraph
from tgdist.errors import ConfigError
from tgdist.kernels import graph as kernels
from tgdist.kernels.graph import splitmix64


@dataclass
class TCSR:
    """Temporal CSR: node u's events are ``[indptr[u], indptr[u+1])`` in time order.

    ``nbr``, ``eid``, ``t``: ``[num_entries]`` (the other endpoint, the event id and its time);
    ``num_entries = 2 * num_events - num_self_loops`` when both directions are indexed (the default;
    a self-loop is listed once), ``num_events`` otherwise.
    """

    indptr: np.ndarray
    nbr: np.ndarray
    eid: np.ndarray
    t: np.ndarray

    @classmethod
    def build(cls, graph: TemporalGraph, both_directions: bool = True) -> "TCSR":
        """The graph's T-CSR: the one its mapped cache entry holds (shared by every process of the
        machine) when it has one for these directions, else built in this process."""
        if both_directions and graph.tcsr_arrays is not None:
            return cls(**graph.tcsr_arrays)
        indptr, nbr, eid = kernels.tcsr_fill(graph.src, graph.dst, graph.num_nodes, both_directions)
        return cls(indptr, nbr, eid, graph.t[eid])

    @property
    def num_nodes(self) -> int:
        return self.indptr.shape[0] - 1

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.indptr, self.nbr, self.eid, self.t))


@dataclass
class SampledHop:
    """One hop of sampled neighbours; every array is ``[num_roots, K]``.

    ``nbr`` and ``eid`` are -1 and ``t`` is 0 where ``mask`` is False (fewer than K neighbours).
    ``dt`` is ``root_t - t`` as float32 (0 where masked).
    """

    nbr: np.ndarray
    eid: np.ndarray
    t: np.ndarray
    mask: np.ndarray
    dt: np.ndarray

    def to_torch(self, device: torch.device | str = "cpu") -> "SampledHopTensors":
        def tt(a):
            x = torch.from_numpy(a)
            return x if str(device) == "cpu" else x.to(device, non_blocking=True)
        return SampledHopTensors(tt(self.nbr), tt(self.eid), tt(self.mask), tt(self.dt))


@dataclass
class SampledHopTensors:
    """Torch view of a ``SampledHop`` (zero-copy on CPU); shapes ``[num_roots, K]``."""

    nbr: torch.Tensor
    eid: torch.Tensor
    mask: torch.Tensor
    dt: torch.Tensor


class TemporalSampler:
    """Samples ``fanouts[l]`` neighbours per root at each of ``len(fanouts)`` hops.

    Hop l+1's roots are hop l's neighbours (flattened, ``[num_roots * K_l]``) at the time of the
    sampled event, as in TGAT/TGL. ``strategy`` is ``recent`` (the K latest strictly before the
    root's time) or ``uniform`` (K draws with replacement, seeded; the same seed and call sequence
    give the same samples whatever the thread count).
    A hop with fewer than ``min_parallel_slots`` output slots (``num_roots * K``) runs on the
    calling thread: a training batch's first hop (e.g. 1,800 roots x 10) takes ~0.2 ms serially,
    less than a fork-join costs once another process occupies a core. Larger hops use
    ``num_threads`` threads. Results are identical either way.
    """

    def __init__(self, tcsr: TCSR, fanouts: list[int], strategy: str = "recent", seed: int = 0,
                 num_threads: int = 0, min_parallel_slots: int = 65_536):
        if strategy not in ("recent", "uniform"):
            raise ConfigError(f"sampler strategy must be 'recent' or 'uniform', got {strategy!r}")
        if not fanouts or any(int(k) <= 0 for k in fanouts):
            raise ConfigError(f"fanouts must be positive integers, got {list(fanouts)}")
        self.tcsr = tcsr
        self.fanouts = [int(k) for k in fanouts]
        self.strategy = strategy
        self.seed = int(seed)
        self.calls = 0
        self._side = False  # inside side_stream
        self.num_threads = kernels.set_threads(num_threads)
        self.min_parallel_slots = int(min_parallel_slots)

    def sample(self, roots: np.ndarray, root_t: np.ndarray) -> list[SampledHop]:
        """``roots`` int64 ``[num_roots]``, ``root_t`` ``[num_roots]`` (graph time dtype)."""
        roots = np.ascontiguousarray(roots, dtype=np.int64)
        root_t = np.ascontiguousarray(root_t, dtype=self.tcsr.t.dtype)
        hops = []
        with kernels.torch_threads_kept():
            for level, k in enumerate(self.fanouts):
                hop = self._sample_hop(roots, root_t, k, level)
                hops.append(hop)
                roots, root_t = hop.nbr.reshape(-1), hop.t.reshape(-1)
        self.calls += 1
        return hops

    @contextmanager
    def side_stream(self, key: int):
        """Uniform draws inside the block come from stream ``key`` (evaluation, embedding queries)
        and leave the training stream where it was: evaluating (or not) between epochs does not
        change what training samples next. Each block starts its stream afresh, so evaluating
        the same state twice samples the same neighbours; a block inside another continues the
        outer one's stream."""
        if self._side:
            yield
            return
        saved, self._side = self.calls, True
        self.calls = (int(key) + 1) << 40
        try:
            yield
        finally:
            self.calls, self._side = saved, False

    def _sample_hop(self, roots, root_t, k, level) -> SampledHop:
        n = roots.shape[0]
        c = self.tcsr
        nbr = np.empty((n, k), dtype=np.int64)
        eid = np.empty((n, k), dtype=np.int64)
        t = np.empty((n, k), dtype=c.t.dtype)
        mask = np.empty((n, k), dtype=np.bool_)
        parallel = self.num_threads > 1 and n * k >= self.min_parallel_slots
        if self.strategy == "recent":
            fn = kernels.sample_recent if parallel else kernels.sample_recent_serial
            fn(c.indptr, c.nbr, c.eid, c.t, roots, root_t, k, nbr, eid, t, mask)
        else:
            seed = (self.seed * 1_000_003 + self.calls * 31 + level) & 0x7FFFFFFFFFFFFFFF
            fn = kernels.sample_uniform if parallel else kernels.sample_uniform_serial
            fn(c.indptr, c.nbr, c.eid, c.t, roots, root_t, k, seed, nbr, eid, t, mask)
        dt = (root_t[:, None] - t).astype(np.float32)
        dt[~mask] = 0.0
        return SampledHop(nbr, eid, t, mask, dt)


class NegativeSampler:
    """Negative destinations: uniform over all nodes, or over the destination side when bipartite.

    ``train(n, num_neg)`` draws fresh negatives from the sampler's own generator.
    ``fixed(split_name, start, stop, num_neg)`` returns evaluation negatives that depend only on the
    seed, the split and the event index, so every run and every rank sees the same sets
    (1 per positive for AP, 49 for MRR).
    """

    def __init__(self, graph: TemporalGraph, seed: int = 0):
        self.low = graph.num_src_nodes if graph.bipartite else 0
        self.high = graph.num_nodes
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)

    def train(self, num_events: int, num_neg: int = 1) -> np.ndarray:
        """int64 ``[num_events, num_neg]``."""
        return self.rng.integers(self.low, self.high, size=(num_events, num_neg), dtype=np.int64)

    def fixed(self, part: str, start: int, stop: int, num_neg: int) -> np.ndarray:
        """int64 ``[stop - start, num_neg]``, a pure function of (seed, part, event index)."""
        return self.keyed({"train": 0, "val": 1, "test": 2}[part], start, stop, num_neg)

    def keyed(self, key: int, start: int, stop: int, num_neg: int) -> np.ndarray:
        """int64 ``[stop - start, num_neg]``, a pure function of (seed, key, event index, column).
        Keys 0-2 are the evaluation sets; parallel training uses ``3 + neg_set`` (one set per memory
        group, pass and epoch-parallel subgroup, whatever rank draws it).

        Column j of an event does not depend on ``num_neg``: AP and ROC-AUC, which use column 0,
        are the same whatever number of negatives MRR ranks against. Each (seed, key) has its own
        stream: splitmix64 of the counter ``event + j * 2**40`` from a start hashed from both."""
        idx = np.arange(start, stop, dtype=np.uint64)[:, None] + (np.arange(num_neg, dtype=np.uint64) << np.uint64(40))
        stream = splitmix64(((self.seed & 0xFFFFFFFF) << 32) ^ (key & 0xFFFFFFFF) ^ 0x5EED)
        with np.errstate(over="ignore"):
            x = idx * np.uint64(0x9E3779B97F4A7C15) + np.uint64(stream)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(31))
        return (self.low + (x % np.uint64(self.high - self.low)).astype(np.int64)).astype(np.int64)
