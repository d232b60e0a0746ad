"""A toy memory store registered from outside tgdist (``TGDIST_PLUGINS=tests.extending.toy_store``),
picked by ``memory.backend=toy``: local memory that counts its reads and writes into the file
``$TGDIST_TOY_STORE_LOG`` (if set) and prices itself its own way for the advisor (its reads and
writes twice what the process's cost, one collective on the aggregation side)."""

from __future__ import annotations

import os

from tgdist.memory import StoreContext, register
from tgdist.memory.store import LocalMemory


class ToyMemory(LocalMemory):
    """In-process memory of one trainer, counted; the run builds it from the registry (not the
    trainer's own local memory) and ``memory.backend=auto`` never picks it."""

    auto, trainers_own = False, False
    collectives = (0, 1)

    def __init__(self, *args, log: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.log, self.calls = log, {"read": 0, "write": 0}

    @classmethod
    def price_memory(cls, read_s, write_s, group_write_s, group):
        return 2.0 * read_s, 2.0 * write_s, 0.0

    def _count(self, what: str) -> None:
        self.calls[what] += 1
        if self.log:
            with open(self.log, "w") as f:
                f.write(f"{self.calls['read']} {self.calls['write']}\n")

    def read(self, ids):
        self._count("read")
        return super().read(ids)

    def write_memory(self, ids, mem, mem_ts):
        self._count("write")
        return super().write_memory(ids, mem, mem_ts)


@register("toy", ToyMemory)
def _toy(ctx: StoreContext) -> ToyMemory:
    return ToyMemory(ctx.num_nodes, ctx.mem_dim, ctx.mail_dim, ctx.mailbox_size,
                     log=os.environ.get("TGDIST_TOY_STORE_LOG")).to(ctx.device)
