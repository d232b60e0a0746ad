"""Sweeps on SLURM (``tgdist launch -- -m ... hydra/launcher=submitit_slurm``): the resources each
point asks for, and real sweeps on the local one-node test cluster, one job per point."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from tgdist.cli import main as cli_main
from tgdist.errors import ConfigError
from tgdist.launcher.slurm_sweep import PointResources, executor_parameters, point_resources

from .helpers import REPO, train_events

SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=100",
         "train.num_neg_eval=4", "train.num_threads=1", "sampler.num_threads=1", "train.progress=false"]


def test_point_resources_come_from_the_layout():
    assert point_resources(1, None) == PointResources(nodes=1, tasks_per_node=1, gpus_per_node=None)
    assert point_resources(4, None) == PointResources(nodes=1, tasks_per_node=4, gpus_per_node=None)
    assert point_resources(4, None, nodes=2) == PointResources(nodes=2, tasks_per_node=2, gpus_per_node=None)
    # one GPU per trainer: as many nodes as the trainers need, only the GPUs they use
    assert point_resources(2, 8) == PointResources(nodes=1, tasks_per_node=2, gpus_per_node=2)
    assert point_resources(32, 8) == PointResources(nodes=4, tasks_per_node=8, gpus_per_node=8)
    assert point_resources(32, 8).tasks == 32
    assert point_resources(12, 8) == PointResources(nodes=2, tasks_per_node=6, gpus_per_node=6)
    with pytest.raises(ConfigError, match="9 trainers do not fill 2 nodes of 8 GPUs evenly"):
        point_resources(9, 8)
    with pytest.raises(ConfigError, match="3 trainers cannot be spread evenly over hydra.launcher.nodes=2"):
        point_resources(3, None, nodes=2)


def test_executor_parameters_are_the_launchers_with_the_points_tasks():
    launcher = {"submitit_folder": "sw/.submitit/%j", "timeout_min": 30, "cpus_per_task": 4, "gpus_per_node": 8,
                "tasks_per_node": 1, "mem_gb": None, "nodes": 1, "name": "app", "stderr_to_stdout": False,
                "_target_": "x", "partition": "gpu", "account": "proj", "max_num_timeout": 0,
                "array_parallelism": 256, "gpus_per_task": None, "additional_parameters": {}}
    params = executor_parameters(launcher, PointResources(2, 8, 8), "tgdist-3")
    assert params == {"timeout_min": 30, "cpus_per_task": 4, "gpus_per_node": 8, "tasks_per_node": 8, "mem_gb": None,
                      "nodes": 2, "name": "tgdist-3", "stderr_to_stdout": False, "slurm_partition": "gpu",
                      "slurm_account": "proj", "slurm_additional_parameters": {}}


def test_slurm_sweep_settings_are_checked_before_anything_is_submitted(capsys):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra")
    cases = [
        (["hydra.launcher.tasks_per_node=2"], "hydra.launcher.tasks_per_node=2: the tasks of each point's job are read "
                                              "from its layout"),
        (["hydra.launcher.partitoin=gpu"], "Could not override 'hydra.launcher.partitoin'"),
        (["hydra.launcher.nodes=2", "memory.backend=daemon"], "parallel.k = 1 memory copies for 2 machines"),
    ]
    for extra, message in cases:
        try:
            rc = cli_main(["launch", "--dry-run", "--", "-m", "parallel.i=2", "hydra/launcher=submitit_slurm", *extra])
        except SystemExit as e:  # a config error found while the jobs are composed
            rc = e.code
        assert rc == 2
        err = capsys.readouterr().err
        assert err.startswith("tgdist launch: error: ") and message in err and len(err.splitlines()) == 1, err
    rc = cli_main(["launch", "--dry-run", "--", "-m", "parallel.i=16", "hydra/launcher=submitit_slurm",
                   "hydra.launcher.gpus_per_node=8", "hydra.launcher.partition=gpu", "run_dir=sw"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(out) == 1
    assert "gpus_per_node=8 tasks_per_node=8 nodes=2 name=tgdist-0" in out[0] and "partition=gpu" in out[0]
    assert out[0].endswith(f"each of its 16 task(s) runs python -m tgdist.train parallel.i=16 run_dir={Path.cwd()}/sw/0")


def _exports(cluster) -> dict:
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    try:  # the rendezvous is on the node list's first host: it must resolve
        socket.gethostbyname(cluster.node)
    except OSError:
        env["MASTER_ADDR"] = "127.0.0.1"
    return env


def _launch(cluster, tmp_path, *overrides, env=None):
    import subprocess

    return subprocess.run([sys.executable, "-m", "tgdist", "launch", "--", "-m", *overrides,
                           "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=5", *SMALL,
                           f"run_dir={tmp_path / 'sweep'}"], env={**_exports(cluster), **(env or {})},
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_three_point_sweep_on_slurm(slurm_cluster, tmp_path):
    """1x1x1, 2x1x1 and 1x1x2, one SLURM job each with the tasks its layout needs; every summary
    read back from its run directory."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra (hydra-submitit-launcher)")
    res = _launch(slurm_cluster, tmp_path, "parallel={i:1,k:1},{i:2,k:1},{i:1,k:2}", "train.epochs=2")
    assert res.returncode == 0, res.stderr[-4000:] + slurm_cluster.logs()
    events = train_events(*SMALL)
    for num, layout in enumerate(["1 x 1 x 1", "2 x 1 x 1", "1 x 1 x 2"]):
        summary = json.loads((tmp_path / "sweep" / str(num) / "summary.json").read_text())
        assert summary["parallel"] == layout and summary["traversed_events"] == 2 * events
        tasks = 1 if num == 0 else 2
        assert f"sweep job #{num} (parallel=" in res.stderr and f"1 node(s) x {tasks} task(s)" in res.stderr
        assert f"done, test AP {summary['test_ap']:.4f}" in res.stderr
    assert (tmp_path / "sweep" / ".submitit").is_dir()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failing_slurm_point_is_named_and_the_others_keep_their_results(slurm_cluster, tmp_path):
    """Rank 1 of every two-trainer point kills itself at its second iteration: that point fails and
    is named, the one-trainer point finishes and keeps its summary, the launcher exits 1."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra (hydra-submitit-launcher)")
    res = _launch(slurm_cluster, tmp_path, "parallel.i=1,2", "train.epochs=1", env={"TGDIST_FAULT_KILL": "1:2"})
    assert res.returncode == 1, res.stderr[-4000:]
    summary = json.loads((tmp_path / "sweep" / "0" / "summary.json").read_text())
    assert summary["parallel"] == "1 x 1 x 1"
    assert not (tmp_path / "sweep" / "1" / "summary.json").exists()
    lines = res.stderr.strip().splitlines()
    assert any(ln.startswith("tgdist launch: sweep job #1 (parallel.i=2): failed: ") for ln in lines), res.stderr
    assert lines[-1] == ("tgdist launch: 1 of 2 sweep jobs failed: #1 (parallel.i=2); the others kept their results")
    pytest.importorskip("matplotlib", reason="tgdist report draws with matplotlib")
    assert cli_main(["report", str(tmp_path / "sweep")]) == 0  # the failed point is named there too
    assert "Without a summary (failed, stopped or still running): `#1 2x1x1`" in (tmp_path / "sweep" / "report.md").read_text()


def test_a_sweep_that_sbatch_refuses_is_one_line_and_leaves_no_submitit_folder(tmp_path):
    """No reachable slurmctld, a wrong partition or account: sbatch refuses the first job. That was
    a 48-line submitit traceback that left the sweep's .submitit/ folder behind."""
    import os
    import stat
    import subprocess

    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra (hydra-submitit-launcher)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"  # what sbatch says of a partition the cluster does not have
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid partition name "
                      "specified' >&2\nexit 1\n")
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    work = tmp_path / "work"
    work.mkdir()
    res = subprocess.run([sys.executable, "-m", "tgdist", "launch", "--", "-m", "parallel.i=1,2",
                          "hydra/launcher=submitit_slurm", "hydra.launcher.partition=nope", *SMALL,
                          f"run_dir={work / 'sweep'}"], env=env, cwd=work, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [
        "tgdist launch: error: sweep job #0 (parallel.i=1): sbatch refused it: Batch job submission failed: Invalid "
        "partition name specified"]
    assert not list(work.rglob(".submitit"))
