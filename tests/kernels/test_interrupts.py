"""Ctrl-C while numba compiles is held until the compile ends (tgdist/kernels/interrupts.py).

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
    from tgdist.kernels.interrupts import hold_interrupts_during_compiles, terminate_as_interrupt

    hold, times, sig = sys.argv[1] == "hold", int(sys.argv[2]), getattr(signal, sys.argv[3])
    terminate_as_interrupt()
    if hold:
        hold_interrupts_during_compiles("test")

    class Ctrl_C(event.Listener):
        def on_start(self, ev):
            for _ in range(times):
                os.kill(os.getpid(), sig)
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
    except KeyboardInterrupt as e:
        print(f"{type(e).__name__}, compiled signatures:", len(sum_of_squares.signatures))
    event.unregister("numba:compile", listener)
    print("then", sum_of_squares(np.arange(4.0)))
    print("handler restored:", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          signal.getsignal(signal.SIGTERM).__name__)
""")


def run(mode: str, times: int = 1, sig: str = "SIGINT") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode, str(times), sig], capture_output=True, text=True,
                          timeout=120, check=False)


def test_without_the_hold_ctrl_c_lands_inside_the_compile():
    """The hazard the module exists for: the KeyboardInterrupt aborts the compile half-way."""
    r = run("plain")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "KeyboardInterrupt, compiled signatures: 0"


def test_ctrl_c_is_held_until_the_compile_ends():
    r = run("hold")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["KeyboardInterrupt, compiled signatures: 1", "then 14.0",
                                     "handler restored: True _raise_terminated"]
    assert r.stderr == ("test: interrupt received; stopping once numba finishes compiling a kernel "
                        "(Ctrl-C again to stop at once)\n")


def test_sigterm_is_held_like_ctrl_c_and_raises_terminated():
    """SIGTERM, once ``terminate_as_interrupt`` is installed, waits for the compile like Ctrl-C."""
    r = run("plain", sig="SIGTERM")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "Terminated, compiled signatures: 0"  # the hazard, for SIGTERM too
    r = run("hold", sig="SIGTERM")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["Terminated, compiled signatures: 1", "then 14.0",
                                     "handler restored: True _raise_terminated"]
    assert r.stderr.startswith("test: SIGTERM received; stopping once numba finishes compiling a kernel")


def test_termination_signals_keep_an_ignore_and_name_their_exit_code():
    """``nohup`` ignores SIGHUP: it stays ignored. ``stopped`` gives the closing words and the
    shell's exit code for each signal, also for an error the signal caused."""
    code = ("import signal; from tgdist.kernels import interrupts as i; i.terminate_as_interrupt(); "
            "print(signal.getsignal(signal.SIGHUP) == signal.SIG_IGN, signal.getsignal(signal.SIGTERM).__name__)")
    r = subprocess.run(["nohup", sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True _raise_terminated"

    import signal

    from tgdist.kernels.interrupts import Terminated, stopped

    assert stopped(KeyboardInterrupt()) == ("interrupted", 130)
    assert stopped(Terminated(signal.SIGTERM)) == ("stopped by SIGTERM", 143)
    try:
        try:
            raise Terminated(signal.SIGHUP)
        except KeyboardInterrupt as e:
            raise SystemError("returned a result with an exception set") from e
    except SystemError as e:
        assert stopped(e) == ("stopped by SIGHUP", 129)


def test_a_second_ctrl_c_stops_at_once():
    r = run("hold", times=2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["KeyboardInterrupt, compiled signatures: 0", "then 14.0",
                                     "handler restored: True _raise_terminated"]


def test_errors_caused_by_ctrl_c_count_as_interrupts():
    """Ctrl-C inside a Python callback of numba's compiled code reaches the caller as a SystemError
    caused by the KeyboardInterrupt (seen on a kernel's first call, in ``_numba_unpickle``)."""
    from tgdist.kernels.interrupts import caused_by_interrupt

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
