"""TGB link-prediction data sets (``tgbl-*``) read from the files TGB's loader downloads, with TGB's
split and the negative destinations TGB ships for validation and test (its one-vs-many protocol).

A TGB data set lives in one folder, ``ROOT/`` or TGB's own ``ROOT/tgbl_wiki/`` (the name with
``_`` for ``-``):
  * ``{name}_edgelist_v2.csv`` (``_edgelist.csv`` for the data sets TGB has at version 1), one
    header line, then one event a line in the column layout of its family (``FAMILIES``);
  * ``{name}_val_ns_v2.pkl`` and ``{name}_test_ns_v2.pkl``: a pickled dict from each validation
    or test event ``(src, dst, t)`` to the array of its negative destinations. Lists may differ in
    length (the generator leaves out the event's own destinations at its time and source).
  * ``airport_node_feat_v2.csv`` for ``tgbl-flight`` (node features).

Node ids are TGB's own (the pickles name nodes by them), so ``node_map`` is the identity.
The split is TGB's: by time quantiles of all events, train ``t <= q(0.70)``, validation
``q(0.70) < t <= q(0.85)``, test ``t > q(0.85)`` (numpy's linear quantile), carried as
``TemporalGraph.ext_roll`` so that ``chronological_split`` keeps it.

The pickles are read through a restricted unpickler (``NegativesUnpickler``) that builds only what
TGB's files hold, a dict of tuples of numpy integers to numpy arrays, and refuses any other
global, so a crafted file cannot run code. Both are read and matched to their events when the
trainer is built (``shipped_negatives``): a damaged or foreign file is refused before training.

A cached edge list (``read(cache=True)``) is keyed by the BLAKE2b digest of its bytes (and of the
airport file's), as plain files are: a file changed in place, even to the same size and time, is
parsed again.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import importlib.util
import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tgdist.data.cache import CACHE_VERSION, cached_graph, default_cache_dir
from tgdist.data.graph import TemporalGraph
from tgdist.data.mapped import digest_file
from tgdist.errors import ConfigError, DataError

log = logging.getLogger(__name__)

# name -> (file version, family). Families, by how TGB's loader reads the edge list:
#   jodie:   src, dst, t, state label, features...; destinations moved past the sources
#            (dst + max(src) + 1), times truncated to integers
#   weight:  t, src, dst, weight; ids are names numbered in order of first appearance (src before
#            dst), edge feature log2(weight) with a weight of 0 read as 1
#   comment: t, src, dst, words, score; ids as weight; edge features [words / 5000] * 2 + [score]
#   flight:  day (Unix seconds or YYYY-MM-DD, local time), src, dst, callsign, typecode; ids as
#            weight; 16 edge features from the two codes, node features from the airport file
DATASETS = {
    "tgbl-wiki": (2, "jodie"), "tgbl-subreddit": (1, "jodie"), "tgbl-uci": (1, "jodie"), "tgbl-enron": (1, "jodie"),
    "tgbl-lastfm": (1, "jodie"), "tgbl-review": (2, "weight"), "tgbl-coin": (2, "weight"),
    "tgbl-comment": (1, "comment"), "tgbl-flight": (2, "flight"),
}
PARTS = ("val", "test")
VAL_RATIO = TEST_RATIO = 0.15  # TGB's split of every tgbl data set
MAX_WORDS = 5000  # tgbl-comment: its word counts are divided by this
READER_VERSION = 2  # bump when a reader's output changes, so cache entries made by the old one are not used


def check_name(name: str) -> tuple[int, str]:
    if name not in DATASETS:
        raise ConfigError(f"data.name={name}: data=tgb reads the TGB link-prediction data sets "
                          f"{', '.join(DATASETS)}")
    return DATASETS[name]


def default_root() -> Path | None:
    """TGB's own folder for its data sets, ``<py-tgb package>/datasets`` (where its dataset class
    downloads), or None without py-tgb."""
    try:
        import tgb
    except ImportError:
        return None
    return Path(tgb.__file__).resolve().parent / "datasets"


@dataclass(frozen=True)
class Files:
    """Where a TGB data set's files are: ``edges``, ``negatives[part]``, ``nodes`` (tgbl-flight)."""

    name: str
    folder: Path
    edges: Path
    negatives: dict
    nodes: Path | None

    def all(self) -> list[Path]:
        return [self.edges, *self.negatives.values(), *([self.nodes] if self.nodes else [])]


def files(name: str, root: str | Path | None) -> Files:
    """The files of data set ``name`` under ``root`` (or under ``root/<name with _>``, TGB's layout,
    when that folder exists); ``root`` None: TGB's own folder (``default_root``)."""
    version, family = check_name(name)
    base = Path(root).expanduser() if root is not None else default_root()
    if base is None:
        raise ConfigError(f"data=tgb needs data.root=DIR, the folder that holds {name}'s files (or py-tgb installed, "
                          f"whose own data folder is the default: pip install py-tgb)")
    folder = base / name.replace("-", "_")
    folder = folder if folder.is_dir() else base
    v = f"_v{version}" if version > 1 else ""
    return Files(name, folder, folder / f"{name}_edgelist{v}.csv",
                 {p: folder / f"{name}_{p}_ns{v}.pkl" for p in PARTS},
                 folder / f"airport_node_feat{v}.csv" if family == "flight" else None)


def missing(f: Files, parts=("edges", *PARTS)) -> Path | None:
    """The first file of ``f`` that is not there (``parts``: which ones matter), else None."""
    wanted = ([f.edges] + ([f.nodes] if f.nodes else []) if "edges" in parts else []) + [
        f.negatives[p] for p in PARTS if p in parts]
    return next((p for p in wanted if not p.is_file()), None)


def how_to_get(name: str, root) -> str:
    where = f" data.root={root}" if root is not None else ""
    return (f"fetch it with py-tgb on a machine with network (pip install py-tgb, then run with data.download=true"
            f"{where}), or copy the unzipped TGB download of {name} there")


def check_files(name: str, root, parts=("edges", *PARTS)) -> Files:
    """The files, all there, or a ``DataError`` naming the first missing one and how to get it."""
    f = files(name, root)
    if (gone := missing(f, parts)) is not None:
        raise DataError(f"data=tgb: {gone} is missing; {how_to_get(name, root)}")
    return f


def fetch(name: str, root: str | Path | None) -> Files:
    """Download ``name`` through TGB's own dataset class (py-tgb, network), which writes to its
    package folder, and copy the files to ``root`` (when given and elsewhere)."""
    try:
        from tgb.linkproppred.dataset import LinkPropPredDataset
    except ImportError:
        raise ConfigError("data.download=true fetches TGB data sets through py-tgb: pip install py-tgb") from None
    try:
        ds = LinkPropPredDataset(name=name, root="datasets", download=True, preprocess=True)
    except Exception as e:  # noqa: BLE001 - network and TGB's own errors, as one line
        raise DataError(f"data=tgb: fetching {name} through py-tgb failed: {type(e).__name__}: {e}") from None
    got = files(name, ds.root)
    if root is not None:
        dest = Path(root).expanduser()
        dest.mkdir(parents=True, exist_ok=True)
        for src in got.all():
            if src.is_file() and not (dest / src.name).exists():
                shutil.copy2(src, dest / src.name)
        return check_files(name, root)
    return check_files(name, ds.root)


# ------------------------------------------------------------------------------------------------
# The edge list


def tgb_roll(t: np.ndarray) -> np.ndarray:
    """TGB's split of events at times ``t`` as an ``ext_roll`` (0 train, 1 val, 2 test)."""
    val_time, test_time = np.quantile(t, [1 - VAL_RATIO - TEST_RATIO, 1 - TEST_RATIO])
    return ((t > val_time).astype(np.int8) + (t > test_time).astype(np.int8)).astype(np.int8)


def _body(path: Path) -> list[list[str]]:
    with open(path, newline="") as fh:
        rows = csv.reader(fh)
        next(rows, None)  # the header
        return [r for r in rows if r]


def _number_ids(rows: list[list[str]]) -> tuple[np.ndarray, np.ndarray, dict]:
    """src and dst (columns 1 and 2) as ids numbered in order of first appearance, src first."""
    ids: dict[str, int] = {}
    src = np.empty(len(rows), np.int64)
    dst = np.empty(len(rows), np.int64)
    for k, r in enumerate(rows):
        src[k] = ids.setdefault(r[1], len(ids))
        dst[k] = ids.setdefault(r[2], len(ids))
    return src, dst, ids


def _read_jodie(path: Path) -> dict:
    try:
        table = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2, dtype=np.float64)
    except ValueError as e:
        raise DataError(f"{path}: not a TGB edge list of the tgbl-wiki family (src,dst,t,label,features...): {e}") \
            from None
    if table.shape[1] < 4:
        raise DataError(f"{path}: {table.shape[1]} columns; the tgbl-wiki family has src, dst, t, label, features...")
    src = table[:, 0].astype(np.int64)
    shift = int(src.max()) + 1 if len(src) else 0
    feat = table[:, 4:].astype(np.float32) if table.shape[1] > 4 else None
    return {"src": src, "dst": table[:, 1].astype(np.int64) + shift, "t": table[:, 2].astype(np.int64),
            "edge_feat": feat, "bipartite": True, "num_src_nodes": shift}


def _read_weight(path: Path) -> dict:
    rows = _body(path)
    src, dst, _ = _number_ids(rows)
    w = np.array([float(r[3]) for r in rows], dtype=np.float64)
    w[w == 0] = 1
    return {"src": src, "dst": dst, "t": np.array([int(r[0]) for r in rows], dtype=np.int64),
            "edge_feat": np.log2(w).astype(np.float32)[:, None]}


def _read_comment(path: Path) -> dict:
    rows = _body(path)
    src, dst, _ = _number_ids(rows)
    words = np.array([int(r[3]) / MAX_WORDS for r in rows], dtype=np.float64)
    score = np.array([float(int(r[4])) for r in rows], dtype=np.float64)
    return {"src": src, "dst": dst, "t": np.array([int(r[0]) for r in rows], dtype=np.int64),
            "edge_feat": np.stack([words, words, score], 1).astype(np.float32)}


def _code_vector(text: str) -> list[float]:
    """A code as numbers, one per character: digits as themselves, '!' (padding) -1, letters
    and other characters by their upper-case code point minus 35 (A: 30)."""
    return [float(c) if c.isnumeric() else -1.0 if c == "!" else float(ord(c.upper()) - 35) for c in text]


def _padded(code: str) -> str:
    code = code or "!" * 8
    return "!" * 8 if len(code) > 8 else code.ljust(8, "!")


def _day(text: str) -> int:
    if text.isdigit():
        return int(text)
    return int(datetime.datetime.strptime(text, "%Y-%m-%d").timestamp())  # local time, as TGB reads it


def _read_flight(path: Path, nodes: Path) -> dict:
    rows = _body(path)
    src, dst, ids = _number_ids(rows)
    digits = rows[0][0].isdigit() if rows else True
    t = np.array([int(r[0]) if digits else _day(r[0]) for r in rows], dtype=np.int64)
    callsign = [(r[3] or "!" * 8).ljust(8, "!") for r in rows]
    feat = np.array([_code_vector(c + _padded(r[4])) for c, r in zip(callsign, rows)], dtype=np.float32)
    return {"src": src, "dst": dst, "t": t, "edge_feat": feat, "node_feat": _airports(nodes, ids)}


def _airports(path: Path, ids: dict) -> np.ndarray:
    """tgbl-flight's node features: one-hot airport type and continent (in order of first
    appearance among the airports of the edge list), the region code as numbers, longitude, latitude."""
    rows = [r for r in _body(path) if r[0] in ids]
    types, continents = {}, {}
    for r in rows:
        types.setdefault(r[1], len(types))
        continents.setdefault(r[2], len(continents))
    out = np.zeros((len(ids), 20), np.float32)
    for r in rows:
        vec = np.zeros(len(types) + len(continents))
        vec[types[r[1]]] = 1
        vec[len(types) + continents[r[2]]] = 1
        row = np.concatenate([vec, _code_vector(r[3].ljust(7, "!")), [float(r[4]), float(r[5])]])
        out[ids[r[0]], :len(row)] = row
    return out


def read(name: str, root=None, cache: bool = False, cache_dir: str | Path | None = None) -> TemporalGraph:
    """TGB data set ``name`` as a ``TemporalGraph`` with TGB's node ids and split (``ext_roll``).
    ``cache``: through the processed-graph cache (``tgdist.data.cache.cached_graph``, in ``cache_dir`` or the
    default folder), keyed by the digest of the files' bytes: parsed once per machine, then mapped
    by every process (the larger TGB edge lists take minutes to parse; hashing them, seconds)."""
    f = check_files(name, root, parts=("edges",))
    digest = source_digest(f)
    if not cache:
        return _parse(name, f, digest)
    key = hashlib.blake2b(repr((READER_VERSION, CACHE_VERSION, name, digest)).encode(),
                          digest_size=16).hexdigest()
    folder = Path(cache_dir or default_cache_dir()) / f"{name}-{key}"
    return cached_graph(folder, lambda: (_parse(name, f, digest), []))


def source_digest(f: Files) -> str:
    """What names the edge list's content: the BLAKE2b digests of its bytes and of the airport file's
    (tgbl-flight), not their paths or times, so a file changed in place is never taken for the old."""
    return hashlib.blake2b(repr([digest_file(p) for p in (f.edges, f.nodes) if p is not None]).encode(),
                           digest_size=16).hexdigest()


def _parse(name: str, f: Files, digest: str) -> TemporalGraph:
    family = DATASETS[name][1]
    reader = {"jodie": _read_jodie, "weight": _read_weight, "comment": _read_comment}.get(family)
    try:
        raw = reader(f.edges) if reader else _read_flight(f.edges, f.nodes)
    except (IndexError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{f.edges}: not a TGB edge list of {name}'s layout: {type(e).__name__}: {e}") from None
    src, dst, t = raw["src"], raw["dst"], raw["t"]
    if len(t) == 0:
        raise DataError(f"{f.edges}: no events")
    order = None
    if (np.diff(t) < 0).any():  # TGB's files are in time order; its loader keeps file order
        log.warning("%s: the events are not in time order; sorted by time (stable)", f.edges)
        order = np.argsort(t, kind="stable")
    per_event = {"src": src, "dst": dst, "t": t, "edge_feat": raw.get("edge_feat")}
    if order is not None:
        per_event = {k: (v[order] if v is not None else None) for k, v in per_event.items()}
    node_feat = raw.get("node_feat")
    num_nodes = max(int(per_event["src"].max()), int(per_event["dst"].max())) + 1
    if node_feat is not None:
        num_nodes = max(num_nodes, len(node_feat))
    g = TemporalGraph(per_event["src"], per_event["dst"], per_event["t"], num_nodes, np.arange(num_nodes),
                      edge_feat=per_event["edge_feat"], node_feat=node_feat, bipartite=bool(raw.get("bipartite")),
                      num_src_nodes=int(raw.get("num_src_nodes", 0)), ext_roll=tgb_roll(per_event["t"]), name=name,
                      source_hash=digest[:16])
    return g.check(str(f.edges))


# ------------------------------------------------------------------------------------------------
# The shipped negatives


@dataclass
class OneVsMany:
    """The negative destinations of the events ``[lo, lo + n)`` of one part: event ``lo + k``'s
    are ``dst[ptr[k]:ptr[k + 1]]``. Shapes: ``ptr [n + 1]`` int64, ``dst [ptr[-1]]`` int32 (int64 for
    graphs of more than 2**31 - 1 nodes): 4 bytes a negative, kept from the run's start to its end."""

    lo: int
    ptr: np.ndarray
    dst: np.ndarray

    @property
    def num_events(self) -> int:
        return len(self.ptr) - 1

    def lengths(self, a: int, b: int) -> np.ndarray:
        """``[b - a]``: how many negatives each of the events ``[a, b)`` has."""
        return np.diff(self.ptr[a - self.lo:b - self.lo + 1])

    def padded(self, a: int, b: int, pad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The negatives of events ``[a, b)`` as ``[b - a, width]`` (width: the longest list),
        short rows filled with ``pad [b - a]`` (any node: its scores are masked), and the mask
        ``[b - a, width]`` of real entries."""
        lens = self.lengths(a, b)
        width = max(int(lens.max()) if len(lens) else 0, 1)
        valid = np.arange(width)[None, :] < lens[:, None]
        out = np.repeat(np.asarray(pad, np.int64)[:, None], width, 1)
        out[valid] = self.dst[self.ptr[a - self.lo]:self.ptr[b - self.lo]]
        return out, valid


# numpy's own module for its reconstruction helpers: ``numpy._core`` from numpy 2 on (which still
# reads the ``numpy.core`` of files written by numpy 1), ``numpy.core`` before
_CORE = "numpy._core" if importlib.util.find_spec("numpy._core") is not None else "numpy.core"

# What a TGB negatives file is made of (protocols 2 to 5): numpy arrays (``_frombuffer`` from
# protocol 5, ``_reconstruct`` with ``ndarray`` before), numpy integer scalars (the keys), their
# dtypes, and the bytes protocol 2 spells through ``_codecs.encode``. Dicts, tuples, lists,
# numbers and strings are opcodes and need no global.
ALLOWED_GLOBALS = frozenset({
    ("numpy", "dtype"), ("numpy", "ndarray"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy.core.numeric", "_frombuffer"),
    ("_codecs", "encode"), ("builtins", "bytes"), ("__builtin__", "bytes"),
})


class NegativesUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``ALLOWED_GLOBALS``: any other global (``os.system``,
    ``builtins.eval``, a class with a ``__reduce__``) is an ``UnpicklingError`` raised before it is
    imported, so a crafted file cannot run code; persistent ids are refused by ``pickle.Unpickler``
    itself."""

    def find_class(self, module: str, name: str):
        canonical = module.replace("numpy._core.", "numpy.core.")
        if (canonical, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a TGB negative-sample file never holds "
                                         f"(it holds numpy arrays in a dict): refused, not run")
        return super().find_class(canonical.replace("numpy.core.", f"{_CORE}."), name)


def _load_pickle(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            table = NegativesUnpickler(fh).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError,
            IndexError, KeyError, MemoryError) as e:
        text = " ".join(str(e).split()) or "truncated or damaged"
        raise DataError(f"{path}: not a TGB negative-sample file: {type(e).__name__}: {text}") from None
    if not isinstance(table, dict):
        raise DataError(f"{path}: not a TGB negative-sample file (a {type(table).__name__}, not a dict keyed by "
                        f"(src, dst, t))")
    return table


def match_negatives(table: dict, graph: TemporalGraph, lo: int, hi: int, where: str) -> OneVsMany:
    """Each event ``[lo, hi)``'s entry of ``table`` (``(src, dst, t)`` -> negatives) as a ``OneVsMany``;
    a ``DataError`` naming the first event without one."""
    arrays = []
    keys = zip(graph.src[lo:hi].tolist(), graph.dst[lo:hi].tolist(), graph.t[lo:hi].tolist())
    for e, key in enumerate(keys, lo):
        neg = table.get(key)
        if neg is None:
            raise DataError(f"{where}: no negatives for event {e} (src {key[0]}, dst {key[1]}, t {key[2]}): the file "
                            f"does not belong to this edge list")
        arr = np.asarray(neg).reshape(-1)
        if arr.dtype.kind not in "iuf":
            raise DataError(_not_ids(where, graph, e, arr.dtype))
        arrays.append(arr)
    ptr = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([len(a) for a in arrays], out=ptr[1:])
    cat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)  # float64 where a list is (TGB's empty ones)
    if cat.dtype.kind == "f" and not (whole := np.isfinite(cat) & (cat == np.round(cat))).all():
        k = int(np.searchsorted(ptr, np.flatnonzero(~whole)[0], side="right")) - 1
        raise DataError(_not_ids(where, graph, lo + k, arrays[k].dtype))
    if len(cat) and (cat.min() < 0 or cat.max() >= graph.num_nodes):  # (before narrowing, which would wrap)
        bad = int(cat.max() if cat.max() >= graph.num_nodes else cat.min())
        raise DataError(f"{where}: negative destination {bad} is not a node of the edge list "
                        f"(0..{graph.num_nodes - 1})")
    return OneVsMany(lo, ptr, cat.astype(np.int32 if graph.num_nodes <= np.iinfo(np.int32).max else np.int64))


def _not_ids(where: str, graph: TemporalGraph, e: int, dtype) -> str:
    return (f"{where}: the negatives of event {e} (src {graph.src[e]}, dst {graph.dst[e]}, t {graph.t[e]}) are not "
            f"node ids (an array of {dtype})")


@dataclass
class ShippedNegatives:
    """The val and test negatives of a TGB data set, ``parts[part]`` a ``OneVsMany`` over the part's
    events. ``shipped_negatives`` reads and matches both files when the trainer is built, so a
    damaged or foreign file is refused before training, not after it."""

    parts: dict

    def has(self, part: str) -> bool:
        return part in self.parts

    def part(self, part: str) -> OneVsMany:
        return self.parts[part]


def read_negatives(path: Path, graph: TemporalGraph, lo: int, hi: int) -> OneVsMany:
    """The negatives file ``path`` (restricted unpickling) matched to the events ``[lo, hi)``."""
    log.info("reading the negatives of %s's events %d..%d from %s", graph.name, lo, hi - 1, path)
    return match_negatives(_load_pickle(path), graph, lo, hi, str(path))


def shipped_negatives(name: str, root, graph: TemporalGraph, split) -> ShippedNegatives:
    """Both parts' negatives, read and checked now (at the run's start): each file whole, through
    ``NegativesUnpickler``, every event of its part matched to its list. What is kept is the
    ``OneVsMany`` arrays (4 bytes a negative), not the pickled dict."""
    f = check_files(name, root, parts=PARTS)
    return ShippedNegatives({p: read_negatives(f.negatives[p], graph, *split.range(p)) for p in PARTS})


def root_of(data_cfg) -> str | None:
    """``data.root`` as a path string, or None."""
    root = getattr(data_cfg, "root", None)
    return None if root in (None, "") else os.fspath(root)
