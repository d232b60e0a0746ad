"""Real torchrun launches on this machine (gloo): world detection, validation, named groups."""

from __future__ import annotations

import pytest

from tgdist.distributed.schedule import Layout

from .helpers import expected_mean, free_port, read_ranks, run_all, torchrun_cmd

pytestmark = pytest.mark.distributed


def check_groups(records: list[dict], layout: Layout) -> None:
    assert sorted(r["world"]["rank"] for r in records) == list(range(layout.world_size))
    for r in records:
        rank = r["world"]["rank"]
        ii, jj, kk = layout.coords(rank)
        want = {
            "world": list(range(layout.world_size)),
            "memory": layout.memory_group_ranks(kk),
            "minibatch": layout.subgroup_ranks(jj, kk),
            "epoch": layout.epoch_peer_ranks(ii, kk),
        }
        leaders = [layout.memory_group_ranks(g)[0] for g in range(layout.k)]
        if rank in leaders:
            want["leaders"] = leaders
        for name, ranks in want.items():
            assert r["groups"][name] == [ranks, expected_mean(ranks)], (rank, name)
        if rank not in leaders:
            assert r["groups"]["leaders"] is None
        assert r["bytes"]["world"] == 4  # one float32 averaged


def test_torchrun_two_processes(tmp_path):
    port = free_port()
    (res,) = run_all([torchrun_cmd(2, port, "--layout", "2,1,1", "--groups", "--out", str(tmp_path))])
    res.check()
    records = read_ranks(tmp_path, 2)
    check_groups(records, Layout(2, 1, 1))
    for r in records:
        w = r["world"]
        assert (w["world_size"], w["local_world_size"], w["num_nodes"], w["launcher"]) == (2, 2, 1, "torchrun")
        assert w["local_rank"] == w["rank"]
    assert len({r["master"] for r in records}) == 1


def test_destroy_frees_every_group_and_names_one_kept_elsewhere(tmp_path):
    """Gloo's shutdown is a no-op, so a group lives (with its threads) until its last reference goes;
    one alive at interpreter exit can abort a finished rank. ``destroy`` frees ours and names the
    group a caller still holds."""
    (res,) = run_all([torchrun_cmd(2, free_port(), "--layout", "1,2,1", "--groups", "--hold", "memory",
                                   "--out", str(tmp_path))])
    res.check()
    records = read_ranks(tmp_path, 2, freed=False)
    assert [r["leaked"] for r in records] == [["memory"], ["memory"]]
    assert "process groups memory are still referenced after destroy" in res.stderr


@pytest.mark.slow
def test_torchrun_two_nodes_on_loopback(tmp_path):
    """Two torchrun agents (--nnodes 2, node ranks 0 and 1) meeting at one c10d endpoint, two
    processes each: a 2 x 1 x 2 layout, one memory group per "machine"."""
    port = free_port()
    cmds = [torchrun_cmd(2, port, "--layout", "2,1,2", "--groups", "--out", str(tmp_path), nnodes=2, node_rank=n)
            for n in (0, 1)]
    for res in run_all(cmds):
        res.check()
    records = read_ranks(tmp_path, 4)
    layout = Layout(2, 1, 2)
    check_groups(records, layout)
    for r in records:
        w = r["world"]
        assert (w["world_size"], w["local_world_size"], w["num_nodes"]) == (4, 2, 2)
        # torchrun numbers ranks node by node, so memory group kk lives on node kk
        assert w["node_rank"] == layout.coords(w["rank"])[2] and w["local_rank"] == w["rank"] % 2


@pytest.mark.slow
def test_torchrun_two_nodes_one_process_each(tmp_path):
    port = free_port()
    cmds = [torchrun_cmd(1, port, "--layout", "1,1,2", "--groups", "--out", str(tmp_path), nnodes=2, node_rank=n)
            for n in (0, 1)]
    for res in run_all(cmds):
        res.check()
    records = read_ranks(tmp_path, 2)
    check_groups(records, Layout(1, 1, 2))
    assert sorted((r["world"]["node_rank"], r["world"]["rank"]) for r in records) == [(0, 0), (1, 1)]


def test_torchrun_layout_mismatch_fails_before_training():
    port = free_port()
    (res,) = run_all([torchrun_cmd(2, port, "--layout", "2,1,2")])
    assert res.returncode != 0
    assert "parallel.i x parallel.j x parallel.k = 2 x 1 x 2 = 4 but the world has 2 processes" in res.stderr


# ---------------------------------------------------------------- restarts (issue 55, point 3)

SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.num_threads=1", "sampler.num_threads=1",
         "train.progress=false", "train.batch_size=100", "train.num_neg_eval=4", "train.lr=1e-3"]


def test_launch_passes_max_restarts_to_torchrun():
    from tgdist.errors import ConfigError
    from tgdist.launcher.launch import build_command

    cmd = build_command(2, ["parallel.i=2"], master_port=29999, max_restarts=3)
    assert cmd[cmd.index("--max-restarts") + 1] == "3"
    assert build_command(2, [], master_port=29999)[cmd.index("--max-restarts") + 1] == "0"
    with pytest.raises(ConfigError, match="--max-restarts -1: give 0 or more"):
        build_command(2, [], master_port=29999, max_restarts=-1)


def _write_run(path, iteration=None):
    """A run folder as an interrupted start leaves it: its marker, and ``last.pt`` at ``iteration``."""
    import torch

    from tgdist.runtime import checkpoint, rundir

    rundir.claim(path)
    (path / "metrics.jsonl").write_text("")
    if iteration is not None:
        checkpoint.atomic_save({"iteration": iteration, "model": {}, "format": checkpoint.FORMAT, "parts": []}, path / "checkpoints" / "last.pt")
    return path


def test_a_restart_resumes_from_the_folder_checkpoint_or_starts_afresh(tmp_path):
    from tgdist.runtime import rundir

    run = _write_run(tmp_path / "r", iteration=8)
    assert rundir.restarted(run, env={}) is None  # a first start
    r = rundir.restarted(run, env={"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_RUN_ID": "x"})
    assert (r.number, r.iteration, r.checkpoint) == (1, 8, run / "checkpoints" / "last.pt")
    assert r.line() == f"restart 1 (torchrun restart) resumed from {run / 'checkpoints' / 'last.pt'} at iteration 8"
    r = rundir.restarted(run, env={"SLURM_RESTART_COUNT": "2", "SLURM_JOB_ID": "7"})
    assert r.by == "SLURM requeue" and r.iteration == 8
    fresh = _write_run(tmp_path / "f")  # the earlier start left no checkpoint
    r = rundir.restarted(fresh, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert r.checkpoint is None and "holds no checkpoint yet, so the run starts afresh there" in r.line()
    assert rundir.restarted(tmp_path / "never", env={"TORCHELASTIC_RESTART_COUNT": "1"}) is None
    rundir.mark_requeue(run, 8)  # stopped by the preemption signal: a start by hand resumes too
    assert rundir.restarted(run, env={}).iteration == 8


def test_restarts_without_progress_stop_after_the_bound(tmp_path):
    from tgdist.errors import ConfigError
    from tgdist.runtime import rundir

    run = _write_run(tmp_path / "r", iteration=8)
    env = {"TORCHELASTIC_RUN_ID": "x"}
    for n in range(1, rundir.MAX_IDLE_RESTARTS + 1):  # each resumes from iteration 8 and fails before the next
        r = rundir.restarted(run, env={**env, "TORCHELASTIC_RESTART_COUNT": str(n)})
        rundir.check_restart_loop(r)
        rundir.record_restart(r)
        assert rundir.check_restart_loop(r) is None  # its own record is not held against it (the other ranks')
    r = rundir.restarted(run, env={**env, "TORCHELASTIC_RESTART_COUNT": "4"})
    with pytest.raises(ConfigError, match=r"restart 4 of the run in .* refused: the 3 restarts before it all resumed "
                                          r"from iteration 8 and ended before the next checkpoint"):
        rundir.check_restart_loop(r)
    from tgdist.runtime import checkpoint

    checkpoint.atomic_save({"iteration": 12, "model": {}, "format": checkpoint.FORMAT, "parts": []}, run / "checkpoints" / "last.pt")  # progress: allowed again
    rundir.check_restart_loop(rundir.restarted(run, env={**env, "TORCHELASTIC_RESTART_COUNT": "4"}))


def test_a_restart_loop_is_one_line_and_exit_2(tmp_path):
    """``tgdist train`` started as torchrun's fourth restart of a run whose three restarts all
    resumed from one checkpoint: one line, exit 2, nothing started."""
    import json
    import os
    import subprocess
    import sys

    from tgdist.runtime import rundir

    run = _write_run(tmp_path / "r", iteration=8)
    with open(run / rundir.RESTARTS, "a") as f:
        for n in (1, 2, 3):
            f.write(json.dumps({"key": f"x:TORCHELASTIC_RESTART_COUNT={n}", "iteration": 8}) + "\n")
    env = {**os.environ, "TORCHELASTIC_RESTART_COUNT": "4", "TORCHELASTIC_RUN_ID": "x"}
    res = subprocess.run([sys.executable, "-m", "tgdist.train", *SMALL, f"run_dir={run}"], capture_output=True,
                         text=True, env=env, timeout=120, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"tgdist train: error: restart 4 of the run in {run} refused: the 3 restarts before it all resumed from "
        f"iteration 8 and ended before the next checkpoint (a run that fails at once after each restart); train.log "
        f"says why, then continue by hand with train.resume={run}"]
    assert len((run / rundir.RESTARTS).read_text().splitlines()) == 3  # the refused one is not recorded


@pytest.mark.slow
def test_a_killed_rank_restarts_the_group_which_resumes_to_the_uninterrupted_results(tmp_path):
    """``tgdist launch --max-restarts 1``: rank 1 SIGKILLed at iteration 9; torchrun restarts both
    ranks, which resume from the last complete checkpoint on their own (iteration 8's, or 4's when
    the kill came while iteration 8's was still written in the background) and end with the results
    of an uninterrupted run; the log says which restart resumed from where."""
    import json
    import os
    import sys

    from .helpers import run_all

    common = [*SMALL, "parallel.k=2", "train.epochs=2", "train.checkpoint_every=4"]
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    launch = [sys.executable, "-m", "tgdist", "launch", "--nproc", "2"]
    [full] = run_all([[*launch, "--", *common, f"run_dir={tmp_path / 'full'}"]], timeout=300, env=env, cwd=tmp_path)
    full.check()
    [cut] = run_all([[*launch, "--max-restarts", "1", "--", *common, f"run_dir={tmp_path / 'cut'}"]], timeout=300,
                    env={**env, "TGDIST_FAULT_KILL": "1:9"}, cwd=tmp_path)
    cut.check()
    ckpt = tmp_path / "cut" / "checkpoints" / "last.pt"
    [at] = [json.loads(x)["iteration"] for x in (tmp_path / "cut" / ".tgdist-restarts").read_text().splitlines()]
    assert at in (4, 8) and f"restart 1 (torchrun restart) resumed from {ckpt} at iteration {at}" in cut.stderr, \
        cut.stderr[-3000:]
    expected, got = json.loads(full.stdout.strip().splitlines()[-1]), json.loads(cut.stdout.strip().splitlines()[-1])
    for key in ("loss", "traversed_events", "val_ap", "test_ap", "test_mrr"):
        assert got[key] == expected[key], key
    assert "TGDIST_FAULT_KILL" not in os.environ


@pytest.mark.slow
def test_the_signal_to_one_rank_stops_every_rank_after_the_same_iteration(tmp_path):
    """SIGUSR1 to rank 1 alone, mid-run: the ranks agree on it at the next iteration boundary, both
    stop after the same iteration, the checkpoint is there, ``tgdist launch`` exits 75; the same
    command run again resumes there on its own (the requeue marker) and finishes."""
    import json
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    from .helpers import kill_group

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tgdist", "launch", "--nproc", "2", "--", *SMALL, "parallel.k=2", "train.epochs=4",
           "parallel.link=1gbps:50ms", f"run_dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # (a loaded machine starts slowly)
        while not (run / "metrics.jsonl").is_file():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        [rank1] = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_rank(int(p), 1, str(run))]
        os.kill(rank1, signal.SIGUSR1)
        _, err = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    assert proc.returncode == 75, err[-3000:]
    stops = re.findall(r"tgdist train \[rank (\d)\]: stopped by SIGUSR1 \(preemption\) after iteration (\d+);", err)
    assert sorted(r for r, _ in stops) == ["0", "1"] and len({n for _, n in stops}) == 1, err[-3000:]
    from tgdist.runtime import checkpoint

    stopped_at = int(stops[0][1])
    assert checkpoint.read(run / "checkpoints" / "last.pt")["iteration"] == stopped_at
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'last.pt'} at iteration {stopped_at}" in again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["traversed_events"] > 0


def _is_rank(pid: int, rank: int, run_dir: str) -> bool:
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return f"RANK={rank}".encode() in env and b"tgdist.train" in args and f"run_dir={run_dir}".encode() in args


def test_launch_returns_75_when_the_ranks_checkpointed_on_the_forwarded_signal(tmp_path):
    """``tgdist launch`` sent SIGUSR1 passes it on; a torchrun whose ranks checkpointed on it exits
    75, which the launcher returns as it is (other signals give 128 + N)."""
    import os
    import signal
    import sys
    import threading
    import time

    from tgdist.launcher.launch import run_forwarding_signals

    ready = tmp_path / "ready"
    child = [sys.executable, "-c", "import pathlib, signal, sys, time\n"
             "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\n"
             f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(60)\nsys.exit(1)\n"]

    def send() -> None:
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=send, daemon=True).start()
    assert run_forwarding_signals(child) == 75


def test_a_restart_before_the_first_checkpoint_starts_afresh_in_the_folder(tmp_path):
    """The first start left its start-up files and metrics.jsonl but no checkpoint: started by hand
    the folder is refused (an interrupted run), started as a restart the run begins afresh there."""
    import os
    import subprocess
    import sys

    run = _write_run(tmp_path / "r")
    cmd = [sys.executable, "-m", "tgdist.train", *SMALL, "train.epochs=1", f"run_dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    by_hand = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert by_hand.returncode == 2 and "holds an interrupted tgdist run" in by_hand.stderr
    res = subprocess.run(cmd, capture_output=True, text=True, env={**env, "SLURM_RESTART_COUNT": "1"}, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"restart 1 (SLURM requeue): {run} holds no checkpoint yet, so the run starts afresh there" in res.stderr
    assert (run / "summary.json").is_file()
