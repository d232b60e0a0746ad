"""The i x j x k schedule of DistTGL (Zhou et al., section 3.2): which events, which negative set,
which memory copy and whether to write, for every (rank, iteration). Pure functions only: nothing
here touches processes, tensors or the environment, so the whole schedule is unit-tested apart.

Layout (``Layout``): ``world = i * j * k`` ranks, ``rank = (kk * j + jj) * i + ii``:

- ``ii`` in ``[0, i)``: mini-batch parallelism (3.2.1). The i trainers of a subgroup split one
  *global batch* of ``i * B`` consecutive training events chronologically; trainer ``ii`` takes
  ``[base + ii*B, base + (ii+1)*B)``.
- ``jj`` in ``[0, j)``: epoch parallelism (3.2.2). The j subgroups of a memory group train the same
  positive global batch in consecutive iterations (subgroup jj lags jj iterations behind subgroup
  0), each with its own negative set; only subgroup 0 writes memory.
- ``kk`` in ``[0, k)``: memory parallelism (3.2.3). Each memory group owns one copy of the node
  memory and walks the stream from its own starting segment (a rotation), so no memory moves
  between groups. Group kk = ranks ``[kk*i*j, (kk+1)*i*j)``: contiguous, so with ``i*j`` dividing
  the GPUs per machine a group (and its memory daemon) sits on one machine (section 3.3).

Counting traversals: the run asks for ``epochs`` traversals of the training events in total (what the
single-process run does in ``epochs`` epochs). Every group position is trained by j subgroups and
there are k groups, so each group makes ``passes = epochs / (j*k)`` passes over the stream, and the
whole world traverses exactly ``epochs`` times the training events, like the single-process run
(DistTGL section 4: "we keep the total number of traversed edges to be the same"). With
``nb = ceil(E / (i*B))`` global batches, a group has ``P = passes * nb`` positions and the run has
``T = P + j - 1`` iterations: about ``1/(i*j*k)`` of the single-process ``epochs * ceil(E / B)``.
The ``j - 1`` extra iterations are the pipeline fill and drain of epoch parallelism: every rank is
idle in exactly ``j - 1`` of the T iterations (subgroup jj in the first jj and the last j-1-jj).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tgdist.errors import ConfigError

__all__ = [
    "Layout",
    "Step",
    "ScheduleSummary",
    "num_global_batches",
    "segment_bounds",
    "segment_of",
    "passes_per_group",
    "positions_per_group",
    "num_iterations",
    "global_batch_bounds",
    "local_slice",
    "neg_set_id",
    "negative_seed",
    "step",
    "steps_of_rank",
    "single_process_slices",
    "single_process_iterations",
    "summary",
    "scaled_lr",
    "LR_SCALING_MODES",
    "stream_position",
    "resume_iteration",
    "next_resumable_iteration",
]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Layout:
    """DistTGL's ``i x j x k``: ``i`` trainers per global batch (mini-batch parallelism), ``j``
    epoch-parallel subgroups per memory copy, ``k`` memory copies. ``rank = (kk*j + jj)*i + ii``."""

    i: int = 1
    j: int = 1
    k: int = 1

    def __post_init__(self) -> None:
        for name in ("i", "j", "k"):
            _positive_int(f"parallel.{name}", getattr(self, name))

    @property
    def world_size(self) -> int:
        return self.i * self.j * self.k

    @property
    def group_size(self) -> int:
        """Ranks sharing one memory copy: ``i * j``."""
        return self.i * self.j

    def __str__(self) -> str:
        return f"{self.i} x {self.j} x {self.k}"

    def rank_of(self, ii: int, jj: int, kk: int) -> int:
        if not (0 <= ii < self.i and 0 <= jj < self.j and 0 <= kk < self.k):
            raise ValueError(f"coordinates ({ii}, {jj}, {kk}) outside the layout {self}")
        return (kk * self.j + jj) * self.i + ii

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(ii, jj, kk)`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the world of {self.world_size} ranks ({self})")
        ii = rank % self.i
        jj = (rank // self.i) % self.j
        kk = rank // (self.i * self.j)
        return ii, jj, kk

    def memory_group_ranks(self, kk: int) -> list[int]:
        """The ``i*j`` ranks sharing memory copy ``kk`` (contiguous)."""
        return list(range(kk * self.group_size, (kk + 1) * self.group_size))

    def subgroup_ranks(self, jj: int, kk: int) -> list[int]:
        """The ``i`` ranks that split one positive global batch (mini-batch parallelism)."""
        return [self.rank_of(ii, jj, kk) for ii in range(self.i)]

    def epoch_peer_ranks(self, ii: int, kk: int) -> list[int]:
        """The ``j`` ranks that train the same local slice with different negatives, one per
        subgroup (the path along which DistTGL hands prepared positive inputs on)."""
        return [self.rank_of(ii, jj, kk) for jj in range(self.j)]

    def memory_groups(self) -> list[list[int]]:
        return [self.memory_group_ranks(kk) for kk in range(self.k)]

    def subgroups(self) -> list[list[int]]:
        return [self.subgroup_ranks(jj, kk) for kk in range(self.k) for jj in range(self.j)]

    def epoch_peer_groups(self) -> list[list[int]]:
        return [self.epoch_peer_ranks(ii, kk) for kk in range(self.k) for ii in range(self.i)]


@dataclass(frozen=True)
class Step:
    """What ``rank`` does at ``iteration``. Event indices are absolute (``train_start`` included),
    half-open ``[lo, hi)``; an inactive step has ``lo == hi`` and -1 in the index fields.

    - ``pass_index`` (g): the group's pass over the stream, ``position // nb``.
    - ``position`` (p): the group position this subgroup trains, ``iteration - jj``.
    - ``batch``: global batch index in ``[0, nb)``; ``segment``: its memory-parallel segment.
    - ``neg_set``: identity of the negative set, unique per (memory group, pass, subgroup), in
      ``[0, epochs)``; hash it with the event index (``negative_seed``) for reproducible negatives.
    - ``writes``: only subgroup 0 writes memory/mails back (DistTGL 3.2.2: later subgroups would
      cause read-after-write hazards).
    - ``memory_copy``: the memory group ``kk`` whose copy is read (and written when ``writes``).
    - ``reset_memory``: the copy is reset to zeros before this position is read: at the group's
      first position and whenever the stream wraps to batch 0. It is a property of the position
      (the same for all subgroups at that position); with one shared copy (daemon) it is acted on
      once, before subgroup 0's read.
    - ``read_position`` / ``read_slot``: the read of subgroup jj for position p is served at the
      same logical point as subgroup 0's read of p (before subgroup 0 writes p), into read slot
      ``p % j`` (DistTGL 3.3: j read slots per trainer, ``mem_read_buf[i*j, j, ...]``).
    """

    rank: int
    iteration: int
    active: bool
    pass_index: int
    position: int
    batch: int
    segment: int
    lo: int
    hi: int
    neg_set: int
    writes: bool
    memory_copy: int
    reset_memory: bool
    read_position: int
    read_slot: int

    @property
    def num_events(self) -> int:
        return self.hi - self.lo


def num_global_batches(num_train_events: int, i: int, batch_size: int) -> int:
    """``nb = ceil(num_train_events / (i * B))``: global batches per traversal of the stream."""
    _positive_int("the number of training events", num_train_events)
    _positive_int("parallel.i", i)
    _positive_int("train.batch_size", batch_size)
    return -(-num_train_events // (i * batch_size))


def segment_bounds(nb: int, k: int) -> list[tuple[int, int]]:
    """The ``k`` contiguous segments of ``nb`` global batches, as equal as possible:
    segment s = batches ``[floor(s*nb/k), floor((s+1)*nb/k))`` (memory parallelism, 3.2.3)."""
    if nb < k:
        raise ConfigError(
            f"{nb} global batches cannot be cut into parallel.k = {k} memory segments; "
            "use a smaller parallel.k, parallel.i or train.batch_size"
        )
    return [(s * nb // k, (s + 1) * nb // k) for s in range(k)]


def segment_of(batch: int, nb: int, k: int) -> int:
    """The segment holding global batch ``batch`` (inverse of ``segment_bounds``)."""
    if not 0 <= batch < nb:
        raise ValueError(f"batch {batch} outside [0, {nb})")
    # floor(s*nb/k) <= b < floor((s+1)*nb/k)  <=>  s = ceil((b+1)*k/nb) - 1
    return -(-(batch + 1) * k // nb) - 1


def _nearest_multiples(value: int, m: int) -> str:
    lower = (value // m) * m
    upper = lower + m
    return f"{lower} or {upper}" if lower >= m else f"{upper}"


def passes_per_group(layout: Layout, epochs: int) -> int:
    """``epochs / (j*k)``: passes each memory group makes over the stream, so that all groups and
    subgroups together traverse the training events ``epochs`` times."""
    _positive_int("train.epochs", epochs)
    jk = layout.j * layout.k
    if epochs % jk:
        raise ConfigError(
            f"train.epochs = {epochs} is not a multiple of parallel.j x parallel.k = "
            f"{layout.j} x {layout.k} = {jk} (each memory group makes epochs / (j*k) passes so the "
            f"total traversals equal the single-process run); use train.epochs="
            f"{_nearest_multiples(epochs, jk)}"
        )
    return epochs // jk


def positions_per_group(layout: Layout, num_train_events: int, batch_size: int, epochs: int) -> int:
    """``P = passes * nb``: global batches one memory group trains (each by all j subgroups)."""
    nb = num_global_batches(num_train_events, layout.i, batch_size)
    segment_bounds(nb, layout.k)  # nb >= k
    return passes_per_group(layout, epochs) * nb


def num_iterations(layout: Layout, num_train_events: int, batch_size: int, epochs: int) -> int:
    """``T = P + j - 1``: iterations of every rank (the j-1 are epoch parallelism's fill/drain)."""
    return positions_per_group(layout, num_train_events, batch_size, epochs) + layout.j - 1


def global_batch_bounds(batch: int, num_train_events: int, i: int, batch_size: int,
                        train_start: int = 0) -> tuple[int, int]:
    """Absolute ``[lo, hi)`` of global batch ``batch``: ``i*B`` consecutive events (fewer in the last)."""
    lo = batch * i * batch_size
    hi = min(lo + i * batch_size, num_train_events)
    if not 0 <= lo < num_train_events:
        raise ValueError(f"global batch {batch} starts past the {num_train_events} training events")
    return train_start + lo, train_start + hi


def local_slice(batch: int, ii: int, num_train_events: int, i: int, batch_size: int,
                train_start: int = 0) -> tuple[int, int]:
    """Trainer ``ii``'s chronological share of global batch ``batch`` (mini-batch parallelism,
    3.2.1). A full global batch gives every trainer exactly ``B`` events,
    ``[base + ii*B, base + (ii+1)*B)``; the last, shorter one (S < i*B events) is split as evenly as
    possible, ``[base + floor(ii*S/i), base + floor((ii+1)*S/i))``, sizes differing by at most one.
    A slice is empty only when ``S < i`` (fewer remaining events than trainers), which no split can
    avoid; the trainer then still takes part in the gradient all-reduce with a zero gradient."""
    lo, hi = global_batch_bounds(batch, num_train_events, i, batch_size, train_start)
    size = hi - lo
    return lo + ii * size // i, lo + (ii + 1) * size // i


def neg_set_id(layout: Layout, kk: int, pass_index: int, jj: int) -> int:
    """``(g*k + kk)*j + jj``: a distinct integer per (memory group, pass, subgroup), in
    ``[0, epochs)``. It plays the role of the single-process epoch number for negatives: on
    1 x 1 x 1 it is the epoch."""
    return (pass_index * layout.k + kk) * layout.j + jj


def negative_seed(seed: int, neg_set: int) -> int:
    """A 63-bit seed key for negative set ``neg_set`` of a run seeded ``seed`` (splitmix64 mix), to
    hash with the event index, e.g. ``NegativeSampler(graph, seed=negative_seed(seed,
    step.neg_set)).fixed("train", step.lo, step.hi, num_neg)``: the negatives of an event then
    depend only on (seed, neg_set, event index), whichever rank draws them."""
    mask = (1 << 64) - 1
    x = (int(seed) * 0x9E3779B97F4A7C15 + (int(neg_set) + 1) * 0xD1B54A32D192ED03) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return x >> 1


def step(layout: Layout, rank: int, iteration: int, num_train_events: int, batch_size: int,
         epochs: int, train_start: int = 0) -> Step:
    """What ``rank`` does at ``iteration`` (DistTGL 3.2.1-3.2.3 combined).

    Memory group kk walks positions p = 0, 1, ...: pass ``g = p // nb``; batch
    ``(first batch of segment kk + p % nb) % nb``, i.e. segments kk, kk+1, ..., k-1, 0, ..., kk-1.
    Subgroup jj trains position ``p = iteration - jj`` (inactive outside ``[0, P)``).
    """
    T = num_iterations(layout, num_train_events, batch_size, epochs)
    if not 0 <= iteration < T:
        raise ValueError(f"iteration {iteration} outside [0, {T})")
    ii, jj, kk = layout.coords(rank)
    nb = num_global_batches(num_train_events, layout.i, batch_size)
    P = positions_per_group(layout, num_train_events, batch_size, epochs)
    p = iteration - jj
    if not 0 <= p < P:
        return Step(rank=rank, iteration=iteration, active=False, pass_index=-1, position=-1,
                    batch=-1, segment=-1, lo=train_start, hi=train_start, neg_set=-1, writes=False,
                    memory_copy=kk, reset_memory=False, read_position=-1, read_slot=-1)
    start = segment_bounds(nb, layout.k)[kk][0]
    g = p // nb
    batch = (start + p % nb) % nb
    lo, hi = local_slice(batch, ii, num_train_events, layout.i, batch_size, train_start)
    return Step(
        rank=rank,
        iteration=iteration,
        active=True,
        pass_index=g,
        position=p,
        batch=batch,
        segment=segment_of(batch, nb, layout.k),
        lo=lo,
        hi=hi,
        neg_set=neg_set_id(layout, kk, g, jj),
        writes=jj == 0,
        memory_copy=kk,
        reset_memory=p == 0 or batch == 0,
        read_position=p,
        read_slot=p % layout.j,
    )


def steps_of_rank(layout: Layout, rank: int, num_train_events: int, batch_size: int, epochs: int,
                  train_start: int = 0) -> list[Step]:
    """All T steps of one rank, in iteration order."""
    T = num_iterations(layout, num_train_events, batch_size, epochs)
    return [step(layout, rank, t, num_train_events, batch_size, epochs, train_start) for t in range(T)]


def single_process_slices(num_train_events: int, batch_size: int, epochs: int,
                          train_start: int = 0) -> list[tuple[int, int, int]]:
    """The plain chronological loop: ``(epoch, lo, hi)`` for every batch of every epoch."""
    _positive_int("train.epochs", epochs)
    nb = num_global_batches(num_train_events, 1, batch_size)
    return [(e, *global_batch_bounds(b, num_train_events, 1, batch_size, train_start))
            for e in range(epochs) for b in range(nb)]


def single_process_iterations(num_train_events: int, batch_size: int, epochs: int) -> int:
    return epochs * num_global_batches(num_train_events, 1, batch_size)


def _one_group(layout: Layout) -> None:
    if layout.j != 1 or layout.k != 1:
        raise ValueError(f"the stream position of layout {layout} is not one place in the stream (j = k = 1 only)")


def stream_position(layout: Layout, iteration: int, num_train_events: int, batch_size: int) -> tuple[int, int]:
    """``(pass, events)``: where a run of ``layout`` (one memory group, j = k = 1) stands before
    ``iteration``: passes done over the stream, and events of the pass under way trained so far
    (``batch * i * B``, a whole global batch each; the last batch of a pass, shorter, ends it)."""
    _one_group(layout)
    nb = num_global_batches(num_train_events, layout.i, batch_size)
    g, b = divmod(iteration, nb)
    return g, b * layout.i * batch_size


def resume_iteration(old: Layout, iteration: int, new: Layout, num_train_events: int, batch_size: int) -> int | None:
    """The iteration of layout ``new`` that continues a run of layout ``old`` (both j = k = 1)
    stopped before ``iteration``: the one starting at the same place in the stream, or None where
    that place is not a boundary of ``new``'s global batches of ``new.i * B`` events (the first
    batch would be a part of one; a resume there is refused, see ``next_resumable_iteration``)."""
    _one_group(new)
    g, events = stream_position(old, iteration, num_train_events, batch_size)
    b, rest = divmod(events, new.i * batch_size)
    if rest:
        return None
    return g * num_global_batches(num_train_events, new.i, batch_size) + b


def next_resumable_iteration(old: Layout, iteration: int, new: Layout, num_train_events: int, batch_size: int) -> int:
    """The first iteration of ``old`` from ``iteration`` on whose place in the stream is a boundary
    of ``new``'s global batches (an end of pass always is)."""
    t = iteration
    while resume_iteration(old, t, new, num_train_events, batch_size) is None:
        t += 1
    return t


@dataclass(frozen=True)
class ScheduleSummary:
    """Counts of one schedule, for logs and the planner."""

    layout: str
    world_size: int
    num_global_batches: int
    passes_per_group: int
    positions_per_group: int
    iterations: int
    single_process_iterations: int
    speedup_in_iterations: float  # single-process iterations / iterations (ideal: i*j*k)
    idle_fraction: float  # (j-1)/T: share of a rank's iterations with nothing to train


def summary(layout: Layout, num_train_events: int, batch_size: int, epochs: int) -> ScheduleSummary:
    T = num_iterations(layout, num_train_events, batch_size, epochs)
    single = single_process_iterations(num_train_events, batch_size, epochs)
    return ScheduleSummary(
        layout=str(layout),
        world_size=layout.world_size,
        num_global_batches=num_global_batches(num_train_events, layout.i, batch_size),
        passes_per_group=passes_per_group(layout, epochs),
        positions_per_group=positions_per_group(layout, num_train_events, batch_size, epochs),
        iterations=T,
        single_process_iterations=single,
        speedup_in_iterations=single / T,
        idle_fraction=(layout.j - 1) / T,
    )


LR_SCALING_MODES = ("linear", "sqrt", "none")


def scaled_lr(base_lr: float, i: int, j: int = 1, k: int = 1, mode: str = "linear") -> float:
    """Learning rate of an ``i x j x k`` run whose single-process rate is ``base_lr``.

    DistTGL (section 4.0.1) sets "the learning rate to be linear with the global batch size", and its
    global batch is the ``i * B`` events that the i trainers of one subgroup split (3.2.1), so
    ``"linear"`` (the default) gives ``base_lr * i``, whatever j and k are.

    Reasoning, since gradients are averaged over all ``i*j*k`` ranks: the average covers
    ``i*j*k*B`` events per step, but not that many independent samples. The j subgroups train the
    *same* positive events (only their negatives differ, 3.2.2), so they mostly reduce the variance
    of the negative term. The k groups do see different events, yet each on its own memory copy,
    which DistTGL treats like running epochs side by side rather than as a larger batch. Note the
    consequence: the run makes ``1/(i*j*k)`` of the single-process steps with ``i`` times the rate,
    so its summed step size is ``1/(j*k)`` of the single-process one; the experiments of DistTGL
    (section 4) use this rule. ``"sqrt"`` (``base_lr * sqrt(i)``) is the milder rule often
    used with adaptive optimisers such as Adam; ``"none"`` keeps ``base_lr``.
    """
    for name, v in (("parallel.i", i), ("parallel.j", j), ("parallel.k", k)):
        _positive_int(name, v)
    if mode == "linear":
        return base_lr * i
    if mode == "sqrt":
        return base_lr * math.sqrt(i)
    if mode == "none":
        return base_lr
    raise ConfigError(f"train.lr_scaling = {mode!r} is not one of {', '.join(LR_SCALING_MODES)}")
