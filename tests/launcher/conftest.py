"""Fixtures of the launcher tests: a one-node SLURM cluster, shared by the tests of a session."""

from __future__ import annotations

import pytest

from .slurm_cluster import LocalSlurmCluster, missing_reason


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running ``LocalSlurmCluster``; the test is skipped (with the reason) where SLURM or root
    is missing. Torn down at the end of the session, leaving no process behind."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurmCluster()
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
