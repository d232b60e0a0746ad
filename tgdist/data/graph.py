"""Temporal graphs and what every reader shares: the graph type, finishing a reader's raw columns
into one (order, id remapping, checks), splits, labels and subsets.

A graph is a stream of events (src, dst, t) sorted by t, with optional edge features, node
features and labels. Node ids are remapped to 0..N-1 (the original ids are kept in
``node_map``); for bipartite graphs sources come first, 0..num_src_nodes-1, then destinations.
Timestamps are kept exactly: int64 when every time is an integer, float64 otherwise.

The formats are read by the readers of ``tgdist.data.readers`` (one module each, chosen by
``data.format`` or by their sniffing rules), through ``tgdist.data.load``; the processed graphs
are cached by ``tgdist.data.cache``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tgdist.errors import DataError


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


def finish(raw: dict, *, name: str, source_hash: str, bipartite: bool | None, strict_order: bool,
           origin: Path) -> TemporalGraph:
    """The graph of a reader's raw columns (``tgdist.data.readers``): events sorted by time (with
    a warning, or an error when ``strict_order``), node ids remapped (sources first when
    ``bipartite``, None: as the reader says), node features and labels moved to the new ids."""
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


def feature_scale_notes(graph: TemporalGraph) -> list[str]:
    """Warnings about features too large for float32 layers (read in place: no copy)."""
    notes = []
    for what, feat in (("edge", graph.edge_feat), ("node", graph.node_feat)):
        largest = max(float(feat.max()), -float(feat.min())) if feat is not None and feat.size else 0.0
        if largest > 1e12:  # float32 products of such values saturate the layers: every score ties
            notes.append(f"{what} features reach {largest:.3g} in magnitude; the model's layers saturate on such "
                         f"values (every score may tie): standardise them first")
    return notes


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
