"""What a long, otherwise silent step is doing, on one line of a terminal.

Reading and caching a large file, compiling numba kernels, pre-sampling the batches and
partitioning a graph can each take minutes without a line of output. ``Status`` shows what the step
is doing and for how long, redrawn in place on stderr (a background thread ticks the clock even
while the step itself says nothing), and erased when the step ends, so the terminal keeps only the
command's own lines; a log record written to the same terminal meanwhile erases it first, and the
next tick draws it again below. Where stderr is not a terminal (a log file, CI, a pipe) it writes nothing:
those keep their usual lines. Every layer may use it (it imports nothing of tgdist).

    with Status("reading events.csv (2,048 MiB)") as status:
        status.set("parsing")
        ...
        status.set("writing the cache")
"""

from __future__ import annotations

import logging
import sys
import threading
import time

__all__ = ["Status", "on_terminal"]

_TICK = 0.5  # seconds between redraws of the clock


def on_terminal(stream=None) -> bool:
    """Whether ``stream`` (stderr by default) is a terminal."""
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced by an object without isatty
        return False


class Status:
    """A status line ``WHAT: TEXT (N s)`` on a terminal while a step runs (see the module)."""

    def __init__(self, what: str, enabled: bool = True, stream=None):
        self.what, self.text = what, ""
        self.stream = stream if stream is not None else sys.stderr
        self.active = enabled and on_terminal(self.stream)
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._quiet_until = 0.0
        self._handlers: list[logging.Handler] = []

    def __enter__(self) -> Status:
        if self.active:
            self.start = time.perf_counter()
            for logger in {logging.getLogger(), logging.getLogger("tgdist")}:
                for handler in logger.handlers:  # log lines to this terminal erase the status line first
                    if getattr(handler, "stream", None) is self.stream:
                        handler.addFilter(self._erase_for_record)
                        self._handlers.append(handler)
            self._draw()
            self._thread = threading.Thread(target=self._tick, name="tgdist-status", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set(self, text: str) -> None:
        """What the step does now (a phase, or counts such as ``120/4,000 batches``)."""
        self.text = text
        if self.active:
            self._draw()

    def close(self) -> None:
        """Stop the clock and erase the line."""
        for handler in self._handlers:
            handler.removeFilter(self._erase_for_record)
        self._handlers = []
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            with self._lock:
                self._write("\r\x1b[K")

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        return f"{self.what}: {self.text} ({elapsed:.0f} s)" if self.text else f"{self.what} ({elapsed:.0f} s)"

    def _erase_for_record(self, record: logging.LogRecord) -> bool:
        with self._lock:
            self._quiet_until = time.perf_counter() + 0.1  # the record is written after this returns
            self._write("\r\x1b[K")
        return True

    def _tick(self) -> None:
        while not self._stop.wait(_TICK):
            self._draw()

    def _draw(self) -> None:
        with self._lock:
            if not self._stop.is_set() and time.perf_counter() >= self._quiet_until:
                self._write("\r\x1b[K" + self.line())

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: the step goes on without it
            self.active = False
