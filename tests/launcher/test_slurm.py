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
    groups through the rendezvous on the first node of the step."""
    out = tmp_path / "ranks"
    out.mkdir()
    env_entry = f"TGDIST_ENTRY={PROBE}"
    try:  # the master address is the node list's first host: it must resolve to reach rank 0
        socket.gethostbyname(slurm_cluster.node)
    except OSError:
        env_entry += ",MASTER_ADDR=127.0.0.1"
    res = slurm_cluster.cmd(
        ["sbatch", "--wait", "--parsable", "-n", "2", "--time=2", f"--output={tmp_path}/job.out",
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
        ["sbatch", "--wait", "--parsable", "--nodes=1", "--cpus-per-task=2", "--time=2", f"--output={tmp_path}/job.out",
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
