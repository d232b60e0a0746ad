"""The advisor's prediction: for every allowed layout, memory store, pipeline and placement, the
epoch time stage by stage and the memory per rank, from a profile and a cluster (a pure function:
``predict(profile, cluster)``; no measurement, no process).

The candidates are the registries': every registered memory store (``tgdist.memory``) and every
pipeline (the presets of ``configs/pipeline/``, composed as a run composes them, and each
registered strategy of ``tgdist.runtime.pipelines`` that no preset picks), extensions included.
What a candidate costs comes from its classes, never from its name: the store's pricing members
(``MemoryStore.collectives``, ``traffic``, ``price_memory``, ``bytes_per_rank``) and the pipeline
strategy's ``price``; what it may not do, from the runtime's own checks.

One iteration of one trainer at local batch b (DESIGN.md "One training iteration"), W = i j k
trainers, memory groups of G = i j trainers (DistTGL 3.2), Q trainers per machine:

- CPU stages, from the profile: sample, features, memory read, compute, memory write, each fitted
  as ``a + c b`` over the profiled batch sizes (``StageFit``); the rows a batch reads, N1 (1 - eta1),
  from Sven eq. (12)'s hypothesis eta = A + B / bs (``RowFit``, the fit ``fit_eta`` of
  ``micro_batches=auto``). The store turns the memory read and write into its own
  (``price_memory``: a replica that applies the whole group's writes, a daemon's buffers and the
  CPU its process spends serving the group).
- Communication, per trainer and iteration, priced with ``parallel.link``'s alpha-beta model
  (``link_seconds``) on the cluster's link (the inter-machine one when the collective's ranks span
  machines): the store's bytes per trainer (``traffic``, from ``memory/volumes.py``, the one copy
  of Sven's eq. (7)-(9)) and its collectives per iteration (``collectives``, each paying the
  link's latency once). The share of rows another trainer owns is the profile's measure of the
  placement (``PlacementShare``) in place of the ideal (M - 1) / M, and the busiest trainer's load
  over the mean scales the time. Gradients: a ring all-reduce over all W trainers.
- Collectives on the profile's own machine (a simulated cluster: the ranks are its processes): each
  of the store's collectives and the gradients' all-reduce costs what two training processes paid
  for one there (``exchange_s``, ``gradient_s``: ``measure.paid_costs``, two ranks of the store
  that times its exchanges, ``exchange_store``, over the window the profile timed alone, their
  all-reduce and store timed inside) and its bytes at the idle rate (``bytes_per_s``); a profile
  without that measure prices each at the idle two-process cost (``fixed_s``). Measured at two
  ranks, used for any W (as ``parallel.link`` prices a latency per collective, whatever the
  group's size).
- Overlap: the pipeline strategy's ``price`` (``runtime.pipelines``: the plain loop with Sven's
  levels, prefetch, micro-batches with eq. (12)'s n*, asynchronous all-reduce; MSPipe's schedule of
  ``staleness_bounds``), given the stages alone (``IterationCosts``) and the share of the ideal
  overlap that stage threads bought in the profile (``overlap``; 1 when absent).
- Shared cores (CPU trainers, ``Cluster.cores_per_machine``): the Q trainers of a machine, their
  background threads and the processes serving memory groups share its cores. With x = the
  machine's CPU seconds per iteration over the critical path (the processes at work on average: a
  rank waiting on a slept link leaves its core to another), the CPU stages run s(x) times slower,
  s measured by the profile on its machine (``core_sharing``: its cores, and the load others put
  on them), else s(x) = x / cores: the iteration is the path plus (s(x) - 1) times the rank's CPU
  seconds on it.
- Synchronised ranks: every iteration ends in the gradient all-reduce, so it lasts as long as the
  slowest of the W ranks: the profile's spread of the step time (``step_cv``) and the expected
  maximum of W normal variables add ``cv * E[max of W]`` of the rank's CPU seconds, times the square
  root of the times per iteration the ranks meet (``_straggler``; an order statistic, not one of the
  papers' formulas).
- Epoch: ceil(E / (W b)) iterations per trainer, plus j - 1 for the epoch-parallel subgroups' fill.

Memory per rank: node memory and mails (num_nodes rows of mem_dim floats, a float64 time, the
mailbox) as the store keeps them (``bytes_per_rank``: a copy, a shard times the imbalance, or none
in the trainer; a store in host shared memory holds one copy per group on each machine),
parameters with Adam's two moments, and a working set of the batch's rows; the host also holds
each rank's graph and T-CSR.

A combination is refused with its reason when it does not fit memory, or when the runtime refuses
it (the same checks: ``validate_pipeline`` with the strategy's ``validate``, ``check_settings``,
and ``distributed.world.validate``, where the rules of host shared memory live: k >= machines, a
memory group on one machine), or when the store's placement makes it pointless (memory in a
process for a group, a store kept by collectives for one trainer per copy).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from tgdist.distributed.link import link_seconds
from tgdist.errors import ConfigError
from tgdist.launcher.advisor.cluster import Cluster
from tgdist.launcher.advisor.profile import STAGES, Profile

__all__ = ["PipelineOption", "pipeline_options", "default_pipeline", "exchange_store", "store_names", "StageFit", "RowFit", "Candidate",
           "volumes", "paper_volumes", "sven_beats_depcache", "micro_count", "predict", "layouts",
           "expected_max_normal"]


@dataclass(frozen=True)
class PipelineOption:
    """One pipeline candidate: ``overrides`` that pick it, ``pipe`` the ``pipeline`` config they
    compose to (the YAML preset through the config's own composition, a plain dict read fast) and
    ``strategy`` the registered class ``pipe.mode`` names (which prices and validates it)."""

    name: str
    overrides: tuple
    pipe: dict
    strategy: type


@functools.cache
def pipeline_options() -> dict[str, PipelineOption]:
    """The pipeline candidates by name: every preset of ``configs/pipeline/`` (the default first,
    then by name), composed as ``tgdist train pipeline=NAME`` composes it, then every registered
    strategy (``runtime.pipelines.registry``, extensions included) that no preset picks, as
    ``pipeline.mode=NAME`` over the default preset. Built once per process."""
    from tgdist import plugins
    from tgdist.config import config_dir
    from tgdist.runtime import pipelines
    from tgdist.runtime.build import compose

    plugins.load()
    default = default_pipeline()
    presets = sorted((p.stem for p in (Path(config_dir()) / "pipeline").glob("*.yaml")), key=lambda n: (n != default, n))
    out: dict[str, PipelineOption] = {}

    def add(name: str, overrides: list[str]) -> None:
        pipe = _Plain(OmegaConf.to_container(compose(overrides).pipeline, resolve=True))
        out[name] = PipelineOption(name, tuple(overrides), pipe, pipelines.pipeline_class(pipe["mode"]))

    for name in presets:
        add(name, [f"pipeline={name}"])
    picked = {o.strategy for o in out.values()}
    for mode in pipelines.names():
        if pipelines.pipeline_class(mode) not in picked:
            add(mode, [f"pipeline.mode={mode}"])
    return out


@functools.cache
def default_pipeline() -> str:
    """The preset of ``configs/pipeline/`` that a run without ``pipeline=...`` composes (the plain loop)."""
    from tgdist.runtime.build import compose

    return str(compose([], return_hydra_config=True).hydra.runtime.choices.pipeline)


def exchange_store() -> str:
    """The registered store whose exchanges a profile times to price every store's collectives
    (``measure.exchange_runs``): the first whose class says so (``profiled_exchange``)."""
    from tgdist import memory

    for name in store_names():
        if memory.store_class(name).profiled_exchange:
            return name
    raise ConfigError("no registered memory store times its exchanges for the profile (profiled_exchange)")


def store_names() -> list[str]:
    """The memory stores to weigh: every registered one (``memory.registry``, extensions included)."""
    from tgdist import memory, plugins

    plugins.load()
    return memory.names()


def _store(name: str):
    from tgdist import memory

    return memory.store_class(name)


# ------------------------------------------------------------------------------------------------
# Fits of the profile


@dataclass(frozen=True)
class StageFit:
    """Seconds of each stage at local batch b: ``a[s] + c[s] * b`` (least squares over the profiled
    sizes; one size: proportional), never below 0. ``a`` is the fixed part of an iteration, what
    each micro-batch pays again."""

    a: dict
    c: dict

    @classmethod
    def of(cls, profile: Profile) -> "StageFit":
        bs = np.array([b.batch_size for b in profile.batches], dtype=np.float64)
        a, c = {}, {}
        for s in STAGES:
            y = np.array([float(b.seconds.get(s, 0.0)) for b in profile.batches])
            if np.unique(bs).size < 2:
                a[s], c[s] = 0.0, float(y.mean() / bs.mean())
                continue
            slope, icept = np.polyfit(bs, y, 1)
            if icept < 0:  # a negative fixed cost: proportional instead
                icept, slope = 0.0, float((y * bs).sum() / (bs * bs).sum())
            if slope < 0:
                icept, slope = float(y.mean()), 0.0
            a[s], c[s] = float(icept), float(slope)
        return cls(a, c)

    def at(self, stage: str, b: float) -> float:
        return max(self.a[stage] + self.c[stage] * b, 0.0)


@dataclass(frozen=True)
class RowFit:
    """Rows of a batch of b events: ``sampled(b)`` = N1 (proportional to b), ``distinct(b)`` = N1 (1 - eta1)
    with eta1 = A1 + B1 / b, and the roots N2 = 2 b with eta2 = A2 + B2 / b: Sven eq. (12)'s
    hypothesis, fitted as ``micro_batches=auto`` fits it (``fit_eta``)."""

    sampled_per_event: float
    A1: float
    B1: float
    A2: float
    B2: float

    @classmethod
    def of(cls, profile: Profile) -> "RowFit":
        bs = [b.batch_size for b in profile.batches]
        per_event = float(np.mean([b.rows_sampled / b.batch_size for b in profile.batches]))
        if len(set(bs)) < 2:
            b = profile.batches[0]
            return cls(per_event, b.eta1, 0.0, b.eta2, 0.0)
        A1, B1 = fit_eta(bs, [b.eta1 for b in profile.batches])
        A2, B2 = fit_eta(bs, [b.eta2 for b in profile.batches])
        return cls(per_event, A1, B1, A2, B2)

    def sampled(self, b: float) -> float:
        return self.sampled_per_event * b

    def eta1(self, b: float) -> float:
        return min(max(self.A1 + self.B1 / b, 0.0), 1.0)

    def eta2(self, b: float) -> float:
        return min(max(self.A2 + self.B2 / b, 0.0), 1.0)

    def distinct(self, b: float) -> float:
        return self.sampled(b) * (1.0 - self.eta1(b))

    def roots_distinct(self, b: float) -> float:
        return 2.0 * b * (1.0 - self.eta2(b))


def fit_eta(sizes, eta) -> tuple[float, float]:
    """Sven eq. (12) (Appendix D, eq. (22)): least squares of eta = A + B / bs."""
    from tgdist.runtime.pipelines import fit_eta as runtime_fit

    return runtime_fit(sizes, eta)


# ------------------------------------------------------------------------------------------------
# Sven's volumes (3.2, eq. (7)-(10)): each store's own (``memory/volumes.py``, the one copy)


def paper_volumes(N1: float, eta1: float, N2: float, eta2: float, d_msg: float, d_mem: float, M: int,
                  C0: float = 4.0) -> dict:
    """Eq. (7)-(9) as printed, by store: the bytes one iteration moves over all M trainers (sent and
    received), N1 / N2 the sampled / original vertices of the global batch; every registered store
    whose class gives one (``paper_volume``)."""
    out = {}
    for name in store_names():
        v = _store(name).paper_volume(N1, eta1, N2, eta2, M, d_mem * C0, d_msg * C0)
        if v is not None:
            out[name] = v
    return out


def volumes(backend: str, rows_sampled: float, rows_distinct: float, roots_distinct: float, row_bytes: float,
            mem_bytes: float, grad_mem_bytes: float, remote: float, group: int) -> tuple[float, float]:
    """Bytes on one trainer's link per iteration (its busier direction, as ``parallel.link`` charges
    an all-to-all), as (dispatch, aggregation), with store ``backend``: its class's ``traffic`` of
    a trainer whose batch samples ``rows_sampled`` rows, ``rows_distinct`` of them distinct, with
    ``roots_distinct`` distinct roots to write back; ``remote``: the share of rows another trainer
    of its group owns ((M - 1) / M for an ideal placement, the profile's measure otherwise). Over M
    trainers each sending and receiving this, the sums are the store's eq. (7)-(9) (see each
    store's ``traffic``)."""
    from tgdist.memory.volumes import TrainerRows

    rows = TrainerRows(rows_sampled, rows_distinct, roots_distinct, row_bytes, mem_bytes, grad_mem_bytes, remote)
    return _store(backend).traffic(rows, group)


def sven_beats_depcache(T: float, M: int) -> bool:
    """Eq. (10) (``memory.volumes.sven_beats_depcache``)."""
    from tgdist.memory.volumes import sven_beats_depcache as eq10

    return eq10(T, M)


def micro_count(compute_s: float, dispatch_s: float, overhead_s: float, n_max: int | None = None) -> int:
    """Micro-batches as ``micro_batches=auto`` chooses them (``runtime.pipelines.micro_count``);
    ``n_max``: ``pipeline.max_micro_batches``, its default when None."""
    from tgdist.config import section_schema
    from tgdist.runtime.pipelines import micro_count as auto

    if n_max is None:  # the default of whichever registered strategy reads the key
        from tgdist.runtime.build import load_strategies

        load_strategies()
        n_max = section_schema("pipeline")().max_micro_batches
    return auto(compute_s, dispatch_s, overhead_s, n_max)


# ------------------------------------------------------------------------------------------------
# Candidates


@dataclass
class Candidate:
    """One combination and what the model predicts for it (``refused``: why it cannot run)."""

    i: int
    j: int
    k: int
    backend: str
    pipeline: str
    placement: str | None
    batch_size: int
    epoch_s: float = math.nan
    iteration_s: float = math.nan
    iterations: int = 0
    stages: dict = field(default_factory=dict)  # stage -> epoch seconds on the critical path, unoverlapped
    memory_per_rank_gb: float = 0.0
    host_per_machine_gb: float = 0.0
    bytes_per_epoch: float = 0.0
    micro_batches: int = 1
    staleness: int = 0
    risk: list = field(default_factory=list)
    risk_level: int = 0
    refused: str | None = None
    notes: list = field(default_factory=list)

    @property
    def layout(self) -> str:
        return f"{self.i}x{self.j}x{self.k}"

    @property
    def world(self) -> int:
        return self.i * self.j * self.k

    def label(self) -> str:
        place = f"/{self.placement}" if self.placement else ""
        return f"{self.layout} {self.backend}{place} {self.pipeline} b={self.batch_size}"

    def overrides(self, cluster: Cluster | None = None) -> list[str]:
        out = [f"parallel.i={self.i}", f"parallel.j={self.j}", f"parallel.k={self.k}",
               f"memory.backend={_config_backend(self.backend, self.i * self.j)}",
               f"train.batch_size={self.batch_size}", *pipeline_options()[self.pipeline].overrides]
        if self.placement:
            out.append(f"partition.method={self.placement}")
        if cluster is not None:
            if cluster.simulated and self.world > 1:
                out.append(f"parallel.link={cluster.intra_link}")
            out.append(f"train.device={cluster.device}")
        return out

    def as_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d["layout"] = self.layout
        return d


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (pairs up to sqrt(n): a huge cluster is instant)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def layouts(world: int) -> list[tuple[int, int, int]]:
    """Every ``(i, j, k)`` with ``i * j * k = world``, i then j increasing."""
    return [(i, j, world // (i * j)) for i in _divisors(world) for j in _divisors(world // i)]


def combinations(cluster: Cluster, batch_sizes: int, backends: list[str], pipelines: int, methods: int) -> int:
    """How many combinations ``predict`` weighs for ``cluster`` (before any is refused)."""
    per_layout = sum(methods if _store(b).partitioned else 1 for b in backends) * pipelines * batch_sizes
    return len(layouts(cluster.trainers)) * per_layout


MAX_COMBINATIONS = 50_000  # about a minute of predict on a slow core; beyond it the user narrows the search


def _config_backend(backend: str, group: int) -> str:
    """``memory.backend`` as a launch line gives it: ``auto`` where that picks this store and the
    trainer builds it itself (memory in the process), else its name."""
    from tgdist import memory

    return "auto" if _store(backend).trainers_own and memory.resolve("auto", group) == backend else backend


def runtime_refusal(c: Candidate, cluster: Cluster | None = None, num_train_events: int | None = None) -> str | None:
    """What the runtime says of this combination before any data is read (the same checks: the
    pipeline's, the partitioned store's, and the world's, with the data's size where given: a
    memory parallelism k above the global batches of one pass is refused there as here)."""
    why = _settings_refusal(c.i, c.j, c.k, c.backend, c.pipeline, c.placement)
    if why is None and cluster is not None:
        why = _world_refusal(c.i, c.j, c.k, c.backend, cluster.machines, cluster.trainers_per_machine,
                             num_train_events, c.batch_size)
    return why


class _Plain(dict):
    """A composed config group's values, read as a ``DictConfig`` is (``cfg.key`` and ``cfg["key"]``)
    but at a dict's speed: the checks run for thousands of combinations on a large cluster."""

    def __getattr__(self, key: str):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


@functools.cache
def _placement_config(method: str):
    from tgdist.config import PlacementConfig

    return _Plain(OmegaConf.to_container(OmegaConf.structured(PlacementConfig(method=method))))


@functools.cache
def _settings_refusal(i: int, j: int, k: int, backend: str, pipeline: str, placement: str | None) -> str | None:
    """The runtime's own checks of the pipeline settings (``validate_pipeline``: its keys, then the
    strategy's ``validate``) and of the partitioned store's (``check_settings``), for one combination
    (cached: they read no batch size)."""
    from tgdist.config import ParallelConfig
    from tgdist.memory.placement import check_settings
    from tgdist.runtime.build import validate_pipeline

    try:
        validate_pipeline(pipeline_options()[pipeline].pipe, ParallelConfig(i=i, j=j, k=k), backend)  # (resolved)
        store = _store(backend)
        if store.partitioned:
            check_settings(store, j, _placement_config(placement or "reflexbicut"))
    except ConfigError as e:
        return str(e)
    return None


@functools.cache
def _world_refusal(i: int, j: int, k: int, backend: str, machines: int, per_machine: int, num_train_events: int | None,
                   batch_size: int) -> str | None:
    """``tgdist.distributed.world.validate`` as ``tgdist launch`` calls it for this layout on the
    cluster's machines, with the data's size (where the rules of the store's placement live: host
    shared memory needs k >= machines and a group on one machine), then the store's own rule for
    them where it has one (``layout_refusal``): what the printed launch line would be refused with."""
    from tgdist import memory
    from tgdist.distributed.schedule import Layout
    from tgdist.distributed.world import WorldInfo, validate

    layout = Layout(i, j, k)
    name = memory.resolve(_config_backend(backend, layout.group_size), layout.group_size)
    world = WorldInfo(world_size=layout.world_size, local_world_size=per_machine, num_nodes=machines,
                      launcher="torchrun")
    store = memory.store_class(name)
    try:
        validate(layout, world, name, placement=store.placement,
                 num_train_events=num_train_events, batch_size=batch_size if num_train_events else None)
    except ConfigError as e:
        return str(e)
    own = getattr(store, "layout_refusal", None)  # a store's own rule for the layout and the data's size
    return own(num_train_events, i, batch_size) if own is not None and num_train_events else None


def _row_bytes(data: dict) -> tuple[float, float]:
    """Bytes of one node's memory + mails (float32 vectors, float64 times) and of its memory alone."""
    S = int(data.get("mailbox_size", 1))
    mem = 4 * data["mem_dim"] + 8
    return mem + S * (4 * data["mail_dim"] + 8), mem


def _groups_span_machines(G: int, per_machine: int, machines: int) -> bool:
    """Whether a memory group of ``G`` consecutive ranks (groups tiling the ranks from 0) crosses a
    machine boundary: one does unless every boundary, a multiple of ``per_machine``, is a multiple
    of ``G`` (arithmetic, not a loop over the groups: a huge cluster is instant)."""
    return machines > 1 and per_machine % G != 0


def predict(profile: Profile, cluster: Cluster, *, batch_sizes: list[int] | None = None,
            backends: list[str] | None = None, pipelines: list[str] | None = None,
            placements: list[str] | None = None, check_runtime: bool = True) -> list[Candidate]:
    """Every combination for ``cluster``'s trainers, ranked: the runnable ones by predicted epoch time
    (accuracy risk beyond L last), then the refused ones. See the module docstring."""
    stage = StageFit.of(profile)
    rows = RowFit.of(profile)
    W, Q, P = cluster.trainers, cluster.trainers_per_machine, cluster.machines
    E = int(profile.data["num_train_events"])
    num_nodes = int(profile.data["num_nodes"])
    row_bytes, mem_bytes = _row_bytes(profile.data)
    grad_mem_bytes = 4.0 * profile.data["mem_dim"]
    copy_bytes = num_nodes * row_bytes
    if batch_sizes is None:  # DistTGL 3.2.4: each trainer takes S events, or L when L < S
        S = profile.saturation_batch or profile.batch_sizes()[len(profile.batches) // 2]
        batch_sizes = [min(S, profile.largest_batch) if profile.largest_batch else S]
    backends = backends or store_names()
    options = pipeline_options()
    pipelines = pipelines or list(options)
    for name in pipelines:
        if name not in options:
            raise ConfigError(f"pipeline {name}: give one of {', '.join(options)}")
    methods = placements or profile.methods() or ["reflexbicut"]
    n = combinations(cluster, len(batch_sizes), backends, len(pipelines), len(methods))
    if n > MAX_COMBINATIONS:
        raise ConfigError(f"cluster {cluster.name}: {cluster.machines:,} x {cluster.trainers_per_machine:,} trainers give "
                          f"{n:,} combinations to predict, more than {MAX_COMBINATIONS:,}: narrow them with --backends, "
                          f"--pipelines, --placements or --batch")
    here = cluster.simulated  # the profile's machine: its collectives' own cost applies
    coll = profile.collectives
    L = profile.largest_batch
    out: list[Candidate] = []
    for (i, j, k) in layouts(W):
        G = i * j
        for b in batch_sizes:
            for backend in backends:
                store = _store(backend)
                for method in (methods if store.partitioned else [None]):
                    for pipe in pipelines:
                        c = Candidate(i, j, k, backend, pipe, method, int(b))
                        out.append(c)
                        why = _layout_refusal(c, store, G)
                        if why is None and check_runtime:
                            why = runtime_refusal(c, cluster, E)
                        if why is not None:
                            c.refused = why
                            continue
                        price = _time(c, store, options[pipe], profile, cluster, stage, rows, G, W, Q, E, row_bytes,
                                      mem_bytes, grad_mem_bytes, here, coll)
                        _memory(c, store, profile, cluster, rows, G, W, Q, P, copy_bytes, row_bytes)
                        _risk(c, L, price.risk)
    ok = sorted((c for c in out if c.refused is None), key=lambda c: (c.risk_level >= 2, c.epoch_s))
    return ok + [c for c in out if c.refused is not None]


def _layout_refusal(c: Candidate, store: type, G: int) -> str | None:
    """What the advisor leaves out besides the runtime's refusals, from the store's capabilities:
    memory in a process serves one trainer; a store kept by collectives in a group of one holds
    its copy whole, as memory in the process does; memory served by its own process (host shared)
    is no use to one trainer alone."""
    if store.placement == "process" and G > 1:
        return (f"{c.backend} memory serves one trainer; a memory group of parallel.i x parallel.j = {G} trainers "
                f"needs a shared store")
    if store.placement == "collective" and G == 1:
        return f"one trainer per memory copy: memory.backend={c.backend} would hold it whole, as local memory does"
    if store.placement == "host_shared" and c.world == 1:
        return f"one trainer: local memory in the process, no memory.backend={c.backend} process"
    if c.batch_size < c.i:
        return f"local batch {c.batch_size} below parallel.i = {c.i}"
    return None


def _time(c: Candidate, store: type, option: PipelineOption, profile: Profile, cluster: Cluster, stage: StageFit,
          rows: RowFit, G: int, W: int, Q: int, E: int, row_bytes: float, mem_bytes: float, grad_mem_bytes: float,
          here: bool, coll: dict):
    """The candidate's iteration and epoch: the stages at its batch, the store's costs (its memory
    read and write, its exchanges' bytes and collectives), the links, the pipeline's overlap (its
    strategy's ``price``), shared cores and the wait for the slowest rank. Returns the ``Price``."""
    from tgdist.memory.volumes import TrainerRows
    from tgdist.runtime.pipelines.base import IterationCosts

    b = c.batch_size
    S, F, C = stage.at("sample", b), stage.at("features", b), stage.at("compute", b)
    R, Wr, helper_cpu = store.price_memory(stage.at("memory_read", b), stage.at("memory_write", b),
                                           stage.at("memory_write", G * b), G)
    place = profile.placement(c.placement, G) if c.placement else None
    remote = place.remote_share if place else (G - 1) / G
    imbalance = place.imbalance if place else 1.0
    if c.placement and place is None:
        c.notes.append(f"placement {c.placement} not profiled at M={G}: the ideal share (M-1)/M assumed")
    disp_b, agg_b = store.traffic(TrainerRows(rows.sampled(b), rows.distinct(b), rows.roots_distinct(b), row_bytes,
                                              mem_bytes, grad_mem_bytes, remote), G)
    disp_b, agg_b = disp_b * imbalance, agg_b * imbalance
    n_disp, n_agg = store.collectives
    mem_link = cluster.link(_groups_span_machines(G, Q, cluster.machines))
    grad_link = cluster.link(W > Q)
    lat = mem_link.latency
    D = (n_disp * lat + disp_b / mem_link.bandwidth) if n_disp and G > 1 else 0.0
    A = (n_agg * lat + agg_b / mem_link.bandwidth) if n_agg and G > 1 else 0.0
    Gr = link_seconds("all_reduce", profile.grad_bytes, W, grad_link)
    coll_cpu = 0.0
    if here:  # the real collectives between processes of this machine, besides the modelled link:
        # each as training processes pay it where the profile measured that (measure.paid_costs), else idle
        bps = coll.get("bytes_per_s") or math.inf
        idle = coll.get("fixed_s", 0.0)
        store_calls = n_disp + n_agg if G > 1 else 0
        coll_cpu = (store_calls * coll.get("exchange_s", idle) + (coll.get("gradient_s", idle) if W > 1 else 0.0)
                    + ((disp_b + agg_b) * (1 if G > 1 else 0) + (profile.grad_bytes if W > 1 else 0)) / bps)
    micro_o = stage.a["sample"] + stage.a["features"] + stage.a["memory_read"] + stage.a["compute"] + n_disp * lat
    iters = max(1, math.ceil(E / (W * b)))
    price = option.strategy.price(option.pipe, IterationCosts(
        sample=S, features=F, memory_read=R, dispatch=D, compute=C, memory_write=Wr, aggregation=A, allreduce=Gr,
        collective_cpu=coll_cpu, micro_overhead=micro_o, micro_latency=n_disp * lat, overlap=_overlap(profile),
        iterations=iters))
    path, n = price.path, price.micro_batches
    c.staleness = price.staleness
    cpu_rank = S + F + R + C + Wr + coll_cpu + price.extra_cpu
    T = path
    sharing = _sharing(profile, cluster)
    if sharing is not None:
        groups_here = max(1, Q // G) if store.placement == "host_shared" else 0  # the processes serving groups
        busy = (Q * cpu_rank + groups_here * helper_cpu) / max(path, 1e-12)  # processes at work, on average
        slower = sharing(busy)
        T = path + (slower - 1.0) * min(cpu_rank, path)
        if slower > 1.0:
            c.notes.append(f"shared cores: {busy:.1f} processes at work, CPU stages {slower:.2f}x slower")
    phases = (1 if n_disp and G > 1 else 0) + (1 if n_agg and G > 1 else 0) + 1  # points where ranks meet
    wait = _straggler(profile, b, W, phases) * min(cpu_rank + (T - path), T)
    T += wait
    c.iterations = iters
    c.micro_batches = n
    c.iteration_s = T
    c.epoch_s = (iters + c.j - 1) * T
    per = {"sample": S, "features": F, "memory_read": R, "dispatch": D, "compute": C, "memory_write": Wr,
           "aggregation": A, "allreduce": Gr, "collective_cpu": coll_cpu, "straggler": wait}
    c.stages = {s: v * iters for s, v in per.items()}
    c.bytes_per_epoch = iters * W * ((disp_b + agg_b if G > 1 else 0.0) + (2 * (W - 1) / W * profile.grad_bytes))
    return price


@functools.cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal variables] (0 for n = 1, 1 / sqrt(pi) for 2, 1.029 for
    4): integral of x n phi(x) Phi(x)^(n - 1), numerically."""
    if n <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 48001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    y = x * n * phi * cdf ** (n - 1)
    return float(np.sum((y[1:] + y[:-1]) * 0.5 * np.diff(x)))


def _straggler(profile: Profile, b: float, W: int, phases: int = 1) -> float:
    """What W ranks that synchronise every iteration wait for the slowest, as a share of a rank's CPU
    seconds: an iteration's time varies from rank to rank (other batches, another part of the
    stream, the machine's jitter); with the profile's step-time spread cv at batch b (``step_cv``,
    interpolated between the profiled sizes), the slowest of W is modelled as normal, E[max] = mean
    + cv * mean * ``expected_max_normal(W)``. A store whose exchanges meet ``phases`` times per
    iteration (a partitioned store's dispatch and aggregation, and the gradients) splits the
    iteration into that many parts, each waited for: with independent parts of variance
    1 / phases each, the waits sum to sqrt(phases) times one. Not from the four papers: an order
    statistic; 0 for one trainer or a profile without the spread."""
    if W <= 1:
        return 0.0
    pts = sorted((bp.batch_size, float(bp.step_cv)) for bp in profile.batches)
    cv = float(np.interp(b, [p[0] for p in pts], [p[1] for p in pts]))
    return cv * expected_max_normal(W) * math.sqrt(max(phases, 1)) if cv > 0 else 0.0


def _overlap(profile: Profile) -> float:
    """The share of the ideal overlap that stages in threads of one process buy (prefetch's
    sampling, MSPipe's stage threads): the profile's measure, else 1 (the papers' perfect overlap)."""
    value = (profile.overlap or {}).get("prefetch")
    return 1.0 if value is None else min(max(float(value), 0.0), 1.0)


def _sharing(profile: Profile, cluster: Cluster):
    """The slowdown of x processes at work side by side on one of the cluster's machines, as a
    function of x, or None where each trainer has a device of its own: the profile's measure
    (``core_sharing``, linear between the measured counts, proportional beyond) for trainers on the
    profile's machine, else x / cores for CPU trainers."""
    if cluster.cores_per_machine is None:
        return None
    measured = {int(r): float(v) for r, v in (profile.core_sharing or {}).items() if str(r).isdigit()}
    if cluster.simulated and len(measured) >= 2:
        xs = sorted(measured)
        ys = [measured[x] for x in xs]

        def from_profile(x: float) -> float:
            if x <= xs[-1]:
                return max(1.0, float(np.interp(x, xs, ys)))
            return max(1.0, ys[-1] * x / xs[-1])

        return from_profile
    cores = cluster.cores_per_machine
    return lambda x: max(1.0, x / cores)


def _memory(c: Candidate, store_class: type, profile: Profile, cluster: Cluster, rows: RowFit, G: int, W: int, Q: int,
            P: int, copy_bytes: float, row_bytes: float) -> None:
    b = c.batch_size
    params = 4.0 * profile.grad_bytes  # weights, gradients, Adam's two moments
    working = 3 * rows.distinct(b) * row_bytes + 6 * rows.sampled(b) * 4 * profile.data["mem_dim"]
    place = profile.placement(c.placement, G) if c.placement else None
    store = store_class.bytes_per_rank(copy_bytes, G, place.imbalance if place else 1.0)
    rank = params + working + store
    # memory in host shared memory: one copy per memory group on the machine
    groups_per_machine = max(1, Q // G) if store_class.placement == "host_shared" else 0
    host = Q * profile.graph_bytes + groups_per_machine * copy_bytes
    if cluster.device_memory_gb is None:  # CPU trainers: the rank lives in host memory
        host += Q * rank
    c.memory_per_rank_gb = rank / 2**30
    c.host_per_machine_gb = host / 2**30
    if cluster.device_memory_gb is not None and rank > cluster.device_memory_gb * 2**30:
        c.refused = (f"needs {rank / 2**30:.1f} GiB per trainer, the device has {cluster.device_memory_gb:g} GB "
                     f"({c.backend}{' holds a whole copy of node memory' if store == copy_bytes else ''})")
    elif host > cluster.host_memory_gb * 2**30:
        c.refused = (f"needs {host / 2**30:.1f} GiB of host memory per machine, which has {cluster.host_memory_gb:g} GB"
                     + (f" ({groups_per_machine} memory copies per machine)" if groups_per_machine else ""))


def _risk(c: Candidate, L: int | None, pipeline_risk: list) -> None:
    g = c.i * c.batch_size
    if L is not None and g > L:
        c.risk.append(f"global batch {g} > L = {L} (DistTGL 3.2.4: accuracy drops beyond it)")
        c.risk_level = 2
    if c.j > 1:
        c.risk.append(f"epoch parallelism j = {c.j} (DistTGL Fig. 9b: converges slower than memory parallelism)")
        c.risk_level = max(c.risk_level, 1)
    for level, why in pipeline_risk:  # what the pipeline changes in training (its strategy's ``price``)
        c.risk.append(why)
        c.risk_level = max(c.risk_level, level)
