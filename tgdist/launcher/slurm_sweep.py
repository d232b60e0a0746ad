"""Sweeps on SLURM: ``tgdist launch -- -m ... hydra/launcher=submitit_slurm``, one job per point.

Hydra's submitit launcher submits a sweep as one job array whose every job asks for the same
resources; a sweep over ``parallel.i/j/k`` needs a different number of trainers per point. Here the
``hydra.launcher.*`` settings are composed as Hydra composes them (the ``slurm`` extra installs
hydra-submitit-launcher, whose ``SlurmQueueConf`` checks their names), and every point becomes its
own submitit job whose tasks are read from its layout (``point_resources``): ``i*j*k`` tasks, one
trainer each, on ``ceil(i*j*k / gpus_per_node)`` nodes when ``hydra.launcher.gpus_per_node`` is set
(one GPU per trainer), else on ``hydra.launcher.nodes`` nodes (1 by default). submitit's batch
script runs the tasks with ``srun``; each task runs ``python -m tgdist.train`` with the point's
overrides, which finds its rank from SLURM's variables (``tgdist.distributed.world``).

The launcher waits for every point and reports each (``#N (swept values): done, test AP ...`` or
``failed: ...``, naming its log); a point that fails does not stop the others, whose run
directories keep their results. Exit code 0 when every point finished, else 1.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tgdist.errors import ConfigError, first_line

__all__ = ["PointResources", "point_resources", "executor_parameters", "check_launcher_overrides", "TrainPoint",
           "run_sweep", "LAUNCHER_TARGET"]

LAUNCHER_TARGET = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
# Read from each point's layout: given on the command line they would be typed twice and could disagree.
_FROM_LAYOUT = ("tasks_per_node", "gpus_per_task")
# SlurmQueueConf's keys that submitit takes without the ``slurm_`` prefix (BaseQueueConf's)
_BASE_KEYS = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
              "stderr_to_stdout"}
_NOT_PARAMETERS = {"_target_", "submitit_folder", "max_num_timeout"}
_POLL_SECONDS = 2.0


@dataclass(frozen=True)
class PointResources:
    """What one point's SLURM job asks for: ``nodes x tasks_per_node`` tasks, one trainer each."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int | None  # one per trainer on the node; None on a CPU cluster

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


def point_resources(world_size: int, gpus_per_node: int | None, nodes: int = 1) -> PointResources:
    """The job of a point of ``world_size`` trainers (a pure function). With ``gpus_per_node`` G,
    a node holds at most G trainers: ``ceil(world / G)`` nodes, each with ``world / nodes`` trainers
    and as many GPUs. Without GPUs, the trainers are spread evenly over ``nodes`` nodes."""
    if world_size < 1:
        raise ConfigError(f"a layout of {world_size} trainers")
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ConfigError(f"hydra.launcher.gpus_per_node={gpus_per_node}: give at least 1 (or leave it out "
                              f"on a CPU cluster)")
        nodes = math.ceil(world_size / gpus_per_node)
        if world_size % nodes:
            raise ConfigError(f"{world_size} trainers do not fill {nodes} nodes of {gpus_per_node} GPUs evenly: "
                              f"use a layout whose i*j*k is at most {gpus_per_node} or a multiple of it")
        per_node = world_size // nodes
        return PointResources(nodes=nodes, tasks_per_node=per_node, gpus_per_node=per_node)
    if nodes < 1:
        raise ConfigError(f"hydra.launcher.nodes={nodes}: give at least 1")
    if world_size % nodes:
        raise ConfigError(f"{world_size} trainers cannot be spread evenly over hydra.launcher.nodes={nodes} nodes")
    return PointResources(nodes=nodes, tasks_per_node=world_size // nodes, gpus_per_node=None)


def check_launcher_overrides(overrides: list[str]) -> None:
    """Refuse the settings that each point's layout decides, and a missing plugin, in one line."""
    for ov in overrides:
        key = ov.partition("=")[0].lstrip("+~")
        if key.startswith("hydra.launcher.") and key.removeprefix("hydra.launcher.") in _FROM_LAYOUT:
            raise ConfigError(f"{ov}: the tasks of each point's job are read from its layout (one per trainer, "
                              f"parallel.i*j*k); leave {key} out")


def executor_parameters(launcher: dict, resources: PointResources, name: str) -> dict:
    """submitit's ``update_parameters`` arguments for one point: the ``hydra.launcher`` settings
    (resolved, as a dict) as hydra-submitit-launcher passes them, with the point's own tasks,
    nodes and GPUs."""
    params = {k if k in _BASE_KEYS else f"slurm_{k}": v for k, v in launcher.items() if k not in _NOT_PARAMETERS}
    params.update(nodes=resources.nodes, tasks_per_node=resources.tasks_per_node,
                  gpus_per_node=resources.gpus_per_node, name=name)
    params.pop("slurm_gpus_per_task", None)
    params.pop("slurm_array_parallelism", None)  # one job per point, no array
    return params


class TrainPoint:
    """What every task of a point's job runs: ``python -m tgdist.train OVERRIDES`` (a rank, from
    SLURM's variables). Rank 0 returns the run's summary; a task that fails raises, which submitit
    records as the job's error."""

    def __init__(self, overrides: list[str], run_dir: str):
        self.overrides, self.run_dir = list(overrides), run_dir

    def __call__(self) -> dict | None:
        import json

        rc = subprocess.run([sys.executable, "-m", "tgdist.train", *self.overrides]).returncode
        if rc:
            rank = os.environ.get("SLURM_PROCID", "?")
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with {rc}"
            raise RuntimeError(f"rank {rank}: tgdist.train {how}")
        if os.environ.get("SLURM_PROCID", "0") != "0":
            return None
        return json.loads((Path(self.run_dir) / "summary.json").read_text())


def _squeue_ids(env: dict | None = None) -> set[str] | None:
    """Job ids SLURM still lists (any state), or None when squeue cannot be asked."""
    try:
        r = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {ln.strip() for ln in r.stdout.splitlines() if ln.strip()} if r.returncode == 0 else None


def _say(text: str) -> None:
    print(f"tgdist launch: {text}", file=sys.stderr, flush=True)


def run_sweep(points: list[tuple[list[str], dict[str, int], str]], launcher: dict, base: Path,
              check_world=None) -> int:
    """Submit one job per point, wait for all, report each. ``points``: (train overrides with the
    point's ``run_dir``, its layout ``{i, j, k}``, its swept values for messages). ``launcher``:
    the resolved ``hydra.launcher`` settings. ``check_world(num, layout, resources)`` checks a
    point's layout against the nodes it gets (before anything is submitted)."""
    import submitit

    logging.getLogger("submitit").setLevel(logging.ERROR)  # without accounting, sacct warns on every poll
    jobs_res = []
    for num, (_, layout, where) in enumerate(points):
        world = layout["i"] * layout["j"] * layout["k"]
        try:
            res = point_resources(world, launcher.get("gpus_per_node"), int(launcher.get("nodes") or 1))
            if check_world is not None:
                check_world(num, layout, res)
        except ConfigError as e:
            raise ConfigError(f"{e} (sweep job #{num}: {where})") from None
        jobs_res.append(res)
    folder = launcher.get("submitit_folder") or str(base / ".submitit" / "%j")
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm",
                                     slurm_max_num_timeout=int(launcher.get("max_num_timeout") or 0))
    prefix = launcher.get("name") if launcher.get("name") not in (None, "", "app") else "tgdist"
    submitted = []
    for num, ((overrides, _, where), res) in enumerate(zip(points, jobs_res)):
        executor.update_parameters(**executor_parameters(launcher, res, f"{prefix}-{num}"))
        run_dir = next(o.partition("=")[2] for o in reversed(overrides) if o.startswith("run_dir="))
        said = io.StringIO()  # submitit prints sbatch's stderr before it raises: the one line below says it
        try:
            with contextlib.redirect_stderr(said):
                job = executor.submit(TrainPoint(overrides, run_dir))
        except Exception as e:  # noqa: BLE001 - sbatch refused it: submitit's FailedJobError, with sbatch's output
            for earlier in submitted:  # a sweep runs whole or not at all
                earlier.cancel(check=False)
            logs = Path(folder.split("%")[0])  # the jobs' pickles and logs (.submitit/ of the sweep, by default)
            if logs.resolve().is_relative_to(Path(base).resolve()) and logs.resolve() != Path(base).resolve():
                shutil.rmtree(logs, ignore_errors=True)  # inside this sweep's directory: this sweep's alone
            raise ConfigError(f"sweep job #{num} ({where or 'no swept keys'}): sbatch refused it: {sbatch_reason(e)}"
                              + (f"; the {len(submitted)} job(s) submitted before it were cancelled" if submitted
                                 else "")) from None
        gpus = f", {res.gpus_per_node} GPU(s) per node" if res.gpus_per_node else ""
        _say(f"sweep job #{num} ({where or 'no swept keys'}): SLURM job {job.job_id}, {res.nodes} node(s) x "
             f"{res.tasks_per_node} task(s){gpus}")
        submitted.append(job)
    return _wait(submitted, points)


def sbatch_reason(e: BaseException) -> str:
    """sbatch's own error line in submitit's report of a failed submission ("sbatch: error: Batch
    job submission failed: Invalid partition name specified"), else the report's first line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    said = [ln for ln in lines if "error" in ln.lower() and "sbatch" in ln.lower()]
    text = (said[-1] if said else lines[0] if lines else type(e).__name__)
    return text.removeprefix("sbatch: error: ")


def _wait(jobs, points) -> int:
    """Poll until every job has a result or has left the queue; one line per point as it ends."""
    pending = dict(enumerate(jobs))
    failed = []
    gone_once: set[int] = set()
    while pending:
        listed = _squeue_ids()
        for num, job in list(pending.items()):
            where = points[num][2] or "no swept keys"
            if job.paths.result_pickle.exists() or job.done():
                outcome = _outcome(job)
            elif listed is not None and job.job_id not in listed:
                if num not in gone_once:  # the result file may reach a shared file system a moment later
                    gone_once.add(num)
                    continue
                outcome = f"failed: the job left the queue without a result (cancelled, out of time or memory?); " \
                          f"its log: {job.paths.stderr}"
            else:
                continue
            del pending[num]
            if outcome.startswith("failed"):
                failed.append(num)
            _say(f"sweep job #{num} ({where}): {outcome}")
        if pending:
            time.sleep(_POLL_SECONDS)
    if failed:
        _say(f"{len(failed)} of {len(jobs)} sweep job{'s' * (len(jobs) > 1)} failed: "
             f"{', '.join(f'#{n} ({points[n][2]})' for n in sorted(failed))}; the others kept their results")
        return 1
    return 0


def _outcome(job) -> str:
    try:
        summary = next((r for r in job.results() if r), None)  # rank 0's; the other tasks return None
    except Exception as e:  # submitit's FailedJobError holds the task's traceback: its last line says why
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        cause = next((ln.strip() for ln in reversed(lines) if "Error" in ln or "rank" in ln), first_line(e))
        return f"failed: {cause}; its log: {job.paths.stderr}"
    if not summary:
        return "done"
    return (f"done, test AP {summary.get('test_ap', float('nan')):.4f}, "
            f"{summary.get('train_events_per_s', float('nan')):,.0f} events/s, in {summary.get('run_dir')}")
