"""Where each node's memory lives in a memory group of M trainers (Sven 3.1.2 and 4.1): the group
rank that owns it and its slot there, as the partitioner's dual-hash maps (``DualHashMap``).

Two sources: a ``tgdist partition`` artifact (``partition.artifact=DIR``, checked against the
data and M), or an assignment computed when the run starts (``partition.method``) from the
batches of the run's first pass: global batches of ``i * train.batch_size`` events split among
the i trainers as the run splits them, the model's sampled neighbours, and the negatives the run
draws for memory group 0's first pass (``NegativeSampler.keyed(3 + 0, ...)``), so the
partitioner's predicted traffic is that pass's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from tgdist.data.graph import TemporalGraph
from tgdist.data.sampler import NegativeSampler
from tgdist.distributed import collectives
from tgdist.errors import ConfigError
from tgdist.partition import artifact, methods
from tgdist.partition.access import WEIGHTS, AccessGraph, build_access_graph, from_weights
from tgdist.partition.idmap import DualHashMap
from tgdist.progress import Status

log = logging.getLogger(__name__)


# NegativeSampler.keyed's key of memory group 0's first pass in a parallel run (3 + neg_set, which
# is jj there: tgdist.distributed.schedule.neg_set_id)
FIRST_PASS_NEGATIVES = 3


@dataclass
class Placement:
    """``maps``: owner group rank (``trainer_of``) and local slot (``local_of``) of every node;
    ``source``: how it was made, for the log line and the summary."""

    maps: DualHashMap
    source: str

    @property
    def num_parts(self) -> int:
        return self.maps.num_parts


def check_settings(store: type, j: int, part) -> None:
    """One line for settings a partitioned store (its class: ``name``, ``epoch_parallel``) cannot
    run with (before any data is read)."""
    if j > 1 and not store.epoch_parallel:  # (depcomm: owners update at compute time, which idle trainers skip)
        raise ConfigError(f"memory.backend={store.name}: with epoch parallelism (parallel.j={j}) a trainer idles in the "
                          f"first and last iterations and could not update the memory it owns for the others; use "
                          f"parallel.j=1, or memory.backend=sven or depcache")
    if part.method not in methods.METHODS:
        raise ConfigError(f"partition.method={part.method!r}: choose one of {', '.join(methods.METHODS)}")
    if part.weights not in WEIGHTS:
        raise ConfigError(f"partition.weights={part.weights!r}: choose one of {', '.join(WEIGHTS)}")
    if not part.imbalance >= 0:
        raise ConfigError(f"partition.imbalance={part.imbalance}: must be >= 0")
    if not 0 < part.tolerance < 1:
        raise ConfigError(f"partition.tolerance={part.tolerance}: must lie in (0, 1)")


def first_pass_access(graph: TemporalGraph, train_end: int, num_parts: int, batch_size: int, fanouts, *,
                      subgroups: int = 1, strategy: str = "recent", both_directions: bool = True, seed: int = 0,
                      per_batch: bool = False, progress=None) -> AccessGraph:
    """The trainer-node access graph of memory group 0's first pass of a run whose ``num_parts``
    (i) trainers take ``batch_size`` events each (global batches of ``i * batch_size``), sampling
    ``fanouts`` (empty: the model reads roots only), with that pass's negatives (train seed
    ``seed``). With ``subgroups`` (j) > 1 the group has ``i * j`` trainers in group-rank order
    ``jj * i + ii``: subgroup jj reads the same positives with its own negative set jj."""
    negatives = NegativeSampler(graph, seed)
    parts = [build_access_graph(graph, num_parts=num_parts, batch_size=num_parts * batch_size, train_end=train_end,
                                fanouts=tuple(fanouts), strategy=strategy, num_neg=1, seed=seed,
                                both_directions=both_directions, per_batch=per_batch and subgroups == 1, progress=progress,
                                negatives=lambda lo, hi, jj=jj: negatives.keyed(FIRST_PASS_NEGATIVES + jj, lo, hi, 1))
             for jj in range(subgroups)]
    if subgroups == 1:
        return parts[0]
    return from_weights(np.concatenate([a.raw for a in parts], 1), np.concatenate([a.dedup for a in parts], 1))


def compute_owner(graph: TemporalGraph, train_end: int, num_parts: int, batch_size: int, fanouts, part, *,
                  subgroups: int = 1, strategy: str = "recent", both_directions: bool = True,
                  seed: int = 0, progress=None) -> tuple[np.ndarray, str]:
    """``(owner [num_nodes], description)`` among ``num_parts * subgroups`` trainers by
    ``part.method`` over the first pass's accesses (``first_pass_access``; range and interval
    need none). ``progress`` receives a short line about once a second."""
    start = time.perf_counter()
    n, m = graph.num_nodes, num_parts * subgroups
    if part.method == "range":
        return methods.range_partition(n, m), "range"
    if part.method == "interval":
        return methods.interval_partition(n, m), "interval"
    access = first_pass_access(graph, train_end, num_parts, batch_size, fanouts, subgroups=subgroups,
                               strategy=strategy, both_directions=both_directions, seed=seed, progress=progress)
    if part.method == "reflexbicut":
        owner = methods.reflexbicut_search(access.weights(part.weights), imbalance=part.imbalance, seed=part.seed,
                                           tolerance=part.tolerance, progress=progress).owner
    else:
        owner = methods.assign(access, part.method, weights=part.weights, imbalance=part.imbalance, seed=part.seed)
    return owner, f"{part.method} computed at start ({time.perf_counter() - start:.1f} s)"


def load_owner(path: str, graph: TemporalGraph, num_parts: int, global_batch: int) -> tuple[np.ndarray, str]:
    """The assignment of a ``tgdist partition`` artifact for ``num_parts`` trainers, refused in one
    line when it was made for other data or another number of trainers (a warning when it was
    balanced for global batches other than the run's ``global_batch`` events)."""
    part = artifact.load(path, graph=graph, num_parts=num_parts)
    made = part.metadata.get("batch_size")
    if made is not None and made != global_batch:
        log.warning("partition artifact %s was balanced for global batches of %s events, this run's are %d: the "
                    "placement is valid but balanced for other batches", path, made, global_batch)
    return part.maps.trainer_of, f"{part.metadata.get('method', '?')} from {path}"


def placement(ctx) -> Placement:
    """The placement of this run's memory groups (``ctx``: a ``StoreContext`` with ``graph``,
    ``train_end`` and ``cfg``): world rank 0 loads or computes it and every rank gets its copy
    (a failure there is every rank's one line)."""
    cfg, graph = ctx.cfg, ctx.graph
    if graph is None or cfg is None:
        raise ValueError("a partitioned store needs StoreContext.graph, train_end and cfg")
    group = ctx.groups.get("memory") if ctx.groups is not None else None
    m = collectives.group_size(group)
    j = ctx.layout.j if ctx.layout is not None else 1
    part = cfg.partition

    def work():
        if part.artifact:
            return load_owner(part.artifact, graph, m, m // j * ctx.batch_size)
        with Status("placing node memory", enabled=cfg.train.progress) as status:  # rank 0, on a terminal
            return compute_owner(graph, ctx.train_end, m // j, ctx.batch_size, ctx.fanouts, part, subgroups=j,
                                 strategy=cfg.sampler.strategy, both_directions=cfg.sampler.both_directions,
                                 seed=cfg.train.seed, progress=status.set)

    world = ctx.groups.get("world") if ctx.groups is not None else None
    owner, source = collectives.result_of(work, world, name="placement", counter=collectives.ByteCounter())
    return Placement(DualHashMap.from_assignment(np.asarray(owner, dtype=np.int64), m), source)
