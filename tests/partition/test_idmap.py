import numpy as np
import pytest
import torch

from tgdist.errors import ConfigError
from tgdist.partition.idmap import DualHashMap


def test_maps_by_hand():
    # Sven Fig. 10: global ids sharing a trainer are gathered in order; a vertex's local id is its rank
    m = DualHashMap.from_assignment(np.array([1, 0, 1, 2, 0, 1]), 3)
    assert m.trainer_of.tolist() == [1, 0, 1, 2, 0, 1]
    assert m.local_of.tolist() == [0, 0, 1, 0, 1, 2]
    assert m.offsets.tolist() == [0, 2, 5, 6]
    assert m.globals_of(0).tolist() == [1, 4]
    assert m.globals_of(1).tolist() == [0, 2, 5]
    assert m.globals_of(2).tolist() == [3]
    assert m.sizes().tolist() == [2, 3, 1]


def test_numpy_round_trip():
    rng = np.random.default_rng(0)
    owner = rng.integers(0, 7, 1000)
    m = DualHashMap.from_assignment(owner, 7)
    ids = rng.integers(0, 1000, (32, 10))  # any shape, with repeats
    trainer, local = m.lookup(ids)
    assert trainer.shape == ids.shape and np.array_equal(trainer, owner[ids])
    assert np.array_equal(m.to_global(trainer, local), ids)
    assert np.array_equal(m.trainer(ids), trainer) and np.array_equal(m.local(ids), local)
    for j in range(7):
        g = m.globals_of(j)
        assert np.array_equal(m.local(g), np.arange(g.size)) and np.all(owner[g] == j)
    m.check()


def test_torch_round_trip():
    owner = np.random.default_rng(1).integers(0, 4, 200)
    m = DualHashMap.from_assignment(owner, 4)
    ids = torch.randint(0, 200, (50,))
    trainer, local = m.lookup(ids)
    assert isinstance(trainer, torch.Tensor) and trainer.dtype == torch.int64
    assert torch.equal(trainer, torch.from_numpy(owner)[ids])
    assert torch.equal(m.to_global(trainer, local), ids)


def test_empty_trainer_and_validation():
    m = DualHashMap.from_assignment(np.array([0, 0, 2]), 3)
    assert m.globals_of(1).tolist() == [] and m.sizes().tolist() == [2, 0, 1]
    with pytest.raises(ConfigError):
        DualHashMap.from_assignment(np.array([0, 3]), 3)
    with pytest.raises(ConfigError):
        m.globals_of(3)


def test_check_detects_corruption():
    m = DualHashMap.from_assignment(np.array([1, 0, 1, 0]), 2)
    m.local_of[0] = 1
    with pytest.raises(ConfigError, match="inconsistent"):
        m.check()
