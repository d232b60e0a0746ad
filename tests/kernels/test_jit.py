"""Compile accounting: real numba compiles are timed (cache loads are not) and announced once."""

import sys

import numpy as np
import pytest
from numba import njit

from tgdist.kernels import jit
from tgdist.runtime.build import build_trainer, compose


def test_a_compile_is_timed_and_announced_once(monkeypatch, capsys):
    clock = jit.track_compiles()
    monkeypatch.setattr(clock, "announced", False)
    monkeypatch.setattr(clock, "who", None)
    jit.announce_compiles("tgdist test")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # said on a terminal only
    before = jit.compile_seconds()

    @njit(cache=False)
    def first(x):
        return x * 2.0 + np.sin(x)

    @njit(cache=False)
    def second(x):
        return first(x) - 1.0  # compiles ``first`` inside its own compile: counted once

    assert second(1.0) == pytest.approx(2.0 + np.sin(1.0) - 1.0)
    spent = jit.compile_seconds() - before
    assert spent > 0.01  # a numba compile takes tens of milliseconds at least
    notice = ("tgdist test: compiling numba kernels on first use, which takes a while once: they are cached for "
              "later runs\n")
    err = capsys.readouterr().err
    assert err.startswith(notice)
    # then, on a terminal, the status line of the compile, redrawn in place and erased at its end
    redraws = err[len(notice):].split("\r")
    assert all(r == "" or r.startswith("\x1b[K") for r in redraws) and "compiling numba kernels" in err[len(notice):]
    assert second(2.0) == pytest.approx(3.0 + np.sin(2.0))  # compiled already: no time, no notice
    assert jit.compile_seconds() - before == spent and capsys.readouterr().err == ""


def test_epoch_events_per_s_leaves_out_compile_time(monkeypatch):
    tr = build_trainer(compose(["data.max_events=600", "model.mem_dim=8", "model.time_dim=4", "train.batch_size=100",
                                "train.progress=false"]))
    tr.train_epoch(0)  # compiled and cached now
    readings = iter([10.0, 10.0 + 0.004])  # as if 4 ms of the epoch went to compiling
    monkeypatch.setattr(jit, "compile_seconds", lambda: next(readings))
    res = tr.train_epoch(1)
    assert res["compile_seconds"] == pytest.approx(0.004)
    assert res["events_per_s"] == pytest.approx(res["train_events"] / (res["train_seconds"] - 0.004))
