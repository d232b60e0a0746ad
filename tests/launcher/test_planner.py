"""DistTGL 3.2.4 planner and ``tgdist plan``."""

from __future__ import annotations

import json

import pytest

from tgdist.cli import main as cli_main
from tgdist.distributed.schedule import Layout
from tgdist.distributed.world import WorldInfo, validate
from tgdist.errors import ConfigError
from tgdist.launcher import planner
from tgdist.runtime.build import compose
from tgdist.runtime.build import validate as check_settings


def test_paper_example():
    """4 machines x 8 GPUs, largest batch 3200, saturation 1600, 2 copies per machine."""
    p = planner.plan(4, 8, 3200, 1600, 2)
    assert (p.i, p.j, p.k) == (2, 2, 8)
    assert (p.local_batch, p.global_batch, p.copies_per_machine, p.epochs_multiple_of, p.world_size) == (1600, 3200, 2, 16, 32)


@pytest.mark.parametrize("args, ijk, local", [
    ((1, 1, 600, 600, 1), (1, 1, 1), 600),          # one GPU
    ((1, 8, 4800, 600, 1), (8, 1, 1), 600),         # one machine, memory for one copy: all mini-batch
    ((1, 8, 600, 600, 8), (1, 1, 8), 600),          # small batch, lots of memory: all memory parallelism
    ((1, 8, 600, 600, 3), (1, 4, 2), 600),          # 3 copies do not split 8 slots: 2 copies, j = 4
    ((2, 4, 500, 1600, 4), (1, 1, 8), 500),         # largest batch below saturation: local batch = largest
    ((2, 6, 9000, 2000, 3), (3, 1, 4), 2000),       # i = 4 does not divide 6 GPUs: lowered to 3
    ((8, 8, 100_000, 1000, 1), (8, 1, 8), 1000),    # i capped at the GPUs of one machine
])
def test_plans(args, ijk, local):
    p = planner.plan(*args)
    assert (p.i, p.j, p.k) == ijk and p.local_batch == local
    P, Q = args[0], args[1]
    assert p.i * p.j * p.k == P * Q and p.k >= P and p.k % P == 0 and p.k // P <= args[4]
    # the plan passes the launcher's own checks for a daemon memory on that cluster
    validate(Layout(p.i, p.j, p.k), WorldInfo(world_size=P * Q, local_world_size=Q, num_nodes=P, launcher="slurm"),
             "daemon", epochs=p.epochs_multiple_of)


@pytest.mark.parametrize("args, match", [
    ((4, 8, 3200, 1600, 0), "holds 0 copies .* at least one copy per machine"),
    ((0, 8, 3200, 1600, 2), "--machines must be a positive integer"),
    ((4, 8, 3200, -1, 2), "--saturation-batch must be a positive integer"),
])
def test_infeasible(args, match):
    with pytest.raises(ConfigError, match=match):
        planner.plan(*args)


def test_copies_from_memory():
    assert planner.copies_from_memory(256, 100) == 2
    assert planner.copies_from_memory(300, 100) == 3
    with pytest.raises(ConfigError):
        planner.copies_from_memory(0, 10)
    for mem, per in ((float("inf"), 10), (10, float("nan")), (float("inf"), float("inf"))):
        with pytest.raises(ConfigError, match="must be positive finite numbers"):
            planner.copies_from_memory(mem, per)
    assert planner.copies_from_memory(1e300, 1e-300) == 10**6  # no OverflowError


def test_cli_plan_refuses_an_option_it_would_ignore(capsys):
    with pytest.raises(ConfigError, match="--memory-gb-per-copy goes with --host-mem-gb"):
        planner.main(["--machines", "2", "--gpus-per-machine", "4", "--largest-batch", "1200", "--saturation-batch",
                      "600", "--memory-copies-per-machine", "1", "--memory-gb-per-copy", "5"])


def test_cli_plan(capsys):
    rc = cli_main(["plan", "--machines", "4", "--gpus-per-machine", "8", "--largest-batch", "3200",
                   "--saturation-batch", "1600", "--memory-copies-per-machine", "2"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0] == "4 machines x 8 GPUs -> i x j x k = 2 x 2 x 8"
    got = json.loads(out[-1])
    assert (got["i"], got["j"], got["k"], got["local_batch"]) == (2, 2, 8, 1600)
    assert got["overrides"][:3] == ["parallel.i=2", "parallel.j=2", "parallel.k=8"]
    assert got["overrides"][-1] == "train.epochs=16"  # a multiple of j*k, or the launch line would be refused
    line = next(ln for ln in out if "slurm/multinode_gpu.sbatch" in ln)
    cfg = compose(line.split("slurm/multinode_gpu.sbatch ")[1].split())
    check_settings(cfg)  # the settings the printed line launches with pass tgdist's checks
    assert any("slurm/multinode_gpu.sbatch" in ln for ln in out)


def test_cli_plan_from_memory_sizes_and_errors(capsys):
    rc = cli_main(["plan", "-P", "2", "-Q", "4", "--largest-batch", "1000", "--saturation-batch", "1000",
                   "--host-mem-gb", "64", "--memory-gb-per-copy", "20", "--json-only"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(out) == 1 and json.loads(out[0])["max_copies_per_machine"] == 3
    rc = cli_main(["plan", "-P", "2", "-Q", "4", "--largest-batch", "1000", "--saturation-batch", "1000",
                   "--host-mem-gb", "10", "--memory-gb-per-copy", "20"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("tgdist plan: error: host memory holds 0 copies") and err.count("\n") == 1
    rc = cli_main(["plan", "-P", "2", "-Q", "4", "--largest-batch", "1000", "--saturation-batch", "1000", "--host-mem-gb", "64"])
    assert rc == 2 and "needs --memory-gb-per-copy" in capsys.readouterr().err


def test_plan_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["plan", "--help"])
    assert e.value.code == 0 and "DistTGL section 3.2.4" in capsys.readouterr().out


def test_plan_edge_cases(capsys):
    """A huge GPU count is planned at once (divisors were listed one by one: 1e9 did not finish);
    one trainer keeps its memory local; a negative copy count is refused as the other numbers are;
    counts of one are singular."""
    p = planner.plan(1, 10**9, 600, 600, 1)
    assert (p.i, p.j, p.k) == (1, 10**9, 1)
    assert planner._divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and planner._divisors(1) == [1]
    assert not any(o.startswith("memory.backend") for o in planner.plan(1, 1, 600, 600, 1).overrides())
    assert "memory.backend=daemon" in planner.plan(1, 2, 600, 600, 2).overrides()
    rc = cli_main(["plan", "-P", "1", "-Q", "1", "--largest-batch", "600", "--saturation-batch", "600",
                   "--memory-copies-per-machine", "-3"])
    assert rc == 2 and capsys.readouterr().err == (
        "tgdist plan: error: --memory-copies-per-machine must be a positive integer, got -3\n")
    rc = cli_main(["plan", "-P", "1", "-Q", "1", "--largest-batch", "600", "--saturation-batch", "600",
                   "--memory-copies-per-machine", "1"])
    assert rc == 0 and capsys.readouterr().out.startswith("1 machine x 1 GPU -> i x j x k = 1 x 1 x 1\n")


def test_a_reader_that_leaves_stops_the_command_quietly():
    """``tgdist plan ... | head -1``: writing to a pipe whose reader has gone printed a BrokenPipeError
    traceback; it now ends quietly with the code a SIGPIPE death gives."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # every write fails with EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "tgdist", "plan", "-P", "4", "-Q", "8", "--largest-batch", "3200",
                            "--saturation-batch", "1600", "--memory-copies-per-machine", "2"], stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == "", r.stderr
