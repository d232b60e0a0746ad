"""Shared pytest fixtures: an isolated processed-graph cache and the shared real data sets."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

# A test command started in the background by a shell without job control (`make test &` in a
# script, some CI runners) inherits SIGINT ignored, and so would every process the tests start:
# the Ctrl-C tests would then see their SIGINT ignored. Tests send SIGINT on purpose, so take it
# back: an exec'd child resets a handled signal to its default, but keeps an ignored one ignored.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The repository's sibling folder shared/ holds the real data sets (see shared/datasets/SOURCES.md).
DATASETS = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """The root logger's handlers and level as before the test: a run started in the test's process
    (``train.main()``) sets Hydra's logging, whose console handler writes to the ``sys.stderr`` of
    that moment, a test's captured stream; left behind, a later test's log line hit that closed
    stream ("--- Logging error ---" in the next test's stderr)."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch) -> Path:
    """Every test gets its own empty ``$TGDIST_CACHE``, so no test writes to ~/.cache."""
    cache = tmp_path_factory.mktemp("tgdist-cache")
    monkeypatch.setenv("TGDIST_CACHE", str(cache))
    return cache


@pytest.fixture
def cache_dir(_isolated_cache) -> Path:
    """The test's ``$TGDIST_CACHE`` folder (empty at the start of the test)."""
    return _isolated_cache


@pytest.fixture
def datasets_dir() -> Path:
    """``shared/datasets`` next to the repository; the test is skipped where it is absent."""
    if not DATASETS.is_dir():
        pytest.skip(f"real data sets not found at {DATASETS} (the shared/ folder next to the repository)")
    return DATASETS
