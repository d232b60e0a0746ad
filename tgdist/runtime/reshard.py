"""Resuming a checkpoint on another layout or memory store (issue 55.1).

What is well-defined: with one memory group and no epoch parallelism (``j = k = 1``), the node
memory and mails at the end of an iteration are those after every training event before it, in
whichever store holds them (a copy per group, a daemon, or shards over the trainers). So the
trainer count ``i`` and the store may change there: the memory is gathered from every file of the
checkpoint (``MemoryStore.whole_state`` of the store that wrote them), each trainer of the new
layout takes its part (``load_whole_state``: all of it, or the shard its placement gives it), the
model and optimizer are carried, and the run continues at the same place in the stream
(``schedule.resume_iteration``) with the learning rate of its own global batch. Where that place
is not a boundary of the new global batches the resume is refused with the old layout's next
iteration that is one (a first, shortened batch would train at a batch size neither run has).
``checkpoint.check_layout`` refuses ``j`` or ``k`` other than 1 on either side. With the layout
unchanged the store alone may change, for any j and k: each memory group's memory is re-placed
the same way and every rank keeps its own file.

Each rank of the new layout takes the random state, sampler position and embedding cache of the
old rank ``rank % old world`` (all replicas of one model, so any one's fits); rank 0 takes every
old rank's training losses, so the epoch's loss is over all its events. A resumed run is not
bit-identical to an uninterrupted run of either layout: batches, learning rate and rounding
differ from where it resumed on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from tgdist import memory
from tgdist.distributed import schedule
from tgdist.distributed.schedule import Layout
from tgdist.errors import ConfigError
from tgdist.runtime import checkpoint

log = logging.getLogger(__name__)


def layout_of(state: dict) -> Layout:
    """The layout a checkpoint was written by (``str(Layout)``, ``"2 x 1 x 1"``)."""
    return Layout(*(int(x) for x in state["layout"].split(" x ")))


def replaces_memory(state: dict, cfg: DictConfig, layout: Layout, backend: str) -> bool:
    """Whether this run's store (``backend``, resolved) cannot read its part of the checkpoint's
    memory as it was written: another layout, or a store that keeps it otherwise (shards against
    copies, another store's shards, shards of another placement). An older checkpoint names no
    store: its files are read as they are."""
    if state.get("layout", str(layout)) != str(layout):
        return True
    written = state.get("memory_backend")
    if written is None:
        return False
    a, b = memory.store_class(written), memory.store_class(backend)
    if not (a.partitioned or b.partitioned):
        return False
    return written != backend or state.get("placement") != checkpoint.settings(cfg, ("partition",), set())


class _Whole:
    """``load_state_dict`` of a whole memory into a store (``checkpoint.restore``'s one-line errors)."""

    def __init__(self, store):
        self.store = store

    def load_state_dict(self, state: dict) -> None:
        self.store.load_whole_state(state)


def load_memory(path: Path, state: dict, store, kk: int) -> None:
    """Memory group ``kk``'s whole memory from the checkpoint ``path`` (every file of the group),
    into ``store``'s part of it."""
    d = path.parent / state["dir"]
    names = [n for n in state["parts"] if n.startswith((f"memory-{kk}.", f"memory-{kk}-"))]
    written = memory.store_class(state["memory_backend"])
    try:
        whole = written.whole_state({n: checkpoint.read_part(d / n) for n in names})
    except (ValueError, KeyError, RuntimeError) as e:
        raise ConfigError(f"{path}: its node memory files ({', '.join(names)}) do not make one memory "
                          f"({' '.join(str(e).split())})") from None
    checkpoint.restore(d / names[0], _Whole(store), whole, "node memory")


@dataclass
class Plan:
    """A resume on another layout: the old layout, the iteration of this run it continues at,
    and this rank's part of the old ranks' files (``mine``, as ``Run.load`` reads a rank file)."""

    old: Layout
    start: int
    mine: dict


def plan(path: Path, state: dict, layout: Layout, rank: int, num_train_events: int, batch_size: int) -> Plan | None:
    """None where the checkpoint was written by ``layout``; else the resume on it, or one line
    why not (``check_layout`` has refused what cannot be re-placed): a place in the stream that
    is not a boundary of this layout's global batches, or reads made ahead for the old layout's
    batches (a pipeline that reads ahead: MSPipe)."""
    old = layout_of(state)
    if old == layout:
        return None
    t = int(state["iteration"])
    start = schedule.resume_iteration(old, t, layout, num_train_events, batch_size)
    if start is None:
        g, events = schedule.stream_position(old, t, num_train_events, batch_size)
        later = schedule.next_resumable_iteration(old, t, layout, num_train_events, batch_size)
        raise ConfigError(f"{path}: written at iteration {t} of layout {old}, after {events} events of pass {g}, "
                          f"which is not a boundary of this run's global batches of {layout.i} x {batch_size} "
                          f"events; resume it with a parallel.i that divides {events // batch_size}, or let "
                          f"layout {old} train on to its iteration {later} and resume from there")
    d = path.parent / state["dir"]
    files = {r: checkpoint.read_part(d / f"rank-{r}.pt") for r in range(old.world_size)
             if rank == 0 or r == rank % old.world_size}
    ahead = sum(len(f.get("slots") or {}) for f in files.values())
    if ahead:
        raise ConfigError(f"{path}: written by layout {old} with {ahead} reads made ahead for its batches (a "
                          f"pipeline that reads ahead), which this run's batches would not read; resume it with "
                          f"layout {old}")
    mine = dict(files[rank % old.world_size])
    mine["losses"] = [loss for r in sorted(files) for loss in files[r]["losses"]] if rank == 0 else []
    return Plan(old, start, mine)


def carry_lr(plan: Plan, optimizer, cfg: DictConfig, lr: float) -> None:
    """The optimizer's learning rate for this run's global batch (``lr``, scaled from
    ``train.lr``) instead of the old layout's, said in the log."""
    scaling = cfg.train.lr_scaling
    old_lr = schedule.scaled_lr(cfg.train.lr, plan.old.i, plan.old.j, plan.old.k, scaling)
    for group in optimizer.param_groups:
        group["lr"] = lr if group["lr"] == old_lr else group["lr"] * lr / old_lr
    b = cfg.train.batch_size
    log.info("resuming a checkpoint of layout %s: global batches of %d x %d events instead of %d x %d, so the "
             "learning rate is %g instead of %g (train.lr_scaling=%s)", plan.old, cfg.parallel.i, b, plan.old.i, b,
             lr, old_lr, getattr(scaling, "name", scaling))
