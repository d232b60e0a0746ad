"""``native``: the ``.npz`` that ``save_native`` writes (``tgdist data synth``, a graph saved from
Python), sealed with its checksum; told by its suffix or, under another name, by the ``meta.npy``
inside the zip archive. It holds a finished graph: nothing is parsed."""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from tgdist import checksum
from tgdist.data import cache
from tgdist.data.cache import ARRAYS, LABEL_ARRAYS
from tgdist.data.graph import NodeLabels, TemporalGraph
from tgdist.data.readers import ReadOptions, Reader, Target, register
from tgdist.data.text import ZIP_MAGIC
from tgdist.errors import DataError


@register
class Native(Reader):
    name = "native"
    describes = "a tgdist .npz"
    sniff_rank = 20
    ready_made = True

    def sniff(self, path: Path) -> bool:
        return path.is_file() and (path.suffix == ".npz" or _is_native(path))

    def read(self, path: Path, options: ReadOptions, target: Target | None):
        return _read_native(path)


def save_native(graph: TemporalGraph, path: str | Path, notes: list[str] | None = None) -> Path:
    """Write ``graph`` as an uncompressed .npz, atomically (a temp file renamed into place), sealed
    with its checksum (``tgdist.checksum``), which ``load_native`` checks before parsing it.

    A crash or an error while writing leaves no file at ``path`` and no temporary file behind.
    ``notes``: warnings given while reading the source, repeated whenever the cache entry is used.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"version": cache.CACHE_VERSION, "num_nodes": graph.num_nodes, "bipartite": graph.bipartite,
            "num_src_nodes": graph.num_src_nodes, "name": graph.name, "source_hash": graph.source_hash}
    if notes:
        meta["notes"] = list(notes)
    arrays = {k: getattr(graph, k) for k in ARRAYS if getattr(graph, k) is not None}
    if graph.node_labels is not None:
        arrays.update({k: getattr(graph.node_labels, f) for k, f in LABEL_ARRAYS.items()})
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
            if f.read(4) != ZIP_MAGIC:  # else numpy takes it for a pickle and suggests unpickling it
                raise DataError(f"{path}: not a readable tgdist .npz graph (not a zip archive)")
            f.seek(0)
            with np.load(f, allow_pickle=False) as z:
                if "meta" not in z.files:
                    raise DataError(f"{path}: a NumPy .npz, but not a tgdist graph (it has no 'meta' array; it "
                                    f"holds {', '.join(z.files[:6]) or 'nothing'}): write the events as a text edge "
                                    f"list, or build a TemporalGraph in Python and save it with "
                                    f"tgdist.data.readers.native.save_native")
                meta = json.loads(bytes(z["meta"]).decode())
                arrays = {k: z[k] for k in (*ARRAYS, *LABEL_ARRAYS) if k in z.files}
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{path}: not a readable tgdist .npz graph ({e})") from None
    if int(meta.get("version", 1)) > cache.CACHE_VERSION:
        raise DataError(f"{path}: written by a newer tgdist (format version {meta['version']} > {cache.CACHE_VERSION})")
    for k in ("src", "dst", "t", "node_map"):
        if k not in arrays:
            raise DataError(f"{path}: missing array {k!r}")
    labels = None
    if all(k in arrays for k in LABEL_ARRAYS):
        labels = NodeLabels(**{f: arrays[k] for k, f in LABEL_ARRAYS.items()})
    graph = TemporalGraph(num_nodes=meta["num_nodes"], bipartite=meta["bipartite"], num_src_nodes=meta["num_src_nodes"],
                          name=meta["name"], source_hash=meta.get("source_hash", ""), node_labels=labels,
                          **{k: arrays.get(k) for k in ARRAYS})
    return graph.check(str(path)), [str(n) for n in meta.get("notes", [])]


def _is_native(path: Path) -> bool:
    """A tgdist .npz under another name: a zip archive holding ``meta.npy`` (a ``.zip`` of a text
    edge list holds one text file)."""
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            return False
    try:
        with zipfile.ZipFile(path) as z:
            return "meta.npy" in z.namelist()
    except (zipfile.BadZipFile, OSError):
        return False


