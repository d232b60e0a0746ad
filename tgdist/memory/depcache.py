"""DepCache (Sven 2.3, Fig. 4): every trainer of a memory group holds a replica of the group's
memory; an iteration's writes are all-gathered in the group and applied in group-rank order."""

from __future__ import annotations

import torch

from tgdist.distributed import collectives
from tgdist.memory import StoreContext, register
from tgdist.memory.store import LocalMemory, MemoryStore


class DepCacheMemory(LocalMemory):
    """DepCache: a full replica of the group's memory in every trainer of the group.

    ``write_memory`` / ``write_mail`` are buffered; ``flush`` all-gathers the buffered rows of the
    group (in group-rank order) and applies them to every replica, so replicas stay identical. With
    ``sync = False`` (evaluation on one rank) writes apply at once, like ``LocalMemory``.
    """

    def __init__(self, num_nodes: int, mem_dim: int, mail_dim: int, mailbox_size: int, group=None,
                 counter: collectives.ByteCounter | None = None):
        super().__init__(num_nodes, mem_dim, mail_dim, mailbox_size)
        self.group = group
        self.counter = counter
        self.sync = True
        self._mem_rows: list[torch.Tensor] = []
        self._mail_rows: list[torch.Tensor] = []

    def write_memory(self, ids, mem, mem_ts):
        if not self.sync:
            return super().write_memory(ids, mem, mem_ts)
        # float64 rows [id, mem_ts, mem...]: exact for ids < 2**53 and float32 memory values
        self._mem_rows.append(torch.cat([ids.double()[:, None], mem_ts.double()[:, None], mem.detach().double()], 1))

    deliver_mails = MemoryStore.deliver_mails  # in rounds of write_mail, which buffers them

    def exchange(self) -> None:
        self.flush()

    def end_training(self, evaluates: bool) -> None:
        self.sync = False  # from here on writes apply to this replica alone (evaluation on one rank)

    def close(self) -> None:
        """Let go of the process group (the run destroys it; the replica's tensors stay readable)."""
        self.group, self.sync = None, False

    def write_mail(self, ids, mail, mail_ts):
        if not self.sync:
            return super().write_mail(ids, mail, mail_ts)
        rnd = torch.full((ids.shape[0], 1), float(len(self._mail_rows)), dtype=torch.float64, device=mail.device)
        self._mail_rows.append(torch.cat([rnd, ids.double()[:, None], mail_ts.double()[:, None],
                                          mail.detach().double()], 1))

    def flush(self) -> None:
        """Exchange and apply this iteration's writes of the whole memory group (every rank of the
        group must call it, writers and non-writers alike)."""
        dev = self.mem.device  # all_gather_rows answers on the device it is given: the replica's
        mem = torch.cat(self._mem_rows) if self._mem_rows else \
            torch.zeros(0, 2 + self.mem_dim, dtype=torch.float64, device=dev)
        mail = torch.cat(self._mail_rows) if self._mail_rows else \
            torch.zeros(0, 3 + self.mail_dim, dtype=torch.float64, device=dev)
        self._mem_rows, self._mail_rows = [], []
        for rows in collectives.all_gather_rows(mem, self.group, name="memory_write", counter=self.counter):
            if rows.shape[0]:
                super().write_memory(rows[:, 0].long(), rows[:, 2:].float(), rows[:, 1])
        for rows in collectives.all_gather_rows(mail, self.group, name="mail_write", counter=self.counter):
            for r in torch.unique(rows[:, 0]).tolist():  # rounds in order (APAN delivers several)
                sel = rows[rows[:, 0] == r]
                super().write_mail(sel[:, 1].long(), sel[:, 3:].float().view(-1, self.mail_dim), sel[:, 2])


@register("depcache")
def _depcache(ctx: StoreContext) -> DepCacheMemory:
    return DepCacheMemory(ctx.num_nodes, ctx.mem_dim, ctx.mail_dim, ctx.mailbox_size, group=ctx.groups.get("memory"),
                          counter=ctx.counter).to(ctx.device)
