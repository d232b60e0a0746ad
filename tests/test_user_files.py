"""End to end through the real command line (and torchrun): a run never deletes or overwrites what
it did not write, bad input ends in one line with exit 2 and nothing else changed on disk, and
wrong input is not trained on silently (issue 23)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from tests.partition.test_cli import _events
from tests.partition.test_cli import _run as partition
from tests.runtime.test_parallel import torchrun_cmd
from tests.test_train_cli import QUICK, _interrupt_when, tgdist
from tgdist import checksum
from tgdist.data import mapped
from tgdist.data.cache import from_arrays
from tgdist.errors import DataError
from tgdist.memory import shm
from tgdist.partition import artifact
from tgdist.partition.idmap import DualHashMap

SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.num_threads=1", "sampler.num_threads=1",
         "train.progress=false", "train.num_neg_eval=4", "train.batch_size=100", "train.epochs=1"]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def foreign(command: str, run_dir: Path, names: str) -> str:
    """The one line refusing a run_dir that holds files of something other than a tgdist run."""
    return (f"tgdist {command}: error: run_dir={run_dir} holds files that are not a tgdist run's ({names}); give a new "
            f"or empty directory, or train.overwrite=true to write into it (its config.yaml, metrics.jsonl, "
            f"summary.json, train.log and checkpoints/ would be replaced)")


def private_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("tgdist-rank*")}


def test_a_folder_of_ones_own_files_is_refused_as_run_dir(tmp_path):
    """The issue's case: ``run_dir=.`` in a project folder overwrote its config.yaml at start."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "config.yaml").write_text("my: notes\n")
    before = tree(tmp_path)
    r = tgdist("train", *QUICK, "run_dir=.", cwd=proj)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [foreign("train", proj, "config.yaml")]
    assert tree(tmp_path) == before


def test_ctrl_c_in_a_run_in_the_working_directory_keeps_the_directory(tmp_path):
    """Ctrl-C before the first checkpoint removed the whole run directory, which was the
    working directory the user gave as ``run_dir=.``; only what the run wrote goes now."""
    proj = tmp_path / "proj"
    proj.mkdir()
    rc, err = _interrupt_when(proj / "metrics.jsonl", ["train.progress=false", "train.epochs=3", "run_dir=."], proj)
    assert rc == 130, err
    assert err.strip().splitlines()[-1] == "tgdist train: interrupted; no checkpoint had been written"
    assert proj.is_dir() and tree(proj) == {}


def test_overwrite_writes_into_a_folder_and_takes_back_only_its_own_files(tmp_path):
    """``train.overwrite=true``: the run writes there, and a failure removes the files it made and
    nothing else (the folder, the user's other files)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "notes.txt").write_text("mine\n")
    r = tgdist("train", *QUICK, "run_dir=.", "train.overwrite=true", "train.task=node", cwd=proj)  # no labels
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("tgdist train: error: train.task=node needs labels")
    assert tree(proj) == {"notes.txt": b"mine\n"}


def test_a_failed_run_in_an_empty_folder_given_leaves_the_folder(tmp_path):
    run = tmp_path / "mine"
    run.mkdir()
    r = tgdist("train", *QUICK, f"run_dir={run}", "train.task=node", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "tgdist train: error: train.task=node needs labels, and data 'collegemsg' has none"
    assert run.is_dir() and tree(run) == {}


def test_a_finished_run_is_never_replaced_and_overwrite_starts_afresh_keeping_the_users_notes(tmp_path):
    run = tmp_path / "run"
    assert tgdist("train", *QUICK, f"run_dir={run}", cwd=tmp_path).returncode == 0
    marker = json.loads((run / ".tgdist-run").read_text())
    assert marker["made_dir"] is True and marker["pid"] > 0
    (run / "notes.txt").write_text("what I tried\n")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.old").write_text("x")
    before, old_log = tree(run), (run / "train.log").read_text()
    r = tgdist("train", *QUICK, f"run_dir={run}", cwd=tmp_path)  # the finished run stays as it is
    assert r.returncode == 2 and r.stderr.strip() == (
        f"tgdist train: error: run_dir={run} holds a finished tgdist run: continue it with train.resume={run}, or "
        f"give train.overwrite=true to remove its files and start afresh there (or another run_dir)")
    assert tree(run) == before
    r = tgdist("train", *QUICK, f"run_dir={run}", "train.overwrite=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (run / "notes.txt").read_text() == "what I tried\n" and not (run / "tensorboard").exists()
    assert json.loads((run / ".tgdist-run").read_text())["pid"] != marker["pid"]  # the new run's
    log = (run / "train.log").read_text()
    assert old_log.splitlines()[0] not in log and "train.overwrite=true: removed the earlier run's" in log
    r = tgdist("train", *QUICK, f"run_dir={run}", "train.task=node", "train.overwrite=true", cwd=tmp_path)
    assert r.returncode == 2 and (run / "summary.json").exists() and (run / "notes.txt").exists()  # refused first


def test_another_rank_never_sees_foreign_files_while_rank_0_claims_and_releases(tmp_path, monkeypatch):
    """Every rank of a parallel run checks the run directory while rank 0 claims it (and, after bad
    input, removes its files again): at no step of either may the folder look like a user's. CI
    once caught rank 1 listing rank 0's marker while it was being written."""
    from tgdist.runtime import rundir

    run = tmp_path / "run"
    seen = []

    def other_rank_checks():
        seen.append(rundir.foreign_entries(run))

    replace, unlink, rmtree = os.replace, Path.unlink, shutil.rmtree
    monkeypatch.setattr(rundir.os, "replace", lambda a, b: (other_rank_checks(), replace(a, b))[1])
    rundir.claim(run)
    assert seen == [[]] and (run / rundir.MARKER).is_file()
    for name in ("config.yaml", "train.log", "metrics.jsonl"):
        (run / name).write_text("x")
    (run / ".hydra").mkdir()
    monkeypatch.setattr(Path, "unlink", lambda self, *a, **k: (unlink(self, *a, **k), other_rank_checks())[0])
    monkeypatch.setattr(rundir.shutil, "rmtree", lambda *a, **k: (rmtree(*a, **k), other_rank_checks())[0])
    seen.clear()
    assert rundir.release(run) and not run.exists()
    assert seen == [[]] * 5  # after each of the five removals, the marker's last


def test_a_sweep_directory_of_other_files_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "data.csv").write_text("1,2,3\n")
    before = tree(tmp_path)
    r = tgdist("train", "-m", *QUICK, "train.seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"tgdist train: error: hydra.sweep.dir={sweep} holds files that are not a tgdist sweep's (data.csv); give a "
        f"new or empty directory, or train.overwrite=true to write into it"]
    assert tree(tmp_path) == before


@pytest.mark.slow  # three sweeps of one job: ~1-2 min on 2 cores
def test_a_sweep_never_replaces_an_earlier_sweeps_runs(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *QUICK, "train.seed=0", f"hydra.sweep.dir={sweep}"]
    assert tgdist("train", *args, cwd=tmp_path).returncode == 0
    before, pid = tree(tmp_path), json.loads((sweep / "0" / ".tgdist-run").read_text())["pid"]
    r = tgdist("train", *args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"tgdist train: error: hydra.sweep.dir={sweep} holds the runs of an earlier sweep (job folders 0); give a new "
        f"hydra.sweep.dir, or train.overwrite=true to replace them"]
    assert tree(tmp_path) == before
    r = tgdist("train", *args, "train.overwrite=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((sweep / "0" / ".tgdist-run").read_text())["pid"] != pid  # the new sweep's job


@pytest.mark.slow  # ~17 s
def test_the_resume_hint_can_be_pasted_with_spaces_in_the_path(tmp_path):
    run = tmp_path / "my runs" / "a, b"
    args = ["data.max_events=6000", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=100",
            "train.num_neg_eval=4", "train.progress=false", "train.epochs=3", "train.checkpoint_every=5"]
    rc, err = _interrupt_when(run / "checkpoints" / "last.pt", [*args, f"run_dir='{run}'"], tmp_path)
    assert rc == 130, err
    hint = err.strip().splitlines()[-1].rpartition("continue with ")[2]
    assert hint == f"'train.resume=\"{run}\"'"
    r = tgdist("train", *args, *shlex.split(hint), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["run_dir"] == str(run)


@pytest.mark.distributed
def test_torchrun_ranks_write_and_lock_one_run_directory(tmp_path):
    """A run directory named by the time was resolved at each rank's own moment: rank 0 locked
    an empty directory named at its check, the run wrote another, and rank 1's checkpoint went
    to a third. Rank 0 now names it once, locks it, and tells the other ranks."""
    before = private_dirs()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(torchrun_cmd(2, "-m", "tgdist.train", *SMALL, "parallel.i=2", "train.epochs=4",
                                      "run_dir=runs/${now:%H%M%S%f}"),
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, runs = time.monotonic() + 120, tmp_path / "runs"
        while p.poll() is None and time.monotonic() < deadline and not any(
                "threads:" in log.read_text() for log in runs.glob("*/train.log")):
            time.sleep(0.1)
        held = [d for d in runs.iterdir() if _locked(d)]
        out, err = p.communicate(timeout=240)
    finally:
        p.kill()
    assert p.returncode == 0, err[-3000:]
    run = Path(json.loads(out.strip().splitlines()[-1])["run_dir"])
    assert [d.name for d in runs.iterdir()] == [run.name] and held == [run]
    assert sorted(q.name for q in run.glob("checkpoints/it*/rank-*.pt")) == ["rank-0.pt", "rank-1.pt"]
    assert private_dirs() <= before


def _locked(d: Path) -> bool:
    fd = os.open(d, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.mark.distributed
def test_torchrun_bad_input_is_one_line_per_rank_and_leaves_nothing(tmp_path):
    """Plain torchrun then prints its own failure report (ChildFailedError, exit 1); tgdist
    launch says it in one line instead (docs)."""
    before, private = tree(tmp_path), private_dirs()
    r = subprocess.run(torchrun_cmd(2, "-m", "tgdist.train", *SMALL, "parallel.i=3"), cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ours = sorted(ln for ln in r.stderr.splitlines() if ln.startswith("tgdist train"))
    assert ours == [f"tgdist train [rank {n}]: error: parallel.i x parallel.j x parallel.k = 3 x 1 x 1 = 3 but the "
                    f"world has 2 processes (torchrun --nproc-per-node 3 (x nodes), or tgdist launch --nproc 3)"
                    for n in (0, 1)]
    assert r.returncode == 1 and "exitcode  : 2" in r.stderr  # torchrun's report of a rank's exit 2
    assert tree(tmp_path) == before and private_dirs() <= private


def test_tgdist_launch_refuses_a_folder_of_other_files_before_starting_ranks(tmp_path):
    (tmp_path / "notes.txt").write_text("x\n")
    before = tree(tmp_path)
    r = tgdist("launch", "--nproc", "2", "--", "parallel.i=2", "run_dir=.", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [foreign("launch", tmp_path, "notes.txt")]
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------------------------------
# The daemon names a dead trainer by its global rank; an override error blames the argument at fault.


def tree_misc(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time: what a command changed."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.distributed
@pytest.mark.slow  # ~14 s
def test_a_dead_trainer_of_memory_group_1_is_named_by_its_global_rank(tmp_path, monkeypatch):
    """parallel.k=2 with daemon memory: rank 1 is the only trainer of memory group 1, and its
    daemon said "trainer rank 0 (pid N) died" when rank 1 was killed."""
    (tmp_path / "keep.txt").write_text("the user's file\n")
    before = tree_misc(tmp_path)
    monkeypatch.setenv("TGDIST_FAULT_KILL", "1:2")  # rank 1 SIGKILLs itself at iteration 2
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    r = tgdist("launch", "--nproc", "2", "--", *QUICK, "train.epochs=2", "parallel.k=2", "memory.backend=daemon",
               "train.num_threads=1", "sampler.num_threads=1", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 128 + 9, r.stderr
    lines = r.stderr.strip().splitlines()
    # the launcher's closing line; the killed rank's daemon, left alone, may say its own line after it
    assert "tgdist launch: rank 1 was killed by signal 9; rank 0 stopped by torchrun" in lines[-2:], r.stderr
    died = [m for ln in lines if (m := re.fullmatch(r"tgdist memory daemon of group 1 \(pid \d+\): trainer rank "
                                                     r"(\d+) \(pid (\d+)\) died", ln))]
    assert [m.group(1) for m in died] == ["1"], r.stderr
    assert shm.list_segments(f"tgdist-{died[0].group(2)}-") == []  # group 1's run id starts with its starter's pid
    after = tree_misc(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("run")} == before  # the run's own folder aside


QUOTED_RUN_DIR = "run_dir='runs/\u00f1and\u00fa'"


@pytest.mark.parametrize("args, line", [
    # the other argument is at fault: Hydra cannot read it (the quoted non-ASCII one was blamed)
    ([QUOTED_RUN_DIR, "train.epochs=1=2"],
     "cannot read the override 'train.epochs=1=2': Hydra reads = ~ spaces, quotes and non-ASCII letters in a value "
     "only inside quotes: \"train.epochs='1=2'\""),
    (['run_dir="runs/\u00f1and\u00fa"', "tra\u00f1n.epochs=1"],
     "cannot read the override 'tra\u00f1n.epochs=1': 'tra\u00f1n.epochs' is not a key of tgdist's config; did you "
     "mean 'train.epochs'?"),
    (["--multirun", QUOTED_RUN_DIR, "train.epochs=1=2"],
     "cannot read the override 'train.epochs=1=2': Hydra reads = ~ spaces, quotes and non-ASCII letters in a value "
     "only inside quotes: \"train.epochs='1=2'\""),
    # the other argument is at fault after reading: a typo, a value of the wrong type
    (["data.name='Z\u00fcrich caf\u00e9'", "train.epochz=1"],
     "Could not override 'train.epochz': Key 'epochz' not in 'TrainConfig'; did you mean 'train.epochs'?"),
    ([QUOTED_RUN_DIR, "train.batch_size=abc"],
     "Error merging override train.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    # the non-ASCII argument is at fault: unquoted, or a key Hydra cannot read
    (["run_dir=runs/\u00f1and\u00fa", "train.batch_size=abc"],
     "cannot read the override 'run_dir=runs/\u00f1and\u00fa': Hydra reads = ~ spaces, quotes and non-ASCII letters "
     "in a value only inside quotes: \"run_dir='runs/\u00f1and\u00fa'\""),
    (["tra\u00f1n.epochs=1", QUOTED_RUN_DIR],
     "cannot read the override 'tra\u00f1n.epochs=1': 'tra\u00f1n.epochs' is not a key of tgdist's config; did you "
     "mean 'train.epochs'?"),
    (["run_dir=x'\u00f1'", "train.epochs=1=2"], "Error parsing override 'run_dir=x'\u00f1''"),
    # a path with a space that the shell split: the word after it is no override
    (["data.path=/tmp/my", "space/file.csv"],
     "cannot read the override 'space/file.csv': an override is KEY=VALUE; if it is the rest of a value with "
     "spaces that the shell split, quote the whole override, e.g. \"data.path='/my data/x.csv'\""),
], ids=["bad-value", "non-ascii-key-after-double-quoted", "multirun", "typo", "wrong-type", "unquoted",
        "non-ascii-key-first", "broken-quotes", "split-path"])
def test_the_error_names_the_argument_at_fault(tmp_path, args, line):
    (tmp_path / "keep.txt").write_text("the user's file\n")
    before = tree_misc(tmp_path)
    r = tgdist("train", *args, *QUICK, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"tgdist train: error: {line}"]
    assert tree_misc(tmp_path) == before


def test_launch_names_the_argument_at_fault(tmp_path):
    (tmp_path / "keep.txt").write_text("the user's file\n")
    before = tree_misc(tmp_path)
    r = tgdist("launch", "--nproc", "2", "--", QUOTED_RUN_DIR, "train.epochs=1=2", "parallel.i=2", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "tgdist launch: error: cannot read the override 'train.epochs=1=2': Hydra reads = ~ spaces, quotes and "
        "non-ASCII letters in a value only inside quotes: \"train.epochs='1=2'\""]
    assert tree_misc(tmp_path) == before


# --------------------------------------------------------------------------------------------------
# Checksums: a corrupt checkpoint, partition artifact or cache entry.


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


def tree_checksums(root: Path) -> dict:
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
    before = tree_checksums(tmp_path)
    r = tgdist("train", *QUICK, "train.epochs=2", f"train.resume={run}", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"tgdist train: error: {mismatch(last)}; resume from another checkpoint or start afresh"]
    assert tree_checksums(tmp_path) == before


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
    data_args = ["data=file", f"data.path={events}", f"data.cache_dir={tmp_path / 'cache'}"]
    first = tgdist("train", *QUICK, *data_args, f"run_dir={tmp_path / 'a'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]  # a lock file beside it
    t = entry / "t.npy"
    data = bytearray(t.read_bytes())
    data[-8] ^= 1  # the last event's time, size unchanged
    t.write_bytes(data)
    again = tgdist("train", *QUICK, *data_args, f"run_dir={tmp_path / 'b'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"{entry}: t.npy does not match its checksum" in again.stderr and "building it again" in again.stderr
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (first, again))
    for key in ("loss", "val_ap", "test_ap", "test_mrr", "traversed_events"):
        assert a[key] == b[key], key
    mapped.verify(entry)  # written again, intact


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
@pytest.mark.slow  # ~22 s
def test_a_corrupt_file_of_a_parallel_checkpoint_is_refused_before_any_rank_starts(tmp_path):
    """A 2-process run leaves last.pt and, in its iteration directory, rank-0.pt, rank-1.pt and
    memory-0.pt; ``tgdist launch`` checks them all and refuses a corrupt or missing one in one line."""
    from tests.runtime.test_parallel import SMALL, torchrun

    common = [*SMALL, "train.batch_size=100", "parallel.i=2", "train.num_neg_eval=4", "train.epochs=1"]
    torchrun(2, "-m", "tgdist.train", *common, f"run_dir={tmp_path / 'a'}", cwd=tmp_path)
    ckpt = tmp_path / "a" / "checkpoints"
    (it,) = [p for p in ckpt.iterdir() if p.is_dir()]
    assert sorted(p.name for p in it.iterdir()) == ["memory-0.pt", "rank-0.pt", "rank-1.pt"]
    before = tree_checksums(tmp_path)

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
    assert tree_checksums(tmp_path) == before


# --------------------------------------------------------------------------------------------------
# Columns that are probably wrong; node ids that are only labels.


EPOCH = 1_289_241_911  # 2010-11-08, where SNAP's bitcoin-otc starts


def tree_data(*roots: Path) -> dict[str, bytes]:
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


@pytest.mark.slow
def test_a_rating_read_as_the_time_stops_the_run_in_one_line(tmp_path, cache_dir):
    snap_csv(tmp_path / "otc.csv")
    before = tree_data(tmp_path, cache_dir)
    r = tgdist("train", "data=file", "data.path=otc.csv", *QUICK, cwd=tmp_path)  # the default runs/ folder
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [doubt_line("otc.csv", 21, "2010-11-08", "2010-11-25", "400")]
    assert tree_data(tmp_path, cache_dir) == before  # no run directory, no cache entry


@pytest.mark.slow
def test_the_suggested_columns_train(tmp_path):
    snap_csv(tmp_path / "otc.csv")
    r = tgdist("train", "data=file", "data.path=otc.csv", "data.columns='src,dst,feat,t'", *QUICK,
               f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["data"] == "otc" and summary["traversed_events"] == 280  # 70% of 400, times read as times
    assert "column 3, read as the time" not in r.stderr


@pytest.mark.slow
def test_strict_columns_false_trains_with_a_warning(tmp_path):
    snap_csv(tmp_path / "otc.csv")
    r = tgdist("train", "data=file", "data.path=otc.csv", "data.strict_columns=false", *QUICK,
               f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    warning = ("[WARNING] otc.csv: column 3, read as the time, holds 21 distinct values, some negative (-10 .. 10), "
               "but column 4 looks like Unix times (400 distinct values, 2010-11-08 .. 2010-11-25); column 3 is read "
               "as the time, as data.strict_columns=false asks")
    assert warning in r.stderr and warning in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.slow  # ~12 s
def test_the_shared_bitcoin_otc_by_position_stops_and_as_configured_trains(tmp_path, cache_dir, datasets_dir):
    path = datasets_dir / "bitcoin-otc" / "soc-sign-bitcoinotc.csv.gz"
    before = tree_data(tmp_path, cache_dir)
    r = tgdist("train", "data=file", f"data.path={path}", *QUICK, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [doubt_line(path, 20, "2010-11-08", "2016-01-25", "35,592")]
    assert tree_data(tmp_path, cache_dir) == before
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
    [entry] = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]  # the graph it trained on
    g = from_arrays(*mapped.load(entry))
    # negative and beyond int64 together: the decimal text of each id, exactly as written
    assert g.node_map.tolist() == [str(i) for i in sorted(set(ids))]
    assert g.node_map[g.src].tolist() == [str(s) for s, _, _ in rows]
    assert g.node_map[g.dst].tolist() == [str(d) for _, d, _ in rows]
