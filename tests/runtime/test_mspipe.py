"""MSPipe (``tgdist.runtime.pipelines.mspipe``, ``pipeline.mode=mspipe``): the staleness bound as a pure
function, and the loop with staleness K against a reference written by hand with the Trainer API."""

import dataclasses
import math
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from tgdist.distributed import collectives
from tgdist.distributed.schedule import Layout, num_global_batches, num_iterations, step
from tgdist.errors import ConfigError
from tgdist.memory.store import LocalMemory
from tgdist.runtime.build import build_trainer, compose, validate
from tgdist.runtime.pipelines import mspipe as mspipe_module
from tgdist.runtime.pipelines.mspipe import (StageLocks, StageStreams, lower_priority, max_staleness, mitigate,
                                             quantile_gap, read_schedule, similar_nodes, stale_fraction,
                                             staleness_bounds, tensors_in, update_gaps)
from tgdist.runtime.pipelines import GradientHooks
from tgdist.runtime.run import Run

from tests.runtime import runs
from tests.runtime.runs import metrics
from tests.memory.test_sven import SMALL as PROBE_SMALL
from tests.memory.test_sven import _probe

# ----------------------------------------------------------------------------------------------
# The bound (MSPipe 3.2). The paper's figures give no stage times in its text, only the bounds
# they show: Figure 3 "k = 2, 4", Figure 7 "minimal staleness bound is 3" with the memory fetch
# delayed into the bubble. We reconstruct one pipeline per stated bound, with integer stage times
# (sample, features, memory fetch, training, memory update), and check the schedule by hand.


def test_figure_3a_training_bound_pipeline_has_k_2():
    """tau = (1, 1, 1, 2, 1): training is the slowest stage; fetch + update (2) fit in one training
    stage (2), so iteration i can read the memory updated by i - 2 (paper k = 2, our K = 1)."""
    b = staleness_bounds([1, 1, 1, 2, 1], 8)
    assert b.k.tolist() == [1, 2, 2, 2, 2, 2, 2, 2]  # i = 0 waits for nothing (first of the epoch)
    assert b.staleness.tolist() == [0, 1, 1, 1, 1, 1, 1, 1] and b.steady() == 1
    assert not b.stall.any()
    # by hand, iteration 2: sample [2, 3], features [5, 6] (after fetch 1 ends at 5), fetch ready
    # at 6, training of 1 ends at 7 = the stall-free start, so the fetch must start by 6; the
    # update of 1 ends at 8 > 6, the update of 0 at 6 <= 6: k = 2, fetch [6, 7], training [7, 9]
    assert b.begin[2].tolist() == [2, 5, 6, 7, 9] and b.end[2].tolist() == [3, 6, 7, 9, 10]


def test_figure_3b_slow_update_grows_k_to_the_cap_and_training_waits():
    """tau = (1, 1, 1, 2, 3): the memory update is slower than training, so each iteration's update
    ends later behind training than the last; k grows until C3's cap (k_max = 4, K <= 3) holds
    it at 4, and from then on training waits for the fetch (the price of the cap)."""
    b = staleness_bounds([1, 1, 1, 2, 3], 10, max_staleness=3)
    assert b.k.tolist() == [1, 2, 3, 3, 4, 4, 4, 4, 4, 4]
    assert b.steady() == 3
    assert not b.stall[:7].any() and (b.stall[7:] > 0).all()
    free = staleness_bounds([1, 1, 1, 2, 3], 10)  # without the cap k keeps growing: never stalls
    assert free.k[-1] > 4 and not free.stall.any()


def test_figure_7_fetch_delayed_into_the_bubble_with_k_3():
    """tau = (1, 1, 1, 3, 3): fetch + update (4) need two training stages (6), so k = 3; the fetch
    is ready before the update of i - 3 ends and is delayed by 1 into the bubble before training
    (Figure 7's green arrow), without stalling training."""
    b = staleness_bounds([1, 1, 1, 3, 3], 8)
    assert b.k.tolist() == [1, 2, 3, 3, 3, 3, 3, 3]
    assert b.delay.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert not b.stall.any() and b.steady() == 2
    # by hand, iteration 3: fetch ready at 8, training of 2 ends at 12, so the fetch must start by
    # 11; updates of 2 and 1 end at 15 and 12 (too late), that of 0 at 9: k = 3, fetch [9, 10]
    assert b.begin[3].tolist() == [3, 7, 9, 12, 15] and b.end[3].tolist() == [4, 8, 10, 15, 18]
    # training runs back to back: the GPU never idles
    assert np.allclose(b.begin[1:, 3], b.end[:-1, 3])


@pytest.mark.parametrize("tau", [(1, 1, 1, 2, 1), (1, 1, 1, 3, 3), (0.5, 0.2, 0.7, 2.0, 1.5), (1, 0, 2, 2, 2),
                                 (0.1, 0.3, 0.4, 5.0, 0.2)])
def test_training_bound_steady_k_is_one_plus_fetch_and_update_over_training(tau):
    """When training is the slowest stage (tau2 + tau3 <= tau4, tau5 <= tau4), the update of
    i - k must end by training i's start minus the fetch: (k - 1) tau4 >= tau3 + tau5."""
    b = staleness_bounds(tau, 40)
    assert b.k[-1] == 1 + math.ceil((tau[2] + tau[4]) / tau[3] - 1e-12)
    assert not b.stall.any()


def test_no_staleness_when_memory_stages_take_no_time():
    assert staleness_bounds([1, 1, 0, 1, 0], 5).k.tolist() == [1, 1, 1, 1, 1]


def test_bad_stage_times_are_refused():
    with pytest.raises(ValueError, match="five non-negative"):
        staleness_bounds([1, 1, 1], 4)
    with pytest.raises(ValueError, match="five non-negative"):
        staleness_bounds([1, 1, -1, 1, 1], 4)


def test_stale_fraction_and_c3_cap_on_a_hand_made_case():
    """Iterations read {0,1,2,3} each; iteration j writes node j (0, 1, 2, 3, 0). At K = 1 the reads
    of 1..4 each find one of 4 nodes written by the previous iteration: 4 of 20 reads stale; at
    K = 2, 1 + 2 + 2 + 2 = 7; at K = 3, 1 + 2 + 3 + 3 = 9; at K = 4, 1 + 2 + 3 + 4 = 10."""
    reads = [np.array([0, 1, 2, 3])] * 5
    writes = [np.array([0]), np.array([1]), np.array([2]), np.array([3]), np.array([0])]
    assert stale_fraction(reads, writes, 0) == 0
    assert [stale_fraction(reads, writes, K) for K in (1, 2, 3, 4)] == [4 / 20, 7 / 20, 9 / 20, 10 / 20]
    assert max_staleness(reads, writes, 0.5, upper=4) == 4
    assert max_staleness(reads, writes, 0.4, upper=4) == 2
    assert max_staleness(reads, writes, 0.1) == 0


def test_mitigation_formula_on_a_hand_made_case():
    """MSPipe-S (3.3): node 0 is stale (age 10 > gamma 5) and its similar nodes 1 (active, fresher)
    and 2 (too old) give Omega = {1}: s_hat = 0.75 s_0 + 0.25 s_1. Node 1 is fresh: unchanged.
    Node 3 is stale with no active similar node: unchanged. Node 4 was never written (-inf): new,
    not stale."""
    mem = torch.tensor([[4.0, 0.0], [0.0, 8.0], [100.0, 100.0], [1.0, 1.0], [7.0, 7.0]])
    updated = torch.tensor([0.0, 8.0, -5.0, 1.0, -math.inf], dtype=torch.float64)
    out = mitigate(mem, updated, now=10.0, similar=[np.array([1, 2]), np.array([0]), np.array([]), np.array([2]),
                                                    np.array([1])], gamma=5.0, lam=0.75)
    assert torch.equal(out, torch.tensor([[3.0, 2.0], [0.0, 8.0], [100.0, 100.0], [1.0, 1.0], [7.0, 7.0]]))
    assert quantile_gap(np.array([1.0, 2.0, 3.0, 4.0, np.inf]), 0.5) == 2.5


@pytest.mark.parametrize("seed", range(3))
def test_mitigation_of_every_stale_row_at_once_equals_the_formula_row_by_row(seed):
    """``mitigate`` takes all stale rows in one masked sum; here, on random memory, ages and
    candidate lists, against the formula applied row by row (float rounding apart)."""
    rng = np.random.default_rng(seed)
    n, gamma, now, lam = 60, 5.0, 20.0, 0.8
    mem = torch.from_numpy(rng.normal(size=(n, 4)).astype(np.float32))
    updated = torch.from_numpy(rng.uniform(0, 20, n))
    updated[rng.choice(n, 5, replace=False)] = -math.inf  # never written
    similar = {v: rng.choice(n, rng.integers(0, 8), replace=False) for v in range(n) if rng.random() < 0.8}
    want = mem.clone()
    changed = 0
    for v in range(n):
        if not (math.isfinite(updated[v]) and now - updated[v] > gamma) or v not in similar:
            continue
        omega = [u for u in similar[v] if now - updated[u] <= gamma and updated[u] > updated[v]]
        if omega:
            want[v] = lam * mem[v] + (1 - lam) * mem[omega].mean(0)
            changed += 1
    got = mitigate(mem, updated, now, similar, gamma, lam)
    assert changed >= 5
    assert torch.allclose(got, want, rtol=0, atol=1e-6) and (got != mem).any(1).sum() == changed


# ----------------------------------------------------------------------------------------------
# The online schedule's parts (Appendix D.3, Algorithm 1)


def test_stage_locks_run_a_stage_for_one_iteration_at_a_time_in_ticket_order():
    """Six threads started in reverse order still run the stage in ticket order (0..5), never two
    at once; ``wait`` returns once an iteration is through, ``mark`` counts one as through."""
    locks = StageLocks(("sample", "memory_write"))
    locks.spans = []
    tickets = [locks.ticket("sample") for _ in range(6)]
    inside, most = [0], [0]
    guard = threading.Lock()

    def work(i):
        with locks.turn("sample", tickets[i], iteration=10 + i):
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.005)
            with guard:
                inside[0] -= 1

    threads = [threading.Thread(target=work, args=(i,)) for i in reversed(range(6))]
    for th in threads:
        th.start()
    locks.wait("sample", 15)
    for th in threads:
        th.join()
    assert [it for _, it, *_ in locks.spans] == list(range(10, 16)) and most[0] == 1
    assert all(a[4] <= b[3] for a, b in zip(locks.spans, locks.spans[1:]))  # one after the other
    assert locks.done("sample") == 15 and locks.done("memory_write") == -1
    locks.mark("memory_write", 3)
    locks.wait("memory_write", 3)  # returns: marked through


def test_stage_streams_do_nothing_on_a_cpu_and_find_every_tensor_of_a_batch():
    """``StageStreams`` off a GPU: no event, no stream, the block runs as it is. ``tensors_in``
    (what ``hand_over`` records on a GPU) finds a batch's tensors through its dataclasses, lists,
    tuples and dicts, each once, and nothing else."""
    from tgdist.memory.store import MemoryRead

    st = StageStreams("cpu")
    assert not st.on and st.streams == {} and st.mark() is None
    ran = []
    with st.on_stream("fetch", None):
        ran.append(1)
    st.finish("fetch"), st.settle()
    assert ran == [1]
    a, b, c, d, e = (torch.zeros(i + 1) for i in range(5))
    read = MemoryRead(a, b, c, d)
    batch = {"read": read, "hops": [(e, None, "x"), [a]], "n": 3}
    found = tensors_in(batch)
    assert [id(t) for t in found] == [id(a), id(b), id(c), id(d), id(e)]
    assert st.hand_over(batch) is batch


def test_a_failed_stage_wakes_every_waiter_with_its_error():
    locks = StageLocks(("memory_read", "memory_write"))
    first, second = locks.ticket("memory_read"), locks.ticket("memory_read")
    errors = []

    def waiter():
        try:
            with locks.turn("memory_read", second, 1):  # waits for ticket 0's turn, which fails
                pass
        except ValueError as e:
            errors.append(str(e))

    def update_waiter():
        try:
            locks.wait("memory_write", 0)  # no update will come
        except ValueError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=waiter), threading.Thread(target=update_waiter)]
    for th in threads:
        th.start()
    with pytest.raises(ValueError):
        with locks.turn("memory_read", first, 0):
            raise ValueError("disk on fire")
    for th in threads:
        th.join(timeout=10)
    assert not any(th.is_alive() for th in threads)
    assert len(errors) == 2 and all("disk on fire" in e for e in errors)


def test_read_schedule_keeps_the_newest_update_a_read_sees_from_going_back():
    """i - K_i - 1, the newest update iteration i's read sees, may only move on: a K_i that would
    make it go back is lowered, any other is kept; the bound's own schedules are kept as they are."""
    assert read_schedule([0, 1, 2, 3, 0, 1, 5, 0]).tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert read_schedule([0, 1, 2, 3, 3, 3]).tolist() == [0, 1, 2, 3, 3, 3]
    for tau, cap in (([1, 1, 3, 10, 4], 3), ([1, 1, 3, 5, 8], 3), ([2, 1, 1, 3, 9], 6), ([1, 1, 1, 1, 1], None)):
        k = staleness_bounds(tau, 40, cap).staleness
        assert np.array_equal(read_schedule(k), k)
    with pytest.raises(ValueError, match="at least 0"):
        read_schedule([0, -1])


# ----------------------------------------------------------------------------------------------
# Config

SMALL = [*runs.SMALL, "model.dropout=0"]


def run(tmp_path, name, extra=(), trainer=None):
    return runs.run(tmp_path, name, extra, trainer, base=SMALL)


@pytest.mark.parametrize("bad, message", [
    (["pipeline.mode=pipedream"], "pipeline.mode=pipedream: give one of plain, mspipe"),
    (["pipeline.mode=mspipe", "pipeline.staleness=-1"], "pipeline.staleness=-1"),
    (["pipeline.mode=mspipe", "pipeline.staleness=soon"], "or auto"),
    (["pipeline.staleness=2"], "read by pipeline.mode=mspipe only"),
    (["pipeline.mode=mspipe", "pipeline.micro_batches=2"],
     "^pipeline.micro_batches=2 is read by pipeline.mode=plain only; pipeline.mode=mspipe does not read it$"),
    (["pipeline.mode=mspipe", "parallel.i=2", "memory.backend=sven"], "2 \\(2x1x1\\) with memory.backend=sven"),
    (["pipeline.mode=mspipe", "parallel.j=2", "memory.backend=daemon"],
     "parallel.i\\*j\\*k=2 \\(1x2x1\\) with memory.backend=daemon"),
    (["pipeline.mode=mspipe", "parallel.i=2", "parallel.k=2", "memory.backend=daemon"],
     "parallel.i\\*j\\*k=4 \\(2x1x2\\) with memory.backend=daemon"),
    (["pipeline.mode=mspipe", "pipeline.max_stale_fraction=0"], "max_stale_fraction=0"),
    (["pipeline.mitigation=similarity"],
     "^pipeline.mitigation=similarity is read by pipeline.mode=mspipe only; pipeline.mode=plain does not read it$"),
    (["pipeline.mode=mspipe", "pipeline.mitigation=cosine"], "^pipeline.mitigation=cosine: choose one of none, similarity$"),
    (["pipeline.mode=mspipe", "pipeline.mitigation_lambda=2"], "mitigation_lambda=2"),
    (["pipeline.mode=mspipe", "pipeline.stage_nice=20"], "pipeline.stage_nice=20: give a nice increment from 0"),
    (["pipeline.mode=mspipe", "pipeline.stage_nice=-1"], "pipeline.stage_nice=-1"),
])
def test_bad_mspipe_settings_are_refused_in_one_line(bad, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose(SMALL + bad))
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# The loop




def test_staleness_0_is_bit_identical_to_the_plain_loop(tmp_path):
    over = ["train.epochs=2"]
    plain, _ = run(tmp_path, "plain", over)
    k0, _ = run(tmp_path, "k0", [*over, "pipeline.mode=mspipe", "pipeline.staleness=0", "pipeline.prefetch=2"])
    assert metrics(k0) == metrics(plain) and len(metrics(plain)) >= 6
    k2, _ = run(tmp_path, "k2", [*over, "pipeline.mode=mspipe", "pipeline.staleness=2"])
    assert metrics(k2) != metrics(plain)  # staleness changes what is read
    assert k2["pipeline"]["mode"] == "mspipe" and k2["pipeline"]["staleness"] == 2


class RecordingMemory(LocalMemory):
    """Local memory that keeps a copy of every read; with ``delay`` K its writes are held back and
    applied K iterations late (``end_iteration``), in order: the reference semantics of MSPipe."""

    def __init__(self, *args, delay: int = 0):
        super().__init__(*args)
        self.reads, self.delay, self.held, self.current = [], delay, [], []

    def read(self, ids):
        r = super().read(ids)
        self.reads.append((ids.clone(), r.mem.clone(), r.mem_ts.clone(), r.mail.clone(), r.mail_ts.clone()))
        return r

    def write_memory(self, *a):
        self._write(super().write_memory, a)

    def write_mail(self, *a):
        self._write(super().write_mail, a)

    def deliver_mails(self, *a):
        self._write(super().deliver_mails, a)

    def _write(self, fn, args):
        if self.delay:
            self.current.append((fn, [x.clone() if torch.is_tensor(x) else x for x in args]))
        else:
            fn(*args)

    def end_iteration(self):
        self.held.append(self.current)
        self.current = []
        while len(self.held) > self.delay:
            self.flush(1)

    def flush(self, n=None):
        for _ in range(len(self.held) if n is None else n):
            for fn, args in self.held.pop(0):
                fn(*args)


def recording(tr, delay=0):
    m = tr.memory
    tr.memory = RecordingMemory(m.num_nodes, m.mem_dim, m.mail_dim, m.mailbox_size, delay=delay)
    return tr


@pytest.mark.parametrize("model, K, prefetch", [("tgn", 2, 2), ("apan", 3, 0)])
def test_every_read_equals_a_reference_that_applies_writes_k_iterations_late(tmp_path, model, K, prefetch):
    """The reference: the plain loop over the same batches and negatives, each iteration reading
    at once, with every write held back and applied K iterations late; at the end of each epoch
    every held write is applied before evaluation. Every memory read of the mspipe run (training
    and evaluation) must equal the reference's, and so must the metrics. (Without prefetch the
    read thread samples the batch it reads too.)"""
    epochs = 2
    # select=last: the final test starts from the last validation's memory, as the reference's does
    over = ["train.epochs=2", f"model={model}", "pipeline.mode=mspipe", f"pipeline.staleness={K}",
            f"pipeline.prefetch={prefetch}", "train.select=last"]
    cfg = compose(SMALL + over + [f"run_dir={tmp_path / 'ms'}"])
    ms = recording(build_trainer(cfg, progress=False))
    summary = Run(cfg, tmp_path / "ms", trainer=ms).train()

    ref = recording(build_trainer(cfg, progress=False), delay=K)
    n_train, bs = ref.split.range("train")[1], ref.batch_size
    nb, lay = num_global_batches(n_train, 1, bs), Layout(1, 1, 1)
    ref.model.train()
    for t in range(epochs * nb):
        s = step(lay, 0, t, n_train, bs, epochs)
        if s.reset_memory:
            ref.memory.reset_state()
        neg = ref.negatives.keyed(3 + s.neg_set, s.lo, s.hi, 1)
        ref.compute(ref.prepare(s.lo, s.hi, neg), train=True,
                    hooks=GradientHooks(lambda ps: collectives.average_gradients(ps)))
        ref.memory.end_iteration()
        if (t + 1) % nb == 0:  # the epoch's end: every held write applied, then validation as it is
            ref.memory.flush()
            ref.memory.delay = 0
            res = ref.evaluate("val", 1)  # (validation during training scores one negative)
            ref.memory.delay = K
            ref.model.train()
    ref.memory.delay = 0
    res.update(ref.evaluate("test"))  # the one complete test, at the end
    assert len(ms.memory.reads) == len(ref.memory.reads) > epochs * nb
    for got, want in zip(ms.memory.reads, ref.memory.reads):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert summary["val_ap"] == res["val_ap"] and summary["test_ap"] == res["test_ap"]


class HeldMemory(RecordingMemory):
    """The reference of a per-iteration schedule: every write is held, and ``apply_through(j)``
    applies the held writes of iterations up to j, in order."""

    def __init__(self, *args):
        super().__init__(*args, delay=1)
        self.through = -1

    def end_iteration(self):
        self.held.append(self.current)
        self.current = []

    def apply_through(self, j):
        while self.through < j and self.held:
            self.flush(1)
            self.through += 1


def test_a_per_iteration_schedule_reads_what_a_reference_with_those_delays_reads(tmp_path):
    """The online schedule (K_i per position of an epoch, here K_i = position mod 4, so the reads
    of each group of four see the memory as it was at the group's start): every training read
    equals a hand-written loop's that applies, before reading batch i, the writes of iterations
    up to i - K_i - 1 of the epoch."""
    K = 3
    over = ["train.epochs=2", "pipeline.mode=mspipe", f"pipeline.staleness={K}", "train.select=last"]
    cfg = compose(SMALL + over + [f"run_dir={tmp_path / 'ms'}"])
    ms = recording(build_trainer(cfg, progress=False))
    run = Run(cfg, tmp_path / "ms", trainer=ms)
    nb = run.batches_per_epoch
    schedule = np.arange(nb) % 4
    run.pipeline._online = read_schedule(schedule)
    assert np.array_equal(run.pipeline._online, schedule)
    run.train()

    ref = build_trainer(cfg, progress=False)
    m = ref.memory
    ref.memory = HeldMemory(m.num_nodes, m.mem_dim, m.mail_dim, m.mailbox_size)
    n_train, bs, lay = ref.split.range("train")[1], ref.batch_size, Layout(1, 1, 1)
    ref.model.train()
    for t in range(2 * nb):
        s = step(lay, 0, t, n_train, bs, 2)
        if s.reset_memory:
            ref.memory.reset_state()
        pos = t % nb
        ref.memory.apply_through(t - pos + (pos - int(schedule[pos]) - 1))
        neg = ref.negatives.keyed(3 + s.neg_set, s.lo, s.hi, 1)
        ref.compute(ref.prepare(s.lo, s.hi, neg), train=True,
                    hooks=GradientHooks(lambda ps: collectives.average_gradients(ps)))
        ref.memory.end_iteration()
        if pos == nb - 1:  # the epoch's end: every held write applied, then validation
            ref.memory.apply_through(t)
            ref.memory.delay = 0
            ref.evaluate("val", 1)
            ref.memory.delay = 1
            ref.model.train()
    per_val = len(range(*ref.split.range("val"), bs))
    got = [r for e in range(2) for r in ms.memory.reads[e * (nb + per_val): e * (nb + per_val) + nb]]
    want = [r for e in range(2) for r in ref.memory.reads[e * (nb + per_val): e * (nb + per_val) + nb]]
    assert len(got) == len(want) == 2 * nb
    for i, (a, b) in enumerate(zip(got, want)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), i


def test_the_five_stages_of_consecutive_iterations_overlap_in_threads(tmp_path):
    """Algorithm 1 in the loop: sampling, features and memory reads run in stage threads and the
    memory update in its own, each stage for one iteration at a time and in iteration order; with
    training slowed (an 80 ms optimizer step) the reads of later batches and each update run while
    the main thread trains; and no read ever runs during an update (which keeps the run exact)."""
    K = 1
    cfg = compose(SMALL + ["train.epochs=1", "pipeline.mode=mspipe", f"pipeline.staleness={K}",
                           f"run_dir={tmp_path / 'r'}"])
    tr = build_trainer(cfg, progress=False)
    computing = []
    compute, opt_step = tr.compute, tr.optimizer.step

    def timed_compute(*a, **k):
        began = time.perf_counter()
        try:
            return compute(*a, **k)
        finally:
            computing.append((began, time.perf_counter()))

    def slow_step(*a, **k):
        time.sleep(0.08)
        return opt_step(*a, **k)

    tr.compute, tr.optimizer.step = timed_compute, slow_step
    run = Run(cfg, tmp_path / "r", trainer=tr)
    run.pipeline.stage_spans = spans = []
    run.train()
    nb = run.batches_per_epoch
    by_stage = {st: [sp for sp in spans if sp[0] == st] for st in ("sample", "features", "memory_read", "memory_write")}
    for stage, ss in by_stage.items():
        assert [sp[1] for sp in ss] == list(range(nb)), stage  # each iteration once, in order
        assert all(a[4] <= b[3] for a, b in zip(ss, ss[1:])), stage  # one at a time
        assert all(sp[2] != "MainThread" for sp in ss), stage
    computing = computing[:nb]  # (evaluation computes after them)

    def overlaps(a, b):
        return a[0] < b[1] and b[0] < a[1]

    reads = [(sp[3], sp[4]) for sp in by_stage["memory_read"]]
    updates = [(sp[3], sp[4]) for sp in by_stage["memory_write"]]
    assert not any(overlaps(r, u) for r in reads for u in updates)
    read_during_training = sum(any(overlaps(r, c) for c in computing) for r in reads)
    update_during_training = sum(overlaps(u, c) for u, c in zip(updates, computing))
    assert read_during_training >= nb // 2 and update_during_training >= nb // 2, (read_during_training,
                                                                                    update_during_training, nb)


def _nice(tid=None) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own priority is Linux's")
def test_lower_priority_lowers_the_calling_thread_only_and_stops_at_19():
    main = _nice()
    got = {}

    def probe(key, nice):
        got[key] = (lower_priority(nice), _nice())

    for key, nice in (("by 3", 3), ("by 0", 0), ("by 40", 40)):
        th = threading.Thread(target=probe, args=(key, nice))
        th.start()
        th.join()
    assert got["by 3"] == (min(19, main + 3),) * 2
    assert got["by 0"] == (main, main)
    assert got["by 40"] == (19, 19)
    assert _nice() == main  # the caller of the threads keeps its priority


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own priority is Linux's")
@pytest.mark.parametrize("nice", [19, 0])
def test_the_stage_threads_run_at_pipeline_stage_nice_below_training(tmp_path, monkeypatch, nice):
    """Every MSPipe stage and update thread lowers its priority by pipeline.stage_nice when it
    starts (19 by default: the stages take the cycles training leaves idle); training keeps its own."""
    seen = []

    def recording(n):
        seen.append((threading.current_thread().name, n, lower_priority(n), _nice()))
        return seen[-1][2]

    monkeypatch.setattr(mspipe_module, "lower_priority", recording)
    main = _nice()
    s, _ = run(tmp_path, "r", ["train.epochs=1", "pipeline.mode=mspipe", "pipeline.staleness=1",
                               f"pipeline.stage_nice={nice}"])
    assert s["pipeline"]["stage_nice"] == nice
    names = {name.rsplit("_", 1)[0] for name, *_ in seen}
    assert names == {"tgdist-mspipe-stages", "tgdist-mspipe-update"}, names
    assert all(n == nice and got == now == min(19, main + nice) for _, n, got, now in seen), seen
    assert _nice() == main


def test_an_error_in_a_stage_thread_ends_the_run_with_it_and_leaves_no_thread(tmp_path):
    """The sampler fails in a stage thread at its fifth batch while later batches' threads wait
    for their turns: the run raises that error, and every stage thread is gone afterwards."""
    cfg = compose(SMALL + ["train.epochs=1", "pipeline.mode=mspipe", "pipeline.staleness=2",
                           f"run_dir={tmp_path / 'r'}"])
    tr = build_trainer(cfg, progress=False)
    sample, calls = tr.sampler.sample, [0]

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == 5:
            raise ValueError("bad neighbour table")
        return sample(*a, **k)

    tr.sampler.sample = failing
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="bad neighbour table"):
        Run(cfg, tmp_path / "r", trainer=tr).train()
    left = [th for th in threading.enumerate() if th not in before and th.name.startswith("tgdist")]
    assert not left, left


def _as_in_a_parallel_run(run: Run) -> Run:
    """``run`` (one process) with its MSPipe taking the path of a parallel run: writes made in the
    main thread, and the store's exchange, passed on by ``after_exchange``, as the update stage."""
    run.pipeline.ctx = dataclasses.replace(run.pipeline.ctx, alone=False)
    return run


def test_an_iteration_without_after_exchange_is_an_error_at_once_not_a_hang(tmp_path, monkeypatch):
    """In a parallel run the update stage is the store's exchange, which ``after_exchange`` passes
    on to the reads waiting for it: a loop that skipped the call left the next reads waiting for
    ever (the parallel tests hung for 600 s). The pipeline checks that every iteration that ended
    passed its write on, before the next reads and at a drain. Taken here in one process on the
    parallel path, which trains as the one-process path does when the hook is called."""
    over = SMALL + ["train.epochs=1", "pipeline.mode=mspipe", "pipeline.staleness=1", "train.select=last"]
    alone, _ = runs.run(tmp_path, "alone", over)
    cfg = compose(over + [f"run_dir={tmp_path / 'parallel'}"])
    assert metrics(_as_in_a_parallel_run(Run(cfg, tmp_path / "parallel")).train()) == metrics(alone)

    monkeypatch.setattr(mspipe_module.MSPipe, "after_exchange", lambda self, t: None)
    run = _as_in_a_parallel_run(Run(compose(over + [f"run_dir={tmp_path / 'skipped'}"]), tmp_path / "skipped"))
    raised: list = []

    def train():
        try:
            run.train()
        except BaseException as e:  # noqa: BLE001 - what the test looks at
            raised.append(e)

    began = time.perf_counter()
    th = threading.Thread(target=train, daemon=True)
    th.start()
    th.join(timeout=120)
    if th.is_alive():  # the hang this test is about: end it (the stages' waits fail) before failing
        run.pipeline.close()
        th.join(timeout=30)
        pytest.fail(f"the run still waited after {time.perf_counter() - began:.0f} s")
    assert [str(e) for e in raised] == ["pipeline.mode=mspipe: iteration 0 ended without after_exchange(0), which "
                                        "passes its memory write on to the reads; iteration 1's reads would wait "
                                        "for it for ever"]
    run.close()


def _k0_is_the_plain_run_and_k_is_not(ranks: list, plain: str, k0: str, k2: str) -> None:
    """Probe records of every rank: staleness 0 gives the plain run's losses and memory after
    every iteration bit for bit, and rank 0's metrics; staleness K > 0 gives other losses."""
    for rec in ranks:
        assert rec[k0]["losses"] == rec[plain]["losses"]
        for a, b in zip(rec[k0]["states"], rec[plain]["states"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert rec[k2]["losses"] != rec[plain]["losses"]
    assert ranks[0][k0]["metrics"] == ranks[0][plain]["metrics"] and ranks[0][k0]["metrics"]


def _probe_batches(layout: list[str]) -> tuple[int, int]:
    """The number of training events and the batch size of the probe's runs at ``layout``."""
    tr = build_trainer(compose(PROBE_SMALL + layout), progress=False)
    return tr.split.range("train")[1], tr.batch_size


def _read_is(got: list, ids, state: dict | None, where) -> bool:
    """A recorded training read (memory, memory times, mail, mail times of ``ids``) is reset memory
    where ``state`` is None, else ``state``'s rows; True when it was compared with a state."""
    if state is None:
        assert not any(x[torch.isfinite(x)].any() for x in got), where
        return False
    assert all(torch.equal(x, state[k][ids]) for x, k in zip(got, ("mem", "mem_ts", "mail", "mail_ts"))), where
    return True


@pytest.mark.slow
def test_mini_batch_parallelism_on_depcache_reads_what_the_staleness_says(tmp_path):
    """mspipe at 2 x 1 x 1 on depcache memory (its stage threads read the replica while the main
    thread runs the collectives): staleness 0 is the plain parallel run bit for bit (losses, memory
    after every iteration, metrics); with K = 2 every training read of a rank equals the replica as
    it was after iteration u - K - 1 of the epoch (every rank's writes in it), or reset memory in
    the epoch's first K + 1 iterations, and the replicas stay identical; auto chooses one K for
    both ranks."""
    K = 2
    runs = ["depcache", "depcache:pipeline.mode=mspipe;pipeline.staleness=0",
            f"depcache:pipeline.mode=mspipe;pipeline.staleness={K}",
            "depcache:pipeline.mode=mspipe;pipeline.staleness=auto;pipeline.profile_iterations=3"]
    ranks = _probe(tmp_path, 2, "model=tgn", "parallel.i=2", "train.epochs=2", runs="runs=" + ",".join(runs))
    plain, k0, k2, auto = runs
    _k0_is_the_plain_run_and_k_is_not(ranks, plain, k0, k2)
    for a, b in zip(ranks[0][k2]["states"], ranks[1][k2]["states"]):
        assert all(torch.equal(a[k], b[k]) for k in a)

    (n_train, bs), lay = _probe_batches(["model=tgn", "parallel.i=2", "train.epochs=2"]), Layout(2, 1, 1)
    nb = num_global_batches(n_train, 2, bs)
    checked = 0
    for r in range(2):
        rec = ranks[r][k2]
        for t in range(2 * nb):
            s = step(lay, r, t, n_train, bs, 2)
            if not s.active or s.hi == s.lo:
                continue
            ids, *got = rec["read_values"][s.lo][t // nb]  # (its epoch's read of that batch)
            seen = t - t % nb + (t % nb - K - 1)  # the newest iteration of this epoch whose writes it sees
            warm_up = seen < t - t % nb  # reset memory
            checked += _read_is(got, ids, None if warm_up else rec["states"][seen], (r, t))
    assert checked >= 2 * 2 * (nb - K - 1) > 0
    assert ranks[0][auto]["staleness"] == ranks[1][auto]["staleness"] and ranks[0][auto]["staleness"][1]


@pytest.mark.parametrize("i, backend", [(1, "local"), pytest.param(2, "depcache", marks=pytest.mark.slow)])
def test_memory_parallelism_reads_what_the_staleness_says_across_the_reset_inside_a_pass(tmp_path, i, backend):
    """mspipe at i x 1 x 2 (two memory groups of i trainers; one pass each): group 1 walks the
    stream from its second segment and resets its memory where the stream wraps to the first
    batch, inside its pass. Staleness 0 is the plain run bit for bit; with K = 2 every training
    read of a rank equals its memory after iteration u - K - 1, or reset memory where a reset came
    after that iteration (no read crosses a reset)."""
    K, nproc = 2, 2 * i
    runs = [backend, f"{backend}:pipeline.mode=mspipe;pipeline.staleness=0",
            f"{backend}:pipeline.mode=mspipe;pipeline.staleness={K}"]
    layout = ["model=tgn", f"parallel.i={i}", "parallel.k=2", "train.epochs=2"]
    ranks = _probe(tmp_path, nproc, *layout, runs="runs=" + ",".join(runs))
    plain, k0, k2 = runs
    _k0_is_the_plain_run_and_k_is_not(ranks, plain, k0, k2)

    (n_train, bs), lay = _probe_batches(layout), Layout(i, 1, 2)
    nb, T = num_global_batches(n_train, i, bs), num_iterations(lay, n_train, bs, 2)  # (one pass each)
    checked, resets_inside = [0] * nproc, 0
    for r in range(nproc):
        rec, last_reset = ranks[r][k2], None
        for t in range(T):
            s = step(lay, r, t, n_train, bs, 2)
            if s.reset_memory:
                last_reset = t
                resets_inside += t % nb != 0
            if s.hi == s.lo:
                continue
            ids, *got = rec["read_values"][s.lo][s.pass_index]
            seen = t - K - 1  # the newest iteration whose writes it sees
            reset_since = seen < last_reset  # reset memory
            checked[r] += _read_is(got, ids, None if reset_since else rec["states"][seen], (r, t))
    assert T == nb and resets_inside == i  # group 1's wrap to the first batch, on each of its trainers
    assert checked[0] == T - K - 1 and checked[-1] == T - 2 * (K + 1) > 0


@pytest.mark.parametrize("i", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_epoch_parallelism_reads_each_position_on_subgroup_0s_schedule(tmp_path, monkeypatch, i):
    """mspipe at i x 2 x 1 on depcache (two epoch-parallel subgroups on one memory copy; only
    subgroup 0 writes): staleness 0 is the plain run bit for bit; with K = 2 subgroup jj trains
    position p at iteration p + jj on the read subgroup 0 makes of p, the replica after position
    p - K - 1's write (reset memory before the pass's (K + 1)-th position), on every rank. The
    reads of subgroup 1 are held back 100 ms, so one of its ranks that applied a write before the
    reads that must miss it were done would show it."""
    K, nproc = 2, 2 * i
    monkeypatch.setenv("PROBE_READ_DELAY", "0.1:" + ",".join(str(r) for r in range(i, nproc)))  # (ranks of jj = 1)
    runs = ["depcache", "depcache:pipeline.mode=mspipe;pipeline.staleness=0;pipeline.prefetch=2",
            f"depcache:pipeline.mode=mspipe;pipeline.staleness={K}"]  # (K = 0 with the sampling thread)
    layout = ["model=tgn", f"parallel.i={i}", "parallel.j=2", "train.epochs=2"]
    ranks = _probe(tmp_path, nproc, *layout, runs="runs=" + ",".join(runs))
    plain, k0, k2 = runs
    _k0_is_the_plain_run_and_k_is_not(ranks, plain, k0, k2)

    (n_train, bs), lay = _probe_batches(layout), Layout(i, 2, 1)
    nb, T = num_global_batches(n_train, i, bs), num_iterations(lay, n_train, bs, 2)  # (one pass)
    checked = [0] * nproc
    for r in range(nproc):
        rec, jj = ranks[r][k2], lay.coords(r)[1]
        for t in range(T):
            s = step(lay, r, t, n_train, bs, 2)
            if not s.active or s.hi == s.lo:
                continue
            assert s.position == t - jj
            (ids, *got), = rec["read_values"][s.lo]  # the one read of that batch on this rank
            seen = s.position - K - 1  # the newest position whose write it sees
            # reset memory, or the replica after iteration `seen`, whose exchange applied subgroup 0's write of it
            checked[r] += _read_is(got, ids, None if seen < 0 else rec["states"][seen], (r, t))
    assert T == nb + 1 and all(c == nb - K - 1 > 0 for c in checked), (T, nb, checked)
    for a, b in zip(ranks[0][k2]["states"], ranks[-1][k2]["states"]):  # the replicas stay one copy
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_no_read_sees_a_write_of_the_last_k_iterations_or_later(tmp_path):
    """Every memory and mail time a training read returns is at most the time of the last event
    of batch i - K - 1 of its epoch (the newest write it may see); reset memory before that."""
    K = 3
    cfg = compose(SMALL + ["train.epochs=2", "pipeline.mode=mspipe", f"pipeline.staleness={K}",
                           "train.select=last", f"run_dir={tmp_path / 'r'}"])
    tr = recording(build_trainer(cfg, progress=False))
    n_train, bs = tr.split.range("train")[1], tr.batch_size
    nb = num_global_batches(n_train, 1, bs)
    Run(cfg, tmp_path / "r", trainer=tr).train()
    per_val, per_test = len(range(*tr.split.range("val"), bs)), len(range(*tr.split.range("test"), bs))
    train_reads = [r for e in range(2) for r in tr.memory.reads[e * (nb + per_val): e * (nb + per_val) + nb]]
    assert len(tr.memory.reads) == 2 * (nb + per_val) + per_test  # each epoch validated, one test at the end
    t_rel = tr.t_rel
    seen = False
    for i, (_, _, mem_ts, _, mail_ts) in enumerate(train_reads):
        j = i % nb - K - 1  # the newest batch of this epoch whose write this read may see
        newest = max(mem_ts.max().item(), mail_ts[torch.isfinite(mail_ts)].max().item() if torch.isfinite(
            mail_ts).any() else 0.0)
        limit = t_rel[min((j + 1) * bs, n_train) - 1] if j >= 0 else 0.0
        assert newest <= limit, (i, newest, limit)
        seen |= j >= 1 and newest > t_rel[j * bs - 1]  # it sees batch j's write: no staler than K
    assert seen


def test_mspipe_resumes_exactly_from_a_checkpoint_with_reads_in_flight(tmp_path):
    """A mid-epoch checkpoint after iteration t holds the K + 1 batches read ahead, t + 1 .. t + K
    + 1 (the last read during t, after t's update), and the sampler's count before them, so
    uniform sampling draws them again alike: the resumed run ends as the full one."""
    over = ["train.epochs=2", "sampler.strategy=uniform", "pipeline.mode=mspipe", "pipeline.staleness=2",
            "pipeline.prefetch=2"]
    full, _ = run(tmp_path, "full", over)
    stopped, d = run(tmp_path, "part", [*over, "train.checkpoint_every=4", "train.stop_after_batches=17"])
    assert stopped["stopped"]
    state = torch.load(d / "checkpoints" / "last.pt", weights_only=True)
    part = torch.load(d / "checkpoints" / state["dir"] / "rank-0.pt", weights_only=True)
    assert sorted(part["slots"]) == [16, 17, 18]  # the checkpoint after 16 iterations (every 4), K = 2
    resumed, _ = run(tmp_path, "resumed", [*over, f"train.resume={d}"])
    assert metrics(resumed) == metrics(full)


def test_staleness_auto_measures_chooses_and_reports(tmp_path, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="tgdist.runtime.pipelines")
    s, _ = run(tmp_path, "auto", ["train.epochs=1", "pipeline=mspipe", "pipeline.profile_iterations=4"])
    chosen = [r.getMessage() for r in caplog.records if "pipeline.staleness=auto: K=" in r.getMessage()]
    assert len(chosen) == 1
    p = s["pipeline"]
    assert p["mode"] == "mspipe" and 0 <= p["staleness"] <= p["bounds"]["max_staleness"]
    assert len(p["bounds"]["tau"]) == 5 and p["bounds"]["steady_k"] == p["staleness"] + 1


def test_similar_nodes_count_common_neighbours_before_the_batch():
    """Events (src, dst, t): (0,5,1) (1,5,2) (2,5,3) (1,6,4) (0,6,5) (3,7,6) (2,6,9). Before t = 8,
    node 0's neighbours are {5, 6}; 1 shares both, 2 shares 5 only (its event with 6 is at 9), 3
    none. Rows of ids [3, 2, 1, 0]: for row 3 (node 0), row 2 (node 1, 2 shared), then row 1."""
    from tgdist.data.graph import TemporalGraph
    from tgdist.data.sampler import TCSR
    src, dst = np.array([0, 1, 2, 1, 0, 3, 2]), np.array([5, 5, 5, 6, 6, 7, 6])
    t = np.array([1, 2, 3, 4, 5, 6, 9])
    g = TemporalGraph(src=src, dst=dst, t=t, num_nodes=8, node_map=np.arange(8))
    tcsr = TCSR.build(g)
    got = similar_nodes(tcsr, np.array([3, 2, 1, 0]), [3], before=8)
    assert got[3].tolist() == [2, 1]
    assert similar_nodes(tcsr, np.array([3, 2, 1, 0]), [3], before=10)[3].tolist() == [1, 2]  # 2 ties 1 now
    gaps = update_gaps(np.array([0, 1, 0]), np.array([1, 2, 2]), np.array([1.0, 3.0, 7.0]))
    assert gaps.tolist() == [6.0, 2.0, 4.0]  # nodes 0 (t 1, 7), 1 (t 1, 3), 2 (t 3, 7)


def test_mitigation_with_lambda_1_changes_nothing_and_with_less_changes_the_run(tmp_path):
    over = ["train.epochs=2", "pipeline.mode=mspipe", "pipeline.staleness=2"]
    base, _ = run(tmp_path, "base", over)
    one, _ = run(tmp_path, "one", [*over, "pipeline.mitigation=similarity", "pipeline.mitigation_lambda=1",
                                   "pipeline.mitigation_quantile=0.9"])
    half, _ = run(tmp_path, "half", [*over, "pipeline.mitigation=similarity", "pipeline.mitigation_lambda=0.5",
                                    "pipeline.mitigation_quantile=0.9"])
    assert metrics(one) == metrics(base)
    m = half["pipeline"]["mitigation"]
    assert m["stale_rows_read"] >= m["rows_mitigated"] > 0 and m["gamma_s"] > 0
    assert metrics(half) != metrics(base)
