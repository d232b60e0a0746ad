"""Edge-list columns that are probably wrong (a rating read as the time) and node ids that are
only labels (negative, beyond int64), kept exactly in ``node_map`` and through the cache."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from tgdist.data.load import load_graph
from tgdist.data.readers import edgelist as edgelist_reader
from tgdist.data.readers.native import load_native, save_native
from tgdist.errors import DataError

EPOCH = 1_289_241_911  # 2010-11-08, where SNAP's bitcoin-otc starts


def snap_rows(n: int = 120, seed: int = 0, times: np.ndarray | None = None) -> list[tuple]:
    """``source,target,rating,time`` as SNAP's signed networks hold them: ratings -10..10, Unix
    times (out of order: the check must not lean on the order)."""
    rng = np.random.default_rng(seed)
    if times is None:
        times = EPOCH + rng.permutation(n) * 3_600
    ratings = np.arange(n) % 21 - 10  # all 21 values
    return [(int(rng.integers(1, 30)), int(rng.integers(1, 30)), int(r), int(t)) for r, t in zip(ratings, times)]


def write_rows(path: Path, rows, header: str | None = None) -> Path:
    lines = ([header] if header else []) + [",".join(map(str, r)) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def line_of(message: str) -> str:
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------
# A third field that is probably not the time


def snap_doubt(path, distinct: int, later: str) -> str:
    """The line stopping a SNAP-shaped file read by position: its ratings (-10..10) in column 3."""
    return (f"{path}: column 3, read as the time, holds {distinct} distinct values, some negative (-10 .. 10), but "
            f"column 4 looks like Unix times ({later}): name the columns, \"data.columns='src,dst,feat,t'\" (tgdist "
            f"data: --columns src,dst,feat,t), or set data.strict_columns=false (tgdist data: --columns src,dst,t,feat) "
            f"to read column 3 as the time")


def test_a_rating_read_as_the_time_stops_the_read_and_names_the_columns(tmp_path, cache_dir):
    path = write_rows(tmp_path / "otc.csv", snap_rows())
    with pytest.raises(DataError) as err:
        load_graph(path)
    assert line_of(str(err.value)) == snap_doubt(path, 21, "120 distinct values, 2010-11-08 .. 2010-11-13")
    assert list(cache_dir.iterdir()) == []  # a refused read leaves no cache entry


def test_the_suggested_columns_read_the_times(tmp_path, cache_dir):
    rows = snap_rows()
    with pytest.warns(UserWarning, match="events are not sorted by time"):  # SNAP's order, sorted as before
        g = load_graph(write_rows(tmp_path / "otc.csv", rows), columns="src,dst,feat,t")
    assert g.t.tolist() == sorted(r[3] for r in rows) and g.t.dtype == np.int64
    by_time = sorted(rows, key=lambda r: r[3])
    assert g.edge_feat[:, 0].tolist() == [r[2] for r in by_time]
    assert g.node_map[g.src].tolist() == [r[0] for r in by_time]


def test_naming_the_columns_as_they_are_or_relaxing_the_check_reads_column_3(tmp_path, cache_dir, monkeypatch):
    path = write_rows(tmp_path / "otc.csv", snap_rows())
    with pytest.warns(UserWarning) as caught:  # the ratings are out of order, and sorted; nothing else
        assert load_graph(path, columns="src,dst,t,feat").t.min() == -10
    assert [str(w.message).split(": ", 1)[1] for w in caught] == ["events are not sorted by time; sorting them stably"]
    with pytest.warns(UserWarning) as caught:
        g = load_graph(path, strict_columns=False)
    assert g.t.min() == -10 and g.edge_feat[:, 0].min() >= EPOCH
    assert str(caught[0].message) == (
        f"{path}: column 3, read as the time, holds 21 distinct values, some negative (-10 .. 10), but column 4 "
        f"looks like Unix times (120 distinct values, 2010-11-08 .. 2010-11-13); column 3 is read as the time, as "
        f"data.strict_columns=false asks (\"data.columns='src,dst,feat,t'\" (tgdist data: --columns src,dst,feat,t) "
        f"reads the other)")
    # the relaxed read's cache entry repeats the warning, and never serves a strict read
    monkeypatch.setattr(edgelist_reader, "_read_edgelist", None)
    with pytest.warns(UserWarning) as again:
        assert load_graph(path, strict_columns=False).t.min() == -10
    assert [str(w.message) for w in again] == [str(w.message) for w in caught]
    monkeypatch.undo()
    with pytest.raises(DataError, match="or set data.strict_columns=false"):
        load_graph(path)


@pytest.mark.parametrize("ratings, why", [
    (lambda n: np.arange(n) % 5 + 1, "holds 5 distinct values (1 .. 5)"),  # few values, none negative
    (lambda n: np.arange(n) - 5, "holds 120 distinct values, some negative (-5 .. 114)"),  # many, some negative
])
def test_few_or_negative_values_are_doubtful(tmp_path, cache_dir, ratings, why):
    rows = [(s, d, int(r), EPOCH + 60 * i) for i, ((s, d, _, _), r) in enumerate(zip(snap_rows(), ratings(120)))]
    path = write_rows(tmp_path / "f.csv", rows)
    with pytest.raises(DataError, match=re.escape(f"column 3, read as the time, {why}, but column 4 looks like")):
        load_graph(path)


def test_millisecond_times_and_a_later_column_are_named(tmp_path, cache_dir):
    rows = [(s, d, r, 0.5, t * 1000) for s, d, r, t in snap_rows()]
    with pytest.raises(DataError, match=re.escape(
            "but column 5 looks like Unix times in ms (120 distinct values, 2010-11-08 .. 2010-11-13): name the "
            "columns, \"data.columns='src,dst,feat,feat,t'\" (tgdist data: --columns src,dst,feat,feat,t), or set "
            "data.strict_columns=false (tgdist data: --columns src,dst,t,feat,feat)")):
        load_graph(write_rows(tmp_path / "ms.csv", rows))


@pytest.mark.parametrize("rows", [
    # the third field looks like Unix times itself (SocioPatterns' i j unix_t class_i class_j)
    [(1, 2, EPOCH + i, 1, EPOCH + 10 * i) for i in range(50)],
    # the later field is not Unix-sized (relative seconds), or has few values (a creation date per account)
    [(1, 2, i % 21 - 10, 1000 + i) for i in range(50)],
    [(1, 2, i % 21 - 10, EPOCH + i % 4) for i in range(50)],
    # times in 0..20, as many distinct values as the later field has: nothing to tell them apart
    [(1, 2, i % 21, EPOCH + i % 21) for i in range(50)],
])
def test_columns_that_are_not_doubtful_read_as_before(tmp_path, cache_dir, rows):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unsorted times: sorted with a warning, as before
        g = load_graph(write_rows(tmp_path / "ok.csv", rows))
    assert sorted(g.t.tolist()) == sorted(r[2] for r in rows)


def test_a_header_that_names_the_third_field_the_time_is_trusted(tmp_path, cache_dir):
    rows = snap_rows()
    with pytest.warns(UserWarning, match="events are not sorted by time"):
        g = load_graph(write_rows(tmp_path / "h.csv", rows, header="src,dst,time,created"))
    assert g.t.min() == -10
    # and one naming the fourth field the time reads it (as it did before)
    with pytest.warns(UserWarning) as caught:
        g = load_graph(write_rows(tmp_path / "s.csv", rows, header="source,target,rating,time"))
    assert g.t.min() == EPOCH
    assert "columns read by their header names, as data.columns='src,dst,feat,t'" in str(caught[0].message)


def test_the_shared_bitcoin_otc_read_by_position_stops(datasets_dir, cache_dir):
    path = datasets_dir / "bitcoin-otc" / "soc-sign-bitcoinotc.csv.gz"
    with pytest.raises(DataError) as err:
        load_graph(path)
    assert line_of(str(err.value)) == snap_doubt(path, 20, "35,592 distinct values, 2010-11-08 .. 2016-01-25")
    g = load_graph(path, columns="src,dst,feat,t")  # as configs/data/bitcoin_otc.yaml reads it
    assert g.num_events == 35_592 and g.t.min() > EPOCH - 1


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
    monkeypatch.setattr(edgelist_reader, "_read_edgelist", None)  # from the cache entry, exactly as read
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
