"""``tgdist <command> [args]``: a thin dispatcher to each command's own ``main``.

Commands that take Hydra overrides (train, partition) see ``sys.argv`` without the command word,
exactly as ``python -m tgdist.train`` would.
"""

from __future__ import annotations

import difflib
import importlib
import os
import signal
import sys

from tgdist.errors import TgdistError

COMMANDS = {
    "train": ("tgdist.cli.train", "train a model: tgdist train [hydra overrides], e.g. model=jodie data.path=FILE"),
    "data": ("tgdist.cli.data", "inspect a data set or write a synthetic one: tgdist data --help"),
    "partition": ("tgdist.cli.partition", "partition node memory across trainers: tgdist partition [overrides]"),
    "plan": ("tgdist.launcher.planner", "choose i x j x k for a cluster: tgdist plan --help"),
    "launch": ("tgdist.launcher.launch", "run torchrun on this machine, or a sweep on SLURM: tgdist launch --help"),
    "report": ("tgdist.cli.report", "report.md and plots for a run or a sweep directory: tgdist report PATH"),
}


def usage() -> str:
    lines = ["usage: tgdist <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "tgdist help <command> (or tgdist <command> --help) documents a command's options."]
    return "\n".join(lines)


def standard_streams() -> None:
    """Make a closed stdout or stderr (``2>&-``) write to /dev/null: Python leaves it None, where
    every message and progress line would fail, and the next file opened would take its number.
    On a stream whose encoding cannot spell every name (``PYTHONIOENCODING=ascii``, a C locale),
    what it cannot spell is written as escapes instead of failing the command. Under
    ``PYTHONUNBUFFERED`` (``python -u``) stderr is line-buffered again: there every ``print``
    writes its text and its newline apart, and the ranks of one torchrun, which share a pipe, then
    interleave their lines (one rank's error ending in the middle of another's)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if getattr(sys, name) is None:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, "w", closefd=False))  # noqa: SIM115 (the process's own stream)
        stream = getattr(sys, name)
        if hasattr(stream, "reconfigure") and (stream.encoding or "").lower().replace("-", "") != "utf8":
            stream.reconfigure(errors="backslashreplace")
        if name == "stderr" and getattr(stream, "write_through", False):  # a line in one write
            stream.reconfigure(write_through=False, line_buffering=True)


def numba_threads_error() -> str | None:
    """What is wrong with ``$NUMBA_NUM_THREADS``, which numba reads as it is imported, or None:
    0 or less stopped every command with numba's traceback (tgdist's own 0 means every CPU)."""
    value = os.environ.get("NUMBA_NUM_THREADS", "").strip()
    try:
        bad = bool(value) and int(value) < 1
    except ValueError:
        return None  # numba warns and uses its default
    return (f"NUMBA_NUM_THREADS={value}: numba needs a positive thread count; unset it (sampler.num_threads=0 "
            f"already uses every CPU)") if bad else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    standard_streams()
    if (why := numba_threads_error()) is not None:
        print(f"tgdist: error: {why}", file=sys.stderr)
        return 2
    if not argv:  # like a missing argument: usage on stderr, exit 2
        print(f"tgdist: error: give a command\n\n{usage()}", file=sys.stderr)
        return 2
    if argv[:1] == ["help"] and len(argv) > 1:  # ``tgdist help train`` is ``tgdist train --help``
        argv = [argv[1], "--help"]
    if argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version") or argv[1:] in (["-V"], ["--version"]):  # ``tgdist train --version`` too
        from tgdist import version_line

        print(version_line())
        return 0
    name = argv[0]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"tgdist: error: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    if name in ("data", "partition"):  # train installs it itself (not in ranks); launch forwards signals
        from tgdist.kernels.interrupts import terminate_as_interrupt

        terminate_as_interrupt()
    sys.argv = [f"tgdist {name}", *argv[1:]]
    try:
        from tgdist import plugins

        plugins.load()  # extensions register their stores, pipelines, models and readers first
        module = importlib.import_module(COMMANDS[name][0])
        rc = module.main()
    except TgdistError as e:
        print(f"tgdist {name}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # ``tgdist plan ... | head``: the reader left; stop quietly, as a SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 128 + signal.SIGPIPE
    except (KeyboardInterrupt, Exception) as e:  # Ctrl-C, SIGTERM: one line and the shell's 128 + N
        from tgdist.kernels import interrupts

        if not interrupts.caused_by_interrupt(e):
            raise
        words, code = interrupts.stopped(e)
        print(f"tgdist {name}: {words}", file=sys.stderr)  # outputs are written atomically
        return code
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
