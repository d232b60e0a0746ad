"""DistTGL's memory daemon (section 3.3, Algorithm 1): one process per memory group owns the node
memory and mails in shared memory and serves its ``i * j`` trainers' reads and writes in a fixed
order, through buffers and status words shared with them.

Protocol (per memory group; group rank ``r = jj * i + ii``, subgroup ``jj`` of ``j``):

- The daemon serves *positions* ``p = 0, 1, 2, ...`` of the group's stream. At position ``p`` it
  first serves every trainer's request for ``p`` (a read into read slot ``p % j``, or a skip), then
  the writes of subgroup 0's ``i`` trainers for ``p`` in ``ii`` order, then moves to ``p + 1``.
  Subgroup ``jj >= 1`` trains position ``p`` at iteration ``p + jj`` but posts its read for ``p``
  with subgroup 0, so it sees the memory before subgroup 0 writes ``p`` (DistTGL 3.2.2); the ``j``
  read slots keep that result intact until the trainer uses it. With ``i = j = 1`` this is
  ``R W R W ...``. Reads of one position are served as they arrive (they do not change the memory).
- If two trainers of subgroup 0 write the same node at one position, the higher ``ii`` wins: writes
  are applied trainer by trainer in ``ii`` order, and within a trainer in the order of its calls.
- A request may ask for a memory reset (a new pass over the stream): the daemon resets before it
  serves the first request of that position. Every trainer must give the same flag for a position.
- The first position served is the one the first request names (so a resumed run may start
  anywhere); after that each trainer posts exactly one read or skip per position, in order.
- Commands (outside positions, served when the group is between positions): hold/release (the
  holder copies the whole state in or out directly: checkpoints), detach.

Shared segments per group, all named ``tgdist-<run id>-g<group>-<buffer>``, mode 0600, created by
the daemon and unlinked on every exit path (by the daemon, or by whichever trainer or launcher
finds it dead):

- ``ctl``: header words (pids, readiness, fatal flag and message, position, counters), one row of
  status words per trainer (requested / done position + 1 for reads and writes, command sequence
  numbers), doorbells, and an optional trace of the served order (tests).
- ``state``: ``mem [N, mem_dim]`` float32, ``mem_ts [N]`` float64, ``mail [N, S, mail_dim]``
  float32, ``mail_ts [N, S]`` float64, ``head [N]`` int64 (the ``LocalMemory`` buffers).
- ``t<r>`` per trainer: read slots ``ids [j, max_ids]`` and results ``mem [j, max_ids, mem_dim]``,
  ``mem_ts [j, max_ids]``, ``mail [j, max_ids, S, mail_dim]``, ``mail_ts [j, max_ids, S]``; for
  subgroup 0 also the write buffer: an op list ``[max_ops, 3]`` (kind, start, count) over memory
  rows (``ids``, ``mem``, ``mem_ts``) and mail rows (``ids``, ``mail``, ``mail_ts``), so APAN's
  delivery rounds are applied in order.

The daemon only copies rows (``index_select`` into the read slots, ``LocalMemory``'s own write
code over the shared tensors), so a run through it is bit-identical to a run with ``LocalMemory``.

Waiting never spins without bound: spin ~100 us, then sleep on a doorbell (futex) with growing,
capped intervals; peers' liveness is checked every ~50-100 ms; trainers time out (``timeout``)
with a message naming whom the daemon is waiting for. A trainer's death stops the group (the
daemon unlinks and exits; the others raise ``RunFailure`` naming it); the daemon's death makes
the trainers raise and unlink. ``finish()`` lets a trainer leave the stream on purpose.

Ordering of shared stores: a poster writes the payload, then publishes the status word; the
daemon reads the status word, then the payload. x86-64 keeps stores, and loads, in program order,
which this relies on; a weakly ordered CPU (aarch64) would need explicit fences (not done here).
A ``DaemonMemory`` is used by one thread at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import traceback
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import numpy as np
import torch

from tgdist.config import MemoryConfig
from tgdist.errors import ConfigError, RunFailure, TgdistError
from tgdist.memory import StoreContext, register, shm
from tgdist.memory.store import LocalMemory, MemoryRead, MemoryStore

log = logging.getLogger(__name__)

MAGIC, VERSION = 0x7464697374, 1  # "tdist"

# Header words (int64) of the ctl segment.
(H_MAGIC, H_VERSION, H_PID, H_PID_START, H_READY, H_FATAL, H_STOPPED, H_SHUTDOWN, H_POSITION, H_PHASE,
 H_WAIT_RANK, H_WAIT_WHAT, H_GROUP, H_I, H_J, H_NUM_NODES, H_MEM_DIM, H_MAIL_DIM, H_MAILBOX, H_MAX_IDS,
 H_MAX_WRITE, H_MAX_MAIL, H_MAX_OPS, H_TRACE_CAP, H_TRACE_LEN, H_READS, H_SKIPS, H_WRITES, H_RESETS,
 H_READ_NS, H_WRITE_NS, H_READ_ROWS, H_WRITE_ROWS, H_IDLE_NS, H_FIRST_RANK) = range(35)
NUM_H = 64
# Status words of one trainer (int64). REQ fields are written by the trainer, DONE by the daemon.
# C_RD_EMPTY (daemon): 1 when the read it served found the group's mailboxes unwritten since their
# reset (``MemoryRead.empty``, as ``LocalMemory`` says it).
(C_PID, C_PID_START, C_STATE, C_RD_REQ, C_RD_KIND, C_RD_RESET, C_RD_LEN, C_RD_SLOT, C_RD_DONE, C_WR_REQ,
 C_WR_OPS, C_WR_DONE, C_CMD_REQ, C_CMD_KIND, C_CMD_DONE, C_CMD_STATUS, C_RD_EMPTY) = range(17)
NUM_C = 17
MSG_BYTES = 4096

ATTACHED, DETACHED = 1, 2  # C_STATE
READ, SKIP = 1, 2  # C_RD_KIND
HOLD, HOLD_LOAD, RELEASE, DETACH, FINISH = 1, 2, 3, 4, 5  # C_CMD_KIND
OP_MEM, OP_MAIL = 1, 2  # write ops
PHASE_READ, PHASE_WRITE = 0, 1
WAIT_REQUEST, WAIT_WRITE, WAIT_RELEASE = 1, 2, 3  # H_WAIT_WHAT
# Trace record kinds: (kind, rank, position)
T_READ, T_SKIP, T_WRITE, T_RESET = 1, 2, 3, 4
TRACE_NAMES = {T_READ: "R", T_SKIP: "S", T_WRITE: "W", T_RESET: "Z"}

STATE_KEYS = ("mem", "mem_ts", "mail", "mail_ts", "head")


# ------------------------------------------------------------------------------------------------
# Configuration, names, layouts (pure)


@dataclass
class DaemonConfig:
    """The daemon's knobs, proposed as fields of ``tgdist.config.MemoryConfig`` (``memory.*``)."""

    max_ids: Optional[int] = None  # rows per read slot; null: read_bound(...) or the number of nodes
    max_write: Optional[int] = None  # memory rows per write; null: max_ids
    timeout: float = 120.0  # trainer waiting for the daemon, and the daemon for trainers to attach
    idle_timeout: float = 0.0  # daemon waiting for live trainers' next request; 0: no limit
    num_threads: int = 1  # torch threads of the daemon process
    spin_us: float = 100.0  # busy polling before sleeping on a doorbell
    copy_reads: bool = False  # return copies instead of views of the read slots


@dataclass
class DaemonMemoryConfig(MemoryConfig):
    """``memory.*`` of ``memory.backend=daemon``: the section's keys and the daemon's own."""

    max_ids: Optional[int] = None  # rows per read slot (null: bounded from batch and fanouts)
    timeout: float = 120.0  # seconds a trainer waits for the daemon before failing
    num_threads: int = 1  # torch threads of the daemon process


@dataclass
class DaemonSpec:
    """Everything the daemon process needs; JSON on its command line."""

    run_id: str
    group: int
    i: int
    j: int
    num_nodes: int
    mem_dim: int
    mail_dim: int
    mailbox_size: int = 1
    max_ids: int = 0  # 0: num_nodes
    max_write: int = 0  # 0: max_ids
    max_mail: int = 0  # 0: max_write * mailbox_size
    max_ops: int = 0  # 0: 16 + 2 * mailbox_size
    timeout: float = 120.0
    idle_timeout: float = 0.0
    num_threads: int = 1
    spin_us: float = 100.0
    trace: int = 0  # capacity of the served-order trace; 0: off
    owner_pid: int = 0
    owner_start: int = 0
    trainer_pids: List[int] = field(default_factory=list)
    # Global rank of the group's trainer 0: messages name trainer r as rank first_rank + r, the
    # number the launcher and the user know it by (a group's ranks are contiguous: Layout).
    first_rank: int = 0

    def __post_init__(self) -> None:
        shm.check_name(f"tgdist-{self.run_id}")
        for name in ("i", "j", "num_nodes", "mem_dim", "mail_dim", "mailbox_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"memory daemon: {name} must be >= 1, got {getattr(self, name)}")
        self.max_ids = int(self.max_ids or self.num_nodes)
        self.max_write = int(self.max_write or self.max_ids)
        self.max_mail = int(self.max_mail or self.max_write * self.mailbox_size)
        self.max_ops = int(self.max_ops or 16 + 2 * self.mailbox_size)
        if int(self.first_rank) < 0:
            raise ConfigError(f"memory daemon: first_rank must be >= 0, got {self.first_rank}")
        if self.trainer_pids and len(self.trainer_pids) != self.num_trainers:
            raise ConfigError(f"memory daemon: {len(self.trainer_pids)} trainer pids for {self.num_trainers} trainers")

    @property
    def num_trainers(self) -> int:
        return self.i * self.j


def new_run_id() -> str:
    """Unique per run on this machine: the starter's pid plus 8 random hex digits."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def prefix_of(run_id: str, group: int) -> str:
    return f"tgdist-{run_id}-g{group}-"


def segment_names(run_id: str, group: int, num_trainers: int) -> list[str]:
    p = prefix_of(run_id, group)
    return [p + "ctl", p + "state"] + [p + f"t{r}" for r in range(num_trainers)]


def read_bound(batch_size: int, num_neg: int, fanouts, num_nodes: int) -> int:
    """Most unique nodes one trainer reads per batch: roots ``b * (2 + num_neg)`` and their sampled
    neighbours over all hops, capped by the number of nodes (a safe ``max_ids``)."""
    layer = total = batch_size * (2 + num_neg)
    for f in fanouts or []:
        layer *= int(f)
        total += layer
    return int(min(num_nodes, total))


def ctl_layout(num_trainers: int, trace_cap: int) -> shm.Layout:
    return shm.Layout.of([("hdr", np.int64, (NUM_H,)), ("ctl", np.int64, (num_trainers, NUM_C)),
                          ("bells", np.int32, (num_trainers + 1, 16)), ("msg", np.uint8, (MSG_BYTES,)),
                          ("trace", np.int64, (max(trace_cap, 1), 3))])


def state_layout(n: int, mem_dim: int, mail_dim: int, s: int) -> shm.Layout:
    return shm.Layout.of([("mem", np.float32, (n, mem_dim)), ("mem_ts", np.float64, (n,)),
                          ("mail", np.float32, (n, s, mail_dim)), ("mail_ts", np.float64, (n, s)),
                          ("head", np.int64, (n,))])


def trainer_layout(j: int, max_ids: int, mem_dim: int, mail_dim: int, s: int, writes: bool, max_write: int,
                   max_mail: int, max_ops: int) -> shm.Layout:
    spec = [("rd_ids", np.int64, (j, max_ids)), ("rd_mem", np.float32, (j, max_ids, mem_dim)),
            ("rd_mem_ts", np.float64, (j, max_ids)), ("rd_mail", np.float32, (j, max_ids, s, mail_dim)),
            ("rd_mail_ts", np.float64, (j, max_ids, s))]
    if writes:  # only subgroup 0 writes (DistTGL 3.2.2)
        spec += [("wr_ops", np.int64, (max_ops, 3)), ("wr_mem_ids", np.int64, (max_write,)),
                 ("wr_mem", np.float32, (max_write, mem_dim)), ("wr_mem_ts", np.float64, (max_write,)),
                 ("wr_mail_ids", np.int64, (max_mail,)), ("wr_mail", np.float32, (max_mail, mail_dim)),
                 ("wr_mail_ts", np.float64, (max_mail,))]
    return shm.Layout.of(spec)


def _spec_layouts(sp: DaemonSpec):
    tl = [trainer_layout(sp.j, sp.max_ids, sp.mem_dim, sp.mail_dim, sp.mailbox_size, r < sp.i, sp.max_write,
                         sp.max_mail, sp.max_ops) for r in range(sp.num_trainers)]
    return (ctl_layout(sp.num_trainers, sp.trace), state_layout(sp.num_nodes, sp.mem_dim, sp.mail_dim, sp.mailbox_size),
            tl)


def _set_msg(msg_arr: np.ndarray, text: str) -> None:
    raw = text.encode("utf-8", "replace")[: MSG_BYTES - 1]
    msg_arr[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    msg_arr[len(raw)] = 0


def _get_msg(msg_arr: np.ndarray) -> str:
    raw = bytes(msg_arr)
    return raw[: raw.find(b"\0") if b"\0" in raw else len(raw)].decode("utf-8", "replace")


def _stats(hdr: np.ndarray) -> dict:
    keys = {"reads": H_READS, "skips": H_SKIPS, "writes": H_WRITES, "resets": H_RESETS, "read_ns": H_READ_NS,
            "write_ns": H_WRITE_NS, "read_rows": H_READ_ROWS, "write_rows": H_WRITE_ROWS, "idle_ns": H_IDLE_NS,
            "position": H_POSITION}
    return {k: int(hdr[v]) for k, v in keys.items()}


def _trace(ctl_seg: shm.Segment) -> list[tuple[str, int, int]]:
    n = int(ctl_seg.array("hdr")[H_TRACE_LEN])
    return [(TRACE_NAMES[k], r, p) for k, r, p in ctl_seg.array("trace")[:n].tolist()]


def unlink_group(run_id: str, group: int, num_trainers: int) -> list[str]:
    """Remove every segment name of a group; returns those that existed."""
    return [n for n in segment_names(run_id, group, num_trainers) if shm.shm_unlink(n)]


def sweep_stale(prefix: str = "tgdist-") -> list[str]:
    """Unlink segment families left by runs whose daemon and trainers are all dead (e.g. after a
    SIGKILL of every process of a group). Returns the names removed."""
    removed = []
    for name in shm.list_segments(prefix):
        if not name.endswith("-ctl"):
            continue
        fam = name[: -len("ctl")]
        try:
            seg = shm.Segment.attach(name)
            hdr = np.frombuffer(seg.mm, dtype=np.int64, count=NUM_H).copy()
            r = int(hdr[H_I] * hdr[H_J])
            lay = ctl_layout(r, int(hdr[H_TRACE_CAP]))
            seg.layout = lay
            ctl = seg.array("ctl").copy()
            seg.close()
        except (OSError, ValueError):
            continue
        pids = [(int(hdr[H_PID]), int(hdr[H_PID_START]))] + [(int(c[C_PID]), int(c[C_PID_START])) for c in ctl
                                                              if c[C_STATE] == ATTACHED]
        # The run id starts with the pid of the rank that started the daemon (new_run_id): a daemon
        # still starting has made its segments but not yet written its own pid into them.
        starter = re.match(r"tgdist-(\d+)-", fam)
        if starter:
            pids.append((int(starter.group(1)), 0))
        if not any(shm.alive(p, s) for p, s in pids):
            for n in shm.list_segments(fam):
                if shm.shm_unlink(n):
                    removed.append(n)
    return removed


# ------------------------------------------------------------------------------------------------
# The daemon process


class _Fatal(Exception):
    """Stops the daemon; the message is shown to every trainer."""


class _Signal(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Server:
    """The daemon's state and its service loop (Algorithm 1 generalised to positions and slots)."""

    def __init__(self, spec: DaemonSpec):
        self.spec = sp = spec
        self.R, self.I, self.J = sp.num_trainers, sp.i, sp.j
        self.names = segment_names(sp.run_id, sp.group, self.R)
        self.segs: list[shm.Segment] = []
        cl, sl, tls = _spec_layouts(sp)
        try:
            # ctl first, with READY = 0: attachers wait for READY, so the order is not observable.
            self.ctl_seg = self._create(self.names[0], cl)
            self.state_seg = self._create(self.names[1], sl)
            self.tsegs = [self._create(self.names[2 + r], tls[r]) for r in range(self.R)]
        except BaseException:
            self.unlink()
            raise
        self.hdr = self.ctl_seg.array("hdr")
        self.ctl = self.ctl_seg.array("ctl")
        self.msg = self.ctl_seg.array("msg")
        self.trace = self.ctl_seg.array("trace")
        bells = self.ctl_seg.array("bells")
        self.bell = shm.Doorbell(bells[0, :1])
        self.tbells = [shm.Doorbell(bells[r + 1, :1]) for r in range(self.R)]
        # The memory: LocalMemory's own code over tensors in the shared segment.
        st = {k: self.state_seg.tensor(k) for k in STATE_KEYS}
        st["mail_ts"].fill_(float("-inf"))
        self.local = LocalMemory(0, sp.mem_dim, sp.mail_dim, sp.mailbox_size)
        for k in STATE_KEYS:
            setattr(self.local, k, st[k])
        self.local.num_nodes = sp.num_nodes
        self.local._mark_unwritten()  # (its mailboxes are now the segment's, empty)
        self.mem, self.mem_ts, self.mail, self.mail_ts = st["mem"], st["mem_ts"], st["mail"], st["mail_ts"]
        self.S = sp.mailbox_size
        if self.S == 1:
            self.mail1, self.mail_ts1 = self.mail.view(sp.num_nodes, -1), self.mail_ts.view(sp.num_nodes)
        self.t = [{f.name: seg.tensor(f.name) for f in seg.layout.fields} for seg in self.tsegs]
        self.ops = [seg.array("wr_ops") if r < self.I else None for r, seg in enumerate(self.tsegs)]
        h = self.hdr
        h[H_MAGIC], h[H_VERSION], h[H_PID], h[H_PID_START] = MAGIC, VERSION, os.getpid(), shm.start_time(os.getpid())
        h[H_GROUP], h[H_I], h[H_J], h[H_NUM_NODES] = sp.group, sp.i, sp.j, sp.num_nodes
        h[H_MEM_DIM], h[H_MAIL_DIM], h[H_MAILBOX], h[H_MAX_IDS] = sp.mem_dim, sp.mail_dim, sp.mailbox_size, sp.max_ids
        h[H_MAX_WRITE], h[H_MAX_MAIL], h[H_MAX_OPS], h[H_TRACE_CAP] = sp.max_write, sp.max_mail, sp.max_ops, sp.trace
        h[H_FIRST_RANK] = sp.first_rank
        h[H_POSITION] = -1
        self.p: int | None = None
        self.phase = PHASE_READ
        self.served = [False] * self.R
        self.requesters: set[int] = set()  # trainers that posted a request for this position
        self.finished = [False] * self.R  # left the stream: later positions do not wait for them
        self.reset_p: bool | None = None
        self.next_writer = 0
        self.held_by = -1
        self.done = False
        self.started = time.monotonic()
        h[H_READY] = 1

    def _create(self, name: str, layout: shm.Layout) -> shm.Segment:
        seg = shm.Segment.create(name, layout)
        self.segs.append(seg)
        return seg

    def unlink(self) -> None:
        for n in self.names:
            shm.shm_unlink(n)

    def ring_all(self) -> None:
        for b in self.tbells:
            b.ring()

    def record(self, kind: int, r: int, p: int) -> None:
        n = int(self.hdr[H_TRACE_LEN])
        if n < self.spec.trace:
            self.trace[n] = (kind, r, p)
            self.hdr[H_TRACE_LEN] = n + 1

    def ranks(self, rs) -> str:
        """The global ranks of group trainers ``rs``, comma-separated."""
        return ", ".join(str(self.spec.first_rank + r) for r in rs)

    def who(self, r: int) -> str:
        pid = int(self.ctl[r, C_PID]) or (self.spec.trainer_pids[r] if self.spec.trainer_pids else 0)
        return f"trainer rank {self.ranks([r])}" + (f" (pid {pid})" if pid else "")

    # -- the loop ----------------------------------------------------------------------------

    def loop(self) -> None:
        backoff = shm.Backoff(self.bell, self.spec.spin_us * 1e-6)
        idle_since = None
        next_check = 0.0
        while True:
            seen = self.bell.value()
            if self.poll():
                if idle_since is not None:
                    self.hdr[H_IDLE_NS] += int((time.monotonic() - idle_since) * 1e9)
                    idle_since = None
                backoff.reset()
                continue
            if self.done:
                return
            now = time.monotonic()
            if idle_since is None:
                idle_since = now
                self.publish_waiting()
            if now >= next_check:
                self.check_peers(now, idle_since)
                next_check = now + 0.1
            backoff.pause(seen)

    def poll(self) -> bool:
        """One pass over the status words; True if anything was served."""
        ctl, R = self.ctl, self.R
        if self.hdr[H_SHUTDOWN]:
            self.done = True
            return False
        progress = False
        for r in range(R):
            if ctl[r, C_CMD_REQ] != ctl[r, C_CMD_DONE] and self.command(r):
                progress = True
        if self.held_by >= 0:
            return progress
        if self.phase == PHASE_READ:
            for r in range(R):
                if not self.served[r]:
                    if ctl[r, C_RD_REQ] != ctl[r, C_RD_DONE]:
                        self.serve_request(r, int(ctl[r, C_RD_REQ]) - 1)
                        progress = True
                    elif self.finished[r]:
                        self.served[r] = True
            # (a position where every trainer has finished is not a position: wait, do not spin on)
            if self.requesters and all(self.served):
                self.phase, self.next_writer = PHASE_WRITE, 0
                self.hdr[H_PHASE] = PHASE_WRITE
                progress = True
        if self.phase == PHASE_WRITE:
            while self.next_writer < self.I:
                r = self.next_writer
                if ctl[r, C_WR_REQ] == ctl[r, C_WR_DONE]:
                    if self.finished[r]:
                        self.next_writer += 1
                        continue
                    break
                q = int(ctl[r, C_WR_REQ]) - 1
                if q != self.p:
                    raise _Fatal(f"{self.who(r)} posted a write for position {q} while group {self.spec.group} "
                                 f"applies the writes of position {self.p}")
                self.apply_writes(r)
                ctl[r, C_WR_DONE] = q + 1
                self.tbells[r].ring()
                self.next_writer += 1
                progress = True
            if self.next_writer == self.I:
                self.p += 1
                self.phase = PHASE_READ
                self.served = [False] * R
                self.requesters = set()
                self.reset_p = None
                self.hdr[H_POSITION], self.hdr[H_PHASE] = self.p, PHASE_READ
        if not progress and all(ctl[r, C_STATE] == DETACHED for r in range(R)):
            self.done = True  # every trainer left and what they posted is served
        return progress

    def serve_request(self, r: int, q: int) -> None:
        c = self.ctl[r]
        if self.p is None:  # the first request names the first position
            self.p = q
            self.hdr[H_POSITION] = q
        if q != self.p:
            raise _Fatal(f"{self.who(r)} posted a request for position {q} while group {self.spec.group} serves "
                         f"position {self.p} (every trainer posts one read or skip per position, in order)")
        reset = bool(c[C_RD_RESET])
        if self.reset_p is None:
            self.reset_p, self.reset_by = reset, r
            if reset:
                self.local.reset_state()
                self.hdr[H_RESETS] += 1
                self.record(T_RESET, r, q)
        elif reset != self.reset_p:
            raise _Fatal(f"{self.who(r)} {'asked' if reset else 'did not ask'} for a memory reset at position {q} "
                         f"and {self.who(self.reset_by)} {'did' if self.reset_p else 'did not'}")
        kind = int(c[C_RD_KIND])
        if kind == READ:
            n, slot = int(c[C_RD_LEN]), int(c[C_RD_SLOT])
            if not (0 <= n <= self.spec.max_ids and 0 <= slot < self.J):
                raise _Fatal(f"{self.who(r)} posted a read of {n} ids into slot {slot} (buffer {self.spec.max_ids}, "
                             f"{self.J} slots)")
            t0 = time.perf_counter_ns()
            b = self.t[r]
            ids = b["rd_ids"][slot, :n]
            torch.index_select(self.mem, 0, ids, out=b["rd_mem"][slot, :n])
            torch.index_select(self.mem_ts, 0, ids, out=b["rd_mem_ts"][slot, :n])
            torch.index_select(self.mail, 0, ids, out=b["rd_mail"][slot, :n])
            torch.index_select(self.mail_ts, 0, ids, out=b["rd_mail_ts"][slot, :n])
            c[C_RD_EMPTY] = int(self.local.mail_unwritten())
            self.hdr[H_READ_NS] += time.perf_counter_ns() - t0
            self.hdr[H_READS] += 1
            self.hdr[H_READ_ROWS] += n
            self.record(T_READ, r, q)
        elif kind == SKIP:
            self.hdr[H_SKIPS] += 1
            self.record(T_SKIP, r, q)
        else:
            raise _Fatal(f"{self.who(r)} posted an unknown request kind {kind}")
        self.served[r] = True
        self.requesters.add(r)
        c[C_RD_DONE] = q + 1
        self.tbells[r].ring()

    def apply_writes(self, r: int) -> None:
        """Trainer ``r``'s writes of this position, in the order it made them."""
        nops = int(self.ctl[r, C_WR_OPS])
        if not 0 <= nops <= self.spec.max_ops:
            raise _Fatal(f"{self.who(r)} posted {nops} write operations (at most {self.spec.max_ops})")
        t0 = time.perf_counter_ns()
        b, rows = self.t[r], 0
        for kind, start, cnt in self.ops[r][:nops].tolist():
            if kind == OP_MEM:
                if start < 0 or start + cnt > self.spec.max_write:
                    raise _Fatal(f"{self.who(r)} posted memory rows [{start}, {start + cnt}) outside its buffer")
                sl = slice(start, start + cnt)
                self.local.write_memory(b["wr_mem_ids"][sl], b["wr_mem"][sl], b["wr_mem_ts"][sl])
            elif kind == OP_MAIL:
                if start < 0 or start + cnt > self.spec.max_mail:
                    raise _Fatal(f"{self.who(r)} posted mail rows [{start}, {start + cnt}) outside its buffer")
                sl = slice(start, start + cnt)
                if self.S == 1:  # the ring has one slot: LocalMemory's result (head stays 0) by index_copy_
                    self.mail1.index_copy_(0, b["wr_mail_ids"][sl], b["wr_mail"][sl])
                    self.mail_ts1.index_copy_(0, b["wr_mail_ids"][sl], b["wr_mail_ts"][sl])
                else:
                    self.local.write_mail(b["wr_mail_ids"][sl], b["wr_mail"][sl], b["wr_mail_ts"][sl])
            else:
                raise _Fatal(f"{self.who(r)} posted an unknown write kind {kind}")
            rows += cnt
        self.hdr[H_WRITE_NS] += time.perf_counter_ns() - t0
        self.hdr[H_WRITES] += 1
        self.hdr[H_WRITE_ROWS] += rows
        self.record(T_WRITE, r, self.p)

    def command(self, r: int) -> bool:
        c = self.ctl[r]
        kind, seq, status = int(c[C_CMD_KIND]), int(c[C_CMD_REQ]), 0
        if kind == DETACH:
            c[C_STATE] = DETACHED
            if self.held_by == r:
                self.held_by = -1
        elif kind == FINISH:
            self.finished[r] = True
        elif kind in (HOLD, HOLD_LOAD):
            # Only between positions: all writes of the previous position are applied, and the
            # holder (who posted all of its own requests) keeps the group from passing this one.
            # The holder's own posted requests are served first, so it sees its own writes.
            if self.held_by >= 0 or self.phase != PHASE_READ or self.posted(r):
                return False
            if kind == HOLD_LOAD and self.requesters:
                status = 1
                readers = self.ranks(sorted(self.requesters))
                _set_msg(self.msg, f"load_state_dict at position {self.p}: trainer rank(s) {readers} already read "
                                   f"that position; load the state before the other trainers post (behind a barrier)")
            else:
                self.held_by = r
                if kind == HOLD_LOAD:  # the holder copies a state into the segment: a write this process
                    self.local.mark_written()  # does not see (its tensors' versions do not move)
        elif kind == RELEASE:
            if self.held_by == r:
                self.held_by = -1
        else:
            raise _Fatal(f"{self.who(r)} sent an unknown command {kind}")
        c[C_CMD_STATUS] = status
        c[C_CMD_DONE] = seq
        self.tbells[r].ring()
        return True

    def posted(self, r: int) -> bool:
        """Has trainer ``r`` a read, skip or write that is not served yet?"""
        c = self.ctl[r]
        return bool(c[C_RD_REQ] != c[C_RD_DONE] or (r < self.I and c[C_WR_REQ] != c[C_WR_DONE]))

    def pending(self, r: int) -> bool:
        """Has trainer ``r`` posted anything that is not served yet (commands included)?"""
        return self.posted(r) or bool(self.ctl[r, C_CMD_REQ] != self.ctl[r, C_CMD_DONE])

    def waiting_for(self) -> tuple[int, int]:
        """(rank, what) the daemon waits for now."""
        if self.held_by >= 0:
            return self.held_by, WAIT_RELEASE
        if self.phase == PHASE_READ:
            for r in range(self.R):
                if not self.served[r]:
                    return r, WAIT_REQUEST
            return -1, 0
        return self.next_writer, WAIT_WRITE

    def publish_waiting(self) -> None:
        r, what = self.waiting_for()
        self.hdr[H_WAIT_RANK], self.hdr[H_WAIT_WHAT] = r, what

    def check_peers(self, now: float, idle_since: float) -> None:
        sp, ctl = self.spec, self.ctl
        unattached = []
        for r in range(self.R):
            st = ctl[r, C_STATE]
            if st == ATTACHED:
                if not shm.alive(int(ctl[r, C_PID]), int(ctl[r, C_PID_START])):
                    if self.finished[r]:  # done with the stream: nothing is lost
                        ctl[r, C_STATE] = DETACHED
                        if self.held_by == r:
                            self.held_by = -1
                        continue
                    raise _Fatal(f"{self.who(r)} died")
            elif st == 0:
                unattached.append(r)
                if sp.trainer_pids and not shm.alive(sp.trainer_pids[r]):
                    raise _Fatal(f"{self.who(r)} died before attaching")
        if unattached:
            if sp.owner_pid and not shm.alive(sp.owner_pid, sp.owner_start):
                raise _Fatal(f"the process that started the daemon (pid {sp.owner_pid}) died before "
                             f"trainer rank(s) {self.ranks(unattached)} attached")
            if now - self.started > sp.timeout:
                raise _Fatal(f"trainer rank(s) {self.ranks(unattached)} did not attach within {sp.timeout:g} s")
        # A trainer that detached before its part of this position blocks the group; that is an
        # error once a live trainer waits for the group to go on (else they may all be finishing).
        if self.held_by < 0:
            if self.phase == PHASE_READ:
                gone = [(x, "read or skip") for x in range(self.R)
                        if not self.served[x] and ctl[x, C_STATE] == DETACHED]
            else:
                x = self.next_writer
                gone = [(x, "write")] if ctl[x, C_STATE] == DETACHED else []
            if gone and any(ctl[x, C_STATE] != DETACHED and self.pending(x) for x in range(self.R)):
                raise _Fatal(f"{self.who(gone[0][0])} detached before posting its {gone[0][1]} for position {self.p}")
        r, what = self.waiting_for()
        if sp.idle_timeout and now - idle_since > sp.idle_timeout and r >= 0:
            raise _Fatal(f"{self.who(r)} posted no {_WHAT[what]} for position {self.p} within {sp.idle_timeout:g} s")


_WHAT = {WAIT_REQUEST: "read or skip", WAIT_WRITE: "write", WAIT_RELEASE: "release of its hold"}


def run_daemon(spec: DaemonSpec) -> int:
    """Body of the daemon process: serve until every trainer detached or a shutdown; always unlink."""
    tag = f"tgdist memory daemon of group {spec.group} (pid {os.getpid()})"

    def on_signal(signum, frame):
        raise _Signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    torch.set_num_threads(max(1, spec.num_threads))
    server, msg, code = None, None, 0
    try:
        try:
            server = _Server(spec)
            server.loop()
        except _Fatal as e:
            msg, code = str(e), 1
        except _Signal as e:
            msg, code = f"stopped by {signal.Signals(e.signum).name}", 128 + e.signum
        except BaseException as e:  # a bug: still tell the trainers, and clean up
            traceback.print_exc()
            msg, code = f"internal error: {type(e).__name__}: {e}", 1
        # No signal may cut the clean-up short.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
        if server is not None:
            if msg is None:
                server.hdr[H_STOPPED] = 1
            else:
                _set_msg(server.msg, msg)
                server.hdr[H_FATAL] = 1
            server.ring_all()
    finally:
        if server is not None:
            server.unlink()
        else:
            unlink_group(spec.run_id, spec.group, spec.num_trainers)
    if msg is not None:
        print(f"{tag}: {msg}", file=sys.stderr, flush=True)
    return code


# ------------------------------------------------------------------------------------------------
# Starting and stopping (the launcher side)


class DaemonHandle:
    """The launcher's handle on a running daemon: attach trainers, stop it, clean up."""

    def __init__(self, spec: DaemonSpec, process: subprocess.Popen):
        self.spec, self.process = spec, process
        self.names = segment_names(spec.run_id, spec.group, spec.num_trainers)
        self._ctl = None
        self._clients: list[weakref.ref] = []
        # At interpreter exit without stop(): SIGTERM after 2 s (the daemon tells the trainers).
        self._finalizer = weakref.finalize(self, _stop_process, process, self.names, 2.0)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    def attach(self, rank: int, **kw) -> "DaemonMemory":
        client = DaemonMemory(self.spec.run_id, self.spec.group, rank, handle=self, **kw)
        self._clients.append(weakref.ref(client))
        return client

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout: float | None = None) -> int | None:
        """Detach this process's clients, let the daemon finish (it exits once every trainer
        detached, or stops the group if one is waited for), then after ``timeout`` (default: the
        daemon's ``timeout``) shut it down, escalating to SIGTERM / SIGKILL; unlink the segments."""
        for ref in self._clients:
            client = ref()
            if client is not None:
                client.close()
        timeout = self.spec.timeout if timeout is None else timeout
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        grace = 0.0
        if self.process.poll() is None and self._ctl is not None:
            self._ctl.array("hdr")[H_SHUTDOWN] = 1
            shm.Doorbell(self._ctl.array("bells")[0, :1]).ring()
            grace = 5.0
        rc = _stop_process(self.process, self.names, grace)
        self._finalizer.detach()
        return rc

    def stats(self) -> dict:
        """The daemon's counters (readable after it exited: the handle keeps its mapping)."""
        return _stats(self._ctl.array("hdr"))

    def trace(self) -> list[tuple[str, int, int]]:
        """The served order as (R|S|W|Z, rank, position) if started with ``trace > 0``."""
        return _trace(self._ctl)

    def __enter__(self) -> "DaemonHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_process(process: subprocess.Popen, names: list[str], timeout: float) -> int | None:
    try:
        for sig_wait in ((None, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if sig_wait[0] is not None and process.poll() is None:
                process.send_signal(sig_wait[0])
            try:
                process.wait(sig_wait[1])
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        for n in names:
            shm.shm_unlink(n)
    return process.poll()


def start_daemon(group: int, num_trainers: int | None = None, *, num_nodes: int, mem_dim: int, mail_dim: int,
                 mailbox_size: int = 1, i: int | None = None, j: int = 1, trainer_pids: list[int] | None = None,
                 max_ids: int | None = None, max_write: int | None = None, run_id: str | None = None,
                 timeout: float = 120.0, idle_timeout: float = 0.0, num_threads: int = 1, spin_us: float = 100.0,
                 trace: int = 0, start_timeout: float = 120.0, first_rank: int = 0) -> DaemonHandle:
    """Start the memory daemon of ``group`` (``python -m tgdist.memory.daemon``) and wait until its
    segments are ready. Call it from the group's local rank 0; the other ranks attach with
    ``DaemonMemory(run_id, group, rank)`` (``run_id`` must reach them, e.g. by a broadcast).
    ``first_rank``: the global rank of the group's trainer 0, so that messages name trainers by
    their global ranks.

    ``num_trainers = i * j`` (or give ``trainer_pids``); ``i`` defaults to ``num_trainers // j``.
    """
    if trainer_pids:
        num_trainers = len(trainer_pids)
    if num_trainers is None:
        num_trainers = (i or 1) * j
    if i is None:
        i = num_trainers // j
    if i * j != num_trainers:
        raise ConfigError(f"memory daemon: {num_trainers} trainers is not i * j = {i} * {j}")
    spec = DaemonSpec(run_id=run_id or new_run_id(), group=group, i=i, j=j, num_nodes=num_nodes, mem_dim=mem_dim,
                      mail_dim=mail_dim, mailbox_size=mailbox_size, max_ids=max_ids or 0, max_write=max_write or 0,
                      timeout=timeout, idle_timeout=idle_timeout, num_threads=num_threads, spin_us=spin_us, trace=trace,
                      owner_pid=os.getpid(), owner_start=shm.start_time(os.getpid()),
                      trainer_pids=list(trainer_pids or []), first_rank=first_rank)
    stale = sweep_stale()  # a run whose daemon and trainers were all SIGKILLed could not remove its own
    if stale:
        log.warning("removed %d shared-memory segment%s of an earlier run whose processes are all dead: %s", len(stale),
                    "s" * (len(stale) > 1), ", ".join(stale[:4]) + (", ..." if len(stale) > 4 else ""))
    names = segment_names(spec.run_id, group, spec.num_trainers)
    taken = [n for n in names if os.path.exists(os.path.join(shm.SHM_DIR, n))]
    if taken:
        raise ConfigError(f"memory daemon: segment {shm.SHM_DIR}/{taken[0]} exists (run id {spec.run_id!r} in use)")
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(max(1, num_threads))
    proc = subprocess.Popen([sys.executable, "-m", "tgdist.memory.daemon", "--spec", json.dumps(asdict(spec))],
                            stdin=subprocess.DEVNULL, env=env)
    handle = DaemonHandle(spec, proc)
    deadline = time.monotonic() + start_timeout
    while True:
        if proc.poll() is not None:
            handle.stop(0)
            raise RunFailure(f"memory daemon of group {group} exited with code {proc.returncode} while starting "
                              f"(its message is above)")
        try:
            seg = shm.Segment.attach(names[0], ctl_layout(spec.num_trainers, spec.trace))
            if seg.array("hdr")[H_READY] == 1:
                handle._ctl = seg
                return handle
            seg.close()
        except (FileNotFoundError, ValueError):
            pass
        if time.monotonic() > deadline:
            handle.stop(0)
            raise RunFailure(f"memory daemon of group {group} (pid {proc.pid}) was not ready within "
                              f"{start_timeout:g} s")
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------------
# The trainer side


class _Conn:
    """A trainer's mapping of its group's segments, and the waiting rules (no MemoryStore logic)."""

    def __init__(self, run_id: str, group: int, rank: int, timeout: float, attach_timeout: float, spin_us: float,
                 handle: DaemonHandle | None):
        self.run_id, self.group, self.rank, self.timeout, self.handle = run_id, group, rank, timeout, handle
        self.spin_s = spin_us * 1e-6
        self.segs: list[shm.Segment] = []
        self.broken = False
        prefix = prefix_of(run_id, group)
        deadline = time.monotonic() + attach_timeout
        while True:
            try:
                seg = shm.Segment.attach(prefix + "ctl")
                hdr = np.frombuffer(seg.mm, dtype=np.int64, count=NUM_H)
                if hdr[H_READY] == 1:
                    del hdr
                    break
                del hdr
                seg.close()
            except (FileNotFoundError, ValueError):
                pass
            if handle is not None and handle.poll() is not None:
                raise RunFailure(f"memory daemon of group {group} exited with code {handle.poll()} before trainer "
                                  f"rank {handle.spec.first_rank + rank} attached")
            if time.monotonic() > deadline:
                raise RunFailure(f"no memory daemon for run {run_id} group {group} appeared within "
                                  f"{attach_timeout:g} s ({shm.SHM_DIR}/{prefix}ctl)")
            time.sleep(0.01)
        h = np.frombuffer(seg.mm, dtype=np.int64, count=NUM_H).copy()
        if h[H_MAGIC] != MAGIC or h[H_VERSION] != VERSION:
            seg.close()
            raise RunFailure(f"{shm.SHM_DIR}/{prefix}ctl is not a tgdist memory daemon segment of this version")
        self.i, self.j = int(h[H_I]), int(h[H_J])
        self.R = self.i * self.j
        if not 0 <= rank < self.R:
            seg.close()
            raise ConfigError(f"trainer rank {rank} outside memory group {group} of {self.R} trainers")
        self.first_rank = int(h[H_FIRST_RANK])
        self.N, self.mem_dim, self.mail_dim, self.S = (int(h[k]) for k in
                                                       (H_NUM_NODES, H_MEM_DIM, H_MAIL_DIM, H_MAILBOX))
        self.max_ids, self.max_write, self.max_mail, self.max_ops = (int(h[k]) for k in
                                                                     (H_MAX_IDS, H_MAX_WRITE, H_MAX_MAIL, H_MAX_OPS))
        self.writes = rank < self.i
        self.names = segment_names(run_id, group, self.R)
        seg.layout = ctl_layout(self.R, int(h[H_TRACE_CAP]))
        self.segs.append(seg)
        try:
            self.state_seg = self._attach(self.names[1], state_layout(self.N, self.mem_dim, self.mail_dim, self.S))
            self.tseg = self._attach(self.names[2 + rank], trainer_layout(
                self.j, self.max_ids, self.mem_dim, self.mail_dim, self.S, self.writes, self.max_write, self.max_mail,
                self.max_ops))
        except BaseException:
            self.close()
            raise
        self.ctl_seg = seg
        self.hdr = seg.array("hdr")
        self.ctl = seg.array("ctl")
        self.row = self.ctl[rank]
        self.msg = seg.array("msg")
        bells = seg.array("bells")
        self.daemon_bell = shm.Doorbell(bells[0, :1])
        self.bell = shm.Doorbell(bells[rank + 1, :1])
        self.dpid, self.dstart = int(h[H_PID]), int(h[H_PID_START])
        if self.row[C_STATE] != 0:
            holder = int(self.row[C_PID])
            self.close(detach=False)  # the row is the other process's: a detach would end its attachment
            raise RunFailure(f"trainer rank {self.first_rank + rank} of memory group {group} is already attached "
                              f"(pid {holder})")
        self.row[C_PID], self.row[C_PID_START] = os.getpid(), shm.start_time(os.getpid())
        self.row[C_STATE] = ATTACHED

    def _attach(self, name: str, layout: shm.Layout) -> shm.Segment:
        seg = shm.Segment.attach(name, layout)
        self.segs.append(seg)
        return seg

    @property
    def tag(self) -> str:
        return f"memory daemon of group {self.group} (pid {self.dpid})"

    def check(self) -> None:
        """Raise if the daemon stopped (its message) or died (and clean up after it)."""
        if self.broken:
            raise RunFailure(f"{self.tag} is gone")
        if self.hdr[H_FATAL]:
            self.broken = True
            unlink_group(self.run_id, self.group, self.R)
            raise RunFailure(f"{self.tag} stopped: {_get_msg(self.msg)}")
        if self.hdr[H_STOPPED] or self.hdr[H_SHUTDOWN]:
            self.broken = True
            raise RunFailure(f"{self.tag} has shut down")

    def check_alive(self) -> None:
        if not shm.alive(self.dpid, self.dstart):
            self.check()  # it may have left a message before exiting
            self.broken = True
            unlink_group(self.run_id, self.group, self.R)
            how = ""
            if self.handle is not None and self.handle.poll() is not None:
                rc = self.handle.poll()
                how = f" (killed by {signal.Signals(-rc).name})" if rc < 0 else f" (exit code {rc})"
            raise RunFailure(f"{self.tag} died{how}")

    def wait(self, cond, what: str, timeout: float | None = None) -> None:
        """Wait until ``cond()``: spin, then doorbell sleeps; liveness every 50 ms; time out."""
        if cond():
            return
        timeout = self.timeout if timeout is None else timeout
        backoff = shm.Backoff(self.bell, self.spin_s)
        t0 = time.monotonic()
        next_check = t0 + 0.05
        while True:
            seen = self.bell.value()
            if cond():
                return
            self.check()
            now = time.monotonic()
            if now >= next_check:
                self.check_alive()
                if now - t0 > timeout:
                    raise RunFailure(f"{self.tag} did not answer {what} within {timeout:g} s ({self.daemon_waits()})")
                next_check = now + 0.05
            backoff.pause(seen)

    def daemon_waits(self) -> str:
        r, what = int(self.hdr[H_WAIT_RANK]), int(self.hdr[H_WAIT_WHAT])
        if what not in _WHAT or r < 0:
            return "it is busy"
        pid = int(self.ctl[r, C_PID])
        return (f"it is waiting for trainer rank {self.first_rank + r}{f' (pid {pid})' if pid else ''} to post its "
                f"{_WHAT[what]} for position {int(self.hdr[H_POSITION])}")

    def command(self, kind: int, what: str, timeout: float | None = None) -> int:
        row = self.row
        seq = int(row[C_CMD_REQ]) + 1
        row[C_CMD_KIND] = kind
        row[C_CMD_REQ] = seq
        self.daemon_bell.ring()
        self.wait(lambda: row[C_CMD_DONE] == seq, what, timeout)
        return int(row[C_CMD_STATUS])

    def close(self, detach: bool = True) -> None:
        if detach and not self.broken and getattr(self, "row", None) is not None:
            try:
                self.check()
                self.command(DETACH, "a detach", timeout=min(self.timeout, 10.0))
            except TgdistError:
                pass
        self.row = self.hdr = self.ctl = self.msg = None
        self.daemon_bell = self.bell = None
        for seg in self.segs:
            seg.close()
        self.segs = []


class DaemonMemory(MemoryStore):
    """A trainer's client of its group's memory daemon, with ``LocalMemory``'s behaviour.

    Explicit use (distributed runtime): ``begin(position, slot, reset)``, at most one ``read(ids)``
    (posted and waited for), any number of ``write_memory`` / ``write_mail`` calls (buffered), then
    ``end()`` posts the writes as one request and returns at once (the daemon applies them while
    the trainer goes on). A step without a read posts a skip. Only subgroup 0 (``rank < i``) writes.

    Implicit use (drop-in for ``LocalMemory``, e.g. ``Trainer`` 1x1x1): every ``read`` opens the
    next position and closes the previous one; ``reset_state()`` marks the next position for a
    reset; ``state_dict()`` / ``load_state_dict()`` close the open position first.

    ``read`` returns views of read slot ``slot`` (``copy_reads=False``): valid until this trainer's
    read of position ``p + j`` (the next read when ``j = 1``).
    """

    Config = DaemonMemoryConfig  # memory.max_ids, memory.timeout, memory.num_threads

    @classmethod
    def check_config(cls, memory) -> None:
        if not 0 < memory.timeout < float("inf"):
            raise ConfigError(f"memory.timeout={memory.timeout}: give a positive, finite number of seconds")
        if memory.max_ids is not None and memory.max_ids < 1:
            raise ConfigError(f"memory.max_ids={memory.max_ids}: give a positive row count, or null")
        if memory.num_threads < 1:
            raise ConfigError(f"memory.num_threads={memory.num_threads}: must be at least 1")

    def __init__(self, run_id: str, group: int, rank: int, *, timeout: float = 120.0,
                 attach_timeout: float | None = None, device: str | torch.device | None = None,
                 copy_reads: bool = False, spin_us: float = 100.0, handle: DaemonHandle | None = None):
        super().__init__()
        self._conn = _Conn(run_id, group, rank, timeout, timeout if attach_timeout is None else attach_timeout,
                           spin_us, handle)
        c = self._conn
        self.rank, self.group = rank, group
        self.num_nodes, self.mem_dim, self.mail_dim, self.mailbox_size = c.N, c.mem_dim, c.mail_dim, c.S
        self.i, self.j, self.ii, self.jj = c.i, c.j, rank % c.i, rank // c.i
        self.device = torch.device(device) if device is not None else None
        self.copy_reads = copy_reads
        self.owned_daemon: DaemonHandle | None = None  # the daemon this client started: stopped by close()
        tb = {f.name: c.tseg.tensor(f.name) for f in c.tseg.layout.fields}
        self._rd_ids, self._rd = tb["rd_ids"], (tb["rd_mem"], tb["rd_mem_ts"], tb["rd_mail"], tb["rd_mail_ts"])
        self._wr = tb if c.writes else None
        self._ops = c.tseg.array("wr_ops") if c.writes else None
        self._state = {k: c.state_seg.tensor(k) for k in STATE_KEYS}
        self._p: int | None = None  # position of the open step
        self._explicit = False
        self._slot = 0
        self._step_reset = False
        self._read_posted = False
        self._nops = self._mem_off = self._mail_off = 0
        self._wrote = False
        self._next_auto = 0
        self._after_auto = False  # the last step was implicit (see begin)
        self._shift = 0  # daemon position - caller's position (see begin)
        self._pending_reset = False
        self._finished = False
        self._finalizer = weakref.finalize(self, _Conn.close, c)

    # -- steps -------------------------------------------------------------------------------

    @property
    def writes(self) -> bool:
        """Only epoch-parallel subgroup 0 writes memory (DistTGL 3.2.2)."""
        return self._conn.writes

    def begin(self, position: int, slot: int | None = None, reset: bool = False) -> None:
        """Open ``position``; its read goes to ``slot`` (default ``position % j``)."""
        if self._p is not None:
            if self._explicit:
                raise RunFailure(f"begin({position}) while position {self._p - self._shift} is open: call end() first")
            self.end()
        self._explicit = True
        # Implicit steps between explicit ones (one trainer's evaluation between its epochs) take
        # daemon positions of their own: the caller's later positions move past them.
        if self._after_auto and position + self._shift < self._next_auto:
            self._shift = self._next_auto - position
        self._after_auto = False
        self._open(position + self._shift, slot, reset)

    def _open(self, position: int, slot: int | None, reset: bool) -> None:
        if self._finished:
            raise RunFailure(f"trainer rank {self._conn.first_rank + self.rank} called finish(): it takes no part in "
                             f"positions any more")
        slot = position % self.j if slot is None else slot
        if not 0 <= slot < self.j:
            raise ConfigError(f"read slot {slot} outside the {self.j} slots of memory group {self.group}")
        self._p, self._slot = int(position), int(slot)
        self._step_reset = bool(reset) or self._pending_reset
        self._pending_reset = False
        self._read_posted = self._wrote = False
        self._nops = self._mem_off = self._mail_off = 0

    def _open_auto(self) -> None:
        if self._p is not None:
            self.end()
        self._explicit = False
        self._after_auto = True
        self._open(self._next_auto, None, False)

    def end(self) -> None:
        """Post the step's skip (if it did not read) and its writes; returns without waiting."""
        if self._p is None:
            return
        c, row, p = self._conn, self._conn.row, self._p
        c.check()
        if not self._read_posted:
            self._wait_request_served()
            row[C_RD_KIND], row[C_RD_RESET], row[C_RD_LEN] = SKIP, int(self._step_reset), 0
            row[C_RD_REQ] = p + 1
        if c.writes:
            if not self._wrote:
                self._wait_write_free()
            row[C_WR_OPS] = self._nops
            row[C_WR_REQ] = p + 1
        c.daemon_bell.ring()
        self._p = None
        self._next_auto = p + 1

    flush = end  # "this iteration's writes are complete", as DepCacheMemory.flush

    one_copy_per_group = True
    state_dict_copies = True  # (``state_dict`` clones the shared memory under a hold)
    placement = "host_shared"
    staged_reads = False  # the daemon serves its group's reads and writes strictly in stream order
    evaluates_untrained = False  # its stream is the training schedule's
    # its read + write over in-process memory's, measured (benchmarks/results/memory_daemon.md: 1.82-2.03)
    served_factor = 1.9

    @classmethod
    def price_memory(cls, read_s, write_s, group_write_s, group):
        """Reads and writes through the daemon's buffers; the daemon serves its group's in turn."""
        return cls.served_factor * read_s, cls.served_factor * write_s, group * (read_s + write_s)

    @classmethod
    def bytes_per_rank(cls, copy_bytes, group, imbalance):
        return 0.0  # the copy is the daemon's, in host shared memory

    def open_position(self, position: int, slot: int, reset: bool) -> None:
        self.begin(position, slot=slot, reset=reset)

    def close_position(self) -> None:
        self.end()

    def end_training(self, evaluates: bool) -> None:
        if not evaluates:  # the group's memory stays with the trainer that evaluates on it
            self.finish()

    def finish(self) -> None:
        """Leave the stream: later positions no longer wait for this trainer (e.g. the other ranks
        of a group while rank 0 evaluates alone). What it posted is still served; it stays
        attached (``state_dict`` works) until ``close()``."""
        self._quiesce("finish()")
        self._conn.check()
        self._conn.command(FINISH, "a finish")
        self._finished = True

    def skip(self, position: int, reset: bool = False) -> None:
        """Post that this trainer does nothing at ``position`` (subgroup 0 also posts an empty write)."""
        self.begin(position, reset=reset)
        self.end()

    def _wait_request_served(self) -> None:
        row = self._conn.row
        self._conn.wait(lambda: row[C_RD_DONE] == row[C_RD_REQ], f"the previous request before position {self._p}")

    def _wait_write_free(self) -> None:
        row = self._conn.row
        self._conn.wait(lambda: row[C_WR_DONE] == row[C_WR_REQ], f"the write of position {int(row[C_WR_REQ]) - 1}")

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1)
        if ids.dtype != torch.int64:
            ids = ids.to(torch.int64)
        if ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= self.num_nodes:
                raise IndexError(f"node id {lo if lo < 0 else hi} out of range for {self.num_nodes} nodes")
        return ids

    # -- MemoryStore -------------------------------------------------------------------------

    def read(self, ids: torch.Tensor) -> MemoryRead:
        if self._p is None or self._read_posted or self._wrote:
            if self._p is not None and self._explicit:
                done = "read" if self._read_posted else "writes"
                raise RunFailure(f"a read after the {done} of position {self._p - self._shift}: "
                                  f"one read per position, served before its writes (end() then begin())")
            self._open_auto()  # LocalMemory order: a read sees every earlier write
        c, row, p = self._conn, self._conn.row, self._p
        c.check()
        ids = self._check_ids(ids)
        n = ids.numel()
        if n > c.max_ids:
            raise ConfigError(f"read of {n} ids exceeds the daemon buffer of {c.max_ids} ids (set memory.max_ids)")
        self._wait_request_served()
        slot = self._slot
        self._rd_ids[slot, :n].copy_(ids)
        row[C_RD_KIND], row[C_RD_RESET], row[C_RD_LEN], row[C_RD_SLOT] = READ, int(self._step_reset), n, slot
        row[C_RD_REQ] = p + 1  # publish last: the daemon reads the fields above only after this
        c.daemon_bell.ring()
        self._read_posted = True
        c.wait(lambda: row[C_RD_DONE] == p + 1, f"a read for position {p}")
        out = [t[slot, :n] for t in self._rd]
        if self.device is not None and self.device.type != "cpu":
            out = [t.to(self.device) for t in out]
        elif self.copy_reads:
            out = [t.clone() for t in out]
        return MemoryRead(*out, empty=bool(row[C_RD_EMPTY]))

    def _begin_write(self, what: str) -> None:
        if not self.writes:
            raise RunFailure(f"trainer rank {self._conn.first_rank + self.rank} is in epoch-parallel subgroup "
                             f"{self.jj} and may not {what} (DistTGL 3.2.2: only subgroup 0 writes)")
        if self._p is None:
            self._explicit = False
            self._after_auto = True
            self._open(self._next_auto, None, False)
        if not self._wrote:
            self._conn.check()
            self._wait_write_free()  # the daemon has consumed the previous position's writes
            self._wrote = True
        if self._nops >= self._conn.max_ops:
            raise ConfigError(f"more than {self._conn.max_ops} write calls at position {self._p}")

    def write_memory(self, ids: torch.Tensor, mem: torch.Tensor, mem_ts: torch.Tensor) -> None:
        """``ids`` unique ``[n]``; ``mem [n, mem_dim]``; ``mem_ts [n]`` (buffered until ``end()``)."""
        self._begin_write("write memory")
        self._mem_off = self._stage(OP_MEM, "wr_mem", self._mem_off, self._conn.max_write, "memory", ids, mem, mem_ts)

    def write_mail(self, ids: torch.Tensor, mail: torch.Tensor, mail_ts: torch.Tensor) -> None:
        """Append one mail per (unique) id to its ring; several calls are applied in call order."""
        self._begin_write("write mail")
        self._mail_off = self._stage(OP_MAIL, "wr_mail", self._mail_off, self._conn.max_mail, "mail", ids, mail,
                                     mail_ts)

    def _stage(self, op: int, prefix: str, off: int, capacity: int, what: str, ids, rows, ts) -> int:
        """Copy a write into the ``prefix``_ids / ``prefix`` / ``prefix``_ts buffers at row ``off``
        and record it as op ``op``; returns the next free row."""
        ids = self._check_ids(ids)
        n = ids.numel()
        if off + n > capacity:
            raise ConfigError(f"write of {off + n} {what} rows exceeds the daemon buffer of {capacity} "
                              f"rows (set memory.max_write)")
        w = self._wr
        w[prefix + "_ids"][off:off + n].copy_(ids)
        w[prefix][off:off + n].copy_(rows.detach())
        w[prefix + "_ts"][off:off + n].copy_(ts.detach())
        self._ops[self._nops] = (op, off, n)
        self._nops += 1
        return off + n

    def reset_state(self) -> None:
        """Reset before the next position is served (``begin(..., reset=True)`` in explicit use)."""
        if self._p is not None:
            if self._explicit:
                if self._read_posted:
                    raise RunFailure(f"reset_state() after the read of position {self._p}: pass reset=True to begin()")
                self._step_reset = True
                return
            self.end()
        self._pending_reset = True

    def _quiesce(self, what: str) -> None:
        if self._p is not None:
            if self._explicit:
                raise RunFailure(f"{what} while position {self._p - self._shift} is open: call end() first")
            self.end()

    def _hold(self, kind: int, what: str) -> None:
        c = self._conn
        c.check()
        if c.command(kind, what):
            raise RunFailure(_get_msg(c.msg))

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The group's whole memory state (copies), with ``LocalMemory``'s keys."""
        self._quiesce("state_dict()")
        self._hold(HOLD, "a hold for state_dict()")
        try:
            out = OrderedDict((prefix + k, v.clone()) for k, v in self._state.items())
        finally:
            self._conn.command(RELEASE, "a release")
        if self._pending_reset:  # what the state will be when the reset is served
            for k in STATE_KEYS:
                out[prefix + k].fill_(float("-inf") if k == "mail_ts" else 0)
        if destination is not None:
            destination.update(out)
            return destination
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Copy a state (from ``LocalMemory`` or ``DaemonMemory``) into the daemon's memory. In a
        group, call it before the other trainers post their first request (behind a barrier)."""
        from torch.nn.modules.module import _IncompatibleKeys

        missing = [k for k in STATE_KEYS if k not in state_dict]
        unexpected = [k for k in state_dict if k not in STATE_KEYS]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for DaemonMemory: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        for k in STATE_KEYS:
            if k in state_dict and tuple(state_dict[k].shape) != tuple(self._state[k].shape):
                raise RuntimeError(f"size mismatch for {k}: copying a param with shape {tuple(state_dict[k].shape)}, "
                                   f"the shape in current model is {tuple(self._state[k].shape)}")
        self._quiesce("load_state_dict()")
        self._hold(HOLD_LOAD, "a hold for load_state_dict()")
        try:
            for k in STATE_KEYS:
                if k in state_dict:
                    self._state[k].copy_(state_dict[k])
        finally:
            self._conn.command(RELEASE, "a release")
        self._pending_reset = False
        return _IncompatibleKeys(missing, unexpected)

    # Copies of the state under the LocalMemory buffer names (tests and inspection).
    @property
    def mem(self) -> torch.Tensor:
        return self.state_dict()["mem"]

    @property
    def mem_ts(self) -> torch.Tensor:
        return self.state_dict()["mem_ts"]

    @property
    def mail(self) -> torch.Tensor:
        return self.state_dict()["mail"]

    @property
    def mail_ts(self) -> torch.Tensor:
        return self.state_dict()["mail_ts"]

    @property
    def head(self) -> torch.Tensor:
        return self.state_dict()["head"]

    def daemon_stats(self) -> dict:
        """The daemon's counters: requests served, rows, and nanoseconds spent copying / idle."""
        return _stats(self._conn.hdr)

    def trace(self) -> list[tuple[str, int, int]]:
        """The served order as (R|S|W|Z, rank, position), if the daemon was started with ``trace``."""
        return _trace(self._conn.ctl_seg)

    def close(self) -> None:
        """Post the open implicit step, detach from the daemon, unmap; then stop the daemon if this
        client started it (``owned_daemon``: the daemon unlinks its segments on the way out).
        Idempotent."""
        if self._finalizer.alive:
            try:
                if self._p is not None and not self._explicit and not self._conn.broken:
                    self.end()
            except TgdistError:
                pass
            finally:
                self._rd = self._wr = self._state = self._rd_ids = self._ops = None
                self._finalizer()
        if self.owned_daemon is not None:
            daemon, self.owned_daemon = self.owned_daemon, None
            daemon.stop()

    def __enter__(self) -> "DaemonMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tgdist.memory.daemon",
                                 description="tgdist memory daemon (started by the runtime, not by hand)")
    ap.add_argument("--spec", required=True, help="DaemonSpec as JSON")
    a = ap.parse_args(argv)
    return run_daemon(DaemonSpec(**json.loads(a.spec)))


if __name__ == "__main__":
    sys.exit(main())


@register("daemon", DaemonMemory)
def _daemon(ctx: StoreContext) -> DaemonMemory:
    """DistTGL's daemon for this trainer's memory group: the group's first trainer starts it, and
    every trainer of the group attaches (a collective of the group). The starting trainer's client
    owns the daemon and stops it when closed."""
    from tgdist.distributed import collectives

    layout, cfg = ctx.layout, ctx.cfg
    ii, jj, kk = layout.coords(ctx.rank)
    group = ctx.groups.get("memory")
    pids = collectives.all_gather_object(os.getpid(), group, name="daemon_setup")
    handle, run_id = None, None
    if ii == 0 and jj == 0:
        # train.eval=tgb ranks against the data set's own lists, which evaluation scores in column
        # chunks of at most 2**17 roots per pass (Trainer.EVAL_ROOTS): the reads of such a chunk
        num_neg = max(1, cfg.train.num_neg_eval) if cfg.train.eval != "tgb" else max(1, (1 << 17) // ctx.batch_size)
        max_ids = cfg.memory.max_ids or read_bound(ctx.batch_size, num_neg, list(ctx.fanouts), ctx.num_nodes)
        handle = start_daemon(kk, layout.group_size, i=layout.i, j=layout.j, num_nodes=ctx.num_nodes,
                              mem_dim=ctx.mem_dim, mail_dim=ctx.mail_dim, mailbox_size=ctx.mailbox_size,
                              trainer_pids=pids, max_ids=max_ids, timeout=cfg.memory.timeout,
                              num_threads=cfg.memory.num_threads, first_rank=ctx.rank)
        run_id = handle.run_id
    run_id = collectives.broadcast_object(run_id, src=layout.memory_group_ranks(kk)[0], group=group,
                                          name="daemon_setup")
    client = DaemonMemory(run_id, kk, jj * layout.i + ii, handle=handle, timeout=cfg.memory.timeout,
                          device=ctx.device)  # reads come back on the compute device
    client.owned_daemon = handle
    return client
