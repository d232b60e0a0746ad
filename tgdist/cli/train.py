"""``tgdist train`` (and ``python -m tgdist.train``): check the command line, claim the run
directory, run, report; errors and signals as one line and an exit code.

The config of a run is composed once, here, before anything is written, and the run starts with
it as Hydra's ``@hydra.main`` would start it (``overrides.run_composed``: its logging, run
directory and ``.hydra/`` files); a ``--multirun`` composes the sweep's config and each job's
once, checks every job, and starts Hydra's sweeper and launcher with them
(``overrides.run_sweep``). Hydra's own flags (``--cfg``, ``--info``, ``--help``, ``--experimental-rerun``) go to
``@hydra.main``.

The final JSON summary is the last line of stdout; progress and logs go to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import tgdist.config  # noqa: F401  (registers the typed schema before Hydra composes)
from tgdist.config.overrides import ConfigSource, precheck_command, run_composed, run_sweep, without_hydra
from tgdist.config import config_dir
from tgdist.errors import TgdistError, first_line, write_failure
from tgdist.runtime import rundir
from tgdist.runtime.rundir import remove_empty_dirs, resume_override


@dataclass
class _Launch:
    """What ``main`` learns before Hydra starts, for ``_job`` and for the way out. Hydra's job
    function takes the config alone, so this one module-level object is how the rest reaches it
    (the only state Hydra forces to be global here); ``main`` resets it, so a second call in the
    same process (tests) starts clean."""

    # the run directory of each finished run (a sweep has several): an interrupt after it is said so
    finished: list[str] = field(default_factory=list)
    # parents of the run directory that did not exist before this process (``runs/`` on a first
    # run): removed again, when left empty, with a run directory that holds no result
    new_parents: list[Path] = field(default_factory=list)
    # the sweep directory of a checked ``--multirun`` (None otherwise), its number of jobs, the keys
    # it sweeps (an error in a job names the job by them), and the entries of its existing job
    # folders before the sweep (a job folder not listed is made by the sweep)
    sweep_dir: Path | None = None
    sweep_size: int = 0
    swept: list = field(default_factory=list)
    sweep_jobs_before: dict[str, frozenset[str]] = field(default_factory=dict)
    # the run directory of a run checked before Hydra starts (None for sweeps and other flags), and
    # whether this process made it (a default name, claimed before Hydra starts)
    run_dir: Path | None = None
    claimed: bool = False
    # ranks but 0 of a parallel run have Hydra write nothing (its run directory is the temp folder,
    # with no .hydra/ and the log file on the null device; a killed rank leaves nothing behind):
    # only rank 0 writes the run directory's start-up files, so it alone can take them back
    elsewhere: bool = False
    # the open run directory whose lock this process holds until it ends (``_hold_run_dir``)
    held: list[int] = field(default_factory=list)
    # this start as a restart of the run in its folder (``_continue_a_restart``), said in the log
    restart: rundir.Restart | None = None
    # the config of a run, composed once and checked before Hydra starts: the run trains with it
    # (``_start``), and what its validation resolved, when it was validated here (a resume: None
    # otherwise, validated once by the run)
    cfg: DictConfig | None = None
    choices: object = None
    # a checked sweep's jobs, in order: each one's composed config and what its validation resolved
    jobs: list = field(default_factory=list)

    def reset(self) -> None:
        self.__dict__.update(_Launch().__dict__)


_launch = _Launch()


def _sweep_job_note() -> str:
    """`` (sweep job #N: KEY=VALUE ...; ...)`` for an error inside a job of a checked sweep."""
    if _launch.sweep_dir is None:
        return ""
    from tgdist.config.overrides import jobs_not_run, swept_values

    num = int(HydraConfig.get().job.num)
    values = swept_values(list(HydraConfig.get().overrides.task), _launch.swept)
    return f" (sweep job #{num}: {values}{jobs_not_run(num, _launch.sweep_size)})"


def _remove_if_empty_run(run_dir: Path) -> None:
    """Remove what this run wrote into ``run_dir`` when that holds no result: start-up files and a
    metrics file only, with no checkpoint (stopped before the first one: every finished epoch
    writes one; a resumed run's metrics start with the lines copied from the checkpoint it
    resumed). The directory goes too only when this run made it (``rundir.release``): a user's
    own files, and a directory the user gave, stay."""
    if not rundir.release(run_dir):
        return
    sweep_file = run_dir.parent / "multirun.yaml"  # a sweep whose first job failed: nothing ran
    sweep = _launch.sweep_dir
    if sweep is not None and run_dir.parent == sweep and [*sweep.iterdir()] == [sweep_file]:
        sweep_file.unlink()
    remove_empty_dirs(_launch.new_parents)


def _composed(hydra_cfg: DictConfig):
    """The config this Hydra job trains with and what its validation resolved (None: not yet
    validated): the one composed before Hydra started (a run's, or this job's of a checked sweep),
    so that a config is composed and validated once; else Hydra's (``--experimental-rerun``, a
    sweeper other than Hydra's basic one), its strategy sections given the classes of the
    strategies they name (``narrow``), as every composition does."""
    from tgdist.config.overrides import narrow

    if _launch.sweep_dir is not None and _launch.jobs:
        return _launch.jobs[int(HydraConfig.get().job.num)]
    if _launch.cfg is not None:
        return _launch.cfg, _launch.choices
    narrow(hydra_cfg)
    return hydra_cfg, None


def _job(cfg: DictConfig) -> None:
    """A run, or a job of a sweep, inside Hydra's job (its ``HydraConfig``, run directory and logging)."""
    from tgdist.distributed.world import detect
    from tgdist.kernels.interrupts import PREEMPTED_EXIT, caused_by_interrupt, hold_interrupts_during_compiles, stopped
    from tgdist.kernels.jit import announce_compiles
    from tgdist.runtime.driver import run
    from tgdist.runtime.run import Preempted

    cfg, choices = _composed(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)  # the temp folder on ranks but 0 (_launch.elsewhere)
    world = detect()
    if _launch.sweep_dir is not None and run_dir.parent == _launch.sweep_dir:  # a job of a checked sweep: Hydra made it
        rundir.claim(run_dir, cfg.train.overwrite, made=run_dir.name not in _launch.sweep_jobs_before,
                     before=_launch.sweep_jobs_before.get(run_dir.name, frozenset()))
    rank = world.rank
    who = f"tgdist train{f' [rank {rank}]' if world.world_size > 1 else ''}"  # every rank of a parallel run
    hold_interrupts_during_compiles(who)  # Ctrl-C inside a numba compile crashes at exit
    if rank == 0:
        announce_compiles(who)  # why the first batches of a fresh install are slow
    _paths_from_the_launch_directory(cfg)
    if not _launch.elsewhere and (Path(HydraConfig.get().runtime.cwd) / cfg.run_dir).resolve() != run_dir.resolve():
        cfg.run_dir = str(run_dir)  # config.yaml names where the run went: a sweep's job, a config's hydra.run.dir
    if not _launch.elsewhere and _launch.run_dir is not None and _launch.run_dir.resolve() != run_dir.resolve():
        # a config's hydra.run.dir replaced the directory claimed here: give that back, and take
        # Hydra's as found (its start-up files aside), never removing it
        if rundir.release(_launch.run_dir):
            remove_empty_dirs(_launch.new_parents)
        rundir.claim(run_dir, cfg.train.overwrite, made=False,
                     before=frozenset(p.name for p in run_dir.iterdir()) - {".hydra", "train.log"})
    if _launch.restart is not None and rank == 0:
        logging.getLogger("tgdist.cli.train").info("%s", _launch.restart.line())
    try:
        summary = run(cfg, None if _launch.elsewhere else run_dir, choices)  # None: rank 0's, told when the ranks meet
    except Preempted as e:  # checkpointed after the same iteration on every rank: requeue and resume
        where = (_launch.run_dir or run_dir) if _launch.elsewhere else run_dir
        print(f"{who}: {e.words()} after iteration {e.iteration}; {where / 'checkpoints' / 'last.pt'} holds the "
              f"checkpoint; exiting {PREEMPTED_EXIT} for the job to be requeued (its next start in {where} resumes "
              f"there)", file=sys.stderr)
        _exit(PREEMPTED_EXIT, world)
    except TgdistError as e:
        _remove_if_empty_run(run_dir)
        code = getattr(e, "exit_code", 2)  # 2: bad input; 1: a process of the run failed
        if code == 2:  # refused before training (a resume checked inside the ranks): the folder as it was
            rundir.restore(run_dir)
        print(f"{who}: error: {e}{_sweep_job_note()}", file=sys.stderr)
        _exit(code, world)
    except OSError as e:  # a full disk, say: one line, exit 1 (the input was not at fault)
        if write_failure(e) is None:
            raise
        _remove_if_empty_run(run_dir)
        where = "" if e.filename else f"{run_dir}: "  # a flush of metrics.jsonl names no file
        print(f"{who}: error: {where}{write_failure(e)}{_sweep_job_note()}", file=sys.stderr)
        _exit(1, world)
    except BaseException as e:  # Ctrl-C or SIGTERM: one line saying what is kept, the shell's 128 + N
        if not caused_by_interrupt(e):
            _remove_if_empty_run(run_dir)  # what follows is a traceback (a bug) or out of memory
            if (why := _out_of_memory(e)) is not None:
                print(f"{who}: error: out of memory ({why}): try a smaller train.batch_size, model.mem_dim or "
                      f"sampler.fanouts, or data.max_events{_sweep_job_note()}", file=sys.stderr)
                _exit(1, world)
            if world.world_size > 1 and (why := _peer_lost(e)) is not None:
                print(f"{who}: error: another rank of this run went away ({why}); its own line, or the "
                      f"launcher's, says why", file=sys.stderr)
                _exit(1, world)
            raise
        _remove_if_empty_run(run_dir)
        where = (_launch.run_dir or run_dir) if _launch.elsewhere else run_dir  # ranks but 0: rank 0's directory
        ckpt = where / "checkpoints" / "last.pt"
        kept = (f"; {ckpt} holds the last checkpoint, continue with {resume_override(where)}" if ckpt.exists()
                else "; no checkpoint had been written")
        words, code = stopped(e)
        print(f"{who}: {words}{kept}{_sweep_job_note()}", file=sys.stderr)
        _exit(code, world)
    if rank == 0:
        (run_dir / rundir.REQUEUE_MARKER).unlink(missing_ok=True)  # the run went on past its preemption
        _print_summary(summary, who)
    elif "run_dir" not in summary or Path(summary["run_dir"]).resolve() != run_dir.resolve():  # (a stopped run: none)
        _remove_if_empty_run(run_dir)  # rank 0's run directory holds the results
    # a signal from here on (Hydra's teardown) is not "before the run started"; a stopped run has no run_dir key
    _launch.finished.append(summary.get("run_dir", str(run_dir)))


# Hydra's own flags (``--cfg job``, ``--info``, ``--help``): Hydra reads the command line itself
_hydra_main = hydra.main(version_base=None, config_path=config_dir(), config_name="train")(_job)


def _start(full: DictConfig, source: ConfigSource) -> None:
    """The run, with its config composed once (``full``: with Hydra's settings under ``hydra``)."""
    run_composed(full, _job, source)


def _exit(code: int, world) -> None:
    """``sys.exit(code)``; a failing rank of an ``mpiexec`` job aborts the job instead: at exit,
    mpi4py's MPI_Finalize would wait for the other ranks, which wait for it, until killed."""
    if code and world.launcher == "mpi" and world.world_size > 1 and "mpi4py.MPI" in sys.modules:
        sys.stderr.flush()
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)
    sys.exit(code)


def _print_summary(summary: dict, who: str) -> None:
    """The summary as stdout's last line; a reader gone (``| head``) stops quietly with the
    shell's 141 and an unwritable stdout (``>/dev/full``) is one line: the run's files hold it."""
    try:
        print(json.dumps(summary), flush=True)
    except OSError as e:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        if isinstance(e, BrokenPipeError):
            sys.exit(128 + signal.SIGPIPE)
        print(f"{who}: error: cannot write the summary to stdout ({e.strerror or e}); it is in "
              f"{summary.get('run_dir', 'the run directory')}/summary.json", file=sys.stderr)
        sys.exit(1)


def _out_of_memory(e: BaseException) -> str | None:
    """The first line of an allocation failure (Python's MemoryError, torch's CPU or CUDA
    allocator), else None."""
    text = re.sub(r"^\[enforce fail at [^\]]*\] [^.]*\. ", "", first_line(e))  # torch's source location
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and (
            "can't allocate memory" in text or "out of memory" in text.lower())):
        return text
    return None


def _peer_lost(e: BaseException) -> str | None:
    """The first line, without gloo's source location, of a collective that failed because
    another rank's connection closed (it died or stopped), else None."""
    lost = re.search(r"^(?:\[[^\]]*\] )?(.*?(?:Connection (?:reset|closed) by peer|Broken pipe))", first_line(e))
    return lost.group(1) if isinstance(e, RuntimeError) and lost else None


def _paths_from_the_launch_directory(cfg: DictConfig) -> None:
    """With ``hydra.job.chdir=true`` the job runs inside its run directory: relative file settings
    still name files from where the command was started (checked there before Hydra started)."""
    if not HydraConfig.get().job.chdir:
        return
    from hydra.utils import to_absolute_path
    from omegaconf import open_dict

    with open_dict(cfg):
        for group, key in (("data", "path"), ("data", "cache_dir"), ("train", "resume")):
            value = cfg[group][key]
            if value and not str(value).startswith("~"):
                cfg[group][key] = to_absolute_path(str(value))


def _check_run_parent(run_dir: Path) -> None:
    """Exit 2 with one line unless ``run_dir`` can be written, or made, and exit 1 when its file
    system is full (Hydra would fail later with a traceback). An existing ``run_dir`` is probed
    itself; otherwise only the parent, removed again if it was made: ``run_dir`` may name the
    time, which Hydra resolves again when it makes the directory."""
    from tgdist.data.graph import unwritable

    try:
        exists = run_dir.exists()
    except OSError as e:  # a name too long for the file system, say
        print(f"tgdist train: error: run_dir={run_dir}: {e.strerror or e}", file=sys.stderr)
        sys.exit(2)
    if exists and not run_dir.is_dir():
        print(f"tgdist train: error: run_dir={run_dir} is a file, not a directory", file=sys.stderr)
        sys.exit(2)
    if exists and (why := unwritable(run_dir)):  # an earlier run's, resumed in place, say
        print(f"tgdist train: error: run_dir={run_dir}: cannot write in it ({why}); give another run_dir",
              file=sys.stderr)
        sys.exit(2)
    if not exists and (why := unwritable(run_dir.parent)):
        print(f"tgdist train: error: run_dir={run_dir}: cannot make a directory in {run_dir.parent} ({why})",
              file=sys.stderr)
        sys.exit(2)
    there = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    free = shutil.disk_usage(there).free
    if free < 1 << 20:  # Hydra's own first writes (.hydra/, train.log) would fail in tracebacks
        print(f"tgdist train: error: run_dir={run_dir}: no space left on its file system ({free / 1024:.0f} KiB "
              f"free)", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    """``_main``, with Ctrl-C (or SIGTERM) before the run starts (while torch is imported, say, or
    Hydra sets up) as one line and exit 130 (143), leaving no run directory, like Ctrl-C during
    the run."""
    from tgdist.cli import numba_threads_error, standard_streams

    standard_streams()  # python -m tgdist.train (torchrun) does not pass through tgdist.cli.main
    _launch.reset()
    if (why := numba_threads_error()) is not None:
        print(f"tgdist train: error: {why}", file=sys.stderr)
        sys.exit(2)
    try:
        from tgdist import plugins
        from tgdist.distributed.world import detect
        from tgdist.kernels.interrupts import stop_on_preemption, terminate_as_interrupt

        plugins.load()  # extensions' stores, pipelines, models, readers: choices before composition

        if detect().world_size == 1:  # ranks keep SIGTERM's default (terminate_as_interrupt)
            terminate_as_interrupt()
        stop_on_preemption()  # SIGUSR1: checkpoint after the iteration under way, exit for a requeue
        try:
            _main()
        finally:
            while _launch.held:  # the run directory's lock (for callers in one process, such as tests)
                os.close(_launch.held.pop())
    except TgdistError as e:  # the launcher's environment (MASTER_PORT=abc), a directory that cannot be made
        print(f"tgdist train: error: {e}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))
    except KeyboardInterrupt as e:
        from tgdist.kernels.interrupts import stopped

        if _launch.run_dir is not None:
            _remove_if_empty_run(_launch.run_dir)
            # the directory itself when it was claimed here and Hydra had not started in it
            remove_empty_dirs(([_launch.run_dir] if _launch.claimed else []) + _launch.new_parents)
        elif _launch.sweep_dir is not None:
            remove_empty_dirs([_launch.sweep_dir, *_launch.new_parents])
        rank = os.environ.get("RANK", "0") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
        words, code = stopped(e)
        when = (f"after its run finished (its results are in {_launch.finished[-1]})" if _launch.finished
                else "before the run started")
        print(f"tgdist train{f' [rank {rank}]' if rank is not None else ''}: {words} {when}", file=sys.stderr)
        sys.exit(code)


def _main() -> None:
    """Check the overrides (and the run directory) before Hydra starts, then hand over to it."""
    from tgdist.config.overrides import override_value, resumed_run_dir
    from tgdist.distributed.world import detect
    from tgdist.runtime.rundir import claim_directory

    from tgdist.runtime.build import load_strategies

    def precheck(cfg):  # a job of a sweep: composed and validated once, here (``_composed``)
        from tgdist.runtime.build import precheck as check_settings

        _launch.jobs.append((cfg, check_settings(cfg)))

    if os.environ.get("TORCHELASTIC_RUN_ID") and sys.platform.startswith("linux"):
        _stop_with_the_agent()
    if os.environ.get("TGDIST_PREEMPTED"):  # torchrun restarted the group after the preemption notice
        from tgdist.kernels.interrupts import PREEMPTED_EXIT

        print(f"tgdist train: not started: the job was preempted (SIGUSR1); exiting {PREEMPTED_EXIT} for it to be "
              f"requeued", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT)
    if sys.argv[1:] in (["--version"], ["-V"]):  # tgdist's, not Hydra's (as ``tgdist train --version``)
        from tgdist import version_line

        print(version_line())
        return
    argv = _continue_a_restart(_hydra_run_dir_as_run_dir(sys.argv[1:]))
    if {"-m", "--multirun"} & set(argv) and detect().world_size > 1:  # each rank would sweep alone
        print("tgdist train: error: --multirun inside a parallel job runs the sweep in every rank; sweep with "
              "tgdist launch -- --multirun ... (one launch per job)", file=sys.stderr)
        sys.exit(2)
    load_strategies()  # every store and pipeline with its config class, before the first composition
    # composed once (a resume with its run's config.yaml, given keys on top) and checked here,
    # before anything is written into the run directory; the run starts with this config
    args, full, sweep = precheck_command("tgdist train", "train", argv, precheck, __file__, return_hydra_config=True)
    cfg = None if full is None else without_hydra(full)
    if sweep is not None:  # every job's settings are valid; Hydra gets the directory checked here
        _launch.sweep_dir = Path(sweep.dir).absolute()
        _launch.sweep_size, _launch.swept = len(sweep.jobs), sweep.swept
        _check_sweep_dir(_launch.sweep_dir, all(str(override_value(job, "train.overwrite")).lower() == "true"
                                                for job in sweep.jobs))
        _launch.new_parents[:] = [p for p in (_launch.sweep_dir, *_launch.sweep_dir.parents) if not p.exists()]
        if override_value(args.overrides, "hydra.sweep.dir") is None:
            _launch.sweep_dir = claim_directory(_launch.sweep_dir)  # a sweep started in the same second has its own
            _launch.new_parents[:] = [_launch.sweep_dir,
                                      *(p for p in _launch.new_parents if p in _launch.sweep_dir.parents)]
            sweep.set_dir(str(_launch.sweep_dir))
        run_sweep(sweep, _job, ConfigSource.of(args, "train", __file__))
        return
    if cfg is None or args.cfg or args.help or args.hydra_help or args.info:  # Hydra's own flags
        sys.argv[1:] = argv  # (Hydra reads the command line itself)
        _hydra_main()
        return
    given = override_value(args.overrides, "run_dir") is not None
    resumed = resumed_run_dir(cfg.train.resume)
    if resumed is not None and not given:  # continue in place
        _set_run_dir(full, cfg, str(resumed))
        given = True
    run_dir = Path(cfg.run_dir).absolute()
    _launch.new_parents[:] = [p for p in run_dir.parents if not p.exists()]
    _check_run_parent(run_dir)
    _launch.choices = _check_resume(cfg)
    _launch.cfg = cfg
    rank = detect().rank
    if given and rank == 0 and run_dir.is_dir():  # a run still going holds it: said before what it holds
        _hold_run_dir(run_dir)
    try:  # every rank: each says it in one line
        rundir.check_foreign(run_dir, cfg.train.overwrite)
        rundir.check_replace(run_dir, cfg.train.overwrite, cfg.train.resume)
    except TgdistError as e:
        print(f"tgdist train: error: {e}", file=sys.stderr)
        sys.exit(2)
    # a name that holds the time (the default) is resolved once, here: Hydra would resolve it again
    timed = not given or "${" in str(override_value(args.overrides, "run_dir"))
    _launch.run_dir = run_dir
    if rank > 0:  # writes into rank 0's directory, told when the ranks meet: each rank has its own clock
        _launch.run_dir = None if timed else run_dir  # (known here only to name it when stopped)
        _launch.elsewhere = True  # Hydra writes nothing: no .hydra/, its log file is the null device
        with open_dict(full.hydra):
            full.hydra.run.dir = tempfile.gettempdir()
            full.hydra.output_subdir = None
            full.hydra.job_logging.handlers.file.filename = os.devnull
    else:
        if not given:  # the default name: NAME-2 where a run of the same second has NAME
            _launch.run_dir, _launch.claimed = claim_directory(run_dir), True
        if timed:
            _set_run_dir(full, cfg, str(_launch.run_dir))
        rundir.claim(_launch.run_dir, cfg.train.overwrite, made=True if _launch.claimed else None)
        if not _launch.held:  # (a directory given and there is held since the check above)
            _hold_run_dir(_launch.run_dir)
    _start(full, ConfigSource.of(args, "train", __file__))


def _set_run_dir(full: DictConfig, cfg: DictConfig, run_dir: str) -> None:
    """``run_dir`` of the composed run (``hydra.run.dir`` follows it), said among its overrides in
    ``.hydra/overrides.yaml`` as a command line naming it would have it."""
    from tgdist.config.overrides import quoted

    full.run_dir = cfg.run_dir = run_dir
    with open_dict(full.hydra):
        task = [o for o in full.hydra.overrides.task if o.partition("=")[0].lstrip("+") != "run_dir"]
        full.hydra.overrides.task = [*task, f"run_dir={quoted(run_dir)}"]


def _continue_a_restart(argv: list[str]) -> list[str]:
    """``argv`` for a restarted start of a run (torchrun's ``--max-restarts``, a requeued SLURM
    job, a start after the preemption signal; ``rundir.restarted``): with ``train.resume`` set to
    its folder when that holds a checkpoint, else with ``train.overwrite=true`` (the earlier start
    left its start-up files and no result: the run starts afresh there). Every rank decides alike,
    from the folder as the earlier start left it; rank 0 records the restart. A restart from the
    same checkpoint as the ``MAX_IDLE_RESTARTS`` before it is refused (``check_restart_loop``)."""
    from tgdist.config.overrides import override_value, quoted
    from tgdist.distributed.world import detect

    given = override_value(argv, "run_dir")
    if {"-m", "--multirun"} & set(argv) or given is None or "${" in given:  # a new folder each start
        return argv
    r = rundir.restarted(Path(given.strip("'\"")).expanduser())
    if r is None:
        return argv
    rundir.check_restart_loop(r)
    if detect().rank == 0:
        rundir.record_restart(r)
    _launch.restart = r
    key, value = ("train.resume", quoted(str(r.path))) if r.checkpoint is not None else ("train.overwrite", "true")
    return [a for a in argv if a.partition("=")[0].lstrip("+~") != key] + [f"{key}={value}"]


def _check_sweep_dir(sweep_dir: Path, overwrite: bool) -> None:
    """Exit 2 with one line when a given sweep directory holds files that are not tgdist's (its
    ``multirun.yaml`` and job folders); note what the job folders there hold."""
    if not sweep_dir.is_dir():
        return
    ours = {"multirun.yaml"} | {p.name for p in sweep_dir.iterdir() if p.is_dir() and rundir.is_run_dir(p)}
    others = sorted(p.name for p in sweep_dir.iterdir() if p.name not in ours)
    if others and not overwrite:
        print(f"tgdist train: error: hydra.sweep.dir={sweep_dir} holds files that are not a tgdist sweep's "
              f"({', '.join(others[:4])}{' ...' if len(others) > 4 else ''}); give a new or empty directory, or "
              f"train.overwrite=true to write into it", file=sys.stderr)
        sys.exit(2)
    held = sorted((p.name for p in sweep_dir.iterdir() if p.is_dir() and rundir.held_run(p)), key=_job_order)
    if held and not overwrite:  # a job would replace the earlier sweep's run in its folder
        print(f"tgdist train: error: hydra.sweep.dir={sweep_dir} holds the runs of an earlier sweep (job folders "
              f"{', '.join(held[:4])}{' ...' if len(held) > 4 else ''}); give a new hydra.sweep.dir, or "
              f"train.overwrite=true to replace them", file=sys.stderr)
        sys.exit(2)
    _launch.sweep_jobs_before.update({p.name: frozenset(q.name for q in p.iterdir())
                                      for p in sweep_dir.iterdir() if p.is_dir()})


def _job_order(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _hold_run_dir(run_dir: Path) -> None:
    """Lock ``run_dir`` for this run (an flock on the directory, released when the process ends),
    or exit 2 with one line when another process holds it: two runs given one run_dir, or a
    resume of a run still going, wrote one metrics.jsonl and removed each other's checkpoint temp
    files. A file system without locks (some network mounts) is left unlocked."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        print(f"tgdist train: error: run_dir={run_dir} is in use by another tgdist run that has not ended; give "
              f"another run_dir, or resume it once that run has stopped", file=sys.stderr)
        sys.exit(2)
    except OSError:
        os.close(fd)
        return
    _launch.held.append(fd)


def _hydra_run_dir_as_run_dir(argv: list[str]) -> list[str]:
    """``hydra.run.dir=X`` as ``run_dir=X``: Hydra's run directory is ``${run_dir}``, and given
    alone it would leave the config recording another directory (and a default one claimed, empty)."""
    if {"-m", "--multirun"} & set(argv):  # a sweep's jobs go to hydra.sweep.dir
        return argv
    def key(arg: str) -> str:
        return arg.partition("=")[0].lstrip("+")

    if not any(key(a) == "hydra.run.dir" for a in argv):
        return argv
    if any(key(a) == "run_dir" for a in argv):
        print("tgdist train: error: give run_dir=DIR or hydra.run.dir=DIR, not both (the run directory is "
              "run_dir, which hydra.run.dir follows)", file=sys.stderr)
        sys.exit(2)
    return [f"run_dir={a.partition('=')[2]}" if key(a) == "hydra.run.dir" else a for a in argv]


def _stop_with_the_agent() -> None:
    """A rank started by torchrun runs in a session of its own: were the agent killed (SIGKILL),
    it would train on alone and end minutes later in a broken-pipe crash of its process group.
    SIGTERM when the agent dies stops it at once (its daemon follows it, as for any dead trainer)."""
    from tgdist.launcher.launch import set_parent_death_signal

    agent = os.getppid()
    set_parent_death_signal()
    if os.getppid() != agent:  # it died before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)


def _check_resume(cfg):
    """Exit 2 with one line when ``train.resume`` names a checkpoint of another config, before
    Hydra writes its ``.hydra/`` into the run directory (often the checkpoint's own). The settings
    are validated for it, once: returns what that resolved (None without a resume: the run
    validates them)."""
    if not cfg.train.resume:
        return None
    from tgdist.runtime import checkpoint
    from tgdist.runtime.build import validate

    try:
        choices = validate(cfg)
        checkpoint.check_resume(cfg, choices.backend)
    except TgdistError as e:
        print(f"tgdist train: error: {e}", file=sys.stderr)
        sys.exit(2)
    return choices


if __name__ == "__main__":
    main()
