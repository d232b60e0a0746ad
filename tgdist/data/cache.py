"""The processed-graph cache: each source's graph parsed once per machine into a folder of mapped
``.npy`` files (``tgdist.data.mapped``) with its T-CSR, keyed by a digest of the source's bytes and
the reader's options, then mapped read-only by every process. Entries of an older
``CACHE_VERSION`` are removed when a new one is written."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tgdist.data.graph import NodeLabels, TemporalGraph, feature_scale_notes
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

# A graph's arrays by name, in a cache entry and in a tgdist .npz (``tgdist.data.readers.native``).
ARRAYS = ("src", "dst", "t", "node_map", "edge_feat", "node_feat", "label", "ext_roll")
LABEL_ARRAYS = {"node_labels_node": "node", "node_labels_t": "t", "node_labels_label": "label"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("TGDIST_CACHE") or Path.home() / ".cache" / "tgdist")  # set but empty: the default


def digest_source(path: Path, options: dict) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"v": CACHE_VERSION, **options}, sort_keys=True).encode())
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for p in files:
        h.update(os.fsencode(p.name))  # the bytes of a name that is not UTF-8
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def to_arrays(graph: TemporalGraph, notes: list[str] | None = None, tcsr: bool = True) -> tuple[dict, dict]:
    """A graph as the named arrays and JSON meta of a mapped cache entry (``tgdist.data.mapped``),
    with its T-CSR of both directions (what the sampler indexes by default) unless ``tcsr`` is False."""
    from tgdist.kernels.graph import tcsr_fill

    meta = {"version": CACHE_VERSION, "num_nodes": int(graph.num_nodes), "bipartite": bool(graph.bipartite),
            "num_src_nodes": int(graph.num_src_nodes), "name": graph.name, "source_hash": graph.source_hash,
            "notes": list(notes or [])}
    arrays = {k: getattr(graph, k) for k in ARRAYS if getattr(graph, k) is not None}
    if arrays["node_map"].dtype == object:  # decimal text of ids beyond int64 (see _common_ids)
        arrays["node_map"] = arrays["node_map"].astype(str)
    if graph.node_labels is not None:
        arrays.update({k: getattr(graph.node_labels, f) for k, f in LABEL_ARRAYS.items()})
    if tcsr:
        indptr, nbr, eid = tcsr_fill(graph.src, graph.dst, graph.num_nodes, True)
        arrays.update(tcsr_indptr=indptr, tcsr_nbr=nbr, tcsr_eid=eid, tcsr_t=graph.t[eid])
    return arrays, meta


def from_arrays(arrays: dict, meta: dict, folder: str | None = None) -> TemporalGraph:
    """The graph ``to_arrays`` describes; ``folder``: the cache entry its arrays map."""
    labels = None
    if all(k in arrays for k in LABEL_ARRAYS):
        labels = NodeLabels(**{f: arrays[k] for k, f in LABEL_ARRAYS.items()})
    tcsr = {k[len("tcsr_"):]: arrays[k] for k in ("tcsr_indptr", "tcsr_nbr", "tcsr_eid", "tcsr_t") if k in arrays}
    return TemporalGraph(num_nodes=int(meta["num_nodes"]), bipartite=bool(meta["bipartite"]),
                         num_src_nodes=int(meta["num_src_nodes"]), name=meta["name"],
                         source_hash=meta.get("source_hash", ""), node_labels=labels, mapped=folder,
                         tcsr_arrays=tcsr if len(tcsr) == 4 else None, **{k: arrays.get(k) for k in ARRAYS})


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

@dataclass
class Prepared:
    """A cache entry's arrays (some as files already written, see ``mapped.write``) and meta."""

    arrays: dict
    meta: dict


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
