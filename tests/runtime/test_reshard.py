"""Resuming on another layout or store (issue 55.1): the stream position mapped between global
batches, the refusals, the memory gathered from every file and re-placed, bit for bit, for pairs of
stores at 1, 2 and 4 trainers, and a run resumed twice on other layouts trained to its end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.launcher.helpers import free_port
from tests.runtime import reshard_probe
from tgdist.distributed import collectives
from tgdist.distributed.schedule import (Layout, next_resumable_iteration, resume_iteration, scaled_lr,
                                         stream_position)
from tgdist.errors import ConfigError
from tgdist.memory.placement import Placement
from tgdist.memory.store import LocalMemory
from tgdist.memory.sven import SvenMemory
from tgdist.partition.idmap import DualHashMap
from tgdist.runtime import checkpoint, reshard
from tgdist.runtime.build import compose

PROBE = str(Path(__file__).with_name("reshard_probe.py"))
SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.num_threads=1",
         "sampler.num_threads=1", "train.progress=false", "train.batch_size=100", "train.num_neg_eval=4",
         "train.epochs=2", "partition.method=range"]
N_TRAIN = 1048  # SMALL's training events (70% of 1,500, to the split's last timestamp)


# ------------------------------------------------------------------------------------------------
# The stream position (schedule.py, pure)


def test_the_stream_position_maps_to_the_iteration_of_the_new_global_batches():
    one, two, four = Layout(1), Layout(2), Layout(4)
    # 2 x 100 events a global batch: 6 a pass (the last of 48 events)
    assert stream_position(two, 2, N_TRAIN, 100) == (0, 400)
    assert stream_position(two, 6, N_TRAIN, 100) == (1, 0)  # the pass's short last batch ends it
    assert resume_iteration(two, 2, one, N_TRAIN, 100) == 4
    assert resume_iteration(two, 2, four, N_TRAIN, 100) == 1
    assert resume_iteration(four, 1, two, N_TRAIN, 100) == 2
    assert resume_iteration(two, 8, four, N_TRAIN, 100) == 3 + 1  # pass 1, event 400: 3 batches a pass at 4 x 100
    assert resume_iteration(one, 11, two, N_TRAIN, 100) == 6  # an end of pass: 11 and 6 batches a pass
    assert resume_iteration(two, 12, one, N_TRAIN, 100) == 22  # the end of a run of 2 epochs
    assert resume_iteration(two, 3, four, N_TRAIN, 100) is None  # event 600: not a multiple of 400
    assert resume_iteration(one, 3, two, N_TRAIN, 100) is None
    assert next_resumable_iteration(two, 3, four, N_TRAIN, 100) == 4
    assert next_resumable_iteration(one, 9, four, N_TRAIN, 100) == 11  # no multiple of 4 before the pass ends
    assert next_resumable_iteration(one, 8, four, N_TRAIN, 100) == 8
    with pytest.raises(ValueError, match="j = k = 1 only"):
        stream_position(Layout(1, 2, 1), 2, N_TRAIN, 100)


def test_a_place_that_is_no_boundary_of_the_new_global_batches_is_refused_naming_both_ways_out():
    state = {"layout": "1 x 1 x 1", "iteration": 3, "dir": "it00000003"}
    with pytest.raises(ConfigError) as e:
        reshard.plan(Path("last.pt"), state, Layout(2), 0, N_TRAIN, 100)
    assert str(e.value) == ("last.pt: written at iteration 3 of layout 1 x 1 x 1, after 300 events of pass 0, which "
                            "is not a boundary of this run's global batches of 2 x 100 events; resume it with a "
                            "parallel.i that divides 3, or let layout 1 x 1 x 1 train on to its iteration 4 and resume from there")
    assert reshard.plan(Path("last.pt"), state, Layout(1), 0, N_TRAIN, 100) is None  # its own layout


def test_reads_made_ahead_for_the_old_layouts_batches_are_refused(tmp_path):
    d = tmp_path / "it00000004"
    checkpoint.atomic_save({"losses": [], "slots": {}, "sampler_calls": 0}, d / "rank-0.pt")
    checkpoint.atomic_save({"losses": [], "slots": {5: {"lo": 0}}, "sampler_calls": 0}, d / "rank-1.pt")
    state = {"layout": "2 x 1 x 1", "iteration": 4, "dir": d.name}
    with pytest.raises(ConfigError, match=r"last.pt: written by layout 2 x 1 x 1 with 1 reads made ahead for its "
                                          r"batches \(a pipeline that reads ahead\), which this run's batches would "
                                          r"not read; resume it with layout 2 x 1 x 1$"):
        reshard.plan(tmp_path / "last.pt", state, Layout(1), 0, N_TRAIN, 100)
    checkpoint.atomic_save({"losses": [(0, 2.0, 100)], "slots": {}, "sampler_calls": 3}, d / "rank-1.pt")
    checkpoint.atomic_save({"losses": [(0, 1.0, 100)], "slots": {}, "sampler_calls": 2}, d / "rank-0.pt")
    got = reshard.plan(tmp_path / "last.pt", state, Layout(1), 0, N_TRAIN, 100)
    assert got.start == 8 and got.old == Layout(2)
    assert got.mine["losses"] == [(0, 1.0, 100), (0, 2.0, 100)] and got.mine["sampler_calls"] == 2  # rank 0: all losses
    assert reshard.plan(tmp_path / "last.pt", state, Layout(4), 3, N_TRAIN, 100).mine == {
        "losses": [], "slots": {}, "sampler_calls": 3}  # rank 3 takes old rank 1's file, and no losses


# ------------------------------------------------------------------------------------------------
# The layouts the memory can be re-placed to


def test_only_the_trainer_count_of_one_memory_group_without_epoch_parallelism_may_change():
    def check(written: str, now: list, backend="sven"):
        state = {"layout": written, "epochs": 2, "memory_backend": backend}
        checkpoint.check_layout("last.pt", state, compose(["train.epochs=2", *now]))

    check("2 x 1 x 1", ["parallel.i=4"])
    check("4 x 1 x 1", [])
    check("1 x 1 x 1", ["parallel.i=2"])
    why = {"k": "with parallel.k > 1 each memory group holds its own memory at its own place in the stream, so no "
                "one memory is the run's",
           "j": "with parallel.j > 1 the subgroups train other places in the stream in one iteration, and only the "
                "first writes memory"}
    for written, now, layout, reason in [("2 x 1 x 2", ["parallel.i=4"], "4 x 1 x 1", "k"),
                                         ("2 x 1 x 1", ["parallel.k=2"], "1 x 1 x 2", "k"),
                                         ("2 x 1 x 2", ["parallel.k=2"], "1 x 1 x 2", "k"),
                                         ("1 x 2 x 1", [], "1 x 1 x 1", "j"),
                                         ("2 x 1 x 1", ["parallel.j=2"], "1 x 2 x 1", "j")]:
        with pytest.raises(ConfigError) as e:
            check(written, now)
        assert str(e.value) == (f"last.pt: written by a run of layout {written}, and this run's is {layout} "
                                f"(parallel.i/j/k), a layout the memory cannot be re-placed to ({why[reason]}); resume "
                                f"with layout {written}, or change only parallel.i where j = k = 1")
    with pytest.raises(ConfigError, match=r"\(the checkpoint, of an older tgdist, does not say which store wrote its "
                                          r"memory files\)"):
        checkpoint.check_layout("last.pt", {"layout": "2 x 1 x 1", "epochs": 2}, compose(["train.epochs=2"]))


def test_a_checkpoint_of_a_store_this_tgdist_does_not_have_is_refused():
    with pytest.raises(ConfigError) as e:
        checkpoint.check_store("last.pt", {"memory_backend": "elsewhere"}, compose([]))
    assert str(e.value) == ("last.pt: its node memory was written by memory.backend=elsewhere, a store this tgdist "
                            "does not have; resume where that store is registered (TGDIST_PLUGINS)")
    checkpoint.check_store("last.pt", {"memory_backend": "sven"}, compose(["memory.backend=depcache"]))


# ------------------------------------------------------------------------------------------------
# Gathering shards and placing them again (in one process: a group of three trainers faked)


def test_shards_gather_into_the_whole_memory_and_each_trainer_takes_its_rows(monkeypatch):
    whole = reshard_probe.whole_memory(10, 4, 6, 2)
    owner = np.array([2, 0, 1, 1, 0, 2, 2, 0, 1, 0])
    maps = DualHashMap.from_assignment(owner, 3)
    monkeypatch.setattr(collectives, "group_size", lambda group=None: 3)
    files = {}
    for me in range(3):
        monkeypatch.setattr(collectives, "group_rank", lambda group=None, me=me: me)
        store = SvenMemory(Placement(maps, "by hand"), 4, 6, 2)
        store.load_whole_state(whole)
        assert torch.equal(store.shard.mem, whole["mem"][torch.from_numpy(maps.globals_of(me))])
        files[f"memory-0-s{me}.pt"] = store.state_dict()
    back = SvenMemory.whole_state(files)
    assert set(back) == set(reshard_probe.KEYS)
    for k in reshard_probe.KEYS:
        assert torch.equal(back[k], whole[k]), k
    local = LocalMemory(10, 4, 6, 2)
    local.load_whole_state(back)
    assert torch.equal(LocalMemory.whole_state({"memory-0.pt": local.state_dict()})["mail"], whole["mail"])
    del files["memory-0-s1.pt"]
    with pytest.raises(ValueError, match=r"the 2 memory shards hold 7 rows, not nodes 0 \.\. 6 once each$"):
        SvenMemory.whole_state(files)


# ------------------------------------------------------------------------------------------------
# Store to store through real checkpoints (reshard_probe.py writes and reads them)


def source_memory(run_dir: Path) -> dict:
    """The whole memory of a checkpoint's files, put together here (not by the code under test)."""
    state = checkpoint.read(run_dir / "checkpoints" / "last.pt")
    d = run_dir / "checkpoints" / state["dir"]
    files = [checkpoint.read_part(d / n) for n in state["parts"] if n.startswith("memory-0")]
    if "owned" not in files[0]:
        return files[0]
    whole = {}
    for k in reshard_probe.KEYS:
        first = files[0][f"shard.{k}"]
        whole[k] = torch.zeros((sum(len(f["owned"]) for f in files), *first.shape[1:]), dtype=first.dtype)
        for f in files:
            whole[k][f["owned"]] = f[f"shard.{k}"]
    return whole


def assert_carried(folder: Path, src: str, i: int, backend: str) -> None:
    """After ``src`` was resumed at i trainers with ``backend``: the memory, model and optimizer
    state bit for bit the source's, the iteration at event 400, the learning rate of i trainers."""
    got = torch.load(folder / f"{src}-into-{i}-{backend}.pt", weights_only=True)
    state = checkpoint.read(folder / src / "checkpoints" / "last.pt")
    mem = source_memory(folder / src)
    assert mem["mem"].abs().min() > 0  # every row written (the probe's values are never zero)
    for k in reshard_probe.KEYS:
        assert torch.equal(got["memory"][k], mem[k]), k
    assert got["model"].keys() == state["model"].keys()
    for k, v in state["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["optimizer"]["state"].keys() == state["optimizer"]["state"].keys()
    for p, s in state["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(got["optimizer"]["state"][p][k], v), (p, k)
    written = int(src.split("-")[1])
    assert got["start"] == reshard_probe.iteration(i) and state["iteration"] == reshard_probe.iteration(written)
    lr = compose(SMALL).train.lr
    assert state["optimizer"]["param_groups"][0]["lr"] == scaled_lr(lr, written)
    assert got["lr"] == [scaled_lr(lr, i)]


def probe(folder: Path, nproc: int, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, PROBE] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", PROBE]
    r = subprocess.run([*cmd, str(folder), *args, *SMALL], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


def test_one_process_resumes_a_local_checkpoint_into_sven_and_back(tmp_path):
    """The fast core, in this process: 1 x 1 x 1 with local memory into sven's one shard, and sven's
    into local."""
    reshard_probe.main(str(tmp_path), "write=local,sven", "read=src-1-local", "into=sven", *SMALL)
    reshard_probe.main(str(tmp_path), "read=src-1-sven", "into=local", *SMALL)
    assert_carried(tmp_path, "src-1-local", 1, "sven")
    assert_carried(tmp_path, "src-1-sven", 1, "local")


STORES = {1: ["local", "sven", "daemon"], 2: ["depcache", "sven", "daemon", "depcomm"],
          4: ["depcache", "sven", "daemon", "depcomm"]}
PAIRS = [(f"src-{a}-{s}", b, t) for a in STORES for s in STORES[a] for b in STORES for t in STORES[b]]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Every store of STORES writes a checkpoint at 1, 2 and 4 trainers, and each is read by every
    store at every count (five launches: a layout's reads follow every write they read)."""
    folder = tmp_path_factory.mktemp("reshard")
    src = {n: [f"src-{n}-{s}" for s in STORES[n]] for n in STORES}
    probe(folder, 1, f"write={','.join(STORES[1])}")
    probe(folder, 2, f"write={','.join(STORES[2])}", f"read={','.join(src[1] + src[2])}",
          f"into={','.join(STORES[2])}")
    probe(folder, 4, f"write={','.join(STORES[4])}", f"read={','.join(src[1] + src[2] + src[4])}",
          f"into={','.join(STORES[4])}")
    probe(folder, 1, f"read={','.join(src[1] + src[2] + src[4])}", f"into={','.join(STORES[1])}")
    probe(folder, 2, f"read={','.join(src[4])}", f"into={','.join(STORES[2])}")
    return folder


@pytest.mark.slow  # about 6 minutes for the whole matrix on two shared cores
@pytest.mark.distributed
@pytest.mark.parametrize("src, i, backend", PAIRS, ids=[f"{s}-into-{i}-{b}" for s, i, b in PAIRS])
def test_memory_model_and_optimizer_carry_bit_for_bit_between_stores_and_trainer_counts(resharded, src, i, backend):
    assert_carried(resharded, src, i, backend)


# ------------------------------------------------------------------------------------------------
# A run resumed twice on other layouts trains to its end


@pytest.mark.slow  # about 4 minutes on two shared cores
@pytest.mark.distributed
def test_a_run_moved_from_two_sven_trainers_to_one_process_to_two_depcache_trainers_trains_to_the_end(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = [*SMALL, "train.checkpoint_every=2"]

    def torchrun(*args):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m",
                               "tgdist.train", *args], capture_output=True, text=True, timeout=600, env=env)

    r = torchrun(*common, "parallel.i=2", "memory.backend=sven", "train.stop_after_batches=2",
                 f"run_dir={tmp_path / 'a'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["stopped"]  # at iteration 2: 400 events
    r = subprocess.run([sys.executable, "-m", "tgdist.train", *common, "parallel.i=1", "memory.backend=local",
                        "train.stop_after_batches=4", f"train.resume={tmp_path / 'a'}", f"run_dir={tmp_path / 'b'}"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "b" / "train.log").read_text()
    assert ("resuming a checkpoint of layout 2 x 1 x 1: global batches of 1 x 100 events instead of 2 x 100, so the "
            "learning rate is 0.0001 instead of 0.0002 (train.lr_scaling=linear)") in log
    assert "at iteration 4 of 22" in log
    # one process stopped at its iteration 8 (800 events): 2 x 100 events a global batch continue at 4
    r = torchrun(*common, "parallel.i=2", "memory.backend=depcache", f"train.resume={tmp_path / 'b'}",
                 f"run_dir={tmp_path / 'c'}")
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads(r.stdout.strip().splitlines()[-1])
    assert done["parallel"] == "2 x 1 x 1" and done["memory_backend"] == "depcache"
    assert done["traversed_events"] == 2 * N_TRAIN  # every training event twice, over three layouts
    assert 0.3 < done["test_ap"] <= 1 and np.isfinite(done["loss"])
    assert "at iteration 4 of 12" in (tmp_path / "c" / "train.log").read_text()
