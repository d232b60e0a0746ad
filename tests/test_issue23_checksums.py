"""Issue 23, checksums: a corrupt checkpoint, partition artifact or processed-graph cache entry is
found before it is parsed (the command line as users run it)."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.partition.test_cli import _events, _run as partition
from tests.test_train_cli import QUICK, tgdist
from tgdist import checksum
from tgdist.errors import DataError
from tgdist.partition import artifact
from tgdist.partition.idmap import DualHashMap


def corrupted(path: Path, how: str, at: int | None = None) -> bytes:
    """``path`` with 64 bytes inverted or 16 bytes changed at ``at`` (its middle by default);
    returns the bytes it had."""
    data = path.read_bytes()
    bad = bytearray(data)
    at = len(data) // 2 if at is None else at
    if how == "invert 64":
        bad[at:at + 64] = bytes(b ^ 0xFF for b in bad[at:at + 64])
    else:
        bad[at:at + 16] = bytes((b + 1) % 256 for b in bad[at:at + 16])
    path.write_bytes(bad)
    return data


def mismatch(path: Path) -> str:
    """What the checksum line says about a sealed file whose digits are intact."""
    data = path.read_bytes()
    expected, found = data[-64:].decode(), hashlib.sha256(data[:-64]).hexdigest()
    return (f"{path}: checksum mismatch, the file is corrupt (expected sha256 {expected[:12]}..., found "
            f"{found[:12]}...)")


def tree(root: Path) -> dict:
    """Every file's bytes and every folder under ``root``."""
    return {p: p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 1-epoch run on the tiny embedded data, its checkpoint sealed."""
    root = tmp_path_factory.mktemp("run")
    r = tgdist("train", *QUICK, f"run_dir={root / 'r'}", cwd=root)
    assert r.returncode == 0, r.stderr
    return root / "r"


@pytest.mark.parametrize("how", ["invert 64", "change 16"])
def test_a_corrupt_checkpoint_is_refused_in_one_line_and_nothing_changes(tmp_path, finished_run, how):
    """Before checksums, 64 inverted bytes resumed with exit 0 and null metrics, 16 changed bytes
    shifted the loss in its 8th digit."""
    run = tmp_path / "r"
    shutil.copytree(finished_run, run)
    last = run / "checkpoints" / "last.pt"
    assert checksum.verify(last) is not None  # sealed
    corrupted(last, how)
    before = tree(tmp_path)
    r = tgdist("train", *QUICK, "train.epochs=2", f"train.resume={run}", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"tgdist train: error: {mismatch(last)}; resume from another checkpoint or start afresh"]
    assert tree(tmp_path) == before


def test_an_intact_checkpoint_still_resumes(tmp_path, finished_run):
    run = tmp_path / "r"
    shutil.copytree(finished_run, run)
    r = tgdist("train", *QUICK, "train.epochs=2", f"train.resume={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert checksum.verify(run / "checkpoints" / "last.pt") is not None


def test_a_corrupt_cache_entry_is_read_again_from_the_source(tmp_path):
    """With a warning naming the entry; the run trains on the source's events, to the results of
    a run that found the entry intact, and the entry is written again, intact."""
    events = _events(tmp_path / "events.txt", n=1200, nodes=60)
    data = ["data=file", f"data.path={events}", f"data.cache_dir={tmp_path / 'cache'}"]
    first = tgdist("train", *QUICK, *data, f"run_dir={tmp_path / 'a'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (entry,) = (tmp_path / "cache").iterdir()
    intact = corrupted(entry, "invert 64")
    line = mismatch(entry)
    again = tgdist("train", *QUICK, *data, f"run_dir={tmp_path / 'b'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"ignoring cache entry {line}; reading the source again" in again.stderr
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (first, again))
    for key in ("loss", "val_ap", "test_ap", "test_mrr", "traversed_events"):
        assert a[key] == b[key], key
    assert checksum.verify(entry) is not None and len(entry.read_bytes()) == len(intact)  # written again, intact


@pytest.fixture(scope="module")
def partition_artifact(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("partition")
    events = _events(root / "events.txt")
    r = partition(root, "data=file", f"data.path={events}", "data.name=tiny", "partition.num_parts=3",
                  "partition.batch_size=30", "partition.out_dir=parts/tiny")
    assert r.returncode == 0, r.stderr
    return root / "parts" / "tiny"


def _refused(out: Path, name: str, expected: str, found: str) -> None:
    with pytest.raises(DataError) as e:
        artifact.load(out)
    assert str(e.value) == (f"{out / name}: checksum mismatch, the file is corrupt (expected sha256 {expected[:12]}..., "
                            f"found {found[:12]}...); re-run tgdist partition to make the artifact again")


def test_a_corrupt_partition_artifact_is_refused_in_one_line(tmp_path, partition_artifact):
    """``tgdist partition`` writes it; training does not read artifacts yet, so they are loaded
    here as their users do (``tgdist.partition.artifact.load``). Each file of the artifact."""
    out = tmp_path / "tiny"
    shutil.copytree(partition_artifact, out)
    sums = json.loads((out / "metadata.json").read_text())["sha256"]
    assert set(sums) == {"maps.npz", "comm.npz", "measures.json", "metadata.json"}
    for name, how in [("comm.npz", "invert 64"), ("comm.npz", "change 16")]:
        intact = corrupted(out / name, how)
        _refused(out, name, sums[name], hashlib.sha256((out / name).read_bytes()).hexdigest())
        (out / name).write_bytes(intact)
    # maps made for another assignment, consistent in themselves
    intact = (out / "maps.npz").read_bytes()
    with np.load(out / "maps.npz") as z:
        other = DualHashMap.from_assignment(np.roll(z["trainer_of"], 1), 3)
    np.savez(out / "maps.npz", **{k: getattr(other, k) for k in artifact.MAP_KEYS})
    _refused(out, "maps.npz", sums["maps.npz"], hashlib.sha256((out / "maps.npz").read_bytes()).hexdigest())
    (out / "maps.npz").write_bytes(intact)
    # a number changed in the JSON files: still valid JSON, silently other values before checksums
    for name, key in [("measures.json", '"capacity": '), ("metadata.json", '"imbalance": 0.0')]:
        text = (out / name).read_text()
        digit = text.index(key) + len(key)
        (out / name).write_text(text[:digit] + str(int(text[digit]) % 9 + 1) + text[digit + 1:])
        if name == "measures.json":
            found = hashlib.sha256((out / name).read_bytes()).hexdigest()
        else:
            found = artifact._content_digest(json.loads((out / name).read_text()))
        _refused(out, name, sums[name], found)
        (out / name).write_text(text)
    assert artifact.load(out).num_parts == 3


@pytest.mark.distributed
def test_a_corrupt_file_of_a_parallel_checkpoint_is_refused_before_any_rank_starts(tmp_path):
    """A 2-process run leaves last.pt and, in its iteration directory, rank-0.pt, rank-1.pt and
    memory-0.pt; ``tgdist launch`` checks them all and refuses a corrupt or missing one in one line."""
    from tests.runtime.test_parallel import SMALL, torchrun

    common = [*SMALL, "train.batch_size=100", "parallel.i=2", "train.num_neg_eval=4", "train.epochs=1"]
    torchrun(2, "-m", "tgdist.train", *common, f"run_dir={tmp_path / 'a'}", cwd=tmp_path)
    ckpt = tmp_path / "a" / "checkpoints"
    (it,) = [p for p in ckpt.iterdir() if p.is_dir()]
    assert sorted(p.name for p in it.iterdir()) == ["memory-0.pt", "rank-0.pt", "rank-1.pt"]
    before = tree(tmp_path)

    def launch():
        return subprocess.run([sys.executable, "-m", "tgdist", "launch", "--", *common, f"train.resume={tmp_path / 'a'}",
                               f"run_dir={tmp_path / 'b'}"], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, check=False)

    for path in (ckpt / "last.pt", it / "rank-1.pt", it / "memory-0.pt"):
        intact = corrupted(path, "change 16")
        r = launch()
        assert r.returncode == 2 and r.stderr == (f"tgdist launch: error: {mismatch(path)}; resume from another "
                                                  f"checkpoint or start afresh\n"), r.stderr
        path.write_bytes(intact)
    (it / "rank-1.pt").rename(tmp_path / "away.pt")
    r = launch()
    assert r.returncode == 2 and r.stderr == (f"tgdist launch: error: {it / 'rank-1.pt'}: missing, so the parallel "
                                              f"checkpoint beside it is incomplete; resume from another checkpoint or "
                                              f"start afresh\n"), r.stderr
    (tmp_path / "away.pt").rename(it / "rank-1.pt")
    assert tree(tmp_path) == before
