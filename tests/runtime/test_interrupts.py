"""Ctrl-C while numba compiles is held until the compile ends (tgdist/runtime/interrupts.py).

Each case runs in its own process: a numba listener sends SIGINT to the process as soon as the
compile of a fresh (uncached) kernel starts, so the signal lands inside numba every time.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from numba import njit
    from numba.core import event
    from tgdist.runtime.interrupts import hold_interrupts_during_compiles

    hold, times = sys.argv[1] == "hold", int(sys.argv[2])
    if hold:
        hold_interrupts_during_compiles("test")

    class Ctrl_C(event.Listener):
        def on_start(self, ev):
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        def on_end(self, ev):
            pass

    listener = Ctrl_C()
    event.register("numba:compile", listener)

    @njit
    def sum_of_squares(x):
        s = 0.0
        for i in range(x.shape[0]):
            s += x[i] * x[i]
        return s

    try:
        print("returned", sum_of_squares(np.arange(4.0)))
    except KeyboardInterrupt:
        print("interrupted, compiled signatures:", len(sum_of_squares.signatures))
    event.unregister("numba:compile", listener)
    print("then", sum_of_squares(np.arange(4.0)))
    print("handler restored:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
""")


def run(mode: str, times: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode, str(times)], capture_output=True, text=True,
                          timeout=120, check=False)


def test_without_the_hold_ctrl_c_lands_inside_the_compile():
    """The hazard the module exists for: the KeyboardInterrupt aborts the compile half-way."""
    r = run("plain")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "interrupted, compiled signatures: 0"


def test_ctrl_c_is_held_until_the_compile_ends():
    r = run("hold")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["interrupted, compiled signatures: 1", "then 14.0", "handler restored: True"]
    assert r.stderr == ("test: interrupt received; stopping once numba finishes compiling a kernel "
                        "(Ctrl-C again to stop at once)\n")


def test_a_second_ctrl_c_stops_at_once():
    r = run("hold", times=2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["interrupted, compiled signatures: 0", "then 14.0", "handler restored: True"]


def test_errors_caused_by_ctrl_c_count_as_interrupts():
    """Ctrl-C inside a Python callback of numba's compiled code reaches the caller as a SystemError
    caused by the KeyboardInterrupt (seen on a kernel's first call, in ``_numba_unpickle``)."""
    from tgdist.runtime.interrupts import caused_by_interrupt

    def callback_error():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise SystemError("returned a result with an exception set") from e

    try:
        callback_error()
    except SystemError as e:
        wrapped = e
    assert caused_by_interrupt(wrapped) and caused_by_interrupt(KeyboardInterrupt())
    assert not caused_by_interrupt(SystemError("plain")) and not caused_by_interrupt(ValueError())
