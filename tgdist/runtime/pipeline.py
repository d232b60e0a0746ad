"""Sven's hierarchical pipelining (Sven 3.3; DESIGN.md "Pipelines"): what ``pipeline.*`` switches on.

Each level is a controlled change of the loop in ``runtime.run`` that leaves training as it was:

- ``Prefetcher`` (``pipeline.prefetch=Q``): a background thread samples and organizes the next Q
  batches (Sven 3.3.1, DistTGL 3.3) while the current one trains. Sampling reads the graph only
  and its numba kernels release the GIL, so a thread does. Same batches, same order: bit-identical.
- micro-batches (``pipeline.micro_batches=N|auto``, Sven 3.3.2): ``Trainer.prepare_micro`` and
  ``Trainer.compute``; ``granularity`` is eq. (12)'s fit for ``auto``.
- ``GradientSync`` (``pipeline.async_allreduce``, Sven 3.3.3): the gradient all-reduce of iteration
  t travels while t + 1 computes, and the step applies it: w_{t+1} = w_t - lr * grad(w_{t-1}),
  eq. (13), staleness one.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from tgdist.distributed import collectives

log = logging.getLogger(__name__)


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
    hidden = max(min(compute_s, dispatch_s), 0.0)
    n_model = math.sqrt(hidden / max(overhead_s, 1e-9))
    rows_per_s = rows / max(dispatch_s, 1e-12)
    tau_s = max(dispatch_s, 1e-12) / max(n_model, 1.0)  # n* < 1: one micro-batch already carries all it should
    S = rows_per_s * tau_s
    n = int(min(max(math.floor(rows / S + 1e-9), 1), n_max))
    return Granularity(A, B, S, n, n_model, compute_s, dispatch_s, overhead_s, rows_per_s, tau_s)
