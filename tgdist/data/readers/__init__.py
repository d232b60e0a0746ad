"""The data readers by name (``data.format``): each format's module registers a ``Reader`` here
(``@register``), with its sniffing rule (``Reader.sniff``, how ``format=auto`` tells the format
from a path). The loading code (``tgdist.data.load``) asks for a reader by name or by sniffing, and
reads what it can do from its attributes, never from its name.

Built in, one module each in this package: ``edgelist``, ``jodie``, ``tgl``, ``native``,
``collegemsg``, ``synthetic`` (``tgdist.data.synthetic``'s generator) and ``tgb`` (the data sets
``tgdist.data.tgb`` reads). A new format is one module that subclasses ``Reader`` and registers
it; from outside the package it is imported by ``tgdist.plugins`` (``TGDIST_PLUGINS``), so its name
is a choice like the built-in ones.

A file format implements ``parse(path, options)``: the raw columns of the file, ``src``, ``dst``
and ``t`` (``[num_events]`` each) and optionally ``edge_feat`` ``[num_events, dim]``, ``label``,
``ext_roll``, ``bipartite``, ``table`` (a ``tgdist.data.text.Table``, whose line numbers errors
name), ``order_hint``; ``tgdist.data.graph.finish`` then sorts, remaps and checks them, and the
processed graph is cached as for every format. A source that is not a file (a generator, a
downloaded data set) sets ``takes_path = False`` and ``from_config = True`` and implements
``load(cfg)`` instead.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgdist import plugins
from tgdist.errors import ConfigError, DataError


@dataclass(frozen=True)
class ReadOptions:
    """What a file reader is asked to honour (``data.*`` keys of the same names)."""

    columns: str | None = None  # an edge list's fields in order (``Reader.reads_columns``)
    strict_columns: bool = True  # an edge list whose third field is probably not the time: an error
    bipartite: bool | None = None  # sources and destinations numbered apart; None: as the reader says
    strict_order: bool = False  # events out of time order: an error instead of a stable sort


@dataclass
class Target:
    """Where a source's graph goes when it is cached: its ``name``, the ``digest`` of the source
    and the options (the cache's key), the source's ``size`` in bytes, the terminal's ``status``
    line, and the cache ``entry`` folder a reader may write its arrays beside (``Reader.read``)."""

    name: str
    digest: str
    size: int
    status: Any
    entry: Path


class Reader:
    """One data format. Capabilities are attributes, read by ``tgdist.data.load``:

    ``name``: the value of ``data.format`` that picks it. ``describes``: the format in messages
    ("a JODIE CSV"). ``sniff_rank``: the order in which ``format=auto`` asks the readers' ``sniff``
    (lower first; a reader whose rule would misread another format's files goes after it).
    ``fallback``: what ``format=auto`` reads when no rule says yes (the plain edge list).
    ``takes_path``: the source is a file or folder given by ``data.path``; False for the embedded
    stream (``path()`` names it), the generator and TGB's data sets. ``from_config``: the graph
    comes from ``load(cfg)``, made from the config's own keys (the generator, TGB's data sets).
    ``reads_columns``: ``data.columns`` names its fields. ``ready_made``: the file holds a finished
    graph, read by ``read`` without parsing (and without hashing when the cache is off).
    ``carries_protocol``: the data set comes with its own evaluation protocol, a split by time and
    the negatives to rank each val and test event against (TGB's; ``train.eval=tgb`` reads them).
    """

    name: str = ""
    describes: str = ""
    sniff_rank: int = 50
    fallback: bool = False
    takes_path: bool = True
    from_config: bool = False
    reads_columns: bool = False
    ready_made: bool = False
    carries_protocol: bool = False

    def sniff(self, path: Path) -> bool:
        """Whether ``path`` (an existing file or folder) is in this format, for ``format=auto``:
        cheap, from the name or the first bytes; never an error for another format's file."""
        return False

    def parse(self, path: Path, options: ReadOptions) -> dict:
        """The raw columns of the file at ``path`` (see the module's docstring); errors are
        ``DataError``s naming the file and line; warnings are ``warnings.warn``, kept with the
        cache entry and repeated whenever it is used."""
        raise DataError(f"format {self.name!r} is not readable from {path}")

    def read(self, path: Path, options: ReadOptions, target: Target | None) -> Any:
        """A reader's own way to the graph, or None to ``parse`` the file: ``(graph, notes)``
        (``ready_made``), or a ``tgdist.data.cache.Prepared`` entry written in place beside
        ``target.entry`` (a large edge list read in blocks; ``target`` is None without a cache)."""
        return None

    def path(self) -> Path:
        """The source of a reader that ``takes_path`` is False for and that ``parse`` reads (the
        embedded CollegeMsg stream)."""
        raise DataError(f"format {self.name!r} reads no file")

    def check(self, cfg) -> None:
        """Refuse, as a ``ConfigError``, ``data.*`` settings this format cannot read, and a source
        that is not there, before any data is read (``cfg``: the run's ``DataConfig``)."""

    def load(self, cfg):
        """The ``TemporalGraph`` a ``DataConfig`` names, for a reader ``from_config``; None: the
        source is read through ``tgdist.data.load.load_graph``."""
        return None


READERS: dict[str, Reader] = {}

# The built-in readers' modules in this package, in the order data.format's choices are named.
BUILTIN = ("edgelist", "jodie", "tgl", "native", "collegemsg", "synthetic", "tgb")


def register(cls: type[Reader]) -> type[Reader]:
    """Register a ``Reader`` subclass (an instance of it) under its ``name``; a decorator."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a reader needs a name (the value of data.format that picks it)")
    READERS[cls.name] = cls()
    return cls


def names() -> list[str]:
    """The registered formats: the built-in ones in ``BUILTIN``'s order, then the extensions' in
    the order they were registered."""
    _load_builtin()
    order = {f"{__name__}.{module}": n for n, module in enumerate(BUILTIN)}
    return sorted(READERS, key=lambda name: order.get(type(READERS[name]).__module__, len(BUILTIN)))


def check_format(name: str) -> None:
    """``data.format`` is ``auto`` or a registered reader; else one line naming the choices."""
    if str(name) != "auto" and str(name) not in names():
        raise ConfigError(f"data.format={name}: choose one of auto, {', '.join(names())}")


def carries_protocol(name: str) -> bool:
    """Whether ``data.format=name`` reads a data set with its own split and negatives (``auto``
    never does: such data sets are named, not sniffed)."""
    return str(name) != "auto" and get(name).carries_protocol


def get(name: str) -> Reader:
    """The reader registered as ``name`` (a ``ConfigError`` naming the choices otherwise)."""
    check_format(name)
    return READERS[str(name)]


def detect(path: Path) -> Reader:
    """The reader of ``path`` for ``format=auto``: the first whose sniffing rule says yes (in
    ``sniff_rank`` order), else the fallback (a plain edge list) for a file."""
    _load_builtin()
    for reader in sorted(READERS.values(), key=lambda r: r.sniff_rank):
        if reader.takes_path and not reader.fallback and reader.sniff(path):
            return reader
    if path.is_dir():
        raise DataError(f"{path}: a directory, but not a TGL dataset (no edges.csv)")
    return next(r for r in READERS.values() if r.fallback)


def _load_builtin() -> None:
    """Import the built-in readers' modules, which register themselves, and the extensions of
    ``tgdist.plugins``."""
    for module in BUILTIN:
        importlib.import_module(f"{__name__}.{module}")
    plugins.load()
