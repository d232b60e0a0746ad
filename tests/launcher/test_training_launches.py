"""Real training jobs through each launcher (CPU, gloo, tiny data): sbatch on the local SLURM
cluster, mpiexec, and two torchrun invocations standing in for two machines. Each reads the
run's summary back and checks every training event was traversed as often as in one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from .helpers import REPO, free_port, run_all, train_events
from .test_mpi import mpiexec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=100",
         "train.num_neg_eval=4", "train.num_threads=1", "sampler.num_threads=1", "train.progress=false"]
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def check_summary(run_dir, layout: str, epochs: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parallel"] == layout
    assert summary["traversed_events"] == epochs * train_events(*SMALL)
    assert 0.0 <= summary["test_ap"] <= 1.0
    return summary


def test_sbatch_two_task_training_job(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    exports = f"ALL,PYTHON={sys.executable},OMP_NUM_THREADS=1,OMP_WAIT_POLICY=PASSIVE"
    try:
        socket.gethostbyname(slurm_cluster.node)
    except OSError:  # the rendezvous is on the node list's first host: it must resolve
        exports += ",MASTER_ADDR=127.0.0.1"
    res = slurm_cluster.cmd(["sbatch", "--wait", "--parsable", "-n", "2", "--time=5", f"--output={tmp_path}/job.out",
                             f"--chdir={tmp_path}", f"--export={exports}", str(REPO / "slurm" / "srun_direct.sbatch"),
                             *SMALL, "parallel.k=2", "train.epochs=2", f"run_dir={run_dir}"])
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + log[-3000:] + slurm_cluster.logs()
    check_summary(run_dir, "1 x 1 x 2", 2)


def test_sbatch_job_with_partitioned_memory(slurm_cluster, tmp_path):
    """Sven's partitioned memory under SLURM: two tasks of one memory group, each holding half of it."""
    run_dir = tmp_path / "run"
    exports = f"ALL,PYTHON={sys.executable},OMP_NUM_THREADS=1,OMP_WAIT_POLICY=PASSIVE"
    try:
        socket.gethostbyname(slurm_cluster.node)
    except OSError:
        exports += ",MASTER_ADDR=127.0.0.1"
    res = slurm_cluster.cmd(["sbatch", "--wait", "--parsable", "-n", "2", "--time=5", f"--output={tmp_path}/job.out",
                             f"--chdir={tmp_path}", f"--export={exports}", str(REPO / "slurm" / "srun_direct.sbatch"),
                             *SMALL, "parallel.i=2", "memory.backend=sven", "train.epochs=1", f"run_dir={run_dir}"])
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + log[-3000:] + slurm_cluster.logs()
    summary = check_summary(run_dir, "2 x 1 x 1", 1)
    assert summary["memory_backend"] == "sven" and summary["communication"]["dispatch.payload"]["bytes_sent"] > 0


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_with_partitioned_memory(tmp_path, nproc):
    """``tgdist launch`` (torchrun) with Sven's partitioned memory over 2 and 4 trainers, on the
    simulated InfiniBand link."""
    run_dir = tmp_path / "run"
    [res] = run_all([[sys.executable, "-m", "tgdist", "launch", "--nproc", str(nproc), "--", *SMALL,
                      f"parallel.i={nproc}", "memory.backend=sven", "parallel.link=ib100", "train.epochs=1",
                      f"run_dir={run_dir}"]], timeout=300, env=ENV, cwd=tmp_path)
    res.check()
    summary = check_summary(run_dir, f"{nproc} x 1 x 1", 1)
    comm = summary["communication"]
    assert summary["memory_backend"] == "sven" and comm["aggregation.payload"]["bytes_sent"] > 0
    # the run installed the simulated link: every phase is priced (a collective's latency alone is 5 us)
    assert all(c["modelled_seconds"] > 0 for c in comm.values()), comm
    assert comm["gradients"]["modelled_seconds"] >= 5e-6 * comm["gradients"]["calls"]


def test_mpiexec_two_rank_training(tmp_path):
    run_dir = tmp_path / "run"
    [res] = run_all([[*mpiexec(), "-n", "2", sys.executable, "-m", "tgdist.train", *SMALL, "parallel.i=2",
                      "train.epochs=1", f"run_dir={run_dir}"]], timeout=300, env=ENV, cwd=tmp_path)
    res.check()
    summary = check_summary(run_dir, "2 x 1 x 1", 1)
    assert json.loads(res.stdout.strip().splitlines()[-1])["test_ap"] == summary["test_ap"]


def test_two_torchrun_nodes_on_loopback(tmp_path):
    """--nnodes 2: node_rank 0 and 1, one process each, c10d rendezvous on loopback (two machines'
    worth of launch logic on one box); memory parallelism k=2, one memory copy per node."""
    run_dir = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
             "-m", "tgdist.train", *SMALL, "parallel.k=2", "train.epochs=2", f"run_dir={run_dir}"] for n in (0, 1)]
    for res in run_all(cmds, timeout=300, env=ENV, cwd=tmp_path):
        res.check()
    check_summary(run_dir, "1 x 1 x 2", 2)


@pytest.mark.parametrize("case", ["config", "data"])
def test_ranks_started_with_other_settings_fail_at_once(tmp_path, case):
    """Two machines' command lines typed differently, or their copies of the data differing: the
    ranks met in collectives of other shapes (or trained on other data) without a word. Every rank
    now fails with one line."""
    rows = [f"{i % 40},{40 + i % 23},{i}" for i in range(1200)]
    for n, count in ((0, 1200), (1, 1100)):  # each machine's own copy of ev.csv (the path may differ)
        (tmp_path / f"m{n}").mkdir()
        (tmp_path / f"m{n}" / "ev.csv").write_text("\n".join(rows[:count]) + "\n")
    per_node, message = {
        "config": ([["train.batch_size=100"], ["train.batch_size=200"]],
                   "configs: train.batch_size: rank 0 100 vs rank 1 200"),
        "data": ([[f"data.path={tmp_path / f'm{n}' / 'ev.csv'}"] for n in (0, 1)],
                 ("data: events: rank 0 1200 vs rank 1 1100, first and last time: rank 0 (0.0, 1199.0) vs rank 1 "
                  "(0.0, 1099.0)"))}[case]
    endpoint = f"127.0.0.1:{free_port()}"
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
             "-m", "tgdist.train", *SMALL, "parallel.k=2", "train.epochs=2", f"run_dir={tmp_path / 'run'}",
             *per_node[n]] for n in (0, 1)]
    for n, res in enumerate(run_all(cmds, timeout=300, env=ENV, cwd=tmp_path)):
        assert res.returncode != 0
        line = f"tgdist train [rank {n}]: error: the ranks of this run were started with other {message}; start every"
        assert line in res.stderr, res.stderr
    assert not (tmp_path / "run").exists()


def test_a_peer_that_dies_under_srun_is_one_line(tmp_path):
    """Outside torchrun nobody reports the dead rank: the survivor printed gloo's 30-line
    'Connection reset by peer' traceback. The srun path by hand (SLURM's variables), rank 1 killed."""
    port = free_port()
    common = {**ENV, "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0",
              "SLURM_NNODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TGDIST_FAULT_KILL": "1:2"}
    cmd = [sys.executable, "-m", "tgdist.train", *SMALL, "parallel.k=2", "train.epochs=4", f"run_dir={tmp_path / 'r'}"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, **common, "SLURM_PROCID": str(r),
                                                      "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        (_, err0), _ = procs[0].communicate(timeout=240), procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9 and procs[0].returncode == 1
    assert err0.strip().splitlines()[-1].startswith("tgdist train [rank 0]: error: another rank of this run went away ("), err0
    assert "Traceback" not in err0 and not (tmp_path / "r").exists()


def test_a_failing_mpiexec_rank_ends_the_job(tmp_path):
    """A rank that fails before the others meet it (here its epochs do not fit the layout) printed
    its line, then waited in MPI_Finalize while rank 0 waited for it: ten minutes, then a traceback."""
    import time
    from pathlib import Path

    cmd = [sys.executable, "-m", "tgdist.train", *SMALL, "parallel.k=2", f"run_dir={tmp_path / 'run'}"]
    shm = Path("/dev/shm")
    before = set(shm.glob("mpich_shm_*"))
    t0 = time.monotonic()
    try:
        [res] = run_all([[*mpiexec(), "-n", "1", *cmd, "train.epochs=2", ":", "-n", "1", *cmd, "train.epochs=3"]],
                        timeout=120, env=ENV, cwd=tmp_path)
    finally:  # MPICH's own segment, which an aborted job leaves (not tgdist's)
        for left in set(shm.glob("mpich_shm_*")) - before:
            left.unlink(missing_ok=True)
    assert res.returncode != 0 and time.monotonic() - t0 < 60
    assert "tgdist train [rank 1]: error: train.epochs = 3 is not a multiple" in res.stderr, res.stderr
