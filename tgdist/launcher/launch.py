"""``tgdist launch``: start ``tgdist.train`` under torchrun on this machine (one node of several).

    tgdist launch --nproc 4 -- data=wikipedia parallel.i=2 parallel.k=2 memory.backend=daemon
    tgdist launch --nproc 8 --nnodes 2 --node-rank 0 --master-addr node01 -- ...   (on each node)
    tgdist launch --max-parallel 2 -- -m parallel.i=1,2 parallel.k=1,2             (a sweep, ``_sweep``)
    tgdist launch -- -m parallel.i=1,2 hydra/launcher=submitit_slurm              (one SLURM job per point)
    tgdist launch --nproc 2 --max-restarts 3 -- run_dir=runs/a ...      (a dead rank restarts the group; it resumes)
    tgdist launch --slurm --nnodes 2 --nproc 4 -- run_dir=runs/a ...    (sbatch slurm/multinode_gpu.sbatch, requeued
                                                                         on preemption; ``slurm_command``)

builds and runs

    python -m torch.distributed.run --nproc-per-node N --nnodes M --node-rank R \
        --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID --max-restarts 0 -m tgdist.train ...

``--dry-run`` prints that command instead. ``--max-restarts N`` is torchrun's: a rank that dies makes
the group restart, up to N times, and the new ranks resume from the run folder's last checkpoint
(``tgdist.runtime.rundir.restarted``). SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 received by
the launcher are forwarded to torchrun (which stops its workers; SIGTERM and SIGHUP as SIGINT, on
which a rank stops as on Ctrl-C). The launcher returns torchrun's
exit code, or 128 + the signal number when it died of a signal or failed after one was forwarded
(torchrun itself exits 1 then), with a last line naming the signal; SIGUSR1, the preemption
notice, has the ranks checkpoint and exit 75, which is returned as it is.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tgdist.errors import ConfigError

__all__ = ["build_command", "slurm_command", "parallel_overrides", "main"]

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# Forwarded as SIGINT: a rank stops on it as on Ctrl-C (its line naming the checkpoint, an empty run
# directory removed), where SIGTERM's default kills it without a word. Ranks keep that default for
# a SIGTERM sent to them directly (terminate_as_interrupt says why).
_AS_CTRL_C = (signal.SIGTERM, signal.SIGHUP)
DEFAULT_MULTINODE_PORT = 29500
_LOOPBACK = "127.0.0.1"
_PARALLEL = re.compile(r"\+{0,2}parallel\.([ijk])=(\S+)")  # parallel.i=2, +parallel.k=4


def parallel_overrides(overrides: list[str]) -> dict[str, int]:
    """``parallel.i/j/k`` given on the command line (``parallel.i=2``, ``+parallel.k=4``)."""
    out = {}
    for ov in overrides:
        m = _PARALLEL.fullmatch(ov.strip())
        if m and not m.group(2).strip("'\"").startswith("${"):  # an interpolation: the composed config resolves it
            try:
                out[m.group(1)] = int(m.group(2))
            except ValueError:
                raise ConfigError(f"{ov!r}: parallel.{m.group(1)} must be an integer") from None
    return out


def _free_port() -> int:
    """A port free now and not reserved by another tgdist launch on this machine (``_reserve``)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if _reserve(port):
            return port
    raise ConfigError("found no free port for the ranks' rendezvous: name one with --master-port")


# Ports this launcher has reserved (``_reserve``): port -> the socket holding the reservation.
_reserved: dict[int, socket.socket] = {}


def _reserve(port: int) -> bool:
    """Reserve ``port`` among the tgdist launches of this machine while this launcher lives, by
    binding an abstract Unix socket named after it (Linux; elsewhere always True). A port found
    free stays free only until torchrun binds it: a second launch given the same port in that
    gap joined the first launch's rendezvous, waited for it to end and failed. False when
    another launch holds it."""
    if port in _reserved or not sys.platform.startswith("linux"):
        return True
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0tgdist-launch-port-{port}")
    except OSError:
        s.close()
        return False
    _reserved[port] = s
    return True


def _check_port_free(addr: str, port: int) -> None:
    """One line when ``port`` is taken on this machine: torchrun's store would wait for it, then
    fail with a long traceback (and another launch on it would wait for that one to end)."""
    host = _LOOPBACK if addr in ("localhost", "") else addr
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # another machine's address (not bindable here), or not IPv4: not probed
            raise ConfigError(f"--master-port {port} is in use on {addr} ({e.strerror or e}); another launch may "
                              f"hold it: leave --master-port out (a free port is picked) or name another") from None


def build_command(nproc: int, overrides: list[str], *, nnodes: int = 1, node_rank: int = 0,
                  master_addr: str = "127.0.0.1", master_port: int = DEFAULT_MULTINODE_PORT,
                  module: str = "tgdist.train", python: str | None = None, rdzv_id: str = "tgdist",
                  max_restarts: int = 0) -> list[str]:
    """The torchrun command line (a pure function of its arguments)."""
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ConfigError(f"--nproc {nproc}, --nnodes {nnodes}, --node-rank {node_rank}: need nproc >= 1 and 0 <= node-rank < nnodes")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts}: give 0 or more")
    if not 0 < master_port < 65536:
        raise ConfigError(f"--master-port {master_port} is not a TCP port")
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--nnodes", str(nnodes),  # no --node-rank: c10d's rendezvous numbers the machines (torchrun warns)
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{master_addr}:{master_port}",
        "--rdzv-id", rdzv_id,
        "--max-restarts", str(max_restarts),
        "-m", module,
        *overrides,
    ]


def slurm_template() -> Path:
    """``slurm/multinode_gpu.sbatch`` of a clone, or the copy a wheel carries as ``tgdist/slurm``."""
    here = Path(__file__).resolve().parents[1]  # tgdist/
    for candidate in (here / "slurm", here.parent / "slurm"):
        if (candidate / "multinode_gpu.sbatch").is_file():
            return candidate / "multinode_gpu.sbatch"
    raise ConfigError(f"the sbatch templates are not found next to {here} (slurm/multinode_gpu.sbatch); submit it "
                      f"yourself with sbatch")


def slurm_command(nproc: int, overrides: list[str], *, nnodes: int = 1, signal_seconds: int = 120,
                  max_restarts: int = 0, sbatch_args: list[str] = (), template: Path | None = None,
                  python: str | None = None) -> list[str]:
    """The ``sbatch`` command of ``tgdist launch --slurm`` (a pure function of its arguments): the
    torchrun template on ``nnodes`` nodes with ``nproc`` trainers each, requeued when preempted
    (``--requeue``; the batch shell gets SIGUSR1 ``signal_seconds`` before the end, forwards it, and
    the run checkpoints and is requeued: docs/parallel-training.md, "Preemptible clusters")."""
    if signal_seconds < 1:
        raise ConfigError(f"--signal-seconds {signal_seconds}: give at least 1 (seconds before the job's end, time "
                          f"enough to finish an iteration and write a checkpoint)")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts}: give 0 or more")
    exports = f"ALL,NPROC_PER_NODE={nproc},MAX_RESTARTS={max_restarts},PYTHON={python or sys.executable}"
    return ["sbatch", "--nodes", str(nnodes), "--requeue", f"--signal=B:USR1@{signal_seconds}",
            f"--export={exports}", *sbatch_args, str(template or slurm_template()), *overrides]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tgdist launch",
        description="Run tgdist training under torchrun on this machine. Arguments after '--' are Hydra "
                    "overrides for tgdist.train.",
        epilog="example: tgdist launch --nproc 4 -- data=wikipedia parallel.i=2 parallel.k=2",
    )
    ap.add_argument("--nproc", type=int, default=None,
                    help="trainer processes on this machine (default: parallel.i*j*k / nnodes from the overrides)")
    ap.add_argument("--nnodes", type=int, default=1, help="machines taking part (run the same command on each)")
    ap.add_argument("--node-rank", type=int, default=0,
                    help="this machine's index in [0, nnodes); with torchrun's c10d rendezvous ranks are assigned "
                         "as machines join, so it only has to be valid")
    ap.add_argument("--master-addr", default=_LOOPBACK, help="host of the c10d rendezvous (node 0)")
    ap.add_argument("--master-port", type=int, default=None,
                    help=f"rendezvous port (default: a free port on one node, {DEFAULT_MULTINODE_PORT} on several)")
    ap.add_argument("--max-parallel", type=int, default=1, metavar="N",
                    help="a sweep (-m): run up to N jobs side by side on this machine, each on CPUs of its own "
                         "(default 1: one after another)")
    ap.add_argument("--max-restarts", type=int, default=0, metavar="N",
                    help="torchrun's: restart the ranks up to N times when one fails; they resume from the run "
                         "folder's last checkpoint (give run_dir=; default 0)")
    ap.add_argument("--slurm", action="store_true",
                    help="submit the run as a SLURM job (sbatch slurm/multinode_gpu.sbatch on --nnodes nodes, --nproc "
                         "trainers each), requeued and resumed when preempted")
    ap.add_argument("--signal-seconds", type=int, default=120, metavar="S",
                    help="with --slurm: SLURM signals the job S seconds before its end to checkpoint (default 120)")
    ap.add_argument("--sbatch", action="append", default=[], metavar="ARG",
                    help="with --slurm: one more sbatch argument (--sbatch=--time=4:00:00; repeat for several)")
    ap.add_argument("--module", default="tgdist.train", help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (after '--')")
    return ap


def set_parent_death_signal() -> None:
    """In the child: get SIGTERM if the launcher dies (Linux), since it runs in its own session
    (also a rank that ``torchrun`` started: ``tgdist train`` under an agent)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except Exception:  # not Linux: the child simply outlives a killed launcher
        pass


def run_forwarding_signals(cmd: list[str]) -> int:
    """Run ``cmd`` in its own session, forward the launcher's signals to it, return its exit code."""
    child = subprocess.Popen(cmd, start_new_session=True,
                             preexec_fn=set_parent_death_signal if sys.platform.startswith("linux") else None)
    previous, received = {}, []

    def forward(signum, _frame):
        received.append(signum)
        if child.poll() is None:  # torchrun passes the signal on to the ranks; they stop cleanly on SIGINT
            child.send_signal(signal.SIGINT if signum in _AS_CTRL_C else signum)

    for sig in FORWARDED_SIGNALS:
        previous[sig] = signal.signal(sig, forward)
    try:
        while True:
            try:
                rc = child.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait() itself
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if rc < 0:
        if not received:  # killed from outside (the OOM killer, kill -9): its ranks stop with it
            print(f"tgdist launch: torchrun was killed by {signal.Signals(-rc).name}; its ranks stop with it",
                  file=sys.stderr, flush=True)
        return 128 - rc
    from tgdist.kernels.interrupts import PREEMPTED_EXIT  # (numba's import: not for every launch's start)

    if rc == PREEMPTED_EXIT and received and received[0] == signal.SIGUSR1:  # the ranks checkpointed on it
        return rc
    if rc and received:  # torchrun stops its workers on a forwarded signal and exits 1
        how = " as SIGINT" if received[0] in _AS_CTRL_C else ""
        print(f"tgdist launch: stopped by {signal.Signals(received[0]).name}, forwarded to torchrun{how}",
              file=sys.stderr, flush=True)
        return 128 + received[0]
    return rc


def _check_args(args: argparse.Namespace) -> None:
    """The launcher's own numbers, each named alone; a warning where several machines would meet on
    the loopback address (only right when every "machine" is this one, as in a rehearsal)."""
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: give at least 1 process")
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes}: give at least 1 machine")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank}: give 0 .. {args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.max_parallel < 1:
        raise ConfigError(f"--max-parallel {args.max_parallel}: give at least 1")
    if args.max_parallel > 1 and args.nnodes > 1:
        raise ConfigError(f"--max-parallel runs a sweep's jobs side by side on this machine; with --nnodes {args.nnodes} "
                          f"they run one after another")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ConfigError(f"--master-port {args.master_port} is not a TCP port")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: give 0 or more")
    if not args.slurm and (args.sbatch or args.signal_seconds != 120):
        raise ConfigError(f"{'--sbatch' if args.sbatch else '--signal-seconds'} is for --slurm (a SLURM job)")
    if args.slurm and (args.node_rank or args.master_port is not None or args.master_addr != _LOOPBACK
                       or args.max_parallel != 1):
        raise ConfigError("--slurm: the job's nodes meet at the first node of its allocation; leave --node-rank, "
                          "--master-addr, --master-port and --max-parallel out")
    if args.slurm:
        return
    if args.nnodes > 1 and args.master_addr == _LOOPBACK:
        print(f"tgdist launch: warning: --nnodes {args.nnodes} without --master-addr: the rendezvous is on "
              f"{_LOOPBACK}, which only processes on this machine can reach; give node 0's host name",
              file=sys.stderr, flush=True)


def _check_world(args: argparse.Namespace, cfg, nproc: int, choices) -> None:
    """The layout against the world torchrun will start (the memory backend's needs, epochs a
    multiple of j x k), as every rank checks it at start-up: one line here instead of one per
    rank after each has imported torch and read the data. ``choices``: what the config's
    validation resolved (``tgdist.runtime.build.Resolved``)."""
    from tgdist.distributed.world import WorldInfo
    from tgdist.distributed.world import validate as validate_world

    layout, backend, placement = choices.layout, choices.backend, choices.store.placement
    if layout.world_size != nproc * args.nnodes:
        return  # _nproc has said so, or a single-process run
    world = WorldInfo(world_size=nproc * args.nnodes, local_world_size=nproc, num_nodes=args.nnodes,
                      launcher="torchrun")
    validate_world(layout, world, backend, placement=placement, epochs=cfg.train.epochs)
    if layout.k > 1:  # the stream must cut into k segments of whole global batches: that needs its size
        import logging

        from tgdist.data.graph import chronological_split
        from tgdist.data.load import load_data

        quiet = logging.getLogger("tgdist")
        level, quiet.level = quiet.level, logging.ERROR  # the ranks report the reader's warnings themselves
        try:
            graph = load_data(cfg.data)  # cached for the ranks, which read it next
        finally:
            quiet.setLevel(level)
        train_end = chronological_split(graph, cfg.data.val_frac, cfg.data.test_frac).train_end
        validate_world(layout, world, backend, placement=placement, num_train_events=train_end,
                       batch_size=cfg.train.batch_size)


def _check_flags(overrides: list[str]) -> None:
    """Flags after ``--`` are Hydra's: a bad one is its usage message once, not once per rank."""
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in overrides):
        from hydra._internal.utils import get_args_parser

        get_args_parser().parse_args(overrides)  # argparse: usage and the error on stderr, exit 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    _check_args(args)
    if args.module == "tgdist.train":
        _check_flags(args.overrides)
    if not {"-m", "--multirun"} & set(args.overrides):
        nproc = None
        if args.module == "tgdist.train":  # settings errors once, here, not from every rank after start-up
            from tgdist.config.overrides import precheck_overrides
            from tgdist.runtime.build import load_strategies, precheck

            load_strategies()  # (each store and pipeline has its own config class)
            cfg = precheck_overrides("tgdist launch", "train", args.overrides)
            if cfg is not None:
                choices = precheck(cfg)
                if cfg.run_dir:  # a folder of other files, or of another run: refused once, here, not by every rank
                    from tgdist.runtime.rundir import check_foreign, check_replace, restarted

                    check_foreign(Path(cfg.run_dir).absolute(), cfg.train.overwrite)
                    if restarted(Path(cfg.run_dir).absolute()) is None:  # (a run stopped by the preemption
                        # signal: its ranks resume it, tgdist.cli.train._continue_a_restart)
                        check_replace(Path(cfg.run_dir).absolute(), cfg.train.overwrite, cfg.train.resume)
                nproc = _nproc(args, _layout(args, cfg, args.overrides))
                _check_world(args, cfg, nproc, choices)
                if cfg.train.resume:  # a checkpoint of another config or epochs, before any process starts
                    from tgdist.runtime import checkpoint

                    checkpoint.check_resume(cfg, choices.backend)
                if args.slurm:
                    return _submit(args, cfg, nproc)
                return _launch_in_own_directory(args, cfg, nproc)
        if args.slurm:
            return _submit(args, None, nproc)
        return _launch(args, args.overrides, nproc)
    if args.slurm:
        raise ConfigError("--slurm submits one run; a sweep with one SLURM job per point is "
                          "tgdist launch -- -m ... hydra/launcher=submitit_slurm")
    return _sweep(args, [a for a in args.overrides if a not in ("-m", "--multirun")])


def _submit(args: argparse.Namespace, cfg, nproc: int | None) -> int:
    """``--slurm``: ``sbatch`` the torchrun template (``slurm_command``); sbatch's own output (the
    job id) is passed on. A run without ``run_dir=`` gets the default name resolved now, so that
    every start of the job (a requeue) writes into one folder and resumes there."""
    from tgdist.config.overrides import override_value, quoted

    nproc = nproc or _nproc(args, parallel_overrides(args.overrides))
    overrides = list(args.overrides)
    if cfg is not None and override_value(overrides, "run_dir") is None and cfg.run_dir:
        overrides.append(f"run_dir={quoted(str(Path(cfg.run_dir).absolute()))}")
    cmd = slurm_command(nproc, overrides, nnodes=args.nnodes, signal_seconds=args.signal_seconds,
                        max_restarts=args.max_restarts, sbatch_args=args.sbatch)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    print(f"tgdist launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        return subprocess.run(cmd).returncode
    except FileNotFoundError:
        raise ConfigError("--slurm: sbatch is not on PATH (run on a SLURM login node)") from None


def _launch_in_own_directory(args: argparse.Namespace, cfg, nproc: int) -> int:
    """One launch whose run directory has the default name (the time to the second) claims it
    first and hands it to the ranks: launches started in the same second wrote into one directory,
    the later one's results replacing the other's without a word. A directory the user names, a
    resumed run's own, a dry run and a launch of one machine among several are left as they are."""
    from tgdist.config.overrides import override_value, quoted
    from tgdist.runtime.rundir import claim_directory, remove_empty_dirs

    overrides = args.overrides
    if (override_value(overrides, "run_dir") is not None or cfg.train.resume or args.dry_run
            or args.nnodes > 1 or not cfg.run_dir):
        return _launch(args, overrides, nproc)
    wanted = Path(cfg.run_dir).absolute()
    new_parents = [p for p in wanted.parents if not p.exists()]
    run_dir = claim_directory(wanted)
    try:
        return _launch(args, [*overrides, f"run_dir={quoted(str(run_dir))}"], nproc)
    finally:
        remove_empty_dirs([run_dir, *new_parents])  # a launch that failed before writing anything


def _sweep(args: argparse.Namespace, overrides: list[str]) -> int:
    """``--multirun``: one torchrun per job of the sweep, each with the process count its layout
    needs, every job checked first. Job N runs in ``multirun/<time>/N``, or in ``RUN_DIR/N`` when
    ``run_dir`` is given, and ``sweep.json`` there lists the jobs. One after another by default,
    stopping at the first job that fails; ``--max-parallel N`` runs up to N side by side, each on
    CPUs of its own (a failed job then lets the running ones end and starts no other). With ``hydra/launcher=submitit_slurm``
    every job is a SLURM job instead (``slurm_sweep``)."""
    import time

    from tgdist.config.overrides import jobs_not_run, override_value, sweep_jobs, swept_values
    from tgdist.runtime.build import load_strategies, precheck
    from tgdist.runtime.rundir import claim_directory, remove_empty_dirs

    composed = []  # each job's config, in the sweep's order
    resolved = []  # ... and what its validation resolved

    slurm = _slurm_launcher(overrides)
    load_strategies()  # (each store and pipeline has its own config class)

    def check(cfg) -> None:
        choices = precheck(cfg)
        composed.append(cfg)
        resolved.append(choices)
        if not slurm and (par := _layout(args, cfg, [])):  # else the job's own overrides decide (below)
            _check_world(args, cfg, _nproc(args, par), choices)

    if slurm:
        from tgdist.launcher.slurm_sweep import check_launcher_overrides

        check_launcher_overrides(overrides)
    jobs, swept = sweep_jobs("tgdist launch", "train", overrides, check if args.module == "tgdist.train" else None)
    nprocs: list[int | None] = []
    for num, job in enumerate(jobs):  # the process counts, before anything starts
        try:
            if composed:  # on SLURM every job's layout is its own (no --nproc to default to)
                cfg = composed[num]
                par = {k: int(cfg.parallel[k]) for k in "ijk"} if slurm else _layout(args, cfg, job)
            else:
                par = {}
            nprocs.append(_nproc(args, par or parallel_overrides(job)))
        except ConfigError as e:
            raise ConfigError(f"{e} (sweep job #{num}: {swept_values(job, swept)})") from None
    base = override_value(overrides, "run_dir")
    made: list[Path] = []  # folders this sweep made, removed again if no job left anything in them
    if base is None:
        base = Path(f"multirun/{time.strftime('%Y%m%d-%H%M%S')}")
        if not args.dry_run:  # a sweep started in the same second takes NAME-2
            new_parents = [p for p in base.parents if not p.exists()]
            base = claim_directory(base)
            made = [base, *new_parents]
    jobs = [[a for a in job if a.partition("=")[0].lstrip("+") != "run_dir"] + [f"run_dir={base}/{num}"]
            for num, job in enumerate(jobs)]
    record = None
    if not args.dry_run:
        record, new = _record_sweep(Path(base), jobs, swept, composed)
        made = made or new
    rc = 1
    try:
        if slurm:
            rc = _sweep_on_slurm(args, jobs, swept, composed, Path(base), resolved)
        elif args.max_parallel > 1 and not args.dry_run:
            rc = _sweep_side_by_side(args, jobs, swept, nprocs)
        else:
            for num, job in enumerate(jobs):
                if not args.dry_run:
                    print(f"tgdist launch: sweep job #{num} of {len(jobs)}: "
                          f"{swept_values(job, swept) or '(no swept keys)'}", file=sys.stderr, flush=True)
                rc = _launch(args, job, nprocs[num])
                if rc:
                    print(f"tgdist launch: sweep stopped: job #{num} exited with {rc}"
                          f"{jobs_not_run(num, len(jobs))}", file=sys.stderr, flush=True)
                    break
        return rc
    finally:
        if rc and not any(Path(base, str(n)).exists() for n in range(len(jobs))):
            if record is not None:  # no job left anything: neither does the sweep
                record.unlink(missing_ok=True)
            remove_empty_dirs(made)


def _record_sweep(base: Path, jobs: list[list[str]], swept: list[str], composed: list) -> tuple[Path, list[Path]]:
    """``BASE/sweep.json``: every job's number, swept values, overrides and layout, so that
    ``tgdist report`` names the jobs that left no run directory (a run that fails removes its own).
    Returns its path and the folders made for it, deepest first."""
    import json

    from tgdist.config.overrides import swept_values
    from tgdist.runtime.results import SWEEP_RECORD

    points = [{"num": num, "swept": swept_values(job, swept), "overrides": job,
               "layout": [int(composed[num].parallel[k]) for k in "ijk"] if composed else None}
              for num, job in enumerate(jobs)]
    path = base / SWEEP_RECORD
    new = [p for p in [base, *base.parents] if not p.exists()]
    try:
        base.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"points": points}, indent=1) + "\n")
    except OSError as e:
        from tgdist.runtime.rundir import remove_empty_dirs

        remove_empty_dirs(new)
        raise ConfigError(f"{path}: cannot write the sweep's record ({e.strerror or e})") from None
    return path, new


def _slurm_launcher(overrides: list[str]) -> bool:
    """Whether the sweep chooses Hydra's submitit SLURM launcher (``hydra/launcher=submitit_slurm``,
    or a config of that group built on it, such as ``slurm_example``); another launcher than Hydra's
    basic one is refused, since this command starts the jobs itself."""
    from tgdist.config.overrides import checked_compose
    from tgdist.launcher.slurm_sweep import LAUNCHER_TARGET

    chosen = [o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+") == "hydra/launcher"]
    if not chosen or chosen[-1] == "basic":
        return False
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
        import submitit  # noqa: F401
    except ImportError:
        raise ConfigError(f"hydra/launcher={chosen[-1]} needs hydra-submitit-launcher and submitit: "
                          f"pip install 'tgdist[slurm]'") from None
    target = checked_compose([f"hydra/launcher={chosen[-1]}"], return_hydra_config=True).hydra.launcher.get("_target_")
    if target != LAUNCHER_TARGET:
        raise ConfigError(f"hydra/launcher={chosen[-1]}: tgdist launch runs a sweep's jobs on this machine, or one "
                          f"SLURM job each with hydra/launcher=submitit_slurm")
    return True


def _sweep_on_slurm(args: argparse.Namespace, jobs: list[list[str]], swept: list[str], composed: list,
                    base: Path, resolved: list) -> int:
    """One SLURM job per point (``tgdist.launcher.slurm_sweep``), its tasks read from its layout
    (``resolved``: what each job's validation resolved)."""
    from omegaconf import OmegaConf

    from tgdist.config.overrides import checked_compose, swept_values
    from tgdist.launcher import slurm_sweep

    if args.module != "tgdist.train" or args.nproc is not None or args.nnodes != 1:
        raise ConfigError("hydra/launcher=submitit_slurm reads each job's processes and nodes from its layout: "
                          "leave --nproc and --nnodes out")
    if args.max_parallel != 1:
        raise ConfigError("--max-parallel is for sweeps on this machine; SLURM runs a sweep's jobs as it schedules them")
    hydra_cfg = checked_compose([*jobs[0], f"hydra.sweep.dir={base.absolute()}"], return_hydra_config=True).hydra
    launcher = OmegaConf.to_container(hydra_cfg.launcher, resolve=True)
    points = []
    for job, cfg in zip(jobs, composed):
        train = [a for a in job if not a.partition("=")[0].lstrip("+").startswith(("hydra/launcher", "hydra.launcher."))]
        run_dir = str(Path(train[-1].removeprefix("run_dir=")).absolute())
        points.append(([*train[:-1], f"run_dir={run_dir}"], {k: int(cfg.parallel[k]) for k in "ijk"},
                       swept_values(job, [s for s in swept if not s.startswith("hydra")])))

    def check_world(num: int, layout: dict, res) -> None:
        from tgdist.distributed.world import WorldInfo
        from tgdist.distributed.world import validate as validate_world

        choices = resolved[num]  # (its layout is the job's: ``layout`` was read from the same config)
        world = WorldInfo(world_size=res.tasks, local_world_size=res.tasks_per_node, num_nodes=res.nodes,
                          launcher="slurm")
        validate_world(choices.layout, world, choices.backend, placement=choices.store.placement,
                       epochs=composed[num].train.epochs)

    if args.dry_run:
        for num, (train, layout, where) in enumerate(points):
            res = slurm_sweep.point_resources(layout["i"] * layout["j"] * layout["k"], launcher.get("gpus_per_node"),
                                              int(launcher.get("nodes") or 1))
            check_world(num, layout, res)
            params = slurm_sweep.executor_parameters(launcher, res, f"tgdist-{num}")
            settings = " ".join(f"{k.removeprefix('slurm_')}={v}" for k, v in params.items()
                                if v not in (None, {}, []))
            print(f"sweep job #{num} ({where or 'no swept keys'}): SLURM job with {settings}; each of its "
                  f"{res.tasks} task(s) runs python -m tgdist.train {shlex.join(train)}")
        return 0
    return slurm_sweep.run_sweep(points, launcher, base, check_world)


def _sweep_side_by_side(args: argparse.Namespace, jobs: list[list[str]], swept: list[str],
                        nprocs: list[int | None]) -> int:
    """Up to ``--max-parallel`` torchruns at once, each pinned to CPUs of its own: a job takes
    ``max(its processes, CPUs / max-parallel)`` of the CPUs this launcher may use that no running
    job holds, and waits while fewer are free (one job always runs, on what is free), so jobs side
    by side do not share cores and each rank's automatic thread count (``train.num_threads=0``)
    splits its job's CPUs. Each job's output lines are prefixed with ``[#N]``. After a failure no
    job starts; the running ones end. Returns the first failure's exit code."""
    import threading
    import time

    from tgdist.config.overrides import swept_values
    from tgdist.kernels.graph import cpu_mask

    mask = sorted(cpu_mask())
    running: dict[int, tuple[subprocess.Popen, list[int], list[threading.Thread]]] = {}
    queue = list(range(len(jobs)))
    failure: tuple[int, int] | None = None
    received: list[int] = []
    forwarded = 0
    previous = {sig: signal.signal(sig, lambda signum, _f: received.append(signum)) for sig in FORWARDED_SIGNALS}
    try:
        while queue or running:
            for signum in received[forwarded:]:  # torchrun stops its ranks; no job starts after
                forwarded += 1
                for child, _, _ in running.values():
                    if child.poll() is None:
                        child.send_signal(signal.SIGINT if signum in _AS_CTRL_C else signum)
            while queue and failure is None and not received and len(running) < args.max_parallel:
                held = {c for _, cpus, _ in running.values() for c in cpus}
                free = [c for c in mask if c not in held]
                want = max(nprocs[queue[0]] or 1, len(mask) // args.max_parallel)
                if running and len(free) < want:
                    break
                num = queue.pop(0)
                print(f"tgdist launch: sweep job #{num} of {len(jobs)}: "
                      f"{swept_values(jobs[num], swept) or '(no swept keys)'}", file=sys.stderr, flush=True)
                running[num] = _start_prefixed(args, jobs[num], nprocs[num], num, free[:want] or mask)
            time.sleep(0.2)
            for num in [n for n, (child, _, _) in running.items() if child.poll() is not None]:
                child, _, readers = running.pop(num)
                for t in readers:
                    t.join()
                rc = child.returncode if child.returncode >= 0 else 128 - child.returncode
                if rc and failure is None:
                    failure = (num, rc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child, _, _ in running.values():  # only after an error of this launcher's own
            if child.poll() is None:
                child.send_signal(signal.SIGINT)
    if received:
        print(f"tgdist launch: stopped by {signal.Signals(received[0]).name}", file=sys.stderr, flush=True)
        return 128 + received[0]
    if failure is not None:
        num, rc = failure
        left = f"; {len(queue)} job{'s' * (len(queue) != 1)} did not run" if queue else ""
        print(f"tgdist launch: sweep stopped: job #{num} exited with {rc}{left}", file=sys.stderr, flush=True)
        return rc
    return 0


def _start_prefixed(args: argparse.Namespace, job: list[str], nproc: int | None, num: int, cpus: list[int]):
    """Start job ``num``'s torchrun on ``cpus``, its stdout and stderr lines prefixed ``[#num] ``;
    returns (the process, its CPUs, the threads copying its output)."""
    import threading

    def pinned() -> None:  # in the child: its CPUs, and SIGTERM when the launcher dies
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        set_parent_death_signal()

    nproc = nproc or _nproc(args, parallel_overrides(job))
    port = _free_port()
    cmd = build_command(nproc, job, master_addr=args.master_addr, master_port=port, module=args.module,
                        max_restarts=args.max_restarts)
    print(f"tgdist launch: [#{num}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
    child = subprocess.Popen([cmd[0], "-m", "tgdist.launcher.torchrun", *cmd[3:]], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True,
                             preexec_fn=pinned if sys.platform.startswith("linux") else None)

    def pump(src, dst) -> None:
        for line in src:
            dst.write(f"[#{num}] {line}")
            dst.flush()

    readers = [threading.Thread(target=pump, args=(child.stdout, sys.stdout), daemon=True),
               threading.Thread(target=pump, args=(child.stderr, sys.stderr), daemon=True)]
    for t in readers:
        t.start()
    return child, cpus, readers


def _layout(args: argparse.Namespace, cfg, overrides: list[str]) -> dict[str, int]:
    """parallel.i/j/k to check the process count against: the composed config's (its defaults
    included) when the overrides give one of them or ``--nproc`` is given, else none."""
    named = any(_PARALLEL.fullmatch(o.strip()) or o.partition("=")[0].lstrip("+") == "parallel" for o in overrides)
    if named or args.nproc is not None or any(cfg.parallel[k] != 1 for k in "ijk"):
        return {k: int(cfg.parallel[k]) for k in "ijk"}
    return {}


def _nproc(args: argparse.Namespace, par: dict[str, int]) -> int:
    """Processes on this machine: ``--nproc``, or parallel.i*j*k / nnodes; checked against each other."""
    world = None
    if par:
        world = par.get("i", 1) * par.get("j", 1) * par.get("k", 1)
    nproc = args.nproc
    if nproc is None:
        if world is None:
            raise ConfigError("give --nproc N (trainers on this machine), or parallel.i/j/k overrides to derive it")
        if world % args.nnodes:
            raise ConfigError(f"parallel.i x parallel.j x parallel.k = {world} is not divisible by --nnodes {args.nnodes}")
        nproc = world // args.nnodes
    if world is not None and world != nproc * args.nnodes:
        raise ConfigError(
            f"parallel.i x parallel.j x parallel.k = {par.get('i', 1)} x {par.get('j', 1)} x {par.get('k', 1)} = "
            f"{world} but --nproc {nproc} x --nnodes {args.nnodes} starts {nproc * args.nnodes} processes"
        )
    return nproc


def _launch(args: argparse.Namespace, overrides: list[str], nproc: int | None = None) -> int:
    """One torchrun (or its command line, with ``--dry-run``); ``nproc`` from the composed config
    when known (it resolves interpolations such as ``parallel.i=${oc.env:NI}``)."""
    nproc = nproc or _nproc(args, parallel_overrides(overrides))
    port = args.master_port
    if port is None:
        port = _free_port() if args.nnodes == 1 else DEFAULT_MULTINODE_PORT
    elif args.nnodes == 1 and not args.dry_run:
        if not _reserve(port):
            raise ConfigError(f"--master-port {port} is in use by another tgdist launch on this machine: leave "
                              f"--master-port out (a free port is picked) or name another")
        _check_port_free(args.master_addr, port)
    if args.nnodes > 1 and args.node_rank == 0 and not args.dry_run:  # the machine that hosts the store
        _check_port_free(args.master_addr, port)
    cmd = build_command(nproc, overrides, nnodes=args.nnodes, node_rank=args.node_rank,
                        master_addr=args.master_addr, master_port=port, module=args.module,
                        max_restarts=args.max_restarts)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    print(f"tgdist launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    run_as = [cmd[0], "-m", "tgdist.launcher.torchrun", *cmd[3:]]  # the same, with a short failure report
    return run_forwarding_signals(run_as)


if __name__ == "__main__":
    sys.exit(main())
