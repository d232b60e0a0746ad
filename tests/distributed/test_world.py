"""World resolution from launcher environments (pure parsers), validation, single-process groups."""

from __future__ import annotations

import time

import pytest
import torch

from tgdist.distributed import collectives as C
from tgdist.distributed import world as W
from tgdist.distributed.schedule import Layout
from tgdist.errors import ConfigError

from tests.launcher.helpers import free_port

# ---------------------------------------------------------------- host lists


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("a1,b2", ["a1", "b2"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("x[007]-ib", ["x007-ib"]),
])
def test_expand_hostlist(text, hosts):
    assert W.expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node]1[", "n[3-1]", "n[a-b]", ""])
def test_expand_hostlist_rejects(bad):
    with pytest.raises(ConfigError, match="host list"):
        W.expand_hostlist(bad)


def test_tasks_per_node_and_port():
    assert W.parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert W.parse_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError):
        W.parse_tasks_per_node("2(y3)")
    p = W.slurm_port("12345", "0")
    assert p == W.slurm_port("12345", "0") and 20000 <= p < 40000 and p != W.slurm_port("12345", "1")


# ---------------------------------------------------------------- launchers


TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node01", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "3",
         "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "777", "SLURM_TASKS_PER_NODE": "2(x3)",
         "SLURM_JOB_NODELIST": "node[01-03,07],gpu5"}


def test_parse_torchrun():
    w = W.detect(TORCHRUN)
    assert w == W.WorldInfo(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2,
                            master_addr="node01", master_port=29400, launcher="torchrun")
    assert w.is_distributed


def test_torchrun_wins_over_slurm_under_srun_torchrun():
    env = {**SLURM, **TORCHRUN}
    assert W.which_launcher(env) == "torchrun" and W.detect(env).rank == 5


def test_parse_slurm():
    w = W.detect(SLURM)
    assert w == W.WorldInfo(rank=3, world_size=6, local_rank=1, local_world_size=2, node_rank=1, num_nodes=3,
                            master_addr="node01", master_port=W.slurm_port("777", "0"), launcher="slurm")


def test_parse_slurm_variants():
    # uneven tasks per node, step variables preferred, explicit master
    env = {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "3,2,1", "SLURM_NODEID": "2", "SLURM_PROCID": "5",
           "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "gpu[5-7]", "MASTER_PORT": "1234"}
    w = W.parse_slurm(env)
    assert (w.local_world_size, w.node_rank, w.master_addr, w.master_port) == (1, 2, "gpu5", 1234)
    env = {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}
    assert W.parse_slurm({**env, "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "10.0.0.1"}).master_addr == "10.0.0.1"
    assert W.parse_slurm({**env, "SLURM_NODELIST": "z9"}).local_world_size == 2  # 6 tasks / 3 nodes


def test_sbatch_batch_script_is_single():
    """The batch script itself is not a step (no SLURM_STEP_ID): one process, whatever NTASKS says."""
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    env["SLURM_PROCID"] = "0"
    assert W.which_launcher(env) == "single"
    assert W.detect(env).world_size == 1


def test_which_launcher_mpi():
    assert W.which_launcher({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}) == "mpi"
    assert W.which_launcher({"PMI_SIZE": "2", "PMI_RANK": "0"}) == "mpi"
    assert W.which_launcher({"PMIX_RANK": "0"}) == "mpi"
    # srun --mpi=pmix: SLURM's own ranks are used
    assert W.which_launcher({**SLURM, "PMIX_RANK": "3"}) == "slurm"
    # Open MPI's mpirun inside an allocation: the MPI ranks, not the orted step's
    assert W.which_launcher({**SLURM, "OMPI_COMM_WORLD_SIZE": "6"}) == "mpi"
    assert W.which_launcher({}) == "single"


def test_parse_mpi_from_hosts_and_from_env():
    facts = W.MpiFacts(rank=3, world_size=5, hosts=["a", "a", "b", "b", "c"], master_addr="10.1.1.1", master_port=4242)
    w = W.parse_mpi({}, facts)
    assert w == W.WorldInfo(rank=3, world_size=5, local_rank=1, local_world_size=2, node_rank=1, num_nodes=3,
                            master_addr="10.1.1.1", master_port=4242, launcher="mpi")
    w = W.parse_mpi({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, W.MpiFacts(rank=3, world_size=4))
    assert (w.local_rank, w.local_world_size, w.node_rank, w.num_nodes) == (1, 2, 1, 2)


def test_single_and_bad_values():
    assert W.detect({}) == W.WorldInfo()
    assert W.detect({"MASTER_PORT": "4000"}).master_port == 4000
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        W.detect({**TORCHRUN, "RANK": "x"})
    with pytest.raises(ConfigError, match="inconsistent world"):
        W.detect({**TORCHRUN, "RANK": "8"})


# ---------------------------------------------------------------- validation


def world(n, local=None, nodes=1, launcher="torchrun"):
    return W.WorldInfo(rank=0, world_size=n, local_world_size=local or n, num_nodes=nodes, launcher=launcher)


def test_validate_world_size_message():
    with pytest.raises(ConfigError) as e:
        W.validate(Layout(2, 1, 2), world(3))
    assert str(e.value) == ("parallel.i x parallel.j x parallel.k = 2 x 1 x 2 = 4 but the world has 3 processes "
                            "(torchrun --nproc-per-node 4 (x nodes), or tgdist launch --nproc 4)")
    with pytest.raises(ConfigError, match="world has 1 process .*tgdist launch --nproc 2"):
        W.validate(Layout(2, 1, 1), W.WorldInfo())
    with pytest.raises(ConfigError, match="mpiexec -n 2"):
        W.validate(Layout(1, 1, 2), world(3, launcher="mpi"))


def test_validate_memory_placement():
    W.validate(Layout(2, 2, 2), world(8, local=4, nodes=2))  # one group per machine: fine
    with pytest.raises(ConfigError, match=r"parallel.k = 1 memory copies for 2 machines"):
        W.validate(Layout(2, 2, 1), world(4, local=2, nodes=2))
    with pytest.raises(ConfigError, match="= 2 trainers would span machines with 3 processes per machine"):
        W.validate(Layout(2, 1, 3), world(6, local=3, nodes=2))
    # collective stores may spread a memory group over machines
    W.validate(Layout(4, 1, 1), world(4, local=2, nodes=2), memory_backend="sven", placement="collective")
    with pytest.raises(ConfigError, match="memory.backend=local keeps node memory inside one process"):
        W.validate(Layout(2, 1, 1), world(2), memory_backend="local", placement="process")
    W.validate(Layout(1, 1, 2), world(2), memory_backend="local", placement="process")
    with pytest.raises(ValueError, match="placement='shm': one of process, host_shared, collective"):
        W.validate(Layout(1, 1, 1), world(1), memory_backend="shm", placement="shm")
    with pytest.raises(ConfigError, match="4 processes on this machine but 2 GPUs"):
        W.validate(Layout(4, 1, 1), world(4), device="cuda", num_devices=2)


def test_validate_data_sizes():
    W.validate(Layout(2, 1, 2), world(4), num_train_events=40, batch_size=10, epochs=4)
    with pytest.raises(ConfigError, match="not a multiple of parallel.j x parallel.k"):
        W.validate(Layout(2, 1, 2), world(4), epochs=3)
    with pytest.raises(ConfigError, match="2 global batches cannot be cut into parallel.k = 4"):
        W.validate(Layout(1, 1, 4), world(4), num_train_events=20, batch_size=10)


# ---------------------------------------------------------------- single-process groups and helpers


def test_single_process_groups_and_collectives():
    pg = W.ProcessGroups.init(W.WorldInfo(), Layout(1, 1, 1))
    try:
        assert W.ProcessGroups.current() is pg and pg.backend in ("gloo", "nccl")
        for name in W.GROUP_NAMES:
            assert pg.get(name) is None and pg.ranks(name) == [0] and W.get_group(name) is None
        with pytest.raises(KeyError, match="unknown process group 'tensor'"):
            pg.get("tensor")
        counter = C.ByteCounter()
        t = torch.tensor([1.0, 3.0])
        C.all_reduce_mean([t], pg.get("world"), name="grad", counter=counter)
        assert t.tolist() == [1.0, 3.0] and counter.as_dict() == {}  # nothing sent with one process
        assert C.broadcast_object({"a": 1}, counter=counter) == {"a": 1}
        assert C.all_gather_object(7) == [7]
        C.barrier(timeout=1)
        with pytest.raises(RuntimeError, match="already initialised"):
            W.ProcessGroups.init(W.WorldInfo(), Layout(1, 1, 1))
    finally:
        pg.destroy()
    pg.destroy()  # idempotent
    with pytest.raises(RuntimeError, match="not initialised"):
        W.ProcessGroups.current()


@pytest.mark.parametrize("gpus, per_machine, want", [(0, 1, "gloo"), (0, 4, "gloo"), (1, 1, "nccl"),
                                                     (1, 2, "gloo"), (4, 4, "nccl"), (2, 4, "gloo")])
def test_auto_backend_takes_nccl_only_where_each_process_has_a_gpu(monkeypatch, gpus, per_machine, want):
    """NCCL refuses two ranks on one GPU: ``auto`` takes gloo where a machine's processes outnumber
    its GPUs (and on a machine with none); a named backend is taken as named."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    world = W.WorldInfo(rank=0, world_size=per_machine, local_world_size=per_machine)
    assert W.ProcessGroups.resolve_backend("auto", world) == want
    assert W.ProcessGroups.resolve_backend("nccl", world) == "nccl"
    with pytest.raises(ConfigError, match="parallel.comm_backend=ucc: choose one of auto, gloo, nccl, mpi"):
        W.ProcessGroups.resolve_backend("ucc", world)


def test_comm_backend_is_a_typed_setting():
    from tgdist.runtime.build import compose

    assert compose(["parallel.comm_backend=gloo"]).parallel.comm_backend == "gloo"
    with pytest.raises(Exception, match="comm_backend"):
        compose(["parallel.comm_backend=ucc"])


def test_process_groups_check_world_first():
    with pytest.raises(ConfigError, match="= 2 but the world has 1 process"):
        W.ProcessGroups.init(W.WorldInfo(), Layout(1, 2, 1))


def test_byte_counter():
    c = C.ByteCounter()
    c.add("grad", sent=8, received=8)
    c.add("grad", sent=4)
    c.add("mem")
    assert c["grad"] == C.Traffic(calls=2, bytes_sent=12, bytes_received=8)
    assert c["missing"] == C.Traffic() and c.total_sent() == 12
    assert c.as_dict() == {"grad": {"calls": 2, "bytes_sent": 12, "bytes_received": 8},
                           "mem": {"calls": 1, "bytes_sent": 0, "bytes_received": 0}}


def test_disagreement_names_the_keys_and_the_first_rank():
    from tgdist.distributed.world import disagreement

    same = {"train.lr": "0.1", "parallel.k": "2"}
    assert disagreement([same, dict(same), dict(same)], "configs") is None
    other = {"train.lr": "0.2", "parallel.k": "2", "train.extra": "1"}
    assert disagreement([same, dict(same), other, other], "configs") == (
        "the ranks of this run were started with other configs: train.extra: rank 0 <unset> vs rank 2 1, "
        "train.lr: rank 0 0.1 vs rank 2 0.2 (2 ranks differ from rank 0); start every rank with the same ones")


def test_ranks_that_do_not_meet_fail_in_one_line_and_rank_0_says_it_waits(caplog):
    """A machine never started: rank 0 waited the whole timeout in silence, then a traceback."""
    from datetime import timedelta

    from tgdist.distributed.world import ProcessGroups, WorldInfo, _waiting_notice
    from tgdist.errors import RunFailure

    with caplog.at_level("WARNING", logger="tgdist.distributed.world"), \
            _waiting_notice(0, 2, "host:1", timedelta(seconds=600), first=0.05):
        time.sleep(0.3)
    assert "rank 0: still waiting for the other ranks (2 in all) to meet at host:1 after 0 s; gives up after 600 s" \
        in caplog.text
    port = free_port()
    world = WorldInfo(rank=0, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=port,
                      launcher="slurm")
    t0 = time.monotonic()
    with pytest.raises(RunFailure, match=rf"rank 0: the 2 ranks did not meet at 127.0.0.1:{port} within 2 s \("):
        ProcessGroups.init(world, Layout(2, 1, 1), backend="gloo", timeout=2.0)
    assert time.monotonic() - t0 < 30
    with pytest.raises(ConfigError, match="the master address 'no-such-host.invalid' .* does not resolve"):
        ProcessGroups.init(WorldInfo(rank=0, world_size=2, local_world_size=2, master_addr="no-such-host.invalid",
                                     master_port=port, launcher="slurm"), Layout(2, 1, 1), backend="gloo", timeout=2.0)
