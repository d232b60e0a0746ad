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


def test_what_the_run_may_do_with_a_store_is_read_from_its_class():
    """Capabilities are class attributes that the validation and the run read, never the name:
    where a store keeps memory (the layout checks), what auto picks, whether partition settings,
    epoch parallelism, MSPipe's staged reads and train.epochs=0 apply."""
    cls = {name: memory.store_class(name) for name in memory.names()}
    assert {n: c.placement for n, c in cls.items()} == {"daemon": "host_shared", "depcache": "collective",
                                                          "depcomm": "collective", "local": "process",
                                                          "sven": "collective"}
    assert [n for n, c in cls.items() if c.partitioned] == ["depcomm", "sven"]
    assert [n for n, c in cls.items() if not c.epoch_parallel] == ["depcomm"]
    assert [n for n, c in cls.items() if c.staged_reads] == ["depcache", "local"]
    assert [n for n, c in cls.items() if not c.evaluates_untrained] == ["daemon"]
    assert [n for n, c in cls.items() if c.trainers_own] == ["local"]
    assert (memory.resolve("auto", 1), memory.resolve("auto", 4), memory.resolve("sven", 4)) == \
        ("local", "depcache", "sven")
    with pytest.raises(ConfigError, match="^memory.backend=nvme: choose one of"):
        memory.store_class("nvme")


def test_a_store_registered_from_a_test_module_is_built_and_driven(monkeypatch):
    """A new store is one module that registers its factory and class; the run reads its
    capabilities from the class (here: kept in the trainer's process, as local memory)."""
    class Counting(LocalMemory):
        reads = 0

        def read(self, ids):
            Counting.reads += 1
            return super().read(ids)

    monkeypatch.setitem(memory.STORES, "counting", (Counting, lambda ctx: Counting(ctx.num_nodes, ctx.mem_dim,
                                                                                  ctx.mail_dim, ctx.mailbox_size)))
    store = memory.create("counting", memory.StoreContext(5, 2, 3, 1))
    store.read(torch.tensor([0, 4]))
    assert isinstance(store, Counting) and Counting.reads == 1
    assert memory.store_class("counting").placement == "process" and "counting" in memory.names()


def test_a_store_registered_from_a_test_module_trains_when_the_config_names_it(tmp_path):
    """``memory.backend`` takes any registered name: a store registered here (local memory that
    counts its writes) trains a run named by the config alone, to local memory's metrics."""
    from tests.runtime.runs import metrics, run

    class Counting(LocalMemory):
        trainers_own = False  # built by its factory below (local memory's own is the trainer's)
        writes = 0

        def write_memory(self, ids, mem, mem_ts):
            Counting.writes += 1
            return super().write_memory(ids, mem, mem_ts)

    @memory.register("counting", Counting)
    def _counting(ctx):
        return Counting(ctx.num_nodes, ctx.mem_dim, ctx.mail_dim, ctx.mailbox_size).to(ctx.device)

    try:
        toy, _ = run(tmp_path, "toy", ["memory.backend=counting", "train.epochs=1"])
        local, _ = run(tmp_path, "local", ["memory.backend=local", "train.epochs=1"])
    finally:
        memory.STORES.pop("counting")
    assert toy["memory_backend"] == "counting" and Counting.writes > 0
    assert metrics(toy) == metrics(local)


def test_a_partitioned_store_with_one_trainer_per_copy_says_it_partitions_nothing(caplog):
    """``parallel.k=2 memory.backend=sven``: each memory copy has one trainer, so nothing is
    partitioned; the run says so instead of saying nothing."""
    from tgdist.runtime.build import compose, validate

    with caplog.at_level("WARNING", logger="tgdist.runtime.build"):
        validate(compose(["parallel.k=2", "memory.backend=sven", "train.epochs=4", "train.seed=99"]))
    assert any("memory.backend=sven with one trainer per memory copy" in r.getMessage() and "partitions nothing"
               in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tgdist.runtime.build"):
        validate(compose(["parallel.i=2", "memory.backend=sven", "train.seed=99"]))
    assert not [r for r in caplog.records if "partitions nothing" in r.getMessage()]
