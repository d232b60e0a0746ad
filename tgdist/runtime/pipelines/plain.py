"""The plain loop with Sven's levels (Sven 3.3; DESIGN.md "Pipelines"): ``pipeline.mode=plain``.

Every stage of an iteration runs after the previous one (DESIGN.md "One training iteration"), and
the levels of Sven's hierarchical pipelining, each a controlled change that leaves training as it
was, switch on alone or together:

- prefetch (``pipeline.prefetch=Q``, ``base.Prefetcher``): the next Q batches sampled in a
  background thread; bit-identical;
- micro-batches (``pipeline.micro_batches=N|auto``, Sven 3.3.2): each batch in N micro-batches
  whose reads travel while the previous one computes (``Trainer.prepare_micro`` and
  ``Trainer.compute``); gradients accumulate to the batch's; ``auto`` fits eq. (12) over the first
  iterations (``fit_granularity``);
- asynchronous all-reduce (``pipeline.async_allreduce``, Sven 3.3.3, ``base.GradientSync``).

With epoch parallelism (j > 1) subgroup jj trains position p at iteration p + jj but reads its
memory at iteration p, before subgroup 0 writes p: the read slots of DistTGL, which this
strategy fills one iteration ahead (``read_ahead``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tgdist.config import PipelineConfig, count_or_auto
from tgdist.distributed import collectives
from tgdist.errors import ConfigError
from tgdist.runtime.pipelines.base import IterationCosts, Pipeline, PipelineContext, Price, StepHooks, count_of
from tgdist.runtime.pipelines.registry import register
from tgdist.runtime.trainer import SIDE_STREAMS, micro_bounds

log = logging.getLogger(__name__)


def micro_batches(pipe) -> int | None:
    """``pipeline.micro_batches`` as a count, or None for ``auto``; a bad value is a ConfigError."""
    return count_of(pipe, "micro_batches")


class PlainHooks(StepHooks):
    """The plain step of a run: reads settled before the write, the store's exchange started after
    it, gradients through the run's ``GradientSync``."""

    def __init__(self, pipeline: "Plain"):
        self._pipeline = pipeline

    def before_write(self) -> None:
        self._pipeline.settle()

    def written(self) -> None:
        self._pipeline.trainer.memory.start_exchange()

    def sync_gradients(self, params) -> bool:
        return self._pipeline.grads(params)


@dataclass
class PlainConfig(PipelineConfig):
    """``pipeline.*`` of the plain loop: the section's keys, and Sven's micro-batches."""

    # micro-batches per batch (Sven 3.3.2): 1 (none), N, or auto (eq. (12) fitted over the first iterations)
    micro_batches: str = count_or_auto(1, "a number of micro-batches per batch (1: none)", "1")
    max_micro_batches: int = 8  # micro_batches=auto: the largest n it may choose


@register("plain", "none")
class Plain(Pipeline):
    """The plain loop and Sven's levels (this module's docstring)."""

    name = "plain"
    Config = PlainConfig

    def __init__(self, ctx: PipelineContext):
        super().__init__(ctx)
        self.micro = micro_batches(self.pipe)  # None: auto, measured over the first iterations
        self.fit: Granularity | None = None  # the eq. (12) fit of micro_batches=auto
        self.start = 0  # the run's first iteration (a resumed run's), where auto's measuring starts
        self._ahead = None  # the step read ahead this iteration, when this rank read one
        self._hooks = PlainHooks(self)
        self._profile_rows: list = []  # micro_batches=auto: per profiled batch, its read and eta data
        self._profile_steps: list = []  # ... and the seconds of each profiled iteration
        self._measuring = 0.0  # seconds of this iteration spent measuring, not training

    @classmethod
    def validate(cls, pipe, parallel=None, backend: str = "auto") -> None:
        micro_batches(pipe)
        if pipe.max_micro_batches < 1:
            raise ConfigError(f"pipeline.max_micro_batches={pipe.max_micro_batches}: give at least 1")

    @classmethod
    def micro_batches(cls, pipe) -> int | None:
        return micro_batches(pipe)

    @classmethod
    def price(cls, pipe, c: IterationCosts) -> Price:
        """With micro-batches (Sven 3.3.2), n of them: the dispatch overlaps the memory update and the
        aggregation the GNN layers, T(n) = max(C, D) + min(C, D) / n + (n - 1) o, n as ``auto``
        chooses it (``micro_count``: eq. (12)'s n* at the batch) or the given count; the other
        levels as ``Pipeline.price``."""
        n = micro_batches(pipe)
        if n == 1:
            return super().price(pipe, c)
        if n is None:
            n = micro_count(c.compute, c.dispatch, c.micro_overhead, pipe.max_micro_batches) if c.dispatch > 0 else 1
        C, D = c.compute, c.dispatch
        rest = (c.memory_read + max(C, D) + min(C, D) / n + (n - 1) * c.micro_overhead + c.memory_write
                + max(0.0, c.aggregation - C) + cls._allreduce_path(pipe, c) + c.collective_cpu)
        return Price(cls._prefetched(pipe, c, c.sample + c.features, rest), micro_batches=n,
                     extra_cpu=(n - 1) * (c.micro_overhead - c.micro_latency), risk=cls._gradient_risk(pipe))

    def begin(self, start: int) -> None:
        self.start = start

    def read_ahead(self, t: int) -> None:
        """The position this subgroup trains at iteration t + jj, read now, before subgroup 0 writes
        it at the end of this iteration (at once for subgroup 0)."""
        ctx, mem = self.ctx, self.trainer.memory
        ahead = ctx.step(t + self.jj) if t + self.jj < ctx.iterations else None
        self._ahead = ahead if ahead is not None and ahead.active else None
        if self._ahead is not None:
            mem.open_position(ahead.position, ahead.read_slot, ahead.reset_memory)
            self.slots[ahead.read_slot] = self._prepare(t, ahead, lookup=self.jj == 0)
            if self.jj:  # this position's read is done; subgroup 0 writes it below
                mem.close_position()

    def take(self, t: int, now):
        self.grads.issue()  # asynchronous all-reduce: the last iteration's, now that the reads are out
        self.settle()
        return self.slots.pop(now.read_slot, None)

    def hooks(self, t: int) -> StepHooks:
        return self._hooks

    def after_step(self, t: int) -> None:
        if self.jj == 0 and self._ahead is not None:
            self.trainer.memory.close_position()  # subgroup 0 has written the position it read

    def after_iteration(self, t: int, seconds: float) -> None:
        if self.micro is None:
            self._profile_steps.append(seconds - self._measuring)
            self._measuring = 0.0
            if t + 1 - self.start == self.pipe.profile_iterations:
                self._choose_micro_batches()

    def state(self) -> dict:
        return {**super().state(), "micro_batches": self.micro}

    def load_state(self, mine: dict) -> None:
        super().load_state(mine)
        if self.micro is None and mine.get("micro_batches") is not None:
            self.micro = int(mine["micro_batches"])  # auto chose it before the checkpoint: not measured again

    def summary(self) -> dict:
        fit = None if self.fit is None else {k: round(float(v), 6) for k, v in vars(self.fit).items()}
        return {**super().summary(), "micro_batches": self.micro, "fit": fit}

    # -- reads --------------------------------------------------------------------------------------

    def _prepare(self, t: int, s, lookup: bool = False):
        """The batch of step ``s`` (read ahead at iteration ``t``) sampled, organized and read:
        one ``Prepared``, or one per micro-batch. Its sampling comes from the prefetch worker when
        there is one (from the end of auto's measured iterations on); the memory read is always
        made here, in order with the writes. ``lookup``: ``s`` trains at iteration ``t``, so the
        embedding cache is looked up and the subgraph pruned before the read (``Trainer.prepare``)."""
        tr, n, neg = self.trainer, self.micro or 1, self.ctx.negatives(s)
        if self.micro is None:  # auto: measuring, with one micro-batch, then two
            n = 1 if t - self.start < self.pipe.profile_iterations // 2 else 2
        sampled = None
        if self.pipe.prefetch and self.micro is not None:
            sampled, self._sampler_calls = self.sampled(t, n)
        if n > 1:
            return tr.prepare_micro(s.lo, s.hi, neg, n, sampled=sampled, lookup=lookup)
        read_before = tr.timer.seconds["memory_read"]
        p = tr.prepare(s.lo, s.hi, neg, sampled=sampled, lookup=lookup)
        if self.micro is None:
            self._measure_rows(s, neg, tr.timer.seconds["memory_read"] - read_before)
        return p

    # -- micro_batches=auto ---------------------------------------------------------------------------

    def _measure_rows(self, s, neg, read_s: float) -> None:
        """micro_batches=auto: eq. (22)'s data for this batch (rows to read per event in
        micro-batches of 1/1, 1/2, 1/4 and 1/8 of it; sampled on a side stream, so training's
        sampling is untouched) and the seconds its read took. The sampling here is not the
        iteration's: its time is left out of the iteration's (``_measuring``)."""
        tr = self.trainer
        began = time.perf_counter()
        b = s.hi - s.lo
        points = []
        with tr.side_stream(SIDE_STREAMS["replay"]):
            for parts in (1, 2, 4, 8):
                if b // parts < 1:
                    break
                rows = sum(int(tr.sample(a, c, neg[a - s.lo:c - s.lo]).ids.numel())
                           for a, c in micro_bounds(s.lo, s.hi, parts))
                points.append((b / parts, rows / b))
        self._profile_rows.append({"read_s": read_s, "eta": points, "events": b})
        self._measuring += time.perf_counter() - began

    def _choose_micro_batches(self) -> None:
        """micro_batches=auto, after the profiled iterations: eq. (12) fitted on rank 0 from what
        it measured (one micro-batch in the first half, two in the second), and its n used by every
        rank from here on."""
        ctx, pipe = self.ctx, self.pipe
        fit = None
        if ctx.rank == 0:
            half = pipe.profile_iterations // 2
            steps = self._profile_steps
            one, two = steps[:half], steps[half:]
            reads = [r for r in self._profile_rows if r["events"]]
            sizes = [m for r in reads for m, _ in r["eta"]]
            eta = [e for r in reads for _, e in r["eta"]]
            if reads and len(set(sizes)) >= 2 and one and two:
                # the least of each: on a shared machine noise only ever adds time (the first compiles kernels)
                dispatch = float(np.min([r["read_s"] for r in reads]))
                total1, total2 = float(np.min(one)), float(np.min(two))
                compute = max(total1 - dispatch, 1e-6)
                bs = int(np.median([r["events"] for r in reads]))
                # what one more micro-batch surely costs: the latencies of its reads' collectives (slots,
                # counts and rows); its rows are not sent again (a batch's read is redundancy-free)
                link = collectives.current_link()
                floor = 3 * link.latency if link is not None else 0.0
                overhead = max(total2 - total1 + min(compute, dispatch) / 2, floor, 1e-4)
                fit = fit_granularity(sizes, eta, bs, compute, dispatch, overhead, pipe.max_micro_batches)
        if not ctx.alone:
            fit = collectives.broadcast_object(fit, group=ctx.groups.get("world"), name="micro_batches",
                                               counter=collectives.ByteCounter())
        self.fit = fit
        self.micro = fit.n if fit is not None else 1
        if fit is None:
            log.info("pipeline.micro_batches=auto: too little measured (empty batches?); using 1")
        elif ctx.rank == 0:
            log.info("pipeline.micro_batches=auto: n=%d from eq. (12) n = (A bs + B) / S with A=%.3f, B=%.1f, S=%.1f "
                     "rows = %.0f rows/s x %.2f ms (measured per batch: compute %.1f ms, dispatch %.1f ms, %.2f ms per "
                     "extra micro-batch; cost-model optimum %.2f)", fit.n, fit.A, fit.B, fit.S, fit.rows_per_s,
                     1e3 * fit.tau_s, 1e3 * fit.compute_s, 1e3 * fit.dispatch_s, 1e3 * fit.overhead_s, fit.n_model)


# ----------------------------------------------------------------------------------------------
# Eq. (12): the number of micro-batches


@dataclass(frozen=True)
class Granularity:
    """Eq. (12)'s fit: ``n = floor((A * bs + B) / S)`` clipped to ``[1, n_max]``.

    ``A``, ``B``: eta(m) = A + B / m fitted to the dispatched rows per event eta of micro-batches of
    m events (Appendix D, eq. (22)), so a batch of bs events dispatches ``A * bs + B`` rows. ``S``:
    the paper's transmission constant, measured: ``S = rows_per_s * tau_s``, the rows the link
    moves (``rows_per_s``, the measured dispatch's rows over its seconds) in the dispatch time one
    micro-batch should carry (``tau_s``, from the cost model: ``fit_granularity``). ``n_model``:
    the cost model's best n at the measured batch, which eq. (12) reproduces there and carries to
    other batch sizes with the link's speed and ``tau_s`` held."""

    A: float
    B: float
    S: float
    n: int
    n_model: float
    compute_s: float
    dispatch_s: float
    overhead_s: float
    rows_per_s: float = 0.0
    tau_s: float = 0.0

    def at(self, batch_size: int, n_max: int) -> int:
        """Eq. (12) at ``batch_size`` events."""
        return int(min(max(math.floor((self.A * batch_size + self.B) / self.S), 1), n_max))


def fit_eta(sizes: Sequence[float], eta: Sequence[float]) -> tuple[float, float]:
    """Least squares of ``eta = A + B / m`` over micro-batch sizes ``sizes`` (eq. (22))."""
    m = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(eta, dtype=np.float64)
    if m.size < 2 or np.unique(m).size < 2:
        raise ValueError("fitting eta = A + B / m needs at least two distinct micro-batch sizes")
    X = np.stack([np.ones_like(m), 1.0 / m], 1)
    (a, b), *_ = np.linalg.lstsq(X, y, rcond=None)
    return float(a), float(b)


def best_micro_batches(compute_s: float, dispatch_s: float, overhead_s: float) -> float:
    """The cost model's best n, n* = sqrt(min(C, D) / overhead): T(n) = max(C, D) + min(C, D) / n + n
    overhead is least there (``fit_granularity``)."""
    hidden = max(min(compute_s, dispatch_s), 0.0)
    return math.sqrt(hidden / max(overhead_s, 1e-9))


def micro_count(compute_s: float, dispatch_s: float, overhead_s: float, n_max: int) -> int:
    """The micro-batches ``micro_batches=auto`` chooses at the measured batch: n* whole, in [1, n_max]
    (eq. (12) reproduces the cost model's n there)."""
    return int(min(max(math.floor(best_micro_batches(compute_s, dispatch_s, overhead_s) + 1e-9), 1), n_max))


def fit_granularity(sizes: Sequence[float], eta: Sequence[float], batch_size: int, compute_s: float,
                    dispatch_s: float, overhead_s: float, n_max: int) -> Granularity:
    """Eq. (12) fitted to measurements of the first iterations (a pure function).

    ``sizes`` / ``eta``: micro-batch sizes and their dispatched rows per event; ``compute_s`` and
    ``dispatch_s``: seconds per batch of ``batch_size`` events of computation and of waiting for
    the dispatch, unpipelined; ``overhead_s``: what one more micro-batch costs (its fixed
    per-call work and link latencies).

    The paper leaves S as "a constant determined by the transmission speed" (rows per micro-batch,
    since A bs + B counts rows). A speed alone gives no n: it must meet a time. We measure both:
    the link's speed v = rows / D (rows per second of the unpipelined dispatch D), and the time
    each micro-batch's dispatch should take, tau, from the pipeline's cost model: n micro-batches
    take about T(n) = max(C, D) + min(C, D) / n + n * overhead (the smaller of computation and
    dispatch hides behind the larger but for one micro-batch's share, and each micro-batch pays the
    overhead), least at n* = sqrt(min(C, D) / overhead), so tau = D / n*. Then S = v * tau, and
    eq. (12) gives n* at the measured batch and scales n with the rows at others, as the paper's
    hypothesis has it (n grows with the volume). A and B cancel at the measured batch by
    construction: there n is the cost model's. The obvious transmission constant S = v * overhead
    (a micro-batch carries what the link moves in its own overhead) would give n = D / overhead,
    where T(n) = T(1): pipelining for nothing (``tests/runtime/test_pipeline.py`` shows it)."""
    A, B = fit_eta(sizes, eta)
    rows = max(A * batch_size + B, 1e-9)
    n_model = best_micro_batches(compute_s, dispatch_s, overhead_s)
    rows_per_s = rows / max(dispatch_s, 1e-12)
    tau_s = max(dispatch_s, 1e-12) / max(n_model, 1.0)  # n* < 1: one micro-batch already carries all it should
    S = rows_per_s * tau_s
    n = int(min(max(math.floor(rows / S + 1e-9), 1), n_max))
    return Granularity(A, B, S, n, n_model, compute_s, dispatch_s, overhead_s, rows_per_s, tau_s)
