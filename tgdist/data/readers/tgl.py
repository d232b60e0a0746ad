"""``tgl``: a TGL dataset directory: ``edges.csv`` with ``,src,dst,time,ext_roll``,
``edge_features.pt``, ``node_features.pt``, ``labels.csv`` with ``,node,time,label[,ext_roll]``
node-classification labels (read into ``TemporalGraph.node_labels``); told by its ``edges.csv``."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np

from tgdist.data.readers import ReadOptions, Reader, register
from tgdist.data.text import as_ids, as_times, integral, parse_table, read_bytes
from tgdist.errors import DataError


@register
class TGL(Reader):
    name = "tgl"
    describes = "a TGL dataset directory"
    sniff_rank = 10

    def sniff(self, path: Path) -> bool:
        return path.is_dir() and (path / "edges.csv").exists()

    def parse(self, path: Path, options: ReadOptions) -> dict:
        return _read_tgl(path)


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
    table = parse_table(path, read_bytes(path), delimiter=",")
    col = _tgl_columns(path, table, ("node", "time", "label"), ",node,time,label")
    return {"node": as_ids(table, col["node"], "node"), "t": as_times(table, col["time"]),
            "label": integral(table, col["label"], "label"), "table": table}


def _read_tgl(path: Path) -> dict:
    edges = path / "edges.csv"
    table = parse_table(edges, read_bytes(edges), delimiter=",")
    col = _tgl_columns(edges, table, ("src", "dst", "time"), ",src,dst,time,ext_roll")
    out = {"src": as_ids(table, col["src"], "source"), "dst": as_ids(table, col["dst"], "destination"),
           "t": as_times(table, col["time"]), "table": table}
    if "ext_roll" in col:
        roll = integral(table, col["ext_roll"], "ext_roll")
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


