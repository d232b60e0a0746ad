"""``measure``: take a profile on the machine at hand (``tgdist plan --profile DATA_OVERRIDES``).

In one process, as ``tgdist train`` would build it for the data the overrides name:

1. for each local batch size, a few dozen iterations of the training loop a run makes (after a
   warm-up), each stage timed by the trainer's ``StageTimer`` (sample, features, memory read,
   compute = forward, backward and optimizer, memory write; the loop's own work between them is
   added to compute, so the stages sum to the iteration), and each batch's rows counted: sampled
   N1, distinct N1 (1 - eta1),
   roots N2, distinct roots N2 (1 - eta2) (Sven 3.2); then, since that window is the stream's
   first batches, whose neighbourhoods are still filling, each stage is scaled by its cost over
   batches spread over the whole training range against the window's (``_over_the_stream``), the
   rows are counted on those batches, and the spread of the step time is kept (``step_cv``);
2. for each trainer count M and partition method, the access graph of one pre-sampled epoch
   (``first_pass_access``) and the placement's remote share and imbalance (``measures``);
3. the cost of a collective between two processes of this machine (gloo, loopback): what a
   parallel run pays besides the modelled link, idle (``collective_costs``) and as two training
   processes pay it (``exchange_runs``, ``paid_costs``: two ranks of the store that times its
   exchanges, ``model.exchange_store``, over the same window, their all-reduce and store timed
   inside), each through the run's own collectives (``tgdist.distributed``); and how much slower
   1, 2, M processes run side by side than
   one alone (``core_sharing``: the cores as they are shared now);
4. how much of the ideal overlap a background stage thread buys on this machine: the loop with
   ``pipeline.prefetch=2`` at S against the loop without it, over what perfect overlap of sampling and
   features would save (``overlap``; threads of one process share its interpreter and cores);
5. DistTGL's S (saturation: the smallest batch within 10% of the best events/s) and L (given, or
   the largest batch whose validation AP after one pass is within ``ap_tolerance`` of the best).

Each stage prints one line on stderr when it ends, and while it runs a line at most every
``PROGRESS_EVERY`` seconds with what it has done (iterations, batches, events, runs) and the time
left at its pace so far (``Progress``; where a step only waits for processes, the time it has taken
and its limit).
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tgdist.launcher.advisor.model import default_pipeline, exchange_store
from tgdist.launcher.advisor.profile import STAGES, BatchProfile, PlacementShare, Profile

__all__ = ["measure", "collective_costs", "saturation", "largest_safe", "Progress", "PROGRESS_EVERY"]

SATURATION_SHARE = 0.9  # S: the smallest batch reaching this share of the best events/s
PROGRESS_EVERY = 5.0  # seconds: at most one progress line this often within a step


def _say(msg: str) -> None:
    print(f"tgdist plan --profile: {msg}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class Progress:
    """The progress of one long step of the profile: ``update(done)`` prints ``HEAD: DONE of TOTAL
    UNIT (T s, about R s left)`` on stderr, at most every ``PROGRESS_EVERY`` seconds, R at the
    step's pace so far; ``waiting(limit)`` prints, as often, how long a step that can only wait for
    other processes has waited and its limit."""

    def __init__(self, head: str, total: float, unit: str):
        self.head, self.total, self.unit = head, max(float(total), 1.0), unit
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.done = 0.0

    def update(self, done: float, note: str = "") -> None:
        self.done = float(done)
        now = time.perf_counter()
        if now - self.last < PROGRESS_EVERY:
            return
        self.last = now
        spent = now - self.t0
        left = (f"about {_duration(spent / self.done * max(self.total - self.done, 0.0))} left" if self.done > 0
                else "starting")
        _say(f"{self.head}: {self.done:,.0f} of {self.total:,.0f} {self.unit}{note} ({_duration(spent)}, {left})")

    def add(self, n: float = 1.0, note: str = "") -> None:
        self.update(self.done + n, note)

    def waiting(self, limit: float, what: str) -> "_Waiting":
        """A context in which a background thread prints ``HEAD: WHAT, T s of at most LIMIT``."""
        return _Waiting(self, limit, what)


class _Waiting:
    def __init__(self, progress: Progress, limit: float, what: str):
        self.progress, self.limit, self.what = progress, limit, what
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="tgdist-profile-progress", daemon=True)

    def _tick(self) -> None:
        while not self.stop.wait(min(PROGRESS_EVERY, 1.0) if PROGRESS_EVERY > 0 else 0.05):
            now = time.perf_counter()
            if now - self.progress.last >= PROGRESS_EVERY:
                self.progress.last = now
                _say(f"{self.progress.head}: {self.what}, {_duration(now - self.progress.t0)} "
                     f"(at most {_duration(self.limit)})")

    def __enter__(self) -> "_Waiting":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _silent(head: str = "") -> Progress:
    return Progress(head, 1, "")


def saturation(batch_sizes, events_per_s) -> int:
    """DistTGL's S from measurements: the smallest batch whose events/s is within 10% of the best."""
    best = max(events_per_s)
    return int(min(b for b, e in zip(batch_sizes, events_per_s) if e >= SATURATION_SHARE * best))


def largest_safe(batch_sizes, val_ap, tolerance: float) -> int:
    """DistTGL's L from a sweep: the largest batch whose validation AP is within ``tolerance`` of the best."""
    best = max(val_ap)
    return int(max(b for b, a in zip(batch_sizes, val_ap) if a >= best - tolerance))


def _nbytes(obj, seen=None) -> int:
    """Bytes of the NumPy arrays an object holds (one level of attributes)."""
    total = 0
    for v in vars(obj).values():
        if isinstance(v, np.ndarray):
            total += v.nbytes
    return total


def _rows(tr, p, lo: int, hi: int) -> tuple[float, float, float, float]:
    """The batch's sampled vertices (roots and filled slots, Sven's N1) and distinct nodes, and
    its positive roots and their distinct nodes: what the partitioned stores move."""
    g = tr.g
    if tr.device_sampler is None:
        sampled = p.root_idx.numel() + sum(int(h.mask.sum()) for h in p.hops)
        distinct = p.ids.numel()
    else:  # its node table is not the distinct nodes (trainer._sample_on_device): the host's sampler counts them
        roots = np.concatenate([g.src[lo:hi], g.dst[lo:hi], p.neg.T.reshape(-1)])
        hops = tr.sampler.sample(roots, np.tile(g.t[lo:hi], 2 + p.num_neg))
        sampled = roots.size + sum(int(h.mask.sum()) for h in hops)
        distinct = np.unique(np.concatenate([roots] + [h.nbr[h.mask] for h in hops])).size
    roots = 2 * (hi - lo)
    roots_distinct = np.unique(np.concatenate([g.src[lo:hi], g.dst[lo:hi]])).size
    return sampled, distinct, roots, roots_distinct


def _time_batch(cfg_over: list[str], graph, b: int, warmup: int, iterations: int, over_stream: bool = True,
                progress: Progress | None = None, spread: int = 60):
    """``warmup + iterations`` iterations of the loop a run makes (``Run``, one process, stopped by
    ``train.stop_after_batches``), the last ``iterations`` timed: wall seconds per iteration from the
    loop's own ticks, each stage's from the trainer's ``StageTimer``, the rows of each batch read;
    with ``over_stream``, scaled to the whole training range (``_over_the_stream``). Returns the
    batch's profile, the (scaled) wall, the gradient bytes, the trainer, its config, and the wall
    of the timed window itself (what two loops over the same window compare by), and the window
    (``warmup``, ``iterations``) with the middle-80% mean of its iterations' walls (``wall``,
    ``_middle_mean``: the iteration ``paid_costs`` sizes the model's own waits by). ``progress``
    (its ``total`` set here) counts the iterations of the loop and of the stream's batches;
    ``spread``: the least number of batches over the training range (``_over_the_stream``)."""
    import shutil

    from tgdist.runtime.build import build_trainer, compose
    from tgdist.runtime.run import Run

    cfg = compose([*cfg_over, f"train.batch_size={b}"])
    tr = build_trainer(cfg, graph=graph, progress=False)
    lo, hi = tr.split.range("train")
    steps = -(-(hi - lo) // b)
    if steps < warmup + iterations:
        warmup = min(warmup, max(steps // 4, 1))
        iterations = max(steps - warmup, 1)
    cfg = compose([*cfg_over, f"train.batch_size={b}", f"train.stop_after_batches={warmup + iterations}",
                   "train.epochs=1"])
    progress = progress or _silent()
    later = max(steps - warmup - iterations, 0)
    progress.total = float(warmup + iterations
                           + (warmup + iterations + min(later, max(2 * iterations, spread)) if over_stream and later
                              else 0))
    run_dir = tempfile.mkdtemp(prefix="tgdist-advisor-")
    counts, marks = [], {}
    prepare = tr.prepare

    def counting_prepare(lo_, hi_, neg, read=None, **kw):
        p = prepare(lo_, hi_, neg, read, **kw)
        if marks:  # past the warm-up
            counts.append(_rows(tr, p, lo_, hi_))
        return p

    ticks = []

    def tick(t, loss):
        done = t + 1
        progress.update(done)
        if warmup <= done <= warmup + iterations:
            ticks.append(time.perf_counter())
        if done == warmup:
            marks["t0"], marks["s0"] = time.perf_counter(), dict(tr.timer.seconds)
        elif done == warmup + iterations:
            marks["t1"], marks["s1"] = time.perf_counter(), dict(tr.timer.seconds)

    tr.prepare = counting_prepare
    try:
        driver = Run(cfg, run_dir, trainer=tr)
        driver.train(on_iteration=tick)
    finally:
        tr.prepare = prepare
        shutil.rmtree(run_dir, ignore_errors=True)
    if "t1" not in marks:
        raise RuntimeError(f"batch {b}: the run stopped before its {warmup + iterations} iterations")
    wall = (marks["t1"] - marks["t0"]) / iterations
    secs = {s: (marks["s1"].get(s, 0.0) - marks["s0"].get(s, 0.0)) / iterations for s in STAGES}
    window_wall = wall
    # the window as exchange_runs repeats it with two processes, and a typical iteration of it
    window_middle = {"warmup": warmup, "iterations": iterations, "wall": _middle_mean(np.diff(ticks))}
    loop = max(wall - sum(secs.values()), 0.0)
    rows = np.mean(np.array(counts[:iterations], dtype=np.float64), axis=0)
    factor, cv = dict.fromkeys(STAGES, 1.0), 0.0
    stream = _over_the_stream(tr, warmup, iterations, progress, spread) if over_stream else None
    if stream is not None:  # the stages and rows over the training range
        before = sum(secs.values()) + loop
        factor, cv, rows = stream
        # the Run loop's stages scaled by the trainer's own ratio (spread over window): the loop's
        # stages cost more than the trainer's bare steps (its schedule, hooks, negatives), which
        # the spread batches, stepped bare, would leave out (on Wikipedia the epoch predicted from
        # the bare spread steps was 15-28% short at M = 2, from the scaled window 5-19%)
        secs = {s: v * factor[s] for s, v in secs.items()}
        wall *= (sum(secs.values()) + loop) / before if before > 0 else 1.0  # (stages in threads overlap)
    # the loop's own work between the stages (schedule, negatives, hooks, the loss read back) joins compute
    secs["compute"] += loop
    grad_bytes = sum(4 * q.numel() for q in tr.model.parameters() if q.requires_grad)
    bp = BatchProfile(batch_size=b, seconds={k: round(v, 7) for k, v in secs.items()}, rows_sampled=float(rows[0]),
                      rows_distinct=float(rows[1]), roots=float(rows[2]), roots_distinct=float(rows[3]),
                      iterations=iterations, stream_factor={k: round(v, 4) for k, v in factor.items()},
                      step_cv=round(cv, 4))
    return bp, wall, grad_bytes, tr, cfg, window_wall, window_middle


def _over_the_stream(tr, warmup: int, iterations: int, progress: Progress | None = None, spread: int = 60):
    """How an iteration over the whole training range differs from one of the stream's first
    ``warmup + iterations`` batches, which the Run loop times and whose neighbourhoods are still
    filling: later batches sample more neighbours and read more memory rows (all of Wikipedia at
    batch 300: the epoch's iteration is 1.24x the first 40's). With the same trainer, memory reset,
    the window is stepped again and then ``2 x iterations`` (at least 60) batches spread evenly over
    the rest of the training range (``spread`` at the least). Returns each stage's spread seconds over its window seconds
    (``stream_factor``), the spread batches' step times' standard deviation over their mean (how
    much one rank's iteration varies: what synchronised ranks wait for, ``model._straggler``) and
    their rows as ``_rows`` counts them; None where no batch follows the window."""
    import torch

    batches = list(tr.batches("train"))
    window, later = batches[:warmup + iterations], batches[warmup + iterations:]
    if not later:
        return None
    spread_n = min(len(later), max(2 * iterations, spread))  # (30 spread batches left a 5% error in the factor)
    progress = progress or _silent()
    picked = [later[i] for i in np.unique(np.linspace(0, len(later) - 1, spread_n).astype(int))]
    cuda = tr.device.type == "cuda"
    prepare, counts = tr.prepare, []

    def counting_prepare(lo_, hi_, neg, read=None, **kw):
        p = prepare(lo_, hi_, neg, read, **kw)
        counts.append(_rows(tr, p, lo_, hi_))
        return p

    def steps(span: list, timed_from: int) -> tuple[dict, np.ndarray]:
        walls, s0 = [], None
        for n, (lo, hi) in enumerate(span):
            if n == timed_from:
                s0 = dict(tr.timer.seconds)
            t0 = time.perf_counter()
            tr.step(lo, hi, tr.negatives.train(hi - lo, 1), train=True)
            if cuda:
                torch.cuda.synchronize(tr.device)
            if n >= timed_from:
                walls.append(time.perf_counter() - t0)
            progress.add()
        per = {s: (tr.timer.seconds.get(s, 0.0) - s0.get(s, 0.0)) / max(len(walls), 1) for s in STAGES}
        return per, np.array(walls)

    tr.memory.reset_state()
    tr.model.train()
    first, _ = steps(window, warmup)
    tr.prepare = counting_prepare
    try:
        spread, walls = steps(picked, 0)
    finally:
        tr.prepare = prepare
    factor = {s: (spread[s] / first[s] if first[s] > 0 else 1.0) for s in STAGES}
    cv = float(walls.std() / walls.mean()) if walls.size > 1 and walls.mean() > 0 else 0.0
    return factor, cv, np.mean(np.array(counts, dtype=np.float64), axis=0)


def _val_ap(cfg_over: list[str], graph, b: int, events: int | None, progress: Progress | None = None) -> float:
    """Validation AP after one pass over the first ``events`` training events (all: None) at batch b."""
    from tgdist.runtime.build import build_trainer, compose

    cfg = compose([*cfg_over, f"train.batch_size={b}"])
    tr = build_trainer(cfg, graph=graph, progress=False)
    tr.model.train()
    lo, hi = tr.split.range("train")
    end = hi if events is None else min(hi, lo + events)
    for s in range(lo, end, b):
        e = min(s + b, end)
        tr.step(s, e, tr.negatives.train(e - s, 1), train=True)
        if progress is not None:
            progress.add(e - s, f" (batch {b})")
    return float(tr.evaluate("val", num_neg=1)["val_ap"])


def _collective_worker(out: str, sizes: list[int], repeats: int) -> None:
    """One of ``collective_costs``' two ranks (started with torchrun's environment): all-reduces of
    each size through the run's own collectives (``tgdist.distributed``), timed."""
    import torch

    from tgdist.distributed import collectives
    from tgdist.distributed.schedule import Layout
    from tgdist.distributed.world import ProcessGroups, detect

    torch.set_num_threads(1)
    world = detect()
    groups = ProcessGroups.init(world, Layout(2, 1, 1), backend="gloo")
    try:
        group, counter = groups.get("world"), collectives.ByteCounter()
        res = {}
        for n in sizes:
            x = torch.zeros(max(n // 4, 1))
            for _ in range(3):
                collectives.all_reduce_sum(x, group, counter=counter)
            collectives.barrier(group, counter=counter)
            t0 = time.perf_counter()
            for _ in range(repeats):
                collectives.all_reduce_sum(x, group, counter=counter)
            res[n] = (time.perf_counter() - t0) / repeats
        if world.rank == 0:
            Path(out).write_text(repr(res))
    finally:
        groups.destroy()


def collective_costs(repeats: int = 30, timeout: float = 300.0, progress: Progress | None = None) -> dict:
    """Seconds of a gloo all-reduce between two processes of this machine: ``fixed_s`` (4 bytes)
    and ``bytes_per_s`` (from 4 MiB): what each collective of a parallel run costs here besides the
    modelled link's sleep. The two processes are this module run as a script (``--collective-worker``)."""
    import ast
    import socket
    import subprocess

    sizes = [4, 4 << 20]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="tgdist-advisor-") as d:
        out = os.path.join(d, "out")
        cmd = [sys.executable, "-m", "tgdist.launcher.advisor.measure", "--collective-worker", out,
               ",".join(map(str, sizes)), str(repeats)]
        procs = [subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r),
                                            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                            "MASTER_PORT": str(port)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        failed = ""
        with (progress or _silent()).waiting(timeout, "two processes timing all-reduces"):
            for p in procs:
                try:
                    _, err = p.communicate(timeout=timeout)
                    if p.returncode:
                        failed = (err.strip().splitlines() or [f"exit {p.returncode}"])[-1]
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()
                    failed = f"no result within {timeout:.0f} s"
        if failed or not os.path.exists(out):
            return {"fixed_s": 0.0, "bytes_per_s": None, "note": f"the two-process measurement failed: {failed}"}
        res = ast.literal_eval(Path(out).read_text())
    fixed = float(res[sizes[0]])
    big = float(res[sizes[1]])
    # a ring all-reduce of n bytes over two ranks moves n per rank (link.KINDS)
    bps = sizes[1] / max(big - fixed, 1e-9)
    return {"fixed_s": round(fixed, 7), "bytes_per_s": round(bps, 1), "sizes": sizes, "repeats": repeats}


def _exchange_worker(out: str, plan: str) -> None:
    """One rank of ``exchange_runs`` (started with torchrun's environment): for each (batch size,
    warm-up, timed iterations) of the plan, a ``Run`` of ``model.exchange_store()`` at 2 x 1 x 1 stopped after
    ``warmup + iterations`` batches, after a short warm-up run (imports, numba compiles). Written to
    ``OUT.RANK``, per batch and timed iteration: the wall (the Run loop's ticks), the seconds in the
    gradients' all-reduce (``average_gradients``), in the store (memory read and write stages, which
    hold the dispatch and the aggregation's issue, and the loop's ``exchange``, which waits for the
    aggregation and applies it); over the window, the store's collectives and bytes (its counter)."""
    import json
    import shutil

    import torch

    from tgdist.distributed import collectives
    from tgdist.distributed.schedule import Layout
    from tgdist.distributed.world import ProcessGroups, detect
    from tgdist.runtime.build import build_trainer, compose
    from tgdist.runtime.run import Run

    spec = json.loads(Path(plan).read_text())
    total = 3 + sum(w + n for _, w, n in spec["batches"])  # the warm-up run's 3, then each window
    done, shown = [0], [0.0]

    def report() -> None:  # rank 0's iterations so far, for the parent's progress lines (about once a second)
        done[0] += 1
        if world.rank == 0 and time.monotonic() - shown[0] > 1.0:
            shown[0] = time.monotonic()
            Path(f"{out}.progress").write_text(f"{done[0]} {total}")

    torch.set_num_threads(1)
    world = detect()
    groups = ProcessGroups.init(world, Layout(2, 1, 1))
    spent = {"gradients": 0.0, "exchange": 0.0}

    def timing(fn, key: str):  # fn, its seconds added to spent[key]
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return run

    average = collectives.average_gradients
    collectives.average_gradients = timing(average, "gradients")  # (the pipelines call it through the module)
    got = {}
    try:
        first = spec["batches"][0]
        windows = [(True, first[0], 1, 3)] + [(False, b, w, w + n) for b, w, n in spec["batches"]]
        for warm_up, b, warmup, stop in windows:
            cfg = compose([*spec["overrides"], f"train.batch_size={b}", f"train.stop_after_batches={stop}",
                           "train.epochs=1"])
            run_dir = tempfile.mkdtemp(prefix="tgdist-advisor-") if world.rank == 0 else None
            marks: list[tuple] = []
            try:
                driver = Run(cfg, run_dir, groups=groups, trainer=build_trainer(cfg, progress=False))
                tr, store = driver.trainer, driver.trainer.memory
                store.exchange = timing(store.exchange, "exchange")

                def tick(t, loss, driver=driver, tr=tr, marks=marks):
                    report()
                    store_counts = {n: v for n, v in driver.counter.as_dict().items() if n != "gradients"}
                    counts = {n: v["calls"] for n, v in store_counts.items()}
                    sent = sum(v["bytes_sent"] for v in store_counts.values())
                    marks.append((time.perf_counter(), spent["gradients"],
                                  spent["exchange"] + tr.timer.seconds.get("memory_read", 0.0)
                                  + tr.timer.seconds.get("memory_write", 0.0), counts, sent))

                driver.train(on_iteration=tick)
            finally:
                if run_dir is not None:
                    shutil.rmtree(run_dir, ignore_errors=True)
            if warm_up:
                continue
            if len(marks) < stop:
                raise RuntimeError(f"batch {b}: the run stopped after {len(marks)} of {stop} iterations")
            timed = marks[warmup - 1:stop]
            walls, grads, stores = (np.diff([m[k] for m in timed]).tolist() for k in range(3))
            by_name = {n: c - timed[0][3].get(n, 0) for n, c in timed[-1][3].items()}
            got[str(b)] = {"walls": walls, "gradients": grads, "store": stores, "calls": _gloo_calls(by_name),
                           "bytes": timed[-1][4] - timed[0][4], "calls_by_name": by_name}
        Path(f"{out}.{world.rank}").write_text(json.dumps(got))
        collectives.barrier(groups.get("world"), name="shutdown")
    finally:
        collectives.average_gradients = average
        groups.destroy()


def _gloo_calls(by_name: dict) -> int:
    """Collectives the backend ran, from a ``ByteCounter``'s calls by name: a packed exchange
    (``all_to_all_rows``, ``all_gather_parts``) counts ``NAME.sizes`` once and its ``NAME.index``
    and ``NAME.payload`` besides, but is two collectives (the counts, then the rows)."""
    calls = 0
    for name, n in by_name.items():
        if name.endswith(".sizes"):
            calls += 2 * n
        elif not name.endswith((".index", ".payload")):
            calls += n
    return calls


def _middle_mean(x: np.ndarray, share: float = 0.8) -> float:
    """The mean of the middle ``share`` of ``x`` (the extremes cut evenly): an iteration's typical
    wall with the rare long pause (a page fault, another process's burst) left out."""
    x = np.sort(np.asarray(x, dtype=np.float64))
    cut = int(round(x.size * (1 - share) / 2))
    return float(x[cut:x.size - cut].mean()) if x.size > 2 * cut else float(x.mean())


def _two_ranks(plan: dict, timeout: float, progress: Progress | None = None) -> list[dict]:
    """``_exchange_worker`` as two ranks of this machine (torchrun's environment, a free port);
    their records, by rank. A rank that fails ends the other at once (it would wait for its peer
    until gloo's timeout), as does ``timeout``; either raises ``RuntimeError`` with the failed
    rank's last error line. No rank outlives the call. ``progress``: rank 0's iterations (the
    warm-up run's and the windows'), as it reports them."""
    import json
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="tgdist-advisor-") as d:
        Path(d, "plan.json").write_text(json.dumps(plan))
        procs, logs = [], []
        try:
            for r in range(2):
                env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r),
                       "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                logs.append(open(f"{d}/err.{r}", "w"))
                procs.append(subprocess.Popen([sys.executable, "-m", "tgdist.launcher.advisor.measure",
                                               "--exchange-worker", f"{d}/rank", f"{d}/plan.json"], env=env,
                                              stdout=subprocess.DEVNULL, stderr=logs[-1]))
            deadline, failed = time.monotonic() + timeout, ""
            while any(p.poll() is None for p in procs):
                bad = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if bad is not None:
                    lines = [ln for ln in Path(f"{d}/err.{bad}").read_text().splitlines() if ln.strip()]
                    failed = (lines or [f"rank {bad}: exit {procs[bad].returncode}"])[-1]
                    break
                if time.monotonic() > deadline:
                    failed = f"no result within {timeout:.0f} s"
                    break
                if progress is not None:
                    try:
                        done, total = (int(x) for x in Path(f"{d}/rank.progress").read_text().split())
                        progress.total = float(total)
                        progress.update(done, " of rank 0")
                    except (OSError, ValueError):  # not written yet, or being written
                        progress.update(0)
                time.sleep(0.05)
            for r, p in enumerate(procs):
                if not failed and p.returncode:
                    lines = [ln for ln in Path(f"{d}/err.{r}").read_text().splitlines() if ln.strip()]
                    failed = (lines or [f"rank {r}: exit {p.returncode}"])[-1]
        finally:
            for p in procs:  # (a rank that waits for a dead peer would wait for gloo's timeout)
                if p.poll() is None:
                    p.kill()
                p.wait()
            for f in logs:
                f.close()
        if failed:
            raise RuntimeError(failed)
        return [json.loads(Path(f"{d}/rank.{r}").read_text()) for r in range(2)]


def _two_processes_refused(tr) -> str | None:
    """Why ``exchange_runs`` cannot run two trainers here (None: it can): a CUDA device per rank."""
    if tr.device.type == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            return "one GPU: no second trainer to exchange with"
    return None


def exchange_runs(overrides: list[str], windows: list[tuple[int, int, int]], *, timeout: float = 900.0,
                  progress: Progress | None = None) -> dict:
    """Two trainer processes of this machine train the stream's first ``warmup + iterations``
    global batches of 2 x b events per (b, warmup, iterations) of ``windows`` (the one-process
    loop's) with ``model.exchange_store()`` at 2 x 1 x 1 (a partitioned store): both ranks meet at the store's dispatch and aggregation and at
    the gradients' all-reduce every iteration. Timed directly in each rank, so that no other run's
    stream position enters (memory parallelism, 1 x 1 x 2, would walk the stream from two places:
    on Wikipedia its ranks' first batches differ by a third in cost): per batch size, the seconds an
    iteration spends in the all-reduce (``gradients_s``) and in the store (``store_s``: read,
    write, exchange), the middle 80% of each rank's timed iterations averaged, then the ranks'
    means averaged; the iteration's wall (``wall_s``); the collectives (``calls``, the backend's:
    two per packed exchange) and bytes a rank's store sent per iteration."""
    base = [o for o in overrides if not o.startswith(("parallel.", "memory.backend=", "pipeline="))]
    plan = {"overrides": [*base, "parallel.i=2", "parallel.j=1", "parallel.k=1", f"memory.backend={exchange_store()}",
                          f"pipeline={default_pipeline()}", "parallel.link=none"], "batches": sorted(windows)}
    t0 = time.perf_counter()  # (after naming the store and the preset: the ranks' time starts here)
    if progress is not None:  # the warm-up run's 3 iterations, then each window's (as the ranks count them)
        progress.total = float(3 + sum(w + n for _, w, n in windows))
    ranks = _two_ranks(plan, max(timeout - (time.perf_counter() - t0), 60.0), progress)
    sizes = [b for b, _, _ in sorted(windows)]

    def mean(key: str, b: int) -> float:
        return float(np.mean([_middle_mean(r[str(b)][key]) for r in ranks]))

    def per_iteration(key: str, b: int, n: int) -> float:
        return float(np.mean([r[str(b)][key] for r in ranks])) / n

    n_of = {b: n for b, _, n in windows}
    return {"batches": sizes, "wall_s": [round(mean("walls", b), 7) for b in sizes],
            "gradients_s": [round(mean("gradients", b), 7) for b in sizes],
            "store_s": [round(mean("store", b), 7) for b in sizes],
            "calls": [round(per_iteration("calls", b, n_of[b]), 3) for b in sizes],
            "bytes": [round(per_iteration("bytes", b, n_of[b])) for b in sizes],
            "calls_by_name": {b: {k: round(v / n_of[b], 3) for k, v in ranks[0][str(b)]["calls_by_name"].items()}
                              for b in sizes},
            "windows": [list(w) for w in sorted(windows)]}


def paid_costs(runs: dict, alone_s: list[float], alone_store_s: list[float], step_cv: list[float], grad_bytes: int,
               bytes_per_s: float) -> dict:
    """The cost of a collective as a run pays it here, from ``exchange_runs`` and the one-process
    loop over the same window (``alone_s``: its iteration; ``alone_store_s``: its memory read and
    write; ``step_cv``: its step-time spread), per batch size:

    - the gradients' all-reduce: its seconds in the two ranks, less the wait for the slower rank
      at that meeting that the model adds by itself (``model._straggler``: cv E[max of 2] of the
      iteration over three meetings, a third of the variance each) and its bytes at the idle rate
      ``bytes_per_s``: ``gradient_s``;
    - a store collective: the store's seconds in the two ranks less the one process's memory read
      and write (which the model counts as stages), the waits at its two meetings and its bytes at
      the idle rate, over its collectives: ``exchange_s``;

    each the median over the batch sizes, at least 0. What remains is what idle collectives
    (``collective_costs``) miss: the peer busy, the threads woken, the store's routing of ids to
    owners and the packing of rows."""
    from tgdist.launcher.advisor.model import expected_max_normal

    meeting = expected_max_normal(2) / 3 ** 0.5  # one of three meetings' share of the wait, per iteration
    grad, exch = [], []
    for k, b in enumerate(runs["batches"]):
        wait = float(step_cv[k]) * meeting * float(alone_s[k])
        grad.append(float(runs["gradients_s"][k]) - wait - grad_bytes / bytes_per_s)
        calls = max(float(runs["calls"][k]), 1e-12)
        exch.append((float(runs["store_s"][k]) - float(alone_store_s[k]) - 2 * wait
                     - float(runs["bytes"][k]) / bytes_per_s) / calls)
    return {"gradient_s": round(max(float(np.median(grad)), 0.0), 7),
            "exchange_s": round(max(float(np.median(exch)), 0.0), 7),
            "paid": {**runs, "alone_s": [round(float(v), 7) for v in alone_s],
                     "alone_store_s": [round(float(v), 7) for v in alone_store_s],
                     "gradient_s": [round(v, 7) for v in grad], "exchange_s": [round(v, 7) for v in exch]}}


def _spin_worker(ready: str, go: str, out: str, seconds_of_work: int) -> None:
    """One of ``core_sharing``'s processes: a fixed amount of single-threaded torch work (small matrix
    products and elementwise operations, as a training step's), timed once every process is ready."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(160, 160), torch.randn(160, 160)
    for _ in range(20):  # warm
        a = torch.tanh(a @ b) * 0.5
    Path(ready).write_text("1")
    while not os.path.exists(go):
        time.sleep(0.005)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(seconds_of_work):
        a = torch.tanh(a @ b) * 0.5 + 0.1
    Path(out).write_text(repr((time.perf_counter() - t0) / max(time.process_time() - c0, 1e-9)))


def _side_by_side(r: int, work: int, timeout: float) -> float | None:
    """``r`` processes doing ``work`` at once (``_spin_worker``): the mean of each one's wall seconds
    over its CPU seconds (1 when each had a core to itself the whole time), or None if one failed."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="tgdist-advisor-") as d:
        procs = []
        for k in range(r):
            cmd = [sys.executable, "-m", "tgdist.launcher.advisor.measure", "--spin-worker", f"{d}/ready{k}",
                   f"{d}/go", f"{d}/out{k}", str(work)]
            procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(f"{d}/ready{k}") for k in range(r)):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                    p.wait()
                return None
            time.sleep(0.01)
        Path(f"{d}/go").write_text("1")
        for p in procs:
            p.wait(timeout=timeout)
        return float(np.mean([float(Path(f"{d}/out{k}").read_text()) for k in range(r)]))


def core_sharing(ranks=(1, 2, 4), work: int = 2000, rounds: int = 3, timeout: float = 300.0,
                 progress: Progress | None = None) -> dict:
    """How much slower R single-threaded processes run side by side than one alone, on this machine
    as it is now (its cores and whatever else runs on them): ``{R: slowdown}``, 1.0 for R = 1. The
    model scales the CPU stages of M ranks sharing the machine by it (``model``: shared cores).

    Each process measures its wall time over its CPU time (how long it waited for a core); the
    counts 1, 2, ..., R are run in turn ``rounds`` times, so that the load of other work, which
    comes and goes, falls on each alike, and the median of each count's rounds is taken. R
    processes are never counted less than R / CPUs times slower, whatever the noise."""
    cpus = os.cpu_count() or 1
    counts = sorted({1, *ranks})
    seen: dict[int, list[float]] = {r: [] for r in counts}
    progress = progress or _silent()
    progress.total = float(rounds * len(counts))
    for _ in range(rounds):
        for r in counts:
            got = _side_by_side(r, work, timeout)
            progress.add(1, f" ({r} process{'es' * (r > 1)} done)")
            if got is None:
                return {"note": f"a side-by-side measurement of {r} processes failed"}
            seen[r].append(got)
    base = float(np.median(seen[1]))
    out = {"1": 1.0}
    for r in counts[1:]:
        out[str(r)] = round(max(float(np.median(seen[r])) / base, r / cpus, 1.0), 4)
    return out


def _base(overrides: list[str], threads: int) -> list[str]:
    """The overrides of the one process the profile trains: the user's, then one trainer, no pipeline."""
    return [*overrides, f"train.num_threads={threads}", f"sampler.num_threads={threads}", "train.progress=false",
            "train.num_neg_eval=1", "parallel.i=1", "parallel.j=1", "parallel.k=1", "memory.backend=auto",
            f"pipeline={default_pipeline()}"]


def check_overrides(overrides: list[str], threads: int = 1) -> None:
    """The config the profile would train with composes and passes the runtime's checks (a bad
    override: its one line), before any measuring."""
    from tgdist.runtime.build import compose, validate

    validate(compose(_base(overrides, threads)))


def measure(overrides: list[str], *, batch_sizes: list[int], iterations: int = 30, warmup: int = 10,
            parts: list[int] = (2, 4), methods: list[str] = ("range", "interval", "reflexbicut"),
            threads: int = 1, largest_batch: int | None = None, accuracy_batches: list[int] | None = None,
            accuracy_events: int | None = None, ap_tolerance: float = 0.01, collectives: bool = True,
            overlap_check: bool = True, accuracy: bool = True, spread: int = 60, collective_repeats: int = 30,
            sharing_rounds: int = 3, sharing_work: int = 2000, exchange_batches: int | None = None,
            paid: bool = True) -> Profile:
    """A profile of the data ``overrides`` name on this machine (the module docstring).

    The shorter profile (``tgdist plan --profile --quick``) is this with smaller settings: ``spread``
    batches at the least over the training range, ``collective_repeats`` all-reduces, ``sharing_rounds``
    of ``sharing_work`` for the processes side by side, the two-process runs at the ``exchange_batches``
    batch sizes nearest S only (None: all), or without ``paid`` none (the idle two-process cost then
    prices each collective), and without ``accuracy`` no sweep for L (``largest_batch`` or none:
    ``accuracy_source`` is then ``none``)."""
    from tgdist.memory.placement import first_pass_access
    from tgdist.models import model_class
    from tgdist.partition.measures import measure as measure_placement
    from tgdist.partition.methods import assign

    base = _base(overrides, threads)
    sweep_accuracy = largest_batch is None and accuracy
    steps = (len(set(batch_sizes)) + ((3 if paid else 2) if collectives else 0) + (1 if parts else 0) + (1 if sweep_accuracy else 0)
             + (1 if overlap_check else 0))
    n = 0
    batches, per_iter, window, middle = [], [], {}, {}
    graph = tr = cfg = None
    grad_bytes = 0
    for b in sorted(set(batch_sizes)):
        n += 1
        t0 = time.perf_counter()
        bp, wall, grad_bytes, tr, cfg, window[b], middle[b] = _time_batch(
            base, graph, b, warmup, iterations, progress=Progress(f"[{n}/{steps}] batch {b}", 1, "iterations"),
            spread=spread)
        graph = tr.g
        batches.append(bp)
        per_iter.append(wall)
        _say(f"[{n}/{steps}] batch {b}: {bp.iterations} iterations, {1e3 * wall:.1f} ms each over the epoch "
             f"(x{bp.stream_factor.get('compute', 1.0):.2f} the first batches' compute, step spread "
             f"{100 * bp.step_cv:.0f}%; {b / wall:,.0f} events/s), eta1 {bp.eta1:.2f}, eta2 {bp.eta2:.2f} "
             f"({time.perf_counter() - t0:.1f} s)")
    sizes = [bp.batch_size for bp in batches]
    S = saturation(sizes, [b / w for b, w in zip(sizes, per_iter)])
    overlap = {}
    if overlap_check:  # how much of the ideal overlap a background stage thread buys here (prefetch at S)
        n += 1
        t0 = time.perf_counter()
        at = next(bp for bp in batches if bp.batch_size == S)
        # the prefetching loop against the plain one over the same window, unscaled: a like-for-like
        # ratio (scaling each by its own measure of the stream would add that measure's noise)
        *_, pre_wall, _ = _time_batch([*base, "pipeline.prefetch=2"], graph, S,
                                      warmup, iterations, over_stream=False,
                                      progress=Progress(f"[{n}/{steps}] overlap: prefetch at batch {S}", 1,
                                                        "iterations"))
        in_turn = window[S]
        scale = in_turn / per_iter[sizes.index(S)]  # the stages below are over the epoch: back to the window
        front = (at.seconds["sample"] + at.seconds["features"]) * scale
        rest = max(in_turn - front, 0.0)
        ideal = min(front, rest)
        share = (in_turn - pre_wall) / ideal if ideal > 0 else 1.0
        overlap = {"prefetch": round(min(max(share, 0.0), 1.0), 4), "batch": S, "plain_s": round(in_turn, 6),
                   "prefetch_s": round(pre_wall, 6)}
        _say(f"[{n}/{steps}] overlap: prefetch at batch {S}: {1e3 * pre_wall:.1f} ms against {1e3 * in_turn:.1f} ms, "
             f"{overlap['prefetch']:.0%} of the ideal saving ({time.perf_counter() - t0:.1f} s)")
    lo, train_end = tr.split.range("train")
    placements = []
    if parts:
        n += 1
        t0 = time.perf_counter()
        fanouts = list(cfg.sampler.fanouts) if model_class(cfg.model.name).samples_neighbours() else []
        place_progress = Progress(f"[{n}/{steps}] placements", len(parts) * len(methods), "trainer counts x methods")
        for q, m in enumerate(parts):
            strategy = getattr(cfg.sampler.strategy, "value", str(cfg.sampler.strategy))

            def presampled(line: str, q=q, m=m) -> None:  # first_pass_access's "pre-sampling: x/y batches"
                got = re.search(r"([\d,]+)/([\d,]+) batches", line)
                share = int(got[1].replace(",", "")) / max(int(got[2].replace(",", "")), 1) if got else 0.0
                place_progress.update(len(methods) * (q + 0.5 * share), f" (M = {m}: {line})")

            access = first_pass_access(graph, train_end, m, S, fanouts, strategy=strategy,
                                       seed=cfg.train.seed, progress=presampled)
            for u, method in enumerate(methods):
                owner = assign(access, method)
                ms = measure_placement(access.dedup, owner, m)
                total = int(ms.local.sum()) + ms.total_volume
                remote = ms.total_volume / total if total else 0.0
                mean = ms.recv.mean() if ms.recv.size else 0.0
                imbalance = float(max(ms.recv.max(), ms.send.max()) / mean) if mean > 0 else 1.0
                placements.append(PlacementShare(method, int(m), round(float(remote), 5), round(imbalance, 4)))
                place_progress.update(len(methods) * q + u + 1, f" (M = {m}: {method} placed)")
        _say(f"[{n}/{steps}] placements at M = {', '.join(map(str, parts))}: "
             + "; ".join(f"{p.method} M={p.parts} remote {p.remote_share:.2f} x{p.imbalance:.2f}" for p in placements)
             + f" ({time.perf_counter() - t0:.1f} s)")
    coll = {"fixed_s": 0.0, "bytes_per_s": None}
    if collectives:
        n += 1
        t0 = time.perf_counter()
        coll = collective_costs(repeats=collective_repeats,
                                progress=Progress(f"[{n}/{steps}] collectives between two processes", 1, ""))
        bps = coll.get("bytes_per_s")
        _say(f"[{n}/{steps}] collectives between two processes: {1e6 * coll['fixed_s']:.0f} us each, "
             f"{(bps or float('nan')) / 1e9:.2f} GB/s ({time.perf_counter() - t0:.1f} s)")
    sharing = {}
    if collectives:
        n += 1
        t0 = time.perf_counter()
        sharing = core_sharing(tuple(sorted({1, 2, *parts})), work=sharing_work, rounds=sharing_rounds,
                               progress=Progress(f"[{n}/{steps}] processes side by side", 1, "measures"))
        _say(f"[{n}/{steps}] processes side by side: " + ", ".join(f"{r} -> {v}x" for r, v in sharing.items())
             + f" slower than one ({time.perf_counter() - t0:.1f} s)")
    if collectives and paid and coll.get("bytes_per_s"):
        n += 1
        t0 = time.perf_counter()
        why = _two_processes_refused(tr)
        paid_sizes = sorted(sorted(sizes, key=lambda b: (abs(b - S), b))[:exchange_batches or len(sizes)])
        paid_batches = [bp for bp in batches if bp.batch_size in paid_sizes]
        if why is None:
            try:
                runs = exchange_runs(base, [(b, middle[b]["warmup"], middle[b]["iterations"]) for b in paid_sizes],
                                     progress=Progress(f"[{n}/{steps}] collectives as two training processes pay "
                                                       f"them", 1, "iterations"))
            except RuntimeError as e:
                why = f"the two-process runs failed: {e}"
        if why is None:
            # the one process's memory read and write over the window (the profile's are over the stream)
            store_alone = [(bp.seconds["memory_read"] / bp.stream_factor.get("memory_read", 1.0)
                            + bp.seconds["memory_write"] / bp.stream_factor.get("memory_write", 1.0))
                           for bp in paid_batches]
            paid = paid_costs(runs, [middle[b]["wall"] for b in paid_sizes], store_alone,
                              [bp.step_cv for bp in paid_batches], grad_bytes, coll["bytes_per_s"])
            coll = {**coll, **paid}
            _say(f"[{n}/{steps}] collectives as two training processes pay them: the gradients' all-reduce "
                 f"{1e6 * paid['gradient_s']:.0f} us, a store collective {1e6 * paid['exchange_s']:.0f} us ({exchange_store()} "
                 f"at 2 x 1 x 1, " + ", ".join(f"batch {b}: all-reduce {1e3 * g:.1f} ms, store {1e3 * x:.1f} ms"
                                              for b, g, x in zip(runs["batches"], runs["gradients_s"], runs["store_s"]))
                 + f" an iteration) ({time.perf_counter() - t0:.1f} s)")
        else:
            coll = {**coll, "paid_note": why}
            _say(f"[{n}/{steps}] collectives as training processes pay them: not measured ({why}); the idle "
                 f"two-process cost stands in")
    source, L, aps = ("given" if largest_batch else "none"), largest_batch, {}
    if sweep_accuracy:
        n += 1
        t0 = time.perf_counter()
        sweep = sorted(set(accuracy_batches or sorted({*sizes, *(2 * b for b in sizes), *(4 * b for b in sizes)})))
        per_run = train_end - lo if accuracy_events is None else min(train_end - lo, accuracy_events)
        acc_progress = Progress(f"[{n}/{steps}] accuracy sweep", per_run * len(sweep), "training events")
        for b in sweep:
            aps[b] = _val_ap(base, graph, b, accuracy_events, acc_progress)
        L = largest_safe(list(aps), list(aps.values()), ap_tolerance)
        source = "measured"
        _say(f"[{n}/{steps}] accuracy sweep: val AP " + ", ".join(f"{b}: {a:.4f}" for b, a in aps.items())
             + f" -> L = {L} (within {ap_tolerance} of the best) ({time.perf_counter() - t0:.1f} s)")
        batches = [BatchProfile(**{**bp.__dict__, "val_ap": aps.get(bp.batch_size)}) for bp in batches]
    sampler = getattr(tr, "sampler", None)
    graph_bytes = _nbytes(graph) + (_nbytes(sampler.tcsr) if sampler is not None and hasattr(sampler, "tcsr") else 0)
    m = cfg.model
    data = {"name": cfg.data.name or graph.name, "overrides": list(overrides), "num_nodes": int(graph.num_nodes),
            "num_events": int(graph.num_events), "num_train_events": int(train_end - lo), "mem_dim": int(m.mem_dim),
            "mail_dim": int(tr.memory.mail.shape[-1]) if hasattr(tr.memory, "mail") else int(2 * m.mem_dim),
            "mailbox_size": int(m.mailbox_size), "model": str(m.name), "fanouts": list(cfg.sampler.fanouts),
            "device": tr.device.type,
            "accuracy_sweep": {str(b): a for b, a in aps.items()}}
    return Profile(data=data, batches=batches, grad_bytes=int(grad_bytes), placements=placements,
                   collectives=coll, graph_bytes=int(graph_bytes), core_sharing=sharing, overlap=overlap, largest_batch=L,
                   saturation_batch=S,
                   accuracy_source=source, threads=threads, machine=f"{platform.node()} {os.cpu_count()} CPUs",
                   created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


if __name__ == "__main__" and sys.argv[1:2] == ["--spin-worker"]:  # one of core_sharing's processes
    _spin_worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
if __name__ == "__main__" and sys.argv[1:2] == ["--exchange-worker"]:  # one of exchange_runs' two ranks
    _exchange_worker(sys.argv[2], sys.argv[3])
if __name__ == "__main__" and sys.argv[1:2] == ["--collective-worker"]:  # one of collective_costs' two processes
    _out, _sizes, _repeats = sys.argv[2:5]
    _collective_worker(_out, [int(x) for x in _sizes.split(",")], int(_repeats))
