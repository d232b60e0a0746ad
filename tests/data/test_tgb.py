"""TGB link-prediction data sets (``data=tgb``): the readers against py-tgb's own loader on files
written in TGB's layout, TGB's split, the shipped negatives, and the one-line errors."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from tests.data.tgb_files import tgb_split, write_wiki
from tgdist.data.load import check_data_source, load_data
from tgdist.data import tgb
from tgdist.data.graph import chronological_split
from tgdist.errors import ConfigError, DataError
from tgdist.runtime.build import build_trainer, compose


def tgb_dataset(name: str, root):
    """py-tgb's own ``LinkPropPredDataset`` over the files under ``root`` (skipped without py-tgb).
    TGB puts its root under its package folder, so a relative path reaches ``root``."""
    dataset = pytest.importorskip("tgb.linkproppred.dataset", reason="py-tgb is not installed (the dev extra)")
    from tgb.utils.info import PROJ_DIR
    return dataset.LinkPropPredDataset(name=name, root=os.path.relpath(root, PROJ_DIR), download=False, preprocess=True)


def overrides(root, *extra):
    return ["data=tgb", "data.name=tgbl-wiki", f"data.root={root}", *extra]


def test_wiki_family_reads_tgb_ids_split_and_features(tmp_path):
    info = write_wiki(tmp_path)
    g = load_data(compose(overrides(tmp_path)).data)
    assert (g.src == info["src"]).all() and (g.dst == info["dst"]).all() and (g.t == info["t"]).all()
    assert g.t.dtype == np.int64 and (g.node_map == np.arange(g.num_nodes)).all()
    np.testing.assert_allclose(g.edge_feat, info["feat"], rtol=0, atol=1e-6)
    assert g.bipartite and g.num_src_nodes == info["src"].max() + 1  # TGB moved the items past the users
    assert (g.ext_roll == info["roll"]).all()
    split = chronological_split(g, 0.3, 0.3)  # the data's own split wins over data.val_frac/test_frac
    assert (split.train_end, split.val_end) == (int((info["roll"] == 0).sum()), int((info["roll"] < 2).sum()))
    # the folder itself as the root works as well as TGB's ROOT/tgbl_wiki/
    assert (tgb.read("tgbl-wiki", info["folder"]).src == g.src).all()


def test_readers_match_py_tgb_loader_and_negative_sampler(tmp_path):
    write_wiki(tmp_path)
    ds = tgb_dataset("tgbl-wiki", tmp_path)
    g = tgb.read("tgbl-wiki", tmp_path)
    full = ds.full_data
    for ours, theirs in ((g.src, full["sources"]), (g.dst, full["destinations"]), (g.t, full["timestamps"])):
        assert (ours == theirs).all()
    np.testing.assert_allclose(g.edge_feat, full["edge_feat"], rtol=1e-6)
    for part, mask in ((0, ds.train_mask), (1, ds.val_mask), (2, ds.test_mask)):
        assert ((g.ext_roll == part) == mask).all()
    split = chronological_split(g)
    shipped = tgb.shipped_negatives("tgbl-wiki", tmp_path, g, split)
    for part, load in (("val", ds.load_val_ns), ("test", ds.load_test_ns)):
        load()
        lo, hi = split.range(part)
        theirs = ds.negative_sampler.query_batch(g.src[lo:hi], g.dst[lo:hi], g.t[lo:hi], split_mode=part)
        neg, valid = shipped.part(part).padded(lo, hi, pad=g.dst[lo:hi])
        assert [list(row[v]) for row, v in zip(neg, valid)] == theirs
        assert len({len(x) for x in theirs}) > 1  # lists of several lengths


def _write_csv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([header] + [",".join(map(str, r)) for r in rows]) + "\n")


def _names(rng, n, k):
    return [f"0x{v:04x}" for v in rng.integers(0, k, n)]


@pytest.mark.parametrize("name", ["tgbl-coin", "tgbl-comment", "tgbl-flight"])
def test_named_id_families_match_py_tgb(tmp_path, name):
    """tgbl-coin / tgbl-review (weights), tgbl-comment (words, score), tgbl-flight (codes, airports):
    ids numbered by first appearance, TGB's edge features and node features."""
    rng = np.random.default_rng(1)
    n = 200
    t = np.sort(rng.integers(1_600_000_000, 1_600_100_000, n))
    folder = tmp_path / name.replace("-", "_")
    src, dst = _names(rng, n, 15), _names(rng, n, 15)
    if name == "tgbl-coin":
        w = rng.integers(0, 1000, n)
        _write_csv(folder / f"{name}_edgelist_v2.csv", "day,src,dst,weight", zip(t, src, dst, w))
    elif name == "tgbl-comment":
        _write_csv(folder / f"{name}_edgelist.csv", "ts,src,dst,num_words,score",
                   zip(t, src, dst, rng.integers(0, 900, n), rng.integers(-5, 50, n)))
    else:
        codes = [f"AP{v:02d}" for v in range(15)]
        src, dst = [codes[v] for v in rng.integers(0, 15, n)], [codes[v] for v in rng.integers(0, 15, n)]
        calls = ["", "AB1", "XYZ12345"]
        types = ["", "B7", "A320", "LONGTYPECODE"]
        _write_csv(folder / f"{name}_edgelist_v2.csv", "timestamp,src,dst,callsign,typecode",
                   [(a, b, c, calls[k % 3], types[k % 4]) for k, (a, b, c) in enumerate(zip(t, src, dst))])
        # 4 types + 7 continents + 7 region characters + 2 coordinates = TGB's 20 node features
        _write_csv(folder / "airport_node_feat_v2.csv", "airport_code,type,continent,iso_region,longitude,latitude",
                   [(c, f"type{k % 4}", f"C{k % 7}", f"US-{k}", k * 1.5 - 20, 40 - k) for k, c in enumerate(codes)])
    for part in ("val", "test"):
        v = "" if name == "tgbl-comment" else "_v2"
        with open(folder / f"{name}_{part}_ns{v}.pkl", "wb") as fh:
            pickle.dump({}, fh)
    g = tgb.read(name, tmp_path)
    assert g.num_events == n and not g.bipartite and (np.diff(g.t) >= 0).all()
    assert (g.ext_roll == tgb_split(g.t)).all()
    ds = tgb_dataset(name, tmp_path)
    full = ds.full_data
    for ours, theirs in ((g.src, full["sources"]), (g.dst, full["destinations"]), (g.t, full["timestamps"])):
        assert (ours == theirs).all()
    np.testing.assert_allclose(g.edge_feat, full["edge_feat"], rtol=1e-6)
    if name == "tgbl-flight":
        np.testing.assert_allclose(g.node_feat, ds.node_feat, rtol=1e-6)
    for part, mask in ((0, ds.train_mask), (1, ds.val_mask), (2, ds.test_mask)):
        assert ((g.ext_roll == part) == mask).all()


def test_missing_files_are_one_line_naming_the_file_and_how_to_get_it(tmp_path):
    cfg = compose(overrides(tmp_path))
    with pytest.raises(DataError) as e:
        check_data_source(cfg.data)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "tgbl-wiki_edgelist_v2.csv") in msg
    assert "data.download=true" in msg and "pip install py-tgb" in msg
    info = write_wiki(tmp_path)
    (info["folder"] / "tgbl-wiki_test_ns_v2.pkl").unlink()
    with pytest.raises(DataError, match="tgbl-wiki_test_ns_v2.pkl is missing"):
        check_data_source(cfg.data)
    with pytest.raises(ConfigError, match="data.name=tgbl-wikii: data=tgb reads the TGB link-prediction data sets"):
        check_data_source(compose(["data=tgb", "data.name=tgbl-wikii", f"data.root={tmp_path}"]).data)
    r = subprocess.run([sys.executable, "-m", "tgdist", "train", *overrides(tmp_path / "none"), "train.eval=tgb",
                        f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ))
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tgdist train: error: data=tgb: ") and "tgbl-wiki_edgelist_v2.csv is missing" in last


def test_negatives_of_another_edge_list_are_refused_naming_the_event(tmp_path):
    info = write_wiki(tmp_path)
    table = dict(info["neg"]["val"])
    table.pop(next(iter(table)))
    with open(info["folder"] / "tgbl-wiki_val_ns_v2.pkl", "wb") as fh:
        pickle.dump(table, fh)
    g = tgb.read("tgbl-wiki", tmp_path)
    with pytest.raises(DataError, match=r"no negatives for event \d+ \(src \d+, dst \d+, t \d+\)"):
        tgb.shipped_negatives("tgbl-wiki", tmp_path, g, chronological_split(g))
    for bad in (np.array(["a", "b"]), np.array([3.5])):  # not node ids
        with open(info["folder"] / "tgbl-wiki_val_ns_v2.pkl", "wb") as fh:
            pickle.dump({**info["neg"]["val"], next(iter(info["neg"]["val"])): bad}, fh)
        with pytest.raises(DataError, match=rf"negatives of event \d+ \(src \d+, dst \d+, t \d+\) are not node ids "
                                            rf"\(an array of {bad.dtype}\)$"):
            tgb.shipped_negatives("tgbl-wiki", tmp_path, g, chronological_split(g))
    with open(info["folder"] / "tgbl-wiki_val_ns_v2.pkl", "wb") as fh:  # an id that int32 would wrap to 0
        pickle.dump({**info["neg"]["val"], next(iter(info["neg"]["val"])): np.array([2**32], np.int64)}, fh)
    with pytest.raises(DataError, match=r"negative destination 4294967296 is not a node of the edge list \(0\.\.36\)$"):
        tgb.shipped_negatives("tgbl-wiki", tmp_path, g, chronological_split(g))
    with open(info["folder"] / "tgbl-wiki_val_ns_v2.pkl", "wb") as fh:
        pickle.dump(info["neg"]["val"], fh)
    (info["folder"] / "tgbl-wiki_test_ns_v2.pkl").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="not a TGB negative-sample file"):
        tgb.shipped_negatives("tgbl-wiki", tmp_path, g, chronological_split(g))


def _run(tmp_path, *extra):
    return subprocess.run([sys.executable, "-m", "tgdist", "train", *overrides(tmp_path), "train.eval=tgb",
                           "model.mem_dim=8", "model.time_dim=4", "train.epochs=1", "train.num_threads=1",
                           "sampler.num_threads=1", f"data.cache_dir={tmp_path / 'cache'}",
                           f"run_dir={tmp_path / 'run'}",
                           *extra], capture_output=True, text=True, timeout=300, env=dict(os.environ))


def _refused(r, start: str) -> str:
    """The one line a refused ``tgdist train`` prints (exit 2), which must start with ``start``."""
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tgdist train: error: {start}"), last
    assert "Traceback" not in r.stderr and "epoch 0" not in r.stderr  # refused before training
    return last


def test_a_damaged_test_negatives_file_is_refused_at_the_start_not_after_training(tmp_path):
    """It was read when the test part was evaluated, after all of training."""
    info = write_wiki(tmp_path)
    path = info["folder"] / "tgbl-wiki_test_ns_v2.pkl"
    path.write_bytes(path.read_bytes()[:-100])  # a download cut short
    _refused(_run(tmp_path), f"{path}: not a TGB negative-sample file: ")
    assert not (tmp_path / "run").exists()


def test_a_cut_leaving_tgb_evaluation_no_events_is_refused_before_training(tmp_path):
    """``data.max_events`` keeping only TGB's training part trained, evaluated nothing and exited 0
    with null metrics."""
    write_wiki(tmp_path)
    last = _refused(_run(tmp_path, "data.max_events=300"), "data=tgb: data.max_events=300 keeps the first 300 events "
                    "of tgbl-wiki, and none of them is in TGB's val part")
    assert last.endswith("drop data.max_events, or raise it")
    assert not (tmp_path / "run").exists()
    g = tgb.read("tgbl-wiki", tmp_path)  # a cut into the val part leaves the test part empty: refused the same
    cut = chronological_split(g).range("val")[0] + 10
    with pytest.raises(ConfigError, match=rf"^data=tgb: data.max_events={cut} keeps the first {cut} events of "
                                          rf"tgbl-wiki, and none of them is in TGB's test part"):
        build_trainer(compose(overrides(tmp_path, f"data.max_events={cut}", "train.eval=tgb")))


class _Payload:
    """What a crafted negatives file holds: unpickling it calls ``call(*args)``."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.mark.parametrize("payload", ["system", "eval", "nested"])
def test_a_crafted_negatives_file_is_refused_and_does_not_run(tmp_path, payload):
    """TGB's negatives were read with ``pickle.load``: a crafted file ran its payload."""
    info = write_wiki(tmp_path)
    marker = tmp_path / "ran"
    code = {"system": _Payload(os.system, f"touch {marker}"),
            "eval": _Payload(eval, f"open({str(marker)!r}, 'w').close()"),
            # hidden as one negatives array of an otherwise genuine table
            "nested": {**info["neg"]["val"], next(iter(info["neg"]["val"])): _Payload(os.system, f"touch {marker}")}}
    path = info["folder"] / "tgbl-wiki_val_ns_v2.pkl"
    path.write_bytes(pickle.dumps(code[payload], protocol=pickle.HIGHEST_PROTOCOL))
    g = tgb.read("tgbl-wiki", tmp_path)
    with pytest.raises(DataError) as e:
        tgb.shipped_negatives("tgbl-wiki", tmp_path, g, chronological_split(g))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: not a TGB negative-sample file: UnpicklingError: it asks for ")
    assert ("builtins.eval" if payload == "eval" else "posix.system") in msg and "refused, not run" in msg
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_the_restricted_unpickler_reads_what_pickle_reads(tmp_path, protocol):
    """The files as py-tgb writes them (protocol 5), and older protocols: the same table as
    ``pickle.load``, with float64 arrays (an event without historical negatives), int64 arrays,
    an empty array and a non-contiguous one."""
    table = {(np.int64(1), np.int64(2), np.int64(3)): np.array([4.0, 5.0]),
             (np.int64(2), np.int64(3), np.int64(4)): np.arange(6, dtype=np.int64)[::2],
             (np.int64(3), np.int64(4), np.int64(5)): np.zeros(0), (6, 7, 8): np.array([9], dtype=np.int32)}
    path = tmp_path / "n.pkl"
    path.write_bytes(pickle.dumps(table, protocol=protocol))
    got = tgb._load_pickle(path)
    assert list(got) == list(table)
    for key, value in table.items():
        assert got[key].dtype == value.dtype and (got[key] == value).all()


def test_tgb_evaluation_needs_a_tgb_data_set(tmp_path):
    from tgdist.runtime.build import validate
    with pytest.raises(ConfigError, match="train.eval=tgb ranks each event against the negatives a TGB data set "
                                          "ships, and data.format=auto ships none"):
        validate(compose(["train.eval=tgb"]))
    with pytest.raises(ConfigError, match="train.save_scores=true writes the scores of train.eval=tgb"):
        validate(compose(["train.save_scores=true"]))


def test_download_fetches_through_tgb_dataset_class_and_copies_to_root(tmp_path, monkeypatch):
    """``data.download=true`` with files missing: TGB's dataset class downloads into its own folder
    (here a stand-in writing the files, no network), and the files are copied to data.root."""
    pytest.importorskip("tgb.linkproppred.dataset", reason="py-tgb is not installed (the dev extra)")
    import tgb.linkproppred.dataset as tgb_dataset_module

    calls = []

    class FakeDataset:
        def __init__(self, name, root, download, preprocess):
            calls.append((name, root, download))
            self.root = str(write_wiki(tmp_path / "tgb-own")["folder"])

    monkeypatch.setattr(tgb_dataset_module, "LinkPropPredDataset", FakeDataset)
    dest = tmp_path / "mine"
    g = load_data(compose(overrides(dest, "data.download=true")).data)
    assert calls == [("tgbl-wiki", "datasets", True)] and g.num_events == 600
    assert sorted(p.name for p in dest.iterdir()) == ["tgbl-wiki_edgelist_v2.csv", "tgbl-wiki_test_ns_v2.pkl",
                                                     "tgbl-wiki_val_ns_v2.pkl"]
    load_data(compose(overrides(dest, "data.download=true")).data)  # there now: no second fetch
    assert len(calls) == 1


def test_cached_read_is_parsed_once_and_equal(tmp_path, monkeypatch):
    """With data.cache (the default) a TGB edge list is parsed once per machine into the
    processed-graph cache and mapped afterwards; a changed file is parsed again."""
    info = write_wiki(tmp_path / "data")
    plain = tgb.read("tgbl-wiki", tmp_path / "data")
    cfg = compose(overrides(tmp_path / "data", f"data.cache_dir={tmp_path / 'cache'}"))
    first = load_data(cfg.data)
    parses = []
    monkeypatch.setattr(tgb, "_parse", lambda *a: parses.append(a) or plain)
    again = load_data(cfg.data)
    assert parses == []
    for g in (first, again):
        for key in ("src", "dst", "t", "ext_roll", "edge_feat"):
            np.testing.assert_array_equal(getattr(g, key), getattr(plain, key))
        assert g.bipartite and g.num_src_nodes == plain.num_src_nodes and g.num_nodes == plain.num_nodes
    edges = info["folder"] / "tgbl-wiki_edgelist_v2.csv"
    edges.write_text(edges.read_text() + "0,0,99999.0,0,0.1,0.2,0.3\n")
    load_data(cfg.data)
    assert len(parses) == 1


def test_an_edge_list_changed_in_place_with_its_size_and_time_is_parsed_again(tmp_path):
    """The entry was keyed by the file's path, size and time: a file changed in place, its time put
    back, was served from the old entry bit for bit."""
    info = write_wiki(tmp_path / "data")
    cfg = compose(overrides(tmp_path / "data", f"data.cache_dir={tmp_path / 'cache'}"))
    old = load_data(cfg.data)
    edges = info["folder"] / "tgbl-wiki_edgelist_v2.csv"
    before = edges.stat()
    text = edges.read_text()
    end = text.index("\n", text.index("\n") + 1)  # the first event's line; its last character is a digit
    digit = text[end - 1]
    edges.write_text(text[:end - 1] + ("1" if digit != "1" else "2") + text[end:])
    os.utime(edges, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (edges.stat().st_size, edges.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    new = load_data(cfg.data)
    fresh = tgb.read("tgbl-wiki", tmp_path / "data")  # parsed from the file as it is now
    np.testing.assert_array_equal(new.edge_feat, fresh.edge_feat)
    assert new.edge_feat[0, -1] != old.edge_feat[0, -1] and (new.edge_feat[1:] == old.edge_feat[1:]).all()
    assert new.source_hash != old.source_hash  # a checkpoint of the old file is refused for the new
