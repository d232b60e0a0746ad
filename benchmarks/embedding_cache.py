"""FreshGNN's historical embedding cache on TGN with two attention layers (``model=tgat2``).

For each data set, seed and cache setting: a whole run through ``tgdist.runtime.run.Run`` (train
``--epochs`` epochs, validation after each, test after the last), reporting the training seconds
per epoch and per step, hop-1 slots served from the cache (hit rate), hop-2 rows and neighbours not
expanded, and test AP / MRR. Settings are ``off``, or ``P_GRAD:T_STALE`` (``cache.enabled=true``);
``1:0`` serves nothing and isolates computing each (node, event) pair once per batch
(``cache.share_in_batch``) from reuse across iterations.

This machine is shared, so epoch times of separate runs carry other processes' load. The
``paired`` section therefore also steps one trainer per setting in lockstep in one process, the
same batches in turn, and reports the median over steps of the uncached step time divided by each
setting's: load that comes and goes hits every setting alike.

    python benchmarks/embedding_cache.py --data wikipedia collegemsg --max-events 12000 --epochs 1
    python benchmarks/embedding_cache.py --no-runs --max-events 50000 --paired-warmup 60 --paired-steps 80
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import at_least, emit, machine, note, run_main

from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.run import Run


def setting_overrides(setting: str) -> list[str]:
    if setting == "off":
        return ["cache.enabled=false"]
    try:
        p_grad, t_stale = setting.split(":")
        float(p_grad), int(t_stale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"setting {setting!r}: give off or P_GRAD:T_STALE, e.g. 0.9:20") from None
    return ["cache.enabled=true", f"cache.p_grad={p_grad}", f"cache.t_stale={t_stale}"]


def base_overrides(args, data: str, seed: int) -> list[str]:
    return [f"data={data}", "model=tgat2", f"train.batch_size={args.batch}", f"train.epochs={args.epochs}",
            f"train.num_neg_eval={args.num_neg_eval}", f"train.seed={seed}", f"train.num_threads={args.threads}",
            f"sampler.num_threads={args.threads}", "train.progress=false", "train.test_every_epoch=false",
            *([f"train.device={args.device}"] if getattr(args, "device", None) else []),
            *([f"data.max_events={args.max_events}"] if args.max_events else [])]


def one_run(args, data: str, seed: int, setting: str) -> dict:
    cfg = compose(base_overrides(args, data, seed) + setting_overrides(setting))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        Run(cfg, Path(tmp) / "run").train()
        wall = time.perf_counter() - t0
        lines = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [ln for ln in lines if ln["epoch"] >= 0]
    steps = sum(-(-ln["train_events"] // args.batch) for ln in epochs)
    train_s = sum(ln["train_seconds"] - ln["compile_seconds"] for ln in epochs)
    out = {"data": data, "seed": seed, "setting": setting, "wall_seconds": round(wall, 2),
           "epoch_seconds": [round(ln["train_seconds"] - ln["compile_seconds"], 3) for ln in epochs],
           "steps": steps, "step_ms": round(1000 * train_s / max(steps, 1), 2), "test_ap": epochs[-1].get("test_ap"),
           "test_mrr": epochs[-1].get("test_mrr"), "val_ap": epochs[-1].get("val_ap")}
    caches = [ln["cache"] for ln in epochs if "cache" in ln]
    if caches:
        tot = {k: sum(c[k] for c in caches) for k in ("slots", "computed", "rows", "hit_rows", "nbrs", "nbrs_avoided", "pairs", "hit_pairs",
                                                      "admitted", "evicted_gradient", "evicted_stale", "overwritten")}
        tot["hit_rate"] = tot["hit_rows"] / max(tot["rows"], 1)
        tot["hit_rate_per_epoch"] = [round(c["hit_rate"], 4) for c in caches]
        out["cache"] = tot
    note(f"{data} seed {seed} {setting}: {out['step_ms']} ms/step, test AP {out['test_ap']}, "
         f"hit rate {out.get('cache', {}).get('hit_rate', 0):.3f}")
    return out


def step_times(trainers: dict, batches) -> dict:
    """Seconds of each training step of every trainer, stepped in lockstep over ``batches``
    (``(lo, hi)`` pairs); on a GPU the device is synchronised around each step, so a step's time
    is its own and not the queue of the one before."""
    times = {name: [] for name in trainers}
    for tr in trainers.values():
        tr.model.train()
    for lo, hi in batches:
        for name, tr in trainers.items():
            neg = tr.negatives.train(hi - lo, 1)
            cuda = torch.device(tr.device).type == "cuda"
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tr.step(lo, hi, neg, train=True)
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def cache_parts(trainers: dict):
    """Seconds of the cache's own work in each step of the trainers that have a cache: its lookup
    (id map, staleness, which rows to compute), ``prune_nodes`` and its admission after backward,
    ``{name: {part: [seconds per call]}}`` (one call of each per training step). On a GPU the device
    is synchronised around each part, so a part's time is what the step waits for it; the
    synchronisations add a little to the steps of these trainers."""
    from tgdist.runtime import trainer as trainer_module

    parts = {name: {"lookup": [], "prune_nodes": [], "admit": []} for name, tr in trainers.items()
             if tr.cache is not None}
    owner = {}  # which trainer's cache a prune_nodes call serves: the one whose lookup ran last
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(part, fn, name=None):  # name None: the trainer whose lookup ran last
        def call(*a, **kw):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            sync()
            parts[name or owner["last"]][part].append(time.perf_counter() - t0)
            if part == "lookup":
                owner["last"] = name
            return out
        return call

    prune = trainer_module.prune_nodes
    for name in parts:
        cache = trainers[name].cache
        cache.lookup = timed("lookup", cache.lookup, name)
        cache.admit = timed("admit", cache.admit, name)
    trainer_module.prune_nodes = timed("prune_nodes", prune)
    try:
        yield parts
    finally:
        trainer_module.prune_nodes = prune
        for name in parts:
            for attr in ("lookup", "admit"):
                vars(trainers[name].cache).pop(attr, None)


def paired(args, data: str, settings: list[str]) -> dict:
    """Per-step time of every setting stepped in lockstep (seed 0), over ``--paired-steps`` training
    batches after ``--paired-warmup``; with ``--breakdown``, the cache's own work in those steps."""
    trainers = {s: build_trainer(compose(base_overrides(args, data, 0) + setting_overrides(s)), progress=False)
                for s in settings}
    batches = list(next(iter(trainers.values())).batches("train"))[: args.paired_warmup + args.paired_steps]
    with cache_parts(trainers) if args.breakdown else contextlib.nullcontext() as parts:
        times = step_times(trainers, batches)
    base = np.array(times[settings[0]][args.paired_warmup:])
    out = {"steps": len(base), "warmup": args.paired_warmup, "relative_to": settings[0]}
    for name in settings:
        t = np.array(times[name][args.paired_warmup:])
        out[name] = {"median_step_ms": round(1000 * float(np.median(t)), 2),
                     "median_speedup": round(float(np.median(base / t)), 3)}
        if trainers[name].cache is not None:
            out[name]["hit_rate"] = round(trainers[name].cache.take_stats()["hit_rate"], 4)
        if parts and name in parts:
            own = {p: np.array(v[args.paired_warmup:]) for p, v in parts[name].items()}
            out[name]["cache_ms_median"] = {p: round(1000 * float(np.median(v)), 3) for p, v in own.items() if len(v)}
            total = sum(1000 * float(np.median(v)) for v in own.values() if len(v))
            out[name]["cache_ms_median"]["total"] = round(total, 3)
            out[name]["median_step_ms_without_cache_work"] = round(out[name]["median_step_ms"] - total, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", default=["wikipedia", "collegemsg"], help="configs/data names")
    ap.add_argument("--settings", nargs="+", default=["off", "1:0", "0.9:5", "0.9:20"], type=str)
    ap.add_argument("--seeds", nargs="+", type=at_least(0), default=[0, 1, 2])
    ap.add_argument("--max-events", type=at_least(1), default=None, help="first N events of each data set")
    ap.add_argument("--epochs", type=at_least(1), default=2)
    ap.add_argument("--batch", type=at_least(1), default=200)
    ap.add_argument("--num-neg-eval", type=at_least(1), default=9, help="MRR's negatives")
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument("--paired-steps", type=at_least(0), default=60, help="0: no paired section")
    ap.add_argument("--paired-warmup", type=at_least(0), default=20, help="untimed steps first (the cache fills)")
    ap.add_argument("--no-runs", action="store_true", help="the paired section only")
    ap.add_argument("--breakdown", action="store_true",
                    help="paired section: time the cache's own lookup, pruning and admission in each step")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="train.device of every trainer")
    ap.add_argument("--host-features", action="store_true",
                    help="on a GPU, leave the features in host memory and gather each batch's rows there, as for a "
                         "graph whose features do not fit the device (tgdist.runtime.features.HostRows)")
    args = ap.parse_args()
    for s in args.settings:
        try:
            setting_overrides(s)
        except argparse.ArgumentTypeError as e:
            ap.error(str(e))
    if args.settings[0] != "off":
        ap.error("--settings: the first setting is the baseline and must be off")
    if args.host_features:
        if args.device != "cuda":
            ap.error("--host-features: only with --device cuda (on the CPU the features are host memory already)")
        from tgdist.runtime import features

        features.DEVICE_SHARE = 0.0  # no table is small enough for the device
    for data in args.data:  # a bad name fails before any work
        compose(base_overrides(args, data, 0))
    result = {"machine": machine(), "args": vars(args), "runs": [], "paired": {}}
    for data in args.data:
        for seed in [] if args.no_runs else args.seeds:
            for setting in args.settings:  # interleaved, so slow spells of the machine spread over settings
                result["runs"].append(one_run(args, data, seed, setting))
        if args.paired_steps:
            result["paired"][data] = paired(args, data, args.settings)
    summary = {}
    for data in [] if args.no_runs else args.data:
        base = [r for r in result["runs"] if r["data"] == data and r["setting"] == "off"]
        for setting in args.settings:
            rs = [r for r in result["runs"] if r["data"] == data and r["setting"] == setting]
            row = {k: float(np.mean([r[k] for r in rs])) for k in ("step_ms", "test_ap", "test_mrr")}
            row["test_ap_std"] = float(np.std([r["test_ap"] for r in rs]))
            row["speedup_vs_off"] = float(np.mean([r["step_ms"] for r in base]) / row["step_ms"])
            row["test_ap_change_points"] = 100 * (row["test_ap"] - float(np.mean([r["test_ap"] for r in base])))
            if "cache" in rs[0]:
                row["hit_rate"] = float(np.mean([r["cache"]["hit_rate"] for r in rs]))
                row["layer1_rows_computed_share"] = float(np.mean([r["cache"]["computed"] / r["cache"]["slots"]
                                                                   for r in rs]))
                row["hop2_rows_avoided_per_step"] = float(np.mean([r["cache"]["hit_rows"] / r["steps"] for r in rs]))
                row["hop2_nbrs_avoided_share"] = float(np.mean([r["cache"]["nbrs_avoided"] / max(r["cache"]["nbrs"], 1)
                                                                for r in rs]))
            summary[f"{data} {setting}"] = row
    result["summary"] = summary
    emit(result)
    return 0


if __name__ == "__main__":
    run_main(main)
