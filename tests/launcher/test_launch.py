"""``tgdist launch``: the torchrun command it builds, its checks, a real launch, signal forwarding."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tgdist.cli import main as cli_main
from tgdist.errors import ConfigError
from tgdist.launcher import launch

from .helpers import REPO, free_port, kill_group, read_ranks, run


def test_build_command():
    cmd = launch.build_command(4, ["data=wikipedia", "parallel.i=2"], nnodes=2, node_rank=1,
                               master_addr="node01", master_port=29400, python="python")
    assert shlex.join(cmd) == (
        "python -m torch.distributed.run --nproc-per-node 4 --nnodes 2 --rdzv-backend c10d "
        "--rdzv-endpoint node01:29400 --rdzv-id tgdist --max-restarts 0 -m tgdist.train data=wikipedia parallel.i=2")
    with pytest.raises(ConfigError, match="node-rank 2"):
        launch.build_command(2, [], nnodes=2, node_rank=2)
    with pytest.raises(ConfigError, match="not a TCP port"):
        launch.build_command(2, [], master_port=70000)


def test_parallel_overrides():
    assert launch.parallel_overrides(["parallel.i=2", "+parallel.k=3", "model=jodie", "parallel.jx=1"]) == {"i": 2, "k": 3}
    with pytest.raises(ConfigError, match="parallel.j must be an integer"):
        launch.parallel_overrides(["parallel.j=two"])


def test_dry_run(capsys):
    rc = cli_main(["launch", "--nproc", "2", "--master-port", "29999", "--dry-run", "--", "model=jodie", "parallel.i=2"])
    out = capsys.readouterr().out.strip()
    assert rc == 0
    assert out.endswith("--nproc-per-node 2 --nnodes 1 --rdzv-backend c10d --rdzv-endpoint "
                        "127.0.0.1:29999 --rdzv-id tgdist --max-restarts 0 -m tgdist.train model=jodie parallel.i=2")
    # --nproc derived from parallel.i x j x k over the nodes
    rc = cli_main(["launch", "--nnodes", "2", "--dry-run", "--", "parallel.i=2", "parallel.k=2", "train.epochs=2"])
    cap = capsys.readouterr()
    assert rc == 0 and "--nproc-per-node 2 --nnodes 2" in cap.out and "127.0.0.1:29500" in cap.out
    assert cap.err == ("tgdist launch: warning: --nnodes 2 without --master-addr: the rendezvous is on 127.0.0.1, "
                       "which only processes on this machine can reach; give node 0's host name\n")
    rc = cli_main(["launch", "--nnodes", "2", "--master-addr", "node01", "--dry-run", "--", "parallel.i=2",
                   "parallel.k=2", "train.epochs=2"])
    cap = capsys.readouterr()
    assert rc == 0 and "node01:29500" in cap.out and cap.err == ""


@pytest.mark.parametrize("args, message", [
    (["--nproc", "0"], "--nproc 0: give at least 1 process"),
    (["--nnodes", "0"], "--nnodes 0: give at least 1 machine"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], r"--node-rank 2: give 0 .. 1 \(--nnodes 2\)"),
    (["--node-rank", "-1"], r"--node-rank -1: give 0 .. 0 \(--nnodes 1\)"),
    (["--master-port", "70000"], "--master-port 70000 is not a TCP port"),
])
def test_launcher_arguments_are_named_alone(capsys, args, message):
    assert cli_main(["launch", *args, "--dry-run", "--", "parallel.i=2"]) == 2
    assert re.fullmatch(f"tgdist launch: error: {message}\n", capsys.readouterr().err)


def test_epochs_not_a_multiple_of_j_times_k_refused_before_start(capsys):
    """Once, by the launcher; before, every rank failed with it after torchrun started them."""
    assert cli_main(["launch", "--dry-run", "--", "parallel.k=2", "train.epochs=3"]) == 2
    assert capsys.readouterr().err == (
        "tgdist launch: error: train.epochs = 3 is not a multiple of parallel.j x parallel.k = 1 x 2 = 2 (each "
        "memory group makes epochs / (j*k) passes so the total traversals equal the single-process run); use "
        "train.epochs=2 or 4\n")


def test_layout_checked_before_start(capsys):
    rc = cli_main(["launch", "--nproc", "3", "--dry-run", "--", "parallel.i=2", "parallel.k=2", "train.epochs=2"])
    err = capsys.readouterr().err
    assert rc == 2 and err == ("tgdist launch: error: parallel.i x parallel.j x parallel.k = 2 x 1 x 2 = 4 but "
                               "--nproc 3 x --nnodes 1 starts 3 processes\n")
    assert cli_main(["launch", "--dry-run", "--", "model=jodie"]) == 2
    assert "give --nproc N" in capsys.readouterr().err


def test_training_settings_checked_before_start(capsys):
    """One line from the launcher, instead of one per rank and torchrun's failure report."""
    rc = cli_main(["launch", "--nproc", "2", "--", "parallel.i=2", "model.mem_dim=0"])
    assert rc == 2 and capsys.readouterr().err == "tgdist launch: error: model.mem_dim=0: must be at least 1\n"
    with pytest.raises(SystemExit) as e:  # a misspelt key: the same one-line message as tgdist train
        cli_main(["launch", "--nproc", "2", "--", "parallel.i=2", "model.mem_di=4"])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("tgdist launch: error: Could not override 'model.mem_di': "
                                       "Key 'mem_di' not in 'ModelConfig'; did you mean 'model.mem_dim'?\n")


@pytest.mark.parametrize("launcher, overrides, message", [
    ([], ["memory.backend=local", "parallel.j=2", "train.epochs=2"],
     "memory.backend=local keeps node memory inside one process"),
    (["--nnodes", "2", "--master-addr", "h0", "--nproc", "1"], ["parallel.i=2", "memory.backend=daemon", "train.epochs=2"],
     "parallel.k = 1 memory copies for 2 machines"),
    ([], ["parallel.k=4", "train.batch_size=20000", "train.epochs=4"],
     "3 global batches cannot be cut into parallel.k = 4 memory segments"),
])
def test_the_layout_against_the_world_is_checked_before_start(capsys, launcher, overrides, message):
    """Each rank checked it after start-up and printed it, one line per rank."""
    rc = cli_main(["launch", *launcher, "--dry-run", "--", *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("tgdist launch: error: ") and message in err and err.count("\n") == 1, err
    swept = [*overrides, "train.seed=0,1"]
    with pytest.raises(SystemExit) as e:  # a sweep's jobs too, before the first
        cli_main(["launch", *launcher, "--dry-run", "--", "-m", *swept])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_parallel_sizes_from_an_interpolation_are_resolved(capsys, monkeypatch):
    """``tgdist train`` resolves ``parallel.i=${oc.env:NI}``; the launcher refused it as no integer."""
    monkeypatch.setenv("NI", "2")
    assert cli_main(["launch", "--dry-run", "--", "parallel.i=${oc.env:NI}", "train.epochs=1"]) == 0
    assert "--nproc-per-node 2 " in capsys.readouterr().out


def test_a_bad_flag_after_the_separator_is_one_usage_message(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["launch", "--dry-run", "--", "parallel.i=2", "--bogus"])
    assert e.value.code == 2 and capsys.readouterr().err.count("unrecognized arguments: --bogus") == 1


def test_a_master_port_in_use_is_one_line_before_start(capsys):
    """torchrun waited for the port silently, then failed with a 70-line traceback."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rc = cli_main(["launch", "--nproc", "2", "--master-port", str(port), "--", "parallel.i=2", "train.epochs=1"])
        err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"tgdist launch: error: --master-port {port} is in use on 127.0.0.1 (")
    assert err.count("\n") == 1 and "leave --master-port out" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets")
def test_a_master_port_another_launch_is_about_to_use_is_refused(tmp_path):
    """A port is checked free, then bound by torchrun a second later: a second launch given the
    same port in that gap joined the first's rendezvous, waited for it to end and failed with a
    95-line traceback. Launches reserve their port (here this process holds the reservation)."""
    port = free_port()
    assert launch._reserve(port) and launch._reserve(port)  # a launcher's own reservation holds
    try:
        res = run([sys.executable, "-m", "tgdist", "launch", "--nproc", "2", "--master-port", str(port), "--",
                   "parallel.i=2", "train.epochs=1"], cwd=tmp_path)
        assert res.returncode == 2 and res.stderr.strip() == (
            f"tgdist launch: error: --master-port {port} is in use by another tgdist launch on this machine: leave "
            f"--master-port out (a free port is picked) or name another")
    finally:
        launch._reserved.pop(port).close()
    assert list(tmp_path.iterdir()) == []


def test_missing_data_file_checked_before_start(capsys, tmp_path):
    """One line from the launcher, not one per rank and torchrun's report; in a sweep, naming the job."""
    missing = tmp_path / "nope.csv"
    rc = cli_main(["launch", "--nproc", "2", "--", "parallel.i=2", "data=file", f"data.path={missing}"])
    assert rc == 2 and capsys.readouterr().err == f"tgdist launch: error: {missing}: no such file or directory\n"
    (tmp_path / "ok.csv").write_text("1,2,3\n")
    with pytest.raises(SystemExit) as e:
        cli_main(["launch", "--dry-run", "--", "-m", "parallel.i=2", "data=file", f"data.path={tmp_path / 'ok.csv'},{missing}"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"tgdist launch: error: {missing}: no such file or directory "
                                       f"(sweep job #1: data.path={missing})\n")


def test_sweep_dry_run_is_one_torchrun_per_job(capsys):
    """``--multirun``: Hydra's sweep syntax, one launch per job, each with its own process count and
    run directory."""
    rc = cli_main(["launch", "--dry-run", "--", "-m", "parallel.i=1,2", "model=tgn,jodie", "run_dir=sw"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 4
    tails = [ln.split(" -m tgdist.train ")[1] for ln in lines]
    assert tails == ["parallel.i=1 model=tgn run_dir=sw/0", "parallel.i=1 model=jodie run_dir=sw/1",
                     "parallel.i=2 model=tgn run_dir=sw/2", "parallel.i=2 model=jodie run_dir=sw/3"]
    assert [ln.split("--nproc-per-node ")[1].split()[0] for ln in lines] == ["1", "1", "2", "2"]
    rc = cli_main(["launch", "--dry-run", "--", "--multirun", "parallel.k=1,2", "train.epochs=2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and [ln.split("run_dir=")[1].split("/")[0] for ln in lines] == ["multirun"] * 2
    assert [ln.rsplit("/", 1)[1] for ln in lines] == ["0", "1"]


def test_sweep_folder_is_its_own_and_goes_when_nothing_ran(tmp_path, monkeypatch, capsys):
    """A launcher sweep started in the same second as another takes ``multirun/<time>-2``; a sweep
    whose first job fails leaves no empty folders behind."""
    from datetime import datetime, timedelta

    monkeypatch.chdir(tmp_path)
    launched = []
    monkeypatch.setattr(launch, "_launch", lambda args, job, nproc=None: launched.append(job) or 0)
    now = datetime.now()
    taken = [tmp_path / "multirun" / f"{(now + timedelta(seconds=d)):%Y%m%d-%H%M%S}" for d in range(30)]
    for d in taken:
        d.mkdir(parents=True)
    assert cli_main(["launch", "--", "-m", "model=tgn,jodie", "parallel.i=1"]) == 0
    dirs = [job[-1].removeprefix("run_dir=") for job in launched]
    assert [d.rsplit("/", 1)[1] for d in dirs] == ["0", "1"] and len({d.rsplit("/", 1)[0] for d in dirs}) == 1
    sweep = tmp_path / dirs[0].rsplit("/", 1)[0]
    assert sweep.name.endswith("-2") and sweep.with_name(sweep.name[:-2]) in taken and sweep.is_dir()
    record = json.loads((sweep / "sweep.json").read_text())  # the jobs, for tgdist report
    assert [(p["num"], p["swept"], p["layout"]) for p in record["points"]] == [(0, "model=tgn", [1, 1, 1]),
                                                                              (1, "model=jodie", [1, 1, 1])]
    assert record["points"][1]["overrides"] == launched[1]

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    monkeypatch.chdir(fresh)
    monkeypatch.setattr(launch, "_launch", lambda args, job, nproc=None: 3)
    assert cli_main(["launch", "--", "-m", "model=tgn,jodie", "parallel.i=1"]) == 3
    assert "sweep stopped: job #0 exited with 3" in capsys.readouterr().err and list(fresh.iterdir()) == []


def test_sweep_checked_before_any_job(capsys):
    with pytest.raises(SystemExit) as e:  # the settings of every job, as tgdist train --multirun checks them
        cli_main(["launch", "--dry-run", "--", "-m", "parallel.i=1,0"])
    assert e.value.code == 2 and capsys.readouterr() == (
        "", "tgdist launch: error: parallel.i must be a positive integer, got 0 (sweep job #1: parallel.i=0)\n")
    with pytest.raises(SystemExit) as e:  # the process count of every job too
        cli_main(["launch", "--nproc", "2", "--dry-run", "--", "-m", "parallel.i=2,1"])
    assert e.value.code == 2 and capsys.readouterr() == (
        "", ("tgdist launch: error: parallel.i x parallel.j x parallel.k = 1 x 1 x 1 = 1 but --nproc 2 x --nnodes 1 "
             "starts 2 processes (sweep job #1: parallel.i=1)\n"))
    with pytest.raises(SystemExit) as e:
        cli_main(["launch", "--dry-run", "--", "-m", "parallel.i=1,2", "model=tgn,gcn"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "tgdist launch: error: In 'train': Could not find 'model/gcn' (options: apan, jodie, tgat2, tgn) "
        "(sweep job #1: parallel.i=1 model=gcn)\n")


@pytest.mark.distributed
@pytest.mark.slow  # ~33 s
def test_real_sweep(tmp_path):
    res = run([sys.executable, "-m", "tgdist", "launch", "--", "-m", "parallel.i=1,2", "data.max_events=1200",
               "model.mem_dim=16", "model.time_dim=8", "train.epochs=1", "train.batch_size=100", "train.num_neg_eval=4",
               "train.progress=false", f"run_dir={tmp_path / 'sweep'}"])
    res.check()
    summaries = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert [s["run_dir"] for s in summaries] == [str(tmp_path / "sweep" / "0"), str(tmp_path / "sweep" / "1")]
    assert summaries[0]["parallel"] == "1 x 1 x 1" and summaries[1]["parallel"] == "2 x 1 x 1"  # one summary writer
    assert "tgdist launch: sweep job #1 of 2: parallel.i=2" in res.stderr
    cpus = len(os.sched_getaffinity(0))  # one process uses them all; two unbound ranks split them
    share = max(1, cpus // 2)
    assert f"threads: {cpus} torch, {cpus} numba" in res.stderr
    assert f"threads: {share} torch, {share} numba" in res.stderr.split("sweep job #1 of 2")[1]


@pytest.mark.distributed
@pytest.mark.slow  # ~17 s
def test_a_failing_sweep_job_stops_the_sweep(tmp_path):
    """The file is there, so the checks before the sweep pass; reading it fails in job #0."""
    (tmp_path / "bad.csv").write_text("1,2,3\n2,3\n")
    res = run([sys.executable, "-m", "tgdist", "launch", "--nproc", "1", "--", "-m",
               f"data.path={tmp_path / 'bad.csv'}", "model.mem_dim=16,32", "train.progress=false",
               f"run_dir={tmp_path / 'sweep'}"])
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "tgdist launch: sweep stopped: job #0 exited with 2; the 1 job after it did not run")
    assert "sweep job #1 of 2" not in res.stderr and not (tmp_path / "sweep" / "1").exists()


@pytest.mark.distributed
def test_a_launch_claims_its_default_run_directory(tmp_path, monkeypatch):
    """Two launches started in the same second wrote into one run directory, the later one's
    results replacing the other's without a word: the launcher now claims the default name
    (taking NAME-2 where it is made) and hands it to the ranks; left empty, it is removed."""
    from datetime import datetime, timedelta

    monkeypatch.chdir(tmp_path)
    launched = []
    monkeypatch.setattr(launch, "_launch", lambda args, job, nproc=None: launched.append(job) or 0)
    now = datetime.now()
    taken = [tmp_path / "runs" / f"{(now + timedelta(seconds=d)):%Y%m%d-%H%M%S}-collegemsg-tgn" for d in range(30)]
    for d in taken:
        d.mkdir(parents=True)
    assert cli_main(["launch", "--nproc", "2", "--", "parallel.i=2"]) == 0
    key, _, value = launched[0][-1].partition("=")
    run_dir = Path(value.strip("'"))
    assert key == "run_dir" and run_dir.name.endswith("-2") and run_dir.with_name(run_dir.name[:-2]) in taken
    assert not run_dir.exists()  # nothing was written into it (the launch was not real)
    for given in (["run_dir=mine"], ["--dry-run"]):  # a named directory, a dry run: nothing claimed
        launched.clear()
        flags, overrides = (given, []) if given[0].startswith("-") else ([], given)
        assert cli_main(["launch", "--nproc", "2", *flags, "--", "parallel.i=2", *overrides]) == 0
        assert not any(a.startswith("run_dir=") for a in launched[0] if a not in overrides) if launched else True
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(d.name for d in taken)


def test_real_launch(tmp_path):
    res = run([sys.executable, "-m", "tgdist", "launch", "--nproc", "2", "--module", "tests.launcher.probe", "--",
               "--layout", "2,1,1", "--groups", "--out", str(tmp_path)])
    res.check()
    records = read_ranks(tmp_path, 2)
    assert [r["groups"]["world"] for r in records] == [[[0, 1], 0.5]] * 2
    assert all(r["world"]["launcher"] == "torchrun" for r in records)
    assert "tgdist launch: " in res.stderr and "torch.distributed.run" in res.stderr


@pytest.mark.distributed
def test_exit_code_is_forwarded(tmp_path):
    res = run([sys.executable, "-m", "tgdist", "launch", "--nproc", "1", "--module", "tests.launcher.probe", "--",
               "--layout", "2,1,1"])
    assert res.returncode == 1  # the probe's exit code (an uncaught ConfigError), not torchrun's
    assert "parallel.i x parallel.j x parallel.k = 2 x 1 x 1 = 2 but the world has 1 process" in res.stderr
    assert res.stderr.splitlines()[-1] == "tgdist launch: rank 0 exited with 1 (its error is above)"
    assert "ChildFailedError" not in res.stderr and "Root Cause" not in res.stderr  # torchrun's own report


@pytest.mark.distributed
def test_a_rank_error_ends_in_one_launcher_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 x\n2 3 4\n")
    res = run([sys.executable, "-m", "tgdist", "launch", "--nproc", "2", "--", "parallel.i=2", f"data.path={bad}",
               "train.progress=false", f"run_dir={tmp_path / 'run'}"])
    assert res.returncode == 2, res.stderr  # the ranks' DataError exit code
    lines = res.stderr.strip().splitlines()
    assert sum("non-numeric field 'x'" in ln for ln in lines) == 2  # each rank's own one-line error
    assert sorted(ln.split(":")[0] for ln in lines if "non-numeric" in ln) == [
        "tgdist train [rank 0]", "tgdist train [rank 1]"]
    assert lines[-1].startswith("tgdist launch: rank ") and "exited with 2 (its error is above)" in lines[-1]
    assert not any("Traceback" in ln or "OMP_NUM_THREADS" in ln or "closing signal" in ln for ln in lines), lines
    assert len(lines) == 4, lines  # the command, two rank errors, the report


def test_nproc_is_checked_against_the_default_layout(capsys):
    assert cli_main(["launch", "--nproc", "2", "--dry-run", "--", "train.epochs=1"]) == 2
    assert capsys.readouterr().err == ("tgdist launch: error: parallel.i x parallel.j x parallel.k = 1 x 1 x 1 = 1 "
                                       "but --nproc 2 x --nnodes 1 starts 2 processes\n")


@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_is_forwarded_and_nothing_is_left(tmp_path, sig):
    proc = subprocess.Popen([sys.executable, "-m", "tgdist", "launch", "--nproc", "2", "--master-port", str(free_port()),
                             "--module", "tests.launcher.probe", "--", "--sleep", "120", "--out", str(tmp_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("rank*.ready"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        workers = [int(f.read_text()) for f in sorted(tmp_path.glob("rank*.ready"))]
        assert len(workers) == 2, proc.communicate(timeout=30)
        proc.send_signal(sig)  # only the launcher (Ctrl-C reaches only its group): it must pass it on
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err
        how = " as SIGINT" if sig == signal.SIGTERM else ""
        assert err.strip().splitlines()[-1] == f"tgdist launch: stopped by {sig.name}, forwarded to torchrun{how}"
        assert "SignalException" not in err and "death signal" not in err, err  # torchrun's traceback, warning
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers), err
    finally:
        kill_group(proc)


@pytest.mark.distributed
@pytest.mark.slow  # ~19 s; the forwarded SIGINT and SIGTERM stay in the default run
def test_sigterm_to_the_launcher_stops_the_ranks_as_ctrl_c_does(tmp_path):
    """``kill LAUNCHER``: the ranks got torchrun's SIGTERM and died without a word, leaving their
    run directory; as SIGINT they print their lines and remove a directory with no checkpoint."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "tgdist", "launch", "--nproc", "2", "--master-port", str(free_port()),
                             "--", "parallel.i=2", "train.epochs=50", "train.progress=false", f"run_dir={run_dir}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        log, deadline = run_dir / "train.log", time.monotonic() + 120

        def started() -> bool:  # the log's versions-and-threads line: the run has begun
            return log.exists() and "threads:" in log.read_text()

        while not started() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert started(), proc.communicate(timeout=30)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        lines = err.strip().splitlines()
        assert proc.returncode == 143, err
        assert lines[-1] == "tgdist launch: stopped by SIGTERM, forwarded to torchrun as SIGINT"
        assert sorted(ln for ln in lines if ": interrupted" in ln) == [
            f"tgdist train [rank {r}]: interrupted; no checkpoint had been written" for r in (0, 1)], err
        assert not run_dir.exists() and "Traceback" not in err
    finally:
        kill_group(proc)


def _processes_with(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text in (d / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_stop_when_the_torchrun_agent_is_killed(tmp_path):
    """The ranks run in sessions of their own: with the agent SIGKILLed they trained on alone and
    ended in a broken-pipe crash. They now stop with it, and the launcher says what happened."""
    data = tmp_path / "d.npz"
    from tgdist.data.readers.native import save_native
    from tgdist.data.synthetic import generate

    save_native(generate(3000, 200), data)
    run_dir = tmp_path / "agent-killed"
    proc = subprocess.Popen([sys.executable, "-m", "tgdist", "launch", "--", f"data.path={data}", "parallel.i=2",
                             "train.batch_size=50", "train.epochs=200", "train.progress=false", f"run_dir={run_dir}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "train.log").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(3)
        ranks = [p for p in _processes_with(str(run_dir)) if p != proc.pid]
        agent = [p for p in ranks if "tgdist.launcher.torchrun" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(agent) == 1 and len(ranks) == 3, ranks
        os.kill(agent[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 137 and err.strip().splitlines()[-1] == (
            "tgdist launch: torchrun was killed by SIGKILL; its ranks stop with it"), err
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks)
    finally:
        kill_group(proc)
        for p in _processes_with(str(run_dir)):
            os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sweep_runs_jobs_side_by_side_with_max_parallel(tmp_path):
    """``--max-parallel 2``: both jobs start at once, their lines prefixed with the job number; the
    job whose data does not read fails, the other ends and keeps its result."""
    from tgdist.kernels.graph import cpu_mask

    if len(cpu_mask()) < 2:
        pytest.skip("two jobs side by side need two CPUs")
    (tmp_path / "bad.csv").write_text("1,2,3\n2,3\n")
    (tmp_path / "good.csv").write_text("".join(f"{i % 40},{40 + i % 23},{i}\n" for i in range(600)))
    res = run([sys.executable, "-m", "tgdist", "launch", "--max-parallel", "2", "--nproc", "1", "--", "-m",
               f"data.path={tmp_path / 'bad.csv'},{tmp_path / 'good.csv'}", "model.mem_dim=16", "model.time_dim=8",
               "train.epochs=1", "train.batch_size=100", "train.num_neg_eval=4", "train.progress=false",
               f"run_dir={tmp_path / 'sweep'}"])
    assert res.returncode == 2, res.stderr
    err = res.stderr.splitlines()
    started = [n for n, ln in enumerate(err) if ln.startswith("tgdist launch: sweep job #")]
    first_output = min(n for n, ln in enumerate(err) if ln.startswith("[#0] ") or ln.startswith("[#1] "))
    assert len(started) == 2 and started[1] < first_output  # the second started before the first said anything
    assert any(ln.startswith("[#0] tgdist train: error: ") for ln in err), res.stderr
    assert err[-1] == "tgdist launch: sweep stopped: job #0 exited with 2"
    summary = json.loads((tmp_path / "sweep" / "1" / "summary.json").read_text())
    assert res.stdout.strip().splitlines()[-1].startswith("[#1] {") and summary["test_ap"] > 0
    assert not (tmp_path / "sweep" / "0").exists()
    pinned = [ln for ln in err if "threads: 1 torch, 1 numba" in ln]  # each job on a CPU of its own
    assert any(ln.startswith("[#1] ") for ln in pinned), res.stderr


def test_max_parallel_is_checked(capsys):
    assert cli_main(["launch", "--max-parallel", "0", "--", "-m", "parallel.i=1,2"]) == 2
    assert capsys.readouterr().err == "tgdist launch: error: --max-parallel 0: give at least 1\n"
    assert cli_main(["launch", "--max-parallel", "2", "--nnodes", "2", "--master-addr", "h0", "--", "-m",
                     "parallel.k=2,4"]) == 2
    assert "--max-parallel runs a sweep's jobs side by side on this machine" in capsys.readouterr().err
