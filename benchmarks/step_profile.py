"""Where one training step's time goes: wall milliseconds per phase of a TGN step on real data.

Phases: prepare (sample, unique tables, memory read), updater forward, embedding forward, backward,
optimizer, write-back, and the rest of compute (predictor, loss). Steps ``--warmup`` .. ``--warmup +
--windows * --window`` of epoch 0 are timed in windows of ``--window`` steps; the window with the
least total time is reported (this machine is shared: the least disturbed window is the best
estimate of the step's own cost), with the median beside it. Per-phase figures are from that window.

    python benchmarks/step_profile.py --threads 1 2 --batch 600
    python benchmarks/step_profile.py --cpu-kernels false    # the plain torch formulation
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from common import DATA_FILES, DATASETS, at_least, emit, machine, note, run_main

from tgdist.data.load import load_graph
from tgdist.runtime import trainer
from tgdist.runtime.build import build_trainer, compose


class PhaseClock:
    """Wraps methods so each call adds its wall time to a named phase (nested calls are counted in
    both their own phase and the caller's; the report subtracts them where they nest)."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.undo = []

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0

        setattr(owner, name, timed)
        self.undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)


def profile(graph, threads: int, batch: int, warmup: int, window: int, windows: int, cpu_kernels: bool) -> dict:
    torch.set_num_threads(threads)
    cfg = compose([f"train.batch_size={batch}", "train.num_neg_eval=1", f"train.num_threads={threads}",
                   f"sampler.num_threads={threads}", "train.progress=false", f"model.cpu_kernels={str(cpu_kernels).lower()}"])
    tr = build_trainer(cfg, graph=graph, progress=False)
    steps = list(tr.batches("train"))
    if len(steps) < warmup + window * windows:
        raise SystemExit(f"only {len(steps)} training batches; lower --warmup/--window/--windows")
    for s, e in steps[:warmup]:
        tr.step(s, e, tr.negatives.train(e - s, 1), train=True)

    clock = PhaseClock()
    clock.wrap(trainer.Trainer, "prepare", "prepare")
    clock.wrap(trainer.Trainer, "compute", "compute")
    clock.wrap(trainer.Trainer, "write_back", "write_back")
    clock.wrap(type(tr.model.updater), "forward", "updater_forward")
    clock.wrap(type(tr.model.embedding), "forward", "embedding_forward")
    clock.wrap(torch.Tensor, "backward", "backward")
    clock.wrap(type(tr.optimizer), "step", "optimizer")
    results = []
    try:
        for w in range(windows):
            clock.seconds.clear()
            t0 = time.perf_counter()
            for s, e in steps[warmup + w * window: warmup + (w + 1) * window]:
                tr.step(s, e, tr.negatives.train(e - s, 1), train=True)
            total = time.perf_counter() - t0
            results.append((total, dict(clock.seconds)))
    finally:
        clock.restore()
    totals = sorted(r[0] for r in results)
    best_total, best = min(results, key=lambda r: r[0])
    ms = {k: 1000 * v / window for k, v in best.items()}
    nested = ms.get("updater_forward", 0) + ms.get("embedding_forward", 0) + ms.get("backward", 0) + ms.get("optimizer", 0)
    phases = {k: round(ms.get(k, 0.0), 2) for k in ("prepare", "updater_forward", "embedding_forward", "backward",
                                                     "optimizer", "write_back")}
    phases["rest_of_compute"] = round(ms.get("compute", 0.0) - ms.get("write_back", 0.0) - nested, 2)
    return {"threads": threads, "cpu_kernels": cpu_kernels, "batch": batch,
            "ms_per_step_best": round(1000 * best_total / window, 2),
            "ms_per_step_median": round(1000 * totals[len(totals) // 2] / window, 2),
            "events_per_s_best": round(batch * window / best_total), "phases_ms": phases}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="wikipedia", choices=sorted(DATA_FILES))
    ap.add_argument("--batch", type=at_least(1), default=600, help="training batch size")
    ap.add_argument("--threads", type=at_least(1), nargs="+", default=[1, 2], help="thread counts to profile")
    ap.add_argument("--warmup", type=at_least(0), default=60, help="steps before the first timed window")
    ap.add_argument("--window", type=at_least(1), default=10, help="steps per timed window")
    ap.add_argument("--windows", type=at_least(1), default=6, help="timed windows (best and median reported)")
    ap.add_argument("--cpu-kernels", choices=["true", "false"], default="true", help="model.cpu_kernels")
    args = ap.parse_args()
    graph = load_graph(DATASETS / DATA_FILES[args.data])
    res = {"machine": machine(), "data": args.data, "profiles": []}
    for threads in args.threads:
        note(f"profiling {args.window * args.windows} steps at batch {args.batch}, {threads} thread(s)")
        res["profiles"].append(profile(graph, threads, args.batch, args.warmup, args.window, args.windows,
                                       args.cpu_kernels == "true"))
        note(f"  {res['profiles'][-1]}")
    emit(res)


if __name__ == "__main__":
    run_main(main)
