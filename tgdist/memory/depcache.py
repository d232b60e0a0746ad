"""DepCache (Sven 2.3, Fig. 4): every trainer of a memory group holds a replica of the group's
memory; an iteration's writes are all-gathered in the group and applied in group-rank order."""

from __future__ import annotations

import torch

from tgdist.distributed import collectives
from tgdist.memory import StoreContext, register, volumes
from tgdist.memory.store import LocalMemory, MemoryStore
from tgdist.memory.volumes import TrainerRows


class DepCacheMemory(LocalMemory):
    """DepCache: a full replica of the group's memory in every trainer of the group.

    ``write_memory`` / ``write_mail`` are buffered; ``flush`` all-gathers the buffered writes of the
    group (in group-rank order) and applies them to every replica, so replicas stay identical. With
    ``sync = False`` (evaluation on one rank) writes apply at once, like ``LocalMemory``.
    """

    placement, auto, trainers_own = "collective", True, False
    collectives = (0, 2)  # the all-gather of the writes: the counts, then the rows

    @classmethod
    def traffic(cls, rows: TrainerRows, group: int) -> tuple[float, float]:
        """The all-gather gives each trainer the others' written rows, M - 1 shares per direction
        where eq. (7) counts (M - 1)^2 / M: M / (M - 1) times its share."""
        if group < 2:
            return 0.0, 0.0
        v = volumes.depcache_volume(group * rows.roots_distinct, 0.0, group, rows.mem_bytes, rows.mail_bytes)
        return 0.0, volumes.per_trainer(v, group) * group / (group - 1)

    @classmethod
    def paper_volume(cls, n1, eta1, n2, eta2, m, mem_bytes, mail_bytes):
        return volumes.depcache_volume(n2, eta2, m, mem_bytes, mail_bytes)

    @classmethod
    def price_memory(cls, read_s, write_s, group_write_s, group):
        return read_s, group_write_s, 0.0  # each replica applies the whole group's writes

    def __init__(self, num_nodes: int, mem_dim: int, mail_dim: int, mailbox_size: int, group=None,
                 counter: collectives.ByteCounter | None = None):
        super().__init__(num_nodes, mem_dim, mail_dim, mailbox_size)
        self.group = group
        self.counter = counter
        self.sync = True
        self._mem_writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._mail_writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # one round per call

    def write_memory(self, ids, mem, mem_ts):
        if not self.sync:
            return super().write_memory(ids, mem, mem_ts)
        self._mem_writes.append((ids, mem.detach(), mem_ts))

    deliver_mails = MemoryStore.deliver_mails  # in rounds of write_mail, which buffers them

    def exchange(self) -> None:
        if self.sync:  # (after end_training every write has applied already, and the group may be gone)
            self.flush()

    def end_training(self, evaluates: bool) -> None:
        self.sync = False  # from here on writes apply to this replica alone (evaluation on one rank)

    def pending_writes(self) -> int:
        return len(self._mem_writes) + len(self._mail_writes)

    def close(self) -> None:
        """Let go of the process group (the run destroys it; the replica's tensors stay readable)."""
        self.group, self.sync = None, False

    def write_mail(self, ids, mail, mail_ts):
        if not self.sync:
            return super().write_mail(ids, mail, mail_ts)
        self._mail_writes.append((ids, mail.detach(), mail_ts))

    def flush(self) -> None:
        """Exchange and apply this iteration's writes of the whole memory group (every rank of the
        group must call it, writers and non-writers alike): one all-gather (phase ``aggregation``),
        each rank's writes applied in group-rank order, its mails in the order of its calls."""
        dev = self.mem.device  # all_gather_parts answers on the device it is given: the replica's
        mem_ids, mem, mem_ts = _cat(self._mem_writes, self.mem_dim, dev)
        mail_ids, mail, mail_ts = _cat(self._mail_writes, self.mail_dim, dev)
        rounds = torch.cat([torch.full((w[0].shape[0],), r, dtype=torch.long, device=dev)
                            for r, w in enumerate(self._mail_writes)]) if self._mail_writes else mail_ids
        self._mem_writes, self._mail_writes = [], []
        got = collectives.all_gather_parts(
            {"mem_ids": mem_ids, "mem": mem, "mem_ts": mem_ts, "mail_round": rounds, "mail_ids": mail_ids,
             "mail": mail, "mail_ts": mail_ts}, self.group, name="aggregation", counter=self.counter,
            index=("mem_ids", "mail_round", "mail_ids"))
        for s in range(len(got["mem_ids"])):
            if got["mem_ids"][s].numel():
                super().write_memory(got["mem_ids"][s], got["mem"][s], got["mem_ts"][s])
            rnd = got["mail_round"][s]
            for r in torch.unique(rnd).tolist():  # rounds in order (APAN delivers several)
                sel = torch.nonzero(rnd == r).squeeze(1)
                super().write_mail(got["mail_ids"][s][sel], got["mail"][s][sel], got["mail_ts"][s][sel])


def _cat(writes, width: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffered ``(ids, rows [n, width], ts)`` writes concatenated in call order."""
    if not writes:
        return (torch.zeros(0, dtype=torch.long, device=dev), torch.zeros(0, width, device=dev),
                torch.zeros(0, dtype=torch.float64, device=dev))
    return tuple(torch.cat([w[i] for w in writes]).to(dev, dtype)
                 for i, dtype in enumerate((torch.long, torch.float32, torch.float64)))


@register("depcache", DepCacheMemory)
def _depcache(ctx: StoreContext) -> DepCacheMemory:
    return DepCacheMemory(ctx.num_nodes, ctx.mem_dim, ctx.mail_dim, ctx.mailbox_size, group=ctx.groups.get("memory"),
                          counter=ctx.counter).to(ctx.device)
