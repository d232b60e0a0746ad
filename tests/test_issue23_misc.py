"""Issue 23, point 5 through the real command line: the daemon names a dead trainer by its global
rank, and a correctly quoted non-ASCII override is not blamed for another argument's error."""

import re
from pathlib import Path

import pytest

from tests.test_train_cli import QUICK, tgdist
from tgdist.runtime import shm


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time: what a command changed."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.distributed
def test_a_dead_trainer_of_memory_group_1_is_named_by_its_global_rank(tmp_path, monkeypatch):
    """parallel.k=2 with daemon memory: rank 1 is the only trainer of memory group 1, and its
    daemon said "trainer rank 0 (pid N) died" when rank 1 was killed."""
    (tmp_path / "keep.txt").write_text("the user's file\n")
    before = tree(tmp_path)
    monkeypatch.setenv("TGDIST_FAULT_KILL", "1:2")  # rank 1 SIGKILLs itself at iteration 2
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    r = tgdist("launch", "--nproc", "2", "--", *QUICK, "train.epochs=2", "parallel.k=2", "memory.backend=daemon",
               "train.num_threads=1", "sampler.num_threads=1", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 128 + 9, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == "tgdist launch: rank 1 was killed by signal 9; rank 0 stopped by torchrun", r.stderr
    died = [m for ln in lines if (m := re.fullmatch(r"tgdist memory daemon of group 1 \(pid \d+\): trainer rank "
                                                     r"(\d+) \(pid (\d+)\) died", ln))]
    assert [m.group(1) for m in died] == ["1"], r.stderr
    assert shm.list_segments(f"tgdist-{died[0].group(2)}-") == []  # group 1's run id starts with its starter's pid
    after = tree(tmp_path)
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
], ids=["bad-value", "non-ascii-key-after-double-quoted", "multirun", "typo", "wrong-type", "unquoted",
        "non-ascii-key-first", "broken-quotes"])
def test_the_error_names_the_argument_at_fault(tmp_path, args, line):
    (tmp_path / "keep.txt").write_text("the user's file\n")
    before = tree(tmp_path)
    r = tgdist("train", *args, *QUICK, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"tgdist train: error: {line}"]
    assert tree(tmp_path) == before


def test_launch_names_the_argument_at_fault(tmp_path):
    (tmp_path / "keep.txt").write_text("the user's file\n")
    before = tree(tmp_path)
    r = tgdist("launch", "--nproc", "2", "--", QUOTED_RUN_DIR, "train.epochs=1=2", "parallel.i=2", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "tgdist launch: error: cannot read the override 'train.epochs=1=2': Hydra reads = ~ spaces, quotes and "
        "non-ASCII letters in a value only inside quotes: \"train.epochs='1=2'\""]
    assert tree(tmp_path) == before
