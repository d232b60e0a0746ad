"""``tgdist partition`` end to end, in a subprocess (as users run it), on a tiny event file."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tgdist.data.load import load_graph
from tgdist.errors import ConfigError
from tgdist.partition import artifact


def _events(path, n=400, nodes=30, seed=0):
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, nodes, n), rng.integers(0, nodes, n)
    path.write_text("".join(f"{s} {d} {t}\n" for t, (s, d) in enumerate(zip(src, dst))))
    return path


def _run(cwd, *overrides):
    return subprocess.run([sys.executable, "-m", "tgdist", "partition", *overrides], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def events(tmp_path):
    return _events(tmp_path / "events.txt")


def test_writes_the_artifact_and_nothing_else(tmp_path, events):
    r = _run(tmp_path, "data=file", f"data.path={events}", "data.name=tiny", "partition.num_parts=3",
             "partition.batch_size=30", "partition.out_dir=parts/tiny")
    assert r.returncode == 0, r.stderr
    assert "wrote parts/tiny: reflexbicut balance cost" in r.stdout
    assert "pre-sampling 280 training events" in r.stderr and "pre-sampled 10 batches in" in r.stderr
    assert "pre-sampling: " not in r.stderr  # the running counts are for a terminal only
    out = tmp_path / "parts" / "tiny"
    assert sorted(p.name for p in out.iterdir()) == ["comm.npz", "maps.npz", "measures.json", "metadata.json",
                                                       "residual.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.txt", "parts"]  # no outputs/, no .hydra/
    assert [p.name for p in (tmp_path / "parts").iterdir()] == ["tiny"]
    graph = load_graph(events, cache=False)
    part = artifact.load(out, graph=graph, num_parts=3)
    meta = part.metadata
    assert (meta["num_parts"], meta["method"], meta["batch_size"], meta["K"], meta["seed"]) == (3, "reflexbicut", 30, 10, 0)
    assert meta["data"]["source_hash"] == graph.source_hash and meta["data"]["train_events"] == 280
    meas = json.loads((out / "measures.json").read_text())
    assert set(meas["baselines"]) == {"range", "interval"}
    cost = meas["measures"]["dedup"]["balance_cost"]
    assert cost <= min(b["dedup"]["balance_cost"] for b in meas["baselines"].values())
    assert meas["lower_bound"]["dedup"] <= cost
    comm = np.load(out / "comm.npz")
    assert comm["comm_dedup"].tolist() == meas["measures"]["dedup"]["comm"]
    assert np.array_equal(part.maps.trainer_of, comm["owner"])
    with pytest.raises(ConfigError, match="made for 3 trainers, this run has 4"):
        artifact.load(out, graph=graph, num_parts=4)

    # the same directory again: refused unless overwrite
    r = _run(tmp_path, "data=file", f"data.path={events}", "partition.num_parts=3", "partition.batch_size=30",
             "partition.out_dir=parts/tiny", "partition=range")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "tgdist partition: error: parts/tiny already exists; pass partition.overwrite=true to replace it"]
    r = _run(tmp_path, "data=file", f"data.path={events}", "partition.num_parts=3", "partition.batch_size=30",
             "partition.out_dir=parts/tiny", "partition=range", "partition.overwrite=true", "partition.plot=false",
             "partition.progress=false")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert artifact.load(out).metadata["method"] == "range"
    assert [p.name for p in (tmp_path / "parts").iterdir()] == ["tiny"]


@pytest.mark.parametrize("override, message", [
    ("partition.num_parts=0", "partition.num_parts must be >= 1, got 0"),
    ("partition.method=metis", "partition.method=metis: choose one of range, interval, reflexbicut, greedy"),
    ("partition.batch_size=2", "partition.batch_size (2) must be >= partition.num_parts (8)"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, events, override, message):
    r = _run(tmp_path, "data=file", f"data.path={events}", "partition.out_dir=parts/x", override)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"tgdist partition: error: {message}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.txt"]


def test_an_out_dir_it_cannot_use_is_refused_before_the_data_is_read(tmp_path, events):
    (tmp_path / "afile").write_text("x")
    before = events.read_text()
    r = _run(tmp_path, "data=file", f"data.path={events}", f"partition.out_dir={tmp_path / 'afile' / 'sub'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        (f"tgdist partition: error: partition.out_dir={tmp_path / 'afile' / 'sub'}: cannot write "
         f"({tmp_path / 'afile'} is not a directory)")]
    r = _run(tmp_path, "data=file", f"data.path={events}", f"partition.out_dir={events}", "partition.overwrite=true")
    assert r.returncode == 2 and "is not a partition artifact" in r.stderr and len(r.stderr.splitlines()) == 1
    assert events.is_file() and events.read_text() == before  # overwrite replaced the data file before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "events.txt"]


def test_missing_data_file_is_one_line(tmp_path):
    r = _run(tmp_path, "data=file", f"data.path={tmp_path / 'nope.txt'}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no such file" in r.stderr and list(tmp_path.iterdir()) == []


def test_data_file_without_a_path_is_one_line(tmp_path):
    """``data=file`` alone is refused (it read the embedded CollegeMsg stream before)."""
    r = _run(tmp_path, "data=file")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "tgdist partition: error: data=file needs data.path=FILE (any supported file or TGL directory)"]
    assert list(tmp_path.iterdir()) == []


def test_more_parts_than_nodes_warns(tmp_path):
    events = _events(tmp_path / "events.txt", nodes=5)
    r = _run(tmp_path, "data=file", f"data.path={events}", "partition.num_parts=8", "partition.batch_size=40",
             "partition.out_dir=p", "partition.plot=false", "partition.progress=false")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        "tgdist partition: warning: 8 parts for 5 nodes: at least 3 parts will own no node memory"]
