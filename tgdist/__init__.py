"""tgdist: memory-based temporal graph neural networks, from one process to a cluster."""

# OpenMP's wait policy is left at the runtime's default (spinning). OMP_WAIT_POLICY=PASSIVE helps
# only on an oversubscribed machine and costs a third of training speed when the cores are free,
# because every torch op then wakes sleeping threads: README, "Threads", and benchmarks/BENCHMARKS.md,
# "OpenMP wait policy".

__version__ = "0.1.0"


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
