"""tgdist: memory-based temporal graph neural networks, from one process to a cluster."""

import os
import sys

__version__ = "0.1.0"

# OpenMP threads (torch's and numba's: GNU OpenMP) spin between parallel regions before they sleep:
# 300,000 spins by default, which on a machine where another process is busy leaves the training
# thread waiting for a worker that has no core, 2 to 10 times slower. 1,000 spins keeps a run
# within 1.4x of the best setting under load, at 1.24x of the best on free cores (no setting
# measured does both within 10%: docs/training.md, "Threads"; benchmarks/results/wait_policy.md).
# Set before torch and numba are imported, so their OpenMP runtime reads it; a user's own
# OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as it is.
DEFAULT_SPINCOUNT = "1000"
WAIT_POLICY_SET = not any(key in os.environ for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
if WAIT_POLICY_SET:
    os.environ["GOMP_SPINCOUNT"] = DEFAULT_SPINCOUNT


def wait_policy() -> str:
    """The OpenMP wait setting this process runs under, for logs: tgdist's default or the user's."""
    if WAIT_POLICY_SET:
        return f"GOMP_SPINCOUNT={DEFAULT_SPINCOUNT} (tgdist's default)"
    return ", ".join(f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ)


def _writable(folder: str) -> bool:
    """Can a file be made in ``folder``, or ``folder`` be made in its existing parent?"""
    if os.path.isdir(folder):
        return os.access(folder, os.W_OK | os.X_OK)
    if os.path.exists(folder):  # a file in its place
        return False
    parent = os.path.dirname(folder)
    return parent != folder and _writable(parent)


def _numba_cache_fallback() -> None:
    """numba caches the compiled kernels next to their source, else in the user's cache folder.
    Where both are read-only (site-packages owned by root and no writable home: a container),
    every command failed as it imported the kernels ("cannot cache function ...: no locator
    available"); the cache then goes to this user's folder in the temp directory."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if all(_writable(os.path.join(here, pkg, "__pycache__")) for pkg in ("kernels", "partition")) \
            or _writable(os.path.join(user_cache, "numba")):
        return
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"tgdist-numba-cache-{os.getuid()}")
    os.environ["NUMBA_CACHE_DIR"] = folder
    if "numba" in sys.modules:  # imported before tgdist: its config read the environment already
        sys.modules["numba"].config.CACHE_DIR = folder


_numba_cache_fallback()


def version_line() -> str:
    """tgdist's version and those of what decides its numbers (bug reports, the head of train.log)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"
    return (f"tgdist {__version__} (Python {platform.python_version()}, torch {of('torch')}, numba {of('numba')}, "
            f"numpy {of('numpy')}, hydra-core {of('hydra-core')})")
