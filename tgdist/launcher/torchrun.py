"""``python -m tgdist.launcher.torchrun ARGS``: ``python -m torch.distributed.run ARGS`` with a
short failure report. This is what ``tgdist launch`` runs (its ``--dry-run`` prints the plain
torchrun command, which behaves the same apart from the report).

When a worker fails, torchrun prints its own traceback and a failure table below the error the
worker already printed (``tgdist train [rank N]: error: ...``). Here that becomes one line naming
the rank that failed first and its exit code, and the exit code is the worker's (2 for a settings
or data error; 128 + N for a worker killed by signal N) instead of torchrun's 1. The elastic
agent's log lines about stopping the other workers are dropped too. A signal that stops torchrun
(``tgdist launch`` forwards Ctrl-C and SIGTERM to it) ends it with 128 + the signal's number after
the agent has stopped the workers, without its traceback: the launcher says what happened in one
line. Everything else (rendezvous errors, a worker's own output) is left as torchrun reports it.

SIGUSR1, the preemption notice (SLURM's ``--signal=B:USR1@120``, forwarded by the sbatch
templates and by ``tgdist launch``), would end the agent (its default) and with it the workers,
unsaved: here it goes to the workers instead, which checkpoint after the iteration under way and
exit 75. ``TGDIST_PREEMPTED`` is set for any worker the agent starts after it (``--max-restarts``):
that one exits 75 at once, so the job ends and is requeued rather than restarted in place.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

__all__ = ["main"]

# the agent's lines on stopping the other workers, and on a signal (the launcher reports that itself)
_NOISE = ("Sending process", "failed (exitcode", "Received ")


class _DropWorkerStopLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("torch.distributed.elastic") and record.getMessage().startswith(_NOISE))


def _quiet_agent() -> None:
    quiet = _DropWorkerStopLines()
    for name in ("", "torch", "torch.distributed", "torch.distributed.elastic"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(quiet)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    _quiet_agent()
    signal.signal(signal.SIGUSR1, _forward_preemption)
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun would set 1 with a banner; tgdist sets each rank's threads itself (its share of the
        # machine's CPUs, train.num_threads=0), so the banner would only mislead
        from tgdist.kernels.graph import cpu_mask

        nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(cpu_mask()) // max(1, nproc)))
    try:
        run(args)
    except KeyboardInterrupt:  # Ctrl-C while the agent starts: the ranks print their own line
        return 130
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        from tgdist.kernels.interrupts import PREEMPTED_EXIT

        if code == PREEMPTED_EXIT:  # (every rank checkpointed before any exits: the others may be stopped by the agent)
            print(f"tgdist launch: the ranks stopped on the preemption signal and checkpointed; exiting "
                  f"{PREEMPTED_EXIT} for the job to be requeued", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT
        how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
        failed = sorted(r for r, f in e.failures.items() if r != rank and f.exitcode > 0)
        stopped = sorted(r for r, f in e.failures.items() if r != rank and f.exitcode <= 0)
        report = f"tgdist launch: rank {rank} {how}" + (" (its error is above)" if code > 0 else "")
        if failed:
            report += f"; rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))} failed too"
        if stopped:
            report += f"; rank{'s' * (len(stopped) > 1)} {', '.join(map(str, stopped))} stopped by torchrun"
        print(report, file=sys.stderr, flush=True)
        return 128 - code if code < 0 else code
    except SignalException as e:  # the agent has stopped the workers before raising this
        return 128 + int(e.sigval)
    except RendezvousError as e:  # the store's port taken, a machine that does not answer: one line
        from tgdist.errors import first_line

        cause = first_line(e)
        machines = "" if str(args.nnodes) in ("1", "1:1") else (
            f"; every machine must run the same launch (--nnodes {args.nnodes}, --master-addr and --master-port)")
        print(f"tgdist launch: the ranks could not meet at {args.rdzv_endpoint} ({cause}){machines}; if another "
              f"program holds that port, name another with --master-port", file=sys.stderr, flush=True)
        return 1
    finally:
        _sweep_stale_segments()
    return 0


def _children() -> list[int]:
    """The processes whose parent is this one (the agent's workers), from /proc (Linux)."""
    me, out = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == me:  # the field after the state: the parent's pid
            out.append(int(entry.name))
    return out


def _forward_preemption(signum, _frame) -> None:
    os.environ["TGDIST_PREEMPTED"] = "1"  # (workers started from now on: the environment is read at start)
    for pid in _children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _sweep_stale_segments() -> None:
    """Remove the shared memory of daemon runs whose processes are all dead (a rank and its
    daemon killed together cannot remove their own); segments of live runs are kept."""
    from tgdist.memory.daemon import sweep_stale

    stale = sweep_stale()
    if stale:
        print(f"tgdist launch: removed {len(stale)} shared-memory segment{'s' * (len(stale) > 1)} left by dead "
              f"processes ({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
