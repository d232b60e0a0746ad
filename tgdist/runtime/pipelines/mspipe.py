"""MSPipe (``pipeline.mode=mspipe``): the stage pipeline of MSPipe 3.2 and Algorithm 1 as a strategy
of the loop (``MSPipe``), its staleness bound (Appendix D.3) and similarity mitigation (3.3) as pure
functions, and what its stage threads run under: per-stage locks, priorities, CUDA streams.

Notation. The paper's k_i counts iterations back to the last memory update that iteration i's
fetch must see: iteration i reads memory updated through iteration i - k_i, so its k = 1 is the
plain loop (section 5.4: "k = 1 represents the baseline method of TGL without applying
staleness"). tgdist's ``pipeline.staleness`` K counts the writes a read misses: iteration i reads
memory that lacks the writes of iterations i - K .. i - 1, so K = k - 1 and K = 0 is the plain loop.

Stages j = 1..5: sample, features, memory read (fetch), compute (MTGNN training), memory write
(update); ``tau`` their profiled seconds, b / e their start and end times, eq. (3)-(4):
b_i^(1) = e_{i-1}^(1); b_i^(2) = max(e_i^(1), e_{i-1}^(3)) (feature and memory fetches share the
copy engine); b_i^(j) = max(e_i^(j-1), e_{i-1}^(j)) for j = 3..5.

The constraints as we read them (the paper prints C1 as e_{i-k}^(5) >= b_i^(3), which, taken
literally, would have the update of i - k end *after* the fetch starts; its text and Algorithm 1,
line 9, say the fetch waits for that update, so we use the ordering the text describes):
- C1: the memory fetch of i starts once the update of i - k_i has ended and once it can start
  at all: b_i^(3) = max(eq. (3)'s start, e_{i-k_i}^(5)) -- the fetch is delayed into the bubble;
- C2: that delay does not stall training: e_{i-k_i}^(5) <= b_i^(4) - tau^(3), with b_i^(4) the
  training start the fetch would allow without the delay (max(ready + tau^(3), e_{i-1}^(4)));
- C3: 1 <= k_i <= k_max, k_max the largest k at which at most half of the nodes read are stale
  (``max_staleness``; the paper writes k_i < min{i, k_max} with 1-based i: the first iterations
  have fewer earlier updates to wait for, the warm-up of Appendix D.3).
k_i is the smallest k meeting C2 (the freshest read that does not stall training); when none does
within C3's cap, k_i is the cap and training waits (``Bounds.stall``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tgdist import memory
from tgdist.config import PipelineConfig, choice_type, count_or_auto
from tgdist.data.sampler import TCSR
from tgdist.distributed import collectives
from tgdist.errors import ConfigError
from tgdist.kernels import graph as kernels
from tgdist.memory.store import MemoryRead
from tgdist.runtime.pipelines.base import IterationCosts, Pipeline, PipelineContext, Price, StepHooks, count_of
from tgdist.runtime.pipelines.registry import register
from tgdist.runtime.trainer import STAGES  # MSPipe's stages 1..5, in its order
from tgdist.uploads import upload

log = logging.getLogger(__name__)

__all__ = ["MSPipe", "STAGES", "StageLocks", "StageStreams", "tensors_in", "lower_priority", "Bounds",
           "staleness_bounds", "read_schedule", "stale_fraction", "max_staleness", "stale_rows", "mitigate", "quantile_gap",
           "similar_nodes", "update_gaps", "staleness"]

MSPIPE_THREADS = 8  # stage threads, one per batch in flight (Algorithm 1); more batches queue in order


@dataclass(frozen=True)
class Bounds:
    """The minimal staleness of each iteration of one epoch and the schedule it gives (all [E],
    or [E, 5] per stage): ``k`` the paper's k_i, ``staleness`` = k - 1 (writes missed), ``begin``
    / ``end`` the stage times of eq. (3)-(4) with C1's delayed fetch, ``delay`` how long each fetch
    was held back (Figure 7's green arrows), ``stall`` how long training waited for a fetch because
    C3 capped k (0 when the pipeline is stall-free)."""

    k: np.ndarray
    staleness: np.ndarray
    begin: np.ndarray
    end: np.ndarray
    delay: np.ndarray
    stall: np.ndarray

    def steady(self) -> int:
        """One staleness K for the whole run (the paper, E.2.4: k_i converges to a steady value, which
        it uses): the largest K_i of the second half of the epoch, so no steady iteration stalls."""
        tail = self.staleness[len(self.staleness) // 2:]
        return int(tail.max()) if tail.size else 0


def staleness_bounds(tau: Sequence[float], num_iterations: int, max_staleness: int | None = None) -> Bounds:
    """k_i for iterations 0 .. E-1 of an epoch (memory reset at its start) from the five stage
    times ``tau`` (seconds), with C3's cap ``max_staleness`` (K = k - 1 units; None: no cap).
    O(E * k_max), the paper's iteration over the epoch."""
    tau = np.asarray(tau, dtype=np.float64)
    if tau.shape != (5,) or (tau < 0).any() or not np.isfinite(tau).all():
        raise ValueError(f"tau: give five non-negative stage times (sample, features, memory read, compute, memory "
                         f"write), got {tau.tolist()}")
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be at least 0, got {max_staleness}")
    E = int(num_iterations)
    b, e = np.zeros((E, 5)), np.zeros((E, 5))
    k, delay, stall = np.zeros(E, np.int64), np.zeros(E), np.zeros(E)
    k_cap = np.inf if max_staleness is None else max_staleness + 1
    for i in range(E):
        prev = e[i - 1] if i else np.zeros(5)
        b[i, 0] = prev[0]
        e[i, 0] = b[i, 0] + tau[0]
        b[i, 1] = max(e[i, 0], prev[2])
        e[i, 1] = b[i, 1] + tau[1]
        ready = max(e[i, 1], prev[2])  # eq. (3), j = 3: the earliest the fetch can start
        train_at = max(ready + tau[2], prev[3])  # training's start were the fetch not delayed
        # smallest k whose update ends by the latest stall-free fetch start (C2); k = i + 1: no
        # earlier update of this epoch to wait for (warm-up)
        ki = 1
        while ki <= i and ki < k_cap and e[i - ki, 4] > train_at - tau[2]:
            ki += 1
        k[i] = ki
        waited = e[i - ki, 4] if ki <= i else -np.inf  # C1: the fetch follows the update of i - k
        b[i, 2] = max(ready, waited)
        delay[i] = b[i, 2] - ready
        e[i, 2] = b[i, 2] + tau[2]
        b[i, 3] = max(e[i, 2], prev[3])
        stall[i] = b[i, 3] - train_at
        e[i, 3] = b[i, 3] + tau[3]
        b[i, 4] = max(e[i, 3], prev[4])
        e[i, 4] = b[i, 4] + tau[4]
    return Bounds(k, k - 1, b, e, delay, stall)


def read_schedule(staleness: Sequence[int]) -> np.ndarray:
    """The K_i the loop can keep for the iterations of an epoch: iteration i reads after the update
    of i - K_i - 1 and before that of i - K_i, and reads are made in order, so the newest update
    a read sees, i - K_i - 1, may not go back from one iteration to the next (a later read seeing
    less would have to come before an update an earlier read waits for). ``staleness_bounds``'
    K_i keep that order (the update a fetch waits for only moves on); this holds it for any input
    by lowering a K_i that would go back."""
    k = np.asarray(staleness, dtype=np.int64)
    if (k < 0).any():
        raise ValueError(f"staleness must be at least 0, got {k.min()}")
    i = np.arange(k.size)
    return i - np.maximum.accumulate(i - k)


def stale_fraction(reads: Sequence[np.ndarray], writes: Sequence[np.ndarray], staleness: int) -> float:
    """The share of node reads that are stale at ``staleness`` K (MSPipe Figure 6): over the
    iterations i, the nodes read by i (``reads[i]``, unique ids) that one of iterations i - K .. i - 1
    writes (``writes[j]``), divided by all nodes read. The first iteration is iteration 0 of an epoch."""
    stale = total = 0
    for i, r in enumerate(reads):
        r = np.asarray(r)
        total += r.size
        if staleness > 0 and i > 0 and r.size:
            recent = np.concatenate([np.asarray(writes[j]) for j in range(max(0, i - staleness), i)])
            stale += int(np.isin(r, recent).sum())
    return stale / max(total, 1)


def max_staleness(reads: Sequence[np.ndarray], writes: Sequence[np.ndarray], limit: float = 0.5,
                  upper: int = 64) -> int:
    """C3: the largest K (at most ``upper``) at which at most ``limit`` of the nodes read are stale
    (the paper's 50%). The share grows with K, so the first K over the limit ends the search."""
    K = 0
    while K < upper and stale_fraction(reads, writes, K + 1) <= limit:
        K += 1
    return K


# ----------------------------------------------------------------------------------------------
# The online schedule (Appendix D.3, Algorithm 1)


class StageLocks:
    """Algorithm 1's per-stage locks: a stage runs for one iteration at a time, and for the
    iterations in the order they took their tickets (eq. (3)'s order: stage j of iteration i after
    stage j of i - 1). The driver takes every ticket in one thread, in iteration order, when it
    hands an iteration's stage to a thread (``ticket``); the thread then runs the stage inside
    ``turn``. ``done(stage)`` is the latest iteration through a stage (for the memory write, the
    paper's i_upd), and ``wait(stage, i)`` waits until iteration i is through it: the memory fetch
    of i waits for the update of i - k_i there (Algorithm 1, line 9).

    A stage that fails hands its error to every waiter (``fail``), which raises it, so no thread
    waits forever for an iteration that will not come. ``spans``: when a list, each turn appends ``(stage,
    iteration, thread, start, end)`` (timelines and tests)."""

    def __init__(self, stages: Sequence[str] = STAGES, done: int = -1):
        self._cv = threading.Condition()
        self._issued = dict.fromkeys(stages, 0)  # the next ticket of each stage
        self._serving = dict.fromkeys(stages, 0)  # the ticket whose turn it is
        self._done = dict.fromkeys(stages, done)
        self._error: BaseException | None = None
        self.spans: list | None = None

    def ticket(self, stage: str) -> int:
        with self._cv:
            t = self._issued[stage]
            self._issued[stage] = t + 1
            return t

    @contextmanager
    def turn(self, stage: str, ticket: int, iteration: int):
        """Run the body as ``stage`` of ``iteration`` once every earlier ticket's turn is over."""
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or self._serving[stage] == ticket)
            self._raise()
        began = time.perf_counter()
        try:
            yield
        except BaseException as e:
            self.fail(e)
            raise
        finally:
            with self._cv:
                self._serving[stage] = ticket + 1
                self._done[stage] = max(self._done[stage], iteration)
                if self.spans is not None:
                    self.spans.append((stage, iteration, threading.current_thread().name, began, time.perf_counter()))
                self._cv.notify_all()

    def done(self, stage: str) -> int:
        with self._cv:
            return self._done[stage]

    def mark(self, stage: str, iteration: int) -> None:
        """``iteration`` counts as through ``stage`` (what a checkpoint restored)."""
        with self._cv:
            self._done[stage] = max(self._done[stage], iteration)
            self._cv.notify_all()

    def wait(self, stage: str, iteration: int) -> None:
        """Until ``iteration`` is through ``stage`` (at once for iterations before the first)."""
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or self._done[stage] >= iteration)
            self._raise()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = error
            self._cv.notify_all()

    def _raise(self) -> None:
        if self._error is not None:  # the stage's own error, so the run ends with what went wrong
            raise self._error


_PRIORITY_WARNED = False  # lower_priority: said once that this system cannot lower it


def lower_priority(nice: int) -> int:
    """Lower the calling thread's scheduling priority by ``nice`` (capped at 19, the lowest), and
    return its nice value after. Linux schedules each thread on its own, so the training thread keeps
    its priority. MSPipe's stage and update threads run so (``pipeline.stage_nice``): on a CPU the
    training thread's torch kernels want every core at moments, and a stage thread at the same
    priority then holds one of them, slowing training by about the stage's time; at a lower priority
    the stages fill the cycles that training leaves idle. Where a thread's priority cannot be
    changed (not Linux), it stays as it is, said once in the log."""
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > 0:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as e:  # pragma: no cover - not Linux
        global _PRIORITY_WARNED
        if not _PRIORITY_WARNED:
            _PRIORITY_WARNED = True
            log.info("pipeline.stage_nice: this system does not let a thread's priority be lowered (%s); the stage "
                     "threads keep the training thread's", e)
        return 0


class StageStreams:
    """MSPipe on a GPU (Appendix D): the stages before training (sample, features, memory fetch)
    enqueue their copies and kernels on a ``fetch`` CUDA stream and the memory update on an
    ``update`` stream, so they overlap training's kernels on the thread's current stream. On a CPU
    (or any non-CUDA device) every method does nothing and ``on_stream`` runs its block as it is.

    Ordering across streams is kept in host order, which the stage locks already enforce: a stage
    block first waits for an event the main thread recorded when it handed the work over (the
    memory it reads: resets, evaluation, a parallel run's exchange), and a stage's turn ends only
    once its stream has finished (``finish``), so whatever waits for that turn sees the work done.
    Tensors a stage made are used on the consumer's stream (``hand_over`` records that use, so the
    caching allocator does not give their blocks to the stage's stream while training reads them)."""

    def __init__(self, device):
        self.on = torch.device(device).type == "cuda"
        self.streams = {}
        if self.on:
            self.streams = {"fetch": torch.cuda.Stream(device), "update": torch.cuda.Stream(device)}

    def mark(self):
        """(the handing thread) An event after everything it has enqueued so far; None on a CPU."""
        if not self.on:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @contextmanager
    def on_stream(self, name: str, after=None):
        """Run the block with stream ``name`` current (in this thread), after event ``after``."""
        if not self.on:
            yield
            return
        stream = self.streams[name]
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            yield

    def finish(self, name: str) -> None:
        """Wait until stream ``name`` has done what was enqueued on it (before a stage's turn ends)."""
        if self.on:
            self.streams[name].synchronize()

    def settle(self) -> None:
        """Wait until the calling thread's current stream is done (a parallel run's exchange, made
        by the main thread, before the reads that wait for it may start)."""
        if self.on:
            torch.cuda.current_stream().synchronize()

    def hand_over(self, obj):
        """Record every CUDA tensor in ``obj`` (dataclasses, lists, tuples, dicts) as used by the
        calling thread's current stream; returns ``obj``."""
        if self.on:
            stream = torch.cuda.current_stream()
            for t in tensors_in(obj):
                if t.is_cuda:
                    t.record_stream(stream)
        return obj


def tensors_in(obj, seen=None) -> list:
    """The tensors in ``obj``, found through dataclass fields, lists, tuples and dict values."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif hasattr(obj, "__dataclass_fields__"):
        items = [getattr(obj, f) for f in obj.__dataclass_fields__]
    else:
        return []
    return [t for x in items for t in tensors_in(x, seen)]


# ----------------------------------------------------------------------------------------------
# Similarity-based staleness mitigation (MSPipe-S, section 3.3)


def stale_rows(updated: torch.Tensor, now: float, gamma: float) -> list[int]:
    """The rows whose memory was last updated (``updated``: the time of its latest write, -inf for
    a node never written, which is new, not stale) more than ``gamma`` before ``now``."""
    return torch.nonzero(torch.isfinite(updated) & ((now - updated) > gamma)).flatten().tolist()


def mitigate(mem: torch.Tensor, updated: torch.Tensor, now: float, similar, gamma: float, lam: float) -> torch.Tensor:
    """s_hat_v = lambda s_v + (1 - lambda) mean_{u in Omega(v)} s_u for every read node v whose memory
    was last updated more than ``gamma`` before ``now`` (``stale_rows``); Omega(v): the rows of
    ``similar[v]`` (most similar first) that are active (updated at most ``gamma`` before ``now``)
    and fresher than v. Nodes with no such u, and fresh nodes, keep their memory. ``updated
    [n]``: the time of each row's latest write. Returns a new tensor ``[n, mem_dim]``. Every
    stale row at once: the candidates padded to one matrix, Omega a mask over it."""
    out = mem.clone()
    stale = stale_rows(updated, now, gamma)
    found = [np.asarray(similar.get(v, ()) if isinstance(similar, dict) else similar[v], dtype=np.int64)
             for v in stale]  # (``similar``: a dict by row, or a sequence over every row)
    rows = [v for v, f in zip(stale, found) if f.size]
    found = [f for f in found if f.size]
    if not rows:
        return out
    cand = np.full((len(rows), max(f.size for f in found)), -1, dtype=np.int64)
    for i, f in enumerate(found):
        cand[i, :f.size] = f
    cand = upload(cand, mem.device)
    rows_t = torch.tensor(rows, dtype=torch.long, device=mem.device)
    c = cand.clamp(min=0)
    omega = (cand >= 0) & ((now - updated[c]) <= gamma) & (updated[c] > updated[rows_t].unsqueeze(1))
    size = omega.sum(1)
    i, j = omega.nonzero(as_tuple=True)  # the (stale row, member of its Omega) pairs
    if i.numel():
        total = torch.zeros(len(rows), mem.shape[1], dtype=mem.dtype, device=mem.device)
        total.index_add_(0, i, mem.index_select(0, c[i, j]))
        has = size > 0
        r = rows_t[has]
        out[r] = lam * mem[r] + (1 - lam) * total[has] / size[has].unsqueeze(1).to(mem.dtype)
    return out


def quantile_gap(gaps: np.ndarray, q: float = 0.99) -> float:
    """gamma: the ``q`` quantile of the time since nodes' memories were last updated (section 3.3)."""
    gaps = np.asarray(gaps, dtype=np.float64)
    gaps = gaps[np.isfinite(gaps)]
    return float(np.quantile(gaps, q)) if gaps.size else float("inf")


def similar_nodes(tcsr, ids: np.ndarray, rows: Sequence[int], before, recent: int = 10, top: int = 10) -> dict:
    """Omega's candidates (section 3.3: similarity by common neighbours): for each row v of
    ``rows``, the rows of ``ids`` whose nodes share a neighbour with node ``ids[v]``, most shared
    neighbours first (ties: lower row), at most ``top``. Neighbours are a node's ``recent`` latest
    ones before time ``before`` (the graph's time unit) in the temporal CSR ``tcsr``: the batch's
    own and later events are never looked at. (``kernels.graph.common_neighbour_rows``; ``ids``
    are distinct, a batch's unique nodes.)"""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return {}
    got = kernels.common_neighbour_rows(tcsr.indptr, tcsr.nbr, tcsr.t, np.asarray(ids, dtype=np.int64), rows,
                                        np.asarray(before, dtype=tcsr.t.dtype)[()], recent, top)
    return {int(v): g[g >= 0] for v, g in zip(rows.tolist(), got)}


def update_gaps(src: np.ndarray, dst: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Delta t of section 3.3: for every event endpoint after a node's first event, the time since
    that node's previous event (when its memory was last updated, reading without staleness)."""
    nodes = np.concatenate([src, dst])
    times = np.concatenate([t, t]).astype(np.float64)
    order = np.lexsort((times, nodes))
    n, tt = nodes[order], times[order]
    same = n[1:] == n[:-1]
    return (tt[1:] - tt[:-1])[same]


# ----------------------------------------------------------------------------------------------
# The strategy


def staleness(pipe) -> int | None:
    """``pipeline.staleness`` as a count, or None for ``auto``; a bad value is a ConfigError."""
    return count_of(pipe, "staleness")


Mitigation = choice_type("Mitigation", "none similarity", __name__)  # pipeline.mitigation: MSPipe-S or none


@dataclass
class MSPipeConfig(PipelineConfig):
    """``pipeline.*`` of MSPipe: the section's keys, the staleness bound and MSPipe-S. It takes whole
    batches (no ``micro_batches``)."""

    # K: a count (0: the plain loop), or auto (the minimal stall-free bound from stage times
    # measured over profile_iterations iterations, constraints C1-C3)
    staleness: str = count_or_auto(0, "the iterations of writes a read may miss (0: none)", "auto")
    max_stale_fraction: float = 0.5  # staleness=auto, C3: at most this share of the nodes read may be stale
    # none, or similarity (MSPipe-S, 3.3): a read node whose memory is older than gamma (the
    # mitigation_quantile of the time between a node's events) gets lambda s_v + (1 - lambda) * the
    # mean memory of the most similar active nodes of its batch (common neighbours)
    mitigation: Mitigation = Mitigation.none
    mitigation_lambda: float = 0.95  # similarity: lambda, the weight of the node's own stale memory
    mitigation_quantile: float = 0.99  # similarity: gamma is this quantile of the time between a node's events
    # how much lower (nice, 0-19) the priority of its stage and update threads is than the training
    # thread's; 19: they take the cycles training leaves idle instead of slowing it down
    stage_nice: int = 19


class MSPipeHooks(StepHooks):
    """Iteration t's step under MSPipe: before the write, the reads that must miss it are waited
    for; the write goes to the update stage (one process) or is made at once (a parallel run,
    whose exchange is the update stage); gradients through the run's ``GradientSync``."""

    def __init__(self, pipeline: "MSPipe", t: int):
        self._pipeline, self._t = pipeline, t

    def before_write(self) -> None:
        self._pipeline._before_write(self._t)

    def write(self, fn) -> None:
        p = self._pipeline
        if p.ctx.alone:
            p._update_stage(self._t)(fn)
        else:
            fn()

    def written(self) -> None:
        self._pipeline.trainer.memory.start_exchange()

    def sync_gradients(self, params) -> bool:
        return self._pipeline.grads(params)


@register("mspipe")
class MSPipe(Pipeline):
    """MSPipe's stages overlap across iterations (MSPipe 3.2, Algorithm 1): iteration u's sample,
    features and memory read run in a stage thread ahead of its training, its read missing the
    writes of the last K_u iterations and no more (``read_ahead``); in one process its memory
    update runs in an update thread after its forward pass. K fixed (``pipeline.staleness``) or
    the minimal stall-free bound from measured stage times (``auto``); MSPipe-S mitigates stale
    rows (``pipeline.mitigation=similarity``)."""

    name = "mspipe"
    Config = MSPipeConfig

    def __init__(self, ctx: PipelineContext):
        super().__init__(ctx)
        tr, pipe = self.trainer, self.pipe
        self.staleness = staleness(pipe)  # K (reads made K iterations ahead); None: auto, measured
        self.bounds = None  # staleness=auto: what it measured and chose (the summary's)
        self._online = None  # staleness=auto: K of each position in an epoch, the online schedule's k_i - 1
        self._stage_rows: list = []  # staleness=auto: per measured iteration, its stage seconds, reads, writes
        self._stages = None  # staleness=auto: the stage clocks at the start of this iteration
        self._row = None  # ... and this iteration's measured row
        self.start = 0
        self._next_read = 0  # the next batch (iteration) to read
        self._read_k: dict[int, int] = {}  # the K each read in flight was issued with
        self._locks: StageLocks | None = None  # the per-stage locks of Algorithm 1
        self._read_pool: ThreadPoolExecutor | None = None  # the stages before training, a thread per batch
        self._write_pool: ThreadPoolExecutor | None = None  # the memory update stage
        self._writes: list[Future] = []  # memory updates handed to the update stage, not yet waited for
        self._handed = False  # this iteration's update was handed to the update stage
        self._stepped: int | None = None  # the last iteration whose step ended (after_step)
        self.stage_spans: list | None = None  # a list to record each stage's turns in (timelines, tests)
        self._streams = StageStreams(tr.device)  # on a GPU: its CUDA streams
        self.gamma = None  # MSPipe-S: seconds after which a read node's memory counts as stale
        self._stale_read = self._mitigated = 0  # MSPipe-S: stale rows read, and those it changed
        if pipe.mitigation == "similarity":
            n = tr.split.range("train")[1]
            self.gamma = quantile_gap(update_gaps(tr.g.src[:n], tr.g.dst[:n], tr.t_rel[:n]), pipe.mitigation_quantile)
            self._tcsr = tr.sampler.tcsr if tr.sampler is not None else TCSR.build(tr.g)

    @classmethod
    def validate(cls, pipe, parallel=None, backend: str = "auto") -> None:
        staleness(pipe)
        if not 0 < pipe.max_stale_fraction <= 1:
            raise ConfigError(f"pipeline.max_stale_fraction={pipe.max_stale_fraction}: give a share in (0, 1]")
        if not 0 <= pipe.mitigation_lambda <= 1:
            raise ConfigError(f"pipeline.mitigation_lambda={pipe.mitigation_lambda}: give a weight in [0, 1]")
        if not 0 < pipe.mitigation_quantile <= 1:
            raise ConfigError(f"pipeline.mitigation_quantile={pipe.mitigation_quantile}: give a quantile in (0, 1]")
        if not 0 <= pipe.stage_nice <= 19:
            raise ConfigError(f"pipeline.stage_nice={pipe.stage_nice}: give a nice increment from 0 (the training "
                              f"thread's priority) to 19 (the lowest)")
        world = None if parallel is None else parallel.i * parallel.j * parallel.k
        if world is not None and world > 1 and not memory.store_class(backend).staged_reads:
            # its stage threads read memory while the main thread runs the run's collectives: a
            # store whose reads are collectives (sven, depcomm) would need them in one order on
            # every rank, and a daemon serves its group's reads and writes strictly in stream order
            staged = [n for n in memory.names() if memory.store_class(n).staged_reads]
            raise ConfigError(f"pipeline.mode=mspipe runs in one process or on memory in the trainers "
                              f"(memory.backend=auto, {' or '.join(staged)}): parallel.i*j*k={world} "
                              f"({parallel.i}x{parallel.j}x{parallel.k}) with memory.backend={backend} is not "
                              f"supported with it")  # (the registered stores whose reads may be staged)

    # -- the loop's hooks ---------------------------------------------------------------------------

    SIMULATED = 400  # iterations of the schedule ``price`` simulates at most (its steady state is reached well before)

    @classmethod
    def price(cls, pipe, c: IterationCosts) -> Price:
        """The five stages overlap across iterations (MSPipe 3.2, eq. (3)-(4), C1-C3): the iteration is
        the steady pace of ``staleness_bounds``' stall-free schedule (the store's dispatch with the
        memory read, the gradients and collectives with the training, the aggregation with the
        update), reached by the measured share ``c.overlap`` of its saving over the stages in turn;
        its steady K is the staleness it reads at."""
        tau = (c.sample, c.features, c.memory_read + c.dispatch, c.compute + c.allreduce + c.collective_cpu,
               c.memory_write + c.aggregation)
        sim = min(c.iterations, cls.SIMULATED)
        bounds = staleness_bounds(tau, sim)
        half = sim // 2
        if sim > 2:
            ideal = float(bounds.end[-1, 4] - bounds.end[half, 4]) / (sim - 1 - half)
        else:
            ideal = float(bounds.end[-1, 4]) / sim
        K = bounds.steady()
        risk = [(1, f"memory staleness K = {K} (MSPipe 3.2; tgdist measured -0.67 AP point at K = 1 on CollegeMsg)")]
        return Price(sum(tau) - c.overlap * (sum(tau) - ideal), staleness=K, risk=risk if K > 0 else [])

    def begin(self, start: int) -> None:
        """What a checkpoint restored is through its stages already."""
        self.start, self._stepped = start, None
        self._locks = StageLocks(STAGES, done=start - 1)
        self._locks.spans = self.stage_spans
        self._locks.mark("memory_read", self._next_read - 1)  # the batches it read ahead

    def read_ahead(self, t: int) -> None:
        """At the start of iteration t: hand to the stage threads (Algorithm 1: a thread per batch,
        ``StageLocks``) the positions u not handed yet whose read may happen during iteration t,
        those with u - K_u - 1 <= t, in order. Each thread samples, organizes and reads
        (``_front``); its read waits for the update of position u - K_u - 1 and the update of
        u - K_u waits for the read (``_before_write``), so position u misses exactly the writes of
        u - K_u .. u - 1. Subgroup 0 writes position p at iteration p, so a position is read on
        the same schedule by every subgroup; subgroup jj trains it jj iterations later (epoch
        parallelism: DistTGL's read slots, here a read per position in flight or done).
        Reads never cross an epoch: the next epoch starts from reset memory, after evaluation, so
        its first batches read it alike (the warm-up, MSPipe Appendix D.3). Nor a reset inside one
        (memory parallelism, k > 1: a group's stream wraps to its first batch mid-pass): the
        position that resets is read at its own iteration, after every write before it, so the
        positions after a reset miss only writes made since."""
        self._check_passed_on(f"iteration {t}'s reads")
        ctx, mem, locks, jj = self.ctx, self.trainer.memory, self._locks, self.jj
        nb = ctx.batches_per_epoch
        self._stages = dict(self.trainer.timer.seconds) if self.staleness is None else None  # auto measures
        self._row, self._handed = None, False
        end = min((t // nb + 1) * nb, ctx.iterations - (ctx.layout.j - 1))  # (positions of the group)
        self._next_read = max(self._next_read, t)
        while self._next_read < end and self._next_read - self._staleness_of(self._next_read) - 1 <= t:
            u = self._next_read
            s = ctx.step(u + jj)  # the step at which this rank trains position u
            if u > t and s.active and s.reset_memory:
                break
            if s.active:
                mem.open_position(s.position, s.read_slot, s.reset_memory)
                sampled, self._sampler_calls = self.sampled(u)  # (the prefetch thread's, when on)
                stages = ("memory_read",) if sampled is not None else ("sample", "features", "memory_read")
                tickets = {st: locks.ticket(st) for st in stages}
                k = self._read_k[u] = self._staleness_of(u)
                self.slots[u] = self._reader().submit(self._front, u, k, s, ctx.negatives(s), sampled, tickets,
                                                      self._streams.mark())  # (after the reset above, on a GPU)
                mem.close_position()
            self._next_read += 1

    def take(self, t: int, now):
        """The batch of position ``now.position``, waited for if in flight (it may wait for this
        iteration's update: reads are not settled first); handed over from the fetch stream."""
        self.grads.issue()  # asynchronous all-reduce: the last iteration's, now that the reads are out
        p = self.slots.pop(now.position, None)
        if isinstance(p, Future):
            p = p.result()
        self._read_k.pop(now.position, None)
        if p is not None:
            p = self._streams.hand_over(p)  # (made on the fetch stream)
        if self._stages is not None and now.active and now.hi > now.lo:  # C3's data: nodes read and written
            g = self.trainer.g
            self._row = {"reads": p.ids.cpu().numpy(),
                         "writes": np.unique(np.concatenate([g.src[now.lo:now.hi], g.dst[now.lo:now.hi]]))}
            self._stage_rows.append(self._row)
        return p

    def hooks(self, t: int) -> StepHooks:
        return MSPipeHooks(self, t)

    def after_step(self, t: int) -> None:
        self._stepped = t
        if self.ctx.alone:
            if not self._handed:  # no write made: the update stage still passes t
                self._update_stage(t)(lambda: None)
        else:  # (a rank that does not write waits here for reads that must miss t)
            self._before_write(t)

    def after_exchange(self, t: int) -> None:
        if not self.ctx.alone:  # the update stage is here: the writes are in every replica now
            self._streams.settle()  # (on a GPU: done there too, before the reads that wait for them start)
            with self._locks.turn("memory_write", self._locks.ticket("memory_write"), t):
                pass

    def _check_passed_on(self, where: str) -> None:
        """In a parallel run the update stage is the store's exchange, which ``after_exchange``
        passes on to the reads: an iteration that ended without it would leave every later read
        waiting for that write for ever. Checked before ``where`` (the next reads, or a drain)."""
        t = self._stepped
        if not self.ctx.alone and t is not None and self._locks.done("memory_write") < t:
            raise RuntimeError(f"pipeline.mode=mspipe: iteration {t} ended without after_exchange({t}), which passes its "
                               f"memory write on to the reads; {where} would wait for it for ever")

    def after_iteration(self, t: int, seconds: float) -> None:
        if self._stages is None:
            return
        tr = self.trainer
        if self._row is not None:
            self._row["seconds"] = [tr.timer.seconds.get(k, 0.0) - self._stages.get(k, 0.0) for k in STAGES]
        if t + 1 - self.start == self.pipe.profile_iterations or t + 1 == self.ctx.iterations:
            self._choose_staleness()

    def settle(self) -> None:
        """Wait for the reads in flight: before a batch is used, a checkpoint, the end."""
        for u, p in self.slots.items():
            if isinstance(p, Future):
                self.slots[u] = p.result()
                self._read_k.pop(u, None)

    def drain(self) -> None:
        """Wait for every update handed over and every read in flight (before evaluation, a
        checkpoint, the end); an error in a stage is raised here."""
        self._check_passed_on("the drain")
        writes, self._writes = self._writes, []
        for f in writes:
            f.result()
        self.settle()

    def close(self) -> None:
        super().close()
        if self._locks is not None:  # stages still waiting (after an error) give up
            self._locks.fail(RuntimeError("the run is closing"))
        for name in ("_read_pool", "_write_pool"):
            if getattr(self, name) is not None:
                getattr(self, name).shutdown(wait=True, cancel_futures=True)
                setattr(self, name, None)

    # -- checkpoints and the summary ----------------------------------------------------------------

    def state(self) -> dict:
        return {**super().state(), "staleness": self.staleness, "staleness_bounds": self.bounds}

    def _resampled(self, slots: dict) -> int:
        # the slots are sampled again, with the draws they had
        return len(slots) if self.trainer.model.num_hops else 0

    def load_state(self, mine: dict) -> None:
        super().load_state(mine)
        self._next_read = max(self.slots, default=-1) + 1
        if self.staleness is None and mine.get("staleness") is not None:
            self.staleness = int(mine["staleness"])  # auto chose it before the checkpoint
            self.bounds = b = mine.get("staleness_bounds")
            self._online = read_schedule(staleness_bounds(b["tau"], self.ctx.batches_per_epoch, b["max_staleness"])
                                         .staleness)

    def summary(self) -> dict:
        pipe = self.pipe
        out = {**super().summary(), "staleness": self.staleness, "bounds": self.bounds, "stage_nice": pipe.stage_nice}
        if self.gamma is not None:
            out["mitigation"] = {"gamma_s": self.gamma, "lambda": pipe.mitigation_lambda,
                                 "stale_rows_read": self._stale_read, "rows_mitigated": self._mitigated}
        return out

    # -- the stages -------------------------------------------------------------------------------

    def _staleness_of(self, u: int) -> int:
        """K of iteration ``u``'s read: 0 while auto measures, then the online schedule's k_i - 1
        for its position in the epoch (``staleness_bounds``), or the fixed ``pipeline.staleness``."""
        if self.staleness is None:
            return 0
        if self._online is not None:
            return int(self._online[min(u % self.ctx.batches_per_epoch, len(self._online) - 1)])
        return self.staleness

    def _front(self, u: int, k: int, s, neg, sampled, tickets: dict, after=None):
        """(a stage thread) MSPipe's stages 1-3 of iteration ``u``, each in its turn: sample,
        features (skipped when the prefetch thread made them), then the memory read once the update
        of u - k - 1 is done (Algorithm 1, line 9; at once in the epoch's first k + 1 iterations),
        mitigated with MSPipe-S when on. On a GPU they run on the fetch stream, after event
        ``after`` (what the main thread had enqueued when it handed the batch over), and the read's
        turn ends once that stream is done (``StageStreams``)."""
        tr, locks, streams = self.trainer, self._locks, self._streams
        try:
            with streams.on_stream("fetch", after):
                if sampled is None:
                    sampled = tr.sample(s.lo, s.hi, neg, turn=lambda stage: locks.turn(stage, tickets[stage], u))
                locks.wait("memory_write", u - k - 1)  # (before its turn: its span is the read alone)
                with locks.turn("memory_read", tickets["memory_read"], u):
                    p = self._mitigate(tr.prepare(s.lo, s.hi, neg, sampled=sampled))
                    streams.finish("fetch")
                    return p
        except BaseException as e:  # the later stages' threads are not left waiting for this one
            locks.fail(e)
            raise

    def _before_write(self, t: int) -> None:
        """Before the update of position t: wait until the reads that must miss it (u - K_u <= t;
        with epoch parallelism u = t too, trained later) are done. (Reads that must see it wait
        for it in their thread; those of positions trained already are out of ``_read_k``.)"""
        last = max((u for u, k in self._read_k.items() if u - k <= t), default=None)
        if last is not None:
            self._locks.wait("memory_read", last)

    def _update_stage(self, t: int):
        """MSPipe's stage 5 for iteration t: a function taking the write (a function of no
        arguments), which runs in the update thread in its turn (after t - 1's), overlapping t's
        backward pass and the next iteration."""
        locks, tr, streams = self._locks, self.trainer, self._streams
        ticket = locks.ticket("memory_write")

        def update(write, after):  # (on a GPU: on the update stream, after the forward pass that made the rows)
            with locks.turn("memory_write", ticket, t):
                began = time.perf_counter()
                with streams.on_stream("update", after):
                    write()  # (it holds the rows until the stream is done with them: no hand-over needed)
                streams.finish("update")
                tr.timer.add("memory_write", time.perf_counter() - began)

        def hand(write):
            self._handed = True
            if self._write_pool is None:
                self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="tgdist-mspipe-update",
                                                      initializer=lower_priority,  # pipeline.stage_nice
                                                      initargs=(self.pipe.stage_nice,))
            self._writes.append(self._write_pool.submit(update, write, streams.mark()))

        return hand

    def _reader(self) -> ThreadPoolExecutor:
        if self._read_pool is None:  # Algorithm 1's thread per batch in flight (more queue, in order)
            self._read_pool = ThreadPoolExecutor(MSPIPE_THREADS, thread_name_prefix="tgdist-mspipe-stages",
                                                 initializer=lower_priority,  # pipeline.stage_nice
                                                 initargs=(self.pipe.stage_nice,))
        return self._read_pool

    def _mitigate(self, p):
        """MSPipe-S (3.3) on a training read (``pipeline.mitigation=similarity``): each node of the
        batch whose latest write (its latest mail's time) is older than gamma at the batch's first
        event gets lambda s_v + (1 - lambda) * the mean memory of its most similar active
        nodes of the batch (``similar_nodes``, ``mitigate``). The memory times stay."""
        if self.gamma is None:
            return p
        tr, r = self.trainer, p.read
        now = float(tr.t_rel[p.lo])
        updated = r.mail_ts.max(1).values  # a node's latest write is its latest mail's event
        rows = stale_rows(updated, now, self.gamma)
        if rows:
            similar = similar_nodes(self._tcsr, p.ids.cpu().numpy(), rows, tr.g.t[p.lo])
            mem = mitigate(r.mem, updated, now, similar, self.gamma, self.pipe.mitigation_lambda)
            self._stale_read += len(rows)
            self._mitigated += int((mem != r.mem).any(1).sum())
            p.read = MemoryRead(mem, r.mem_ts, r.mail, r.mail_ts, r.empty)  # (mails unchanged)
        return p

    def _choose_staleness(self) -> None:
        """staleness=auto, after ``profile_iterations`` iterations read without staleness: the
        stage times tau (the median per stage of the measured iterations but the first, which
        compiles kernels), C3's cap from the nodes they read and wrote, and k_i over an epoch from
        C1-C2 (``staleness_bounds``); the run then reads with each position's K_i (the online
        schedule, ``read_schedule``). A parallel run takes rank 0's choice on every rank."""
        ctx, pipe = self.ctx, self.pipe
        rows = [r for r in self._stage_rows if "seconds" in r]
        self._stage_rows = []
        choice = (0, None, None)
        if rows:
            timed = rows[1:] or rows
            tau = np.median(np.array([r["seconds"] for r in timed]), axis=0)
            cap = max_staleness([r["reads"] for r in rows], [r["writes"] for r in rows], pipe.max_stale_fraction,
                                upper=max(len(rows) - 1, 0))
            bounds = staleness_bounds(tau, ctx.batches_per_epoch, cap)
            choice = (bounds.steady(), read_schedule(bounds.staleness).tolist(),
                      {"tau": [round(float(x), 6) for x in tau], "stages": list(STAGES), "max_staleness": cap,
                       "steady_k": bounds.steady() + 1, "stall_s": round(float(bounds.stall.sum()), 6),
                       "schedule": "online", "k_per_position": _runs(bounds.k)})
        if not ctx.alone:
            choice = collectives.broadcast_object(choice, group=ctx.groups.get("world"), name="staleness",
                                                  counter=collectives.ByteCounter())
        self.staleness, online, self.bounds = choice
        self._online = None if online is None else np.asarray(online, dtype=np.int64)
        if self.bounds is None:
            log.info("pipeline.staleness=auto: nothing measured (empty batches?); using 0")
        elif ctx.rank == 0:
            b = self.bounds
            log.info("pipeline.staleness=auto: K=%d (the paper's k=%d) from stage times %s ms, C3's cap K<=%d "
                     "(at most %.0f%% of the nodes read stale)", self.staleness, self.staleness + 1,
                     ", ".join(f"{n} {1e3 * x:.2f}" for n, x in zip(STAGES, b["tau"])), b["max_staleness"],
                     100 * pipe.max_stale_fraction)


def _runs(k: np.ndarray) -> list[list[int]]:
    """``[[k, count], ...]``: a per-position schedule told in runs (the summary's)."""
    out: list[list[int]] = []
    for v in np.asarray(k).tolist():
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out
