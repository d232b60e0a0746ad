"""The `tgdist train` command line as a user runs it (subprocesses)."""

import gzip
import json
import signal
import subprocess
import sys
import time

import numpy as np

QUICK = ["data.max_events=1200", "model.mem_dim=16", "model.time_dim=8", "train.epochs=1", "train.batch_size=100",
         "train.num_neg_eval=4", "train.progress=false"]


def tgdist(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tgdist", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_train_prints_summary_as_last_stdout_line(tmp_path):
    r = tgdist("train", *QUICK, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["data"] == "collegemsg" and 0 <= summary["test_ap"] <= 1
    assert (tmp_path / "run" / "metrics.jsonl").exists() and (tmp_path / "run" / "checkpoints" / "last.pt").exists()
    assert not (tmp_path / "outputs").exists()


def test_cfg_job_prints_the_config(tmp_path):
    r = tgdist("train", "--cfg", "job", "model=jodie", cwd=tmp_path)
    assert r.returncode == 0 and "name: jodie" in r.stdout


def test_config_typos_fail_with_one_line(tmp_path):
    r = tgdist("train", "train.batchsize=3", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == "tgdist train: error: Could not override 'train.batchsize': Key 'batchsize' not in 'TrainConfig'"
    r = tgdist("train", "model=gcn", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "tgn" in r.stderr
    r = tgdist("train", "data.columns=src,dst,t", cwd=tmp_path)  # Hydra reads the commas as a sweep
    assert r.returncode == 2 and r.stderr.strip() == (
        "tgdist train: error: Ambiguous value for argument 'data.columns=src,dst,t': quote a value with commas, "
        "\"data.columns='src,dst,t'\", or add --multirun to sweep over it")


def test_bad_data_path_leaves_nothing_behind(tmp_path):
    r = tgdist("train", "data=file", "data.path=missing.csv", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "tgdist train: error: missing.csv: no such file or directory"
    assert not (tmp_path / "run").exists()


def test_task_without_labels_fails_before_training(tmp_path):
    """Also with the default run directory: the ``runs/`` folder made for it goes too."""
    r = tgdist("train", *QUICK, "train.task=edge", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "tgdist train: error: train.task=edge needs labels, and data 'collegemsg' has none"
    assert "events/s" not in r.stderr and list(tmp_path.iterdir()) == []


def test_run_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    run_dir = tmp_path / "afile" / "x" / "run"
    r = tgdist("train", f"run_dir={run_dir}", cwd=tmp_path)
    expected = (f"tgdist train: error: run_dir={run_dir}: cannot make a directory in {run_dir.parent} "
                f"({tmp_path / 'afile'} is not a directory)")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [expected]
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_data_file_needs_a_path(tmp_path):
    r = tgdist("train", "data=file", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "tgdist train: error: data=file needs data.path=FILE (any supported file or TGL directory)"]
    assert list(tmp_path.iterdir()) == []


def test_data_path_alone_reads_that_file(tmp_path):
    """``data.path=FILE`` on top of the default data group trains on FILE (format detected, run
    named after it), not on the embedded CollegeMsg stream."""
    rng = np.random.default_rng(0)
    rows = [f"{rng.integers(0, 30)},{30 + rng.integers(0, 20)},{t}" for t in range(400)]
    (tmp_path / "ev.csv.gz").write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    r = tgdist("train", *QUICK, "data.path=ev.csv.gz", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["data"] == "ev" and summary["traversed_events"] == 280  # 70% of 400 training events
    assert "name: ev\n" in (tmp_path / "run" / "config.yaml").read_text()


def test_partition_config_typo_fails_with_one_line(tmp_path):
    r = tgdist("partition", "partition.num_prts=3", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == ("tgdist partition: error: Could not override 'partition.num_prts': "
                                "Key 'num_prts' not in 'PartitionConfig'")


def _interrupt_when(path, args, cwd) -> tuple[int, str]:
    """Start ``tgdist train ARGS``, send SIGINT once ``path`` exists; (exit code, stderr)."""
    p = subprocess.Popen([sys.executable, "-m", "tgdist", "train", *args], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not path.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    return p.returncode, err


def test_ctrl_c_says_what_is_kept_in_one_line(tmp_path):
    """Ctrl-C: exit 130 and one line; a run stopped in its first epoch leaves no directory, a later
    one keeps its checkpoint and names the resume override."""
    run = tmp_path / "run"
    args = ["train.progress=false", "train.epochs=3", f"run_dir={run}"]  # full CollegeMsg: ~2 s an epoch
    rc, err = _interrupt_when(run / "metrics.jsonl", args, tmp_path)
    assert rc == 130, err
    assert err.strip().splitlines()[-1] == "tgdist train: interrupted; no checkpoint had been written"
    assert not run.exists() and "Traceback" not in err

    rc, err = _interrupt_when(run / "checkpoints" / "last.pt", args, tmp_path)
    assert rc == 130, err
    assert err.strip().splitlines()[-1] == (
        f"tgdist train: interrupted; {run / 'checkpoints' / 'last.pt'} holds the last checkpoint, "
        f"continue with train.resume={run}")
    assert "Traceback" not in err and not list(run.glob("checkpoints/.*.tmp"))
