"""SLURM launches on the local one-node test cluster: srun, and the two sbatch templates."""

from __future__ import annotations

import socket
import sys

import pytest

from tgdist.distributed.schedule import Layout
from tgdist.distributed.world import slurm_port

from .helpers import PROBE, REPO, expected_mean, read_ranks

pytestmark = pytest.mark.distributed


def check_slurm_world(records, n):
    for r, rec in enumerate(records):
        w = rec["world"]
        assert (w["rank"], w["world_size"], w["local_rank"], w["local_world_size"]) == (r, n, r, n)
        assert (w["node_rank"], w["num_nodes"], w["launcher"]) == (0, 1, "slurm")
    assert len({(rec["world"]["master_addr"], rec["world"]["master_port"]) for rec in records}) == 1


def test_srun_two_tasks(slurm_cluster, tmp_path):
    res = slurm_cluster.cmd(["srun", "-n", "2", "--time=2", sys.executable, str(PROBE), "--out", str(tmp_path)])
    assert res.returncode == 0, res.stderr + slurm_cluster.logs()
    records = read_ranks(tmp_path, 2)
    check_slurm_world(records, 2)
    assert records[0]["world"]["master_addr"] == slurm_cluster.node  # first host of the node list


def test_sbatch_srun_direct_template(slurm_cluster, tmp_path):
    """slurm/srun_direct.sbatch with a 2-task job: ranks from SLURM_* variables, then real gloo
    groups through the rendezvous on the first node of the step. (A time limit above the
    template's 120 s of notice: at 2 minutes SLURM's preemption signal came at once.)"""
    out = tmp_path / "ranks"
    out.mkdir()
    env_entry = f"TGDIST_ENTRY={PROBE}"
    try:  # the master address is the node list's first host: it must resolve to reach rank 0
        socket.gethostbyname(slurm_cluster.node)
    except OSError:
        env_entry += ",MASTER_ADDR=127.0.0.1"
    res = slurm_cluster.cmd(
        ["sbatch", "--wait", "--parsable", "-n", "2", "--time=5", f"--output={tmp_path}/job.out",
         f"--export=ALL,PYTHON={sys.executable},{env_entry}", str(REPO / "slurm" / "srun_direct.sbatch"),
         "--out", str(out), "--layout", "1,1,2", "--groups"])
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + log + slurm_cluster.logs()
    job_id = res.stdout.strip().split(";")[0]
    records = read_ranks(out, 2)
    check_slurm_world(records, 2)
    assert {r["world"]["master_port"] for r in records} == {slurm_port(job_id, "0")}
    layout = Layout(1, 1, 2)
    for r in records:
        rank = r["world"]["rank"]
        assert r["groups"]["world"] == [[0, 1], 0.5]
        assert r["groups"]["memory"] == [[rank], float(rank)]
        assert r["groups"]["leaders"] == [[0, 1], expected_mean([0, 1])] and layout.coords(rank) == (0, 0, rank)
    assert "tgdist: 2 task(s) on 1 node(s)" in log


@pytest.mark.slow
def test_sbatch_multinode_torchrun_template(slurm_cluster, tmp_path):
    """slurm/multinode_gpu.sbatch on one node with two trainers: srun starts one torchrun agent,
    which starts the trainers; torchrun's variables win over SLURM's."""
    out = tmp_path / "ranks"
    out.mkdir()
    res = slurm_cluster.cmd(
        ["sbatch", "--wait", "--parsable", "--nodes=1", "--cpus-per-task=2", "--time=5", f"--output={tmp_path}/job.out",
         f"--export=ALL,PYTHON={sys.executable},TGDIST_ENTRY={PROBE},NPROC_PER_NODE=2",
         str(REPO / "slurm" / "multinode_gpu.sbatch"), "--out", str(out), "--layout", "2,1,1", "--groups"])
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + log + slurm_cluster.logs()
    records = read_ranks(out, 2)
    for r, rec in enumerate(records):
        w = rec["world"]
        assert (w["rank"], w["world_size"], w["local_world_size"], w["num_nodes"], w["launcher"]) == (r, 2, 2, 1, "torchrun")
        assert rec["groups"]["minibatch"] == [[0, 1], 0.5]
    assert "1 node(s) x 2 trainer(s)" in log


# ---------------------------------------------------------------- preemption (issue 55, point 2)

TRAIN = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.num_threads=1",
         "sampler.num_threads=1", "train.progress=false", "train.batch_size=100", "train.num_neg_eval=4",
         "train.lr=1e-3"]


def test_templates_and_launch_slurm_ask_for_requeue_and_the_signal(capsys):
    from tgdist.launcher.launch import main

    for name in ("multinode_gpu.sbatch", "srun_direct.sbatch"):
        lines = (REPO / "slurm" / name).read_text().splitlines()
        assert "#SBATCH --requeue" in lines and "#SBATCH --signal=B:USR1@120" in lines, name
        assert 'scontrol requeue "$SLURM_JOB_ID"' in "\n".join(lines), name
    assert main(["--slurm", "--nproc", "2", "--signal-seconds", "300", "--max-restarts", "1", "--sbatch=--time=60",
                 "--dry-run", "--", "parallel.i=2", "run_dir=/tmp/r"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[:5] == ["sbatch", "--nodes", "1", "--requeue", "--signal=B:USR1@300"]
    assert "NPROC_PER_NODE=2,MAX_RESTARTS=1" in cmd[5] and cmd[6] == "--time=60"
    assert cmd[7].endswith("slurm/multinode_gpu.sbatch") and cmd[8:] == ["parallel.i=2", "run_dir=/tmp/r"]


def test_launch_slurm_refuses_what_a_job_decides_itself():
    import subprocess

    for args, message in ((["--slurm", "--signal-seconds", "0"], "--signal-seconds 0: give at least 1"),
                          (["--signal-seconds", "60"], "--signal-seconds is for --slurm (a SLURM job)"),
                          (["--slurm", "--master-port", "29400"], "--slurm: the job's nodes meet at the first node")):
        res = subprocess.run([sys.executable, "-m", "tgdist", "launch", "--nproc", "2", *args, "--dry-run", "--",
                              "parallel.i=2"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr


def test_the_preemption_signal_checkpoints_after_the_iteration_under_way(tmp_path):
    """SIGUSR1 during iteration 3 of a run of one process: the run ends that iteration, checkpoints
    at iteration 4 (mid-epoch), writes the requeue marker and raises ``Preempted``; its folder is
    then a restart's to resume."""
    import signal

    from tgdist.kernels.interrupts import stop_on_preemption
    from tgdist.runtime import checkpoint, rundir
    from tgdist.runtime.build import compose
    from tgdist.runtime.run import Preempted, Run

    seen = []

    def on_iteration(t, _loss):
        seen.append(t)
        if t == 3:
            signal.raise_signal(signal.SIGUSR1)

    assert stop_on_preemption()
    try:
        cfg = compose([*TRAIN, "train.epochs=1", f"run_dir={tmp_path / 'r'}"])
        with pytest.raises(Preempted) as stop:
            Run(cfg, tmp_path / "r").train(on_iteration=on_iteration)
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    assert (stop.value.iteration, seen) == (4, [0, 1, 2, 3])
    assert checkpoint.read(tmp_path / "r" / "checkpoints" / "last.pt")["iteration"] == 4
    assert rundir.restarted(tmp_path / "r", env={}).iteration == 4  # its marker: the next start resumes


@pytest.mark.slow
def test_a_job_that_stops_on_the_signal_is_requeued(slurm_cluster, tmp_path):
    """srun_direct.sbatch with a stand-in task that exits 75 on SIGUSR1 at its first start: the
    batch shell passes the signal on, requeues the job, and its next start sees
    SLURM_RESTART_COUNT=1 (the real run resumes from it: the test below)."""
    import time

    task = tmp_path / "task.py"
    task.write_text(
        "import os, signal, sys, time\n"
        "n = os.environ.get('SLURM_RESTART_COUNT', '0')\n"
        "print('start', os.environ['SLURM_PROCID'], 'restart', n, flush=True)\n"
        "if n != '0':\n    sys.exit(0)\n"
        "got = []\nsignal.signal(signal.SIGUSR1, lambda s, f: got.append(s))\n"
        "for _ in range(1200):\n"
        "    if got:\n        sys.exit(75)\n"
        "    time.sleep(0.05)\n"
        "sys.exit(1)\n")
    job_id = _submit(slurm_cluster, tmp_path, [f"TGDIST_ENTRY={task}"], [])
    _wait_for(lambda: (tmp_path / "job.out").is_file() and "restart 0" in (tmp_path / "job.out").read_text(), 60,
              slurm_cluster, tmp_path)
    time.sleep(0.5)
    _signal_and_requeue(slurm_cluster, job_id, tmp_path)
    out = (tmp_path / "job.out").read_text()
    assert "requeueing job" in out and "start 0 restart 1" in out and "start 1 restart 1" in out, out


def _submit(cluster, tmp_path, exports: list[str], args: list[str]) -> str:
    env = ",".join(["ALL", f"PYTHON={sys.executable}", "OMP_NUM_THREADS=1", "OMP_WAIT_POLICY=PASSIVE", *exports])
    try:  # the rendezvous is on the node list's first host: it must resolve
        socket.gethostbyname(cluster.node)
    except OSError:
        env += ",MASTER_ADDR=127.0.0.1"
    res = cluster.cmd(["sbatch", "--parsable", "-n", "2", "--time=10", f"--output={tmp_path}/job.out",
                       f"--chdir={tmp_path}", f"--export={env}", str(REPO / "slurm" / "srun_direct.sbatch"), *args])
    assert res.returncode == 0, res.stderr + cluster.logs()
    return res.stdout.strip().split(";")[0]


def _wait_for(ready, seconds: float, cluster, tmp_path) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
            raise AssertionError(f"timed out\n{out[-3000:]}\n{cluster.logs()}")
        time.sleep(0.2)


def _signal_and_requeue(cluster, job_id: str, tmp_path, seconds: float = 240) -> None:
    """SIGUSR1 to the job's batch shell, as SLURM's --signal=B:USR1@S sends it; then, once the job
    is requeued, its start in 3 s rather than after SLURM's delay for requeued jobs; waits for its end.
    Not at once: slurmd refuses a job started again within the second its credential was revoked
    ("Killing non-startable batch JobId=1: Job credential revoked", exit 1), the race that SLURM's
    own delay for requeued jobs avoids."""
    res = cluster.cmd(["scancel", "--signal=USR1", "--batch", job_id])
    assert res.returncode == 0, res.stderr

    def state() -> str:
        r = cluster.cmd(["squeue", "-h", "-j", job_id, "-o", "%T"])
        return r.stdout.strip()

    def requeued() -> bool:
        if state() == "PENDING":
            cluster.cmd(["scontrol", "update", f"JobId={job_id}", "StartTime=now+3"])
            return True
        return False

    _wait_for(requeued, 120, cluster, tmp_path)
    _wait_for(lambda: state() == "", seconds, cluster, tmp_path)


@pytest.mark.slow
def test_a_training_job_signalled_mid_run_is_requeued_and_ends_with_the_uninterrupted_results(slurm_cluster,
                                                                                               tmp_path):
    """Two trainers (1 x 1 x 2) under srun_direct.sbatch, sent SIGUSR1 while they train (a 50 ms
    simulated link slows the iterations): every rank stops after the same iteration, the run
    checkpoints there, the job requeues itself and resumes on its own, and its results equal an
    uninterrupted run's."""
    import json

    from .helpers import run_all

    common = [*TRAIN, "parallel.k=2", "train.epochs=4", "parallel.link=1gbps:50ms"]
    [full] = run_all([[sys.executable, "-m", "tgdist", "launch", "--nproc", "2", "--", *common,
                       f"run_dir={tmp_path / 'full'}"]], timeout=400, env={"OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    full.check()
    run = tmp_path / "run"
    job_id = _submit(slurm_cluster, tmp_path, [], [*common, f"run_dir={run}"])
    _wait_for(lambda: (run / "metrics.jsonl").is_file(), 300, slurm_cluster, tmp_path)
    _signal_and_requeue(slurm_cluster, job_id, tmp_path, seconds=400)
    out = (tmp_path / "job.out").read_text()
    assert "(preemption) after iteration" in out and "requeueing job" in out, out[-3000:]
    assert (run / ".tgdist-restarts").is_file(), f"the requeued job did not resume\n{out[-3000:]}\n{slurm_cluster.logs()}"
    [restart] = [json.loads(x) for x in (run / ".tgdist-restarts").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    assert restart["by"] == "SLURM requeue" and 0 < restart["iteration"] < summary["iterations"]
    ckpt = run / "checkpoints" / "last.pt"
    assert f"restart 1 (SLURM requeue) resumed from {ckpt} at iteration {restart['iteration']}" in out
    expected = json.loads(full.stdout.strip().splitlines()[-1])
    for key in ("loss", "traversed_events", "val_ap", "test_ap", "test_mrr"):
        assert summary[key] == expected[key], key
    assert not (run / ".tgdist-requeue").exists()  # the resumed run finished
