"""The `tgdist train` command line as a user runs it (subprocesses)."""

import gzip
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

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
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary  # wall_seconds included
    assert not (tmp_path / "outputs").exists()


def test_cfg_job_prints_the_config(tmp_path):
    r = tgdist("train", "--cfg", "job", "model=jodie", cwd=tmp_path)
    assert r.returncode == 0 and "name: jodie" in r.stdout


def test_config_typos_fail_with_one_line(tmp_path):
    r = tgdist("train", "train.batchsize=3", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == ("tgdist train: error: Could not override 'train.batchsize': Key 'batchsize' not in "
                                "'TrainConfig'; did you mean 'train.batch_size'?")
    r = tgdist("train", "model=gcn", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "tgn" in r.stderr
    r = tgdist("train", "data.columns=src,dst,t", cwd=tmp_path)  # Hydra reads the commas as a sweep
    assert r.returncode == 2 and r.stderr.strip() == (
        "tgdist train: error: Ambiguous value for argument 'data.columns=src,dst,t': quote a value with commas, "
        "\"data.columns='src,dst,t'\", or add --multirun to sweep over it")


@pytest.mark.parametrize("bad, options", [("memory.backend=shm", "auto, daemon, depcache, depcomm, local, sven"),
                                          ("model.name=gat", "tgn, jodie, apan")])
def test_an_unknown_option_of_a_key_is_one_line_naming_the_options(tmp_path, bad, options):
    r = tgdist("train", bad, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"tgdist train: error: {bad}: choose one of {options}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_options_read_as_plain_names_in_the_run_files(tmp_path):
    r = tgdist("train", *QUICK, "model=jodie", "memory=local", "train.lr_scaling=sqrt", "data.time_unit=s",
               f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["model"] == "jodie"
    for written in (tmp_path / "run" / "config.yaml", tmp_path / "run" / ".hydra" / "config.yaml"):
        text = written.read_text()
        for line in ("  name: jodie\n", "  backend: local\n", "  lr_scaling: sqrt\n", "  time_unit: s\n",
                     "  strategy: recent\n", "  task: link\n", "  format: auto\n"):
            assert line in text, (written, line)


def test_bad_data_path_leaves_nothing_behind(tmp_path):
    r = tgdist("train", "data=file", "data.path=missing.csv", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "tgdist train: error: missing.csv: no such file or directory"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_reader_warnings_are_log_lines(tmp_path):
    """Not Python's ``file:line: UserWarning`` report with a line of tgdist's code under it."""
    rows = [f"{i % 7},{7 + i % 5},{i}" for i in range(300)]
    rows[2], rows[3] = rows[3], rows[2]
    (tmp_path / "u.csv").write_text("\n".join(rows) + "\n")
    r = tgdist("train", "data=file", f"data.path={tmp_path / 'u.csv'}", f"data.cache_dir={tmp_path / 'cache'}",
               *QUICK, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    line = f"[WARNING] {tmp_path / 'u.csv'}:4: events are not sorted by time; sorting them stably"
    assert line in r.stderr and "UserWarning" not in r.stderr
    assert line in (tmp_path / "run" / "train.log").read_text()


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


def test_run_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    r = tgdist("train", f"run_dir={tmp_path / 'afile'}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"tgdist train: error: run_dir={tmp_path / 'afile'} is a file, not a directory"]
    assert [p.name for p in tmp_path.iterdir()] == ["afile"] and (tmp_path / "afile").read_text() == ""


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
                                "Key 'num_prts' not in 'PartitionConfig'; did you mean 'partition.num_parts'?")


def _interrupt_when(path, args, cwd, sig=signal.SIGINT) -> tuple[int, str]:
    """Start ``tgdist train ARGS``, send ``sig`` once ``path`` exists; (exit code, stderr)."""
    p = subprocess.Popen([sys.executable, "-m", "tgdist", "train", *args], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not path.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(sig)
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
    _assert_stopped_keeping_the_checkpoint(run, rc, err, 130, "interrupted")


def _assert_stopped_keeping_the_checkpoint(run, rc: int, err: str, code: int, words: str) -> None:
    assert rc == code, err
    assert err.strip().splitlines()[-1] == (
        f"tgdist train: {words}; {run / 'checkpoints' / 'last.pt'} holds the last checkpoint, "
        f"continue with train.resume={run}")
    assert "Traceback" not in err and not list(run.glob("checkpoints/.*.tmp"))


@pytest.mark.slow
def test_sigterm_stops_like_ctrl_c(tmp_path):
    """``kill``, SLURM's time limit, ``docker stop``: exit 143 (128 + SIGTERM) and the same line
    as Ctrl-C, instead of dying with no word while a checkpoint may be half written."""
    run = tmp_path / "run"
    args = ["train.progress=false", "train.epochs=3", "train.checkpoint_every=20", f"run_dir={run}"]
    rc, err = _interrupt_when(run / "checkpoints" / "last.pt", args, tmp_path, signal.SIGTERM)
    _assert_stopped_keeping_the_checkpoint(run, rc, err, 143, "stopped by SIGTERM")


def test_a_checkpoint_that_cannot_be_written_is_one_line(tmp_path):
    """A full disk or a quota while the checkpoint is written (here a 2 MB file-size limit, under
    the 2.7 MB checkpoint): one line naming the file, exit 1, no temp file, and the directory of a
    run left without any checkpoint is removed."""
    import resource

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2_000_000, 2_000_000))

    run = tmp_path / "run"
    args = ["train.checkpoint_every=2", "train.stop_after_batches=3", "train.progress=false", "data.cache=false"]
    p = subprocess.run([sys.executable, "-m", "tgdist", "train", *args, f"run_dir={run}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size,
                       check=False)
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    # the first file over the limit: the iteration's memory part (the largest), written before last.pt
    assert re.match(rf"tgdist train: error: {re.escape(str(run / 'checkpoints'))}/it\d{{8}}/memory-0.pt: cannot write "
                    r"\(the write failed; torch: ", last), last
    assert "Traceback" not in p.stderr and list(tmp_path.iterdir()) == []


def test_hydra_run_dir_is_the_run_directory(tmp_path):
    """``hydra.run.dir=DIR`` alone is ``run_dir=DIR``: the config records DIR and no default
    directory is claimed next to it; with run_dir too it is refused."""
    r = tgdist("train", *QUICK, "hydra.run.dir=out/r", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert "\nrun_dir: out/r\n" in (tmp_path / "out" / "r" / "config.yaml").read_text()  # as run_dir=out/r records it
    r = tgdist("train", *QUICK, "hydra.run.dir=a", "run_dir=b", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("tgdist train: error: give run_dir=DIR or hydra.run.dir=DIR")


def test_relative_paths_with_hydra_job_chdir(tmp_path):
    """``hydra.job.chdir=true`` runs the job inside its run directory; ``data.path=ev.csv`` still
    names the file where the command was started (it was read from the run directory before)."""
    rows = [f"{i % 30},{30 + i % 17},{i}" for i in range(400)]
    (tmp_path / "ev.csv").write_text("\n".join(rows) + "\n")
    r = tgdist("train", *QUICK, "data.path=ev.csv", "hydra.job.chdir=true", "run_dir=r", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["data"] == "ev"
    assert f"  path: {tmp_path / 'ev.csv'}\n" in (tmp_path / "r" / "config.yaml").read_text()


@pytest.mark.slow  # ~23 s
def test_a_task_the_data_has_no_labels_for_is_the_only_line(tmp_path):
    """Found after the data is read: the data's description and the versions line were logged
    before it, so the error was the third line on stderr."""
    tgdist("train", *QUICK, "train.epochs=0", f"run_dir={tmp_path / 'warm'}", cwd=tmp_path)  # the data is cached
    for bad, message in (("train.task=node", "train.task=node needs labels, and data 'collegemsg' has none"),
                         ("data.max_events=1", "no training events: the chronological split of 1 event ")):
        r = tgdist("train", *QUICK, bad, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"tgdist train: error: {message}")
        assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_resumed_run_continues_in_its_own_directory(tmp_path):
    """``train.resume=RUN_DIR``, as the Ctrl-C line says: the run went on in a new default
    directory, leaving RUN_DIR with the partial run; it now continues in RUN_DIR."""
    run = tmp_path / "r"
    assert tgdist("train", *QUICK, f"run_dir={run}", cwd=tmp_path).returncode == 0
    r = tgdist("train", *QUICK, "train.epochs=2", f"train.resume={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["run_dir"] == str(run)
    assert [p.name for p in tmp_path.iterdir()] == ["r"]  # no runs/ beside it
    assert [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    r = tgdist("train", *QUICK, "train.epochs=3", f"train.resume={run / 'checkpoints' / 'last.pt'}", cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["run_dir"] == str(run)


@pytest.mark.slow
def test_ctrl_c_then_the_printed_command_ends_as_the_uninterrupted_run(tmp_path):
    """The Ctrl-C line's command alone resumes with the run's own config.yaml: the run composed
    the defaults again and refused the checkpoint (data.max_events: 1200 vs None); given that key,
    a 4-epoch run went on to the default 5 epochs."""
    args = [*QUICK, "train.epochs=4", "train.checkpoint_every=0", "model.dropout=0.2"]
    whole = tgdist("train", *args, f"run_dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "tgdist", "train", *args, f"run_dir={run}"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline:  # Ctrl-C once epoch 2 of 4 is written
        if (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    printed = err.strip().splitlines()[-1].rpartition("continue with ")[2]
    assert printed == f"train.resume={run}"
    r = tgdist("train", *shlex.split(printed), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"resuming with the settings of {run / 'config.yaml'}; none changed by this command" in r.stderr
    done, expected = (json.loads(x.stdout.strip().splitlines()[-1]) for x in (r, whole))
    assert done["epochs"] == 4 and done["run_dir"] == str(run)
    keys = ("loss", "val_ap", "val_auc", "test_ap", "test_auc", "test_mrr", "best_epoch", "iterations")
    assert {k: done[k] for k in keys} == {k: expected[k] for k in keys}


def test_a_resume_takes_the_runs_settings_and_checks_what_is_given_on_top(tmp_path):
    run = tmp_path / "r"
    assert tgdist("train", *QUICK, "model.dropout=0.3", f"run_dir={run}", cwd=tmp_path).returncode == 0
    r = tgdist("train", f"train.resume={run}", "train.epochs=2", cwd=tmp_path)  # only what changes
    assert r.returncode == 0, r.stderr
    assert (f"resuming with the settings of {run / 'config.yaml'}; changed by this command: train.epochs 1 -> 2"
            in r.stderr)
    assert "  dropout: 0.3\n" in (run / "config.yaml").read_text()
    for given, line in (
            (["model.dropout=0.1"], f"{run / 'checkpoints' / 'last.pt'}: checkpoint was written under another config "
                                    f"(model.dropout: checkpoint 0.3 vs now 0.1)"),
            (["model=jodie"], "model=jodie: a resume keeps the run's config groups (model=jodie sets "
                              "model.name='jodie' (the run has 'tgn')); drop model=jodie, and give single keys "
                              "(model.KEY=VALUE) for what a resume may change")):
        r = tgdist("train", f"train.resume={run}", "train.epochs=3", *given, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"tgdist train: error: {line}"], r.stderr
    r = tgdist("train", "model=tgn", "data=collegemsg", *QUICK, "model.dropout=0.3", f"train.resume={run}",
               "train.epochs=3", cwd=tmp_path)  # the first command pasted back: its group choices kept out
    assert r.returncode == 0, r.stderr


def test_a_metrics_line_that_cannot_be_written_names_the_run(tmp_path):
    """metrics.jsonl on a full device (here /dev/full): the flush's error names no file, so the
    line names the run directory."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to("/dev/full")
    # (a folder of one's own making: written into only when told to)
    r = tgdist("train", *QUICK, f"run_dir={run}", "train.overwrite=true", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"tgdist train: error: {run}: cannot write (No space left on device)"


def test_write_failures_are_one_line():
    import errno

    from tgdist.errors import write_failure

    assert write_failure(OSError(errno.ENOSPC, "No space left on device", "/r/last.pt")) == (
        "/r/last.pt: cannot write (No space left on device)")
    assert write_failure(OSError(errno.EROFS, "Read-only file system")) == "cannot write (Read-only file system)"
    assert write_failure(OSError(errno.ENOENT, "No such file")) is None and write_failure(ValueError()) is None


def test_ctrl_c_before_the_run_starts_is_one_line_and_leaves_no_directory(tmp_path, monkeypatch, capsys):
    """While torch is imported or Hydra sets up (the first seconds of every launch): exit 130 and
    one line, and the default run directory already claimed is removed again."""
    from tgdist.cli import train

    def interrupted(full, source):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "_start", interrupted)
    monkeypatch.setattr(sys, "argv", ["tgdist train", *QUICK])
    with pytest.raises(SystemExit) as exit_:
        train.main()
    assert exit_.value.code == 130
    assert capsys.readouterr().err == "tgdist train: interrupted before the run started\n"
    assert list(tmp_path.iterdir()) == []  # neither runs/NAME nor runs/


def test_ctrl_c_after_the_run_finished_says_so(tmp_path, monkeypatch, capsys):
    """A signal in Hydra's teardown, after the summary was printed, was reported as arriving
    "before the run started"."""
    from tgdist.cli import train

    def finished_then_interrupted(full, source):
        train._launch.finished.append(str(tmp_path / "r"))
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "_start", finished_then_interrupted)
    monkeypatch.setattr(sys, "argv", ["tgdist train", *QUICK, f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(SystemExit) as exit_:
        train.main()
    assert exit_.value.code == 130
    assert capsys.readouterr().err == f"tgdist train: interrupted after its run finished (its results are in {tmp_path / 'r'})\n"


def test_a_run_checks_its_settings_once(tmp_path, monkeypatch, capsys):
    """The command line composes the config before Hydra starts, and the run trains with that config;
    the run validates it once and hands what that resolved to its trainer (no memo of checked
    configs: each check would count)."""
    from tgdist.cli import train
    from tgdist.runtime import build

    checked = []
    inner = build._validate
    monkeypatch.setattr(build, "_validate", lambda cfg: checked.append(1) or inner(cfg))  # (its choices returned)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["tgdist train", *QUICK, "train.seed=12345", f"run_dir={tmp_path / 'r'}"])
    train.main()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_dir"] == str(tmp_path / "r")
    assert len(checked) == 1


def test_a_run_composes_its_config_once(tmp_path, monkeypatch, capsys):
    """One composition per run (Hydra's config loader called once): the one checked before
    anything is written is the one the run starts with, Hydra's settings included (its run
    directory, its ``.hydra/`` files), and the command line is left as given."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from tgdist.cli import train

    composed = []
    inner = ConfigLoaderImpl.load_configuration
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration",
                        lambda self, *a, **k: composed.append(1) or inner(self, *a, **k))
    monkeypatch.chdir(tmp_path)
    argv = ["tgdist train", *QUICK, "train.seed=7"]
    monkeypatch.setattr(sys, "argv", list(argv))
    train.main()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(composed) == 1 and sys.argv == argv
    run = Path(summary["run_dir"])
    assert run.parent == tmp_path / "runs" and (run / "train.log").read_text().strip()
    overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
    assert overrides == [*QUICK, "train.seed=7", f"run_dir='{run}'"]  # the default name, resolved once
    assert yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["run_dir"] == str(run)
    assert yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]["job"]["name"] == "train"


def test_a_sweep_composes_each_config_once(tmp_path, monkeypatch, capsys):
    """A sweep of two jobs composes three configs (the sweep's, which Hydra's sweeper reads, and
    each job's, checked before the first job starts), where it composed nine before (the sweep's
    and a job's twice, each job's three times: checked, then by Hydra's sweeper to validate its
    batch and by its launcher); and what Hydra records of the sweep (``multirun.yaml``, each
    job's ``.hydra/`` files) and the jobs' results are those of the same sweep with Hydra
    composing each job's config itself, which is run here too (but for a job's
    ``.hydra/config.yaml``, which is a run's: its strategy sections narrowed)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from tgdist.cli import train
    from tgdist.config import overrides

    composed = []
    inner = ConfigLoaderImpl.load_configuration
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration",
                        lambda self, *a, **k: composed.append(1) or inner(self, *a, **k))
    monkeypatch.chdir(tmp_path)

    def sweep(name: str):
        composed.clear()
        argv = ["tgdist train", "--multirun", *QUICK, "train.seed=3,4", f"hydra.sweep.dir={tmp_path / name}"]
        monkeypatch.setattr(sys, "argv", list(argv))
        train.main()
        summaries = [json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines()]
        assert sys.argv == argv and [s["run_dir"] for s in summaries] == [str(tmp_path / name / n) for n in "01"]
        files = {p.relative_to(tmp_path / name): p.read_text().replace(str(tmp_path / name), "SWEEP")
                 for p in sorted((tmp_path / name).rglob("*.yaml"))}
        return len(composed), files, [s["test_ap"] for s in summaries]

    ours = sweep("ours")
    monkeypatch.setattr(overrides._ComposedJobs, "load_sweep_config", ConfigLoaderImpl.load_sweep_config)
    hydras = sweep("hydras")
    assert ours[0] == 3 and hydras[0] == 7  # (each job composed twice more by Hydra's sweeper and launcher)
    assert len(ours[1]) == 9 and ours[1].keys() == hydras[1].keys()  # multirun.yaml; 4 files of each job
    for name in ours[1]:
        if name.parts[-2:-1] != (".hydra",) or name.name != "config.yaml":
            assert ours[1][name] == hydras[1][name], name
            continue
        # the job's config as a run's: its strategy sections as the strategy reads them (``narrow``),
        # where Hydra's own keeps the other strategies' keys, at their defaults
        mine, theirs = (_flat(yaml.safe_load(f[1][name])) for f in (ours, hydras))
        assert mine == {k: v for k, v in theirs.items() if k in mine}, name
        assert {k.split(".")[0] for k in theirs.keys() - mine.keys()} <= {"memory", "pipeline"}, name
    assert ours[2] == hydras[2] and ours[2][0] != ours[2][1]  # the seed swept: each job trained its own config
    job = yaml.safe_load(ours[1][Path("1/.hydra/hydra.yaml")])["hydra"]
    assert job["job"]["num"] == 1 and job["overrides"]["task"][-1] == "train.seed=4"
    assert job["mode"] == "MULTIRUN" and job["sweep"]["dir"] == "SWEEP"


@pytest.mark.slow
def test_a_sweep_through_submitits_launcher_runs_each_job_in_its_own_process(tmp_path):
    """Hydra's submitit launcher carries the sweep's config loader, with each job's checked
    config, to the job's own process, where it is unpickled before tgdist has registered its
    strategies: the section classes those configs hold (``AnyMemoryConfig``) are built there on
    demand, and both jobs train."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    r = tgdist("train", "--multirun", *QUICK, "train.seed=3,4", "hydra/launcher=submitit_local",
               f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    aps = [json.loads((sweep / n / "summary.json").read_text())["test_ap"] for n in "01"]
    assert all(0 < ap <= 1 for ap in aps) and aps[0] != aps[1]
    assert yaml.safe_load((sweep / "1" / ".hydra" / "overrides.yaml").read_text())[-1] == "train.seed=4"


def _flat(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``."""
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def test_a_refused_resume_leaves_the_run_as_it_was(tmp_path):
    """Checked before Hydra writes .hydra/ into the run directory, which is often the checkpoint's."""
    run = tmp_path / "r"
    assert tgdist("train", *QUICK, f"run_dir={run}", cwd=tmp_path).returncode == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    r = tgdist("train", *QUICK, "train.lr=0.01", "train.epochs=2", f"train.resume={run}", f"run_dir={run}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        (f"tgdist train: error: {run / 'checkpoints' / 'last.pt'}: checkpoint was written under another config "
         f"(train.lr: checkpoint 0.0001 vs now 0.01)")]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_removing_a_run_that_holds_no_result():
    """A resumed run stopped before its first checkpoint holds the metrics lines it copied from
    the checkpoint it resumed, and nothing else: it is removed like a fresh run's directory."""
    import tempfile

    from tgdist.cli import train
    from tgdist.runtime import rundir

    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        rundir.claim(run)  # made by this process's run: the only directory clean-up may remove
        (run / ".hydra").mkdir(parents=True)
        for name, text in (("config.yaml", "x"), ("train.log", "x"), ("metrics.jsonl", '{"epoch": 0}\n')):
            (run / name).write_text(text)
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "last.pt").write_bytes(b"x")
        train._remove_if_empty_run(run)
        assert run.exists()  # a checkpoint: kept
        (run / "checkpoints" / "last.pt").unlink()
        (run / "checkpoints").rmdir()
        train._remove_if_empty_run(run)
        assert not run.exists()


def test_a_plus_key_that_is_not_in_the_schema_is_a_typo(tmp_path):
    """Hydra adds ``+train.epoch=1`` silently, and the run trained the default 5 epochs."""
    r = tgdist("train", "+train.epoch=1", *QUICK, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        ("tgdist train: error: +train.epoch: not a key of tgdist's config (a leading + adds a key, and the config has "
         "every key it reads); did you mean 'train.epochs'?")]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("added, line", [
    ("+epochs=1", "+epochs: not a key of tgdist's config (a leading + adds a key, and the config has every key it "
                  "reads); did you mean 'train.epochs'?"),
    ("+foo=1", "+foo: not a key of tgdist's config (a leading + adds a key, and the config has every key it reads)")])
def test_a_plus_key_at_the_top_that_is_no_config_group_is_a_typo(added, line):
    """``+epochs=1`` was added silently at the top of the config (no group is called epochs) and the
    run trained the default 5 epochs; ``+group=option`` of a real group still selects it."""
    from tgdist.config.overrides import checked_compose, unknown_added_key
    from tgdist.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        checked_compose([added, *QUICK])
    assert str(e.value) == line
    assert unknown_added_key(["+experiment=mine", "+cache=freshgnn", "+hydra/launcher=basic"], "train") is None


@pytest.mark.parametrize("bad, message", [("sampler.strategy=recent,random",
                                           "sampler.strategy=random: choose one of recent, uniform"),
                                          ("data.format=auto,bogus", "data.format=bogus: choose one of auto, edgelist"),
                                          ("train.stop_after_batches=0", "train.stop_after_batches=0: give a positive")])
def test_settings_checked_before_a_sweep_starts(tmp_path, bad, message):
    r = tgdist("train", "--multirun", *QUICK, bad, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # job #0 did not run


@pytest.mark.parametrize("value", ["uni/\u00fc.txt", "a=b.txt", "~/x.txt"])
def test_a_value_hydra_cannot_read_unquoted_gets_the_quoted_form(tmp_path, value):
    r = tgdist("train", f"data.path={value}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        (f"tgdist train: error: cannot read the override 'data.path={value}': Hydra reads = ~ spaces, quotes and "
         f"non-ASCII letters in a value only inside quotes: \"data.path='{value}'\"")]


def test_help_lists_this_commands_groups(tmp_path):
    """Hydra's own listing would show the typed schemas (``data_schema``) and the partition
    command's group; the help shows the options a user can pick."""
    r = tgdist("train", "--help", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("tgdist train: train a memory-based temporal GNN")
    groups = {ln.split(":")[0]: ln.split(": ")[1].split(", ") for ln in
              r.stdout.split("== Configuration groups (GROUP=OPTION) ==\n")[1].split("\n\n")[0].splitlines()}
    assert groups == {"data": ["bitcoin_otc", "collegemsg", "enron", "file", "sfhh", "synthetic", "tgb", "wikipedia"],
                      "model": ["apan", "jodie", "tgat2", "tgn"], "train": ["default"],
                      "parallel": ["disttgl_2x1x2", "single"],
                      "memory": ["auto", "daemon", "depcache", "depcomm", "local", "sven"],
                      "pipeline": ["async_allreduce", "micro_batches", "mspipe", "none", "prefetch", "sven"],
                      "cache": ["freshgnn", "none"], "experiment": ["wikipedia_apan"]}
    assert "mem_dim: 100" in r.stdout and "_schema" not in r.stdout
    r = tgdist("partition", "--help", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("tgdist partition: pre-sample one training epoch")
    assert "\ndata: " in r.stdout and "\npartition: greedy, interval, range, reflexbicut\n" in r.stdout
    assert "\nmodel: " not in r.stdout and "_schema" not in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_help_documents_every_key(tmp_path):
    from tgdist.config.overrides import annotate, schema_keys
    from tgdist.config import PartitionJob, TrainApp, key_notes

    for schema in (TrainApp, PartitionJob):
        notes, keys = key_notes(schema), schema_keys(schema)
        groups = {k.rpartition(".")[0] for k in keys}
        assert [k for k in keys if k not in groups and k not in notes] == [], schema.__name__
    r = tgdist("train", "--help", "model=jodie", "train.epochs=2", cwd=tmp_path)
    assert r.returncode == 0
    assert "\n  epochs: 2  # passes over the training events; 0: evaluate" in r.stdout  # the overrides apply
    assert "\n  name: jodie  # tgn | jodie | apan, or a model registered" in r.stdout
    assert "\n  # torch intra-op threads; 0 = auto" in r.stdout and "\n  num_threads: 0\n" in r.stdout  # long: above
    assert r.stdout.rstrip().endswith("Hydra's own flags: tgdist train --hydra-help")
    r = tgdist("partition", "--help", cwd=tmp_path)
    assert r.returncode == 0 and "\n  num_parts: 8  # M, the trainers that share node memory\n" in r.stdout
    assert annotate("a:\n  b: 1\nb: 2", {"a.b": "x"}) == "a:\n  b: 1  # x\nb: 2"  # by path, not by name
    assert list(tmp_path.iterdir()) == []


def test_flags_with_bad_overrides_fail_with_one_line(tmp_path):
    for flags in (["--cfg", "job"], ["--help"]):
        r = tgdist("train", *flags, "model=gcn", cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.strip() == (
            "tgdist train: error: In 'train': Could not find 'model/gcn' (options: apan, jodie, tgat2, tgn)")
    r = tgdist("partition", "--help", "model=tgn", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        "tgdist partition: error: Could not override 'model'. No match in the defaults list")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # (the sweep's jobs, folders and summaries: test_a_sweep_composes_each_config_once, in-process)
def test_sweep_runs_one_job_per_value(tmp_path):
    sweep = tmp_path / "sweep"
    r = tgdist("train", "--multirun", "model=tgn,jodie", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summaries = [json.loads(ln) for ln in r.stdout.splitlines()]  # stdout: the summaries only
    assert [s["model"] for s in summaries] == ["tgn", "jodie"] and "Launching 2 jobs locally" in r.stderr
    assert [s["run_dir"] for s in summaries] == [str(sweep / "0"), str(sweep / "1")]
    assert (sweep / "1" / "summary.json").exists() and (sweep / "multirun.yaml").exists()


@pytest.mark.slow
def test_a_sweep_started_with_another_gets_its_own_folder(tmp_path):
    from datetime import datetime, timedelta

    now = datetime.now()
    taken = [tmp_path / "multirun" / f"{(now + timedelta(seconds=d)):%Y%m%d-%H%M%S}" for d in range(30)]
    for d in taken:
        d.mkdir(parents=True)
    r = tgdist("train", "-m", "train.seed=3", *QUICK, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    run_dir = Path(json.loads(r.stdout.strip().splitlines()[-1])["run_dir"])
    assert run_dir.name == "0" and run_dir.parent.name.endswith("-2") and run_dir.parent.with_name(
        run_dir.parent.name[:-2]) in taken
    assert all(not any(d.iterdir()) for d in taken)


def test_sweep_over_a_missing_data_file_fails_before_any_job(tmp_path):
    (tmp_path / "ok.csv").write_text("1,2,3\n2,3,4\n")
    r = tgdist("train", "-m", "data=file", f"data.path={tmp_path / 'ok.csv'},{tmp_path / 'nope.csv'}", *QUICK,
               cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        (f"tgdist train: error: {tmp_path / 'nope.csv'}: no such file or directory "
         f"(sweep job #1: data.path={tmp_path / 'nope.csv'})")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.csv"]


@pytest.mark.slow  # ~13 s
def test_bad_sweep_value_fails_before_any_job(tmp_path):
    """Every job is composed and validated before Hydra makes the sweep directory: a bad value in
    the last job fails in one line naming that job, and nothing ran or was written."""
    r = tgdist("train", "--multirun", "model.mem_dim=16,0", *QUICK[:1], *QUICK[2:], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "tgdist train: error: model.mem_dim=0: must be at least 1 (sweep job #1: model.mem_dim=0)"]
    r = tgdist("train", "-m", "model=tgn,gcn", *QUICK, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        ("tgdist train: error: In 'train': Could not find 'model/gcn' (options: apan, jodie, tgat2, tgn) "
         "(sweep job #1: model=gcn)")]
    r = tgdist("train", "-m", "model=tgn,jodie", "train.batchsize=3", cwd=tmp_path)  # not the swept key's fault
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        ("tgdist train: error: Could not override 'train.batchsize': Key 'batchsize' not in 'TrainConfig'; "
         "did you mean 'train.batch_size'?")]
    r = tgdist("train", "-m", "train.lr=interval(0.1,0.2)", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        ("tgdist train: error: train.lr=interval(0.1,0.2): Hydra's basic sweeper runs lists (a,b,c), range(...) "
         "and choice(...); interval(...) needs a sweeper plugin (e.g. pip install hydra-optuna-sweeper, then "
         "hydra/sweeper=optuna)")]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # ~20 s
def test_sweep_whose_first_job_fails_leaves_nothing_behind(tmp_path):
    """A failure only reading the data finds (the file is there, so the checks before the sweep pass)."""
    (tmp_path / "bad.csv").write_text("1,2,3\n2,3\n")
    (tmp_path / "other.csv").write_text("1,2,3\n")
    r = tgdist("train", "-m", "data.path=bad.csv,other.csv", *QUICK, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("tgdist train: error: bad.csv:2: expected 3 fields as on the first data line (1), "
                                                 "found 2 "
                                                 "(sweep job #0: data.path=bad.csv; the 1 job after it did not run)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv", "other.csv"]  # no multirun/<time>/multirun.yaml
    r = tgdist("train", "-m", "data.path=bad.csv,other.csv", *QUICK, f"hydra.sweep.dir={tmp_path / 'a' / 'b'}",
               cwd=tmp_path)
    assert r.returncode == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv", "other.csv"]
    # its default folder taken by a sweep of the same second: the NAME-2 it made goes too
    from datetime import datetime, timedelta

    now = datetime.now()
    taken = [tmp_path / "multirun" / f"{(now + timedelta(seconds=d)):%Y%m%d-%H%M%S}" for d in range(30)]
    for d in taken:
        d.mkdir(parents=True)
    r = tgdist("train", "-m", "data.path=bad.csv,other.csv", *QUICK, cwd=tmp_path)
    assert r.returncode == 2 and sorted((tmp_path / "multirun").iterdir()) == taken


def test_a_job_failing_mid_sweep_is_named_and_the_jobs_before_it_are_kept(tmp_path):
    (tmp_path / "good.csv").write_text("".join(f"{i % 7},{(3 * i + 1) % 7},{i}\n" for i in range(60)))
    (tmp_path / "bad.csv").write_text("1,2,3\n2,3\n")
    sweep = tmp_path / "sweep"
    r = tgdist("train", "-m", "data.path=good.csv,bad.csv,good.csv,good.csv", *QUICK, f"hydra.sweep.dir={sweep}",
               cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("tgdist train: error: bad.csv:2: expected 3 fields as on the first data line (1), "
                                                 "found 2 "
                                                 "(sweep job #1: data.path=bad.csv; the 2 jobs after it did not run)")
    assert len(r.stdout.splitlines()) == 1 and sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]


@pytest.mark.slow
def test_second_attention_layer_shows_in_the_run_name(tmp_path):
    r = tgdist("train", "model=tgat2", *QUICK, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["model"] == "tgn-2layer" and summary["run_dir"].endswith("-collegemsg-tgn-2layer")


def test_runs_started_in_one_second_get_their_own_directories(tmp_path):
    """The default run directory names the second a run starts; where that directory exists (a
    run started beside this one: ``for s in 0 1; do tgdist train train.seed=$s & done``), the run
    takes ``NAME-2``, never the other run's directory."""
    from datetime import datetime, timedelta

    now = datetime.now()
    taken = [tmp_path / "runs" / f"{(now + timedelta(seconds=d)):%Y%m%d-%H%M%S}-collegemsg-tgn" for d in range(30)]
    for d in taken:
        d.mkdir(parents=True)
    r = tgdist("train", *QUICK, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    run_dir = Path(json.loads(r.stdout.strip().splitlines()[-1])["run_dir"])
    assert run_dir.name.endswith("-collegemsg-tgn-2") and run_dir.with_name(run_dir.name[:-2]) in taken
    assert (run_dir / "metrics.jsonl").exists() and all(not any(d.iterdir()) for d in taken)


def test_claiming_a_run_directory_is_atomic_and_numbered(tmp_path):
    from tgdist.runtime.rundir import claim_directory

    base = tmp_path / "deep" / "run"
    assert [claim_directory(base) for _ in range(3)] == [base, tmp_path / "deep" / "run-2", tmp_path / "deep" / "run-3"]


def test_sweep_inside_a_parallel_job_is_refused(tmp_path):
    """Under torchrun every rank would run Hydra's sweep on its own; the launcher sweeps instead."""
    import os

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    r = subprocess.run([sys.executable, "-m", "tgdist.train", "-m", "parallel.i=2", "model=tgn,jodie"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        ("tgdist train: error: --multirun inside a parallel job runs the sweep in every rank; sweep with "
         "tgdist launch -- --multirun ... (one launch per job)")]
    assert list(tmp_path.iterdir()) == []


def test_misspelt_keys_get_a_suggestion():
    """In-process: the suggestions of ``closest_keys`` (the CLI tests above show them in messages)."""
    from tgdist.config.overrides import closest_keys

    assert closest_keys("train.epoch", "train") == ["train.epochs"]  # a sibling, spelt close
    assert closest_keys("data.synthetic.numevents", "train") == ["data.synthetic.num_events"]
    assert closest_keys("trian.epochs", "train") == ["train.epochs"]  # the parent misspelt
    assert closest_keys("epochs", "train") == ["train.epochs"]  # the group left out
    assert closest_keys("num_threads", "train") == ["sampler.num_threads", "train.num_threads", "memory.num_threads"]
    assert closest_keys("modle", "train") == ["model"]
    assert closest_keys("partition.out", "partition") == ["partition.out_dir"]
    assert closest_keys("train.zzzzz", "train") == [] and closest_keys("zzz", "train") == []
    assert closest_keys("partition.num_parts", "train") == []  # not a key of tgdist train


def test_unknown_key_without_a_close_spelling_lists_its_group(capsys):
    """No key spelt like ``sampler.num_neighbors``: the message lists the keys ``sampler`` has."""
    from tgdist.config.overrides import _compose_or_exit, keys_under
    from tgdist.runtime.build import load_strategies

    load_strategies()  # as the command does first (run alone, the strategies' config classes were missing)
    assert keys_under("sampler", "train") == ["strategy", "fanouts", "num_threads", "both_directions", "seed",
                                              "on_device"]
    assert keys_under("nosuchgroup", "train") == [] and keys_under("", "train") == []
    with pytest.raises(SystemExit) as exit_:
        _compose_or_exit("tgdist train", "train", ["sampler.num_neighbors=5"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "tgdist train: error: Could not override 'sampler.num_neighbors': Key 'num_neighbors' not in "
        "'SamplerConfig'; its keys are strategy, fanouts, num_threads, both_directions, seed, on_device\n")
    with pytest.raises(SystemExit):
        _compose_or_exit("tgdist train", "train", ["sampler.fanout=[5]"])  # a close spelling: named alone
    assert capsys.readouterr().err.endswith("did you mean 'sampler.fanouts'?\n")


def _user_configs(root: Path) -> Path:
    """A researcher's config folder: an experiment extending tgdist's config, one with a typo, one
    sweeping from the file, one choosing its own run directory, and a data option of its own."""
    conf = root / "myconf"
    (conf / "data").mkdir(parents=True)
    quick = "\n".join(f"  {k.split('.', 1)[1].replace('=', ': ')}" for k in QUICK if k.startswith("train."))
    (conf / "exp.yaml").write_text(f"defaults: [train, _self_]\ntrain:\n{quick}\n  lr: 0.001\n"
                                   "model: {mem_dim: 16, time_dim: 8}\ndata: {max_events: 1200}\n")
    (conf / "typo.yaml").write_text("defaults: [train, _self_]\ntrain:\n  epoch: 1\n")
    (conf / "sweep.yaml").write_text("defaults: [exp, _self_]\nhydra:\n  sweeper:\n    params:\n"
                                     "      train.batch_size: 100,-5\n")
    (conf / "elsewhere.yaml").write_text("defaults: [exp, _self_]\ntrain: {epochs: 0}\nhydra:\n  run:\n    dir: out/x\n")
    (conf / "data" / "mine.yaml").write_text("defaults: [data_schema]\nname: mine\npath: nope.csv\n")
    return conf


@pytest.mark.slow  # ~38 s
def test_a_users_config_directory_is_checked_like_the_default(tmp_path):
    """``--config-dir``/``--config-name`` used to skip every check before Hydra: a typo in the file
    was Hydra's multi-line report with exit 1, ``+train.epoch=1`` trained silently, a refused run
    left runs/ behind, and a resume went to a new directory after rewriting the old one's .hydra/."""
    _user_configs(tmp_path)
    flags = ["--config-dir", "myconf", "--config-name"]
    for args, message in (
            (["typo"], ("config file typo.yaml: train.epoch: Key 'epoch' not in 'TrainConfig'; did you mean "
                        "'train.epochs'?")),
            (["exp", "+train.epoch=1"], "+train.epoch: not a key of tgdist's config"),
            (["exp", "data=mine"], "nope.csv: no such file or directory"),
            (["exp", "-m", "train.batch_size=100,-5"], "train.batch_size=-5: give a positive number"),
            (["sweep", "-m"], ("train.batch_size=-5: give a positive number of events per batch (sweep job #1: "
                               "train.batch_size=-5)")),
            (["nope"], "Cannot find primary config 'nope'")):
        r = tgdist("train", *flags, *args, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (args, r.stderr)
        assert r.stderr.startswith(f"tgdist train: error: {message}"), (args, r.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["myconf"], args
    run = tmp_path / "runs" / "a"
    r = tgdist("train", *flags, "exp", f"run_dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "  lr: 0.001\n" in (run / "config.yaml").read_text()
    recorded = {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()}
    r = tgdist("train", *flags, "exp", f"train.resume={run}", "train.lr=0.5", cwd=tmp_path)
    assert r.returncode == 2 and "checkpoint was written under another config (train.lr" in r.stderr
    assert {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()} == recorded
    r = tgdist("train", *flags, "exp", f"train.resume={run}", "train.epochs=2", cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["run_dir"] == str(run)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["a"]


@pytest.mark.slow
def test_help_lists_the_group_options_of_a_users_config_directory(tmp_path):
    """``--help`` listed only the options under tgdist's configs/, not those a run could pick from
    the user's ``--config-dir``."""
    _user_configs(tmp_path)
    r = tgdist("train", "--config-dir", "myconf", "--config-name", "exp", "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "\ndata: bitcoin_otc, collegemsg, enron, file, mine, sfhh, synthetic, tgb, wikipedia\n" in r.stdout
    r = tgdist("train", "--help", cwd=tmp_path)
    assert "\ndata: bitcoin_otc, collegemsg, enron, file, sfhh, synthetic, tgb, wikipedia\n" in r.stdout


@pytest.mark.slow  # ~15 s
def test_a_config_files_run_directory_is_the_one_recorded(tmp_path):
    """A config setting ``hydra.run.dir`` runs there: no default directory is left claimed, and
    config.yaml (like a sweep job's) names the directory used, not the default name."""
    _user_configs(tmp_path)
    r = tgdist("train", "--config-dir", "myconf", "--config-name", "elsewhere", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["myconf", "out"]
    assert f"\nrun_dir: {tmp_path / 'out' / 'x'}\n" in (tmp_path / "out" / "x" / "config.yaml").read_text()
    r = tgdist("train", "-m", "train.epochs=0", *QUICK[:1], f"hydra.sweep.dir={tmp_path / 's'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"\nrun_dir: {tmp_path / 's' / '0'}\n" in (tmp_path / "s" / "0" / "config.yaml").read_text()


@pytest.mark.parametrize("args, message", [
    (["train.lr=${oc.env:TGDIST_UNSET_VARIABLE}"],
     "train.lr: cannot resolve its value: \"Environment variable 'TGDIST_UNSET_VARIABLE' not found\""),
    (["train.batch_size=${train.lr}"], "train.batch_size: cannot resolve its value: While dereferencing"),
    (["~parallel"], "~parallel: tgdist reads every key of its config, so none can be deleted"),
    (["~run_dir"], "~run_dir: tgdist reads every key of its config, so none can be deleted"),
    (["model=null"], "Config group override must be a string or a list"),
    (["--cfg", "job", "--resolve", "train.lr=${oc.env:TGDIST_UNSET_VARIABLE}"], "train.lr: cannot resolve"),
    (["-m", "model=tgn,jodie", "--cfg", "job"], "--multirun and --cfg do not go together"),
    (["-m", "model=tgn,jodie", "--info"], "--multirun and --info do not go together"),
    (["hydra.mode=MULTIRUN"], "hydra.mode=MULTIRUN: sweep with --multirun (-m)"),
    (["-m", "hydra/sweeper=optuna", "model=tgn,jodie"], "In 'hydra/config': Could not find 'hydra/sweeper/optuna'"),
    (["hydra/job_logging=disabled"], "hydra/job_logging=...: tgdist sets hydra.job_logging itself"),
    (["-sc", "install=bash"], "shell completion (-sc) is not supported"),
])
def test_config_errors_hydra_would_report_late_are_one_line(tmp_path, args, message):
    """Each was a Hydra traceback (exit 1), a run or sweep folder left behind, or silently ignored."""
    r = tgdist("train", *args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"tgdist train: error: {message}"), r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_basic_sweeper_chosen_by_name_is_still_checked(tmp_path):
    r = tgdist("train", "-m", "hydra/sweeper=basic", "train.batch_size=100,-5", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().endswith("(sweep job #1: train.batch_size=-5)")
    assert list(tmp_path.iterdir()) == []


def test_version_anywhere_is_tgdists(tmp_path):
    for args in (["--version", "model=jodie"], ["--config-dir", "x", "-V"]):
        r = tgdist("train", *args, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("tgdist "), r.stdout


@pytest.mark.slow  # ~22 s
def test_a_run_directory_in_use_is_refused(tmp_path):
    """Two runs given one run_dir (or a resume of a run still going) wrote one metrics.jsonl and
    removed each other's checkpoint temp files; a run now holds a lock on its directory."""
    import fcntl
    import os

    run = tmp_path / "r"
    assert tgdist("train", *QUICK, f"run_dir={run}", cwd=tmp_path).returncode == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    fd = os.open(run, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the run still going would hold it
        for args in ([f"run_dir={run}"], [f"train.resume={run}", "train.epochs=2"]):
            r = tgdist("train", *QUICK[:3], *QUICK[4:], *args, cwd=tmp_path)
            assert r.returncode == 2 and r.stderr.strip() == (
                f"tgdist train: error: run_dir={run} is in use by another tgdist run that has not ended; give "
                f"another run_dir, or resume it once that run has stopped"), r.stderr
    finally:
        os.close(fd)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    r = tgdist("train", *QUICK[:3], *QUICK[4:], f"train.resume={run}", "train.epochs=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_out_of_memory_is_one_line_and_leaves_nothing(tmp_path):
    """A memory dim typed with extra zeros: torch's allocator traceback (32 lines, exit 1), and the
    run directory was left behind holding train.log."""
    r = tgdist("train", *QUICK, "train.epochs=0", "model.mem_dim=300000", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        "tgdist train: error: out of memory (DefaultCPUAllocator: can't allocate memory: you tried to allocate"), r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.slow  # ~14 s
def test_names_too_long_for_the_file_system_are_one_line(tmp_path):
    """A run_dir or data file name over 255 bytes, or a default run name made too long by the
    data's name: OSError tracebacks from a bare exists() or mkdir()."""
    long = "x" * 300
    for args, message in (([f"run_dir={tmp_path / long}"], f"run_dir={tmp_path / long}: File name too long"),
                          ([f"data.path={tmp_path / long}.csv", "run_dir=r"], f"{tmp_path / long}.csv: File name too long"),
                          ([f"data.path={tmp_path / ('y' * 250)}.csv"], "cannot make the directory ")):
        if "y" * 250 in args[0]:
            (tmp_path / f"{'y' * 250}.csv").write_text("1,2,0\n2,3,1\n")
        r = tgdist("train", *QUICK, *args, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"tgdist train: error: {message}"), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{'y' * 250}.csv"]


@pytest.mark.slow
def test_closed_or_unwritable_standard_streams(tmp_path):
    """``2>&-`` failed every run (progress and log lines wrote to None); ``>/dev/full`` after a
    finished run was a traceback; ``NUMBA_NUM_THREADS=0`` stopped every command in numba's import."""
    import os

    run = tmp_path / "r"
    cmd = [sys.executable, "-m", "tgdist", "train", *QUICK, "train.epochs=0", f"run_dir={run}"]
    r = subprocess.run(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=300, check=False,
                       preexec_fn=lambda: os.close(2))
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["run_dir"] == str(run)
    with open("/dev/full", "w") as full:  # (the same run_dir again: train.overwrite=true replaces the first run)
        r = subprocess.run([*cmd, "train.overwrite=true"], cwd=tmp_path, stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=300, check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        f"tgdist train: error: cannot write the summary to stdout (No space left on device); it is in "
        f"{run}/summary.json")
    for module in (["tgdist", "train"], ["tgdist.train"]):
        r = subprocess.run([sys.executable, "-m", *module, *QUICK], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, check=False, env={**os.environ, "NUMBA_NUM_THREADS": "0"})
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "NUMBA_NUM_THREADS=0: numba needs a positive" in r.stderr


def test_a_full_file_system_is_one_line_before_hydra_writes(tmp_path, monkeypatch, capsys):
    """Hydra writes .hydra/ and train.log before the run starts: on a full disk these failed in
    a traceback, leaving half-written files."""
    import shutil
    from collections import namedtuple

    from tgdist.cli import train

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 12_288, 12_288))
    with pytest.raises(SystemExit) as stop:
        train._check_run_parent(tmp_path / "r")
    assert stop.value.code == 1 and capsys.readouterr().err == (
        f"tgdist train: error: run_dir={tmp_path / 'r'}: no space left on its file system (12 KiB free)\n")
    assert list(tmp_path.iterdir()) == []


def folder_hash(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the SHA-256 of its bytes."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_resume_refused_inside_the_run_leaves_the_folder_byte_identical(tmp_path):
    """The data file changed under its run: the settings match, so the command line's check lets
    the resume through and the run refuses it once it has read the data, after Hydra rewrote
    .hydra/ and config.yaml and appended to train.log. A refusal puts them back."""
    data = tmp_path / "events.csv"
    data.write_text("".join(f"{i % 7},{7 + i % 5},{i}\n" for i in range(400)))
    run = tmp_path / "r"
    common = [f"data.path={data}", "model.mem_dim=8", "model.time_dim=4", "train.batch_size=50",
              "train.num_neg_eval=2", "train.progress=false"]
    assert tgdist("train", *common, "train.epochs=1", f"run_dir={run}", cwd=tmp_path).returncode == 0
    data.write_text("".join(f"{i % 7},{7 + i % 5},{i}\n" for i in range(401)))  # one event more
    before = folder_hash(run)
    r = tgdist("train", *common, "train.epochs=2", f"train.resume={run}", cwd=tmp_path)
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]  # (the log lines before it are INFO)
    assert r.returncode == 2 and errors == [r.stderr.strip().splitlines()[-1]], r.stderr
    assert errors[0].startswith("tgdist train: error: ") and "checkpoint was trained on other data" in errors[0]
    assert folder_hash(run) == before


def test_a_claimed_folder_is_put_back_as_it_was(tmp_path):
    """``rundir.restore``: the earlier run's files byte for byte, logs cut back to their length,
    no .hydra/ file or run file the refused run added; nothing once a checkpoint was written."""
    from tgdist.runtime import rundir

    run = tmp_path / "run"
    rundir.claim(run)  # an earlier run's folder
    (run / ".hydra").mkdir()
    for name, text in (("config.yaml", "lr: 1\n"), (".hydra/config.yaml", "a\n"), ("train.log", "line\n" * 3),
                       ("metrics.jsonl", '{"epoch": 0}\n')):
        (run / name).write_text(text)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.pt").write_bytes(b"ckpt")
    rundir._claims.clear()  # this process's run starts: it claims the earlier run's folder
    before = folder_hash(run)
    rundir.claim(run)
    (run / "config.yaml").write_text("lr: 2\n")
    (run / ".hydra" / "config.yaml").write_text("b\n")
    (run / ".hydra" / "overrides.yaml").write_text("- x\n")
    with open(run / "train.log", "a") as f:
        f.write("refused\n")
    (run / "summary.json").write_text("{}")
    assert rundir.restore(run) and folder_hash(run) == before
    (run / "config.yaml").write_text("lr: 3\n")
    (run / "checkpoints" / "last.pt").write_bytes(b"a newer checkpoint")
    assert not rundir.restore(run) and (run / "config.yaml").read_text() == "lr: 3\n"
    rundir._claims.clear()
