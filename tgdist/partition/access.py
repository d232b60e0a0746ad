"""The trainer-vertex access graph, built by pre-sampling one training epoch (Sven 3.1.2, Fig. 8c).

Conventions (shared with the mini-batch parallel trainer, DESIGN.md "Parallel training"):

* one epoch = the training events ``[0, train_end)`` in time order, cut into global batches of
  ``batch_size`` consecutive events (the last one may be shorter);
* a global batch is split chronologically into ``num_parts`` contiguous chunks, chunk t going to
  trainer t: events ``[b0 + floor(t n / M), b0 + floor((t + 1) n / M))`` of a batch of n events
  starting at b0 (sizes differ by at most one);
* the roots of an event are its source, its destination and ``num_neg`` negative destinations
  (``NegativeSampler(graph, seed).train``), all at the event time; each root's neighbours are
  sampled with ``TemporalSampler`` (fanouts ``[K] * L``, "recent" or "uniform") over a T-CSR of
  all events (the time filter prevents leakage), hop l + 1 rooted at hop l's neighbours;
* trainer t *needs* vertex v each time v appears among the roots or sampled neighbours of one of
  its events. ``raw[v, t]`` counts every appearance; ``dedup[v, t]`` counts the batches in which it
  appears at least once (what a redundancy-free fetch, Sven Algorithm 2, transfers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from tgdist.data.graph import TemporalGraph
from tgdist.data.sampler import TCSR, NegativeSampler, TemporalSampler
from tgdist.errors import ConfigError
from tgdist.partition import kernels

WEIGHTS = ("dedup", "raw")


@dataclass
class AccessGraph:
    """Weighted trainer-vertex graph of one epoch; dense because N x M is small (1M x 8 int64 = 64 MB).

    ``raw``, ``dedup``: int64 ``[num_nodes, num_parts]`` (see the module docstring);
    ``batches_per_part``: int64 ``[num_parts]``, how many (batch, trainer) chunks had events.
    ``batch_ptr`` int64 ``[num_batches * num_parts + 1]`` and ``batch_ids`` ``[nnz]`` (int32 when
    ids fit): the unique vertices each trainer needs in each batch, group ``b * num_parts + t``
    (kept when ``per_batch=True``; ``measures.batch_measures`` uses them), else None.
    """

    raw: np.ndarray
    dedup: np.ndarray
    num_parts: int
    batch_size: int
    num_events: int  # training events pre-sampled
    num_batches: int
    fanouts: tuple[int, ...]  # () when neighbours are not sampled
    strategy: str
    num_neg: int
    seed: int
    batches_per_part: np.ndarray = field(repr=False, default=None)
    batch_ptr: Optional[np.ndarray] = field(repr=False, default=None)
    batch_ids: Optional[np.ndarray] = field(repr=False, default=None)
    seconds: float = 0.0

    @property
    def num_nodes(self) -> int:
        return int(self.raw.shape[0])

    def weights(self, kind: str = "dedup") -> np.ndarray:
        """``[num_nodes, num_parts]`` weights of the kind the measures and methods use."""
        if kind not in WEIGHTS:
            raise ConfigError(f"partition weights must be one of {', '.join(WEIGHTS)}, got {kind!r}")
        return self.dedup if kind == "dedup" else self.raw


def from_weights(weights: np.ndarray, dedup: Optional[np.ndarray] = None) -> AccessGraph:
    """An ``AccessGraph`` around hand-made weights ``[num_nodes, num_parts]`` (tests, other samplers)."""
    w = np.ascontiguousarray(weights, dtype=np.int64)
    if w.ndim != 2 or w.shape[1] < 1:
        raise ConfigError(f"access weights must be [num_nodes, num_parts], got shape {w.shape}")
    if (w < 0).any():
        raise ConfigError("access weights must be non-negative")
    d = w if dedup is None else np.ascontiguousarray(dedup, dtype=np.int64)
    if d.shape != w.shape:
        raise ConfigError(f"dedup weights have shape {d.shape}, raw weights {w.shape}")
    m = w.shape[1]
    return AccessGraph(raw=w, dedup=d, num_parts=m, batch_size=0, num_events=0, num_batches=0,
                       fanouts=(), strategy="given", num_neg=0, seed=0, batches_per_part=np.zeros(m, np.int64))


def batch_trainers(num_events: int, batch_size: int, num_parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Trainer and (batch, trainer) group of every event: int64 ``[num_events]`` each.

    ``group = batch * num_parts + trainer``; see the module docstring for the split.
    """
    e = np.arange(num_events, dtype=np.int64)
    batch = e // batch_size
    offset = e - batch * batch_size
    n = np.minimum(batch_size, num_events - batch * batch_size)  # length of the event's batch
    # chunk t is [floor(t n / M), floor((t + 1) n / M)): the largest t with floor(t n / M) <= offset
    trainer = ((offset + 1) * num_parts - 1) // n
    return trainer, batch * num_parts + trainer


def build_access_graph(graph: TemporalGraph, *, num_parts: int, batch_size: int, train_end: Optional[int] = None,
                       fanouts: Sequence[int] = (10,), strategy: str = "recent", num_neg: int = 1, seed: int = 0,
                       both_directions: bool = True, num_threads: int = 0, per_batch: bool = True,
                       chunk_ids: int = 1 << 20, negatives: Optional[Callable[[int, int], np.ndarray]] = None,
                       progress: Optional[Callable[[str], None]] = None) -> AccessGraph:
    """Pre-sample one epoch of ``graph`` (events ``[0, train_end)``, all when None) and count accesses.

    ``fanouts`` ``[K] * L`` as the model samples; an empty sequence means the model reads no
    neighbour memory (JODIE): only the roots count. Deterministic for a given ``seed`` (and, with
    ``strategy="uniform"``, a given ``chunk_ids``: uniform draws depend on the sampler's calls).
    ``per_batch`` keeps the unique vertices of every (batch, trainer) for per-batch measures
    (memory: one id per unique access, ``dedup.sum()`` ids). ``negatives(lo, hi)``: the negative
    destinations ``[hi - lo, num_neg]`` of events ``[lo, hi)``, e.g. the keyed ones of a parallel
    run's first pass (default: ``NegativeSampler(graph, seed).train``, drawn in event order).
    ``progress`` receives a short line about once a second (the commands show it on a terminal,
    ``tgdist.progress.Status``).
    """
    start = time.perf_counter()
    n_events = graph.num_events if train_end is None else int(train_end)
    if num_parts < 1:
        raise ConfigError(f"num_parts must be >= 1, got {num_parts}")
    if batch_size < num_parts:
        raise ConfigError(f"batch_size ({batch_size}) must be >= num_parts ({num_parts}): every trainer needs events")
    if not 0 < n_events <= graph.num_events:
        raise ConfigError(f"no training events to pre-sample (train_end={n_events}, graph has {graph.num_events})")
    if num_neg < 0:
        raise ConfigError(f"num_neg must be >= 0, got {num_neg}")
    fanouts = tuple(int(k) for k in fanouts)
    n, m = graph.num_nodes, num_parts
    raw = np.zeros((n, m), dtype=np.int64)
    dedup = np.zeros((n, m), dtype=np.int64)
    stamp = np.full(n, -1, dtype=np.int64)
    trainer, group = batch_trainers(n_events, batch_size, m)
    sampler = None
    if fanouts:
        sampler = TemporalSampler(TCSR.build(graph, both_directions), list(fanouts), strategy=strategy, seed=seed,
                                  num_threads=num_threads)
    negs = NegativeSampler(graph, seed)
    # chunks of whole batches holding about ``chunk_ids`` sampled ids, so the sampler's arrays stay small
    ids_per_event = (2 + num_neg) * int(np.sum(np.cumprod([1, *fanouts])))
    per_chunk = max(1, chunk_ids // (ids_per_event * batch_size)) * batch_size
    num_batches = -(-n_events // batch_size)
    last_report = time.perf_counter()
    id_dtype = np.int32 if n < 2**31 else np.int64
    rec_ids = []
    group_sizes = np.zeros(num_batches * m, dtype=np.int64)
    no_record = np.empty(0, dtype=np.int64)
    for lo in range(0, n_events, per_chunk):
        hi = min(n_events, lo + per_chunk)
        neg = negs.train(hi - lo, num_neg) if negatives is None else np.asarray(negatives(lo, hi), dtype=np.int64)
        roots = np.concatenate([graph.src[lo:hi, None], graph.dst[lo:hi, None], neg.reshape(hi - lo, num_neg)], axis=1)
        parts = [roots]
        if sampler is not None:
            hops = sampler.sample(roots.reshape(-1), np.repeat(graph.t[lo:hi], roots.shape[1]))
            parts += [h.nbr.reshape(hi - lo, -1) for h in hops]  # event-major: row e holds event e's ids
        rows = np.ascontiguousarray(np.concatenate(parts, axis=1))
        buf_ids = np.empty(rows.size, dtype=np.int64) if per_batch else no_record
        buf_group = np.empty(rows.size, dtype=np.int64) if per_batch else no_record
        count = kernels.access_counts(rows, group[lo:hi], trainer[lo:hi], raw, dedup, stamp, buf_ids, buf_group)
        if per_batch:
            rec_ids.append(buf_ids[:count].astype(id_dtype))
            group_sizes += np.bincount(buf_group[:count], minlength=num_batches * m)
        now = time.perf_counter()
        if progress is not None and (now - last_report > 1.0 or hi == n_events):
            last_report = now
            progress(f"pre-sampling: {hi // batch_size if hi < n_events else num_batches:,}/{num_batches:,} batches")
    first = np.ones(n_events, dtype=bool)
    first[1:] = group[1:] != group[:-1]  # groups are non-decreasing
    per_part = np.bincount(group[first] % m, minlength=m).astype(np.int64)
    batch_ptr = batch_ids = None
    if per_batch:
        batch_ptr = np.zeros(num_batches * m + 1, dtype=np.int64)
        np.cumsum(group_sizes, out=batch_ptr[1:])
        batch_ids = np.concatenate(rec_ids)  # groups arrive in order, so the records are grouped already
    return AccessGraph(raw=raw, dedup=dedup, num_parts=m, batch_size=batch_size, num_events=n_events,
                       num_batches=num_batches, fanouts=fanouts, strategy=strategy, num_neg=num_neg, seed=seed,
                       batches_per_part=per_part, batch_ptr=batch_ptr, batch_ids=batch_ids,
                       seconds=time.perf_counter() - start)
