"""Node ids that are only labels (negative, beyond int64), kept exactly in ``node_map`` and
through the cache."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tgdist.errors import DataError
from tgdist.runtime import data as tdata
from tgdist.runtime.data import load_graph, load_native, save_native


def write_rows(path: Path, rows, header: str | None = None) -> Path:
    lines = ([header] if header else []) + [",".join(map(str, r)) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Node ids are labels: negative, beyond int64, mixed


BIG = 2**64 - 1  # uint64's largest, as hashed ids have them


@pytest.mark.parametrize("text, dtype, node_map", [
    (f"{BIG},5,1\n{2**63},{BIG},2\n5,7,3\n", np.uint64, [5, 7, 2**63, BIG]),
    ("-1,5,1\n-7,-1,2\n5,7,3\n", np.int64, [-7, -1, 5, 7]),
    # negative and beyond int64 together: no 64-bit integer holds both, so their decimal text
    (f"{BIG},-5,1\n{2**63},{BIG},2\n-5,7,3\n", np.dtype("U20"), ["-5", "7", str(2**63), str(BIG)]),
    (f"{BIG},-5,1.5\n{2**63},{BIG},2\n-5,7,3\n", np.dtype("U20"), ["-5", "7", str(2**63), str(BIG)]),  # float times
    (f"alice,{BIG},1\nbob,-3,2\n", np.dtype("U20"), ["-3", str(BIG), "alice", "bob"]),  # beside names
])
def test_ids_beyond_int64_and_negative_ids_are_remapped_exactly(tmp_path, cache_dir, monkeypatch, text, dtype,
                                                                   node_map):
    path = tmp_path / "ids.csv"
    path.write_text(text)
    rows = [ln.split(",") for ln in text.splitlines()]
    g = load_graph(path)
    assert g.node_map.dtype == dtype and g.node_map.tolist() == node_map
    assert [str(x) for x in g.node_map[g.src]] == [r[0] for r in rows]
    assert [str(x) for x in g.node_map[g.dst]] == [r[1] for r in rows]
    monkeypatch.setattr(tdata, "_read_edgelist", None)  # from the cache entry, exactly as read
    again = load_graph(path)
    assert again.node_map.dtype == dtype and again.node_map.tolist() == node_map
    assert again.src.tolist() == g.src.tolist() and again.dst.tolist() == g.dst.tolist()


def test_bipartite_sides_keep_their_exact_ids(tmp_path, cache_dir):
    path = tmp_path / "b.csv"
    path.write_text(f"-2,{BIG},1\n3,-2,2\n")
    g = load_graph(path, bipartite=True)
    assert g.num_src_nodes == 2 and g.node_map.tolist() == ["-2", "3", "-2", str(BIG)]
    assert g.node_map[g.src].tolist() == ["-2", "3"] and g.node_map[g.dst].tolist() == [str(BIG), "-2"]


def test_native_format_keeps_uint64_and_text_node_maps(tmp_path):
    for path in (tmp_path / "u.csv", tmp_path / "m.csv"):
        path.write_text(f"{BIG},{2**63},1\n{'-1' if path.stem == 'm' else '1'},{BIG},2\n")
        g = load_graph(path, cache=False)
        back = load_native(save_native(g, tmp_path / f"{path.stem}.npz"))
        assert back.node_map.dtype == g.node_map.dtype and back.node_map.tolist() == g.node_map.tolist()
    assert g.node_map.tolist() == ["-1", str(2**63), str(BIG)]


def test_jodie_and_tgl_ids_are_labels_too(tmp_path, cache_dir):
    torch = pytest.importorskip("torch")
    g = load_graph(write_rows(tmp_path / "j.csv", [(-3, BIG, 1, 0), (-3, 7, 2, 1)],
                              header="user_id,item_id,timestamp,state_label"))
    assert g.bipartite and g.node_map.tolist() == ["-3", "7", str(BIG)]
    d = tmp_path / "tgl"
    d.mkdir()
    write_rows(d / "edges.csv", [(0, BIG, 2**63, 1), (1, 2**63, 5, 2)], header=",src,dst,time")
    write_rows(d / "labels.csv", [(0, BIG, 1, 1), (1, 5, 2, 0), (2, 4, 2, 1)], header=",node,time,label")
    with pytest.warns(UserWarning, match="node 4 has no events"):
        g = load_graph(d)
    assert g.node_map.dtype == np.uint64 and g.node_map.tolist() == [5, 2**63, BIG]
    assert g.node_map[g.node_labels.node].tolist() == [BIG, 5]
    # node features are rows indexed by node id: a negative id indexes none
    write_rows(d / "edges.csv", [(0, -1, 2, 1), (1, 2, 3, 2)], header=",src,dst,time")
    (d / "labels.csv").unlink()
    torch.save(torch.zeros(4, 2), d / "node_features.pt")
    with pytest.raises(DataError, match=re.escape(f"{d / 'node_features.pt'}: rows are indexed by node id, but node "
                                                  f"id -1 occurs in edges.csv")):
        load_graph(d)
