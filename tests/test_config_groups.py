"""Config groups mirror the packages: parallel/, memory/, pipeline/ and experiment/ compose as
their keys do, and an unknown option is one line naming the options: of a group, and of a key
that takes one of a closed set of names (``tgdist.config.Choice``)."""

import dataclasses
import json
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tgdist import memory
from tgdist.config.overrides import ConfigSource, checked_compose
from tgdist.config import (
    Choice,
    CommBackend,
    EvalProtocol,
    LrScaling,
    ModelName,
    PartitionJob,
    PartitionMethod,
    PartitionWeights,
    SamplingStrategy,
    Select,
    Task,
    TimeUnit,
    TrainApp,
    config_dir,
    register_schemas,
    section_schema,
)
from tgdist.errors import ConfigError
from tgdist.memory.depcomm import RemoteDispatch
from tgdist.runtime import checkpoint
from tgdist.runtime.build import compose, validate
from tgdist.runtime.pipelines.mspipe import Mitigation


def test_a_memory_option_is_its_backend_key():
    assert checked_compose(["memory=daemon"]).memory == checked_compose(["memory.backend=daemon"]).memory
    assert checked_compose([]).memory.backend == "auto"


def test_the_default_layout_is_one_trainer_and_a_named_one_sets_every_degree():
    assert (lambda p: (p.i, p.j, p.k))(checked_compose([]).parallel) == (1, 1, 1)
    assert (lambda p: (p.i, p.j, p.k))(checked_compose(["parallel=disttgl_2x1x2"]).parallel) == (2, 1, 2)


def test_an_experiment_changes_only_what_it_names_and_wins_over_the_defaults():
    base, exp = checked_compose([]), checked_compose(["experiment=wikipedia_apan"])
    assert (exp.data.name, exp.model.name, exp.train.batch_size, exp.train.epochs) == ("wikipedia", "apan", 600, 10)
    assert exp.train.lr == base.train.lr and exp.sampler == base.sampler and exp.parallel == base.parallel
    assert checked_compose(["experiment=wikipedia_apan", "train.epochs=2"]).train.epochs == 2  # the command line last


def test_no_pipeline_by_default():
    p = compose([]).pipeline
    assert (p.prefetch, str(p.micro_batches), p.async_allreduce, p.mode) == (0, "1", False, "plain")
    assert "mitigation" not in p  # MSPipe's key: the plain loop's config class has none


def test_no_embedding_cache_by_default_and_the_freshgnn_option_turns_it_on():
    assert checked_compose([]).cache.enabled is False
    assert checked_compose(["cache=freshgnn"]).cache == checked_compose(["cache.enabled=true"]).cache


@pytest.mark.parametrize("group,options", [("memory", "auto, daemon, depcache, depcomm, local, sven"),
                                           ("parallel", "disttgl_2x1x2, single"), ("pipeline", "async_allreduce, micro_batches, mspipe, none, prefetch, sven"),
                                           ("cache", "freshgnn, none"),
                                           ("experiment", "wikipedia_apan")])
def test_an_unknown_option_names_the_options(group, options):
    with pytest.raises(ConfigError) as e:
        checked_compose([f"{group}=bogus"])
    assert str(e.value) == f"In 'train': Could not find '{group}/bogus' (options: {options})"


# Every key that takes one of a closed set of names (tgdist.config.Choice), with its options in the
# order the error names them; tgdist partition's schema shares data.* and sampler.*.
OPTIONS = {
    "data.time_unit": "auto, s, ms, us, ns",
    "sampler.strategy": "recent, uniform",
    "model.name": "tgn, jodie, apan",
    "train.task": "link, node, edge",
    "train.lr_scaling": "linear, sqrt, none",
    "train.select": "best_val, last",
    "train.eval": "tgdist, tgb",
    "parallel.comm_backend": "auto, gloo, nccl, mpi",
    "memory.remote_dispatch": "occurrences, distinct",
    "pipeline.mitigation": "none, similarity",
    "partition.method": "range, interval, reflexbicut, greedy",
    "partition.weights": "dedup, raw",
}
CHOICES = [("train", k, o) for k, o in OPTIONS.items() if not k.startswith("partition.")] + \
    [("partition_job", k, o) for k, o in OPTIONS.items() if k.startswith(("data.", "sampler.", "partition."))]
# a key of one strategy's config class is set with that strategy chosen (another refuses it)
STRATEGY = {"memory.remote_dispatch": ["memory.backend=depcomm"], "pipeline.mitigation": ["pipeline.mode=mspipe"]}
register_schemas()  # tgdist partition's, which its command registers


def choice_keys(schema: type, prefix: str = "") -> list[str]:
    keys = []
    for name, kind in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(kind):  # a strategy section: the keys of every registered strategy
            kind = section_schema(name) if prefix == "" and name in ("memory", "pipeline") else kind
            keys += choice_keys(kind, f"{prefix}{name}.")
        elif isinstance(kind, type) and issubclass(kind, Choice):
            keys.append(prefix + name)
    return keys


def test_every_choice_of_the_schemas_is_tested_here():
    found = [("train", k) for k in choice_keys(TrainApp)] + [("partition_job", k) for k in choice_keys(PartitionJob)]
    assert sorted(found) == sorted((c, k) for c, k, _ in CHOICES)


@pytest.mark.parametrize("config_name, key, options", CHOICES, ids=[f"{c}:{k}" for c, k, _ in CHOICES])
def test_an_unknown_value_fails_at_composition_naming_the_options(config_name, key, options):
    with pytest.raises(ConfigError) as e:
        compose([f"{key}=bogus"], config_name)
    assert str(e.value) == f"{key}=bogus: choose one of {options}"
    with pytest.raises(ConfigError) as e:  # not a name at all
        compose([f"{key}=null"], config_name)
    assert str(e.value) == f"{key}=null: choose one of {options}"


@pytest.mark.parametrize("config_name, key, options", CHOICES, ids=[f"{c}:{k}" for c, k, _ in CHOICES])
def test_every_option_composes_and_reads_as_its_name(config_name, key, options):
    group, leaf = key.split(".")
    for option in options.split(", "):
        cfg = compose([*STRATEGY.get(key, []), f"{key}={option}"], config_name)
        value = cfg[group][leaf]
        assert value == option and str(value) == option and f"{value}" == option and json.dumps(value) == f'"{option}"'
        assert f"\n  {leaf}: {option}\n" in "\n" + OmegaConf.to_yaml(cfg, resolve=True)  # as config.yaml has it
        assert OmegaConf.to_container(cfg[group], enum_to_str=True)[leaf] == option


def test_a_checkpoint_records_the_names_as_before_the_options_were_typed():
    """A checkpoint's config identity holds ``repr`` of plain values: one written before the
    keys were typed (``'jodie'``) still matches."""
    ids = checkpoint.identity(compose(["model=jodie", "memory.backend=daemon"]))
    assert (ids["model.name"], ids["sampler.strategy"], ids["train.lr_scaling"]) == ("'jodie'", "'recent'", "'linear'")


def test_a_bad_value_in_a_config_file_names_the_file(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nmodel:\n  name: gat\n")
    with pytest.raises(ConfigError) as e:
        checked_compose(["experiment=mine"], source=ConfigSource("train", config_dir(), str(tmp_path)))
    assert str(e.value) == "config file experiment/mine.yaml: model.name=gat: choose one of tgn, jodie, apan"


def test_an_interpolated_value_is_checked_as_it_resolves(monkeypatch):
    monkeypatch.setenv("TGDIST_TEST_MODEL", "gat")
    with pytest.raises(ConfigError) as e:
        compose(["model.name=${oc.env:TGDIST_TEST_MODEL}"])
    assert str(e.value) == "model.name=gat: choose one of tgn, jodie, apan"
    monkeypatch.setenv("TGDIST_TEST_MODEL", "apan")
    assert compose(["model.name=${oc.env:TGDIST_TEST_MODEL}"]).model.name == "apan"


def test_option_names_are_their_values():
    """OmegaConf looks a value up by member name: the two must be the same."""
    kinds = [CommBackend, ModelName, TimeUnit, SamplingStrategy, Task, LrScaling, PartitionMethod,
             PartitionWeights, Select, RemoteDispatch, Mitigation, EvalProtocol]
    assert sorted(k.__name__ for k in kinds) == sorted(k.__name__ for k in Choice.__subclasses__())
    for kind in kinds:
        assert [m.name for m in kind] == [m.value for m in kind]


def test_the_options_are_what_the_layers_below_implement():
    from tgdist.data.graph import TIME_UNITS
    from tgdist.data.sampler import TCSR, TemporalSampler
    from tgdist.data.synthetic import generate
    from tgdist.distributed.schedule import LR_SCALING_MODES
    from tgdist.memory.depcomm import REMOTE_DISPATCH
    from tgdist.models.modules import build_model
    from tgdist.partition.access import WEIGHTS
    from tgdist.partition.methods import METHODS

    def names(kind):
        return [m.value for m in kind]

    assert names(TimeUnit) == ["auto", *TIME_UNITS]
    assert names(LrScaling) == list(LR_SCALING_MODES)
    assert names(PartitionMethod) == list(METHODS)
    assert names(PartitionWeights) == list(WEIGHTS)
    assert names(RemoteDispatch) == list(REMOTE_DISPATCH)
    models = [build_model(m, num_nodes=4, mem_dim=4, time_dim=2) for m in ModelName]
    assert [type(model).__name__ for model in models] == ["TemporalModel"] * 3
    with pytest.raises(ValueError):
        build_model("gat", num_nodes=4, mem_dim=4, time_dim=2)
    tcsr = TCSR.build(generate(num_events=30, num_nodes=6, num_communities=2), True)
    assert [TemporalSampler(tcsr, [2], s).strategy for s in SamplingStrategy] == ["recent", "uniform"]
    with pytest.raises(ConfigError):
        TemporalSampler(tcsr, [2], "bogus")


def test_memory_backend_names_a_registered_store_checked_before_training():
    """``memory.backend`` is a name, not a closed list: every registered store (and ``auto``)
    validates, any other name is one line naming them, when the run is checked."""
    for backend in ["auto", *memory.names()]:
        validate(compose([f"memory.backend={backend}"]))
    with pytest.raises(ConfigError) as e:
        validate(compose(["memory.backend=shm"]))
    assert str(e.value) == f"memory.backend=shm: choose one of auto, {', '.join(memory.names())}"




def test_a_resume_composes_the_runs_config_yaml_with_the_given_keys_on_top(tmp_path):
    """``with_run_config``: the run's settings first, the given ones after; a group choice is kept
    out when the run has its settings (here a run without Hydra's record of its choices) and
    refused, naming the key that differs, when it does not."""
    from tgdist.config.overrides import resume_note, with_run_config
    from tgdist.errors import ConfigError
    from tgdist.runtime.build import compose

    run = tmp_path / "run"
    run.mkdir()
    ran = compose(["model=jodie", "model.mem_dim=16", "train.epochs=4", "data.max_events=2000", "train.patience=2",
                   "train.stop_after_batches=7", f"run_dir={run}"])
    (run / "config.yaml").write_text(OmegaConf.to_yaml(ran, resolve=True))
    cfg = compose([f"train.resume={run}", "train.epochs=6"])
    assert (cfg.model.name, cfg.model.mem_dim, cfg.data.max_events, cfg.train.patience) == ("jodie", 16, 2000, 2)
    assert cfg.train.epochs == 6 and cfg.train.stop_after_batches is None  # stop_after_batches stops one command
    assert resume_note(cfg) == (f"resuming with the settings of {run / 'config.yaml'}; changed by this command: "
                                f"train.epochs 4 -> 6")
    assert with_run_config(["train.epochs=6"]) == ["train.epochs=6"]  # no resume: as given
    kept = with_run_config(["model=jodie", "model.mem_dim=16", f"train.resume={run}"])
    assert "model=jodie" not in kept and kept[-2:] == ["model.mem_dim=16", f"train.resume={run}"]
    with pytest.raises(ConfigError) as e:
        with_run_config(["model=tgn", f"train.resume={run}"])
    assert str(e.value) == ("model=tgn: a resume keeps the run's config groups (model=tgn sets model.name='tgn' "
                            "(the run has 'jodie')); drop model=tgn, and give single keys (model.KEY=VALUE) for what a "
                            "resume may change")
    (run / "config.yaml").write_text("[not, a, config]\n")
    with pytest.raises(ConfigError, match="is not a tgdist config"):
        compose([f"train.resume={run}"])


def _own_keys() -> list[tuple[str, str, str, str]]:
    """(group, key, a strategy that reads it, one that does not) for every key that a registered
    store or pipeline has on its own config class (not the section's)."""
    from tgdist import config
    from tgdist.runtime.build import load_strategies

    load_strategies()
    found = []
    for group, (_, base) in config.SECTIONS.items():
        shared = {f.name for f in dataclasses.fields(base)}
        names = config.option_names(group)
        for key in dict.fromkeys(f.name for n in names for f in dataclasses.fields(config.option_schema(group, n))):
            if key not in shared:
                readers = config.readers(group, key)
                found.append((group, key, readers[0], next(n for n in names if n not in readers)))
    return found


def _another_value(group: str, name: str, key: str):
    """A valid value of ``key`` under strategy ``name`` that is not its default."""
    from tgdist import config

    f = next(f for f in dataclasses.fields(config.option_schema(group, name)) if f.name == key)
    if isinstance(f.default, Choice):
        return next(m.value for m in type(f.default) if m != f.default)
    if "count_or_auto" in f.metadata:
        return "3"
    if isinstance(f.default, bool):
        return str(not f.default).lower()
    return 5 if f.default is None else f.default + 1 if isinstance(f.default, int) else f.default / 2


OWN_KEYS = _own_keys()


def test_the_strategies_own_keys_are_known():
    """What the next test covers: the built-in stores' and pipelines' own keys are among them."""
    keys = {(g, k): (r, o) for g, k, r, o in OWN_KEYS}
    assert keys[("pipeline", "staleness")][0] == "mspipe" and keys[("pipeline", "micro_batches")][0] == "plain"
    assert keys[("memory", "timeout")][0] == "daemon" and keys[("memory", "remote_dispatch")][0] == "depcomm"
    assert ("memory", "backend") not in keys and ("pipeline", "prefetch") not in keys  # every strategy's


@pytest.mark.parametrize("group, key, reader, other", OWN_KEYS, ids=[f"{g}.{k}" for g, k, _, _ in OWN_KEYS])
def test_a_key_the_chosen_strategy_does_not_read_is_refused_at_composition(group, key, reader, other):
    """Each store and pipeline reads its own keys (its config class): composed with the strategy
    that reads one, the key is there with its value; with another strategy, a value other than the
    default is refused in one line naming who reads it, and the default goes unsaid."""
    from tgdist import config

    choose = config.SECTIONS[group][0]
    value = _another_value(group, reader, key)
    cfg = compose([f"{group}.{choose}={reader}", f"{group}.{key}={value}"])
    assert OmegaConf.get_type(cfg[group]) is config.option_schema(group, reader)
    assert str(OmegaConf.to_container(cfg[group], enum_to_str=True)[key]).lower() == str(value).lower()
    with pytest.raises(ConfigError) as e:
        compose([f"{group}.{choose}={other}", f"{group}.{key}={value}"])
    assert str(e.value) == (f"{group}.{key}={cfg[group][key]} is read by {group}.{choose}={reader} only; "
                            f"{group}.{choose}={other} does not read it")
    left = compose([f"{group}.{choose}={other}"])
    assert key not in left[group] and OmegaConf.get_type(left[group]) is config.option_schema(group, other)


def _presets() -> list[tuple[str, str, str]]:
    """(group, preset file, strategy) for each preset under ``configs/`` that names its strategy
    (``backend: daemon``, ``mode: mspipe``), but the group's default (``auto.yaml``, ``none.yaml``):
    that one keeps the union of every strategy's keys, as a strategy is picked by a key on top of it
    (``memory.backend=daemon memory.timeout=60``). The level presets name no strategy."""
    import yaml

    from tgdist import config

    defaults = [d for d in yaml.safe_load((Path(config.config_dir()) / "train.yaml").read_text())["defaults"]
                if isinstance(d, dict)]
    default = {k: v for d in defaults for k, v in d.items()}
    found = []
    for group, (choose, _) in config.SECTIONS.items():
        for f in sorted((Path(config.config_dir()) / group).glob("*.yaml")):
            name = yaml.safe_load(f.read_text()).get(choose)
            if f.stem != default[group] and name is not None and config.option_schema(group, name) is not None:
                found.append((group, f.stem, name))
    return found


@pytest.mark.parametrize("group, preset, name", _presets(), ids=[f"{g}={p}" for g, p, _ in _presets()])
def test_a_preset_that_names_a_strategy_composes_its_config_class(group, preset, name):
    """A preset that picks a store or pipeline composes that strategy's own class, not the union
    of every strategy's keys; a key of another strategy on top of it is refused in one line that
    says who reads it."""
    import yaml

    from tgdist import config

    text = yaml.safe_load((Path(config.config_dir()) / group / f"{preset}.yaml").read_text())
    assert text["defaults"] == [f"{name}_schema"]
    cfg = compose([f"{group}={preset}"])
    assert OmegaConf.get_type(cfg[group]) is config.option_schema(group, name)
    choose = config.SECTIONS[group][0]
    own = {f.name for f in dataclasses.fields(config.option_schema(group, name))}
    other = next(((k, r) for g, k, r, _ in OWN_KEYS if g == group and k not in own), None)
    if other is None:
        return
    key, reader = other
    with pytest.raises(ConfigError) as e:
        compose([f"{group}={preset}", f"{group}.{key}={_another_value(group, reader, key)}"])
    assert str(e.value).startswith(f"{group}.{key} is read by ") and str(e.value).endswith(" alone")
    assert f"only, and the {group} preset given has the keys of {group}.{choose}=" in str(e.value)
    assert name in str(e.value).rpartition("=")[2].split()[0].split("|")


def test_the_presets_that_name_a_strategy_are_found():
    """What the test above covers: the stores' presets and MSPipe's."""
    assert {(g, p) for g, p, _ in _presets()} >= {("memory", "daemon"), ("memory", "sven"), ("memory", "local"),
                                                   ("memory", "depcomm"), ("memory", "depcache"), ("pipeline", "mspipe")}


_CHOICE_CHECK = '''
import pickle, sys
K = Choice("K", "tgn jodie")
K.add("toy")
K.add("toy")  # (twice: once)
assert K["toy"] is K("toy") is K.toy and K.toy.value == "toy" and str(K.toy) == "toy" and f"{K.toy:>4}" == " toy"
assert [m.value for m in K] == ["tgn", "jodie", "toy"] and list(K.__members__) == ["tgn", "jodie", "toy"]
assert isinstance(K.toy, K) and K.toy == "toy" and K.toy in K and len(K) == 3
assert pickle.loads(pickle.dumps(K.toy)) is K.toy
K.drop("toy")
assert [m.value for m in K] == ["tgn", "jodie"] and "toy" not in K.__members__ and not hasattr(K, "toy")
for lookup in (lambda: K["toy"], lambda: K("toy")):
    try:
        lookup()
        raise SystemExit("toy is still an option")
    except (KeyError, ValueError):
        pass
print(sys.version_info[:2])
'''


def _pythons() -> list[str]:
    """This interpreter and any other CPython 3.10-3.13 on the machine (pyenv's, or on PATH; not
    pyenv's shims, which run only the versions a project selects)."""
    import shutil
    import sys

    found = {sys.executable}
    for minor in range(10, 14):
        found.update(p for p in [shutil.which(f"python3.{minor}"),
                                 *map(str, Path.home().glob(f".pyenv/versions/3.{minor}.*/bin/python"))]
                     if p and "/shims/" not in p)
    return sorted(found)


def test_an_option_added_to_a_choice_is_one_on_every_python():
    """``Choice.add`` extends an Enum through its internals (Python has no public way), which
    changed in 3.12: the option is found by name, by value, as an attribute, in iteration and
    after pickling, and ``drop`` takes it back, on each Python the package supports that this
    machine has (``requires-python >= 3.10``; the class alone, which needs only ``enum``)."""
    import inspect
    import subprocess

    source = "from enum import Enum\n\n" + inspect.getsource(Choice) + _CHOICE_CHECK
    seen = set()
    for python in _pythons():
        r = subprocess.run([python, "-c", source], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{python}: {r.stderr.strip().splitlines()[-1:]}"
        seen.add(r.stdout.strip())
    assert seen  # (at least this interpreter's)
