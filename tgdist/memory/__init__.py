"""Node memory stores behind one interface (DESIGN.md "Memory stores"), chosen by name from a
registry: ``store`` (the interface, ``MemoryRead`` and the in-process ``LocalMemory``),
``depcache`` (Sven's DepCache replicas), ``daemon`` (DistTGL's memory daemon and its client, over
``shm``'s shared-memory segments), ``sven`` and ``depcomm`` (memory partitioned among a group's
trainers, placed by ``placement``). A new backend is one module that registers its factory here
under the name ``memory.backend`` uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tgdist.errors import ConfigError


@dataclass
class StoreContext:
    """What a store is built from: the memory's shape and device, and where this trainer sits in
    the run (``layout``, ``rank``, the named process ``groups``, the run's byte ``counter``, and
    the config, whose ``memory.*`` and batch settings a daemon sizes its buffers from). The
    partitioned stores (sven, depcomm) place nodes from ``cfg.partition``, pre-sampling the
    ``graph``'s training events ``[0, train_end)`` when no artifact is given."""

    num_nodes: int
    mem_dim: int
    mail_dim: int
    mailbox_size: int
    device: torch.device | str = "cpu"
    layout: Any = None
    rank: int = 0
    groups: Any = None
    counter: Any = None
    cfg: Any = None
    batch_size: int = 0
    fanouts: tuple[int, ...] = ()
    graph: Any = None  # the run's TemporalGraph
    train_end: int = 0  # training events [0, train_end)


# name -> factory(StoreContext) -> MemoryStore
STORES: dict[str, Callable[[StoreContext], Any]] = {}


def register(name: str):
    """Register a store factory under ``name``, the value of ``memory.backend`` that picks it."""
    def add(factory):
        STORES[name] = factory
        return factory
    return add


def create(name: str, ctx: StoreContext):
    """The store ``name`` for this trainer; every trainer of a memory group calls this together
    (a store may meet its group, as the daemon's does to start)."""
    _load_backends()
    if name not in STORES:
        raise ConfigError(f"memory.backend={name}: choose one of {', '.join(sorted(STORES))}")
    return STORES[name](ctx)


def names() -> list[str]:
    _load_backends()
    return sorted(STORES)


def _load_backends() -> None:
    """Import the backend modules, which register themselves (not at package import: the daemon's
    module is large and most processes never need it)."""
    from tgdist.memory import daemon, depcache, depcomm, store, sven  # noqa: F401  (registering is their import)
