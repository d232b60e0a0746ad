"""``edgelist``: SNAP / DyGLib / KONECT text, ``src dst t [extra...]``, whitespace or comma,
optional header (its names, when they name the time, say which column is what), ``#`` and ``%``
comment lines, plain, ``.gz``, ``.bz2``, ``.xz`` or ``.zip`` (one member). ``data.columns`` names
the fields; read by position, a third field that is probably not the time stops the read
(``data.strict_columns``). What ``format=auto`` reads when no other reader's rule says yes; large
files are read in blocks straight into the cache entry (``_stream_edgelist``)."""

from __future__ import annotations

import gzip
import logging
import os
import re
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from tgdist.data import cache
from tgdist.data.cache import Prepared
from tgdist.data.graph import TIME_UNITS, TemporalGraph
from tgdist.data.readers import ReadOptions, Reader, Target, register
from tgdist.data.text import (
    NUMERIC,
    UTF16_BOMS,
    FieldError,
    Table,
    as_ids,
    as_times,
    check_finite,
    integral,
    is_comment,
    is_float,
    parse_table,
    read_bytes,
    split_fields,
    text_blocks,
)
from tgdist.errors import DataError
from tgdist.progress import Status

log = logging.getLogger(__name__)


@register
class EdgeList(Reader):
    name = "edgelist"
    describes = "a plain edge list"
    fallback = True
    reads_columns = True

    def parse(self, path: Path, options: ReadOptions) -> dict:
        return _read_edgelist(path, read_bytes(path), options.columns, options.strict_columns)

    def read(self, path: Path, options: ReadOptions, target: Target | None):
        """A large file (``STREAM_BYTES`` on, not a zip archive) into the cache entry block by block."""
        if target is None or target.size < STREAM_BYTES or path.name.lower().endswith(".zip"):
            return None
        return _stream_edgelist(path, options.columns, options.bipartite, options.strict_columns, target.name,
                                target.digest, target.size, target.status, target.entry)


def _read_edgelist(path: Path, data: bytes, columns: str | None, strict_columns: bool = True) -> dict:
    """``columns`` names the fields in order: src, dst, t, feat (edge feature), label, or _ (skip).

    Without it the layout is ``src dst t`` and any further numeric fields become edge features;
    a third field that is probably not the time (``_time_column_doubt``) is an error, or with
    ``strict_columns=False`` a warning.
    """
    if columns is None and (named := _columns_from_header(data)):
        columns, guessed = named
        how = "its time column named in the header, the first other columns as the " + " and ".join(guessed) \
            if guessed else "their header names"
        warnings.warn(f"{path}: columns read by {how}, as data.columns='{columns}' (naming the columns "
                      f"overrides this)", stacklevel=2)
    spec = [c.strip() for c in (columns or "src,dst,t").split(",")]
    unknown = set(spec) - {"src", "dst", "t", "feat", "label", "_"}
    if unknown:
        raise DataError(f"data.columns={columns!r}: unknown field name(s) {sorted(unknown)}; use src, dst, t, feat, label or _")
    twice = sorted(r for r in ("src", "dst", "t", "label") if spec.count(r) > 1)
    if twice:
        raise DataError(f"data.columns={columns!r} names {' and '.join(twice)} more than once; feat and _ may repeat")
    missing = [r for r in ("src", "dst", "t") if r not in spec]
    if columns and missing:  # before the file is read: the file is not at fault
        names = {"src": "src (source)", "dst": "dst (destination)", "t": "t (time)"}
        raise DataError(f"data.columns={columns!r} names no {' and no '.join(names[m] for m in missing)} column: name "
                        f"src, dst and t, e.g. 'src,dst,t'")
    usecols = [i for i, c in enumerate(spec) if c != "_"] if columns else None
    if columns:
        spec = [c for c in spec if c != "_"]
    ids = (spec.index("src"), spec.index("dst")) if {"src", "dst"} <= set(spec) else ()
    text_cols = _text_id_columns(data, ids, usecols)
    try:
        table = parse_table(path, data, usecols=usecols, text_cols=text_cols)
    except FieldError as e:
        numeric_ids = [usecols[c] if usecols else c for c in ids if c not in text_cols]
        if e.column in numeric_ids and e.field.strip():  # "17" on the first line, "alice" later
            raise DataError(f"{e.path}:{e.line}: node id {e.field!r} in column {e.column + 1} is not a number, but the "
                            f"first data line's is (ids are read as names only when the first data line has a name "
                            f"there)") from None
        raise e.hinted(_columns_hint(e.column, columns)) from None
    ncol = table.values.shape[1]
    if ncol < 3:
        raise DataError(f"{path}:{table.lines[0]}: expected at least 3 fields (src dst t), found {ncol}")
    pos = {name: i for i, name in enumerate(spec) if name in ("src", "dst", "t", "label")}
    for need in ("src", "dst", "t"):
        if need not in pos:
            raise DataError(f"data.columns={columns!r} must name src, dst and t")
    out = {"src": as_ids(table, pos["src"], "source"), "dst": as_ids(table, pos["dst"], "destination"),
           "t": as_times(table, pos["t"]), "table": table}
    feat_cols = [i for i in range(ncol) if i >= len(spec) or spec[i] == "feat"]
    if "label" in pos:
        out["label"] = integral(table, pos["label"], "label")
    if feat_cols:
        feats = table.values[:, feat_cols].astype(np.float32)
        check_finite(feats, table, "edge feature")
        out["edge_feat"] = feats
    if not columns:
        out["order_hint"] = _time_field_hint(table, out["t"])
        doubt = _time_column_doubt(table, out["t"])
        if doubt is not None:
            why, names = doubt
            other = f"\"data.columns='{names}'\" (tgdist data: --columns {names})"
            if strict_columns:
                keep = ",".join(["src", "dst", "t"] + ["feat"] * (ncol - 3))
                raise DataError(f"{path}: {why}: name the columns, {other}, or set data.strict_columns=false "
                                f"(tgdist data: --columns {keep}) to read column 3 as the time")
            warnings.warn(f"{path}: {why}; column 3 is read as the time, as data.strict_columns=false asks ({other} "
                          f"reads the other)", stacklevel=2)
    return out


# Header names by role, compared without case, "_", "-" or spaces (userId = user_id = user-id).
_HEADER_ROLES = {
    "src": {"src", "source", "from", "u", "sender", "srcid", "sourceid", "fromid", "uid", "user", "userid",
            "customer", "customerid", "node1", "head", "srcnode", "sourcenode", "fromnode", "nodefrom"},
    "dst": {"dst", "destination", "dest", "target", "to", "v", "i", "recipient", "receiver", "dstid", "targetid",
            "toid", "vid", "item", "itemid", "movie", "movieid", "product", "productid", "page", "pageid", "node2",
            "tail", "dstnode", "targetnode", "tonode", "nodeto", "destnode", "destinationnode"},
    "t": {"t", "time", "ts", "timestamp", "unixtime", "datetime", "date"},
    "_": {"", "index", "unnamed:0", "id", "idx", "eventid", "edgeid", "eid"},  # row numbers: not features
}


def _columns_from_header(data: bytes) -> tuple[str, list[str]] | None:
    """A ``data.columns`` spec from a header that names its columns in another order than
    ``src dst t`` (``timestamp,source,target``; a leading index column, as pandas writes), and the
    roles it guessed; or None: no header, no name or two names for the time, or the usual order.

    A header that names the time but not the source or destination (``time,a,b``) gets them from
    its first other columns, in order: reading such a file by position would take the times for
    node ids. Other columns are edge features, as without a header."""
    head = data[:1 << 16].decode("utf-8", errors="replace").splitlines()
    first = next((ln for ln in head if ln.strip() and not is_comment(ln)), "")
    fields = [_header_key(f) for f in split_fields(first, "auto")]
    if not fields or any(NUMERIC.match(f) for f in fields):
        return None
    roles = [next((r for r, names in _HEADER_ROLES.items() if f in names), "feat") for f in fields]
    if roles.count("t") != 1 or roles.count("src") > 1 or roles.count("dst") > 1:
        return None
    free = [i for i, r in enumerate(roles) if r == "feat"]
    guessed = [need for need in ("src", "dst") if need not in roles]
    if len(free) < len(guessed):
        return None
    for need, i in zip(guessed, free):
        roles[i] = need
    if roles[:3] == ["src", "dst", "t"]:
        return None
    return ",".join(roles), ["source" if g == "src" else "destination" for g in guessed]


def _header_key(name: str) -> str:
    """A header name as ``_HEADER_ROLES`` holds it: lower case, unquoted, without spaces, "_" or "-"."""
    return re.sub(r"[\s_-]", "", name.strip().strip("\"'").lower())


def _columns_hint(column: int, columns: str | None) -> str:
    """What to do about text in an edge list's 0-based ``column``: name (or skip) the columns."""
    if columns is not None:
        names = [c.strip() for c in columns.split(",")]
        return f"data.columns={columns!r} reads column {column + 1} as {names[column]}; _ skips a column"
    if column == 2:
        return "the third field is read as the time; name the columns if it is elsewhere: data.columns, e.g. src,dst,_,t"
    skip = ",".join(["src", "dst", "t"] + ["feat"] * (column - 3) + ["_"]) if column > 2 else "src,dst,t,_,_"
    return f"name the columns to read with data.columns, e.g. {skip}"


def _text_id_columns(data: bytes, ids: tuple[int, ...], usecols: list[int] | None) -> tuple[int, ...]:
    """The id columns (src, dst: indices among the columns read) that hold names rather than
    numbers, judged on the first data line (after a header: a first line with no numeric field)."""
    head = data[:1 << 16].decode("utf-8", errors="replace").splitlines()
    for n, line in enumerate([ln for ln in head if ln.strip() and not is_comment(ln)][:2]):
        fields = split_fields(line, "auto")
        if usecols is not None:
            fields = [fields[c] for c in usecols if c < len(fields)]
        if n == 0 and not any(NUMERIC.match(f) for f in fields):
            continue  # a header
        return tuple(c for c in ids if c < len(fields) and not is_float(fields[c]))
    return ()


def _time_field_hint(table, t: np.ndarray) -> str | None:
    """For a file read as ``src dst t [feat...]`` whose third field is out of time order: a hint
    naming a later field that never decreases, the likely time (SNAP's bitcoin files put a rating
    third and the time fourth)."""
    v = table.values
    if v.shape[1] < 4 or not (np.diff(t) < 0).any():
        return None
    for i in range(3, v.shape[1]):
        col = v[:, i]
        if np.isfinite(col).all() and col[-1] > col[0] and not (np.diff(col) < 0).any():
            fields = ["src", "dst"] + ["feat"] * (v.shape[1] - 2)
            fields[i] = "t"
            names = ",".join(fields)
            return (f"field {i + 1} is in time order: if it holds the time, name the columns with "
                    f"\"data.columns='{names}'\" (tgdist data: --columns {names})")
    return None


FEW_TIMES = 100  # distinct values of a time column that are "few" beside a column that looks like Unix times


def _epoch_unit(v: np.ndarray) -> str | None:
    """The unit (s, ms, us, ns) in which every value of ``v`` lies where Unix times of 1980-2100
    do, as ``epoch_time_unit`` tells them; None when they do not."""
    if v.size == 0 or not np.isfinite(v).all():
        return None
    lo, hi = float(np.min(v)), float(np.max(v))
    return next((unit for unit, per_s in TIME_UNITS.items() if 3.15e8 * per_s <= lo and hi <= 4.1e9 * per_s), None)


def _time_column_doubt(table: Table, t: np.ndarray) -> tuple[str, str] | None:
    """For a file read by position, ``src dst t [feat...]``: why its third field is probably not
    the time, and the columns that read the likely time instead; None when nothing is doubtful.

    SNAP's signed networks hold ``source,target,rating,time``: read by position, the ratings
    (-10..10) become the times and the Unix times an edge feature, and training runs at chance
    level. So a third field with negative values or few (``FEW_TIMES``) distinct ones is doubtful
    beside a later field that looks like Unix times: 1980-2100 in s, ms, us or ns, with many
    distinct values (more than ``FEW_TIMES``, or 4 times as many as the third field). A third
    field that looks like Unix times itself, or that a header names as the time, is not."""
    v = table.values
    named_t = table.header is not None and len(table.header) > 2 and _header_key(table.header[2]) in _HEADER_ROLES["t"]
    if v.shape[1] < 4 or named_t or _epoch_unit(t) is not None:
        return None
    later = [i for i in range(3, v.shape[1]) if _epoch_unit(v[:, i]) is not None]  # min and max: cheap
    if not later:
        return None
    distinct, negative = np.unique(t).size, bool(t.min() < 0)
    if not (negative or distinct <= FEW_TIMES):
        return None
    for i in later:
        col = table.column(i)
        many = np.unique(col).size
        if many > FEW_TIMES or many >= 4 * distinct:
            unit = _epoch_unit(col)
            first, last = (time.strftime("%Y-%m-%d", time.gmtime(float(x) / TIME_UNITS[unit]))
                           for x in (col.min(), col.max()))
            fields = ["src", "dst"] + ["feat"] * (v.shape[1] - 2)
            fields[i] = "t"
            why = (f"column 3, read as the time, holds {distinct:,} distinct value{'' if distinct == 1 else 's'}"
                   f"{', some negative' if negative else ''} ({t.min()} .. {t.max()}), but column {i + 1} looks like "
                   f"Unix times{'' if unit == 's' else ' in ' + unit} ({many:,} distinct values, {first} .. {last})")
            return why, ",".join(fields)
    return None

TEXT_SUFFIXES = (".csv", ".txt", ".tsv")


def save_edgelist(graph: TemporalGraph, path: str | Path, chunk: int = 1 << 20) -> Path:
    """Write ``graph`` as a plain edge list (``src,dst,t[,f0,...]`` with a header; tab-separated
    for ``.tsv``; gzip-compressed when the name ends in ``.gz``), atomically, as ``save_native``.
    Ids are the graph's node numbers and times are written exactly; node features and labels have
    no place in an edge list, so a graph that has them is refused."""
    path = Path(path)
    dropped = [what for what, x in (("node features", graph.node_feat), ("event labels", graph.label),
                                    ("node labels", graph.node_labels)) if x is not None]
    if dropped:
        raise DataError(f"{path}: an edge list cannot hold {' and '.join(dropped)}; write a .npz")
    name = path.name.lower()
    sep = "\t" if name.removesuffix(".gz").endswith(".tsv") else ","
    cols = ["src", "dst", "t"] + [f"f{i}" for i in range(graph.edge_dim)]
    fmt = sep.join(["%d", "%d", "%d" if graph.t.dtype.kind == "i" else "%r"] + ["%.9g"] * graph.edge_dim)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw, (gzip.open(raw, "wb") if name.endswith(".gz") else raw) as f:
            f.write((sep.join(cols) + "\n").encode())
            for lo in range(0, graph.num_events, chunk):
                hi = min(lo + chunk, graph.num_events)
                rows = [graph.src[lo:hi], graph.dst[lo:hi], graph.t[lo:hi]]
                if graph.edge_feat is not None:
                    rows += list(graph.edge_feat[lo:hi].T)
                f.write("".join(fmt % r + "\n" for r in zip(*(x.tolist() for x in rows))).encode())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

# Edge lists from this size on are read in blocks of STREAM_BLOCK bytes of text (decompressed): the
# build then holds one block's parse, the id columns and the T-CSR, while edge features go straight
# to their file (``_stream_edgelist``).
STREAM_BYTES = 64 << 20
STREAM_BLOCK = 32 << 20


class _NotStreamable(Exception):
    """The file needs the whole-file reader (unsorted times, ids that are not int64, time columns
    that change type): it is read again that way, which also words any error exactly."""


def _stream_edgelist(origin: Path, columns: str | None, bipartite: bool | None, strict_columns: bool, gname: str,
                     digest: str, size: int, status: Status, entry: Path) -> Prepared | None:
    """Read a large text edge list block by block into a cache entry's arrays: each block parsed by
    the whole-file reader's own code (``_read_edgelist``, the header and comment lines before the
    first data line repeated in front of every block, so every block is read as the file is), each
    column appended to its ``.npy`` beside the entry (``mapped.spool_path``). The ids are then read
    back and numbered as ``finish`` numbers them (sorted original ids), in place, and the T-CSR is
    built. Memory: one block's parse while reading; then the two id columns and the T-CSR; edge
    features never enter memory. None when the file needs the whole-file reader
    (``_NotStreamable``)."""
    from tgdist.data import mapped
    from tgdist.kernels.graph import tcsr_fill

    start = time.perf_counter()
    log.info("reading %s (%s MiB); the parsed graph is cached for later runs", origin, f"{size >> 20:,}")
    spool: dict[str, mapped.NpyAppender] = {}
    notes: list[str] = []
    prefix, last_t, t_dtype, line_base, shown, spec = b"", None, None, 0, -1, columns
    said: list = []  # the first block's warnings (the later blocks', the same or about their own lines, dropped)

    def discard():
        for a in spool.values():
            a.discard()

    def append(name: str, block: np.ndarray) -> None:
        if name not in spool:
            if line_base:  # a column the first block did not have
                raise _NotStreamable
            spool[name] = mapped.NpyAppender(mapped.spool_path(entry, name), block.dtype, block.shape[1:])
        spool[name].append(block)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k, (text, done) in enumerate(text_blocks(origin, STREAM_BLOCK)):
                if k == 0 and text.startswith(b"\xef\xbb\xbf"):
                    text = text[3:]
                if k == 0 and text.startswith(UTF16_BOMS):
                    raise _NotStreamable  # the whole-file reader words it
                try:  # later blocks with the first's column spec: judged once, on the first block
                    raw = _read_edgelist(origin, prefix + text, spec, strict_columns)
                except DataError:
                    if k == 0:
                        raise
                    raise _NotStreamable from None  # its line numbers would be the block's: the whole-file reader words it
                table = raw["table"]
                if k == 0:
                    said = list(caught)
                    ncol = table.values.shape[1]
                    spec = columns or ((_columns_from_header(text) or (None,))[0] or
                                       ",".join(["src", "dst", "t"] + ["feat"] * (ncol - 3)))
                    first_data = int(table.lines[0]) - 1 if table.lines.size else text.count(b"\n")
                    prefix = b"".join(text.splitlines(keepends=True)[:first_data])
                    notes.extend(str(w.message) for w in said if w.category is UserWarning)
                del caught[:]
                if table.text or table.wide or raw["src"].dtype != np.int64 or raw["dst"].dtype != np.int64:
                    raise _NotStreamable
                t = raw["t"]
                if t_dtype is not None and t.dtype != t_dtype:
                    raise _NotStreamable
                t_dtype = t.dtype
                if (t.shape[0] > 1 and (np.diff(t) < 0).any()) or (last_t is not None and t.shape[0] and t[0] < last_t):
                    raise _NotStreamable  # unsorted: sorted by the whole-file reader, with its warning
                for c in ("src", "dst", "t", "label", "edge_feat"):
                    if raw.get(c) is not None:
                        append(c, raw[c])
                    elif c in spool:
                        raise _NotStreamable
                last_t = t[-1] if t.shape[0] else last_t
                line_base += text.count(b"\n")
                percent = int(100 * done / max(size, 1))
                status.set(f"parsing: {done / 2**20:,.0f} of {size / 2**20:,.0f} MiB ({percent}%)")
                if percent // 10 > shown:  # a log line every tenth of the file: progress off a terminal too
                    shown = percent // 10
                    log.info("reading %s: %d%% (%s lines)", origin.name, percent, f"{line_base:,}")
            del raw, table, t, text
    except _NotStreamable:
        discard()
        log.info("%s: read whole (its ids, times or order need the whole-file reader)", origin.name)
        return None
    except BaseException:
        discard()
        raise
    for w in said:
        warnings.warn(w.message, w.category, stacklevel=3)
    try:
        if "src" not in spool or spool["src"].rows == 0:
            raise DataError(f"{origin}: no events")
        paths = {name: a.close() for name, a in spool.items()}
        status.set("numbering the nodes")
        src, dst = np.load(paths["src"]), np.load(paths["dst"])
        n = src.shape[0]
        if bipartite:
            users, items = _sorted_unique(src), _sorted_unique(dst)
            node_map, num_src = np.concatenate([users, items]), int(users.size)
            _renumber(src, users, 0)
            _renumber(dst, items, num_src)
            del users, items
        else:
            ids = np.concatenate([src, dst])
            node_map, num_src = _sorted_unique(ids, in_place=True), 0
            del ids
            _renumber(src, node_map, 0)
            _renumber(dst, node_map, 0)
        np.save(paths["src"], src)
        np.save(paths["dst"], dst)
        status.set("building the T-CSR")
        indptr, nbr, eid = tcsr_fill(src, dst, int(node_map.size), True)
        del src, dst  # in their files
        t = np.load(paths["t"])
        tcsr_t = t[eid]
        del t
        arrays = {**paths, "node_map": node_map, "tcsr_indptr": indptr, "tcsr_nbr": nbr, "tcsr_eid": eid,
                  "tcsr_t": tcsr_t}
    except BaseException:
        discard()
        raise
    meta = {"version": cache.CACHE_VERSION, "num_nodes": int(node_map.size), "bipartite": bool(bipartite),
            "num_src_nodes": num_src, "name": gname, "source_hash": digest, "notes": notes}
    log.info("read %s: %s events, %s nodes, in blocks, in %.1fs", origin.name, f"{n:,}", f"{node_map.size:,}",
             time.perf_counter() - start)
    return Prepared(arrays, meta)


def _sorted_unique(ids: np.ndarray, in_place: bool = False) -> np.ndarray:
    """``np.unique(ids)``, sorting ``ids`` itself when ``in_place`` (no copy of the column)."""
    a = ids if in_place else ids.copy()
    a.sort()
    keep = np.empty(a.shape[0], dtype=bool)
    keep[:1] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def _renumber(ids: np.ndarray, node_map: np.ndarray, base: int, block: int = 1 << 22) -> None:
    """Each original id in ``ids`` replaced by ``base`` + its position in the sorted ``node_map``,
    in place, block by block."""
    for lo in range(0, ids.shape[0], block):
        part = ids[lo:lo + block]
        part[:] = np.searchsorted(node_map, part) + base
