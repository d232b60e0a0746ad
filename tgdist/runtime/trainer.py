"""The single-process training loop: one iteration as in DESIGN.md, written once with named phases.

sample -> features -> memory read -> compute (update, embed, loss, backward, step) -> memory write.
Every distributed or pipelined mode is a controlled change of ``Trainer.step``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tgdist.data.device_sampler import DeviceSampler
from tgdist.data.graph import Split, TemporalGraph
from tgdist.data.sampler import NegativeSampler, TemporalSampler
from tgdist.distributed import collectives
from tgdist.errors import ConfigError
from tgdist.kernels import graph as kernels
from tgdist.kernels import jit
from tgdist.memory.store import LocalMemory, MemoryStore
from tgdist.models.modules import EmbedInput, HopTables, TemporalModel
from tgdist.runtime.cache import EmbeddingCache, prune_nodes
from tgdist.runtime.features import RelativeTimes, feature_table
from tgdist.runtime.metrics import average_precision_t, reciprocal_ranks_t, roc_auc_t
from tgdist.runtime.tgb_eval import one_vs_many
from tgdist.uploads import upload

log = logging.getLogger(__name__)

# Uniform-sampling streams that evaluation and queries draw from, apart from training's.
SIDE_STREAMS = {"train": 0, "val": 1, "test": 2, "embed": 3, "replay": 4}

STAGES = ("sample", "features", "memory_read", "compute", "memory_write")


@dataclass
class BatchOutput:
    """Result of one iteration over events ``[lo, hi)``: ``pos [b]`` and ``neg [b, num_neg]`` logits.
    ``loss_t``: the batch's mean loss, a float64 scalar on the trainer's device, left there (reading
    it waits for the device); ``loss`` reads it: the same float as summing the float32 losses in
    Python (float64 additions in the same order)."""

    lo: int
    hi: int
    loss_t: torch.Tensor
    pos: torch.Tensor
    neg: torch.Tensor
    h_src: torch.Tensor | None = None  # [b, dim] when requested (downstream tasks)
    h_dst: torch.Tensor | None = None

    @property
    def loss(self) -> float:
        return float(self.loss_t)


@dataclass
class Prepared:
    """A batch after sampling, feature indexing and memory read, ready for ``Trainer.compute``:
    ``ids [num_unique]`` nodes, ``root_idx [num_roots]`` into them, one ``HopTables`` per hop, the
    raw sampled hops, the memory read of ``ids`` and the negatives used; ``inner``: the embedding
    cache's lookup when it was made before the read (``Trainer.prepare(lookup=True)``), else None."""

    lo: int
    hi: int
    num_neg: int
    ids: torch.Tensor
    root_idx: torch.Tensor
    hop_tables: list
    hops: list
    read: object
    neg: np.ndarray  # [hi - lo, num_neg]
    inner: object | None = None


@dataclass
class Sampled:
    """A batch's roots after phases sample and features, before its memory read: what a prefetch
    worker can build ahead of time (``Trainer.sample``), since it depends on the graph alone."""

    lo: int
    hi: int
    ids: torch.Tensor
    root_idx: torch.Tensor
    hop_tables: list
    hops: list


def occurrences(s: "Sampled | Prepared") -> torch.Tensor:
    """How often the batch ``s`` uses each of ``s.ids`` (int64, aligned with it): as a root, and in
    each hop's neighbour slots that are not masked. Their sum is the batch's sampled vertices,
    Sven's N1."""
    n = s.ids.shape[0]
    out = torch.bincount(s.root_idx, minlength=n)
    for h in s.hop_tables:
        out += torch.bincount(h.nbr[h.mask], minlength=n)
    return out


def micro_bounds(lo: int, hi: int, n: int) -> list[tuple[int, int]]:
    """Events ``[lo, hi)`` cut into ``n`` consecutive micro-batches of sizes differing by at most
    one, the larger first (empty ones at the end when there are fewer events than ``n``)."""
    size, extra = divmod(hi - lo, n)
    out, a = [], lo
    for m in range(n):
        b = a + size + (m < extra)
        out.append((a, b))
        a = b
    return out


_TIMER_LOCK = threading.Lock()


def _no_turn(stage: str):
    return contextlib.nullcontext()


@dataclass
class StageTimer:
    """Accumulated seconds per stage (MSPipe Table 1 style breakdown)."""

    seconds: dict = field(default_factory=lambda: defaultdict(float))
    # a list to record ``(stage, thread, start, end)`` of every interval in (timelines); None: not
    spans: list | None = None

    def add(self, stage: str, dt: float) -> None:
        with _TIMER_LOCK:  # stages may run in several threads (prefetch, MSPipe's stages)
            self.seconds[stage] += dt
            if self.spans is not None:
                now = time.perf_counter()
                self.spans.append((stage, threading.current_thread().name, now - dt, now))

    def table(self, events: int) -> str:
        total = sum(self.seconds.values()) or 1e-12
        rows = [f"{'stage':<13}{'seconds':>9}{'share':>8}{'ms/1k ev':>10}"]
        for s in STAGES:
            v = self.seconds.get(s, 0.0)
            rows.append(f"{s:<13}{v:9.2f}{100 * v / total:7.1f}%{1000 * v / max(events, 1) * 1000:10.2f}")
        rows.append(f"{'total':<13}{total:9.2f}{'':>8}{1000 * total / max(events, 1) * 1000:10.2f}")
        return "\n".join(rows)


class Progress:
    """A rank-0 progress line with events/s on stderr (redrawn on a TTY, every ~10 s otherwise)."""

    def __init__(self, total: int, desc: str, enabled: bool = True, unit: str = "events"):
        self.total, self.desc, self.enabled, self.unit = total, desc, enabled, unit
        self.done = 0
        self.start = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, n: int, **info) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if (self.tty and now - self.last > 0.2) or now - self.last > 10 or self.done >= self.total:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            info = {k: v() if callable(v) else v for k, v in info.items()}  # values read only when shown
            extra = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
            per_s = "ev/s" if self.unit == "events" else f"{self.unit}/s"
            line = (f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} "
                    f"({100 * self.done / max(self.total, 1):5.1f}%) {rate:,.0f} {per_s} {extra}")
            sys.stderr.write(("\r" + line + ("\n" if self.done >= self.total else "")) if self.tty else line + "\n")
            sys.stderr.flush()


class StepHooks:
    """What ``Trainer.compute`` calls during one training step, in this order: ``before_write()``
    just before the memory write; ``write(fn)`` with the write as a function of no arguments (run
    it now, or hand it to a stage that runs it later); ``written()`` after it (a parallel run starts
    sending the writes there, ``MemoryStore.start_exchange``, so they travel during the backward
    pass); ``sync_gradients(params)`` between the backward pass and the optimizer step (a parallel
    run averages the replicas' gradients; False: take no step now). These defaults are the plain
    step of one process: write at once, step at once."""

    def before_write(self) -> None:
        pass

    def write(self, fn: Callable[[], None]) -> None:
        fn()

    def written(self) -> None:
        pass

    def sync_gradients(self, params) -> bool:
        return True


class GradientHooks(StepHooks):
    """The plain step with ``sync(params)`` (its result as ``sync_gradients``'s) between backward
    and the step: a test's recorder, or an averaging over ranks."""

    def __init__(self, sync: Callable):
        self._sync = sync

    def sync_gradients(self, params) -> bool:
        return self._sync(params) is not False


PLAIN_STEP = StepHooks()


class Trainer:
    """Owns one model, one memory store, the sampler and the optimizer; runs epochs and evaluation."""

    # train.eval=tgb: the negatives a TGB data set ships (tgdist.data.tgb.ShippedNegatives), which
    # ``evaluate`` ranks each val/test event against (runtime.tgb_eval); and where it writes the scores
    shipped = None
    scores_dir = None

    def __init__(self, graph: TemporalGraph, split: Split, model: TemporalModel, memory: MemoryStore,
                 sampler: TemporalSampler | None, negatives: NegativeSampler, *, batch_size: int = 200,
                 lr: float = 1e-4, num_neg_eval: int = 49, device: str = "cpu", progress: bool = True,
                 num_threads: int = 0, units_per_second: float = 1.0, cache: EmbeddingCache | None = None,
                 device_sampler: DeviceSampler | None = None):
        self.g, self.split, self.model, self.memory = graph, split, model, memory
        self.cache = cache  # FreshGNN's historical embedding cache, consulted by training steps only
        self.sampler, self.negatives = sampler, negatives
        self.batch_size, self.num_neg_eval = batch_size, num_neg_eval
        self.device = torch.device(device)
        self.progress = progress
        self.optimizer = adam(model.parameters(), lr)
        # Model times are float64 seconds since the first event (the data's times divided by
        # ``units_per_second``, data.time_unit): exact for int64 spans below 2**53 units.
        self.units_per_second = float(units_per_second)
        self.t_rel = RelativeTimes(graph.t, self.units_per_second)
        self.edge_feat = feature_table(graph.edge_feat, self.device, "edge")
        self.node_feat = feature_table(graph.node_feat, self.device, "node")
        self.timer = StageTimer()
        self.writes_enabled = True
        # the recent sampler on the device (build.device_sampler): the events' endpoints and times there too
        self.device_sampler = device_sampler
        if device_sampler is not None:
            self._events = tuple(torch.from_numpy(np.array(a)).to(self.device) for a in (graph.src, graph.dst, graph.t))
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        jit.track_compiles()  # an epoch's events/s leaves out one-time kernel compiles

    # ------------------------------------------------------------------------------------------
    # One iteration

    def step(self, lo: int, hi: int, neg: np.ndarray, train: bool, keep_emb: bool = False,
             hooks: StepHooks | None = None) -> BatchOutput:
        """One iteration over events ``[lo, hi)`` with negatives ``neg [hi - lo, num_neg]``."""
        p = self.prepare(lo, hi, neg, lookup=train)
        out = self.compute(p, train, keep_emb=keep_emb, hooks=hooks)
        self.memory.exchange()  # the iteration's end, as in ``Run``: its writes visible before the next read
        return out

    def prepare(self, lo: int, hi: int, neg: np.ndarray, read=None, sampled: Sampled | None = None,
                lookup: bool = False) -> "Prepared":
        """Phases sample, features and memory read: everything before the model runs. Parallel
        modes call it ahead of ``compute`` (epoch parallelism reads memory before the write of the
        position it will train later). ``sampled``: the batch's ``sample`` made earlier (a prefetch
        worker's); ``read``: its memory read, restored from a checkpoint. ``lookup``: the batch is
        the next one to train, so the embedding cache (if any) is looked up now, as ``compute``
        would, and the nodes that only the pruned hop-2 rows reach are neither read nor updated."""
        s = sampled if sampled is not None else self.sample(lo, hi, neg)
        inner = None
        if lookup and self.cache is not None and read is None:
            t1 = time.perf_counter()
            s, inner = self._look_up(s)
            self.timer.add("features", time.perf_counter() - t1)
        t2 = time.perf_counter()
        if read is None:
            read = self.memory.read(s.ids, **self._uses(s))
        elif isinstance(getattr(read, "mem", None), torch.Tensor) and read.mem.shape[0] != s.ids.shape[0]:
            # a read restored from a checkpoint is used as it was, with the node table it was made for
            raise ConfigError(f"the checkpoint's memory read of batch [{lo}, {hi}) has {read.mem.shape[0]:,} rows "
                              f"where this sampler gives {s.ids.shape[0]:,} nodes: it was made with sampler.on_device="
                              f"{str(self.device_sampler is None).lower()}; resume with that setting")
        self.timer.add("memory_read", time.perf_counter() - t2)
        return Prepared(lo, hi, neg.shape[1], s.ids, s.root_idx, s.hop_tables, s.hops, read, neg, inner)

    def _uses(self, s: Sampled) -> dict:
        """What a read of ``s`` passes the store besides the ids: the occurrences, where it wants them."""
        return {"occurrences": occurrences(s)} if self.memory.wants_occurrences else {}

    def _look_up(self, s: Sampled) -> tuple[Sampled, object]:
        """The cache's lookup of a batch about to train, and the batch without the nodes that only
        hop-2 rows layer 1 does not compute reach (``cache.prune_nodes``)."""
        inner = self.cache.lookup(s.hops, s.lo)
        pruned = prune_nodes(s.ids, s.root_idx, s.hop_tables, inner.compute_rows)
        return (s if pruned is None else Sampled(s.lo, s.hi, *pruned, s.hops)), inner

    def prepare_micro(self, lo: int, hi: int, neg: np.ndarray, n: int,
                      sampled: list[Sampled] | None = None, lookup: bool = False) -> list["Prepared"]:
        """``prepare`` of the ``n`` micro-batches of ``[lo, hi)`` (``micro_bounds``), their reads
        issued together before any of them trains (``MemoryStore.read_many``), so each reads the
        memory the whole batch would read; a store that fetches rows over the network leaves them
        in flight (``Prepared.read`` a ``Handle``) until ``compute`` needs them. ``lookup`` as in
        ``prepare`` (the micro-batches of one iteration see the same cache)."""
        bounds = micro_bounds(lo, hi, n)
        samples = sampled if sampled is not None else self.sample_micro(lo, hi, neg, n)
        inners = [None] * len(samples)
        if lookup and self.cache is not None:
            samples, inners = map(list, zip(*[self._look_up(s) for s in samples]))
        t2 = time.perf_counter()
        uses = {"occurrences": [occurrences(s) for s in samples]} if self.memory.wants_occurrences else {}
        reads = self.memory.read_many([s.ids for s in samples], **uses)
        self.timer.add("memory_read", time.perf_counter() - t2)
        return [Prepared(a, b, neg.shape[1], s.ids, s.root_idx, s.hop_tables, s.hops, r, neg[a - lo:b - lo], c)
                for (a, b), s, r, c in zip(bounds, samples, reads, inners)]

    def sample(self, lo: int, hi: int, neg: np.ndarray, turn=None) -> Sampled:
        """Phases sample and features of events ``[lo, hi)`` with negatives ``neg``: the roots
        ``[src | dst | neg column 0 | neg column 1 | ...]``, their neighbours and the unique tables.
        Reads the graph only, so it may run in another thread (prefetch, MSPipe's stages).
        ``turn(stage)``: a context manager each phase runs in (MSPipe's per-stage locks)."""
        g = self.g
        num_neg = neg.shape[1]
        if self.device_sampler is not None:  # the roots gathered on the device; the negatives go up
            src, dst, t = self._events
            roots = torch.cat([src[lo:hi], dst[lo:hi], upload(neg.T.reshape(-1), self.device)])
            root_t = t[lo:hi].repeat(2 + num_neg)
        else:
            roots = np.concatenate([g.src[lo:hi], g.dst[lo:hi], neg.T.reshape(-1)])
            root_t = np.tile(g.t[lo:hi], 2 + num_neg)
        return Sampled(lo, hi, *self._sample_and_organize(roots, root_t, turn))

    def sample_micro(self, lo: int, hi: int, neg: np.ndarray, n: int) -> list[Sampled]:
        return [self.sample(a, b, neg[a - lo:b - lo]) for a, b in micro_bounds(lo, hi, n)]

    def _sample_and_organize(self, roots: np.ndarray, root_t: np.ndarray, turn=None):
        """Phases sample (the roots' neighbours before their times) and features (unique nodes
        and index tables into them). Returns ``ids, root_idx, hop_tables, hops``."""
        tm, turn = self.timer, turn or _no_turn
        if self.device_sampler is not None:
            return self._sample_on_device(roots, root_t, turn)
        with turn("sample"):
            t0 = time.perf_counter()
            hops = self.sampler.sample(roots, root_t) if self.model.num_hops else []
            tm.add("sample", time.perf_counter() - t0)
        with turn("features"):
            return self._organize(roots, hops)

    def _organize(self, roots: np.ndarray, hops: list):
        """Phase features: unique nodes of the roots and their sampled neighbours, and index tables into them."""
        dev, tm = self.device, self.timer
        t1 = time.perf_counter()
        parts = [roots] + [h.nbr[h.mask] for h in hops]
        unique, psi, _ = kernels.organize(np.concatenate(parts) if len(parts) > 1 else roots)
        offset = roots.shape[0]
        root_idx = upload(psi[:offset], dev)
        hop_tables = []
        for h in hops:
            idx = np.zeros(h.nbr.shape, dtype=np.int64)
            cnt = int(h.mask.sum())
            idx[h.mask] = psi[offset:offset + cnt]
            offset += cnt
            hop_tables.append(self._hop_tables(h, idx))
        ids = upload(unique, dev)
        tm.add("features", time.perf_counter() - t1)
        return ids, root_idx, hop_tables, hops

    def _sample_on_device(self, roots, root_t, turn):
        """``_sample_and_organize`` with the device sampler. Its node table is not deduplicated
        (finding the distinct ids would read their count back from the device): it is every node
        of the graph, in id order, when the graph has no more nodes than the batch has roots and
        sampled slots (each node then updated once: evaluation's 50 roots an event on a graph of
        10,000 nodes update 10,000 rows, not 550,000), else the roots and slots as they are. Each
        hop's time-gap and event tables have one entry a slot. The model computes what the host's
        tables give, row for row (a node in two rows is updated twice, the same way); empty slots
        name node 0 and event 0, masked out as the host's are. ``hops`` stays empty: no step that
        needs the sampled hops on the host runs with this sampler (``build.device_sampler``)."""
        dev, tm = self.device, self.timer
        with turn("sample"):
            t0 = time.perf_counter()
            if isinstance(roots, np.ndarray):  # queries from the host (embed, replay)
                roots, root_t = upload(roots.astype(np.int64), dev), upload(np.asarray(root_t, self.g.t.dtype), dev)
            hops = self.device_sampler.sample(roots, root_t)
            tm.add("sample", time.perf_counter() - t0)
        with turn("features"):
            t1 = time.perf_counter()
            every_node = self.g.num_nodes <= roots.shape[0] + sum(h.nbr.numel() for h in hops)
            if every_node:  # row u is node u
                ids, root_idx = torch.arange(self.g.num_nodes, device=dev), roots
            else:  # row i is the i-th of the roots and slots
                ids = torch.cat([roots] + [h.nbr.reshape(-1) for h in hops]).clamp(min=0)
                root_idx = torch.arange(roots.shape[0], device=dev)
            offset = roots.shape[0]
            tables = []
            for h in hops:
                n = h.nbr.numel()
                own = torch.arange(n, device=dev).view(h.nbr.shape)  # slot i: entry i of its hop's tables
                dt = h.dt.reshape(-1)
                if self.units_per_second != 1.0:
                    dt = dt / self.units_per_second  # float32, as the host's table
                edge_index = edge_feat = None
                if self.edge_feat is not None:
                    edge_index = own
                    edge_feat = self.edge_feat.index_select(0, torch.where(h.mask, h.eid, 0).reshape(-1))
                tables.append(HopTables(h.nbr.clamp(min=0) if every_node else own + offset, h.mask, own, dt, edge_index,
                                        edge_feat))
                offset += n
            tm.add("features", time.perf_counter() - t1)
        return ids, root_idx, tables, []

    @torch.no_grad()
    def embed(self, nodes: np.ndarray, times: np.ndarray) -> torch.Tensor:
        """Embeddings ``[len(nodes), dim]`` of ``nodes`` at ``times`` (the graph's time dtype) from
        the current memory, which is not written: what roots of the next batch would get
        (node-classification queries, e.g. TGL ``labels.csv``). ``nodes`` are ids 0..N-1
        (``g.node_map`` holds the original ones); ``times``, one per node, must be finite. The
        model runs in eval mode (no dropout) and without gradients, whatever mode it is in, so a
        query gives the same answer each time; the mode is left as it was."""
        nodes, times = np.asarray(nodes), np.asarray(times)
        if nodes.ndim != 1 or times.shape != nodes.shape:
            raise ValueError(f"embed: nodes and times must be 1-D arrays of one length, got shapes {nodes.shape} "
                             f"and {times.shape}")
        if nodes.size and (not np.issubdtype(nodes.dtype, np.integer) or nodes.min() < 0
                           or nodes.max() >= self.g.num_nodes):
            raise ValueError(f"embed: node ids must be integers in 0..{self.g.num_nodes - 1} (g.node_map maps them "
                             f"to the data's ids), got {nodes.min()}..{nodes.max()} ({nodes.dtype})")
        if not np.isfinite(times).all():
            raise ValueError("embed: times must be finite numbers")
        model, training = self.model, self.model.training
        with self.side_stream(SIDE_STREAMS["embed"]):
            ids, root_idx, hop_tables, _ = self._sample_and_organize(nodes.astype(np.int64), times)
        model.eval()
        try:
            with torch.no_grad():
                upd = model.updater(self.memory.read(ids))
                h = model.node_repr(ids, upd, None if self.node_feat is None else self.node_feat[ids])
                t_rel = upload(self._seconds(times - self.g.t[0]), self.device)
                return model.embedding(EmbedInput(h, upd.mem_ts, root_idx, t_rel, hop_tables))
        finally:
            model.train(training)

    def compute(self, p: "Prepared | list[Prepared]", train: bool, keep_emb: bool = False, write: bool | None = None,
                hooks: StepHooks | None = None) -> BatchOutput:
        """Phases compute (update memory once per unique node, embed, score, learn) and memory
        write. ``write`` overrides ``writes_enabled`` (epoch-parallel subgroups other than the
        first do not write). ``hooks`` (``StepHooks``; default: write and step at once) is the
        run's pipeline in this step: ``sync_gradients`` between backward and the optimizer step
        (a parallel run's averaging over the replicas; False: no step now, the first iteration of
        asynchronous all-reduce).

        The memory write needs the forward pass only, so it is made before the (last) backward
        pass: ``hooks.before_write()`` just before it (MSPipe: a read of a later batch issued
        during this forward pass is waited for there, so it misses this write), the write itself
        through ``hooks.write(fn)`` (MSPipe's update stage runs it later, in another thread), then
        ``hooks.written()`` (a parallel run starts sending the writes there,
        ``MemoryStore.start_exchange``, so they travel during the backward pass).

        ``p`` may be a batch's micro-batches (``prepare_micro``): each runs forward and backward
        in turn with its loss weighted by its share of the events, so the gradients accumulate to
        the whole batch's (up to float rounding) and one optimizer step follows; the memory write
        is the whole batch's, from every micro-batch's updated memory, so memory and mails end as
        with one batch. A micro-batch's read is resolved (its transfer waited for) only when it
        trains, so the next ones' rows travel meanwhile."""
        model, dev, tm, hooks = self.model, self.device, self.timer, hooks or PLAIN_STEP
        parts = p if isinstance(p, list) else [p]
        lo, hi, num_neg = parts[0].lo, parts[-1].hi, parts[0].num_neg
        b = hi - lo
        t3 = time.perf_counter()
        rows, rows_ts, hop1, pos_l, neg_l, src_l, dst_l = [], [], [], [], [], [], []
        loss_value, pending, wrote, inners = None, None, 0.0, []
        with torch.set_grad_enabled(train):
            if train:
                self.optimizer.zero_grad(set_to_none=True)
            for q in parts:
                if pending is not None:  # the previous micro-batch's backward
                    pending.backward()
                    pending = None
                bq = q.hi - q.lo
                upd = self.memory.update(collectives.resolve(q.read), model.updater)
                if bq == 0:  # a micro-batch left without events: its update still runs (a store's may be a
                    if train and upd.mem.requires_grad:  # collective, DepComm's), and so does its backward
                        pending = upd.mem.sum() * 0
                    continue
                h = model.node_repr(q.ids, upd, None if self.node_feat is None else self.node_feat[q.ids])
                root_t_rel = upload(np.tile(self.t_rel[q.lo:q.hi], 2 + num_neg), dev)
                inner = q.inner
                if inner is None and self.cache is not None and train:
                    inner = self.cache.lookup(q.hops, q.lo)
                if inner is not None:
                    if not train or inner.iteration != self.cache.iteration:
                        raise RuntimeError(f"batch [{q.lo}, {q.hi}) was looked up in the embedding cache at its "
                                           f"iteration {inner.iteration}, but is computed at {self.cache.iteration} "
                                           f"(train={train}): look up only the next batch to train")
                    inners.append(inner)
                emb = model.embedding(EmbedInput(h, upd.mem_ts, q.root_idx, root_t_rel, q.hop_tables, inner))
                # split, not slices: the backward of slices zero-fills a full-size gradient per slice
                h_src, rest = emb.split([bq, emb.shape[0] - bq])
                h_dst = rest[:bq]
                # one call scores [dst | neg_0 | neg_1 ...] per source, so W_s h_src is computed once
                logits = model.predictor(h_src, rest.view(1 + num_neg, bq, -1).transpose(0, 1))
                pos, negl = logits.split([1, num_neg], dim=1)
                pos = pos.squeeze(1)
                loss = (F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos))
                        + F.binary_cross_entropy_with_logits(negl, torch.zeros_like(negl)))
                if len(parts) > 1:  # the batch's mean loss is the micro-batches' means weighted by their events
                    loss = loss * (bq / b)
                if train:
                    pending = loss
                # on the device, in float64: a read here would wait for the device every step
                lq = loss.detach().double()
                loss_value = lq if loss_value is None else loss_value + lq
                pos_idx = q.root_idx[:2 * bq]  # the positive roots [src | dst]: what the write needs
                rows.append(upd.mem.detach().index_select(0, pos_idx))
                rows_ts.append(upd.mem_ts.index_select(0, pos_idx))
                if q.hops:
                    hop1.append((q.hops[0].nbr[:2 * bq], q.hops[0].mask[:2 * bq]))
                pos_l.append(pos.detach())
                neg_l.append(negl.detach())
                if keep_emb:
                    src_l.append(h_src.detach())
                    dst_l.append(h_dst.detach())
            # memory write: positive roots only, with values from this forward pass (detached)
            hooks.before_write()
            w0 = time.perf_counter()
            if (self.writes_enabled if write is None else write) and b > 0:
                sizes = [q.hi - q.lo for q in parts if q.hi > q.lo]
                mem_rows, ts_rows = _src_then_dst(rows, sizes), _src_then_dst(rows_ts, sizes)
                nbr = mask = None
                if hop1:
                    nbr = np.concatenate([n[:k] for (n, _), k in zip(hop1, sizes)]
                                         + [n[k:] for (n, _), k in zip(hop1, sizes)])
                    mask = np.concatenate([m[:k] for (_, m), k in zip(hop1, sizes)]
                                          + [m[k:] for (_, m), k in zip(hop1, sizes)])
                hooks.write(functools.partial(self.write_back, lo, hi, mem_rows, ts_rows, nbr, mask))
            hooks.written()
            wrote = time.perf_counter() - w0
            if pending is not None:
                pending.backward()
            for inner in inners:  # admission by gradient, eviction (FreshGNN 4.1), once every micro-batch is through
                self.cache.admit(inner)
            if train and hooks.sync_gradients(self.model.parameters()) is not False:
                self.optimizer.step()
        tm.add("compute", time.perf_counter() - t3 - wrote)
        tm.add("memory_write", wrote)
        if loss_value is None:  # no events
            loss_value = torch.zeros((), dtype=torch.float64, device=dev)
        out = BatchOutput(lo, hi, loss_value, _cat(pos_l), _cat(neg_l))
        if keep_emb:
            out.h_src, out.h_dst = _cat(src_l), _cat(dst_l)
        return out

    def _seconds(self, dt: np.ndarray) -> np.ndarray:
        """Time differences in the data's unit as float64 seconds."""
        dt = dt.astype(np.float64)
        return dt if self.units_per_second == 1.0 else dt / self.units_per_second

    def _hop_tables(self, h, node_idx: np.ndarray) -> HopTables:
        """Index a sampled hop into unique tables: time gaps (the time term depends on dt only)
        and events (edge-feature terms). Exact: each distinct value is computed once, then gathered."""
        dev = self.device
        # distinct values by hashing (first-appearance order; 10x faster than np.unique's sort);
        # gaps are hashed by their float32 bits
        bits, dt_index, _ = kernels.organize(h.dt.reshape(-1).view(np.int32).astype(np.int64))
        dt_values = bits.astype(np.int32).view(np.float32)
        if self.units_per_second != 1.0:  # the sampler's gaps are in the data's unit
            dt_values = (dt_values / self.units_per_second).astype(np.float32)
        edge_index = edge_feat = None
        if self.edge_feat is not None:
            ev, ev_index, _ = kernels.organize(np.where(h.mask, h.eid, 0).reshape(-1))
            edge_index = upload(ev_index.reshape(h.eid.shape), dev)
            edge_feat = self.edge_feat.index_select(0, upload(ev, dev))
        return HopTables(upload(node_idx, dev), upload(h.mask, dev),
                         upload(dt_index.reshape(h.dt.shape), dev), upload(dt_values, dev),
                         edge_index, edge_feat)

    @torch.no_grad()
    def write_back(self, lo: int, hi: int, mem_rows: torch.Tensor, mem_ts: torch.Tensor, nbr: np.ndarray | None,
                   mask: np.ndarray | None) -> None:
        """memory <- s' and mem_ts <- applied mail time for src/dst; new mail [s'_u || s'_v || e_uv]
        at the event time; COMB = latest per node (DESIGN.md step 7). ``mem_rows [2b, mem_dim]``
        and ``mem_ts [2b]``: the updated memory of the positive roots ``[src (b) | dst (b)]``;
        ``nbr`` / ``mask [2b, fanout]``: their sampled hop-1 neighbours (APAN's mail recipients)."""
        g, dev = self.g, self.device
        b = hi - lo
        # Interleave as [src_0, dst_0, src_1, dst_1, ...] so "latest position" is "latest event".
        own = torch.stack([mem_rows[:b], mem_rows[b:]], 1).reshape(2 * b, -1)
        other = torch.stack([mem_rows[b:], mem_rows[:b]], 1).reshape(2 * b, -1)
        own_ts = torch.stack([mem_ts[:b], mem_ts[b:]], 1).reshape(-1)
        nodes_np = np.stack([g.src[lo:hi], g.dst[lo:hi]], 1).reshape(-1)
        ts = upload(np.repeat(self.t_rel[lo:hi], 2), dev)

        uniq, _, phi = kernels.organize(nodes_np)
        last = upload(phi, dev)
        node_ids = upload(uniq, dev)
        latest = own.index_select(0, last)  # (index_select: 3-4x faster than x[idx] on CPU)
        self.memory.write_memory(node_ids, latest, own_ts.index_select(0, last))
        if not self.model.deliver_to_neighbors:  # only each node's latest mail is kept (COMB = latest)
            self.memory.write_mail(node_ids, self._mails(latest, other.index_select(0, last), lo + last // 2),
                                   ts.index_select(0, last))
            return
        mail = self._mails(own, other, torch.arange(lo, hi, device=dev).repeat_interleave(2))
        # APAN: each positive root's mail also goes to its sampled hop-1 neighbours. The masks are
        # applied on the host, where they are: on a GPU a boolean mask's result size is a read.
        # hop rows follow roots order [src | dst]; map to interleaved positions 2*i (+1 for dst)
        # Recipients and their order stay host arrays: the store finds which each ring keeps there.
        pos_of_row = np.concatenate([np.arange(b) * 2, np.arange(b) * 2 + 1])
        rows = np.broadcast_to(pos_of_row[:, None], nbr.shape)[mask]
        recip = np.concatenate([nodes_np.astype(np.int64), nbr[mask].astype(np.int64)])
        src_pos = np.concatenate([np.arange(2 * b), rows]).astype(np.int64)  # positions are in event order
        self.memory.deliver_mails(recip, src_pos, self.model.mailbox_size, mail, ts, upload(src_pos, dev))

    def _mails(self, own: torch.Tensor, other: torch.Tensor, event: torch.Tensor) -> torch.Tensor:
        """Mails ``[s'_own || s'_other || e_event]`` (memory rows, and event ids; DESIGN.md step 7)."""
        parts = [own, other]
        if self.edge_feat is not None:
            parts.append(self.edge_feat.index_select(0, event))
        return torch.cat(parts, 1)

    # ------------------------------------------------------------------------------------------
    # Epochs

    def batches(self, part: str):
        lo, hi = self.split.range(part)
        for s in range(lo, hi, self.batch_size):
            yield s, min(s + self.batch_size, hi)

    def train_epoch(self, epoch: int) -> dict:
        """One epoch of the plain loop over the training events, negatives from the sampler's
        running stream, memory as it is (benchmarks and tests that time or probe the trainer
        alone; a run, with its schedule, checkpoints and evaluation, is ``runtime.run.Run``)."""
        self.model.train()
        lo, hi = self.split.range("train")
        prog = Progress(hi - lo, f"epoch {epoch} train", self.progress)
        loss_sum, events = 0.0, 0  # loss_sum: a device tensor once a batch is trained (read when shown)
        t0, c0 = time.perf_counter(), jit.compile_seconds()
        for s, e in self.batches("train"):
            out = self.step(s, e, self.negatives.train(e - s, 1), train=True)
            loss_sum = loss_sum + out.loss_t * (e - s)
            events += e - s
            prog.update(e - s, loss=lambda t=loss_sum, n=events: float(t) / n)  # the epoch's mean so far
        el, compiled = time.perf_counter() - t0, jit.compile_seconds() - c0
        loss_sum = float(loss_sum)
        if not math.isfinite(loss_sum):
            log.warning("epoch %d: the training loss is %s: training diverged (lower train.lr?)", epoch, loss_sum)
        return {"loss": loss_sum / max(events, 1), "train_events": events, "train_seconds": el,
                "compile_seconds": compiled, "events_per_s": events / max(el - compiled, 1e-9)}

    @torch.no_grad()
    def evaluate(self, part: str, num_neg: int | None = None) -> dict:
        """AP and ROC-AUC against the first fixed negative, MRR against ``num_neg`` negatives
        (default ``num_neg_eval``; 1: no MRR, at about a sixth of the time of 49 on CollegeMsg).
        Memory is updated by the evaluated events (evaluation continues the stream). The first
        negative of an event is the same for any count and negatives never write memory, so AP,
        ROC-AUC and the memory left do not depend on ``num_neg`` (with ``sampler.strategy=uniform``,
        APAN's mail deliveries go to neighbours drawn from a stream that more roots advance)."""
        self.model.eval()
        num_neg = self.num_neg_eval if num_neg is None else num_neg
        lo, hi = self.split.range(part)
        shipped = self.shipped is not None and self.shipped.has(part)  # train.eval=tgb: TGB's protocol
        if hi <= lo:  # an empty part: its metrics are undefined (null in the summary), not left out
            keys = [f"{part}_mrr"] if shipped else [f"{part}_ap", f"{part}_auc"] + [f"{part}_mrr"] * (num_neg > 1)
            return dict.fromkeys(keys, float("nan"))
        with self.side_stream(SIDE_STREAMS[part]):
            if shipped:  # every event against its own shipped negatives, whatever num_neg says
                return one_vs_many(self, part, self.shipped.part(part), self.scores_dir,
                                   Progress(hi - lo, f"  {part}", self.progress))
            return self._evaluate(part, lo, hi, num_neg)

    def side_stream(self, key: int):
        """``TemporalSampler.side_stream`` (a no-op for models that sample no neighbours)."""
        return self.sampler.side_stream(key) if self.sampler is not None else contextlib.nullcontext()

    def _evaluate(self, part: str, lo: int, hi: int, num_neg: int) -> dict:
        """The metrics of ``[lo, hi)``: the scores stay on the device, where the metrics are computed
        (``metrics.*_t``), and come back in one read at the end (a read per batch waited for the
        device each time)."""
        ranked = num_neg > 1
        num_neg = max(1, num_neg)
        pos_all, neg_all, rr_all = [], [], []
        prog = Progress(hi - lo, f"  {part}", self.progress)
        for s, e in self.batches(part):
            pos, neg = self.eval_scores(s, e, self.negatives.fixed(part, s, e, num_neg))
            pos_all.append(pos)
            neg_all.append(neg[:, 0].clone())  # the one negative of AP and ROC-AUC (the rest freed)
            if ranked:
                rr_all.append(reciprocal_ranks_t(pos, neg))
            prog.update(e - s)
        def labelled(p: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """The labels (the positives first) and the scores of positives ``p`` and negatives ``n``."""
            return torch.arange(2 * len(p), device=p.device) < len(p), torch.cat([p, n])

        pos, neg = torch.cat(pos_all), torch.cat(neg_all)
        y, sc = labelled(pos, neg)
        # the events with a node unseen in training (all of them, maybe): the inductive AP's
        new = upload(np.flatnonzero(self.split.new_node_mask[lo:hi]), self.device)
        none = torch.full((), float("nan"), dtype=torch.float64, device=sc.device)
        values = [average_precision_t(y, sc), roc_auc_t(y, sc),
                  torch.cat(rr_all).mean() if ranked else none,
                  average_precision_t(*labelled(pos.index_select(0, new), neg.index_select(0, new)))
                  if len(new) else none,
                  sc.isnan().sum().double(), sc.min().double(), sc.max().double()]
        ap, auc, mrr, ap_new, nans, low, high = torch.stack(values).tolist()  # the one read
        if nans:
            log.warning("%s: %d of %d scores are NaN (training diverged: lower train.lr? or features beyond float32's "
                        "range); its %s metrics are null", part, int(nans), len(sc), part)
        elif len(sc) > 2 and low == high:
            log.warning("%s: every score is %g, so AP and ROC-AUC are 0.5 whatever the model learnt: it cannot tell "
                        "events apart (edge features of huge magnitude, or a graph with one candidate destination, "
                        "can do this)", part, low)
        res = {f"{part}_ap": ap, f"{part}_auc": auc}
        if ranked:
            res[f"{part}_mrr"] = mrr
        res[f"{part}_ap_inductive"] = ap_new
        return res

    EVAL_ROOTS = 1 << 17  # roots per forward pass in evaluation, above which the negatives are split

    def eval_step(self, lo: int, hi: int, neg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``eval_scores`` read back into NumPy arrays."""
        pos, scores = self.eval_scores(lo, hi, neg)
        return pos.cpu().numpy(), scores.cpu().numpy()

    def eval_scores(self, lo: int, hi: int, neg: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of the positives ``[b]`` and of the negatives ``neg [b, num_neg]`` of one
        evaluation batch, on the device, which then writes memory as any batch does. Many negatives (MRR against
        thousands of nodes) are scored in chunks of columns, each a forward pass of at most
        ``EVAL_ROOTS`` roots, so memory stays bounded: negatives never write memory, so every chunk
        sees the same memory and the write follows the last one. (With ``sampler.strategy=uniform``
        each pass draws the positives' neighbours anew; the default, ``recent``, is exact.)"""
        b, num_neg = hi - lo, neg.shape[1]
        chunk = max(1, self.EVAL_ROOTS // b - 2)
        scores = []
        for c in range(0, num_neg, chunk):
            last = c + chunk >= num_neg
            out = self.compute(self.prepare(lo, hi, neg[:, c:c + chunk]), train=False, write=None if last else False)
            scores.append(out.neg)
        # the batch ends as a training iteration does, with the store's exchange: a store that
        # holds writes until then (DepCache's, Sven's in a group) would otherwise leave the next
        # batch reading memory without them, and apply them later, after a reset
        self.memory.exchange()
        return out.pos, torch.cat(scores, 1) if len(scores) > 1 else scores[0]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.zeros(0)


def _src_then_dst(parts: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Per micro-batch rows ``[src (b_m) | dst (b_m)]`` as the batch's ``[src (b) | dst (b)]``."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat([q[:k] for q, k in zip(parts, sizes)] + [q[k:] for q, k in zip(parts, sizes)])


def adam(params, lr: float) -> torch.optim.Adam:
    """Adam with the fused multi-tensor kernel where torch has one (6x faster per step on CPU
    than the per-parameter loop for TGN's two dozen small tensors); the plain loop otherwise."""
    params = list(params)
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr)


def time_scale(graph: TemporalGraph) -> float:
    """Median gap between consecutive events of the same node (JODIE's time-projection scale)."""
    order = np.argsort(np.concatenate([graph.src, graph.dst]), kind="stable")
    nodes = np.concatenate([graph.src, graph.dst])[order]
    t = np.concatenate([graph.t, graph.t])[order].astype(np.float64)
    gaps = np.diff(t)[nodes[1:] == nodes[:-1]]
    gaps = gaps[gaps > 0]
    return float(np.median(gaps)) if gaps.size else 1.0


def memory_for(model: TemporalModel, num_nodes: int) -> LocalMemory:
    return LocalMemory(num_nodes, model.mem_dim, model.mail_dim, model.mailbox_size)
