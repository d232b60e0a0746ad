"""``tgdist.progress.Status``: a status line on a terminal, nothing elsewhere; the long steps that
use it (reading a large file, numba compiles) show it on a terminal only."""

import io
import logging
import time

import numpy as np

from tgdist.progress import Status


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_nothing_is_written_where_stderr_is_no_terminal():
    stream = io.StringIO()
    with Status("reading x", stream=stream) as status:
        status.set("parsing")
    assert stream.getvalue() == "" and status._thread is None


def test_on_a_terminal_the_line_is_redrawn_and_erased_at_the_end():
    term = Terminal()
    with Status("reading x (20 MiB)", stream=term) as status:
        status.set("parsing")
        time.sleep(0.6)  # one tick of the clock
        assert status._thread.is_alive()
    out = term.getvalue()
    assert out.startswith("\r\x1b[Kreading x (20 MiB) (0 s)")
    assert "\r\x1b[Kreading x (20 MiB): parsing (0 s)" in out and out.count("parsing") >= 2
    assert out.endswith("\r\x1b[K") and status._thread is None
    with Status("off", enabled=False, stream=term):
        pass
    assert term.getvalue() == out


def test_a_log_record_to_the_terminal_erases_the_line_first():
    term = Terminal()
    handler = logging.StreamHandler(term)
    log = logging.getLogger("tgdist")
    log.addHandler(handler)
    try:
        with Status("step", stream=term) as status:
            status.set("phase")
            log.warning("a line of the log")
        assert not handler.filters  # the filter goes with the status
    finally:
        log.removeHandler(handler)
    assert "phase (0 s)\r\x1b[Ka line of the log\n" in term.getvalue()


def test_reading_a_large_file_shows_its_phases_on_a_terminal(tmp_path, monkeypatch):
    from tgdist.data import load as tload

    path = tmp_path / "ev.csv"
    path.write_text("".join(f"{i % 40},{40 + i % 23},{i}\n" for i in range(500)))
    monkeypatch.setattr(tload, "STATUS_BYTES", 1)  # a few KiB count as large here
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    g = tload.load_graph(path, cache_dir=tmp_path / "cache")
    for phase in ("hashing the source", "parsing", "building the graph", "writing the cache"):
        assert f"reading ev.csv (0 MiB): {phase}" in term.getvalue(), term.getvalue()
    term.truncate(0)
    again = tload.load_graph(path, cache_dir=tmp_path / "cache")
    assert "mapping the cached graph" in term.getvalue() and np.array_equal(again.t, g.t)
    quiet = io.StringIO()
    monkeypatch.setattr("sys.stderr", quiet)
    tload.load_graph(path, cache_dir=tmp_path / "cache2")
    assert quiet.getvalue() == ""


def test_a_numba_compile_shows_its_clock_on_a_terminal(monkeypatch):
    import numba

    from tgdist.kernels import jit

    clock = jit.track_compiles()
    monkeypatch.setattr(clock, "who", "tgdist test")
    monkeypatch.setattr(clock, "announced", True)  # the one-time notice is another test's
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)

    @numba.njit(cache=False)
    def fresh(x):  # a kernel no cache holds: it compiles on this call
        return x * 2 + 1

    assert fresh(3) == 7
    out = term.getvalue()
    assert "\r\x1b[Ktgdist test: compiling numba kernels: kernel " in out and out.endswith("\r\x1b[K")
    assert clock.status is None
