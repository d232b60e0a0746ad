"""Run one rank of a parallel training job and record, after every iteration, the loss of this rank
and (on rank 0) the node memory; used by test_parallel.py under torchrun or as a single process."""

import json
import sys

import torch

from tgdist.distributed import collectives
from tgdist.distributed.schedule import Layout
from tgdist.distributed.world import ProcessGroups, detect
from tgdist.memory.depcache import DepCacheMemory
from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.distributed import ParallelRun


def main(out: str, *overrides: str) -> None:
    cfg = compose(list(overrides))
    world = detect()
    layout = Layout(cfg.parallel.i, cfg.parallel.j, cfg.parallel.k)
    groups = ProcessGroups.init(world, layout)
    try:
        tr = build_trainer(cfg, progress=False)
        m = tr.model
        tr.memory = DepCacheMemory(tr.g.num_nodes, m.mem_dim, m.mail_dim, m.mailbox_size, group=groups.get("memory"))
        par = ParallelRun(tr, layout, world.rank, groups, cfg.train.epochs)
        losses, mems, grads = [], [], []

        def record(t, loss):
            losses.append(loss)
            mems.append(tr.memory.mem.clone())
            grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))

        par.train(progress=False, on_iteration=record)
        all_losses = collectives.all_gather_object(losses, groups.get("world"))
        events = sum(collectives.all_gather_object(sum(e for _, _, e in par.losses), groups.get("world")))
        if world.rank == 0:
            torch.save({"losses": all_losses, "mem": torch.stack(mems), "grads": torch.stack(grads),
                        "params": [p.detach() for p in m.parameters()],
                        "events": events}, out)
            print(json.dumps({"iterations": par.iterations}))
        collectives.barrier(groups.get("world"), name="shutdown")  # all done before teardown
    finally:
        tr = par = None  # the memory holds a group handle: let destroy() free every group
        groups.destroy()


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
