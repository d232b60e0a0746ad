"""One rank of a parallel run trained once per memory backend (depcache, sven, depcomm by default)
in the same processes, each store built by ``memory.create`` as ``run_parallel`` builds it; after
every iteration it records this rank's loss, its memory group's whole memory (sharded stores
gather their shards), the byte counter, the rows each read and write touched, and at the end
rank 0's metrics after evaluating alone. Each rank saves ``OUT.<rank>``; used by test_sven.py under
torchrun (``python partitioned_probe.py OUT [runs=a,b:k=v;k=v] OVERRIDES...``)."""

import sys

import torch

from tgdist import memory
from tgdist.distributed import collectives
from tgdist.distributed.schedule import Layout
from tgdist.distributed.world import ProcessGroups, detect
from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.distributed import ParallelRun

STATE = ("mem", "mem_ts", "mail", "mail_ts", "head")


def state_of(store) -> dict:
    if hasattr(store, "full_state"):
        return store.full_state()
    return {k: getattr(store, k).clone() for k in STATE}


def run(backend: str, cfg, layout: Layout, world, groups) -> dict:
    tr = build_trainer(cfg, progress=False)
    m = tr.model
    par = ParallelRun(tr, layout, world.rank, groups, cfg.train.epochs)
    tr.memory = store = memory.create(backend, memory.StoreContext(
        tr.g.num_nodes, m.mem_dim, m.mail_dim, m.mailbox_size, device=tr.device, layout=layout, rank=world.rank,
        groups=groups, counter=par.counter, cfg=cfg, batch_size=tr.batch_size,
        fanouts=tuple(tr.sampler.fanouts) if tr.sampler is not None else (), graph=tr.g, train_end=par.n_train))
    rec = {"losses": [], "grads": [], "states": [], "counters": [], "links": [], "reads": [], "occurrences": [],
           "events": [], "mem_writes": [], "mail_writes": []}
    reads, occurrences, events, mem_writes, mail_writes = [], [], [], [], []
    prepare, write_memory, write_mail = tr.prepare, store.write_memory, store.write_mail

    def recording_prepare(lo, hi, neg, read=None):
        p = prepare(lo, hi, neg, read)
        reads.append(p.ids.clone())
        occurrences.append(p.root_idx.numel() + sum(int(h.mask.sum()) for h in p.hop_tables))
        events.append(hi - lo)
        return p

    def recording_write_memory(ids, mem, mem_ts):
        mem_writes.append(ids.clone())
        return write_memory(ids, mem, mem_ts)

    def recording_write_mail(ids, mail, mail_ts):
        mail_writes.append(ids.clone())
        return write_mail(ids, mail, mail_ts)

    tr.prepare, store.write_memory, store.write_mail = recording_prepare, recording_write_memory, recording_write_mail

    def record(t, loss):
        rec["losses"].append(loss)
        rec["grads"].append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
        rec["states"].append(state_of(store))
        rec["counters"].append(par.counter.as_dict())
        rec["links"].append({k: torch.from_numpy(v.copy()) for k, v in getattr(store, "link_rows", {}).items()})
        for key, got in (("reads", reads), ("occurrences", occurrences), ("events", events),
                         ("mem_writes", mem_writes), ("mail_writes", mail_writes)):
            rec[key].append(list(got))
            got.clear()

    par.train(progress=False, on_iteration=record)
    tr.prepare = prepare
    if hasattr(store, "maps"):
        rec["trainer_of"] = torch.from_numpy(store.maps.trainer_of.copy())
        rec["local_of"] = torch.from_numpy(store.maps.local_of.copy())
        rec["rows_held"] = store.rows_held()
    store.end_training(evaluates=world.rank == 0)
    rec["final_state"] = state_of(store) if world.rank == 0 else None
    if world.rank == 0:
        tr.grad_hook = None
        rec["metrics"] = {**tr.evaluate("val"), **tr.evaluate("test")}
        rec["rows_after_training"] = store.rows_held() if hasattr(store, "rows_held") else None
    elif hasattr(store, "rows_held"):
        rec["rows_after_training"] = store.rows_held()
    rec["params"] = [p.detach().clone() for p in m.parameters()]
    collectives.barrier(groups.get("world"), name="evaluated")
    store.close()
    return rec


def main(out: str, *args: str) -> None:
    runs = ["depcache", "sven", "depcomm"]
    if args and args[0].startswith("runs="):  # BACKEND or BACKEND:KEY=VALUE;KEY=VALUE (its own overrides)
        runs, args = args[0].split("=", 1)[1].split(","), args[1:]
    world = detect()
    cfg = compose(list(args))
    layout = Layout(cfg.parallel.i, cfg.parallel.j, cfg.parallel.k)
    groups = ProcessGroups.init(world, layout)
    try:
        result = {}
        for spec in runs:
            backend, _, extra = spec.partition(":")
            result[spec] = run(backend, compose([*args, *filter(None, extra.split(";"))]), layout, world, groups)
        torch.save(result, f"{out}.{world.rank}")
        collectives.barrier(groups.get("world"), name="shutdown")  # all done before teardown
    finally:
        result = None
        groups.destroy()


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
