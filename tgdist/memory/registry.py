"""The memory stores by name (``memory.backend``): each backend's module registers its factory and
class here (``@register("name", Class)``); the run asks for one by name and reads what it can do
from the class (``MemoryStore``'s capability attributes), never from its name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tgdist.config import register_option
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


# name -> (the store's class, whose attributes say what it can do; factory(StoreContext) -> store)
STORES: dict[str, tuple[type, Callable[[StoreContext], Any]]] = {}


def register(name: str, cls: type):
    """Register a store factory under ``name``, the value of ``memory.backend`` that picks it;
    ``cls`` is the class it builds, whose capability attributes (``MemoryStore``'s) the run and
    the validation read; ``cls.Config``, when it has one, is its config class
    (``tgdist.config.MemoryConfig`` with the keys only it reads), which composition gives
    ``memory`` when ``memory.backend`` names it."""
    def add(factory):
        STORES[name] = (cls, factory)
        register_option("memory", name, getattr(cls, "Config", None))
        return factory
    return add


def store_class(name: str) -> type:
    """The class of store ``name`` (its capabilities); an unknown name is a ``ConfigError``."""
    _load_backends()
    if name not in STORES:
        raise ConfigError(f"memory.backend={name}: choose one of {', '.join(sorted(STORES))}")
    return STORES[name][0]


def create(name: str, ctx: StoreContext):
    """The store ``name`` for this trainer; every trainer of a memory group calls this together
    (a store may meet its group, as the daemon's does to start)."""
    store_class(name)
    return STORES[name][1](ctx)


def names() -> list[str]:
    _load_backends()
    return sorted(STORES)


def resolve(name: str, group_size: int) -> str:
    """``memory.backend`` with ``auto`` resolved: the store of the trainer's own process for a
    memory group of one trainer, else the first registered store that keeps a copy in every
    trainer of a group (DepCache)."""
    if str(name) != "auto":
        return str(name)
    _load_backends()
    wanted = "process" if group_size == 1 else "collective"
    for store, (cls, _) in STORES.items():
        if cls.placement == wanted and cls.auto:
            return store
    raise ConfigError(f"memory.backend=auto: no registered store keeps memory as a group of {group_size} needs")


# memory.backend=auto picks a store that reads the section's keys alone (``resolve``: the local
# store or DepCache): composed with auto, ``memory`` has those keys only
register_option("memory", "auto", None)


def _load_backends() -> None:
    """Import the backend modules, which register themselves (not at package import: the daemon's
    module is large and most processes never need it), then the extensions (``tgdist.plugins``),
    so that the Python API sees their stores as ``tgdist train`` does."""
    from tgdist.memory import daemon, depcache, depcomm, store, sven  # noqa: F401  (registering is their import)

    from tgdist import plugins

    plugins.load()  # (cheap after the first call: the entry points are read once)
