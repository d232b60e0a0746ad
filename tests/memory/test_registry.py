"""Memory stores come from a registry by name and are driven through one lifecycle."""

import pytest
import torch

from tgdist import memory
from tgdist.errors import ConfigError
from tgdist.memory.store import LocalMemory


def test_the_built_backends_are_registered_and_an_unknown_one_is_named():
    assert memory.names() == ["daemon", "depcache", "depcomm", "local", "sven"]
    with pytest.raises(ConfigError) as e:
        memory.create("nvme", memory.StoreContext(4, 2, 3, 1))
    assert str(e.value) == "memory.backend=nvme: choose one of daemon, depcache, depcomm, local, sven"


def test_a_local_store_is_built_on_its_device_and_resets_when_a_pass_starts():
    store = memory.create("local", memory.StoreContext(5, 2, 3, 1, device="cpu"))
    assert isinstance(store, LocalMemory) and store.mem.shape == (5, 2) and store.mail.shape == (5, 1, 3)
    ids = torch.tensor([1, 3])
    store.write_memory(ids, torch.ones(2, 2), torch.tensor([4.0, 5.0]))
    store.open_position(7, 0, reset=False)  # a position inside a pass: the memory stays
    store.close_position()
    store.exchange()
    assert store.mem[1].tolist() == [1.0, 1.0] and store.mem_ts[3].item() == 5.0
    store.open_position(8, 0, reset=True)  # the first position of a pass: empty memory
    assert store.mem.abs().sum().item() == 0 and store.mem_ts.abs().sum().item() == 0
    store.end_training(evaluates=True)
    store.close()
    assert not store.one_copy_per_group
