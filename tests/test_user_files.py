"""End to end through the real command line (and torchrun): a run never deletes or overwrites what
it did not write, and bad input ends in one line, exit 2, with nothing else changed on disk."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.runtime.test_parallel import torchrun_cmd
from tests.test_train_cli import QUICK, _interrupt_when, tgdist

SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.num_threads=1", "sampler.num_threads=1",
         "train.progress=false", "train.num_neg_eval=4", "train.batch_size=100", "train.epochs=1"]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


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
    assert r.stderr.strip().splitlines() == [
        f"tgdist train: error: run_dir={proj} holds files that are not a tgdist run's (config.yaml); give a new or "
        f"empty directory, or train.overwrite=true to write into it (its config.yaml, metrics.jsonl, summary.json, "
        f"train.log and checkpoints/ would be replaced)"]
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


def test_a_run_directory_is_marked_and_reused_with_the_users_notes_kept(tmp_path):
    run = tmp_path / "run"
    assert tgdist("train", *QUICK, f"run_dir={run}", cwd=tmp_path).returncode == 0
    marker = json.loads((run / ".tgdist-run").read_text())
    assert marker["made_dir"] is True and marker["pid"] > 0
    (run / "notes.txt").write_text("what I tried\n")
    r = tgdist("train", *QUICK, f"run_dir={run}", cwd=tmp_path)  # a tgdist run's directory: reused
    assert r.returncode == 0, r.stderr
    assert "already holds a run" in r.stderr
    assert (run / "notes.txt").read_text() == "what I tried\n"
    assert json.loads((run / ".tgdist-run").read_text()) == marker  # the run that made it
    r = tgdist("train", *QUICK, f"run_dir={run}", "train.task=node", cwd=tmp_path)  # fails: keeps the earlier run
    assert r.returncode == 2 and (run / "summary.json").exists() and (run / "notes.txt").exists()


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
    assert r.stderr.strip().splitlines() == [
        f"tgdist launch: error: run_dir={tmp_path} holds files that are not a tgdist run's (notes.txt); give a new or "
        f"empty directory, or train.overwrite=true to write into it (its config.yaml, metrics.jsonl, summary.json, "
        f"train.log and checkpoints/ would be replaced)"]
    assert tree(tmp_path) == before
