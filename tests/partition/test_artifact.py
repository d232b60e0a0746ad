import json

import numpy as np
import pytest

from tgdist.errors import ConfigError, DataError
from tgdist.partition import artifact
from tgdist.partition.idmap import DualHashMap


def _save(path, owner=(0, 1, 1, 0), parts=2, **kw):
    maps = DualHashMap.from_assignment(np.array(owner), parts)
    meta = {"data": {"name": "tiny", "source_hash": "abc123", "num_nodes": len(owner)}, "num_parts": parts,
            "method": "range"}
    return artifact.save(path, maps=maps, metadata=meta, measures={"ok": 1}, arrays={"owner": np.array(owner)}, **kw)


def test_round_trip(tmp_path):
    out = _save(tmp_path / "p")
    assert sorted(x.name for x in out.iterdir()) == ["comm.npz", "maps.npz", "measures.json", "metadata.json"]
    part = artifact.load(out, source_hash="abc123", num_nodes=4, num_parts=2)
    assert part.maps.trainer_of.tolist() == [0, 1, 1, 0] and part.measures == {"ok": 1}
    assert part.metadata["format"] == artifact.FORMAT and part.num_parts == 2
    assert [p.name for p in tmp_path.iterdir()] == ["p"]  # no temporary directory left


def test_refuses_other_data_or_trainer_count(tmp_path):
    out = _save(tmp_path / "p")
    with pytest.raises(DataError, match="made for data set 'tiny'"):
        artifact.load(out, source_hash="other")
    with pytest.raises(ConfigError, match="made for 2 trainers, this run has 4"):
        artifact.load(out, num_parts=4)
    with pytest.raises(DataError, match="covers 4 nodes"):
        artifact.load(out, num_nodes=5)


def test_missing_or_foreign_directory(tmp_path):
    with pytest.raises(DataError, match="no such partition directory"):
        artifact.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no metadata.json"):
        artifact.load(tmp_path / "empty")
    out = _save(tmp_path / "p")
    meta = json.loads((out / "metadata.json").read_text())
    (out / "metadata.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(DataError, match="not a tgdist-partition v1"):
        artifact.load(out)


def test_existing_directory_needs_overwrite(tmp_path):
    _save(tmp_path / "p")
    with pytest.raises(ConfigError, match="overwrite"):
        _save(tmp_path / "p", owner=(1, 1, 0, 0))
    _save(tmp_path / "p", owner=(1, 1, 0, 0), overwrite=True)
    assert artifact.load(tmp_path / "p").maps.trainer_of.tolist() == [1, 1, 0, 0]
    assert [p.name for p in tmp_path.iterdir()] == ["p"]


def test_overwrite_replaces_only_an_artifact(tmp_path):
    """``overwrite`` renamed and deleted whatever was there: a data file, a folder of results."""
    data = tmp_path / "events.npz"
    data.write_bytes(b"precious")
    folder = tmp_path / "results"
    (folder / "sub").mkdir(parents=True)
    (folder / "important.txt").write_text("hi")
    for victim in (data, folder):
        with pytest.raises(ConfigError, match=f"^{victim} is not a partition artifact .* choose another partition.out_dir"):
            _save(victim, overwrite=True)
    assert data.read_bytes() == b"precious" and (folder / "important.txt").read_text() == "hi"
    assert (folder / "sub").is_dir()
    with pytest.raises(ConfigError, match=r"cannot write \(.*events.npz is not a directory\)"):
        _save(data / "p")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.npz", "results"]


def test_corrupt_measures_or_maps_are_one_line_errors(tmp_path):
    out = _save(tmp_path / "p")
    (out / "measures.json").write_text("{broken")
    with pytest.raises(DataError, match="measures.json: unreadable"):
        artifact.load(out)
    out = _save(tmp_path / "q")
    (out / "maps.npz").write_bytes((out / "maps.npz").read_bytes()[:100])
    with pytest.raises(DataError, match="maps.npz: unreadable partition maps"):
        artifact.load(out)
    with pytest.raises(DataError, match="a file, not a partition directory"):
        artifact.load(out / "maps.npz")


def test_failure_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(artifact.json, "dumps", boom)
    with pytest.raises(RuntimeError):
        _save(tmp_path / "p")
    assert list(tmp_path.iterdir()) == []


def test_corrupt_maps_are_refused(tmp_path):
    out = _save(tmp_path / "p")
    maps = dict(np.load(out / "maps.npz"))
    maps["local_of"] = np.array([0, 0, 0, 0])
    np.savez(out / "maps.npz", **maps)
    with pytest.raises(DataError, match="inconsistent"):
        artifact.load(out)


def test_heatmap_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = _save(tmp_path / "p", residuals={"range": np.array([[0, 2], [0, 0]]), "interval": np.zeros((2, 2))})
    assert (out / "residual.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metadata_records_the_checksum_of_every_data_file(tmp_path):
    import hashlib

    out = _save(tmp_path / "p")
    sums = json.loads((out / "metadata.json").read_text())["sha256"]
    for name in ("maps.npz", "comm.npz", "measures.json"):
        assert sums[name] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    assert sums["metadata.json"] == artifact._content_digest(json.loads((out / "metadata.json").read_text()))
    # its own layout is free (re-indented); its content is not
    meta = json.loads((out / "metadata.json").read_text())
    (out / "metadata.json").write_text(json.dumps(meta))
    assert artifact.load(out).num_parts == 2


@pytest.mark.parametrize("name", ["maps.npz", "comm.npz", "measures.json", "metadata.json"])
def test_changed_bytes_are_refused_in_one_line(tmp_path, name):
    """What still parses and passes the file's own checks: a swapped owner in consistent maps, a
    changed count in C or in the measures, another seed in the metadata."""
    out = _save(tmp_path / "p")
    if name == "maps.npz":
        other = DualHashMap.from_assignment(np.array([1, 0, 0, 1]), 2)
        np.savez(out / name, **{k: getattr(other, k) for k in artifact.MAP_KEYS})
    elif name == "comm.npz":
        np.savez(out / name, owner=np.array([0, 1, 1, 1]))
    else:
        text = (out / name).read_text()
        (out / name).write_text(text.replace('"ok": 1', '"ok": 2') if name == "measures.json"
                                else text.replace('"num_parts": 2,', '"num_parts": 2, "seed": 7,'))
    with pytest.raises(DataError) as e:
        artifact.load(out)
    assert str(e.value).startswith(f"{out / name}: checksum mismatch, the file is corrupt (expected sha256 ")
    assert str(e.value).endswith("...); re-run tgdist partition to make the artifact again")
    assert "\n" not in str(e.value)


def test_an_artifact_from_before_checksums_loads(tmp_path):
    out = _save(tmp_path / "p")
    meta = json.loads((out / "metadata.json").read_text())
    del meta["sha256"]
    (out / "metadata.json").write_text(json.dumps(meta))
    (out / "measures.json").write_text('{"ok": 2}')  # unchecked: nothing records what it held
    assert artifact.load(out).measures == {"ok": 2}
    (out / "metadata.json").write_text(json.dumps({**meta, "sha256": "abc"}))
    with pytest.raises(DataError, match="metadata.json: its checksum record is damaged, the file is corrupt; re-run"):
        artifact.load(out)
