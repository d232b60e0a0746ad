"""Time spent compiling numba kernels, and a notice when the first compile starts.

The kernels (sampler, attention, time encoding, GRU gates, ...) are compiled on their first call
and cached on disk (``cache=True``; numba keeps the cache beside the package or under
``$NUMBA_CACHE_DIR``). On a fresh install the first batches of a run therefore take tens of
seconds. ``compile_seconds()`` is the wall time spent in real compiles so far (numba's
``numba:compile`` event fires for those only, not for cache loads), so an epoch's events/s can
leave it out and report it beside; ``announce_compiles`` makes a command say once, on stderr when
that is a terminal, why its first batches are slow (logs get the epoch line's note instead).
"""

from __future__ import annotations

import sys
import threading
import time

from numba.core import event

from tgdist.progress import Status

_clock = None


class _CompileClock(event.Listener):
    def __init__(self):
        self.depth = 0  # kernels that call other kernels compile them inside their own compile
        self.started = 0.0
        self.seconds = 0.0
        self.who: str | None = None
        self.announced = False
        self.compiles = 0
        self.status: Status | None = None  # the compile under way, on a terminal

    def on_start(self, ev) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.depth += 1
        if self.depth == 1:
            self.started = time.perf_counter()
            if self.who is not None and not self.announced and sys.stderr.isatty():
                self.announced = True
                print(f"{self.who}: compiling numba kernels on first use, which takes a while once: they are "
                      f"cached for later runs", file=sys.stderr, flush=True)
            if self.who is not None:  # the clock of this compile, on a terminal only
                self.compiles += 1
                self.status = Status(f"{self.who}: compiling numba kernels").__enter__()
                self.status.set(f"kernel {self.compiles}")

    def on_end(self, ev) -> None:
        if threading.current_thread() is not threading.main_thread() or self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            self.seconds += time.perf_counter() - self.started
            if self.status is not None:
                self.status.close()
                self.status = None


def track_compiles() -> _CompileClock:
    """Start timing numba compiles in this process (idempotent)."""
    global _clock
    if _clock is None:
        _clock = _CompileClock()
        event.register("numba:compile", _clock)
    return _clock


def announce_compiles(who: str) -> None:
    """Say once, as ``WHO: compiling ...`` on stderr (a terminal), when this process first compiles
    a kernel."""
    track_compiles().who = who


def compile_seconds() -> float:
    """Wall seconds this process has spent compiling numba kernels (after ``track_compiles``)."""
    return track_compiles().seconds
