"""Ctrl-C while numba compiles: held until the compile ends.

numba compiles a kernel, or loads it from its on-disk cache, on the kernel's first call, which in a
training run is the first batch of an epoch or of an evaluation. A KeyboardInterrupt raised in the
middle of that work breaks llvmlite's bookkeeping: an LLVM module handed to another is not marked as
moved and is freed twice when the process exits ("free(): double free detected", SIGABRT or
SIGSEGV), or the kernel is left half built and numba raises "RuntimeError: no compiled object yet".
Either way Ctrl-C ends in a crash or a traceback instead of the command's one-line message.

``hold_interrupts_during_compiles`` registers a numba event listener for the compiler lock, which
numba takes around every compile and cache load before any LLVM call. While the main thread holds
that lock, a first SIGINT is recorded and announced on stderr; when the lock is released the
previous handler is put back and the signal raised again, so the KeyboardInterrupt arrives right
after the compile, outside numba. A second SIGINT during the same compile interrupts at once, as
without this module (the user asked twice). The command-line entry points install it; library users
can call it too.

``terminate_as_interrupt`` makes SIGTERM (``kill``, SLURM at its time limit, ``docker stop``) and
SIGHUP (a closed terminal) stop a single-process command the way Ctrl-C does: they raise
``Terminated``, a KeyboardInterrupt, so the same clean-up runs (temporary files removed, an empty
run directory removed, one line naming the checkpoint) and the exit code is 128 + the signal's
number, as for a process the signal killed. They are held during compiles like SIGINT.

``stop_on_preemption`` makes SIGUSR1 (SLURM's ``--signal=B:USR1@120``, which the sbatch templates
forward to every task) a request, not an interrupt: the handler only records it, and the training
loop reads ``preemption_requested`` at an iteration boundary, where the ranks agree on it, so every
rank finishes the same iteration before the run checkpoints and exits with ``PREEMPTED_EXIT`` (the
templates requeue the job on that code). A handler that raised would stop a rank in the middle of
a collective that its peers go on waiting in.
"""

from __future__ import annotations

import signal
import sys
import threading

from numba.core import event

_installed = None


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C raises KeyboardInterrupt (``terminate_as_interrupt``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


class _HoldInterrupts(event.Listener):
    """Holds SIGINT, and the termination signals ``terminate_as_interrupt`` installed, during compiles."""

    def __init__(self, who: str):
        self.who = who
        self.depth = 0  # the compiler lock is re-entrant: nested acquisitions
        self.pending = None  # the first signal received during the compile
        self.previous = {}

    def on_start(self, ev) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal handlers are main-thread only
            return
        self.depth += 1
        if self.depth == 1:
            self.pending = None
            held = [signal.SIGINT] + [s for s in TERMINATION_SIGNALS if signal.getsignal(s) is _raise_terminated]
            self.previous = {s: signal.signal(s, self._hold) for s in held}

    def on_end(self, ev) -> None:
        if threading.current_thread() is not threading.main_thread() or self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            for s, previous in self.previous.items():
                signal.signal(s, previous if previous is not None else signal.default_int_handler)
            if self.pending is not None:
                pending, self.pending = self.pending, None
                signal.raise_signal(pending)  # to the restored handler, now that numba is done

    def _hold(self, signum, frame) -> None:
        if self.pending is not None:  # asked twice: stop now (and not once more when the compile unwinds)
            self.pending = None
            raise _interrupt(signum)
        self.pending = signum
        what = "interrupt" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"{self.who}: {what} received; stopping once numba finishes compiling a kernel "
              f"(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)


def stop_signal(exc: BaseException) -> int | None:
    """The signal behind ``exc``: SIGINT for a KeyboardInterrupt, the signal of a ``Terminated``,
    also when it caused ``exc`` (Ctrl-C inside a Python callback that numba's compiled code makes,
    e.g. ``_numba_unpickle`` on a kernel's first call, surfaces as a ``SystemError`` whose cause is
    the KeyboardInterrupt); None for any other error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return getattr(exc, "signum", signal.SIGINT)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def caused_by_interrupt(exc: BaseException) -> bool:
    """A KeyboardInterrupt (or ``Terminated``), or an error it caused (``stop_signal``)."""
    return stop_signal(exc) is not None


def stopped(exc: BaseException) -> tuple[str, int]:
    """``("interrupted", 130)`` for Ctrl-C, ``("stopped by SIGTERM", 143)``...: the words for a
    command's closing line and its exit code, 128 + the signal's number as the shell reports it."""
    signum = stop_signal(exc) or signal.SIGINT
    words = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return words, 128 + signum


def terminate_as_interrupt() -> None:
    """SIGTERM and SIGHUP raise ``Terminated`` in the main thread from now on, unless this process
    ignores them (``nohup`` keeps ignoring SIGHUP) or already handles them. For single-process
    commands: a rank of a parallel run keeps the default, which ends it even while it waits inside
    a collective, where a Python handler would not run until the collective returned."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in TERMINATION_SIGNALS:
        if signal.getsignal(s) == signal.SIG_DFL:
            signal.signal(s, _raise_terminated)


# The preemption notice (``stop_on_preemption``) and the exit code of a run stopped by it: 75 is
# EX_TEMPFAIL ("try again later"), which neither a settings error (2), a failure (1) nor a signal's
# death (128 + N) gives; the sbatch templates requeue the job on it.
PREEMPT_SIGNAL = signal.SIGUSR1
PREEMPTED_EXIT = 75
_preempted: list[int] = []  # the signals received since ``stop_on_preemption``


def _record_preemption(signum, frame) -> None:
    _preempted.append(signum)


def stop_on_preemption() -> bool:
    """From now on ``PREEMPT_SIGNAL`` is recorded for ``preemption_requested`` instead of ending
    the process (its default), unless this process already handles or ignores it. True when the
    handler is installed (in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(PREEMPT_SIGNAL)
    if current is _record_preemption:
        return True
    if current != signal.SIG_DFL:
        return False
    _preempted.clear()
    signal.signal(PREEMPT_SIGNAL, _record_preemption)
    return True


def preemption_armed() -> bool:
    """Whether ``stop_on_preemption`` is in force: the training loop then looks for the notice."""
    return signal.getsignal(PREEMPT_SIGNAL) is _record_preemption


def preemption_requested() -> int | None:
    """The preemption signal received since ``stop_on_preemption``, or None."""
    return _preempted[0] if _preempted else None


def hold_interrupts_during_compiles(who: str = "tgdist") -> None:
    """Hold SIGINT (and the signals ``terminate_as_interrupt`` installed) while numba compiles or
    loads a kernel (idempotent; ``who`` prefixes the notice)."""
    global _installed
    if _installed is None:
        _installed = _HoldInterrupts(who)
        event.register("numba:compiler_lock", _installed)
    _installed.who = who
