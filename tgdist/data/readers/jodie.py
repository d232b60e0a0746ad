"""``jodie``: JODIE's CSV, ``user,item,timestamp,state_label,features...`` (bipartite, a label per
event, edge features), including the ``u,i,ts,label`` variant; told by its header."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from tgdist.data.readers import ReadOptions, Reader, register
from tgdist.data.text import as_ids, as_times, check_finite, integral, parse_table, read_bytes
from tgdist.errors import DataError

# JODIE's own header is "user_id,item_id,timestamp,state_label,..."; its variant "u,i,ts,label".
# The time must come third: "user,item,rating,timestamp" is an edge list read by its names.
HEADER = re.compile(r"^\s*(user|u)(_id)?\s*,\s*(item|i)(_id)?\s*,\s*(timestamp|ts|time|t)\s*,")


@register
class Jodie(Reader):
    name = "jodie"
    describes = "a JODIE CSV"
    sniff_rank = 30  # after native: a .zip holding a tgdist .npz is no text to look into

    def sniff(self, path: Path) -> bool:
        if not path.is_file():
            return False
        head = read_bytes(path, limit=4096).decode("utf-8", errors="replace").lower()
        first = head.strip().splitlines()[0] if head.strip() else ""
        return HEADER.match(first) is not None

    def parse(self, path: Path, options: ReadOptions) -> dict:
        return _read_jodie(path, read_bytes(path))


def _read_jodie(path: Path, data: bytes) -> dict:
    table = parse_table(path, data)
    if table.values.shape[1] < 4:
        raise DataError(f"{path}:{table.lines[0]}: a JODIE file needs user,item,timestamp,state_label[,features...]; found {table.values.shape[1]} fields")
    out = {"src": as_ids(table, 0, "user"), "dst": as_ids(table, 1, "item"), "t": as_times(table, 2),
           "label": integral(table, 3, "state_label"), "table": table, "bipartite": True}
    if table.values.shape[1] > 4:
        feats = table.values[:, 4:].astype(np.float32)
        check_finite(feats, table, "edge feature")
        out["edge_feat"] = feats
    return out


