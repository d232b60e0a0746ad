"""Models come from a registry by name; what the run may do with one is read from its class."""

import re
from pathlib import Path

import pytest
import torch

from tgdist import models
from tgdist.config import ModelName
from tgdist.data.synthetic import generate
from tgdist.errors import ConfigError
from tgdist.models.modules import TemporalModel, build_model
from tgdist.models.zoo import JODIE, TGN
from tgdist.runtime.build import build_trainer, compose, validate
from tgdist.runtime.trainer import time_scale

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def register():
    """``models.register`` for the test, taken back after it (the names are options of every
    config composed in this process while registered)."""
    added = []

    def add(name, cls):
        added.append(name)
        return models.register(name)(type(f"Test_{name}", (cls,), {}))
    yield add
    for name in added:
        models.unregister(name)


def test_the_built_in_models_are_registered_and_are_the_options_of_model_name():
    assert models.names() == ["tgn", "jodie", "apan"] == [m.value for m in ModelName]
    with pytest.raises(ConfigError) as e:
        models.model_class("gat")
    assert str(e.value) == "model.name=gat: choose one of tgn, jodie, apan"
    with pytest.raises(ConfigError, match="^model name 'a b': give a word"):
        models.register("a b")


def test_capabilities_are_read_from_the_class_and_agree_with_the_model_it_builds():
    cls = {name: models.model_class(name) for name in models.names()}
    assert {n: c.neighbour_hops for n, c in cls.items()} == {"tgn": None, "jodie": 0, "apan": 1}
    assert [n for n, c in cls.items() if not c.samples_neighbours()] == ["jodie"]
    assert [n for n, c in cls.items() if c.delivers_to_neighbours] == ["apan"]
    assert [n for n, c in cls.items() if c.mailbox] == ["apan"]
    assert [n for n, c in cls.items() if c.uses_time_scale] == ["jodie"]
    assert [n for n, c in cls.items() if not c.attention_heads] == ["jodie"]
    assert {n: c.max_layers for n, c in cls.items()} == {"tgn": 2, "jodie": 1, "apan": 1}
    assert [n for n, c in cls.items() if c.embedding_cache] == ["tgn"]
    assert all(c.stores is None for c in cls.values())
    for name, c in cls.items():
        for layers in range(1, c.max_layers + 1):
            m = build_model(name, num_nodes=5, mem_dim=4, time_dim=2, num_layers=layers, mailbox_size=3)
            assert isinstance(m, TemporalModel)
            assert m.num_hops == c.num_hops(layers), (name, layers)
            assert m.deliver_to_neighbors == c.delivers_to_neighbours
            assert (m.mailbox_size == 3) == c.mailbox


def test_a_registered_model_is_an_option_of_model_name_until_taken_back(register):
    with pytest.raises(ConfigError, match="^model.name=mine: choose one of tgn, jodie, apan$"):
        compose(["model.name=mine"])
    register("mine", TGN)
    cfg = compose(["model.name=mine", "model.num_layers=2", "sampler.fanouts=[5,5]", "cache.enabled=true"])
    validate(cfg)  # TGN's capabilities, under another name: two layers, two hops and the cache
    assert cfg.model.name == "mine" and type(build_model("mine", num_nodes=3, mem_dim=4, time_dim=2)) is TemporalModel
    with pytest.raises(ConfigError, match="^model.name=gat: choose one of tgn, jodie, apan, mine$"):
        compose(["model.name=gat"])
    models.unregister("mine")
    with pytest.raises(ConfigError, match="^model.name=mine: choose one of tgn, jodie, apan$"):
        compose(["model.name=mine"])


def test_the_validation_reads_the_class_not_the_name(register):
    """A model named like none of the built-in ones gets the refusals of the class it is."""
    register("clock", JODIE)
    with pytest.raises(ConfigError, match=r"^sampler.fanouts=\[5, 5\] gives 2 hops, but CLOCK samples no neighbours$"):
        validate(compose(["model.name=clock", "sampler.fanouts=[5,5]"]))
    validate(compose(["model.name=clock", "sampler.fanouts=[]", "model.mem_dim=5"]))  # no neighbours, no heads
    with pytest.raises(ConfigError, match="^model.mailbox_size=4: only APAN keeps a mailbox .model=apan.; CLOCK"):
        validate(compose(["model.name=clock", "model.mailbox_size=4"]))
    with pytest.raises(ConfigError, match="^model.num_layers=2: CLOCK has no attention layers to stack"):
        validate(compose(["model.name=clock", "model.num_layers=2"]))
    with pytest.raises(ConfigError, match="^cache.enabled=true caches inner-layer embeddings, which clock"):
        validate(compose(["model.name=clock", "cache.enabled=true"]))
    only_local = register("pinned", TGN)
    only_local.stores = ("local",)
    validate(compose(["model.name=pinned"]))
    with pytest.raises(ConfigError, match=r"^memory.backend=auto \(depcache\): PINNED keeps its memory in local only$"):
        validate(compose(["model.name=pinned", "parallel.i=2"]))


def test_the_trainer_gives_the_time_scale_to_the_models_that_read_one(register):
    register("clock", JODIE)
    graph = generate(num_events=300, num_nodes=30, num_communities=2)
    overrides = ["model.mem_dim=8", "model.time_dim=4", "train.progress=false", "train.num_threads=1",
                 "sampler.num_threads=1", "data.time_unit=s"]
    clock = build_trainer(compose(["model.name=clock", *overrides]), graph=graph)
    assert clock.model.embedding.time_scale == pytest.approx(time_scale(graph)) and time_scale(graph) != 1.0
    register("flat", TGN)
    assert build_trainer(compose(["model.name=flat", *overrides]), graph=graph).model.num_hops == 1
    models.model_class("clock").uses_time_scale = False
    assert build_trainer(compose(["model.name=clock", *overrides]), graph=graph).model.embedding.time_scale == 1.0


def test_no_model_name_is_tested_in_the_runtime_or_the_launcher():
    """The run and the advisor read a model's capabilities, never its name: no quoted model
    name in tgdist/runtime or tgdist/launcher (no place is allowed one)."""
    names = "|".join(map(re.escape, [*models.names(), "tgat2"]))
    found = []
    for folder in ("runtime", "launcher"):
        for path in sorted((ROOT / "tgdist" / folder).rglob("*.py")):
            for num, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(rf"[\"']({names})[\"']", line):
                    found.append(f"{path.relative_to(ROOT)}:{num}: {line.strip()}")
    assert found == []
