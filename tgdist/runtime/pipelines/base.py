"""What every pipeline shares (DESIGN.md "Pipelines"): the hooks of the one loop, the hooks of one
training step, and two levels of Sven's hierarchical pipelining (3.3) that work under any strategy.

A pipeline is a strategy of the loop in ``runtime.run``: ``Run._iterate`` walks the schedule and
calls the pipeline at fixed points of every iteration (``Pipeline``'s methods, in the order the
loop calls them); ``Trainer.compute`` calls the ``StepHooks`` the pipeline gives it. What every
pipeline does alike lives here:

- ``Prefetcher`` (``pipeline.prefetch=Q``): a background thread samples and organizes the next Q
  batches (Sven 3.3.1, DistTGL 3.3) while the current one trains. Sampling reads the graph only
  and its numba kernels release the GIL, so a thread does. Same batches, same order: bit-identical.
- ``GradientSync`` (``pipeline.async_allreduce``, Sven 3.3.3): the gradient all-reduce of iteration
  t travels while t + 1 computes, and the step applies it: w_{t+1} = w_t - lr * grad(w_{t-1}),
  eq. (13), staleness one.
- the read slots: batches read ahead of the iteration that trains them (epoch parallelism's
  DistTGL read slots, MSPipe's reads in flight), which checkpoints keep.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from tgdist.config import PipelineConfig, parse_count_or_auto, section_schema
from tgdist.distributed import collectives
from tgdist.distributed.schedule import Layout
from tgdist.memory.store import MemoryRead
from tgdist.runtime.trainer import GradientHooks, StepHooks, Trainer

log = logging.getLogger(__name__)

__all__ = ["BACKWARD_SHARE", "GradientHooks", "GradientSync", "IterationCosts", "Pipeline", "PipelineContext", "Prefetcher",
           "Price", "StepHooks"]


def count_of(pipe, key: str) -> int | None:
    """``pipeline.KEY``, a count-or-auto key of the strategy's config class (``config.count_or_auto``),
    as a count, or None for ``auto``; a bad value (set after composition) is the ConfigError
    composing gives."""
    schema = OmegaConf.get_type(pipe) if OmegaConf.is_config(pipe) else type(pipe)
    if not dataclasses.is_dataclass(schema):  # a plain mapping of the settings: every strategy's keys
        schema = section_schema("pipeline")
    least, what = next(f for f in dataclasses.fields(schema) if f.name == key).metadata["count_or_auto"]
    return parse_count_or_auto(pipe[key], f"pipeline.{key}", least, what)


# ------------------------------------------------------------------------------------------------
# Pricing: what the strategy advisor (``tgdist.launcher.advisor.model``) asks a strategy


BACKWARD_SHARE = 0.5  # of the compute stage that runs after the write (the backward pass): hides the aggregation


@dataclass(frozen=True)
class IterationCosts:
    """One trainer's seconds per iteration by stage, each alone (unoverlapped), for ``Pipeline.price``:
    the five stages of the step (``sample``, ``features``, ``memory_read``, ``compute``,
    ``memory_write``), the store's exchanges (``dispatch`` before the compute, ``aggregation`` after
    the write), the gradients' ``allreduce``, and ``collective_cpu``, the collectives' own CPU time.
    ``micro_overhead``: what one more micro-batch costs (the fixed parts of its stages and its
    dispatch's link latencies, ``micro_latency`` of it); ``overlap``: the share of the ideal overlap
    a stage thread buys (the profile's measure, 1 for the papers' perfect overlap);
    ``iterations``: per trainer and epoch."""

    sample: float
    features: float
    memory_read: float
    dispatch: float
    compute: float
    memory_write: float
    aggregation: float
    allreduce: float
    collective_cpu: float = 0.0
    micro_overhead: float = 0.0
    micro_latency: float = 0.0
    overlap: float = 1.0
    iterations: int = 1


@dataclass
class Price:
    """A strategy's iteration: ``path``, the seconds of its critical path; ``micro_batches``;
    ``extra_cpu``, CPU seconds it adds beyond the stages (more micro-batches); ``staleness``, the
    memory staleness K it reads at; ``risk``, (level, why) of what it changes in training."""

    path: float
    micro_batches: int = 1
    extra_cpu: float = 0.0
    staleness: int = 0
    risk: list = dataclasses.field(default_factory=list)


@dataclass
class PipelineContext:
    """What a pipeline is built from: the run's config and trainer, this rank's place in the
    layout, the length of its schedule, the process groups and the run's byte counter, and two
    functions of the run: ``step(t)`` (``schedule.step`` of this rank at iteration t) and
    ``negatives(s)`` (a step's fixed negative destinations)."""

    cfg: DictConfig
    trainer: Trainer
    layout: Layout
    rank: int
    alone: bool
    iterations: int
    batches_per_epoch: int
    groups: Any
    counter: collectives.ByteCounter
    step: Callable[[int], Any]
    negatives: Callable[[Any], np.ndarray]


class Pipeline:
    """A pipeline strategy: the hooks the loop calls at fixed points of iteration t.

    - ``begin(start)``: once, before the first iteration (``start``: a resumed run's);
    - ``read_ahead(t)``: first in every iteration: issue the reads the strategy makes ahead;
    - ``take(t, now)``: the batch iteration t trains (``now``: its step), or None (an idle rank);
    - ``hooks(t)``: the ``StepHooks`` of its training step;
    - ``after_step(t)``: after the step (an idle rank's too), before the memory store's exchange;
    - ``after_exchange(t)``: after the exchange, every write of the iteration applied;
    - ``after_iteration(t, seconds)``: last, with the iteration's seconds (what it measures);
    - ``settle()``: wait for the reads in flight (a checkpoint, the end of training);
    - ``drain()``: wait for everything in flight (before evaluation, a checkpoint, the end);
    - ``end_epoch()``: a run of one process evaluates now (which samples on the trainer too);
    - ``state()`` / ``load_state(mine)``: what a checkpoint keeps of this rank's pipeline;
    - ``summary()``: what the run's summary says of it; ``close()``: release threads (idempotent).

    Shared here: the read slots (``slots``: read slot -> a prepared batch, or a future of one),
    the prefetch worker and the gradient exchange (``grads``, ``GradientSync``). ``validate`` is
    the strategy's own checks of the ``pipeline`` settings, given the layout and memory backend."""

    name = ""
    Config = PipelineConfig  # the keys this strategy reads (a subclass with its own; ``registry.register``)

    def __init__(self, ctx: PipelineContext):
        self.ctx, self.trainer, self.pipe = ctx, ctx.trainer, ctx.cfg.pipeline
        self.jj = ctx.layout.coords(ctx.rank)[1]
        self.slots: dict[int, object] = {}  # read slot -> a prepared batch read ahead
        self.prefetcher: Prefetcher | None = None
        self._sampler_calls = None  # the sampler's call count after the last batch consumed (prefetch)
        self.grads = GradientSync(ctx.groups.get("world"), ctx.counter, stale=self.pipe.async_allreduce)

    @classmethod
    def validate(cls, pipe, parallel=None, backend: str = "auto") -> None:
        """Refuse ``pipeline`` settings this strategy cannot run (a ``ConfigError``); ``backend`` is
        the memory store the run resolved (never ``auto``)."""

    @classmethod
    def micro_batches(cls, pipe) -> int | None:
        """The micro-batches each batch is cut into under these settings (None: chosen while
        training); 1 for a strategy that takes whole batches."""
        return 1

    @classmethod
    def price(cls, pipe, c: IterationCosts) -> Price:
        """The iteration under ``pipeline`` settings ``pipe`` from its stages' costs (the advisor's
        model; a strategy that overlaps otherwise says so here). Here the levels every strategy may
        switch on: the stages in turn, but the aggregation travels during the backward pass (the step
        starts it after the write: ``BACKWARD_SHARE`` of compute hides it); the asynchronous
        all-reduce (Sven eq. (13)) hides behind the next iteration's compute; prefetching (Sven 3.3.1)
        takes sampling and features off the critical path, by the measured share ``c.overlap``."""
        front = c.sample + c.features
        rest = (c.memory_read + c.dispatch + c.compute + c.memory_write
                + max(0.0, c.aggregation - BACKWARD_SHARE * c.compute) + cls._allreduce_path(pipe, c) + c.collective_cpu)
        return Price(cls._prefetched(pipe, c, front, rest), risk=cls._gradient_risk(pipe))

    @staticmethod
    def _allreduce_path(pipe, c: IterationCosts) -> float:
        return max(0.0, c.allreduce - c.compute) if pipe.async_allreduce else c.allreduce

    @staticmethod
    def _prefetched(pipe, c: IterationCosts, front: float, rest: float) -> float:
        return front + rest - (c.overlap * min(front, rest) if pipe.prefetch > 0 else 0.0)

    @staticmethod
    def _gradient_risk(pipe) -> list:
        return [(1, "gradient staleness 1 (Sven eq. (13))")] if pipe.async_allreduce else []

    # -- the loop's hooks (defaults: nothing to do) -------------------------------------------------

    def begin(self, start: int) -> None:
        pass

    def read_ahead(self, t: int) -> None:
        raise NotImplementedError

    def take(self, t: int, now):
        raise NotImplementedError

    def hooks(self, t: int) -> StepHooks:
        raise NotImplementedError

    def after_step(self, t: int) -> None:
        pass

    def after_exchange(self, t: int) -> None:
        pass

    def after_iteration(self, t: int, seconds: float) -> None:
        pass

    def settle(self) -> None:
        """Wait for the reads in flight."""
        for u, p in self.slots.items():
            if isinstance(p, Future):
                self.slots[u] = p.result()

    def drain(self) -> None:
        self.settle()

    def end_epoch(self) -> None:
        self.stop_prefetch()  # (it had sampled to here) evaluation samples on this sampler too

    def close(self) -> None:
        self.stop_prefetch()

    # -- checkpoints and the summary --------------------------------------------------------------

    def state(self) -> dict:
        """This rank's pipeline in its checkpoint file: the read slots (each batch's events,
        negatives and read, so a resume reads nothing again) and the sampler's draws so far."""
        tr = self.trainer

        def saved(p):  # a read still in flight (micro-batches) is waited for
            return {"lo": p.lo, "hi": p.hi, "neg": torch.from_numpy(p.neg), "read": vars(collectives.resolve(p.read))}

        slots = {slot: [saved(q) for q in p] if isinstance(p, list) else saved(p) for slot, p in self.slots.items()}
        calls = self._sampler_calls if self._sampler_calls is not None else tr.sampler.calls if tr.sampler else 0
        return {"slots": slots, "sampler_calls": calls}

    def load_state(self, mine: dict) -> None:
        """The state ``state`` saved (``mine``: this rank's checkpoint file): the sampler where it
        was, the read slots prepared again with their saved reads (on the compute device)."""
        tr = self.trainer
        if tr.sampler is not None:
            tr.sampler.calls = int(mine["sampler_calls"]) - self._resampled(mine["slots"])

        def restored(v):
            return tr.prepare(v["lo"], v["hi"], v["neg"].numpy(),
                              read=MemoryRead(**{k: t.to(tr.device) if isinstance(t, torch.Tensor) else t
                                                 for k, t in v["read"].items()}))

        self.slots = {int(slot): [restored(q) for q in v] if isinstance(v, list) else restored(v)
                      for slot, v in sorted(mine["slots"].items())}

    def _resampled(self, slots: dict) -> int:
        """Sampler draws that preparing ``slots`` again makes, which the saved count already holds."""
        return 0

    def summary(self) -> dict:
        return {"prefetch": self.pipe.prefetch, "micro_batches": 1, "async_allreduce": self.pipe.async_allreduce,
                "fit": None, "mode": self.name}

    # -- prefetch ---------------------------------------------------------------------------------

    def sampled(self, u: int, micro_batches: int = 1):
        """The prefetch worker's sampling of batch ``u`` and the sampler's count after it, or
        ``(None, None)`` without a worker (the read then samples too)."""
        if not self.pipe.prefetch:
            return None, None
        if self.prefetcher is None:
            self.start_prefetch(u, micro_batches)
        return self.prefetcher.get(u)

    def start_prefetch(self, t: int, micro_batches: int = 1) -> None:
        """A worker sampling the batches this rank reads from iteration ``t`` on: to the end of the
        epoch in a run of one process (evaluation, which samples too, follows it), else to the end."""
        ctx, tr, n = self.ctx, self.trainer, micro_batches
        end = (t // ctx.batches_per_epoch + 1) * ctx.batches_per_epoch if ctx.alone else ctx.iterations

        def jobs():
            for u in range(t, end):
                s = ctx.step(u + self.jj) if u + self.jj < ctx.iterations else None
                if s is not None and s.active:
                    yield u, s

        def make(s):
            neg = ctx.negatives(s)
            sampled = tr.sample(s.lo, s.hi, neg) if n == 1 else tr.sample_micro(s.lo, s.hi, neg, n)
            return sampled, (tr.sampler.calls if tr.sampler is not None else 0)

        self.prefetcher = Prefetcher(make, jobs(), self.pipe.prefetch)

    def stop_prefetch(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
            if self._sampler_calls is not None and self.trainer.sampler is not None:
                self.trainer.sampler.calls = self._sampler_calls  # as if nothing were sampled ahead
            self._sampler_calls = None


class Prefetcher:
    """Runs ``make(job)`` for each of ``jobs`` (``(key, job)`` pairs, in the order they will be
    asked for) in a background thread, at most ``depth`` results ahead of ``get``.

    ``get(key)`` returns the next result, which must be ``key``'s (the consumer walks the same
    schedule); an exception in the worker is raised there. ``close()`` stops the worker and joins
    it (it is a daemon thread too, so a process never waits for it at exit); it is idempotent and
    safe from ``finally`` after Ctrl-C."""

    _END = object()

    def __init__(self, make: Callable, jobs: Iterable, depth: int, name: str = "tgdist-prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self._make, self._jobs = make, jobs
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            for key, job in self._jobs:
                if self._stop.is_set():
                    return
                if not self._put((key, self._make(job), None)):
                    return
            self._put((None, self._END, None))
        except BaseException as e:  # handed to the consumer, which raises it
            self._put((None, None, e))

    def get(self, key):
        while True:
            try:
                got, value, error = self._queue.get(timeout=0.5)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch worker stopped without a result") from None
        if error is not None:
            raise RuntimeError(f"prefetching the next batches failed: {error}") from error
        if value is self._END:
            raise RuntimeError(f"prefetch: asked for {key!r} after the last job")
        if got != key:
            raise RuntimeError(f"prefetch: asked for {key!r} but the next prefetched batch is {got!r}")
        return value

    def close(self) -> None:
        self._stop.set()
        while True:  # a worker blocked on a full queue sees the stop within its put timeout
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class GradientSync:
    """Gradient averaging over ``group`` before each optimizer step: at once (``stale=False``,
    ``collectives.average_gradients``), or with staleness one (Sven eq. (13)).

    Stale: ``__call__`` keeps this iteration's gradients and puts the previous iteration's
    averages in the parameters' ``.grad``; the first call has none and returns False (no step:
    w_1 = w_0). The kept gradients' all-reduce is issued by ``issue()``, which the loop calls at
    the start of the next iteration's computation, after that iteration's memory reads have gone
    out: the reduction then travels while the forward and backward passes run, instead of queueing
    before the reads on the rank's link. ``drain`` applies the last gradients when training ends,
    so every gradient computed is applied once. ``pending()`` (a checkpoint) returns the averages
    not yet applied; ``restore`` puts them back."""

    def __init__(self, group=None, counter: collectives.ByteCounter | None = None, stale: bool = False):
        self.group, self.counter, self.stale = group, counter, stale
        self._kept: tuple[list[torch.Tensor], bool] | None = None  # gradients not yet sent, and active
        self._sent: collectives.Handle | None = None

    def issue(self) -> None:
        """Send the kept gradients (every rank at the same point of its iteration)."""
        if self._kept is not None:
            grads, active = self._kept
            self._kept = None
            self._sent = collectives.all_reduce_mean_async(grads, self.group, name="gradients", counter=self.counter,
                                                           active=active)

    def __call__(self, params, active: bool = True) -> bool:
        params = list(params)
        if not self.stale:
            collectives.average_gradients(params, self.group, self.counter, active=active)
            return True
        self.issue()  # (the loop issued them already; a caller that does not, here)
        previous, self._sent = self._sent, None
        self._kept = ([p.grad.detach().clone() if active and p.grad is not None else torch.zeros_like(p)
                       for p in params], active)
        if previous is None:
            return False
        for p, g in zip(params, previous.wait()):
            p.grad = g
        return True

    def drain(self, params) -> bool:
        """Put the last gradients' averages in ``.grad`` (True: step now), or False when none are."""
        self.issue()
        if self._sent is None:
            return False
        for p, g in zip(list(params), self._sent.wait()):
            p.grad = g
        self._sent = None
        return True

    def pending(self) -> list[torch.Tensor] | None:
        self.issue()
        return None if self._sent is None else [g.detach().cpu() for g in self._sent.wait()]

    def restore(self, grads: Sequence[torch.Tensor] | None, device) -> None:
        self._kept = None
        self._sent = None if grads is None else collectives.Handle.completed([g.to(device) for g in grads])
