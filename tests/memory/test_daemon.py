"""DistTGL's memory daemon: equivalence with LocalMemory, the served order, faults and clean-up,
segment names and permissions, state round trips (tgdist/memory/daemon.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tgdist.errors import ConfigError, TgdistError
from tgdist.memory import shm
from tgdist.memory.daemon import ctl_layout, new_run_id, read_bound, segment_names, start_daemon, sweep_stale
from tgdist.memory.store import LocalMemory

REPO = Path(__file__).resolve().parents[2]


def segments(run_id: str) -> list[str]:
    return shm.list_segments(f"tgdist-{run_id}-")


def processes_with(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (a /proc scan, no psutil)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmd and shm.alive(int(d)):
                found.append(int(d))
    return found


def run_threads(*fns):
    """Run scripted trainers as threads (one client each; the daemon is its own process)."""
    errors = []

    def wrap(fn):
        def go():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
        return go

    ts = [threading.Thread(target=wrap(f)) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errors:
        raise errors[0]


def col(v: float, n: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.full((n, 1), float(v), dtype=dtype)


def ts(v: float, n: int = 1) -> torch.Tensor:
    return torch.full((n,), float(v), dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# Pure parts


def test_layouts_are_aligned_and_deterministic():
    lay = ctl_layout(3, 10)
    assert [f.offset % 64 for f in lay.fields] == [0] * len(lay.fields)
    # ctl: 3 trainers x 17 status words x 8 bytes = 408, rounded up to 448
    assert [(f.name, f.offset) for f in lay.fields] == [("hdr", 0), ("ctl", 512), ("bells", 960),
                                                         ("msg", 1216), ("trace", 5312)]
    assert lay.size == 5312 + 10 * 3 * 8 + 16  # 240 bytes of trace rounded up to 256
    assert ctl_layout(3, 10) == lay
    assert segment_names("r1", 2, 2) == ["tgdist-r1-g2-ctl", "tgdist-r1-g2-state", "tgdist-r1-g2-t0", "tgdist-r1-g2-t1"]


def test_read_bound():
    # 10 events, 1 negative: 30 roots; hop 1 of fanout 10: 300 more; hop 2 of fanout 5: 1500 more.
    assert read_bound(10, 1, [10], 10_000) == 330
    assert read_bound(10, 1, [10, 5], 10_000) == 1830
    assert read_bound(10, 1, [10, 5], 1000) == 1000


def test_alive_sees_zombies_and_recycled_pids():
    assert shm.alive(os.getpid()) and shm.alive(os.getpid(), shm.start_time(os.getpid()))
    assert not shm.alive(os.getpid(), shm.start_time(os.getpid()) + 1)  # same pid, another process
    p = subprocess.Popen(["sleep", "30"])
    assert shm.alive(p.pid)
    p.kill()
    deadline = time.monotonic() + 5
    while shm.alive(p.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not shm.alive(p.pid)  # not reaped yet: a zombie, which os.kill(pid, 0) calls alive
    assert p.poll() is not None and not shm.alive(p.pid)


# ------------------------------------------------------------------------------------------------
# Equivalence with LocalMemory (1 x 1 x 1, the Trainer unchanged)

SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=100",
         "train.num_neg_eval=9", "train.progress=false", "train.num_threads=1", "sampler.num_threads=1",
         "train.epochs=2", "train.deterministic=true"]


@pytest.mark.distributed
@pytest.mark.parametrize("model,gpu_path", [("tgn", False), ("apan", False), ("tgn", True)])
def test_trainer_through_the_daemon_is_bit_identical(tmp_path, model, gpu_path):
    """The run through the daemon is LocalMemory's, bit for bit; ``gpu_path``: both with the
    updaters as a GPU runs them (plain formulation, no reads of device values), which go by
    whether each read says its mailboxes are unwritten since their reset (``MemoryRead.empty``):
    the daemon's reads say it as LocalMemory's do, or the first batch of each epoch would give
    the updater zero gradients here and none there."""
    from tgdist.models.modules import use_sync_free
    from tgdist.runtime.build import build_trainer, compose
    from tgdist.runtime.run import Run

    over = SMALL + [f"model={model}"] + (["model.mailbox_size=3"] if model == "apan" else []) + \
        (["model.cpu_kernels=false"] if gpu_path else [])
    cfg = compose(over)
    local = build_trainer(cfg)
    use_sync_free(local.model, gpu_path)
    a = Run(cfg, tmp_path / "local", local).train()
    state_a = local.memory.state_dict()

    cfg = compose(over)
    tr = build_trainer(cfg)
    use_sync_free(tr.model, gpu_path)
    m = tr.model
    with start_daemon(0, 1, num_nodes=tr.g.num_nodes, mem_dim=m.mem_dim, mail_dim=m.mail_dim,
                      mailbox_size=m.mailbox_size) as handle:
        tr.memory = handle.attach(0)
        b = Run(cfg, tmp_path / "daemon", tr).train()  # also checkpoints through state_dict()
        state_b = tr.memory.state_dict()
        stats = tr.memory.daemon_stats()
        tr.memory.close()
    keys = [k for k in a if k.startswith(("val_", "test_", "loss"))]
    assert len(keys) >= 7
    assert {k: b[k] for k in keys} == {k: a[k] for k in keys}
    assert list(state_b) == list(state_a)
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), k
    assert state_a["mem"].abs().sum() > 0 and torch.isfinite(state_a["mail_ts"]).any()
    # 2 epochs x (11 train + 3 val batches) + 3 test batches once at the end = 31 positions, one reset
    # per epoch
    assert (stats["reads"], stats["writes"], stats["resets"]) == (31, 31, 2)
    assert segments(handle.run_id) == []


# ------------------------------------------------------------------------------------------------
# The served order


def brackets(trace):
    """Group a trace into per-position lists: [(set of reads), writes in order]."""
    out = {}
    for kind, r, p in trace:
        out.setdefault(p, []).append((kind, r))
    return out


@pytest.mark.distributed
def test_two_trainers_read_before_any_write_of_the_position():
    """i = 2: rank 1 posts its read of p late (after rank 0 posted its write of p) and still sees
    the memory before the writes of p; rank 0's read of p + 1 waits for rank 1's late write of p."""
    with start_daemon(0, 2, num_nodes=4, mem_dim=1, mail_dim=1, trace=100) as h:
        seen = {0: [], 1: []}
        ids = torch.tensor([0, 1, 2])

        def trainer(rank, late):
            m = h.attach(rank, timeout=20)
            for p in range(4):
                if late:
                    time.sleep(0.15)
                m.begin(p)
                seen[rank].append(m.read(ids).mem[:, 0].tolist())
                if late:
                    time.sleep(0.15)
                # both write node 2 at position 3: rank 1 (higher ii) wins whatever the timing
                node, val = (2, 100 + rank) if p == 3 else (rank, 10 * (p + 1) + rank)
                m.write_memory(torch.tensor([node]), col(val), ts(p))
                m.end()
            m.begin(4)
            seen[rank].append(m.read(ids).mem[:, 0].tolist())
            m.end()
            m.close()

        run_threads(lambda: trainer(0, False), lambda: trainer(1, True))
        expect = [[0, 0, 0], [10, 11, 0], [20, 21, 0], [30, 31, 0], [30, 31, 101]]
        assert seen[0] == expect and seen[1] == expect
        tr = brackets(h.trace())
        for p in range(5):  # (position 4 has empty writes: end() of subgroup 0 always posts one)
            assert set(tr[p][:2]) == {("R", 0), ("R", 1)} and tr[p][2:] == [("W", 0), ("W", 1)], tr[p]


@pytest.mark.distributed
def test_epoch_parallel_subgroup_reads_ahead_into_slots():
    """j = 2: subgroup 1 reads position p (posted late, after subgroup 0 posted its write of p)
    and sees the memory before that write; its result for p stays intact in slot p % 2 while it
    reads p + 1 into the other slot (it trains p at iteration p + 1)."""
    with start_daemon(0, 2, i=1, j=2, num_nodes=3, mem_dim=1, mail_dim=1, trace=100) as h:
        got = []

        def sub0():
            m = h.attach(0, timeout=20)
            for p in range(5):
                m.begin(p, reset=p == 0)
                m.read(torch.tensor([0]))
                m.write_memory(torch.tensor([0]), col(p + 1), ts(p))
                m.end()
            m.close()

        def sub1():
            m = h.attach(1, timeout=20)
            prev = None
            for p in range(5):
                time.sleep(0.1)
                m.begin(p, reset=p == 0)  # slot p % 2
                cur = m.read(torch.tensor([0]))
                m.end()
                if prev is not None:  # "train" position p - 1 now, from its slot
                    got.append((p - 1, prev.mem.item(), cur.mem.item()))
                prev = cur
            with pytest.raises(TgdistError, match="subgroup 1 and may not write memory"):
                m.write_memory(torch.tensor([0]), col(9), ts(9))
            m.close()

        run_threads(sub0, sub1)
        assert got == [(0, 0.0, 1.0), (1, 1.0, 2.0), (2, 2.0, 3.0), (3, 3.0, 4.0)]
        tr = brackets(h.trace())
        assert tr[0][0] == ("Z", 0) or tr[0][0] == ("Z", 1)
        for p in range(5):
            reads = [x for x in tr[p] if x[0] == "R"]
            assert set(reads) == {("R", 0), ("R", 1)} and tr[p][-1] == ("W", 0), tr[p]


@pytest.mark.distributed
def test_2x2_group_order_reset_and_skips():
    """i = j = 2: per position all four reads (or skips), then W0, W1; a reset at position 2."""
    with start_daemon(0, 4, i=2, j=2, num_nodes=4, mem_dim=1, mail_dim=1, trace=200) as h:
        seen = {r: [] for r in range(4)}

        def trainer(rank):
            m = h.attach(rank, timeout=20)
            for p in range(4):
                time.sleep(0.02 * rank)
                m.begin(p, reset=p == 2)
                if rank == 3 and p == 1:
                    m.end()  # inactive here: a skip
                    continue
                seen[rank].append(m.read(torch.tensor([0, 1])).mem[:, 0].tolist())
                if rank < 2:
                    m.write_memory(torch.tensor([rank]), col(p + 1 + 10 * rank), ts(p))
                m.end()
            m.close()

        run_threads(*(lambda r=r: trainer(r) for r in range(4)))
        for r in range(4):
            exp = [[0, 0], [1, 11], [0, 0], [3, 13]]  # position 2 reads after the reset
            if r == 3:
                exp = exp[:1] + exp[2:]
            assert seen[r] == exp, (r, seen[r])
        tr = brackets(h.trace())
        for p in range(4):
            head = [x for x in tr[p] if x[0] != "W"]
            assert tr[p][len(head):] == [("W", 0), ("W", 1)], tr[p]
            assert {x for x in head if x[0] in "RS"} == {("R", 0), ("R", 1), ("R", 2), ("S" if p == 1 else "R", 3)}
        assert [x for x in tr[2] if x[0] == "Z"] and tr[2][0][0] == "Z"
        assert all(x[0] != "Z" for p in (0, 1, 3) for x in tr[p])


@pytest.mark.distributed
def test_implicit_positions_apan_rounds_and_ring():
    """Without begin/end every read opens the next position; several write_mail calls of one
    position are applied in call order (APAN delivery rounds) on the ring, like LocalMemory. A
    read says, as LocalMemory's does, whether the mailboxes are unwritten since their reset
    (``MemoryRead.empty``, which lets an updater on a GPU skip its reads of device values): at
    the start, after a position that wrote memory only, and after a reset."""
    with start_daemon(0, 1, num_nodes=5, mem_dim=2, mail_dim=1, mailbox_size=2) as h:
        m, ref = h.attach(0, timeout=20), LocalMemory(5, 2, 1, 2)
        empties = []
        for step in range(4):
            ids = torch.tensor([0, 1, 2, 3])
            a, b = m.read(ids), ref.read(ids)
            assert all(torch.equal(x, y) for x, y in zip((a.mem, a.mem_ts, a.mail, a.mail_ts),
                                                        (b.mem, b.mem_ts, b.mail, b.mail_ts)))
            assert a.empty == b.empty
            empties.append(a.empty)
            for s in (m, ref):
                s.write_memory(torch.tensor([step]), torch.full((1, 2), float(step + 1)), ts(step))
                if step > 0:  # (the first position writes memory only)
                    s.write_mail(torch.tensor([0, 1]), col(10 * step + 1, 2), ts(step, 2))
                    s.write_mail(torch.tensor([0]), col(10 * step + 2), ts(step + 0.5))
        assert empties == [True, True, False, False]
        assert m.mail[0, :, 0].tolist() == [31.0, 32.0] == ref.mail[0, :, 0].tolist()
        assert m.head.tolist() == ref.head.tolist() == [0, 1, 0, 0, 0]
        m.reset_state()
        assert torch.equal(m.mem, torch.zeros(5, 2)) and m.mail_ts.isinf().all()
        after = m.read(torch.tensor([0]))
        assert after.mem.tolist() == [[0.0, 0.0]] and after.empty is True
        assert m.daemon_stats()["resets"] == 1
        m.close()


@pytest.mark.distributed
def test_group_in_implicit_mode_with_flush_checkpoint_and_finish():
    """The parallel loop's use: implicit positions, ``flush()`` after each iteration's writes, a
    checkpoint (state_dict by the writer while the other rank waits at a barrier), then the other
    rank leaves with ``finish()`` and rank 0 goes on alone (evaluation)."""
    with start_daemon(0, 2, num_nodes=3, mem_dim=1, mail_dim=1, trace=100) as h:
        b1, b2, b3 = threading.Barrier(2), threading.Barrier(2), threading.Barrier(2)
        snaps, evals = [], []

        def rank0():
            m = h.attach(0, timeout=20)
            for p in range(3):
                m.read(torch.tensor([0, 1]))
                m.write_memory(torch.tensor([0]), col(p + 1), ts(p))
                m.flush()
                b1.wait()
                snaps.append(m.state_dict()["mem"][:2, 0].tolist())  # needs rank 1's flushed write
                b2.wait()
            b3.wait()  # rank 1 finished
            for p in range(3, 5):
                evals.append(m.read(torch.tensor([0, 1])).mem[:, 0].tolist())
                m.write_memory(torch.tensor([0]), col(p + 1), ts(p))
            m.finish()  # every trainer finished: the daemon must idle, not run through positions
            time.sleep(0.3)
            m.close()

        def rank1():
            m = h.attach(1, timeout=20)
            for p in range(3):
                m.read(torch.tensor([0, 1]))
                m.write_memory(torch.tensor([1]), col(11 + p), ts(p))
                m.flush()
                b1.wait()
                b2.wait()
            m.finish()
            with pytest.raises(TgdistError, match="called finish"):
                m.read(torch.tensor([0]))
            b3.wait()
            m.close()

        run_threads(rank0, rank1)
        assert snaps == [[1, 11], [2, 12], [3, 13]]
        assert evals == [[3, 13], [4, 13]]
        assert [x for x in h.trace() if x[2] >= 3] == [("R", 0, 3), ("W", 0, 3), ("R", 0, 4), ("W", 0, 4)]
        assert h.stats()["position"] == 5


# ------------------------------------------------------------------------------------------------
# State, errors, names


@pytest.mark.distributed
def test_state_dict_round_trip():
    ref = LocalMemory(6, 3, 2, 2)
    g = torch.Generator().manual_seed(0)
    for k, v in ref.state_dict().items():
        v.copy_(torch.randint(0, 50, v.shape, generator=g).to(v.dtype))
    with start_daemon(0, 2, num_nodes=6, mem_dim=3, mail_dim=2, mailbox_size=2) as h:
        m0 = h.attach(0, timeout=20)
        m0.load_state_dict(ref.state_dict())
        got = m0.state_dict()
        assert list(got) == ["mem", "mem_ts", "mail", "mail_ts", "head"]
        assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
        m1 = h.attach(1, timeout=20)
        m1.begin(0)
        r = m1.read(torch.tensor([4, 1]))  # served at once: reads do not wait for each other
        assert torch.equal(r.mem, ref.mem[[4, 1]]) and torch.equal(r.mail_ts, ref.mail_ts[[4, 1]])
        # the load was another process's write of the segment: its mails are known to be there
        assert r.empty is False and ref.read(torch.tensor([4, 1])).empty is False
        m1.end()
        with pytest.raises(TgdistError, match=r"trainer rank\(s\) 1 already read"):
            m0.load_state_dict(ref.state_dict())
        with pytest.raises(RuntimeError, match="missing keys"):
            m0.load_state_dict({"mem": ref.mem})
        with pytest.raises(RuntimeError, match="size mismatch for mem"):
            m0.load_state_dict({**ref.state_dict(), "mem": torch.zeros(6, 4)})
        # state_dict of rank 0 between positions sees rank 1's read-only position 0 unchanged
        m0.begin(0)
        m0.read(torch.tensor([0]))
        m0.write_memory(torch.tensor([5]), torch.ones(1, 3), ts(7))
        m0.end()
        m1.skip(1)
        after = m0.state_dict()
        assert after["mem"][5].tolist() == [1.0, 1.0, 1.0] and after["mem_ts"][5].item() == 7.0
        assert torch.equal(after["mem"][:5], ref.mem[:5])
        m0.close()
        m1.close()


@pytest.mark.distributed
def test_client_errors_are_clear():
    with start_daemon(0, 1, num_nodes=10, mem_dim=2, mail_dim=2, max_ids=4, max_write=2) as h:
        m = h.attach(0, timeout=20)
        with pytest.raises(ConfigError,
                           match=r"read of 5 ids exceeds the daemon buffer of 4 ids \(set memory.max_ids\)"):
            m.read(torch.arange(5))
        with pytest.raises(IndexError, match="node id 10 out of range for 10 nodes"):
            m.read(torch.tensor([1, 10]))
        m.begin(0)
        m.read(torch.tensor([1]))
        with pytest.raises(TgdistError, match="a read after the read of position 0"):
            m.read(torch.tensor([1]))
        with pytest.raises(ConfigError, match="write of 3 memory rows exceeds the daemon buffer of 2 rows"):
            m.write_memory(torch.arange(3), torch.zeros(3, 2), ts(0, 3))
        with pytest.raises(TgdistError, match="begin\\(1\\) while position 0 is open"):
            m.begin(1)
        m.end()
        m.close()


@pytest.mark.distributed
@pytest.mark.parametrize("violation", ["position", "reset"])
def test_protocol_violation_stops_the_group_with_a_message(violation):
    with start_daemon(0, 2, num_nodes=4, mem_dim=1, mail_dim=1) as h:
        m0, m1 = h.attach(0, timeout=20), h.attach(1, timeout=20)
        m0.begin(0, reset=True)
        m0.read(torch.tensor([0]))
        if violation == "position":
            m1.begin(5, reset=True)  # skipped positions 0..4 without posting skips
            msg = r"trainer rank 1 \(pid \d+\) posted a request for position 5 while group 0 serves position 0"
        else:
            m1.begin(0)
            msg = (r"trainer rank 1 \(pid \d+\) did not ask for a memory reset at position 0 and trainer rank 0 "
                   r"\(pid \d+\) did")
        with pytest.raises(TgdistError, match=rf"memory daemon of group 0 \(pid {h.pid}\) stopped: {msg}"):
            m1.read(torch.tensor([0]))
        with pytest.raises(TgdistError, match="stopped: trainer rank 1") as stopped:
            m0.end()
        assert stopped.value.exit_code == 1  # a failed process of the run, not bad input (2)
        assert h.process.wait(10) == 1
        assert segments(h.run_id) == []


@pytest.mark.distributed
def test_timeout_names_the_trainer_the_daemon_waits_for():
    with start_daemon(0, 2, num_nodes=4, mem_dim=1, mail_dim=1) as h:
        m0, m1 = h.attach(0, timeout=0.5), h.attach(1, timeout=20)
        m0.begin(0)
        m0.read(torch.tensor([0]))
        m0.write_memory(torch.tensor([0]), col(1), ts(0))
        m0.end()
        m0.begin(1)
        t0 = time.monotonic()
        with pytest.raises(TgdistError, match=rf"memory daemon of group 0 \(pid {h.pid}\) did not answer a read for "
                                              rf"position 1 within 0.5 s \(it is waiting for trainer rank 1 "
                                              rf"\(pid {os.getpid()}\) to post its read or skip for position 0\)"):
            m0.read(torch.tensor([0]))
        assert time.monotonic() - t0 < 5
        m0.close()
        m1.close()


@pytest.mark.distributed
def test_messages_name_trainers_by_their_global_ranks():
    """Memory group 1 of a 2 x 1 x 2 layout holds ranks 2 and 3 (``first_rank=2``): every message
    about its trainers names those ranks, the numbers the launcher and the user know."""
    with start_daemon(1, 2, num_nodes=4, mem_dim=1, mail_dim=1, first_rank=2) as h:
        m0, m1 = h.attach(0, timeout=0.5), h.attach(1, timeout=20)
        with pytest.raises(TgdistError, match=rf"trainer rank 3 of memory group 1 is already attached \(pid "
                                              rf"{os.getpid()}\)"):
            h.attach(1, timeout=20)
        m1.begin(0, reset=True)
        m1.read(torch.tensor([0]))
        with pytest.raises(TgdistError, match=r"load_state_dict at position 0: trainer rank\(s\) 3 already read"):
            m0.load_state_dict(m0.state_dict())
        m1.end()
        m0.begin(0, reset=True)
        m0.read(torch.tensor([0]))
        m0.end()
        m0.skip(1)
        m0.begin(2)
        with pytest.raises(TgdistError, match=rf"it is waiting for trainer rank 3 \(pid {os.getpid()}\) to post its "
                                              rf"read or skip for position 1\)"):
            m0.read(torch.tensor([0]))
        m1.begin(5)
        with pytest.raises(TgdistError, match=rf"memory daemon of group 1 \(pid {h.pid}\) stopped: trainer rank 3 "
                                              rf"\(pid {os.getpid()}\) posted a request for position 5 while group 1 "
                                              rf"serves position 1"):
            m1.read(torch.tensor([0]))
        m0.close()
        m1.close()
    assert segments(h.run_id) == []


@pytest.mark.distributed
def test_segments_are_private_and_unique_per_run():
    with start_daemon(0, 1, num_nodes=4, mem_dim=1, mail_dim=1) as a, \
            start_daemon(0, 1, num_nodes=4, mem_dim=1, mail_dim=1) as b:
        assert a.run_id != b.run_id
        na, nb = segments(a.run_id), segments(b.run_id)
        assert len(na) == len(nb) == 3 and not set(na) & set(nb)
        for n in na + nb:
            assert stat.S_IMODE(os.stat(f"/dev/shm/{n}").st_mode) == 0o600
            assert os.stat(f"/dev/shm/{n}").st_uid == os.getuid()
        with pytest.raises(ConfigError, match=f"run id '{a.run_id}' in use"):
            start_daemon(0, 1, num_nodes=4, mem_dim=1, mail_dim=1, run_id=a.run_id)
        ma, mb = a.attach(0, timeout=20), b.attach(0, timeout=20)
        ma.write_memory(torch.tensor([1]), col(5), ts(1))
        mb.write_memory(torch.tensor([1]), col(7), ts(1))
        assert ma.mem[1].item() == 5.0 and mb.mem[1].item() == 7.0  # no collision
        ma.close()
        mb.close()
    assert segments(a.run_id) == [] and segments(b.run_id) == []
    assert processes_with(a.run_id) == [] and processes_with(b.run_id) == []


def test_sweep_removes_only_dead_families():
    """A family is kept while its daemon, an attached trainer or the rank that started the daemon
    (its pid opens the run id) is alive: a daemon still starting has made its segments but not
    yet written its pid, and another run's sweep removed them then (the daemon's start timed out)."""
    from tgdist.memory import daemon as d

    for starter in (os.getpid(), 2 ** 22 + 12346):  # this process, then no such process
        run_id = f"{starter}-{new_run_id().split('-')[1]}"
        names = segment_names(run_id, 0, 1)
        seg = shm.Segment.create(names[0], ctl_layout(1, 0))
        other = shm.Segment.create(names[1], shm.Layout.of([("x", np.int64, (1,))]))
        hdr = seg.array("hdr")
        hdr[d.H_I] = hdr[d.H_J] = 1
        assert sweep_stale(f"tgdist-{run_id}") == ([] if starter == os.getpid() else sorted(names[:2]))
        if starter == os.getpid():  # its daemon starting (pid 0), then running, then dead
            hdr[d.H_PID], hdr[d.H_PID_START] = os.getpid(), shm.start_time(os.getpid())
            assert sweep_stale(f"tgdist-{run_id}") == []
            hdr[d.H_PID] = 2 ** 22 + 12345  # no such process, but its starter lives
            assert sweep_stale(f"tgdist-{run_id}") == []
            for n in names[:2]:
                shm.shm_unlink(n)
        del hdr
        assert segments(run_id) == []
        seg.close()
        other.close()


@pytest.mark.slow  # ~23 s
def test_a_new_daemon_removes_the_segments_of_dead_runs(caplog):
    """A rank and its daemon SIGKILLed together leave their segments; the next daemon removes
    them (and ``tgdist launch`` does when its ranks end), keeping live runs' segments."""
    from tgdist.launcher import torchrun
    from tgdist.memory import daemon as d

    dead = f"{2 ** 22 + 12347}-{new_run_id().split('-')[1]}"  # started by no such process
    names = segment_names(dead, 0, 1)
    seg = shm.Segment.create(names[0], ctl_layout(1, 0))
    hdr = seg.array("hdr")
    hdr[d.H_I] = hdr[d.H_J] = 1
    hdr[d.H_PID] = 2 ** 22 + 12345  # no such process
    del hdr
    seg.close()
    with caplog.at_level("WARNING", logger="tgdist.memory.daemon"):
        h = start_daemon(0, 1, num_nodes=4, mem_dim=1, mail_dim=1, timeout=20)
    try:
        assert segments(dead) == [] and segments(h.spec.run_id) != []
        assert "removed 1 shared-memory segment of an earlier run whose processes are all dead" in caplog.text
        torchrun._sweep_stale_segments()  # the live daemon's are kept
        assert segments(h.spec.run_id) != []
    finally:
        h.stop()
    assert segments(h.spec.run_id) == []


# ------------------------------------------------------------------------------------------------
# Faults: separate trainer processes, SIGKILL, exceptions, normal shutdown

WORKER = textwrap.dedent('''
    import sys, time, torch
    from tgdist.errors import TgdistError
    from tgdist.memory.daemon import DaemonMemory, start_daemon

    run_id, rank, mode, out, first_rank = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    h = None
    try:
        if rank == 0:
            h = start_daemon(0, 2, num_nodes=100, mem_dim=4, mail_dim=4, run_id=run_id, timeout=20,
                             first_rank=first_rank)
            open(out + ".daemon", "w").write(str(h.pid))
            m = h.attach(0, timeout=20)
        else:
            m = DaemonMemory(run_id, 0, 1, timeout=20)
        ids = torch.arange(10)
        for p in range(100000):
            m.begin(p)
            m.read(ids)
            if mode == "raise" and rank == 1 and p == 5:
                raise RuntimeError("boom in trainer 1")
            m.write_memory(ids[rank::2], torch.full((5, 4), float(p)), torch.full((5,), float(p), dtype=torch.float64))
            m.end()
            if p == 3:
                open(out + f".ready{rank}", "w").write("1")
            if mode == "normal" and p == 30:
                break
            time.sleep(0.01)
        m.close()
        print(f"rank {rank} done", flush=True)
    except TgdistError as e:
        print(f"rank {rank} error: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    finally:
        if h is not None:
            h.stop()
''')


@contextlib.contextmanager
def launch_pair(tmp_path: Path, mode: str, first_rank: int = 0):
    """Start two worker ranks (the trainers of a group whose first global rank is ``first_rank``);
    yields ``(run_id, out, procs)`` and kills any left running on exit."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_id = new_run_id()
    out = str(tmp_path / "w")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), run_id, str(r), mode, out, str(first_rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        yield run_id, out, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def wait_files(paths, procs, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            outs = [p.communicate(timeout=30) for p in procs]
            raise AssertionError(f"workers did not get going: {outs}")
        time.sleep(0.02)


def finish(procs, limit=30.0):
    t0 = time.monotonic()
    outs = [p.communicate(timeout=limit) for p in procs]
    assert time.monotonic() - t0 < limit
    return [p.returncode for p in procs], outs


def assert_clean(run_id):
    deadline = time.monotonic() + 10  # an orphaned daemon needs a liveness check to notice
    while (segments(run_id) or processes_with(run_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert segments(run_id) == []
    assert processes_with(run_id) == []


@pytest.mark.distributed
@pytest.mark.parametrize("victim", [1, 0])  # rank 0 also started the daemon (its parent)
def test_sigkill_of_a_trainer_stops_the_group(tmp_path, victim):
    with launch_pair(tmp_path, "run") as (run_id, out, procs):
        wait_files([out + ".ready0", out + ".ready1", out + ".daemon"], procs)
        dpid, vpid = int(Path(out + ".daemon").read_text()), procs[victim].pid
        os.kill(vpid, signal.SIGKILL)
        codes, outs = finish(procs)
    other = 1 - victim
    assert codes[victim] == -signal.SIGKILL and codes[other] == 3
    assert (f"rank {other} error: memory daemon of group 0 (pid {dpid}) stopped: trainer rank {victim} "
            f"(pid {vpid}) died" in outs[other][1]), outs[other][1]
    assert_clean(run_id)


@pytest.mark.distributed
def test_a_dead_trainer_is_named_by_its_global_rank(tmp_path):
    """The second trainer of memory group 1 in a 2 x 1 x 2 layout is rank 3: the daemon, which
    numbered its trainers from 0 within the group, said "trainer rank 1 ... died"."""
    with launch_pair(tmp_path, "run", first_rank=2) as (run_id, out, procs):
        wait_files([out + ".ready0", out + ".ready1", out + ".daemon"], procs)
        dpid, vpid = int(Path(out + ".daemon").read_text()), procs[1].pid
        os.kill(vpid, signal.SIGKILL)
        codes, outs = finish(procs)
    assert codes == [3, -signal.SIGKILL]
    assert (f"rank 0 error: memory daemon of group 0 (pid {dpid}) stopped: trainer rank 3 (pid {vpid}) died"
            in outs[0][1]), outs[0][1]
    assert_clean(run_id)


@pytest.mark.distributed
def test_sigkill_of_the_daemon_stops_the_trainers(tmp_path):
    with launch_pair(tmp_path, "run") as (run_id, out, procs):
        wait_files([out + ".ready0", out + ".ready1", out + ".daemon"], procs)
        dpid = int(Path(out + ".daemon").read_text())
        os.kill(dpid, signal.SIGKILL)
        codes, outs = finish(procs)
    assert codes == [3, 3]
    assert f"rank 0 error: memory daemon of group 0 (pid {dpid}) died (killed by SIGKILL)" in outs[0][1], outs[0][1]
    assert f"rank 1 error: memory daemon of group 0 (pid {dpid}) died" in outs[1][1], outs[1][1]
    assert_clean(run_id)


@pytest.mark.distributed
def test_exception_in_a_trainer_stops_the_group(tmp_path):
    with launch_pair(tmp_path, "raise") as (run_id, out, procs):
        codes, outs = finish(procs, 60)
    assert codes == [3, 1]
    assert "RuntimeError: boom in trainer 1" in outs[1][1]
    assert (f"trainer rank 1 (pid {procs[1].pid}) detached before posting its write for position 5"
            in outs[0][1]), outs[0][1]
    assert_clean(run_id)


@pytest.mark.distributed
def test_normal_shutdown_cleans_up(tmp_path):
    with launch_pair(tmp_path, "normal") as (run_id, out, procs):
        codes, outs = finish(procs, 60)
    assert codes == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["rank 0 done", "rank 1 done"]
    assert_clean(run_id)
