"""Node memory stores: one interface, several backends (DESIGN.md "Memory stores").

State per node: memory ``mem [N, mem_dim]``, its time ``mem_ts [N]``, and a mailbox of ``S`` slots
``mail [N, S, mail_dim]``, ``mail_ts [N, S]`` written as a ring (``head [N]`` is the next slot).
TGN and JODIE use ``S = 1`` (COMB = latest); APAN uses several slots. Empty slots have
``mail_ts = -inf``. Times are float64 seconds relative to the first event of the graph.

Invariant used by the updaters: a stored mail is never already applied. Write-back applies a
node's pending mail to its memory and stores the new mail in the same step, so "the mail is newer
than the memory" is simply "the node has a mail". (Comparing ``mail_ts > mem_ts``, as TGL does,
silently drops mails whenever consecutive events of a node share a timestamp.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tgdist.memory import StoreContext, register
from tgdist.memory.volumes import TrainerRows
from tgdist.uploads import upload


@dataclass
class MemoryRead:
    """Memory of ``num_ids`` nodes: ``mem [num_ids, mem_dim]``, ``mem_ts [num_ids]`` (float64),
    ``mail [num_ids, S, mail_dim]``, ``mail_ts [num_ids, S]`` (float64, -inf where empty).
    ``empty``, what the host knows without asking the device: True, no row has a mail (the store's
    mailbox was not written since its reset); False, rows may have one; None, not known (a store
    that does not say). The memory updaters skip their work on True and, on a GPU, run without
    reading device values where it is known (``models.modules._CellUpdater``)."""

    mem: torch.Tensor
    mem_ts: torch.Tensor
    mail: torch.Tensor
    mail_ts: torch.Tensor
    empty: bool | None = None


class MemoryStore(nn.Module):
    """Interface: read(ids) -> MemoryRead; write_memory; write_mail; reset_state; state in buffers.

    The parallel loop drives every store through the same calls, so it never asks which one it
    holds (DESIGN.md "Memory stores"): ``open_position`` before the reads of a stream position,
    ``close_position`` once this trainer is done with it, ``exchange`` at the end of every
    iteration (the group's collective, which every trainer of the group makes), ``end_training``
    when training stops and ``close`` last. Each does nothing here: a store of one process needs
    none of them but the reset.
    """

    # Capabilities: what the run and its validation may do with a store, read from its class
    # (``memory.store_class(name)``), never from its name.
    # Where it keeps a memory group's copy, which decides how a group may be placed
    # (``distributed.world.validate``): "process" (inside one trainer, so a group of one),
    # "host_shared" (host shared memory served per group: a group on one machine), "collective"
    # (spread over or replicated in the group's trainers and kept by collectives).
    placement = "collective"
    auto = False  # memory.backend=auto may pick it for its placement (``memory.resolve``)
    trainers_own = False  # the trainer builds it itself (local memory): the run makes no other
    partitioned = False  # it places nodes by the partitioner, so partition.* settings apply
    epoch_parallel = True  # it runs with epoch parallelism (parallel.j > 1)
    # its reads may run in a stage thread while the main thread makes the run's collectives (MSPipe
    # with more than one trainer): not where reads are collectives or served in stream order
    staged_reads = True
    evaluates_untrained = True  # it runs train.epochs=0, the untrained model evaluated in one process
    # Whether the memory group's copy is held once for all its trainers (a daemon's): only the
    # group's writer then loads it from a checkpoint, the others wait for it.
    one_copy_per_group = False
    # Whether ``state_dict`` returns copies (a daemon's, out of its shared memory) rather than the
    # live buffers: a checkpoint written in the background copies the live ones first, not these.
    state_dict_copies = False
    # Whether ``read`` and ``read_many`` take ``occurrences``: how often the batch uses each id (its
    # sampled occurrences, ``tgdist.runtime.trainer.occurrences``), which the trainer then passes. A
    # store that sends a row per occurrence (DepComm as the paper counts it, eq. (8)) asks for it.
    wants_occurrences = False
    # Whether a profile times this store's exchanges, two trainers of one memory group, to price
    # every store's collectives as training pays them (``launcher.advisor.measure.exchange_runs``):
    # one store whose dispatch and aggregation are both exchanges of rows says so.
    profiled_exchange = False
    # Whether its reads take any ids, repeats included, each read row for row in this process: the
    # device sampler's node table is not deduplicated (``runtime.build.device_sampler``); a store
    # that sends the ids over the network, or counts them, needs the distinct ones.
    reads_repeated_ids = False

    # Pricing: what the strategy advisor (``tgdist.launcher.advisor.model``) reads of a store to
    # predict an iteration with it, from its class as the capabilities above. ``collectives``: the
    # collectives of one iteration on the dispatch side and the aggregation side, each paying a
    # link's latency once (an exchange of rows is two: the row counts, then the rows).
    collectives = (0, 0)

    @classmethod
    def check_config(cls, memory) -> None:
        """Refuse, as a ``ConfigError`` of one line, a value of this store's own ``memory.*`` keys
        (those of its ``Config`` class) that it cannot run with; the run's validation
        (``runtime.build.validate``) calls it for the chosen store. Here there are none."""

    @classmethod
    def traffic(cls, rows: TrainerRows, group: int) -> tuple[float, float]:
        """Bytes on one trainer's link per iteration, its busier direction (as ``parallel.link``
        charges an exchange), as (dispatch, aggregation), in a memory group of ``group`` trainers
        (from ``memory/volumes.py``). Here none: the memory stays in the process."""
        return 0.0, 0.0

    @classmethod
    def paper_volume(cls, n1: float, eta1: float, n2: float, eta2: float, m: int, mem_bytes: float,
                     mail_bytes: float) -> float | None:
        """The bytes one iteration moves over a group of ``m`` trainers as Sven prints it (eq. (7)-(9),
        ``memory/volumes.py``), or None: the paper gives none for this store."""
        return None

    @classmethod
    def price_memory(cls, read_s: float, write_s: float, group_write_s: float, group: int) -> tuple[float, float, float]:
        """A trainer's memory read and write seconds per iteration with this store, from the one
        process's (``read_s``, ``write_s``; ``group_write_s``: the write of the whole group's batches),
        and the CPU seconds per iteration that a process serving the group spends besides its
        trainers. Here the one process's, and no such process."""
        return read_s, write_s, 0.0

    @classmethod
    def bytes_per_rank(cls, copy_bytes: float, group: int, imbalance: float) -> float:
        """The node memory (and mails) a trainer holds, given a whole copy's ``copy_bytes``, its
        group's size and a partition's ``imbalance`` (its busiest share over the mean): here a copy."""
        return copy_bytes

    def checkpoint_part(self, ii: int, jj: int, kk: int) -> tuple[str, bool]:
        """The checkpoint file (in the iteration's directory) that holds this trainer's memory, and
        whether this trainer writes it. Here: one file per memory group, ``memory-KK.pt``, written by
        the group's writer (ii = jj = 0); every trainer of the group loads it (a replica each), or
        its writer alone with ``one_copy_per_group``. A store that holds a shard per trainer names
        a file per trainer."""
        return f"memory-{kk}.pt", ii == 0 and jj == 0

    @classmethod
    def whole_state(cls, parts: dict[str, dict]) -> dict:
        """A memory group's whole memory from the checkpoint files its trainers wrote
        (``checkpoint_part``'s names -> their contents): ``LocalMemory``'s buffers, by global id,
        which any store takes (``load_whole_state``). Here: the group's one copy."""
        if len(parts) != 1:
            raise ValueError(f"{cls.__name__} writes one memory file per group, found {len(parts)}")
        return next(iter(parts.values()))

    def load_whole_state(self, state: dict) -> None:
        """Take a memory group's whole memory (``whole_state``'s) as this trainer's part of it:
        here all of it (a copy, or the one copy of the group)."""
        self.load_state_dict(state)

    def open_position(self, position: int, slot: int, reset: bool) -> None:
        """The reads of stream ``position`` follow (into read ``slot``); ``reset``: the position
        starts a pass, which starts from empty memory."""
        if reset:
            self.reset_state()

    def close_position(self) -> None:
        """This trainer is done with the open position: its reads, and its writes if it writes."""

    def start_exchange(self) -> None:
        """This iteration's writes are all made: a store may start sending them (asynchronously)
        so that ``exchange`` finds them arrived. Every trainer of the group calls it at the same
        point of the iteration, or none does; ``exchange`` alone does the whole exchange."""

    def exchange(self) -> None:
        """The end of an iteration: make this iteration's writes of the whole group visible."""

    def end_training(self, evaluates: bool) -> None:
        """Training is over; ``evaluates``: this trainer goes on to evaluate on the memory alone."""

    def close(self) -> None:
        """Release what the store holds outside this process (idempotent)."""

    def pending_writes(self) -> int:
        """Writes made and not yet applied to the memory that reads see (a store that holds them
        until ``exchange``); 0 here. Reads made meanwhile would miss them, so the loop checks that
        none is left where a reader follows: at every evaluation and at the end of a run."""
        return 0

    def read(self, ids: torch.Tensor) -> MemoryRead:
        raise NotImplementedError

    def read_many(self, ids: list[torch.Tensor]) -> list:
        """The reads of several id sets (a batch's micro-batches), all of the memory as it is now,
        before any write that follows: each a ``MemoryRead``, or a ``collectives.Handle`` on one
        where the store fetches rows over the network (its transfer then overlaps what the caller
        computes before it resolves it, ``collectives.resolve``). Here: ``read`` of each, in turn."""
        return [self.read(i) for i in ids]

    def update(self, read, updater):
        """The memory update of a read (what ``read`` returned): ``updater(read)`` here; a store
        whose owners update the rows they serve (DepComm) runs it its own way."""
        return updater(read)

    def write_memory(self, ids: torch.Tensor, mem: torch.Tensor, mem_ts: torch.Tensor) -> None:
        raise NotImplementedError

    def write_mail(self, ids: torch.Tensor, mail: torch.Tensor, mail_ts: torch.Tensor) -> None:
        raise NotImplementedError

    def deliver_mails(self, ids: torch.Tensor, order_key: torch.Tensor, keep: int, mail: torch.Tensor,
                      mail_ts: torch.Tensor, index: torch.Tensor) -> None:
        """Deliver mails to recipients with repeats (APAN: a root's mail to its neighbours too):
        delivery i appends row ``index[i]`` of ``mail`` / ``mail_ts`` to the ring of ``ids[i]``, in
        ``order_key`` order, and each ring keeps its newest ``keep``. Here: ``write_mail`` in rounds
        of unique recipients (``mail_rounds``), which every store supports. ``ids`` and
        ``order_key`` may be host arrays (NumPy): which deliveries each ring keeps is then found on
        the host, where a GPU would be asked for the sizes of its masks."""
        dev = mail.device
        for r in mail_rounds(ids, order_key, keep):
            if isinstance(ids, np.ndarray):
                r, rid = upload(r, dev), upload(ids[r], dev)
            else:
                rid = ids.index_select(0, r)
            rows = index.index_select(0, r)
            self.write_mail(rid, mail.index_select(0, rows), mail_ts.index_select(0, rows))

    def reset_state(self) -> None:
        raise NotImplementedError


class LocalMemory(MemoryStore):
    """All node memory as tensors of this process (one trainer)."""

    placement, auto, trainers_own = "process", True, True
    reads_repeated_ids = True

    def __init__(self, num_nodes: int, mem_dim: int, mail_dim: int, mailbox_size: int = 1):
        super().__init__()
        self.num_nodes, self.mem_dim, self.mail_dim, self.mailbox_size = num_nodes, mem_dim, mail_dim, mailbox_size
        self.register_buffer("mem", torch.zeros(num_nodes, mem_dim))
        self.register_buffer("mem_ts", torch.zeros(num_nodes, dtype=torch.float64))
        self.register_buffer("mail", torch.zeros(num_nodes, mailbox_size, mail_dim))
        self.register_buffer("mail_ts", torch.full((num_nodes, mailbox_size), float("-inf"), dtype=torch.float64))
        self.register_buffer("head", torch.zeros(num_nodes, dtype=torch.int64))
        self._mark_unwritten()

    # Whether the mailbox is as reset, known on the host: ``mail_ts`` is the tensor it was then and
    # its version counter has not moved (every in-place write moves it: write_mail, deliver_mails,
    # another module's index_put_, load_state_dict's copy). A replaced buffer is not known.
    def _mark_unwritten(self) -> None:
        self._unwritten = (self.mail_ts, self.mail_ts._version)

    def mark_written(self) -> None:
        """Say the mailboxes were written, by a writer this object does not see (another process
        writing the shared tensors: the memory daemon's loads), as ``load_state_dict`` would say."""
        self._unwritten = (None, -1)

    def mail_unwritten(self) -> bool:
        t, version = self._unwritten
        return self.mail_ts is t and t._version == version

    def _apply(self, fn, *args, **kwargs):
        unwritten = self.mail_unwritten()
        out = super()._apply(fn, *args, **kwargs)  # .to(device) and the like make new buffers
        if unwritten:
            self._mark_unwritten()
        return out

    def reset_state(self) -> None:
        self.mem.zero_()
        self.mem_ts.zero_()
        self.mail.zero_()
        self.mail_ts.fill_(float("-inf"))
        self.head.zero_()
        self._mark_unwritten()

    def read(self, ids: torch.Tensor) -> MemoryRead:
        return MemoryRead(self.mem.index_select(0, ids), self.mem_ts.index_select(0, ids),
                          self.mail.index_select(0, ids), self.mail_ts.index_select(0, ids),
                          empty=self.mail_unwritten())

    def write_memory(self, ids: torch.Tensor, mem: torch.Tensor, mem_ts: torch.Tensor) -> None:
        """``ids`` unique ``[n]``; ``mem [n, mem_dim]`` (detached); ``mem_ts [n]``."""
        self.mem.index_copy_(0, ids, mem.detach().to(self.mem.dtype))
        self.mem_ts.index_copy_(0, ids, mem_ts.to(torch.float64))

    def write_mail(self, ids: torch.Tensor, mail: torch.Tensor, mail_ts: torch.Tensor) -> None:
        """Append one mail per id to its ring. ``ids`` must be unique within one call; several mails
        to a node go through ``deliver_mails`` (rounds of this call, oldest first, or one write)."""
        slot = self.head.index_select(0, ids)
        self.mail[ids, slot] = mail.detach().to(self.mail.dtype)
        self.mail_ts[ids, slot] = mail_ts.to(torch.float64)
        self.head.index_copy_(0, ids, (slot + 1) % self.mailbox_size)

    def deliver_mails(self, ids, order_key, keep, mail, mail_ts, index) -> None:
        """``MemoryStore.deliver_mails`` in one write instead of one per round: the k-th oldest
        kept delivery of a recipient goes to slot ``(head + k) % S`` and the head moves by the
        number kept, which is what ``keep`` successive rounds of ring appends do (a test compares
        the two); 10 rounds of Python-level ops per batch become a few."""
        if len(ids) == 0:
            return
        if keep > self.mailbox_size:  # later rounds would overwrite earlier ones' slots
            return super().deliver_mails(ids, order_key, keep, mail, mail_ts, index)
        sel, k = _kept_deliveries(ids, order_key, keep)
        if isinstance(ids, np.ndarray):  # found on the host: uploaded, the device is asked nothing
            dev = self.head.device
            rid_host = ids[sel]
            last = np.flatnonzero(np.append(rid_host[1:] != rid_host[:-1], True))  # each recipient's newest
            rid, sel, k, last_rid, last = (upload(a, dev) for a in (rid_host, sel, k, rid_host[last], last))
        else:
            rid = ids.index_select(0, sel)
            newest = torch.ones_like(rid, dtype=torch.bool)  # each recipient's newest kept delivery
            newest[:-1] = rid[1:] != rid[:-1]
            last = torch.nonzero(newest).squeeze(1)
            last_rid = rid.index_select(0, last)
        slot = (self.head.index_select(0, rid) + k) % self.mailbox_size
        rows = index.index_select(0, sel)
        self.mail[rid, slot] = mail.index_select(0, rows).detach().to(self.mail.dtype)
        self.mail_ts[rid, slot] = mail_ts.index_select(0, rows).to(torch.float64)
        self.head.index_copy_(0, last_rid, (slot.index_select(0, last) + 1) % self.mailbox_size)


def mail_rounds(ids: torch.Tensor, order_key: torch.Tensor, keep: int) -> list[torch.Tensor]:
    """Split deliveries into rounds of unique recipients, keeping each recipient's last ``keep``.

    ``ids [n]`` recipients (with repeats); ``order_key [n]`` their delivery order (time, then
    position). Returns a list of index tensors into ``ids``: round r holds, for every recipient
    with at least ``keep - r`` (clipped) deliveries, its r-th oldest kept delivery. Appending the
    rounds in order leaves the newest ``keep`` mails in each ring, in time order.
    """
    if len(ids) == 0:
        return []
    sel, k = _kept_deliveries(ids, order_key, keep)
    rounds = []
    for r in range(keep):
        at = k == r
        if at.any():
            rounds.append(sel[at])
    return rounds


def _kept_deliveries(ids: torch.Tensor, order_key: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The deliveries each recipient keeps (its newest ``keep``), sorted by (recipient, order):
    ``sel [m]`` indices into ``ids`` and ``k [m]`` the rank of each among its recipient's kept
    ones (0 = oldest). Host arrays (NumPy) are answered on the host, in NumPy, the same."""
    if isinstance(ids, np.ndarray):
        return _kept_deliveries_host(ids, np.asarray(order_key), keep)
    # Sort by (recipient, order) with two stable sorts.
    perm = torch.argsort(order_key, stable=True)
    perm = perm[torch.argsort(ids[perm], stable=True)]
    sid = ids[perm]
    n, dev = sid.numel(), ids.device  # every tensor on the ids' device (a GPU's, not the CPU)
    start = torch.ones(n, dtype=torch.bool, device=dev)
    start[1:] = sid[1:] != sid[:-1]
    position = torch.arange(n, device=dev)
    group_start = torch.cummax(torch.where(start, position, torch.zeros_like(position)), 0).values
    rank = position - group_start  # 0 = oldest
    ends = torch.nonzero(torch.cat([start[1:], start.new_ones(1)])).squeeze(1)
    count = torch.zeros(n, dtype=torch.long, device=dev)
    sizes = ends - torch.nonzero(start).squeeze(1) + 1
    count[start] = sizes
    count = count[group_start]
    from_end = count - 1 - rank  # 0 = newest
    kept = from_end < keep
    first_kept = torch.clamp(count - keep, min=0)
    return perm[kept], (rank - first_kept)[kept]


def _kept_deliveries_host(ids: np.ndarray, order_key: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray]:
    """``_kept_deliveries`` of host arrays."""
    perm = np.argsort(order_key, kind="stable")
    perm = perm[np.argsort(ids[perm], kind="stable")]
    sid = ids[perm]
    n = len(sid)
    start = np.ones(n, dtype=bool)
    start[1:] = sid[1:] != sid[:-1]
    position = np.arange(n)
    rank = position - np.maximum.accumulate(np.where(start, position, 0))  # 0 = oldest
    sizes = np.diff(np.append(np.flatnonzero(start), n))
    count = np.repeat(sizes, sizes)  # each delivery's recipient's number of deliveries
    kept = count - 1 - rank < keep
    first_kept = np.maximum(count - keep, 0)
    return perm[kept], (rank - first_kept)[kept]


@register("local", LocalMemory)
def _local(ctx: StoreContext) -> LocalMemory:
    return LocalMemory(ctx.num_nodes, ctx.mem_dim, ctx.mail_dim, ctx.mailbox_size).to(ctx.device)
