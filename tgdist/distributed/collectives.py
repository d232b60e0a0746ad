"""The few collectives tgdist uses, each taking a group and counting what it sends (STYLE.md 10).

Memory backends and the trainer call these instead of ``torch.distributed`` directly, so the bytes of
every phase can be reported by name and compared with the volume formulas (Sven (7)-(9)).
A byte count is the payload this rank hands to (``sent``) or gets from (``received``) the
collective, i.e. ``numel * element_size`` of its tensors or the pickled size of an object; the
algorithm's wire traffic (e.g. a ring all-reduce's ``2 (n-1)/n`` factor) is not counted (the
simulated link's time models it, below).

With a single process (torch.distributed not initialised, or a group of one) every helper returns
its input unchanged, so the same code path runs on 1 and on N processes.

Simulated interconnect (``parallel.link``, ``tgdist.distributed.link``): once the run installs a
``Link`` (``set_link``), every helper here returns no earlier than its issue time plus the delay
``link_seconds`` models for what it counted, sleeping for what remains after the real work (so a
collective that really took longer is not delayed further). Asynchronous helpers (``*_async``)
return a ``Handle`` whose ``wait()`` does the same, so computation between issue and wait
overlaps the modelled transfer. Each rank has one link: collectives in flight together queue on it
(a transfer starts when those issued before it are through), so overlapping two transfers never
makes them cheaper than one after the other. ``_charge`` is the one place that prices and counts a
collective; a new helper calls it with its counted bytes. Collectives of one process cost nothing.

Devices: a collective takes its tensors on its group's communication device (``comm_device``: the
rank's CUDA device under NCCL, the CPU under gloo and MPI), whatever the compute device of the
caller. The helpers move what they send there and give results back on the caller's device.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from tgdist.distributed.link import Link, link_seconds, parse_link
from tgdist.errors import RunFailure, TgdistError

log = logging.getLogger(__name__)

__all__ = ["ByteCounter", "Traffic", "Handle", "all_reduce_mean", "all_reduce_mean_async", "all_to_all_rows_async",
           "all_to_all_parts_async", "resolve",
           "average_gradients", "all_gather_object", "all_gather_rows", "broadcast_object", "broadcast_tensors",
           "result_of", "barrier", "comm_device", "group_rank", "group_size", "set_link", "current_link"]


@dataclass
class Traffic:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    modelled_seconds: float = 0.0  # what the simulated link charged these calls (0 without one)


@dataclass
class ByteCounter:
    """Calls and payload bytes per name, e.g. ``counter["grad"].bytes_sent``; under a simulated
    link (``set_link``) also the modelled seconds."""

    by_name: dict[str, Traffic] = field(default_factory=dict)
    modelled: bool = field(default=False, repr=False)  # some call was priced by a link

    def add(self, name: str, sent: int = 0, received: int = 0, seconds: float | None = None) -> None:
        """One call of ``name``; ``seconds``: the link's modelled time for it (None: no link)."""
        t = self.by_name.setdefault(name, Traffic())
        t.calls += 1
        t.bytes_sent += int(sent)
        t.bytes_received += int(received)
        if seconds is not None:
            t.modelled_seconds += float(seconds)
            self.modelled = True

    def __getitem__(self, name: str) -> Traffic:
        return self.by_name.get(name, Traffic())

    def total_sent(self) -> int:
        return sum(t.bytes_sent for t in self.by_name.values())

    def total_modelled_seconds(self) -> float:
        return sum(t.modelled_seconds for t in self.by_name.values())

    def as_dict(self) -> dict[str, dict[str, int | float]]:
        """``{name: {"calls", "bytes_sent", "bytes_received"}}`` for JSON reports, and
        ``"modelled_seconds"`` when a simulated link priced the calls."""
        keep = ("calls", "bytes_sent", "bytes_received") + (("modelled_seconds",) if self.modelled else ())
        return {n: {k: getattr(t, k) for k in keep} for n, t in sorted(self.by_name.items())}

    def reset(self) -> None:
        self.by_name.clear()
        self.modelled = False


# Used when the caller passes no counter: one per process.
DEFAULT_COUNTER = ByteCounter()

_link: Link | None = None  # the simulated interconnect of this process (set_link)
_link_free = 0.0  # perf_counter time at which this rank's link has sent all it was given so far


def set_link(link: Link | str | None) -> Link | None:
    """Install the simulated interconnect every collective of this process pays from now on: a
    ``Link``, a ``parallel.link`` value (``none``, a preset, ``BANDWIDTH:LATENCY``; a bad one is a
    ``ConfigError``) or None for none. Returns the installed link."""
    global _link, _link_free
    _link = parse_link(link) if not isinstance(link, Link) else link
    _link_free = 0.0
    if _link is not None:
        log.info("simulated interconnect: %s (a model, not a measurement)", _link.describe())
    return _link


def current_link() -> Link | None:
    return _link


def _charge(issued: float, kind: str, group, name: str, counter: ByteCounter, sent: int = 0,
            received: int = 0) -> float:
    """Count one collective of ``name`` and price it on the installed link (the one place that
    does): returns the time (``time.perf_counter``) before which it must not complete, i.e. its
    issue time plus ``link_seconds`` for the larger of what this rank sent and received."""
    seconds = link_seconds(kind, max(sent, received), group_size(group), _link)
    counter.add(name, sent=sent, received=received, seconds=seconds if _link is not None else None)
    return _occupy(issued, seconds, name)


def _occupy(issued: float, seconds: float, name: str = "") -> float:
    """The time at which a transfer of ``seconds`` issued at ``issued`` is through: one link per
    rank, so a transfer starts when the ones issued before it are through (asynchronous collectives
    in flight together queue, as on one network card, instead of each getting the whole link)."""
    global _link_free
    if seconds <= 0:
        return issued
    start = max(issued, _link_free)
    _link_free = start + seconds
    if _link_spans is not None:
        _link_spans.append((name, start, _link_free))
    return _link_free


_link_spans: list | None = None


def trace_link(spans: list | None) -> None:
    """Record ``(name, start, end)`` of every modelled transfer on this rank's link into ``spans``
    (``time.perf_counter`` times; timelines), or stop recording (None)."""
    global _link_spans
    _link_spans = spans


def _sleep_until(deadline: float) -> None:
    # sleep, not spin: on a shared machine the other ranks need the cores meanwhile
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


class Handle:
    """An issued asynchronous collective. ``wait()`` waits for the real work, finishes it (copies
    results back, divides, splits) and returns its result, no earlier than the issue time plus
    the link's modelled delay: it sleeps only for what remains of that delay, so what the caller
    computed between issue and wait overlaps the transfer. Waiting twice returns the same result."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], Any], deadline: float):
        self._works, self._finish, self._deadline = list(works), finish, deadline
        self._done, self._result = False, None
        self.words: list[int] | None = None  # (``all_to_all_parts_async``'s ``word`` of every rank)

    @classmethod
    def completed(cls, result: Any) -> "Handle":
        """A handle with nothing to wait for (a collective of one process)."""
        return cls([], lambda: result, 0.0)

    def wait(self) -> Any:
        if not self._done:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._works, self._finish = [], None
            _sleep_until(self._deadline)
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        """Whether ``wait()`` would return at once (the real work is done and the modelled time is over)."""
        return self._done or (all(w.is_completed() for w in self._works) and time.perf_counter() >= self._deadline)

    def then(self, fn: Callable[[Any], Any]) -> "Handle":
        """A handle on ``fn(result)``: waiting for it waits for this one, then applies ``fn`` once."""
        after = Handle([], lambda: fn(self.wait()), 0.0)
        after.is_completed = lambda: after._done or self.is_completed()  # (fn itself is not waited for)
        return after


def resolve(value: Any) -> Any:
    """``value.wait()`` for a ``Handle``, else ``value``: a consumer that may be given either."""
    return value.wait() if isinstance(value, Handle) else value


def _active(group) -> bool:
    return dist.is_available() and dist.is_initialized() and group_size(group) > 1


def group_size(group=None) -> int:
    """Ranks in ``group`` (None = world); 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    """This process's rank in ``group`` (None = world); 0 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def comm_device(group=None) -> torch.device:
    """The device ``group``'s collectives take their tensors on: the rank's CUDA device under NCCL
    (``ProcessGroups.init`` selects it), the CPU under gloo and MPI, and without torch.distributed."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_host_groups: dict = {}


def host_group(group=None):
    """``group`` when its collectives run on the CPU (gloo, MPI), else a gloo group of the same
    ranks, made once (every rank of ``group`` must make the first call together): what the ranks
    agree on between iterations (a stop request, say) then passes through the host, and reading
    the result back makes the host wait for no device."""
    if comm_device(group).type == "cpu" or not _active(group):
        return group
    key = tuple(dist.get_process_group_ranks(group))
    if key not in _host_groups:
        _host_groups[key] = dist.new_group(ranks=list(key), backend="gloo")
    return _host_groups[key]


def all_reduce_mean(tensors: Sequence[torch.Tensor], group=None, name: str = "all_reduce",
                    counter: ByteCounter | None = None, active: bool | None = None) -> Sequence[torch.Tensor]:
    """Average ``tensors`` in place over ``group`` (one flat buffer per dtype: one collective call
    instead of one per tensor), on the group's ``comm_device``; the results are copied back into
    ``tensors`` on their own device. Returns the same tensors.

    ``active`` (gradient averaging, where ranks idle in the epoch-parallel tail pass zeros): the
    sum is divided by the number of ranks that passed ``active=True`` (at least 1), which travels
    as one more element of the first buffer (and is counted). None: by the group's size."""
    return all_reduce_mean_async(tensors, group, name, counter, active).wait()


def all_reduce_sum(tensor: torch.Tensor, group=None, name: str = "all_reduce",
                   counter: ByteCounter | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group``, one collective on the tensor as it is (no packing:
    the bare cost of an all-reduce of its bytes, which a profile times, ``launcher.advisor.measure``),
    counted and priced on the link as every collective here. Returns the tensor."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    if not _active(group):
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    nbytes = tensor.numel() * tensor.element_size()
    _sleep_until(_charge(issued, "all_reduce", group, name, counter, sent=nbytes, received=nbytes))
    return tensor


def all_reduce_mean_async(tensors: Sequence[torch.Tensor], group=None, name: str = "all_reduce",
                          counter: ByteCounter | None = None, active: bool | None = None) -> Handle:
    """``all_reduce_mean`` issued without waiting: the tensors are copied into the send buffers
    now and overwritten with the averages at ``wait()``, which returns them (counted now, as the
    synchronous helper counts them)."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    tensors = [t for t in tensors if t is not None]
    if not _active(group) or not tensors:
        return Handle.completed(tensors)
    if any(not t.is_floating_point() for t in tensors):
        raise TypeError("all_reduce_mean averages floating-point tensors only")
    n, dev = group_size(group), comm_device(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    flats, works = [], []
    for k, same in enumerate(by_dtype.values()):
        parts = [t.reshape(-1) for t in same]
        if active is not None and k == 0:
            parts.append(same[0].new_full((1,), 1.0 if active else 0.0))
        flat = torch.cat(parts).to(dev)
        works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True))
        flats.append(flat)

    def finish() -> list[torch.Tensor]:
        divisor = n if active is None else max(float(flats[0][-1]), 1.0)
        for flat, same in zip(flats, by_dtype.values()):
            flat /= divisor
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return tensors

    nbytes = sum(f.numel() * f.element_size() for f in flats)
    return Handle(works, finish, _charge(issued, "all_reduce", group, name, counter, sent=nbytes, received=nbytes))


def all_to_all_rows_async(rows: Sequence[torch.Tensor], group=None, name: str = "all_to_all_rows",
                          counter: ByteCounter | None = None, counts: Sequence[int] | None = None) -> Handle:
    """Send ``rows[r]`` (``[n_r, *width]``, one tensor per group rank r, all of one dtype and
    width) to group rank r; ``wait()`` returns what each rank sent here, ``[m_r, *width]`` per
    source rank r in group rank order, on the device of ``rows``. ``.wait()`` at once is the
    synchronous form.

    ``counts``: the m_r, when the caller knows them; otherwise they travel first, in a small
    blocking exchange of one integer per rank (uncounted, as ``all_gather_rows``'s sizes), and
    only the rows are asynchronous. Counted: the rows sent to and received from other ranks
    (a rank's rows to itself never leave it). With one process: ``[rows[0]]``."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    n = group_size(group)
    if len(rows) != n:
        raise ValueError(f"all_to_all_rows_async needs one tensor per rank of the group ({n}), got {len(rows)}")
    if not _active(group):
        return Handle.completed([rows[0]])
    me, dev, home = group_rank(group), comm_device(group), rows[0].device
    send_counts = [int(r.shape[0]) for r in rows]
    if counts is None:
        got = torch.empty(n, dtype=torch.int64, device=dev)
        dist.all_to_all_single(got, torch.tensor(send_counts, dtype=torch.int64, device=dev), group=group)
        counts = got.tolist()
    counts = [int(c) for c in counts]
    send = torch.cat(list(rows)).to(dev)
    recv = torch.empty((sum(counts), *send.shape[1:]), dtype=send.dtype, device=dev)
    work = dist.all_to_all_single(recv, send, output_split_sizes=counts, input_split_sizes=send_counts,
                                  group=group, async_op=True)

    def finish() -> list[torch.Tensor]:
        return [part.to(home) for part in torch.split(recv, counts)]

    row_bytes = math.prod(send.shape[1:]) * send.element_size()
    sent = (sum(send_counts) - send_counts[me]) * row_bytes
    received = (sum(counts) - counts[me]) * row_bytes
    return Handle([work], finish, _charge(issued, "all_to_all", group, name, counter, sent=sent, received=received))


def average_gradients(params: Sequence[torch.Tensor], group=None, counter: ByteCounter | None = None,
                      active: bool = True) -> None:
    """Data-parallel gradient averaging: every parameter's ``.grad`` becomes the mean over the ranks
    of ``group`` active in this step (``all_reduce_mean``, counted as ``gradients``). An idle rank
    (``active=False``: the epoch-parallel fill and drain) passes zeros and still takes part, so every
    replica takes the same optimizer step; a parameter without a gradient on this rank passes zeros.
    With one process too, a parameter without a gradient gets zeros: the optimizer's state then
    advances alike whatever the number of processes (1 x 1 x 1 is the parallel loop with a world
    of one; Adam's bias correction would otherwise part the runs from the first unused parameter)."""
    params = list(params)
    grads = [p.grad if active and p.grad is not None else torch.zeros_like(p) for p in params]
    all_reduce_mean(grads, group, name="gradients", counter=counter, active=active)
    for p, g in zip(params, grads):
        p.grad = g


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int = 0, group=None, name: str = "broadcast",
                      counter: ByteCounter | None = None) -> Sequence[torch.Tensor]:
    """Overwrite ``tensors`` in place with those of global rank ``src``, on every rank of ``group``."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    if not _active(group):
        return tensors
    dev = comm_device(group)
    nbytes = 0
    for t in tensors:
        data = t.detach()  # the tensor's own storage (parameters included)
        buf = data.to(dev)
        dist.broadcast(buf, src=src, group=group)
        if buf.device != data.device:
            data.copy_(buf)
        nbytes += t.numel() * t.element_size()
    _sleep_until(_charge(issued, "broadcast", group, name, counter,
                         **({"sent": nbytes} if dist.get_rank() == src else {"received": nbytes})))
    return tensors


def broadcast_object(obj: Any, src: int = 0, group=None, name: str = "broadcast",
                     counter: ByteCounter | None = None) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (pickled)."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    if not _active(group):
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    size = len(pickle.dumps(box[0]))
    _sleep_until(_charge(issued, "broadcast", group, name, counter,
                         **({"sent": size} if dist.get_rank() == src else {"received": size})))
    return box[0]


def result_of(work: Callable[[], Any], group=None, src: int = 0, timeout: timedelta = timedelta(days=7),
              name: str = "result", counter: ByteCounter | None = None) -> Any:
    """``work()`` run by global rank ``src`` alone, its result on every rank of ``group`` (every
    rank of the job must call this: the wait uses a group made for it).

    The others wait up to ``timeout``, not the process group's own timeout, which bounds the
    training collectives (10 minutes): rank 0's final evaluation of a large stream takes longer,
    and the job would fail at its end. The wait runs on a gloo group, so this holds under NCCL too.
    If ``work`` raises, the others raise too, with its message, instead of waiting."""
    if not _active(group):
        return work()
    waiting = dist.new_group(ranks=dist.get_process_group_ranks(group), timeout=timeout, backend="gloo")
    try:
        if dist.get_rank() != src:
            status, value = broadcast_object(None, src, waiting, name, counter)
            if status == "failed":  # one line, as rank src's own, with its exit code (2: bad input)
                message, code = value
                failure = RunFailure(f"rank {src} failed while this rank waited for it: {message}")
                failure.exit_code = code
                raise failure
            return value
        try:
            value = work()
        except BaseException as e:
            code = getattr(e, "exit_code", 2) if isinstance(e, TgdistError) else 1
            broadcast_object(("failed", (f"{type(e).__name__}: {e}", code)), src, waiting, name, counter)
            raise
        broadcast_object(("ok", value), src, waiting, name, counter)
        return value
    finally:
        dist.destroy_process_group(waiting)


def all_gather_object(obj: Any, group=None, name: str = "all_gather",
                      counter: ByteCounter | None = None) -> list[Any]:
    """Every rank's ``obj``, in group rank order."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    if not _active(group):
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    mine = len(pickle.dumps(obj))
    received = sum(len(pickle.dumps(o)) for o in out) - mine
    _sleep_until(_charge(issued, "all_gather", group, name, counter, sent=mine, received=received))
    return out


def barrier(group=None, timeout: timedelta | float = 300.0, name: str = "barrier",
            counter: ByteCounter | None = None) -> None:
    """Wait for every rank of ``group``. On gloo it is ``monitored_barrier``: after ``timeout`` it
    raises naming the ranks that did not arrive, instead of hanging. NCCL has no monitored barrier
    and waits up to the process group's own timeout."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    if not _active(group):
        return
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    else:
        dist.barrier(group=group)
    _sleep_until(_charge(issued, "barrier", group, name, counter))


def all_gather_rows(rows: torch.Tensor, group=None, name: str = "all_gather_rows",
                    counter: ByteCounter | None = None) -> list[torch.Tensor]:
    """Every rank's ``rows [n_r, width]`` (n_r may differ per rank), in group rank order, on the
    device of ``rows``: sizes first, then one padded all_gather on the group's ``comm_device``.
    With one process: ``[rows]``."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    if not _active(group):
        return [rows]
    n, dev = group_size(group), comm_device(group)
    size = torch.tensor([rows.shape[0]], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s) for s in sizes]
    longest = max(counts)
    if longest == 0:
        _sleep_until(_charge(issued, "all_gather", group, name, counter))
        return [rows[:0] for _ in range(n)]
    padded = torch.zeros((longest, *rows.shape[1:]), dtype=rows.dtype, device=dev)
    padded[: rows.shape[0]] = rows
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    sent = rows.numel() * rows.element_size()
    row_bytes = padded[0].numel() * padded.element_size()
    received = sum(counts) * row_bytes - sent
    _sleep_until(_charge(issued, "all_gather", group, name, counter, sent=sent, received=received))
    return [o[:c].to(rows.device) for o, c in zip(out, counts)]


# ------------------------------------------------------------------------------------------------
# Rows of partitioned node memory (Sven, DepComm; DepCache's all-gather too): several typed parts
# packed into one byte buffer per peer, so a phase is one collective, and counted per phase with
# the payload (memory and mail rows) apart from the index bytes (ids, slots, rounds) and the sizes
# exchanged before the rows. Bytes a rank keeps for itself are neither sent nor counted.

__all__ += ["all_to_all_rows", "all_gather_parts"]


def _part_specs(parts: dict[str, Sequence[torch.Tensor]], n: int) -> dict[str, tuple[torch.dtype, tuple, int]]:
    """``{part: (dtype, row shape, row bytes)}``, checking every part has one tensor per peer of
    one dtype and row shape."""
    specs = {}
    for p, tensors in parts.items():
        if len(tensors) != n:
            raise ValueError(f"part {p!r}: {len(tensors)} tensors for a group of {n}")
        t0 = tensors[0]
        if any(t.dtype != t0.dtype or t.shape[1:] != t0.shape[1:] for t in tensors):
            raise ValueError(f"part {p!r}: every tensor needs one dtype and row shape")
        specs[p] = (t0.dtype, tuple(t0.shape[1:]), t0.shape[1:].numel() * t0.element_size())
    return specs


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(buf: torch.Tensor, dtype: torch.dtype, shape: tuple, rows: int, device) -> torch.Tensor:
    # a copy first: view(dtype) needs a storage offset aligned to the element size
    return buf.to(device, copy=True).view(dtype).view(rows, *shape)


def _count_parts(issued: float, kind: str, group, counter: ByteCounter, name: str, index: Sequence[str],
                 specs: dict, sent_rows: dict, received_rows: dict, size_bytes: int) -> float:
    """Count one call as ``NAME.sizes`` (the row counts, ``size_bytes`` each way), ``NAME.index``
    (the parts named in ``index``) and ``NAME.payload``, and price its two collectives on the
    installed link, the counts' and the rows' (``_charge``'s model; the rows' time is shared between
    index and payload by their bytes): returns the time before which the call must not complete."""
    sizes_s = link_seconds(kind, size_bytes, group_size(group), _link)
    entries = []
    for part, chosen in (("index", [p for p in specs if p in index]), ("payload", [p for p in specs if p not in index])):
        if chosen:
            entries.append((f"{name}.{part}", sum(sent_rows[p] * specs[p][2] for p in chosen),
                            sum(received_rows[p] * specs[p][2] for p in chosen)))
    sent, received = sum(e[1] for e in entries), sum(e[2] for e in entries)
    rows_s = link_seconds(kind, max(sent, received), group_size(group), _link) if sent or received else 0.0
    priced = _link is not None
    counter.add(f"{name}.sizes", sent=size_bytes, received=size_bytes, seconds=sizes_s if priced else None)
    for entry, s, r in entries:
        share = rows_s * max(s, r) / max(sent, received) if max(sent, received) else 0.0
        counter.add(entry, sent=s, received=r, seconds=share if priced else None)
    return _occupy(issued, sizes_s + rows_s, name)


def all_to_all_rows(parts: dict[str, Sequence[torch.Tensor]], group=None, name: str = "all_to_all_rows",
                    counter: ByteCounter | None = None, index: Sequence[str] = ()) -> dict[str, list[torch.Tensor]]:
    """Personalised exchange: ``parts[p][d]`` (``[n_d, *row]``, one dtype and row shape per part)
    goes to group rank d; returns ``out[p][s]``, the rows group rank s sent here, on the device of
    the parts. ``out[p][me]`` is ``parts[p][me]`` itself (it never travels).

    One ``all_to_all_single`` of the row counts, then one of all parts packed as bytes per peer on
    the group's ``comm_device``. Counted: ``NAME.sizes`` (the counts), ``NAME.index`` (the parts
    named in ``index``) and ``NAME.payload`` (the other parts), each the bytes sent to and received
    from other ranks. With one process: ``{p: [parts[p][0]]}``."""
    return all_to_all_parts_async(parts, group, name, counter, index).wait()


def all_to_all_parts_async(parts: dict[str, Sequence[torch.Tensor]], group=None, name: str = "all_to_all_rows",
                           counter: ByteCounter | None = None, index: Sequence[str] = (),
                           word: int | None = None) -> Handle:
    """``all_to_all_rows`` issued without waiting for the rows: the counts travel now (a small
    blocking exchange), the packed rows asynchronously; ``wait()`` returns ``out`` (Sven's
    micro-batches keep the dispatch of the next micro-batch in flight this way). ``word``: one
    integer this rank sends every peer with its counts (8 bytes more per peer, counted in
    ``NAME.sizes``); the handle's ``words`` are every group rank's, in rank order, on the host at
    once, as the counts are (a fact of each rank that the receivers need before the rows)."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    n = group_size(group) if _active(group) else 1
    specs = _part_specs(parts, n)
    if n == 1:
        handle = Handle.completed({p: [tensors[0]] for p, tensors in parts.items()})
        handle.words = [int(word)] if word is not None else None
        return handle
    me, dev = group_rank(group), comm_device(group)
    names = list(parts)
    out_dev = parts[names[0]][me].device
    extra = [] if word is None else [int(word)]
    counts = torch.tensor([[parts[p][d].shape[0] if d != me else 0 for p in names] + extra for d in range(n)],
                          dtype=torch.int64, device=dev)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)
    counts, got = counts.cpu(), got.cpu()
    words = None
    if word is not None:
        words = got[:, -1].tolist()
        words[me] = int(word)
        counts, got = counts[:, :-1], got[:, :-1]
    row_bytes = torch.tensor([specs[p][2] for p in names], dtype=torch.int64)
    send = torch.cat([_as_bytes(parts[p][d]) for d in range(n) if d != me for p in names]).to(dev) \
        if len(names) else torch.zeros(0, dtype=torch.uint8, device=dev)
    recv = torch.empty(int((got * row_bytes).sum()), dtype=torch.uint8, device=dev)
    # (even with nothing to move: whether a peer has rows for another is not known here)
    work = dist.all_to_all_single(recv, send, output_split_sizes=(got * row_bytes).sum(1).tolist(),
                                  input_split_sizes=(counts * row_bytes).sum(1).tolist(), group=group, async_op=True)
    own = {p: parts[p][me] for p in names}

    def finish() -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {p: [] for p in names}
        offset = 0
        for s in range(n):
            for k, p in enumerate(names):
                if s == me:
                    out[p].append(own[p])
                    continue
                dtype, shape, rb = specs[p]
                rows = int(got[s, k])
                out[p].append(_from_bytes(recv[offset:offset + rows * rb], dtype, shape, rows, out_dev))
                offset += rows * rb
        return out

    deadline = _count_parts(issued, "all_to_all", group, counter, name, index, specs,
                            dict(zip(names, counts.sum(0).tolist())), dict(zip(names, got.sum(0).tolist())),
                            (n - 1) * (len(names) + len(extra)) * 8)
    handle = Handle([work], finish, deadline)
    handle.words = words
    return handle


def all_gather_parts(parts: dict[str, torch.Tensor], group=None, name: str = "all_gather_parts",
                     counter: ByteCounter | None = None, index: Sequence[str] = ()) -> dict[str, list[torch.Tensor]]:
    """Every rank's ``parts[p]`` (``[n_r, *row]``), in group rank order, on the device of the parts:
    one all-gather of the row counts, one of all parts packed as bytes (padded to the longest).

    Counted as ``all_to_all_rows`` is, as if each rank sent its rows to each peer: ``sent`` is its
    rows times ``group size - 1``, ``received`` the other ranks' rows, so the group's sent and
    received totals are equal, as an all-to-all's are. With one process: ``{p: [parts[p]]}``."""
    issued = time.perf_counter()
    counter = DEFAULT_COUNTER if counter is None else counter
    n = group_size(group) if _active(group) else 1
    specs = _part_specs({p: [t] for p, t in parts.items()}, 1)
    if n == 1:
        return {p: [t] for p, t in parts.items()}
    me, dev = group_rank(group), comm_device(group)
    names = list(parts)
    out_dev = parts[names[0]].device
    mine = torch.tensor([parts[p].shape[0] for p in names], dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine, group=group)
    counts = torch.stack(every).cpu()  # [n, parts]
    row_bytes = torch.tensor([specs[p][2] for p in names], dtype=torch.int64)
    sizes = (counts * row_bytes).sum(1)
    longest = int(sizes.max())
    buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
    packed = torch.cat([_as_bytes(parts[p]) for p in names]).to(dev)
    buf[:packed.numel()] = packed
    gathered = [torch.empty_like(buf) for _ in range(n)]
    if longest:  # nobody wrote: no second collective
        dist.all_gather(gathered, buf, group=group)
    out: dict[str, list[torch.Tensor]] = {p: [] for p in names}
    for s in range(n):
        offset = 0
        for k, p in enumerate(names):
            dtype, shape, rb = specs[p]
            rows = int(counts[s, k])
            out[p].append(parts[p] if s == me else _from_bytes(gathered[s][offset:offset + rows * rb], dtype, shape,
                                                               rows, out_dev))
            offset += rows * rb
    others = counts.sum(0) - counts[me]
    _sleep_until(_count_parts(issued, "all_gather", group, counter, name, index, specs,
                              dict(zip(names, (counts[me] * (n - 1)).tolist())), dict(zip(names, others.tolist())),
                              (n - 1) * len(names) * 8))
    return out
