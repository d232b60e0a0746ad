"""Sven's partitioned node memory (Sven 3.1, Algorithm 2; DESIGN.md "Memory stores").

Each trainer of a memory group holds the memory and mails of the nodes it owns (its shard, placed
by ``placement``) and nothing else. A read is the redundancy-free dispatch: the batch's unique
nodes (V_u, with Psi restoring repeats), their local slots sent to their owners, the owners' raw
memory and mail rows sent back in one deduplicated all-to-all; the requester runs the memory
updater itself, on the same rows DepCache would read, so training is bit-identical to DepCache.
Writes are buffered and aggregated at the iteration's end: one all-to-all takes each written
node's latest row (Phi; the trainer writes only those) to its owner, which applies the group's
writes in DepCache's order (group rank, then call), so shards hold what DepCache's replicas hold.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tgdist.distributed import collectives
from tgdist.errors import ConfigError
from tgdist.kernels import graph as kernels
from tgdist.memory import StoreContext, register, volumes
from tgdist.memory.placement import Placement, check_settings, placement
from tgdist.memory.store import LocalMemory, MemoryRead, MemoryStore
from tgdist.memory.volumes import TrainerRows
from tgdist.partition.idmap import DualHashMap

log = logging.getLogger(__name__)

# order key of a mail at its owner: source group rank * ROUNDS + the call (round) that wrote it
ROUNDS = 1 << 32


def redundancy_free(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sven Algorithm 2 on a read: ``(unique, psi)``, ``unique`` the distinct ids in first-appearance
    order and ``psi`` the index restoring ``ids == unique[psi]``; ``psi`` is None when the ids are
    distinct already (the trainer's reads are: it organizes its batch the same way)."""
    uniq, psi, _ = kernels.organize(ids.detach().cpu().numpy().astype(np.int64, copy=False))
    if uniq.shape[0] == ids.shape[0]:
        return ids, None
    return torch.from_numpy(uniq).to(ids.device), torch.from_numpy(psi).to(ids.device)


def latest(ids: torch.Tensor) -> torch.Tensor:
    """Phi of Algorithm 2: positions of each id's last occurrence, in increasing order."""
    _, _, phi = kernels.organize(ids.detach().cpu().numpy().astype(np.int64, copy=False))
    return torch.from_numpy(np.sort(phi)).to(ids.device)


def by_owner(owner: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, list[int]]:
    """``(order, counts)``: a stable permutation grouping rows by owner (order within an owner
    kept), and the rows per owner."""
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=num_parts).tolist()
    return order, counts


def append_in_order(store: LocalMemory, ids: torch.Tensor, key: torch.Tensor, mail: torch.Tensor,
                    mail_ts: torch.Tensor) -> None:
    """Append mail ``i`` to the ring of ``ids[i]`` in increasing ``key`` order, several per id
    allowed: exactly what one ``write_mail`` per mail in that order does (the k-th append of a
    node goes to slot ``(head + k) % S``, later ones overwriting earlier), in one write."""
    if ids.numel() == 0:
        return
    s = store.mailbox_size
    perm = torch.argsort(key, stable=True)
    perm = perm[torch.argsort(ids[perm], stable=True)]  # by id, then key
    sid = ids[perm]
    n, dev = sid.numel(), sid.device
    start = torch.ones(n, dtype=torch.bool, device=dev)
    start[1:] = sid[1:] != sid[:-1]
    position = torch.arange(n, device=dev)
    first = torch.cummax(torch.where(start, position, torch.zeros_like(position)), 0).values
    k = position - first  # this append's number among its node's
    last = torch.ones(n, dtype=torch.bool, device=dev)
    last[:-1] = start[1:]
    count = torch.zeros(n, dtype=torch.long, device=dev)
    count[start] = k[last] + 1  # appends per node, at its first row, then on every row
    count = count[first]
    kept = k >= count - s  # older ones would be overwritten within this write
    head = store.head.index_select(0, sid)
    slot = (head + k) % s
    rows = perm[kept]
    store.mail[sid[kept], slot[kept]] = mail.index_select(0, rows).detach().to(store.mail.dtype)
    store.mail_ts[sid[kept], slot[kept]] = mail_ts.index_select(0, rows).to(torch.float64)
    store.head.index_copy_(0, sid[last], (head[last] + count[last]) % s)


_STATE = ("mem", "mem_ts", "mail", "mail_ts", "head")  # LocalMemory's buffers: a shard's and a whole memory's


class PartitionedMemory(MemoryStore):
    """This trainer's shard of its memory group's node memory, and the group exchanges that keep
    the shards what DepCache's replicas would be (sven's; DepComm changes the read).

    ``maps`` (the placement) gives every node's owner group rank and local slot; the shard holds
    rows ``0 .. sizes[me]`` in slot order. ``link_rows[phase][d]``: rows this trainer sent to group
    rank d in that phase (``dispatch``: the rows it served; ``aggregation``: the writes it sent),
    to hold against the partitioner's C matrix. After ``end_training`` the evaluating trainer holds
    the whole memory (ids are slots) and the others nothing.
    """

    name = "sven"
    partitioned = True
    staged_reads = False  # its reads are collectives of the group, made in one order on every rank
    # eq. (9)'s two exchanges: the request of ids and the rows back (dispatch), the latest writes
    # to their owners (aggregation); each exchange of rows is two collectives (counts, then rows)
    collectives = (4, 2)

    @classmethod
    def traffic(cls, rows: TrainerRows, group: int) -> tuple[float, float]:
        """Eq. (9) per trainer: the distinct rows it needs that others own, raw memory and mails,
        then its distinct roots' latest rows to their owners."""
        r = rows.remote
        d, a = volumes.sven_volume(group * rows.rows_distinct, 0.0, group * rows.roots_distinct, 0.0, group,
                                   rows.mem_bytes, rows.mail_bytes, remote=(r, r))
        return volumes.per_trainer(d, group), volumes.per_trainer(a, group)

    @classmethod
    def paper_volume(cls, n1, eta1, n2, eta2, m, mem_bytes, mail_bytes):
        return sum(volumes.sven_volume(n1, eta1, n2, eta2, m, mem_bytes, mail_bytes))

    @classmethod
    def bytes_per_rank(cls, copy_bytes, group, imbalance):
        return copy_bytes / group * imbalance  # its shard: 1/M of a copy, the busiest share

    def __init__(self, place: Placement, mem_dim: int, mail_dim: int, mailbox_size: int = 1, group=None,
                 counter: collectives.ByteCounter | None = None):
        super().__init__()
        self.maps, self.source = place.maps, place.source
        self.group = group
        self.counter = collectives.ByteCounter() if counter is None else counter
        self.me, size = collectives.group_rank(group), collectives.group_size(group)
        if size != self.maps.num_parts:
            raise ConfigError(f"memory.backend={self.name}: the placement has {self.maps.num_parts} parts, the memory "
                              f"group {size} trainers")
        self.num_nodes, self.mem_dim, self.mail_dim, self.mailbox_size = \
            self.maps.num_nodes, mem_dim, mail_dim, mailbox_size
        self.shard = LocalMemory(int(self.maps.sizes()[self.me]), mem_dim, mail_dim, mailbox_size)
        self.alone = False  # after end_training: no group, ids are slots
        self._mem_writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._mail_writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # one round per call
        self._aggregation: collectives.Handle | None = None  # an aggregation issued, not yet applied
        self.link_rows = {phase: np.zeros(size, dtype=np.int64) for phase in ("dispatch", "aggregation")}

    # -- what it holds ----------------------------------------------------------------------

    def rows_held(self) -> int:
        """Nodes whose memory and mails this trainer holds."""
        return self.shard.num_nodes

    def bytes_held(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.shard.buffers())

    def describe(self) -> str:
        sizes = self.maps.sizes().tolist()
        return (f"memory.backend={self.name}: placement {self.source}; {self.num_nodes:,} nodes' memory and mails over "
                f"{len(sizes)} trainers, rows held per group rank {sizes} (this rank {self.rows_held():,}, "
                f"{100 * self.rows_held() / max(self.num_nodes, 1):.1f}%, {self.bytes_held() / 2**20:.2f} MiB)")

    def full_state(self) -> dict[str, torch.Tensor]:
        """The group's whole memory (``mem``, ``mem_ts``, ``mail``, ``mail_ts``, ``head``, by global
        id) on every trainer of the group: an all-gather of the shards (tests, reports)."""
        if self.alone:
            return {k: getattr(self.shard, k).clone() for k in ("mem", "mem_ts", "mail", "mail_ts", "head")}
        ids = torch.from_numpy(self.maps.globals_of(self.me).copy()).to(self.shard.mem.device)
        parts = {"ids": ids, **{k: getattr(self.shard, k) for k in ("mem", "mem_ts", "mail", "mail_ts", "head")}}
        got = collectives.all_gather_parts(parts, self.group, name="full_state", counter=collectives.ByteCounter())
        out = {}
        for k in ("mem", "mem_ts", "mail", "mail_ts", "head"):
            out[k] = torch.empty((self.num_nodes, *got[k][0].shape[1:]), dtype=got[k][0].dtype,
                                 device=self.shard.mem.device)
            out[k][torch.cat(got["ids"])] = torch.cat(got[k])
        return out

    # -- checkpoints: a shard per trainer ----------------------------------------------------------

    def checkpoint_part(self, ii: int, jj: int, kk: int) -> tuple[str, bool]:
        """Every trainer of the group writes and loads its own shard, ``memory-KK-sR.pt`` (R its
        rank in the memory group)."""
        return f"memory-{kk}-s{self.me}.pt", True

    def state_dict(self, *args, **kwargs):
        """The shard's memory and mails, and the global ids of the nodes it holds (``owned``), by
        which a resume checks that its placement is the one the shard was written under."""
        state = super().state_dict(*args, **kwargs)
        state["owned"] = torch.from_numpy(self.maps.globals_of(self.me).astype(np.int64))
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        owned = state_dict.get("owned")
        if owned is None or not np.array_equal(owned.numpy(), self.maps.globals_of(self.me)):
            raise ConfigError(f"memory.backend={self.name}: the checkpoint's shard of group rank {self.me} holds other "
                              f"nodes than this run's placement gives it (another partition.* setting or data); resume "
                              f"with the placement it was written under")
        return super().load_state_dict({k: v for k, v in state_dict.items() if k != "owned"}, strict, assign)

    @classmethod
    def whole_state(cls, parts: dict[str, dict]) -> dict:
        """The group's whole memory from its shards' files (``state_dict``'s): each shard's rows
        put back at the global ids it holds (``owned``); refused where the shards do not hold
        every node once."""
        shards = list(parts.values())
        owned = torch.cat([s["owned"] for s in shards])
        n = owned.numel()
        if not torch.equal(torch.sort(owned).values, torch.arange(n)):
            raise ValueError(f"the {len(shards)} memory shards hold {n} rows, not nodes 0 .. {n - 1} once each")
        out = {}
        for k in _STATE:
            rows = torch.cat([s[f"shard.{k}"] for s in shards])
            out[k] = torch.empty_like(rows)
            out[k][owned] = rows
        return out

    def load_whole_state(self, state: dict) -> None:
        """This trainer's shard of a whole memory: the rows of the nodes its placement gives it."""
        if state["mem"].shape[0] != self.num_nodes:
            raise ValueError(f"a memory of {state['mem'].shape[0]} nodes, and this run's has {self.num_nodes}")
        owned = torch.from_numpy(self.maps.globals_of(self.me).astype(np.int64))
        self.shard.load_state_dict({k: state[k].index_select(0, owned) for k in _STATE})

    # -- lifecycle ------------------------------------------------------------------------------

    def reset_state(self) -> None:
        self.shard.reset_state()
        self._mem_writes, self._mail_writes = [], []

    def pending_writes(self) -> int:
        return len(self._mem_writes) + len(self._mail_writes) + (self._aggregation is not None)

    def end_training(self, evaluates: bool) -> None:
        """The trainer that evaluates (at most one per group) gathers the whole memory and goes on
        alone, as on DepCache's replica; the others drop their shards."""
        if self.alone:
            return
        if self.pending_writes():
            raise RuntimeError("end_training with writes not exchanged")
        flags = collectives.all_gather_object(bool(evaluates), self.group, name="end_training",
                                              counter=collectives.ByteCounter())
        target = flags.index(True) if True in flags else None
        keys = ("mem", "mem_ts", "mail", "mail_ts", "head")
        dev = self.shard.mem.device
        full = LocalMemory(self.num_nodes if target == self.me else 0, self.mem_dim, self.mail_dim,
                           self.mailbox_size).to(dev)
        if target is not None:
            ids = torch.from_numpy(self.maps.globals_of(self.me).copy()).to(dev)
            mine = {"ids": ids, **{k: getattr(self.shard, k) for k in keys}}
            parts = {p: [t if d == target else t[:0] for d in range(self.maps.num_parts)] for p, t in mine.items()}
            got = collectives.all_to_all_rows(parts, self.group, name="end_training", counter=self.counter,
                                              index=("ids",))
            if target == self.me:
                ids = torch.cat(got["ids"])
                for k in keys:
                    getattr(full, k)[ids] = torch.cat(got[k])
        self.shard = full
        self.maps = DualHashMap.from_assignment(np.zeros(full.num_nodes, dtype=np.int64), 1)  # slot = global id
        self.alone = True

    # -- reads ----------------------------------------------------------------------------------

    def _request(self, ids: torch.Tensor, occurrences: torch.Tensor | None = None):
        """Dispatch, first half: the distinct ids grouped by owner, and their slots at the owners.
        Returns ``(psi, order, counts, got)``: ``got["slot"][s]`` the slots group rank s asks this
        trainer for (``[me]``: its own). ``occurrences`` (int, aligned with ``ids``): how often the
        batch uses each id; summed per distinct node, it travels with the slots as
        ``got["repeats"][s]`` (int32, index bytes), and ``got["mine"]`` is this trainer's own, in
        ``order``."""
        uniq, psi = redundancy_free(ids)
        owner, slot = self.maps.lookup(uniq)
        order, counts = by_owner(owner, self.maps.num_parts)
        parts = {"slot": list(slot.index_select(0, order).split(counts))}
        if occurrences is not None:
            if psi is not None:
                occurrences = torch.zeros(uniq.shape[0], dtype=occurrences.dtype,
                                          device=occurrences.device).index_add_(0, psi, occurrences)
            mine = occurrences.index_select(0, order).to(torch.int32)
            parts["repeats"] = list(mine.split(counts))
        got = collectives.all_to_all_rows(parts, self.group, name="dispatch", counter=self.counter, index=tuple(parts))
        if occurrences is not None:
            got["mine"] = mine
        return psi, order, counts, got

    def read(self, ids: torch.Tensor) -> MemoryRead:
        """Algorithm 2's dispatch: each distinct node once, raw rows from its owner."""
        if self.alone:
            return self.shard.read(ids)
        return self._dispatch(ids).wait()

    def read_many(self, ids: list[torch.Tensor]) -> list:
        """The dispatches of several reads issued one after the other, each waited for only when its
        reader resolves it (micro-batches: the next one's rows travel while one is updated). Every
        owner serves its rows at issue time, and the group's writes wait for ``exchange``, so each
        read is what ``read`` would have returned before them.

        Redundancy-free over the whole batch, not per read: a read fetches only the nodes no
        earlier read of the call fetched, and takes the others' rows from the earlier dispatches
        (the same rows, since nothing is written before ``exchange``). So each node's row comes
        from its owner once per batch, however many micro-batches sample it: Algorithm 2's V_u of
        the batch (deduplicating per micro-batch sent +30% rows at n = 2, +70% at n = 4)."""
        if self.alone:
            return [self.shard.read(i) for i in ids]
        fetched: list[tuple[torch.Tensor, collectives.Handle]] = []  # per read: the nodes it fetched, their rows
        seen = torch.zeros(0, dtype=torch.long, device=ids[0].device if ids else None)
        reads = []
        for i in ids:
            uniq = torch.unique(i)
            new = uniq[~torch.isin(uniq, seen)] if seen.numel() else uniq
            fetched.append((new, self._dispatch(new)))
            seen = torch.cat([seen, new])
            reads.append(self._from_fetched(i, list(fetched)))
        return reads

    @staticmethod
    def _from_fetched(ids: torch.Tensor, fetched: list) -> collectives.Handle:
        """A handle on the read of ``ids`` assembled from the rows of ``fetched`` (``(nodes,
        handle)`` pairs whose nodes hold every id): waiting for it waits for the last dispatch
        (the earlier ones were issued before it, on the same link)."""
        if len(fetched) == 1 and torch.equal(fetched[0][0], ids):
            return fetched[0][1]

        def assemble(_) -> MemoryRead:
            nodes = torch.cat([n for n, _ in fetched])
            got = [h.wait() for _, h in fetched]
            order = torch.argsort(nodes)
            pos = order.index_select(0, torch.searchsorted(nodes.index_select(0, order), ids))
            said = {g.empty for g in got}  # (the same state, nothing written between the dispatches)
            return MemoryRead(**{k: torch.cat([getattr(g, k) for g in got]).index_select(0, pos)
                                 for k in ("mem", "mem_ts", "mail", "mail_ts")},
                              empty=said.pop() if len(said) == 1 else None)

        return fetched[-1][1].then(assemble)

    def _dispatch(self, ids: torch.Tensor) -> collectives.Handle:
        psi, order, counts, got = self._request(ids)
        requests = got["slot"]
        served = [self.shard.read(r) for r in requests]
        self._count_links("dispatch", [r.numel() for r in requests])
        rows = {k: [getattr(r, k) for r in served] for k in ("mem", "mem_ts", "mail", "mail_ts")}

        # each owner says, with its row counts, whether its mailboxes are unwritten since the reset:
        # all of them are exactly when the group's are, which LocalMemory says of a read
        # (``MemoryRead.empty``), so that an updater on a GPU skips its reads here as there
        handle = collectives.all_to_all_parts_async(rows, self.group, name="dispatch", counter=self.counter,
                                                    word=int(self.shard.mail_unwritten()))
        empty = all(handle.words)

        def arrived(got: dict) -> MemoryRead:
            rows = {k: _unsort(torch.cat(v), order) for k, v in got.items()}
            if psi is not None:  # Psi restores the repeats
                rows = {k: v.index_select(0, psi) for k, v in rows.items()}
            return MemoryRead(**rows, empty=empty)

        return handle.then(arrived)

    def _count_links(self, phase: str, rows_to: list[int]) -> None:
        for d, n in enumerate(rows_to):
            if d != self.me:
                self.link_rows[phase][d] += n

    # -- writes ---------------------------------------------------------------------------------

    def write_memory(self, ids, mem, mem_ts) -> None:
        if self.alone:
            return self.shard.write_memory(ids, mem, mem_ts)
        self._mem_writes.append((ids, mem.detach(), mem_ts))

    def write_mail(self, ids, mail, mail_ts) -> None:
        if self.alone:
            return self.shard.write_mail(ids, mail, mail_ts)
        self._mail_writes.append((ids, mail.detach(), mail_ts))

    deliver_mails = MemoryStore.deliver_mails  # in rounds of write_mail, as DepCache delivers them

    def start_exchange(self) -> None:
        """Aggregation, issued: this iteration's writes leave for their owners while the trainer
        computes on (its backward pass); ``exchange`` applies what arrived."""
        if self.alone or self._aggregation is not None:
            return
        m, dev = self.maps.num_parts, self.shard.mem.device
        mem_ids, mem, mem_ts = _cat(self._mem_writes, (torch.long, torch.float32, torch.float64),
                                    (0, self.mem_dim, 0), dev)
        rounds = torch.cat([torch.full((w[0].shape[0],), r, dtype=torch.long, device=dev)
                            for r, w in enumerate(self._mail_writes)]) if self._mail_writes else \
            torch.zeros(0, dtype=torch.long, device=dev)
        mail_ids, mail, mail_ts = _cat(self._mail_writes, (torch.long, torch.float32, torch.float64),
                                       (0, self.mail_dim, 0), dev)
        self._mem_writes, self._mail_writes = [], []
        if mem_ids.numel():  # Phi: a node written twice here sends its latest row only
            keep = latest(mem_ids)
            mem_ids, mem, mem_ts = mem_ids[keep], mem[keep], mem_ts[keep]
        mem_owner, mem_slot = self.maps.lookup(mem_ids)
        mail_owner, mail_slot = self.maps.lookup(mail_ids)
        mo, mc = by_owner(mem_owner, m)
        lo, lc = by_owner(mail_owner, m)
        parts = {"mem_slot": mem_slot[mo].split(mc), "mem": mem[mo].split(mc), "mem_ts": mem_ts[mo].split(mc),
                 "mail_slot": mail_slot[lo].split(lc), "mail_round": rounds[lo].split(lc), "mail": mail[lo].split(lc),
                 "mail_ts": mail_ts[lo].split(lc)}
        self._count_links("aggregation", [a + b for a, b in zip(mc, lc)])
        self._aggregation = collectives.all_to_all_parts_async(
            {k: list(v) for k, v in parts.items()}, self.group, name="aggregation", counter=self.counter,
            index=("mem_slot", "mail_slot", "mail_round"))

    def exchange(self) -> None:
        """Aggregation: this iteration's writes of the group, each to its owner, applied there in
        DepCache's order (group rank, then call): memory the latest per node, mails appended."""
        if self.alone:
            return
        self.start_exchange()  # (unless the loop started it already)
        got, self._aggregation = self._aggregation.wait(), None
        slots = torch.cat(got["mem_slot"])
        if slots.numel():  # a later group rank's row wins, as in DepCache's rank-order application
            keep = latest(slots)
            self.shard.write_memory(slots[keep], torch.cat(got["mem"])[keep], torch.cat(got["mem_ts"])[keep])
        key = torch.cat([r + s * ROUNDS for s, r in enumerate(got["mail_round"])])
        append_in_order(self.shard, torch.cat(got["mail_slot"]), key, torch.cat(got["mail"]), torch.cat(got["mail_ts"]))


def _unsort(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``rows`` in ``order``'s order back to the original: ``out[order[i]] = rows[i]``."""
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def _cat(writes, dtypes, widths, dev) -> list[torch.Tensor]:
    """The buffered ``(ids, rows, ts)`` writes concatenated in call order (empty when none)."""
    if not writes:
        return [torch.zeros((0, w) if w else (0,), dtype=d, device=dev) for d, w in zip(dtypes, widths)]
    return [torch.cat([w[i] for w in writes]).to(dev, d) for i, d in enumerate(dtypes)]


class SvenMemory(PartitionedMemory):
    """``memory.backend=sven``: the partitioned store with Algorithm 2's deduplicated dispatch of
    raw rows (the requester updates them)."""

    profiled_exchange = True  # its dispatch and aggregation, one exchange of rows each, price the collectives


def build(cls, ctx: StoreContext, **options):
    """A partitioned store of class ``cls`` for this trainer, its placement loaded or computed;
    ``options``: the class's own keyword arguments."""
    layout = ctx.layout
    check_settings(cls, layout.j if layout is not None else 1, ctx.cfg.partition)
    place = placement(ctx)
    group = ctx.groups.get("memory") if ctx.groups is not None else None
    store = cls(place, ctx.mem_dim, ctx.mail_dim, ctx.mailbox_size, group=group, counter=ctx.counter,
                **options).to(ctx.device)
    log.info("%s", store.describe())
    return store


@register("sven", SvenMemory)
def _sven(ctx: StoreContext) -> SvenMemory:
    return build(SvenMemory, ctx)
