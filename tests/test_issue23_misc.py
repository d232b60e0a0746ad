"""Issue 23, point 5 through the real command line: the daemon names a dead trainer by its global
rank."""

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

