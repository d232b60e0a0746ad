"""Sven's DepComm (2.3, Fig. 4b; DESIGN.md "Memory stores"): memory partitioned as sven's, but
the owners update it.

A read sends the batch's distinct nodes to their owners (dispatch: slots only). At the update,
each owner runs the model's memory updater on the rows every trainer asked it for (local
dispatch; a node two trainers need is updated twice, once per requester) and sends the updated
memory back (remote dispatch) through an all-to-all whose backward is the reverse all-to-all, so
the gradients of that memory return to the owners and the updater trains as under DepCache (the
group's gradient all-reduce sums the owners' parts). Writes are aggregated as sven's are.

What the remote dispatch sends (``memory.remote_dispatch``):

- ``occurrences`` (the default): one row per sampled occurrence of a node, without
  deduplication, as DESIGN.md and the paper's DepComm have it (eq. (8) counts N1 rows). The
  requester sends each distinct node's occurrence count with its slot; the owner repeats the
  updated row that many times. The requester's model works on distinct nodes, so it keeps the
  first copy of each (the copies are equal) and the others carry zero gradients back, which the
  owner's sum adds exactly: training is bit-identical to ``distinct``, only the bytes differ.
- ``distinct``: one row per distinct node a trainer needs, N1 (1 - eta1) rows: DepComm with
  Sven's redundancy-free reads, the smaller exchange.

Not bit-identical to DepCache: an owner's updater sees a batch of rows from several trainers, and
the gradient of one parameter is summed in another order, so results agree to float rounding
(amplified by Adam where a gradient entry is near zero); the tests state the tolerance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tgdist.config import MemoryConfig, choice_type
from tgdist.distributed import collectives
from tgdist.errors import ConfigError
from tgdist.memory import StoreContext, register, volumes
from tgdist.memory.store import MemoryRead
from tgdist.memory.volumes import TrainerRows
from tgdist.memory.sven import PartitionedMemory, build


@dataclass
class DepCommRead:
    """What a DepComm read leaves for the update: ``requests[s]`` the slots group rank s asked
    this trainer (their owner) for, ``order`` / ``counts`` how this trainer's distinct nodes are
    grouped by owner, ``psi`` the repeats of the read's ids to restore (None: none); with
    ``memory.remote_dispatch=occurrences`` the occurrence counts that size the remote dispatch."""

    requests: list
    order: torch.Tensor
    counts: list
    psi: torch.Tensor | None
    repeats: list | None = None  # [s]: the occurrences of each slot group rank s asked for (None: distinct)
    mine: torch.Tensor | None = None  # this trainer's occurrences of its distinct nodes, in ``order``


class _RemoteDispatch(torch.autograd.Function):
    """All-to-all of updated memory rows, owner -> requester; backward: the reverse all-to-all of
    their gradients, requester -> owner (phase ``backward``)."""

    @staticmethod
    def forward(ctx, mem, mem_ts, updated, anchor, sizes, expect, store):
        got = collectives.all_to_all_rows({"mem": list(mem.split(sizes)), "mem_ts": list(mem_ts.split(sizes)),
                                           "updated": list(updated.split(sizes))}, store.group,
                                          name="remote_dispatch", counter=store.counter)
        ctx.store, ctx.back = store, [t.shape[0] for t in got["mem"]]
        if ctx.back != expect:  # rows lost or added on the way would shift every later node's row
            raise RuntimeError(f"memory.backend=depcomm: the remote dispatch brought {ctx.back} rows from group ranks "
                               f"0..{len(expect) - 1}, but this trainer asked them for {expect} (one row per "
                               f"{'occurrence' if store.wants_occurrences else 'distinct node'}): an owner sent "
                               f"other rows than it was asked for")
        ts, upd = torch.cat(got["mem_ts"]), torch.cat(got["updated"])
        ctx.mark_non_differentiable(ts, upd)
        return torch.cat(got["mem"]), ts, upd

    @staticmethod
    def backward(ctx, grad, _ts, _updated):
        store = ctx.store
        got = collectives.all_to_all_rows({"grad": list(grad.contiguous().split(ctx.back))}, store.group,
                                          name="backward", counter=store.counter)
        return torch.cat(got["grad"]), None, None, None, None, None, None


# memory.remote_dispatch: a row per sampled occurrence (eq. (8)) | per distinct node
REMOTE_DISPATCH = ("occurrences", "distinct")
RemoteDispatch = choice_type("RemoteDispatch", " ".join(REMOTE_DISPATCH), __name__)


@dataclass
class DepCommConfig(MemoryConfig):
    """``memory.*`` of ``memory.backend=depcomm``: the section's keys and the remote dispatch's rows."""

    # what its owners send each requester: occurrences (one row per sampled occurrence of a node, the
    # paper's DepComm and eq. (8)) | distinct (one per distinct node a trainer needs; same training)
    remote_dispatch: RemoteDispatch = RemoteDispatch.occurrences


class DepCommMemory(PartitionedMemory):
    """``memory.backend=depcomm``: the partitioned store whose owners update the rows they serve."""

    name = "depcomm"
    Config = DepCommConfig
    # owners update at compute time, which the idle trainers of epoch parallelism's fill and drain skip
    epoch_parallel = False
    collectives = (6, 2)  # sven's, and the gradients of the dispatched memory back to their owners

    @classmethod
    def traffic(cls, rows: TrainerRows, group: int) -> tuple[float, float]:
        """Eq. (8) per trainer: the memory of every sampled occurrence others own and its gradient
        back (the paper's first term, with the gradients' return), then the aggregation as eq. (9)'s."""
        r = rows.remote
        d = volumes.depcomm_volume(group * rows.rows_sampled, 0.0, 0.0, group, rows.mem_bytes + rows.grad_mem_bytes,
                                   0.0, remote=(r, r))[0]
        a = volumes.depcomm_volume(0.0, group * rows.roots_distinct, 0.0, group, rows.mem_bytes, rows.mail_bytes,
                                   remote=(r, r))[1]
        return volumes.per_trainer(d, group), volumes.per_trainer(a, group)

    @classmethod
    def paper_volume(cls, n1, eta1, n2, eta2, m, mem_bytes, mail_bytes):
        return sum(volumes.depcomm_volume(n1, n2, eta2, m, mem_bytes, mail_bytes))

    @staticmethod
    def layout_refusal(train_end: int, i: int, batch_size: int) -> str | None:
        """Why ``i`` trainers at local batch ``batch_size`` over ``train_end`` training events cannot
        run this store (None: they can): a trainer with no event of the last global batch could not
        update the memory it owns for the others. Read by the builder below and by the advisor."""
        rest = train_end % (i * batch_size)
        if 0 < rest < i:  # an idle trainer would not serve the rows it owns
            return (f"memory.backend=depcomm: the last global batch has {rest} event{'s' * (rest != 1)} for "
                    f"parallel.i={i} trainers, so a trainer would have none and could not update the memory "
                    f"it owns for the others; change train.batch_size")
        return None

    def __init__(self, *args, remote_dispatch: str = "occurrences", **kwargs):
        super().__init__(*args, **kwargs)
        if remote_dispatch not in REMOTE_DISPATCH:
            raise ConfigError(f"memory.remote_dispatch={remote_dispatch}: choose one of {', '.join(REMOTE_DISPATCH)}")
        self.remote_dispatch = remote_dispatch
        self.wants_occurrences = remote_dispatch == "occurrences"
        self.link_rows["remote_dispatch"] = self.link_rows.pop("dispatch")

    def read(self, ids: torch.Tensor, occurrences: torch.Tensor | None = None):
        """The dispatch of the slots (and, per occurrence, their counts; ``None``: once each)."""
        if self.alone:
            return self.shard.read(ids)
        if self.wants_occurrences:  # every id read is sent at least once
            occurrences = (torch.ones(ids.shape[0], dtype=torch.int64, device=ids.device) if occurrences is None
                           else occurrences.clamp(min=1))
        psi, order, counts, got = self._request(ids, occurrences if self.wants_occurrences else None)
        return DepCommRead(got["slot"], order, counts, psi, got.get("repeats"), got.get("mine"))

    def read_many(self, ids: list[torch.Tensor], occurrences: list | None = None) -> list:
        """Micro-batches: each read in turn (a read sends slots only; the rows travel in ``update``)."""
        per_read = occurrences if occurrences is not None else [None] * len(ids)
        return [self.read(x, o) for x, o in zip(ids, per_read)]

    def update(self, read, updater):
        """Local dispatch and update at the owners, remote dispatch of the updated memory."""
        if not isinstance(read, DepCommRead):  # alone (evaluation), or a read of another store
            return updater(read)
        sizes = [r.numel() for r in read.requests]
        served: MemoryRead = self.shard.read(torch.cat(read.requests))
        upd = updater(served)
        mem, mem_ts, updated = upd.mem, upd.mem_ts, upd.updated
        if read.repeats is not None:  # a row per occurrence (index_select: its backward sums the copies)
            rep = torch.cat(read.repeats).to(device=mem.device, dtype=torch.int64)
            copies = torch.repeat_interleave(torch.arange(rep.shape[0], device=mem.device), rep)
            mem, mem_ts, updated = (x.index_select(0, copies) for x in (mem, mem_ts, updated))
            sizes = [int(r.sum()) for r in read.repeats]
        self._count_links("remote_dispatch", sizes)
        # what each owner must send here: a row per distinct node asked of it, or per occurrence
        expect = list(read.counts) if read.mine is None else \
            [int(x) for x in torch.stack([m.sum() for m in read.mine.to(torch.int64).split(read.counts)]).tolist()]
        # anchor: the dispatch is recorded (and its backward collective made) on every trainer
        # while training, even one whose served rows need no gradient
        anchor = torch.zeros((), requires_grad=torch.is_grad_enabled())
        mem, mem_ts, updated = _RemoteDispatch.apply(mem, mem_ts, updated, anchor, sizes, expect, self)
        if read.mine is not None:  # the first copy of each node: the copies are equal
            mine = read.mine.to(device=mem.device, dtype=torch.int64)
            first = torch.cumsum(mine, 0) - mine
            mem, mem_ts, updated = (x.index_select(0, first) for x in (mem, mem_ts, updated))
        inverse = torch.empty_like(read.order)
        inverse[read.order] = torch.arange(read.order.numel(), device=read.order.device)
        if read.psi is not None:
            inverse = inverse.index_select(0, read.psi)
        return dataclasses.replace(upd, mem=mem.index_select(0, inverse), mem_ts=mem_ts.index_select(0, inverse),
                                   updated=updated.index_select(0, inverse))


@register("depcomm", DepCommMemory)
def _depcomm(ctx: StoreContext) -> DepCommMemory:
    if ctx.layout is not None and ctx.train_end:
        if (why := DepCommMemory.layout_refusal(ctx.train_end, ctx.layout.i, ctx.batch_size)) is not None:
            raise ConfigError(why)
    return build(DepCommMemory, ctx, remote_dispatch=str(ctx.cfg.memory.remote_dispatch))
