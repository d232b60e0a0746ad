"""One rank of test_reshard.py's store-by-store checks, under torchrun or as one process:
``reshard_probe.py DIR [write=B,...] [read=SRC,...] [into=B,...] OVERRIDES...``, the layout's
parallel.i the world size.

write: for each store B, a run of this layout whose model, optimizer and node memory are set to
known values (the memory ``whole_memory()``: each store filled through its own ``load_state_dict``,
a partitioned one shard by shard) and checkpointed through ``Run.save`` at ``iteration(i)`` (event
400 of the first pass), in ``DIR/src-<i>-<B>``. Nothing is trained: the checks are about the files.

read: each checkpoint ``DIR/SRC`` resumed (``Run.load``) with each store of ``into``; rank 0 saves
what the run then holds: its memory group's whole memory, the model's and the optimizer's state, the
iteration it continues at and the optimizer's learning rate, in ``DIR/SRC-into-<i>-<B>.pt``."""

import sys
from pathlib import Path

import torch

from tgdist.distributed import collectives
from tgdist.distributed.schedule import Layout
from tgdist.distributed.world import ProcessGroups, detect
from tgdist.runtime.build import compose
from tgdist.runtime.run import Run

KEYS = ("mem", "mem_ts", "mail", "mail_ts", "head")


def iteration(i: int) -> int:
    """The checkpoint's iteration at i trainers of 100 events: 400 events into the stream."""
    return 4 // i


def whole_memory(num_nodes: int, mem_dim: int, mail_dim: int, slots: int) -> dict:
    """Known values for every node's memory and mails (none zero, so a row left out shows)."""
    g = torch.Generator().manual_seed(55)
    return {"mem": torch.randn(num_nodes, mem_dim, generator=g) + 3,
            "mem_ts": torch.rand(num_nodes, generator=g, dtype=torch.float64) * 1e6 + 1,
            "mail": torch.randn(num_nodes, slots, mail_dim, generator=g) - 3,
            "mail_ts": torch.rand(num_nodes, slots, generator=g, dtype=torch.float64) * 1e6 + 1,
            "head": torch.randint(0, slots, (num_nodes,), generator=g)}


def gathered(store, rank: int) -> dict | None:
    """The memory group's whole memory as ``store`` holds it (sharded stores gather their shards)."""
    if hasattr(store, "full_state"):
        return store.full_state()
    return {k: v.clone() for k, v in store.state_dict().items()} if rank == 0 else None


def write(base: list, backend: str, layout: Layout, world, groups, out: Path) -> None:
    i = layout.i
    cfg = compose([*base, f"memory.backend={backend}", f"run_dir={out}"])
    run = Run(cfg, out, groups=groups)
    try:
        tr, store = run.trainer, run.trainer.memory
        m = tr.model
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        tr.optimizer.step()  # Adam's moments and step count, the same on every rank
        whole = whole_memory(tr.g.num_nodes, m.mem_dim, m.mail_dim, m.mailbox_size)
        if hasattr(store, "maps"):  # a shard per trainer: the rows of the nodes it holds
            owned = torch.from_numpy(store.maps.globals_of(store.me).copy())
            store.shard.load_state_dict({k: whole[k][owned] for k in KEYS})
        elif not store.one_copy_per_group or run.rank == 0:
            store.load_state_dict(whole)
        collectives.barrier(groups.get("world"), name="probe")
        run.save(iteration(i))
    finally:
        run.close()


def read(base: list, src: Path, backend: str, layout: Layout, world, groups, out: Path) -> None:
    cfg = compose([*base, f"memory.backend={backend}", f"train.resume={src}", f"run_dir={out}.run"])
    run = Run(cfg, f"{out}.run", groups=groups)
    try:
        path, state = run._resume
        run.load(path, state)
        tr = run.trainer
        whole = gathered(tr.memory, run.rank)
        if run.rank == 0:
            torch.save({"memory": whole, "model": tr.model.state_dict(), "optimizer": tr.optimizer.state_dict(),
                        "start": run.start_iteration, "lr": [g["lr"] for g in tr.optimizer.param_groups],
                        "losses": run.losses}, out)
        collectives.barrier(groups.get("world"), name="probe")
    finally:
        run.close()


def main(folder: str, *args: str) -> None:
    lists = {"write": [], "read": [], "into": []}
    while args and args[0].split("=", 1)[0] in lists:
        key, value = args[0].split("=", 1)
        lists[key] = value.split(",")
        args = args[1:]
    world = detect()
    base = [*args, f"parallel.i={world.world_size}"]
    layout = Layout(world.world_size, 1, 1)
    groups = ProcessGroups.init(world, layout)
    d = Path(folder)
    try:
        for backend in lists["write"]:
            write(base, backend, layout, world, groups, d / f"src-{layout.i}-{backend}")
        for src in lists["read"]:
            for backend in lists["into"]:
                read(base, d / src, backend, layout, world, groups, d / f"{src}-into-{layout.i}-{backend}.pt")
        collectives.barrier(groups.get("world"), name="shutdown")
    finally:
        groups.destroy()


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
