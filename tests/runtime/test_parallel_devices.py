"""The distributed path with a compute device other than the communication device (issue 24, 5).

Two gloo ranks (communication on the CPU) train with the trainer on ``meta`` made a device with
values (``tests/device_shim.py``): every collective must get CPU tensors (``torch.distributed`` is
wrapped to refuse anything else), memory reads must come back on the compute device, and since the
shim computes with the CPU's kernels the run must equal the same run on the CPU, with the same
communication figures. (To float rounding, not bit for bit: the attention layer's CPU-only shortcut,
the query table cut at ``index.max()``, sums two gradients over fewer rows.) A CPU tensor mixed
into the compute device's (the flag of the old gradient averaging, ``all_gather_rows``'s buffers, a
mail round's column) fails here as on a GPU.
"""

from __future__ import annotations

import functools
import io
import traceback
from contextlib import nullcontext
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from tests.device_shim import ShimDevice
from tests.launcher.helpers import spawn_ranks
from tgdist.distributed import collectives

pytestmark = pytest.mark.distributed

OVERRIDES = ["data=synthetic", "data.synthetic.num_events=500", "data.synthetic.num_nodes=40", "model.mem_dim=8",
             "model.time_dim=4", "model.dropout=0.0", "model.cpu_kernels=false", "train.batch_size=40",
             "train.epochs=2", "train.num_threads=1", "sampler.num_threads=1", "train.progress=false",
             "train.lr_scaling=none", "train.num_neg_eval=9"]


def _check_devices(name: str, fn):
    """``torch.distributed.<name>`` refusing any tensor but a CPU one (every group here is gloo)."""
    def call(*args, **kwargs):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and (type(t) is not torch.Tensor or t.device.type != "cpu"):
                raise AssertionError(f"torch.distributed.{name} got a tensor on {t.device} ({type(t).__name__}); "
                                     f"gloo takes CPU tensors")
        return fn(*args, **kwargs)
    return call


def _train(cfg, layout, rank: int, groups, backend: str, device: str) -> dict:
    """One rank's ``Run`` with the trainer on ``device``; everything back on the CPU."""
    import shutil
    import tempfile

    from tgdist.runtime.build import build_trainer
    from tgdist.runtime.run import Run

    run_dir = tempfile.mkdtemp(prefix="tgdist-devices-") if rank == 0 else None
    run = Run(cfg, run_dir, trainer=build_trainer(cfg, progress=False, device=device), groups=groups)
    trainer, m = run.trainer, run.trainer.model
    read_devices = set()
    store_read = trainer.memory.read

    def read(ids, **kw):  # (depcomm's reads take the occurrences too)
        got = store_read(ids, **kw)
        values = tree_flatten(list(vars(got).values()))[0]  # (depcomm's read holds lists of slots)
        read_devices.update(t.device.type for t in values if isinstance(t, torch.Tensor))
        return got

    trainer.memory.read = read
    losses, memory = [], {}

    def record(t, loss):
        losses.append(loss)
        if t == run.iterations - 1:  # the memory training leaves (rank 0's evaluation goes on to change it)
            memory.update({k: v.to("cpu", copy=True) for k, v in trainer.memory.state_dict().items()})

    try:
        run.train(on_iteration=record)
        params = [p.detach().to("cpu") for p in m.parameters()]
        return {"losses": losses, "params": params, "memory": memory, "communication": run.counter.as_dict(),
                "read_devices": sorted(read_devices), "param_types": sorted({type(p).__name__ for p in m.parameters()})}
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


def _collective_helpers(rank: int) -> dict:
    """The helpers the loop above does not use (or not in every form), on ``meta`` tensors."""
    x = torch.full((3,), float(rank + 1), device="meta")
    collectives.all_reduce_mean([x], name="x", counter=collectives.ByteCounter())
    p = torch.nn.Parameter(torch.full((2,), float(rank + 5), device="meta"))
    collectives.broadcast_tensors([p], src=0, counter=collectives.ByteCounter())
    rows = torch.arange(4 * rank, dtype=torch.float64, device="meta").view(-1, 2)  # 0 rows on rank 0, 2 on rank 1
    gathered = collectives.all_gather_rows(rows, counter=collectives.ByteCounter())
    empty = collectives.all_gather_rows(rows[:0], counter=collectives.ByteCounter())
    out = {"mean": x, "broadcast": p.detach(), **{f"rows{r}": g for r, g in enumerate(gathered)}, "empty": empty[0]}
    return {k: (v.device.type, v.to("cpu").tolist()) for k, v in out.items()}


def _worker(rank: int, port: int, layout_ijk: tuple, backend: str, out) -> None:
    torch.set_num_threads(1)
    try:
        from tgdist.distributed.schedule import Layout
        from tgdist.distributed.world import ProcessGroups, WorldInfo
        from tgdist.runtime import trainer as trainer_module
        from tgdist.runtime.build import compose

        # fused Adam refuses the meta device; both runs take the plain loop, so they stay comparable
        trainer_module.adam = lambda params, lr: torch.optim.Adam(list(params), lr=lr)
        for name in ("all_reduce", "all_gather", "broadcast", "all_to_all_single"):
            setattr(dist, name, _check_devices(name, getattr(dist, name)))
        layout = Layout(*layout_ijk)
        cfg = compose(OVERRIDES + [f"parallel.i={layout.i}", f"parallel.j={layout.j}", f"memory.backend={backend}"]
                      + (["memory.timeout=60"] if backend == "daemon" else []))  # (the daemon's own key)
        world = WorldInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, master_port=port,
                          launcher="mpi")  # tcp:// rendezvous at master_port
        groups = ProcessGroups.init(world, layout, backend="gloo", timeout=timedelta(seconds=60))
        try:
            got = {}
            for device in ("cpu", "meta"):
                with ShimDevice() if device == "meta" else nullcontext():
                    got[device] = _train(cfg, layout, rank, groups, backend, device)
                    if device == "meta":
                        try:  # reported by its own test
                            got["helpers"] = _collective_helpers(rank)
                        except Exception:  # noqa: BLE001
                            got["helpers"] = traceback.format_exc()
            buf = io.BytesIO()  # tensors by value: a queue would share them through this process, which exits
            torch.save(got, buf)
            out.put((rank, "ok", buf.getvalue()))
        finally:
            groups.destroy()
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, "failed", traceback.format_exc()))


@functools.cache  # one run per layout for the whole module
def _run(layout_ijk: tuple, backend: str) -> dict:
    return spawn_ranks(_worker, layout_ijk, backend)


@pytest.mark.parametrize("layout,backend", [  # ~14-19 s each; sven's stays in the default run
    pytest.param((1, 2, 1), "depcache", marks=pytest.mark.slow), pytest.param((2, 1, 1), "daemon", marks=pytest.mark.slow),
    ((2, 1, 1), "sven"), pytest.param((2, 1, 1), "depcomm", marks=pytest.mark.slow)])
def test_compute_on_another_device_than_the_collectives_trains_the_same(layout, backend):
    """1 x 2 x 1 with depcache: one rank writes, the other flushes nothing, and each is idle once
    (its zeros averaged with ``active=False``); 2 x 1 x 1 with the daemon: both ranks read the
    daemon's memory and average gradients every iteration."""
    results = _run(layout, backend)
    for rank, got in results.items():
        cpu, meta = got["cpu"], got["meta"]
        assert cpu["read_devices"] == ["cpu"] and meta["read_devices"] == ["meta"], rank  # reads on the compute device
        assert meta["param_types"] == ["Shim"] and cpu["param_types"] == ["Parameter"]
        assert len(meta["losses"]) > 2 and [x is None for x in meta["losses"]] == [x is None for x in cpu["losses"]]
        assert [x for x in meta["losses"] if x is not None] == pytest.approx([x for x in cpu["losses"] if x is not None],
                                                                             rel=1e-6)
        torch.testing.assert_close(meta["params"], cpu["params"])
        torch.testing.assert_close(meta["memory"], cpu["memory"])
        assert meta["communication"] == cpu["communication"]  # the summary's figures do not move
        grads = cpu["communication"]["gradients"]
        params = sum(p.numel() for p in cpu["params"])
        assert grads["bytes_sent"] == grads["calls"] * (params + 1) * 4  # float32 gradients + the active count
    assert results[0]["cpu"]["params"][0].equal(results[1]["cpu"]["params"][0])  # one model
    if layout[1] > 1:  # an idle step somewhere: zeros averaged, not counted
        assert any(None in got["meta"]["losses"] for got in results.values())


def test_collective_helpers_send_from_the_communication_device_and_answer_on_the_callers():
    """``all_reduce_mean``, ``broadcast_tensors`` and ``all_gather_rows`` (rows on one rank only,
    and none at all) with ``meta`` tensors, in the workers of the 1 x 2 x 1 run above."""
    helpers = {rank: got["helpers"] for rank, got in _run((1, 2, 1), "depcache").items()}
    for rank, h in helpers.items():
        assert isinstance(h, dict), f"rank {rank}:\n{h}"
        assert {d for d, _ in h.values()} == {"meta"}, rank
        assert h["mean"][1] == [1.5, 1.5, 1.5] and h["broadcast"][1] == [5.0, 5.0]
        assert h["rows0"][1] == [] and h["rows1"][1] == [[0.0, 1.0], [2.0, 3.0]] and h["empty"][1] == []


def test_comm_device_follows_the_backend(monkeypatch):
    assert collectives.comm_device() == torch.device("cpu")  # no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collectives.comm_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # ProcessGroups.init set it from the local rank
    assert collectives.comm_device() == torch.device("cuda", 3)
