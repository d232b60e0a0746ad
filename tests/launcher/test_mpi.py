"""MPI launch: ``mpiexec -n 2`` resolves rank and world through mpi4py and agrees on the master
address by an MPI broadcast from rank 0; then real gloo groups through that address."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from tgdist.distributed.schedule import Layout

from .helpers import PROBE, expected_mean, read_ranks, run

pytestmark = pytest.mark.distributed


def mpiexec() -> list[str]:
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("MPI tests need mpi4py and an mpiexec (pip install mpi4py mpich; scripts/install_test_deps.sh)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    extra = ["--allow-run-as-root", "--oversubscribe"] if "Open MPI" in version and os.geteuid() == 0 else []
    return [exe, *extra]


def test_mpiexec_two_ranks(tmp_path):
    res = run([*mpiexec(), "-n", "2", sys.executable, str(PROBE), "--layout", "1,2,1", "--groups", "--out", str(tmp_path)])
    res.check()
    records = read_ranks(tmp_path, 2)
    layout = Layout(1, 2, 1)
    for r, rec in enumerate(records):
        w = rec["world"]
        assert (w["rank"], w["world_size"], w["local_rank"], w["local_world_size"]) == (r, 2, r, 2)
        assert (w["node_rank"], w["num_nodes"], w["launcher"]) == (0, 1, "mpi")
        assert rec["groups"]["epoch"] == [layout.epoch_peer_ranks(0, 0), expected_mean([0, 1])]
        assert rec["groups"]["minibatch"] == [[r], float(r)]
    # rank 0 chose the address and a free port; rank 1 learnt them through MPI
    assert len({(rec["world"]["master_addr"], rec["world"]["master_port"]) for rec in records}) == 1
    assert records[0]["master"] == records[1]["master"]


@pytest.mark.slow
def test_mpiexec_honours_master_port(tmp_path):
    res = run([*mpiexec(), "-n", "2", sys.executable, str(PROBE), "--out", str(tmp_path)],
              env={"MASTER_PORT": "23456"})
    res.check()
    assert [rec["world"]["master_port"] for rec in read_ranks(tmp_path, 2)] == [23456, 23456]
