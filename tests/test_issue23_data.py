"""Issue 23, data: columns that are probably wrong stop a run in one line, and node ids that are
only labels (beyond int64, negative) train, kept exactly. Through `tgdist train` as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.test_train_cli import QUICK, tgdist
from tgdist.runtime.data import load_native

EPOCH = 1_289_241_911  # 2010-11-08, where SNAP's bitcoin-otc starts


def tree(*roots: Path) -> dict[str, bytes]:
    """Every file under ``roots`` with its bytes, and every folder (as None): what a command may
    not change."""
    return {str(p): (p.read_bytes() if p.is_file() else None) for root in roots for p in sorted(root.rglob("*"))}


def snap_csv(path: Path, n: int = 400) -> Path:
    """SNAP's signed-network layout, ``source,target,rating,time``: ratings -10..10, Unix times
    out of order (so no "field in time order" hint can help)."""
    rng = np.random.default_rng(0)
    times = EPOCH + rng.permutation(n) * 3_600
    rows = [f"{rng.integers(1, 40)},{rng.integers(1, 40)},{i % 21 - 10},{t}" for i, t in enumerate(times)]
    path.write_text("\n".join(rows) + "\n")
    return path


def doubt_line(path, distinct: int, first: str, last: str, many: str) -> str:
    return (f"tgdist train: error: {path}: column 3, read as the time, holds {distinct} distinct values, some negative "
            f"(-10 .. 10), but column 4 looks like Unix times ({many} distinct values, {first} .. {last}): name the "
            f"columns, \"data.columns='src,dst,feat,t'\" (tgdist data: --columns src,dst,feat,t), or set "
            f"data.strict_columns=false (tgdist data: --columns src,dst,t,feat) to read column 3 as the time")


def test_a_rating_read_as_the_time_stops_the_run_in_one_line(tmp_path, cache_dir):
    snap_csv(tmp_path / "otc.csv")
    before = tree(tmp_path, cache_dir)
    r = tgdist("train", "data=file", "data.path=otc.csv", *QUICK, cwd=tmp_path)  # the default runs/ folder
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [doubt_line("otc.csv", 21, "2010-11-08", "2010-11-25", "400")]
    assert tree(tmp_path, cache_dir) == before  # no run directory, no cache entry


def test_the_suggested_columns_train(tmp_path):
    snap_csv(tmp_path / "otc.csv")
    r = tgdist("train", "data=file", "data.path=otc.csv", "data.columns='src,dst,feat,t'", *QUICK,
               f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["data"] == "otc" and summary["traversed_events"] == 280  # 70% of 400, times read as times
    assert "column 3, read as the time" not in r.stderr


def test_strict_columns_false_trains_with_a_warning(tmp_path):
    snap_csv(tmp_path / "otc.csv")
    r = tgdist("train", "data=file", "data.path=otc.csv", "data.strict_columns=false", *QUICK,
               f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    warning = ("[WARNING] otc.csv: column 3, read as the time, holds 21 distinct values, some negative (-10 .. 10), "
               "but column 4 looks like Unix times (400 distinct values, 2010-11-08 .. 2010-11-25); column 3 is read "
               "as the time, as data.strict_columns=false asks")
    assert warning in r.stderr and warning in (tmp_path / "run" / "train.log").read_text()


def test_the_shared_bitcoin_otc_by_position_stops_and_as_configured_trains(tmp_path, cache_dir, datasets_dir):
    path = datasets_dir / "bitcoin-otc" / "soc-sign-bitcoinotc.csv.gz"
    before = tree(tmp_path, cache_dir)
    r = tgdist("train", "data=file", f"data.path={path}", *QUICK, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [doubt_line(path, 20, "2010-11-08", "2016-01-25", "35,592")]
    assert tree(tmp_path, cache_dir) == before
    # configs/data/bitcoin_otc.yaml names the columns: no stop (epochs=0: evaluation only, enough to read it)
    quick = [a for a in QUICK if not a.startswith("train.epochs=")]
    r = tgdist("train", "data=bitcoin_otc", *quick, "train.epochs=0", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["data"] == "bitcoin_otc"
    assert "column 3, read as the time" not in r.stderr


def test_ids_beyond_int64_and_negative_ids_train_and_are_kept_exactly(tmp_path):
    rng = np.random.default_rng(1)
    ids = [2**64 - 1, 2**63, 2**63 + 12345, -1, -(2**63), 0, 17]  # hashed uint64 ids and negative ones
    rows = [(ids[rng.integers(len(ids))], ids[rng.integers(len(ids))], t) for t in range(300)]
    (tmp_path / "hashed.csv").write_text("".join(f"{s},{d},{t}\n" for s, d, t in rows))
    r = tgdist("train", "data=file", "data.path=hashed.csv", f"data.cache_dir={tmp_path / 'cache'}", *QUICK,
               f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["traversed_events"] == 210
    [entry] = (tmp_path / "cache").iterdir()  # the graph the run trained on
    g = load_native(entry)
    # negative and beyond int64 together: the decimal text of each id, exactly as written
    assert g.node_map.tolist() == [str(i) for i in sorted(set(ids))]
    assert g.node_map[g.src].tolist() == [str(s) for s, _, _ in rows]
    assert g.node_map[g.dst].tolist() == [str(d) for _, d, _ in rows]
