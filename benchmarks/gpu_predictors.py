"""What predicts a training step's time on a GPU, measured on the CPU (issue 53).

A GPU runs tgdist at the host's pace while the host dispatches every operation and waits for the
device's values; these figures say how much of each a step does, without a GPU. Per model and
batch size, with ``model.cpu_kernels=false`` (the plain torch formulation, as a GPU runs it) and
the memory updaters as a GPU runs them (``use_sync_free``: no reads where the store says whether
its mailbox is empty, as local memory does):

- ``aten_ops``: aten operations per training step. ``profiler_all`` and ``profiler_top_level``
  are torch.profiler's aten events (every one, and those not called from another aten op: the
  forward's one per call the Python code makes, the backward's one per call the autograd engine
  makes; by phase too); ``dispatched`` are the operations a backend runs (a
  TorchDispatchMode sees them after autograd and composite ops are decomposed; on a GPU each is a
  kernel launch, or a view), split by phase: ``prepare`` (sample, organise, memory read),
  ``forward`` (the memory update, embedding, loss and what is not below), ``write_back``,
  ``backward``, ``optimizer``; ``views`` of them launch nothing.
- ``host_reads``: calls that wait for the device on a GPU, per step, by kind: a tensor's value
  read in Python (``item``, ``tolist``, ``bool``/``int``/``float``/``index`` of a tensor,
  ``numpy`` / ``__array__``, ``cpu``, ``to('cpu')``; a TorchFunctionMode), aten operations whose
  output shape depends on the data (``nonzero``, ``unique``, ``masked_select``, indexing with a
  boolean mask, ``repeat_interleave`` without ``output_size``, ``bincount``) and scalar reads
  made otherwise (``equal``, the aten scalar read; the dispatch mode). ``to(device)`` counts
  ``.to(d)`` calls given a ``torch.device``: from a host tensor that is a copy to the GPU, which
  waits for the stream unless the source is pinned and ``non_blocking``; a tensor already on
  ``d`` costs nothing; ``to_device_queued`` counts those given ``non_blocking=True``
  (``tgdist.uploads.upload``: pinned on a GPU, queued without a wait). ``top_sites``
  and ``to_device_sites`` give the call sites (file:line in tgdist, and the line) of the most
  frequent, ``--top`` of each. Reads in branches the CPU alone
  takes (``CPU_ONLY``: the GPU path makes no read there) are counted apart as ``cpu_only``.
- ``host_ms``: wall milliseconds per step with the model's arithmetic made small
  (``model.mem_dim`` and ``model.time_dim`` ``--dim``, default 8; on a CPU what still grows with
  the batch is left, which a GPU would not feel): the host's own work, which bounds a GPU step
  from below while the host dispatches every operation. Steps ``--warmup`` ..
  ``--warmup + --windows * --window`` of epoch 0 in windows of ``--window`` steps, the least
  disturbed window (best) and the median, as ``step_profile.py``; ``cpu_*`` the same of this
  process's CPU time (with one thread, ``--threads``, the least moved by other processes on a
  shared machine: the wall time there counts the waits for a core), and ``cpu_by_phase`` that
  CPU time by the phases above (the mean over the timed steps).

- ``evaluation`` (``--eval-neg N``): the validation part evaluated against N negatives an event
  after the steps above: its host reads (in all, with their sites), its uploads and its aten
  operations per batch, then the part again timed: wall and CPU milliseconds per batch and the
  prepare phase's CPU milliseconds.

``--sampler-on-device`` runs the recent sampler as tensor operations (``sampler.on_device=true``,
a GPU's default where it applies; here its operations compute on the CPU, so its prepare phase's
milliseconds hold arithmetic that a GPU would do).

The counts are the same in every run with the same torch (they vary from step to step only
where the data do); the milliseconds move with the machine's load.

    python benchmarks/gpu_predictors.py --models tgn jodie apan --batch 600 200
    python benchmarks/gpu_predictors.py --models tgn --eval-neg 49 --sampler-on-device
"""

from __future__ import annotations

import argparse
import linecache
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from common import REPO, at_least, emit, machine, note, run_main
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tgdist.models.modules import use_sync_free
from tgdist.runtime import trainer
from tgdist.runtime.build import build_trainer, compose

aten = torch.ops.aten

# A tensor's value read in Python: on a GPU each copies to the host and waits for the stream.
READS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
         torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
         torch.Tensor.numpy: "numpy", torch.Tensor.__array__: "numpy", torch.Tensor.cpu: "cpu"}
# aten operations whose output shape depends on the values (the host waits for them on a GPU)
SHAPE_OF_DATA = {aten.nonzero: "nonzero", aten._unique2: "unique", aten._unique: "unique",
                 aten.unique_dim: "unique", aten.unique_consecutive: "unique", aten.masked_select: "masked_select",
                 aten.bincount: "bincount", aten.equal: "equal", aten.is_nonzero: "scalar (aten)"}
# Reads that only the CPU path makes: (file, text of the line); its GPU branch reads nothing there
# (modules.py: the query rows up to index.max() on the CPU, the whole table on a GPU; _used: NumPy
# on the CPU, torch.unique on a GPU, which is a read of its own, but off the steps measured here:
# HopTables.select serves the embedding cache and second layers).
CPU_ONLY = [("tgdist/models/modules.py", "int(index.max())"),
            ("tgdist/models/modules.py", "index.reshape(-1).numpy()")]
PHASES = ("prepare", "forward", "write_back", "backward", "optimizer")
HERE = Path(__file__).resolve()
TORCH_DIR = Path(torch.__file__).resolve().parent


def call_site() -> tuple[str, str]:
    """The innermost frame in this repository outside this file: ``("path:line (function)", line text)``."""
    f = sys._getframe(2)
    while f is not None:
        path = Path(f.f_code.co_filename)
        if path.is_absolute() and path != HERE and not path.is_relative_to(TORCH_DIR) and path.is_relative_to(REPO):
            rel = path.relative_to(REPO).as_posix()
            return f"{rel}:{f.f_lineno} ({f.f_code.co_name})", linecache.getline(str(path), f.f_lineno).strip()
        f = f.f_back
    return "(outside the repository)", ""


class Counts:
    """What the two modes saw: aten operations by phase, and host reads by kind and call site."""

    def __init__(self):
        self.phase = "forward"
        self.ops = Counter()
        self.views = 0
        self.reads = Counter()
        self.cpu_only = Counter()
        self.sites = defaultdict(Counter)  # kind -> site -> calls
        self.text = {}
        self.inside_read = 0  # a Python-level read in progress: its aten scalar read is not counted again

    def read(self, kind: str) -> None:
        site, text = call_site()
        if any(site.startswith(path + ":") and frag in text for path, frag in CPU_ONLY):
            self.cpu_only[kind] += 1
            return
        self.reads[kind] += 1
        self.sites[kind][site] += 1
        self.text[site] = text


def _device_argument(args, kwargs):
    """The device ``Tensor.to(...)`` was given, or None (a dtype alone)."""
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (torch.device, str)):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class HostReads(TorchFunctionMode):
    """Counts the Python-level reads of tensor values and the ``.to(device)`` calls."""

    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = READS.get(func)
        if func is torch.Tensor.to:
            dev = _device_argument(args, kwargs)
            kind = None if dev is None else "to('cpu')" if isinstance(dev, str) and dev == "cpu" else "to(device)"
            if kind == "to(device)" and kwargs.get("non_blocking"):
                kind = "to(device) queued"  # queued on the stream: the host does not wait (tgdist.uploads)
        if kind is None:
            return func(*args, **kwargs)
        self.counts.read(kind)
        self.counts.inside_read += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counts.inside_read -= 1


class AtenOps(TorchDispatchMode):
    """Counts the aten operations a backend runs, by phase, and those whose output shape depends on the data."""

    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counts
        c.ops[c.phase] += 1
        if func.is_view:
            c.views += 1
        kind = self._data_shaped(func, args, kwargs)
        if kind is not None and not (kind == "scalar (aten)" and c.inside_read):
            c.read(kind)
        return func(*args, **kwargs)

    @staticmethod
    def _data_shaped(func, args, kwargs):
        packet = func.overloadpacket
        if packet is aten._local_scalar_dense:
            return "scalar (aten)"  # a read Python made some other way than READS
        if packet in SHAPE_OF_DATA:
            return SHAPE_OF_DATA[packet]
        if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
                return "boolean mask index"
        if packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor:
            if kwargs.get("output_size") is None:
                return "repeat_interleave"
        return None


class Phase:
    """Wraps methods so what runs in them counts in a named phase, restored on exit: the
    operations they dispatch, and this process's CPU seconds (each phase's own, a phase nested in
    another is not counted in the outer one)."""

    def __init__(self, counts: Counts):
        self.counts, self.undo = counts, []
        self.cpu = Counter()
        self.mark = time.process_time()

    def _enter(self, phase: str) -> str:
        now = time.process_time()
        self.cpu[self.counts.phase] += now - self.mark
        self.mark = now
        before, self.counts.phase = self.counts.phase, phase
        return before

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def in_phase(*args, **kwargs):
            before = self._enter(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self._enter(before)

        setattr(owner, name, in_phase)
        self.undo.append((owner, name, original))

    def wrap_step(self, tr) -> None:
        """The phases of ``PHASES`` in ``tr``'s training step."""
        self.wrap(trainer.Trainer, "prepare", "prepare")
        self.wrap(trainer.Trainer, "write_back", "write_back")
        self.wrap(torch.Tensor, "backward", "backward")
        self.wrap(type(tr.optimizer), "step", "optimizer")

    def restore(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)


def run_steps(tr, steps) -> None:
    for s, e in steps:
        tr.step(s, e, tr.negatives.train(e - s, 1), train=True)


def profiler_counts(tr, steps) -> dict:
    """torch.profiler's aten events per step: all, and those without an aten op above them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(tr, steps)
    total, top = 0, Counter()
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        total += 1
        up, phase = ev.cpu_parent, "forward"
        while up is not None and not up.name.startswith("aten::"):
            if up.name.startswith("autograd::engine::evaluate_function"):
                phase = "backward"
            elif up.name.startswith("Optimizer.step"):
                phase = "optimizer"
            up = up.cpu_parent
        if up is None:
            top[phase] += 1
    n = len(steps)
    return {"profiler_all": round(total / n, 1), "profiler_top_level": round(sum(top.values()) / n, 1),
            "profiler_top_level_by_phase": {p: round(top[p] / n, 1) for p in ("forward", "backward", "optimizer")}}


def mode_counts(tr, steps, top: int) -> tuple[dict, dict]:
    counts = Counts()
    phase = Phase(counts)
    phase.wrap_step(tr)
    try:
        with HostReads(counts), AtenOps(counts):
            run_steps(tr, steps)
    finally:
        phase.restore()
    n = len(steps)
    per = {p: round(counts.ops[p] / n, 1) for p in PHASES}
    ops = {"dispatched": round(sum(counts.ops.values()) / n, 1), "dispatched_by_phase": per,
           "dispatched_views": round(counts.views / n, 1)}
    uploads = ("to(device)", "to(device) queued")
    sync_kinds = {k: v for k, v in counts.reads.items() if k not in uploads}

    def sites(kinds) -> list[dict]:
        ranked = sorted(((calls, kind, site) for kind in kinds for site, calls in counts.sites[kind].items()),
                        key=lambda r: (-r[0], r[1], r[2]))
        return [{"kind": kind, "per_step": round(calls / n, 2), "site": site, "line": counts.text[site]}
                for calls, kind, site in ranked[:top]]

    reads = {"per_step": round(sum(sync_kinds.values()) / n, 2),
             "by_kind": {k: round(v / n, 2) for k, v in sorted(sync_kinds.items(), key=lambda kv: (-kv[1], kv[0]))},
             "cpu_only": {k: round(v / n, 2) for k, v in sorted(counts.cpu_only.items())},
             "top_sites": sites(sync_kinds),
             "to_device_per_step": round(counts.reads["to(device)"] / n, 2),
             "to_device_queued_per_step": round(counts.reads["to(device) queued"] / n, 2),
             "to_device_sites": sites(["to(device)"])}
    return ops, reads


def host_ms(tr, steps, window: int) -> dict:
    """Wall and this process's CPU milliseconds per step, by windows: the least and the median;
    and the CPU milliseconds of each phase, the mean over all the steps."""
    wall, cpu = [], []
    phase = Phase(Counts())
    phase.wrap_step(tr)
    try:
        for w in range(0, len(steps), window):
            t0, c0 = time.perf_counter(), time.process_time()
            run_steps(tr, steps[w:w + window])
            wall.append(1000 * (time.perf_counter() - t0) / window)
            cpu.append(1000 * (time.process_time() - c0) / window)
        phase._enter("forward")  # the last stretch counted
    finally:
        phase.restore()
    wall.sort()
    cpu.sort()
    return {"best": round(wall[0], 2), "median": round(wall[len(wall) // 2], 2),
            "cpu_best": round(cpu[0], 2), "cpu_median": round(cpu[len(cpu) // 2], 2), "windows": len(wall),
            "cpu_by_phase": {p: round(1000 * phase.cpu[p] / len(steps), 2) for p in PHASES}}


def measure(model: str, batch: int, args) -> dict:
    torch.set_num_threads(args.threads)
    cfg = compose([f"data={args.data}", *([f"data.max_events={args.max_events}"] if args.max_events else []),
                   f"model={model}", f"model.mem_dim={args.dim}", f"model.time_dim={args.dim}",
                   "model.cpu_kernels=false", f"train.batch_size={batch}", "train.num_neg_eval=1",
                   f"train.num_threads={args.threads}", f"sampler.num_threads={args.threads}", "train.progress=false",
                   f"sampler.on_device={str(args.sampler_on_device).lower()}"])
    tr = build_trainer(cfg, progress=False)
    use_sync_free(tr.model, True)  # the updaters' GPU formulation (a CPU asks the device which rows have a mail)
    steps = list(tr.batches("train"))
    need = args.warmup + args.window * args.windows + 2 * args.count_steps
    if len(steps) < need:
        raise SystemExit(f"{model} at batch {batch}: only {len(steps)} training batches, {need} needed; "
                         f"lower --warmup, --window, --windows or --count-steps")
    run_steps(tr, steps[:args.warmup])
    at = args.warmup
    timed = host_ms(tr, steps[at:at + args.window * args.windows], args.window)
    at += args.window * args.windows
    ops = profiler_counts(tr, steps[at:at + args.count_steps])
    at += args.count_steps
    more_ops, reads = mode_counts(tr, steps[at:at + args.count_steps], args.top)
    out = {"model": model, "batch": batch, "aten_ops": {**ops, **more_ops}, "host_reads": reads, "host_ms": timed}
    if args.eval_neg:
        out["evaluation"] = evaluation(tr, args.eval_neg)
    return out


def evaluation(tr, num_neg: int) -> dict:
    """The validation part evaluated against ``num_neg`` negatives an event, after the steps above:
    host reads and aten operations per evaluated batch (and in all, with the reads' sites), then
    again timed: wall and CPU milliseconds per batch and the prepare phase's CPU share."""
    batches = len(list(tr.batches("val")))
    counts = Counts()
    with HostReads(counts), AtenOps(counts):
        tr.evaluate("val", num_neg)
    reads = {k: v for k, v in counts.reads.items() if not k.startswith("to(device)")}
    phase = Phase(Counts())
    phase.wrap(trainer.Trainer, "prepare", "prepare")
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        tr.evaluate("val", num_neg)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        phase._enter("forward")
    finally:
        phase.restore()
    return {"num_neg": num_neg, "batches": batches, "host_reads": sum(reads.values()),
            "host_reads_by_site": {site: n for kind in reads for site, n in counts.sites[kind].items()},
            "to_device_waiting": counts.reads["to(device)"], "to_device_queued": counts.reads["to(device) queued"],
            "aten_ops_per_batch": round(sum(counts.ops.values()) / batches, 1),
            "wall_ms_per_batch": round(1000 * wall / batches, 2), "cpu_ms_per_batch": round(1000 * cpu / batches, 2),
            "prepare_cpu_ms_per_batch": round(1000 * phase.cpu["prepare"] / batches, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="wikipedia", help="a data set of configs/data (data=NAME)")
    ap.add_argument("--models", nargs="+", default=["tgn", "jodie", "apan"], choices=["tgn", "jodie", "apan"])
    ap.add_argument("--batch", type=at_least(1), nargs="+", default=[600, 200], help="training batch sizes")
    ap.add_argument("--dim", type=at_least(1), default=8, help="model.mem_dim and model.time_dim")
    ap.add_argument("--threads", type=at_least(1), default=1, help="torch and numba threads")
    ap.add_argument("--warmup", type=at_least(0), default=30, help="steps before the timed windows")
    ap.add_argument("--window", type=at_least(1), default=10, help="steps per timed window")
    ap.add_argument("--windows", type=at_least(1), default=6, help="timed windows (best and median reported)")
    ap.add_argument("--count-steps", type=at_least(1), default=5, help="steps counted (profiler, then modes)")
    ap.add_argument("--top", type=at_least(0), default=12, help="call sites of host reads listed")
    ap.add_argument("--max-events", type=at_least(1), default=None, help="the data's first events only (tests)")
    ap.add_argument("--sampler-on-device", action="store_true",
                    help="sampler.on_device=true: the recent sampler as tensor ops (what a GPU runs by default)")
    ap.add_argument("--eval-neg", type=at_least(0), default=0,
                    help="then evaluate the validation part against this many negatives an event (0: not)")
    args = ap.parse_args()
    res = {"machine": machine(), "data": args.data, "dim": args.dim, "threads": args.threads,
           "cpu_kernels": False, "sampler_on_device": args.sampler_on_device, "runs": []}
    for model in args.models:
        for batch in args.batch:
            note(f"{model} at batch {batch}")
            res["runs"].append(measure(model, batch, args))
            r = res["runs"][-1]
            note(f"  aten {r['aten_ops']['dispatched']} dispatched, {r['aten_ops']['profiler_top_level']} top level; "
                 f"reads {r['host_reads']['per_step']}/step; {r['host_ms']['best']} ms/step")
    emit(res)


if __name__ == "__main__":
    run_main(main)
