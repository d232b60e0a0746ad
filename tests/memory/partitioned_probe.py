"""One rank of a parallel run trained once per memory backend (depcache, sven, depcomm by default)
in the same processes, each a ``Run`` on the probe's process groups (its store from the registry); after
every iteration it records this rank's loss, its memory group's whole memory (sharded stores
gather their shards), the byte counter, the rows each read and write touched, and at the end
rank 0's metrics after evaluating alone. Each rank saves ``OUT.<rank>``; used by test_sven.py under
torchrun (``python partitioned_probe.py OUT [runs=a,b:k=v;k=v] OVERRIDES...``); ``PROBE_READ_DELAY=S[:R,R...]``
holds every batch's read back S seconds (on ranks R only), so a read that the loop does not wait for
comes late; ``PROBE_SYNC_FREE=1`` runs the memory updaters as on a GPU (``use_sync_free``)."""

import os
import sys
import time

import torch

from tgdist.distributed import collectives
from tgdist.distributed.schedule import Layout
from tgdist.distributed.world import ProcessGroups, detect
from tgdist.memory.store import MemoryRead
from tgdist.models.modules import use_sync_free
from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.run import Run
from tgdist.runtime.trainer import occurrences as occurrences_of

STATE = ("mem", "mem_ts", "mail", "mail_ts", "head")


def state_of(store) -> dict:
    if hasattr(store, "full_state"):
        return store.full_state()
    return {k: getattr(store, k).clone() for k in STATE}


def run(backend: str, cfg, layout: Layout, world, groups) -> dict:
    import shutil
    import tempfile

    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(cfg, {"memory": {"backend": backend}})
    run_dir = tempfile.mkdtemp(prefix="tgdist-partitioned-") if world.rank == 0 else None
    driver = Run(cfg, run_dir, trainer=build_trainer(cfg, progress=False), groups=groups)
    tr, store = driver.trainer, driver.trainer.memory
    m = tr.model
    if os.environ.get("PROBE_SYNC_FREE"):  # the updaters as a GPU runs them (with model.cpu_kernels=false)
        use_sync_free(m, True)
    rec = {"losses": [], "grads": [], "states": [], "counters": [], "links": [], "reads": [], "occurrences": [],
           "uses": [], "events": [], "mem_writes": [], "mail_writes": [], "read_values": {}}
    reads, occurrences, uses, events, mem_writes, mail_writes = [], [], [], [], [], []
    prepare, prepare_micro, write_memory, write_mail = tr.prepare, tr.prepare_micro, store.write_memory, store.write_mail
    end_training = store.end_training

    seconds, _, on = os.environ.get("PROBE_READ_DELAY", "0").partition(":")  # S[:RANK,RANK...] (races)
    delay = float(seconds) if not on or str(world.rank) in on.split(",") else 0.0

    def recording_prepare(lo, hi, neg, read=None, sampled=None, **kw):
        if delay:
            time.sleep(delay)
        p = prepare(lo, hi, neg, read, sampled, **kw)
        if isinstance(p.read, MemoryRead):  # what training reads returned, by batch, in order (not DepComm's)
            rec["read_values"].setdefault(lo, []).append((p.ids.clone(), *(getattr(p.read, k).clone()
                                                                           for k in STATE[:4])))
        reads.append(p.ids.clone())
        occurrences.append(p.root_idx.numel() + sum(int(h.mask.sum()) for h in p.hop_tables))
        uses.append(occurrences_of(p))  # per id of the read: how often the batch samples it
        events.append(hi - lo)
        return p

    def recording_prepare_micro(lo, hi, neg, n, **kw):  # each micro-batch's read, as ``prepare``'s
        parts = prepare_micro(lo, hi, neg, n, **kw)
        for p in parts:
            reads.append(p.ids.clone())
            occurrences.append(p.root_idx.numel() + sum(int(h.mask.sum()) for h in p.hop_tables))
            uses.append(occurrences_of(p))
            events.append(p.hi - p.lo)
        return parts

    def recording_write_memory(ids, mem, mem_ts):
        mem_writes.append(ids.clone())
        return write_memory(ids, mem, mem_ts)

    def recording_write_mail(ids, mail, mail_ts):
        mail_writes.append(ids.clone())
        return write_mail(ids, mail, mail_ts)

    def recording_end_training(evaluates):  # the memory training leaves, before rank 0 evaluates on it
        tr.prepare, tr.prepare_micro = prepare, prepare_micro
        if hasattr(store, "maps"):
            rec["trainer_of"] = torch.from_numpy(store.maps.trainer_of.copy())
            rec["local_of"] = torch.from_numpy(store.maps.local_of.copy())
            rec["rows_held"] = store.rows_held()
        end_training(evaluates)
        rec["final_state"] = state_of(store) if world.rank == 0 else None
        rec["rows_after_training"] = store.rows_held() if hasattr(store, "rows_held") else None

    tr.prepare, store.write_memory, store.write_mail = recording_prepare, recording_write_memory, recording_write_mail
    tr.prepare_micro = recording_prepare_micro
    store.end_training = recording_end_training

    def record(t, loss):
        rec["losses"].append(loss)
        rec["grads"].append(torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                                       for p in m.parameters()]))  # (None: asynchronous all-reduce, first step)
        rec["states"].append(state_of(store))
        rec["counters"].append(driver.counter.as_dict())
        rec["links"].append({k: torch.from_numpy(v.copy()) for k, v in getattr(store, "link_rows", {}).items()})
        for key, got in (("reads", reads), ("occurrences", occurrences), ("uses", uses), ("events", events),
                         ("mem_writes", mem_writes), ("mail_writes", mail_writes)):
            rec[key].append(list(got))
            got.clear()

    try:
        summary = driver.train(on_iteration=record)  # rank 0 evaluates alone at its end, then every rank has it
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
    rec["metrics"] = {k: v for k, v in summary.items()
                      if k.startswith(("val_", "test_")) and not k.endswith("_at_best_val")}
    rec["params"] = [p.detach().clone() for p in m.parameters()]
    online = getattr(driver.pipeline, "_online", None)  # mspipe: the staleness this rank read with
    rec["staleness"] = (getattr(driver.pipeline, "staleness", 0), None if online is None else online.tolist())
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
            # composed with its store: each store's own keys are on its config class (memory.remote_dispatch: DepComm's)
            cfg = compose([*args, f"memory.backend={backend}", *filter(None, extra.split(";"))])
            result[spec] = run(backend, cfg, layout, world, groups)
        torch.save(result, f"{out}.{world.rank}")
        collectives.barrier(groups.get("world"), name="shutdown")  # all done before teardown
    finally:
        result = None
        groups.destroy()


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
