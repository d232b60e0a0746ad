"""Build a ready-to-run ``Trainer`` from a composed config (also the Python API for scripts)."""

from __future__ import annotations

import logging
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from tgdist import memory, plugins, version_line, wait_policy
import tgdist.config as schema_module
from tgdist.config import TrainApp, model_tag, parse_count_or_auto
from tgdist.config.overrides import checked_compose, counts_or_auto
from tgdist.data.graph import (
    feature_scale_notes,
    TIME_UNITS,
    TemporalGraph,
    chronological_split,
    epoch_time_unit,
    label_classes,
    label_ranges,
)
from tgdist.data import readers, tgb
from tgdist.data.device_sampler import DeviceSampler
from tgdist.data.load import check_data_source, load_data
from tgdist.data.sampler import TCSR, NegativeSampler, TemporalSampler
from tgdist.distributed.link import parse_link
from tgdist.distributed.schedule import Layout, passes_per_group, scaled_lr
from tgdist.errors import ConfigError
from tgdist.kernels import graph as kernels
from tgdist.memory.placement import check_settings
from tgdist.models import model_class, names as model_names
from tgdist.models.modules import build_model, use_cpu_kernels
from tgdist.runtime import checkpoint, pipelines, tensorboard
from tgdist.runtime.cache import EmbeddingCache, default_size
from tgdist.runtime.features import stays_on_host
from tgdist.runtime.tasks import check_evaluation
from tgdist.runtime.trainer import Trainer, memory_for, time_scale

log = logging.getLogger(__name__)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name} but CUDA is not available on this machine")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"train.device={name} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python's, numpy's and torch's global generators, and set torch's deterministic mode
    as configured: on or off, so a run after a deterministic one in the same process is not
    left in that mode. On CUDA, cuBLAS is deterministic only with a fixed workspace, which torch
    checks for (it raises at the first matrix product otherwise): that is set unless the user set
    one (it takes effect for cuBLAS handles made after it, so before the model's first product)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(bool(deterministic))


def validate_pipeline(pipe, parallel=None, backend: str = "local") -> None:
    """The ``pipeline`` settings: the ranges of the keys every strategy reads, then the strategy
    ``pipeline.mode`` names (``runtime.pipelines``) checks its own, given the layout and the memory
    store (``backend``: a registered name, ``auto`` already resolved)."""
    strategy = pipelines.pipeline_class(pipe.mode)  # an unknown mode: the one line naming the options
    if pipe.prefetch < 0:
        raise ConfigError(f"pipeline.prefetch={pipe.prefetch}: give the batches to sample ahead (0: none)")
    if pipe.profile_iterations < 2:
        raise ConfigError(f"pipeline.profile_iterations={pipe.profile_iterations}: give at least 2 (auto measures "
                          f"iterations with one and with two micro-batches)")
    strategy.validate(pipe, parallel, backend)


@dataclass(frozen=True)
class Resolved:
    """What ``validate`` resolved from a config, once: every ``auto`` and every name the run acts on.
    The run, its trainer and the launcher read these instead of resolving the config again.

    - ``layout``: DistTGL's i x j x k;
    - ``backend``: the memory store (``memory.backend`` with ``auto`` resolved by the layout) and
      ``store``, its class (what it can do);
    - ``pipeline``: the strategy ``pipeline.mode`` names (an older alias as its name) and
      ``strategy``, its class;
    - ``lr``: ``train.lr`` scaled with the global batch by ``lr_scaling`` (``train.lr_scaling``);
    - ``device``: ``train.device`` with ``auto`` resolved (``cuda`` where there is one);
    - ``counts``: each count-or-auto key of the config (``pipeline.micro_batches``, ...) as its
      count, or None for ``auto`` (chosen while training); ``micro_batches``: the batches' cut
      under the chosen strategy (1 for one that takes whole batches, None for auto)."""

    layout: Layout
    backend: str
    store: type
    pipeline: str
    strategy: type
    lr: float
    lr_scaling: str
    device: str
    counts: dict = field(default_factory=dict)
    micro_batches: int | None = 1


def validate(cfg: DictConfig) -> Resolved:
    """Reject invalid settings (and a resume checkpoint that is not there) before any data is read,
    and return what they resolve to (``Resolved``): the one check of a config, which its caller
    passes on (``Run``, ``build_trainer``) rather than checking again. A value outside a key's
    fixed options (``model.name``, ...) and a key the chosen strategy does not read are refused
    earlier, when the config is composed (``compose``); ``memory.backend`` and ``pipeline.mode``
    name registered strategies, checked here."""
    return _validate(cfg)


def _validate(cfg: DictConfig) -> Resolved:
    t, m = cfg.train, cfg.model
    if t.tensorboard and (why := tensorboard.missing()) is not None:
        raise ConfigError(why)
    if t.batch_size <= 0:
        raise ConfigError(f"train.batch_size={t.batch_size}: give a positive number of events per batch")
    if t.epochs < 0:
        raise ConfigError(f"train.epochs={t.epochs}: give a count of at least 0 (0 evaluates the untrained model)")
    if not 0 < t.lr < math.inf:
        raise ConfigError(f"train.lr={t.lr}: give a positive, finite learning rate")
    if cfg.memory.backend != "auto" and cfg.memory.backend not in memory.names():  # a registered store, or auto
        raise ConfigError(f"memory.backend={cfg.memory.backend}: choose one of auto, {', '.join(memory.names())}")
    layout = Layout(cfg.parallel.i, cfg.parallel.j, cfg.parallel.k)  # each a positive integer
    backend = memory.resolve(cfg.memory.backend, layout.group_size)  # auto resolved here, once
    store = memory.store_class(backend)
    validate_pipeline(cfg.pipeline, cfg.parallel, backend)
    model = model_class(m.name)  # what the model reads, from its class (tgdist.models.registry)
    fanouts = list(cfg.sampler.fanouts)
    if (not fanouts and model.samples_neighbours()) or (fanouts and min(fanouts) <= 0):  # JODIE samples none
        raise ConfigError(f"sampler.fanouts={fanouts}: give one positive neighbour count per hop, e.g. [10]")
    if t.stop_after_batches is not None and t.stop_after_batches <= 0:
        raise ConfigError(f"train.stop_after_batches={t.stop_after_batches}: give a positive number of batches or null")
    if cfg.data.max_events is not None and cfg.data.max_events <= 0:
        raise ConfigError(f"data.max_events={cfg.data.max_events} keeps no events: give a positive count or null")
    for key, least in {"mem_dim": 1, "num_heads": 1, "mailbox_size": 1, "time_dim": 0}.items():
        if m[key] < least:
            raise ConfigError(f"model.{key}={m[key]}: must be at least {least}")
    if not 0 <= m.dropout <= 1:
        raise ConfigError(f"model.dropout={m.dropout}: give a probability in [0, 1]")
    if m.mem_dim % m.num_heads and model.attention_heads:  # JODIE has no attention
        raise ConfigError(f"model.mem_dim={m.mem_dim} must be divisible by model.num_heads={m.num_heads}")
    if m.mailbox_size != 1 and not model.mailbox:  # settings a model does not read are refused, not ignored
        keep = [name for name in model_names() if model_class(name).mailbox]
        raise ConfigError(f"model.mailbox_size={m.mailbox_size}: only {' and '.join(k.upper() for k in keep)} "
                          f"{'keeps' if len(keep) == 1 else 'keep'} a mailbox (model={'|'.join(keep)}); "
                          f"{m.name.upper()} keeps each node's latest mail")
    least = {"train.seed": 0, "train.num_threads": 0, "train.checkpoint_every": 0, "train.num_neg_eval": 0,
             "train.node_class_epochs": 1, "model.static_pretrain_epochs": 0, "sampler.num_threads": 0,
             "train.patience": 0, "train.eval_every": 1}
    for key, bound in least.items():
        value = OmegaConf.select(cfg, key)  # (None: a key of a strategy not chosen)
        if value is not None and value < bound:
            raise ConfigError(f"{key}={value}: must be at least {bound}")
    if m.static_pretrain_epochs > 0 and not m.static_memory:
        raise ConfigError(f"model.static_pretrain_epochs={m.static_pretrain_epochs} pre-trains the static node memory, "
                          f"which model.static_memory=false leaves out: add model.static_memory=true")
    store.check_config(cfg.memory)  # the store's own keys (its config class's), checked by the store
    if model.stores is not None and backend not in model.stores:
        chosen = f"{cfg.memory.backend} ({backend})" if backend != cfg.memory.backend else backend
        raise ConfigError(f"memory.backend={chosen}: {m.name.upper()} keeps its memory in "
                          f"{', '.join(model.stores)} only")
    if store.partitioned:  # epoch parallelism, partition.* settings
        check_settings(store, cfg.parallel.j, cfg.partition)
        if layout.group_size == 1 and layout.world_size > 1:
            log.warning("memory.backend=%s with one trainer per memory copy (parallel.i x parallel.j = 1) partitions "
                        "nothing: each copy is whole in its trainer, as local memory is; partitioning needs "
                        "parallel.i x parallel.j > 1", cfg.memory.backend)
    strategy = pipelines.pipeline_class(cfg.pipeline.mode)
    micro = strategy.micro_batches(cfg.pipeline)  # None: auto, which stays within max_micro_batches
    if micro is not None and micro > t.batch_size:
        raise ConfigError(f"pipeline.micro_batches={micro} cuts each batch of train.batch_size={t.batch_size} events "
                          f"(per trainer) into more micro-batches than it has events: give at most {t.batch_size}")
    if m.num_layers not in (1, 2):
        raise ConfigError(f"model.num_layers={m.num_layers}: 1 or 2 attention layers are supported")
    if m.num_layers > model.max_layers:
        raise ConfigError(f"model.num_layers={m.num_layers}: {m.name.upper()} has no attention layers to stack; "
                          f"a second layer is TGN's (model=tgat2)")
    hops = model.neighbour_hops  # None: one hop per attention layer
    if hops is not None and len(fanouts) > max(hops, 1):  # (one entry, the default [10], is left unread)
        what = ("samples no neighbours" if hops == 0 else "delivers mails to one hop of sampled neighbours"
                if model.delivers_to_neighbours else f"samples {hops} hop{'s' * (hops != 1)} of neighbours")
        raise ConfigError(f"sampler.fanouts={fanouts} gives {len(fanouts)} hops, but {m.name.upper()} {what}")
    if hops is None and len(fanouts) > m.num_layers:  # the extra hops would be dropped unsaid
        fix = ("use model=tgat2 (or model.num_layers=2) for two hops" if len(fanouts) == 2
               else "give one neighbour count per layer")
        raise ConfigError(f"sampler.fanouts={fanouts} gives {len(fanouts)} hops, but model.num_layers={m.num_layers} "
                          f"attends over {m.num_layers}: {fix}")
    check_cache(cfg)
    parse_link(cfg.parallel.link)  # a link that is not one: refused before the launch
    if t.epochs == 0 and (layout.i * layout.j * layout.k > 1 or not store.evaluates_untrained):
        raise ConfigError(f"train.epochs=0 (evaluate the untrained model) runs in one process; a parallel run "
                          f"needs a positive multiple of parallel.j x parallel.k = {layout.j * layout.k}")
    if layout.i * layout.j * layout.k > 1 and (t.patience or t.eval_every != 1):
        key = f"train.patience={t.patience}" if t.patience else f"train.eval_every={t.eval_every}"
        raise ConfigError(f"{key}: a parallel run validates once, at its end, so it neither stops early nor "
                          f"validates between epochs; drop it, or train in one process")
    if t.epochs:
        passes_per_group(layout, t.epochs)  # a multiple of j x k: checked here so launchers refuse it up front
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", t.device):
        raise ConfigError(f"train.device={t.device!r}: choose auto, cpu, cuda or cuda:N")
    resolve_device(t.device)  # cuda where there is none: refused here, before the data is read (resolved below)
    d = cfg.data
    readers.check_format(d.format)  # a registered reader, or auto
    if not (0 <= d.val_frac < 1 and 0 <= d.test_frac < 1 and d.val_frac + d.test_frac < 1):
        raise ConfigError(f"data.val_frac={d.val_frac}, data.test_frac={d.test_frac}: each must be in [0, 1) "
                          f"and their sum below 1 (the rest is the training part)")
    if t.eval == "tgb" and not readers.carries_protocol(d.format):
        raise ConfigError(f"train.eval=tgb ranks each event against the negatives a TGB data set ships, and "
                          f"data.format={d.format} ships none: use data=tgb data.name=tgbl-... (or train.eval=tgdist)")
    if t.save_scores and t.eval != "tgb":
        raise ConfigError("train.save_scores=true writes the scores of train.eval=tgb: add train.eval=tgb")
    if t.resume:  # a checkpoint that is not there (whether it fits this run is checked when it is read)
        checkpoint.find(t.resume)
    counts = {key: parse_count_or_auto(OmegaConf.select(cfg, key), key, least, what)
              for key, (least, what) in counts_or_auto(TrainApp, cfg=cfg)}
    return Resolved(layout=layout, backend=backend, store=store, pipeline=strategy.name or str(cfg.pipeline.mode),
                    strategy=strategy, lr=scaled_lr(t.lr, layout.i, layout.j, layout.k, t.lr_scaling),
                    lr_scaling=str(t.lr_scaling), device=resolve_device(t.device), counts=counts, micro_batches=micro)


def check_cache(cfg: DictConfig) -> None:
    """The historical embedding cache's settings (``cache.*``), refused in one line."""
    c, m = cfg.cache, cfg.model
    if not 0 <= c.p_grad <= 1:
        raise ConfigError(f"cache.p_grad={c.p_grad}: give the admitted fraction of each batch's pairs, in [0, 1]")
    if c.t_stale < 0:
        raise ConfigError(f"cache.t_stale={c.t_stale}: give a number of iterations of at least 0")
    if c.size is not None and c.size < 1:
        raise ConfigError(f"cache.size={c.size}: give a positive number of table rows, or null")
    if c.enabled and (not model_class(m.name).embedding_cache or m.num_layers < 2):
        raise ConfigError(f"cache.enabled=true caches inner-layer embeddings, which {model_tag(m.name, m.num_layers)} "
                          f"does not have: use a model with two attention layers (model=tgat2)")


def build_cache(cfg: DictConfig, graph: TemporalGraph, model, fanouts: list[int], device: str) -> EmbeddingCache | None:
    """The trainer's historical embedding cache, or None (``cache.enabled=false``). Each trainer of a
    parallel run has its own."""
    c = cfg.cache
    if not c.enabled:
        return None
    rows_per_batch = 3 * cfg.train.batch_size * fanouts[0]  # roots (src, dst, one negative) x hop-1 slots
    size = c.size or default_size(c.p_grad, c.t_stale, rows_per_batch, graph.num_events)
    log.info("historical embedding cache: p_grad %g, t_stale %d, %d rows of %d", c.p_grad, c.t_stale, size,
             model.mem_dim)
    if torch.device(device).type == "cuda":
        log.warning("cache.enabled=true on a GPU: measured slower there (0.84-0.92x a step on an H200, Wikipedia, "
                    "batch 600-2000): the layer-1 work it skips is nearly free on a GPU and its bookkeeping runs on "
                    "the host (benchmarks/results/gpu_checks.md)")
    return EmbeddingCache(graph.src, model.mem_dim, p_grad=c.p_grad, t_stale=c.t_stale, size=size,
                          share=c.share_in_batch, device=device)


def precheck(cfg: DictConfig) -> Resolved:
    """What can be checked before a run starts, without reading the data: the settings
    (``validate``, whose resolved choices it returns) and that the data file is there. Sweeps and
    ``tgdist launch`` run it for every job before the first starts."""
    choices = validate(cfg)
    check_data_source(cfg.data)
    return choices


def check_labels(task: str, graph: TemporalGraph, split) -> None:
    """The labels ``train.task=node|edge`` will use exist and make targets (a ConfigError or
    DataError otherwise, before any training): per-event labels, or for the node task the node
    labels at times of a TGL ``labels.csv``, of which some fall in the training part."""
    if graph.label is not None:
        label_classes(graph.label, graph.name)
        return
    if graph.node_labels is None:
        hint = (" (an edge list's label column is read as an edge feature unless data.columns names it, e.g. "
                "'src,dst,t,label')" if graph.edge_dim else "")
        raise ConfigError(f"train.task={task} needs labels, and data {graph.name!r} has none{hint}")
    if task == "edge":
        raise ConfigError(f"train.task=edge needs a label per event, and data {graph.name!r} has node labels at "
                          f"times (labels.csv) only: use train.task=node")
    label_classes(graph.node_labels.label, graph.name)
    lo, hi = label_ranges(graph.node_labels, graph, split)["train"]
    if hi <= lo:
        raise ConfigError(f"train.task=node: none of the {len(graph.node_labels):,} node labels of data {graph.name!r} "
                          f"falls before the validation part, so the decoder has nothing to learn from")


# (graph, split, model, fanouts, device) -> the trainer's memory store: how ``Run`` gives the trainer
# the store its config names (``build_trainer``'s ``store``)
StoreFactory = Callable[[TemporalGraph, object, object, tuple, str], object]


def build_trainer(cfg: DictConfig, graph: TemporalGraph | None = None, device: str | None = None,
                  progress: bool | None = None, cpus: int | None = None, local_memory: bool = True,
                  choices: Resolved | None = None, store: StoreFactory | None = None) -> Trainer:
    """Data, split, model, memory, sampler and optimizer as ``cfg`` says.

    ``choices``: what ``validate(cfg)`` returned, when the caller validated it (else validated
    here). ``store``: makes the trainer's memory store from the data, model and sampler, before the
    trainer is built with it (``Run`` passes the store its config names; a store the factory made
    is closed when the build fails after it); None: the trainer's own local memory.
    ``train.num_threads`` (torch) and ``sampler.num_threads`` (numba: the sampler and the CPU
    kernels) left at 0 use ``cpus`` threads: by default every CPU this process may run on; a
    parallel run passes its share of the machine (``distributed.cpu_share``).
    ``local_memory=False`` (without ``store``) gives the trainer an empty memory of no rows, for a
    caller that puts the store of another backend in its place: the whole memory and mails (1M
    nodes of TGN: 1.1 GiB) are then never allocated, which a partitioned backend's peak would
    otherwise carry.
    """
    choices = choices or validate(cfg)
    cpus = cpus or kernels.available_cpus()
    torch_threads, numba_threads = cfg.train.num_threads or cpus, cfg.sampler.num_threads or cpus
    torch.set_num_threads(torch_threads)
    numba_threads = kernels.set_threads(numba_threads)  # the sampler's and the CPU kernels'
    seed_everything(cfg.train.seed, cfg.train.deterministic)
    if graph is not None:
        graph = graph.check()  # a graph made in Python: checked
    else:  # named as the run names it (a tgdist .npz carries the name it was written under)
        graph = load_data(cfg.data)
        graph.name = cfg.data.name or graph.name
    split = chronological_split(graph, cfg.data.val_frac, cfg.data.test_frac)
    if cfg.train.task in ("node", "edge"):  # found before training, not after
        check_labels(cfg.train.task, graph, split)
    lo, hi = split.range("train")
    if hi <= lo and cfg.train.epochs > 0:
        n = graph.num_events
        first = int(np.searchsorted(graph.t, graph.t[0], side="right"))  # events at the first timestamp
        if n > 1 and graph.t[0] == graph.t[-1]:
            why = (f"; every event has the time {graph.t[0]}: if the time is another column, name the columns with "
                   f"data.columns, e.g. 'src,dst,_,t'")
        elif n > 1:  # the cut moves back to the first timestamp, which holds too many events
            why = (f"; the first timestamp ({graph.t[0]}) holds {first:,} events ({first / n:.0%}), and a training "
                   f"part must end before the validation part's timestamp: lower data.val_frac + data.test_frac "
                   f"below {1 - first / n:.2f}")
        else:
            why = ""
        raise ConfigError(f"no training events: the chronological split of {n:,} event{'s' * (n != 1)} "
                          f"(val_frac {cfg.data.val_frac}, test_frac {cfg.data.test_frac}, cut back to whole "
                          f"timestamps) leaves none before the validation part{why}")
    check_evaluation(cfg, graph, split)  # no val/test events (or labels) to compute a metric on: refused
    # after the checks of the data: an error in it, or in the task it is read for, stays the one line on stderr
    log.info("%s", graph.describe())
    log.info("%s; threads: %d torch, %d numba; OpenMP %s", version_line(), torch_threads, numba_threads, wait_policy())
    if graph.mapped is None:  # a mapped graph's were found when its cache entry was built (its notes)
        for note in feature_scale_notes(graph):
            log.warning("%s", note)
    unit = cfg.data.time_unit
    if unit == "auto":
        unit = epoch_time_unit(graph.t)
        if unit != "s":
            log.info("the times look like Unix %s: the model reads them as seconds (data.time_unit=s reads them as "
                     "they are)", {"ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}[unit])
    units_per_second = TIME_UNITS[unit]
    m = cfg.model
    model = build_model(m.name, num_nodes=graph.num_nodes, mem_dim=m.mem_dim, time_dim=m.time_dim,
                        edge_dim=graph.edge_dim, node_dim=graph.node_dim, num_layers=m.num_layers,
                        num_heads=m.num_heads, dropout=m.dropout, mailbox_size=m.mailbox_size,
                        static_memory=m.static_memory,
                        time_scale=time_scale(graph) / units_per_second if model_class(m.name).uses_time_scale else 1.0)
    use_cpu_kernels(model, m.cpu_kernels)
    dev = device or choices.device
    model.to(dev)
    sampler = cache = None
    if model.num_hops:
        fanouts = list(cfg.sampler.fanouts)
        if len(fanouts) < model.num_hops:  # e.g. model=tgat2 with the default [10]
            fanouts += [fanouts[-1]] * (model.num_hops - len(fanouts))
        sampler = TemporalSampler(TCSR.build(graph, cfg.sampler.both_directions), fanouts[:model.num_hops],
                                  cfg.sampler.strategy, cfg.sampler.seed, numba_threads)
        cache = build_cache(cfg, graph, model, fanouts, dev)
    negatives = NegativeSampler(graph, cfg.train.seed)
    candidates = negatives.high - negatives.low
    if candidates == 1:  # every negative is the positive: AP and ROC-AUC 0.5, and nothing to learn
        log.warning("there is 1 candidate destination (node %s): every negative is the event's own destination, "
                    "so link prediction has nothing to tell apart", graph.node_map[negatives.low])
    elif cfg.train.num_neg_eval > candidates and cfg.train.eval != "tgb":  # (tgb: the data set's own negatives)
        log.warning("train.num_neg_eval=%d is more than the %d candidate destinations; MRR's negatives are drawn with "
                    "replacement, so many repeat", cfg.train.num_neg_eval, candidates)
    if store is None:
        mem = memory_for(model, graph.num_nodes if local_memory else 0).to(dev)
    else:
        mem = store(graph, split, model, tuple(sampler.fanouts) if sampler is not None else (), dev)
    try:
        on_device = device_sampler(cfg, choices, graph, model, sampler, cache, mem, dev)
        tr = Trainer(graph, split, model, mem, sampler, negatives, batch_size=cfg.train.batch_size, lr=cfg.train.lr,
                     num_neg_eval=cfg.train.num_neg_eval, device=dev,
                     progress=cfg.train.progress if progress is None else progress, num_threads=torch_threads,
                     units_per_second=units_per_second, cache=cache, device_sampler=on_device)
        if cfg.train.eval == "tgb":  # both files read and matched now, before training (tgb.shipped_negatives)
            tr.shipped = tgb.shipped_negatives(cfg.data.name, tgb.root_of(cfg.data), graph, split)
    except BaseException:
        if store is not None:
            mem.close()  # the factory's store (a daemon, say) goes with the failed build
        raise
    return tr


def device_sampler(cfg: DictConfig, choices: Resolved, graph: TemporalGraph, model, sampler: TemporalSampler | None,
                   cache, mem, dev) -> DeviceSampler | None:
    """The recent sampler on the trainer's device (``sampler.on_device``: null on a GPU wherever it
    applies, true required, false never), or None. Its batches carry a node table without
    dedup, so it serves the stores that read repeated ids (``reads_repeated_ids``: local memory,
    DepCache) and the steps that need no host copy of the sampled hops: not APAN's deliveries to
    sampled neighbours, FreshGNN's embedding cache or MSPipe's staleness mitigation, which read
    them on the host, and features on the device (not ``stays_on_host``). Null keeps the
    host's sampler under ``train.deterministic=true``: there every store gives local memory's
    scores exactly, and the device sampler's table sums the gradients in another order."""
    wanted = cfg.sampler.get("on_device")
    if sampler is None or wanted is False or (wanted is None and (torch.device(dev).type != "cuda"
                                                                  or cfg.train.deterministic)):
        return None
    why = [reason for reason, applies in (
        (f"sampler.strategy={cfg.sampler.strategy} (the device sampler is recent's)", cfg.sampler.strategy == "recent"),
        (f"model={cfg.model.name} delivers mails to sampled neighbours on the host", not model.deliver_to_neighbors),
        ("the embedding cache (cache.*) looks up the sampled hops on the host", cache is None),
        (f"memory.backend={choices.backend} reads distinct ids (across processes)", mem.reads_repeated_ids),
        ("pipeline.mode=mspipe reads the sampled nodes on the host", choices.pipeline != "mspipe"),
        ("the features stay in host memory (too large for the device), where each slot's rows would be gathered",
         not (stays_on_host(graph.edge_feat, dev) or stays_on_host(graph.node_feat, dev))),
    ) if not applies]
    if why:
        if wanted:
            raise ConfigError(f"sampler.on_device=true does not apply here: {'; '.join(why)} (drop sampler.on_device)")
        log.info("the sampler runs on the host: %s", "; ".join(why))
        return None
    ds = DeviceSampler(sampler.tcsr, sampler.fanouts, dev)
    log.info("the recent sampler runs on %s (%.1f MiB of T-CSR there)", dev, ds.nbytes() / 2 ** 20)
    return ds


def compose(overrides: list[str] | None = None, config_name: str = "train",
            return_hydra_config: bool = False) -> DictConfig:
    """The config ``tgdist train OVERRIDES`` would run with (for scripts, benchmarks and tests);
    with ``return_hydra_config``, Hydra's own settings too (under ``hydra``). A bad override (a key
    not in the config, ``+key`` included, a value of the wrong type, an unknown group option)
    raises ``ConfigError`` with the line the command would print, and so is a key that the chosen
    memory store or pipeline strategy does not read (each has its own config class:
    ``tgdist.config.register_option``). Hydra's global state is reset. Extensions
    (``TGDIST_PLUGINS``, ``tgdist.plugins``) are imported first, as the command does, so the names
    they register (``model.name=...``, ``memory.backend=...``) compose. Validate the result with
    ``validate``, which returns the resolved choices."""
    load_strategies()
    return checked_compose(list(overrides or []), config_name, return_hydra_config)


def __getattr__(name: str):
    """``Any<Section>``, the union config class of a strategy section (``tgdist.config.union_schema``),
    which a composed config names when it is pickled: in a process that unpickles one (a job of
    Hydra's submitit launcher), the strategies are registered first, which builds it."""
    if name.startswith("Any"):
        load_strategies()
        found = getattr(schema_module, name, None)
        if isinstance(found, type):
            return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_strategies() -> None:
    """Register every memory store and pipeline strategy, extensions' included (``tgdist.plugins``),
    with its config class, before a config is composed (cheap after the first call)."""
    plugins.load()
    memory.names()  # the stores register when their modules are imported
    pipelines.names()
