"""Config groups mirror the packages: parallel/, memory/, pipeline/ and experiment/ compose as
their keys do, and an unknown option is one line naming the options."""

import pytest

from tgdist.cli.overrides import checked_compose
from tgdist.errors import ConfigError


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
    assert dict(checked_compose([]).pipeline) == {}


@pytest.mark.parametrize("group,options", [("memory", "auto, daemon, depcache, depcomm, local, sven"),
                                           ("parallel", "disttgl_2x1x2, single"), ("pipeline", "none"),
                                           ("experiment", "wikipedia_apan")])
def test_an_unknown_option_names_the_options(group, options):
    with pytest.raises(ConfigError) as e:
        checked_compose([f"{group}=bogus"])
    assert str(e.value) == f"In 'train': Could not find '{group}/bogus' (options: {options})"
