"""Reading the data a run names: ``load_data`` (a ``DataConfig``), ``load_graph`` (a path and the
reader's options). The format is the reader that ``data.format`` names, or for ``auto`` the one
whose sniffing rule takes the path (``tgdist.data.readers``); the source is hashed, read once per
machine into the processed-graph cache (``tgdist.data.cache``) and mapped by every process."""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path

from tgdist.config import DataConfig, datasets_dir, file_stem
from tgdist.data import readers
from tgdist.data.cache import cached_graph, default_cache_dir, digest_source
from tgdist.data.graph import TemporalGraph, existing, finish, subset
from tgdist.data.readers import ReadOptions, Reader, Target
from tgdist.errors import ConfigError, DataError
from tgdist.progress import Status

log = logging.getLogger(__name__)

DEFAULT = "collegemsg"  # the reader of a run that names no file (data.path=null)


def check_data_source(cfg: DataConfig) -> Reader | None:
    """The data a ``DataConfig`` names is there, in a format tgdist reads (``tgdist launch`` and
    sweeps check it before starting, ``load_data`` before reading); its reader (None: ``auto``)."""
    reader = None if cfg.format == "auto" else readers.get(cfg.format)
    if cfg.require_path and cfg.path is None:
        raise ConfigError("data=file needs data.path=FILE (any supported file or TGL directory)")
    if reader is not None:
        reader.check(cfg)
    if cfg.path is not None and (reader is None or reader.takes_path):
        shared = datasets_dir()
        if str(cfg.path).startswith(shared + os.sep) and not os.path.exists(cfg.path):  # data=wikipedia and co.
            where = ("$TGDIST_DATASETS" if os.environ.get("TGDIST_DATASETS") else
                     "shared/datasets beside the clone" if os.path.isabs(shared) else "relative to the working directory")
            raise ConfigError(f"data={cfg.name}: {cfg.path} is missing; shared data sets are read from {shared} "
                              f"({where}): set TGDIST_DATASETS to the folder that holds {cfg.name}/")
        existing(cfg.path)
    return reader


def load_data(cfg: DataConfig) -> TemporalGraph:
    """Build the ``TemporalGraph`` a ``DataConfig`` describes."""
    reader = check_data_source(cfg)
    graph = reader.load(cfg) if reader is not None else None
    if graph is None:  # the reader's warnings become log lines (stderr and the run's train.log), not Python's
        with warnings.catch_warnings(record=True) as caught:  # file:line report with a code line
            warnings.simplefilter("always", UserWarning)
            graph = load_graph(cfg.path, format=str(cfg.format), columns=cfg.columns, bipartite=cfg.bipartite,
                               strict_order=cfg.strict_order, cache=cfg.cache, cache_dir=cfg.cache_dir,
                               strict_columns=cfg.strict_columns)
        for w in caught:
            log.warning("%s", w.message)
    if cfg.max_events is not None and cfg.max_events < graph.num_events:
        graph = subset(graph, cfg.max_events)
    return graph


def formats() -> list[str]:
    """The formats ``load_graph`` reads: ``auto`` and the readers of files or of an embedded stream."""
    return ["auto", *(name for name in readers.names() if not readers.READERS[name].from_config)]


def _source_size(origin: Path) -> int:
    """Bytes of a source file, or of a TGL directory's files."""
    files = origin.iterdir() if origin.is_dir() else [origin]
    return sum(f.stat().st_size for f in files if f.is_file())


def load_graph(path: str | Path | None = None, *, format: str = "auto", columns: str | None = None,
               bipartite: bool | None = None, strict_order: bool = False, cache: bool = True,
               cache_dir: str | Path | None = None, name: str | None = None,
               strict_columns: bool = True) -> TemporalGraph:
    """Read a temporal graph from ``path`` (or the embedded CollegeMsg stream when None).

    ``strict_columns``: an edge list read by position whose third field is probably not the time
    is an error (False: a warning), see ``readers.edgelist._time_column_doubt``.

    Processed graphs are cached under ``cache_dir`` (``$TGDIST_CACHE`` or ``~/.cache/tgdist``) keyed
    by a hash of the source bytes and the reader options; the cache file is written atomically,
    so a failed read leaves nothing behind.
    """
    known = formats()  # one look at the registry (and the extensions'): it reads installed packages' metadata
    if format not in known:
        raise DataError(f"unknown data format {format!r}; choose one of {', '.join(known)}")
    chosen = None if format == "auto" else readers.READERS[format]
    if chosen is not None and not chosen.takes_path and path is not None:
        files = [f for f in known if f == "auto" or readers.READERS[f].takes_path]
        raise DataError(f"format {format!r} is {chosen.describes} and takes no path (got {path}); use format "
                        f"{', '.join(files[:-1])} or {files[-1]} for a file")
    if path is None:
        reader = readers.READERS[DEFAULT]
        origin = reader.path()
    else:
        origin, reader = existing(path), chosen
    try:
        reader = reader or readers.detect(origin)
        options = ReadOptions(columns=columns, strict_columns=strict_columns, bipartite=bipartite,
                              strict_order=strict_order)
        return _load(origin, reader, options, cache, cache_dir, name)
    except OSError as e:  # a TGL directory's file that cannot be read, an I/O error...
        raise DataError(f"{e.filename or origin}: cannot read ({e.strerror or e})") from None


def _load(origin: Path, reader: Reader, options: ReadOptions, cache: bool, cache_dir: str | Path | None,
          name: str | None) -> TemporalGraph:
    if options.columns is not None and not reader.reads_columns:
        other = "" if not reader.takes_path else " (data.format=edgelist reads it as an edge list)"
        raise DataError(f"data.columns={options.columns!r} names the fields of a plain edge list, but {origin} is read "
                        f"as {reader.describes}{other}; leave data.columns unset")
    size = _source_size(origin) if reader.takes_path else 0
    # a terminal shows what a large read is doing (hashing, parsing, caching) and for how long
    with Status(f"reading {origin.name} ({size / 2**20:,.0f} MiB)", enabled=size >= STATUS_BYTES) as status:
        return _load_source(origin, reader, options, cache, cache_dir, name, size, status)


# Sources from this size on show a status line on a terminal (parsing runs at about 15 MiB/s).
STATUS_BYTES = 16 << 20


def _load_source(origin: Path, reader: Reader, options: ReadOptions, cache: bool, cache_dir: str | Path | None,
                 name: str | None, size: int, status: Status) -> TemporalGraph:
    if reader.ready_made and not cache:
        status.set("loading")
        return reader.read(origin, options, None)[0]
    gname = name or (file_stem(origin) if reader.takes_path else reader.name)
    key = {"format": reader.name, "columns": options.columns, "bipartite": options.bipartite,  # a relaxed read's
           "strict": options.strict_order, "strict_columns": options.strict_columns}  # entry must not serve a strict one
    status.set("hashing the source (the cache's key)")
    digest = digest_source(origin, key)  # each process reads the source once; the page cache shares it
    if not cache:  # in this process's memory, as before the cache was mapped (the hash names the data all the same)
        return _parse_source(origin, reader, options, gname, digest, size, status, cached=False)[0]
    folder = Path(cache_dir or default_cache_dir())
    entry = folder / f"{gname}-{digest}"

    def build():
        if reader.ready_made:
            status.set("loading")
            return reader.read(origin, options, None)
        own = reader.read(origin, options, Target(gname, digest, size, status, entry))  # a large edge list, in blocks
        if own is not None:
            return own
        return _parse_source(origin, reader, options, gname, digest, size, status)

    def in_memory():  # a cache folder that cannot be written: read as with data.cache=false
        if reader.ready_made:
            return reader.read(origin, options, None)
        return _parse_source(origin, reader, options, gname, digest, size, status, cached=False)

    return cached_graph(entry, build, status=status, in_memory=in_memory)


def _parse_source(origin: Path, reader: Reader, options: ReadOptions, gname: str, digest: str, size: int,
                  status: Status, cached: bool = True) -> tuple[TemporalGraph, list[str]]:
    """Read a text source (or a TGL directory) into a graph; the reader's warnings, given here, are
    returned too, to be stored with a cache entry and repeated whenever it is used."""
    start = time.perf_counter()
    status.set("parsing")
    if size >= 64 << 20:  # parsing runs at about 15 MiB/s: say what is happening before a long silence
        log.info("reading %s (%s MiB)%s", origin, f"{size >> 20:,}", "; the parsed graph is cached for later runs"
                 if cached else "")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        raw = reader.parse(origin, options)
        status.set("building the graph")
        graph = finish(raw, name=gname, source_hash=digest, bipartite=options.bipartite,
                       strict_order=options.strict_order, origin=origin)
    notes = [str(w.message) for w in caught if w.category is UserWarning]  # the readers' own
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=2)
    log.info("read %s in %.2fs", graph.describe(), time.perf_counter() - start)
    return graph, notes
