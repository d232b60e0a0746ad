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
"""

from __future__ import annotations

import signal
import sys
import threading

from numba.core import event

_installed = None


class _HoldSigint(event.Listener):
    def __init__(self, who: str):
        self.who = who
        self.depth = 0  # the compiler lock is re-entrant: nested acquisitions
        self.pending = False
        self.previous = None

    def on_start(self, ev) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal handlers are main-thread only
            return
        self.depth += 1
        if self.depth == 1:
            self.pending = False
            self.previous = signal.signal(signal.SIGINT, self._hold)

    def on_end(self, ev) -> None:
        if threading.current_thread() is not threading.main_thread() or self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.default_int_handler)
            if self.pending:
                self.pending = False
                signal.raise_signal(signal.SIGINT)  # to the restored handler, now that numba is done

    def _hold(self, signum, frame) -> None:
        if self.pending:  # asked twice: stop now (and not once more when the compile unwinds)
            self.pending = False
            raise KeyboardInterrupt
        self.pending = True
        print(f"{self.who}: interrupt received; stopping once numba finishes compiling a kernel "
              f"(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)


def caused_by_interrupt(exc: BaseException) -> bool:
    """A KeyboardInterrupt, or an error it caused: Ctrl-C inside a Python callback that numba's
    compiled code makes (e.g. ``_numba_unpickle`` on a kernel's first call) surfaces as a
    ``SystemError`` whose cause is the KeyboardInterrupt."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def hold_interrupts_during_compiles(who: str = "tgdist") -> None:
    """Hold SIGINT while numba compiles or loads a kernel (idempotent; ``who`` prefixes the notice)."""
    global _installed
    if _installed is None:
        _installed = _HoldSigint(who)
        event.register("numba:compiler_lock", _installed)
    _installed.who = who
