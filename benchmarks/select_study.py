"""Which epoch to report: the test metrics of the best-validation epoch against the last epoch's.

    python benchmarks/select_study.py --data collegemsg bitcoin_otc enron wikipedia --epochs 5 --seeds 0 1

One run per (data, model, seed), in this process, with the test part evaluated after every epoch,
so one run gives both choices of ``train.select``: the test metrics of a run's best-validation
epoch are what that epoch's model and memory give after validation, which the per-epoch test line
is. Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import at_least, emit, machine, note, peak_rss_mib, run_main

from tgdist.config import TrainConfig
from tgdist.runtime.build import compose, precheck
from tgdist.runtime.run import Run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", default=["collegemsg"], help="data= groups (configs/data)")
    ap.add_argument("--models", nargs="+", default=["tgn"], help="model= groups (configs/model)")
    ap.add_argument("--epochs", type=at_least(1), default=5)
    ap.add_argument("--seeds", type=at_least(0), nargs="+", default=[0])
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch and numba threads")
    ap.add_argument("--max-events", type=at_least(1), default=None, help="keep only the first N events")
    args = ap.parse_args()
    per_epoch = ["train.test_every_epoch=true"]
    if hasattr(TrainConfig, "val_mrr"):  # validation during training is cheap by default: ask for MRR too
        per_epoch += ["train.val_mrr=true", "train.select=last", "train.eval_every=1", "train.patience=0"]
    runs = {}
    for data in args.data:
        for model in args.models:
            for seed in args.seeds:
                overrides = [f"data={data}", f"model={model}", f"train.epochs={args.epochs}", f"train.seed={seed}",
                             f"train.num_threads={args.threads}", f"sampler.num_threads={args.threads}",
                             "train.progress=false", *per_epoch]
                if args.max_events:
                    overrides.append(f"data.max_events={args.max_events}")
                precheck(compose(overrides))  # every run's settings and data file, before the first trains
                runs[data, model, seed] = overrides
    results = []
    for (data, model, seed), overrides in runs.items():
        note(f"{data} / {model} / seed {seed}")
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            Run(compose(overrides + [f"run_dir={d}"]), d).train()
            wall = time.perf_counter() - t0
            lines = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        epochs = [h for h in lines if h["epoch"] >= 0 and not h.get("final")]
        scored = [h for h in epochs if h.get("val_ap") is not None]
        best = max(scored, key=lambda h: h["val_ap"]) if scored else epochs[-1]
        last = epochs[-1]
        keys = ("val_ap", "test_ap", "test_auc", "test_mrr")
        row = {"data": data, "model": model, "seed": seed, "best_epoch": best["epoch"],
               "at_best_val": {k: best.get(k) for k in keys}, "at_last": {k: last.get(k) for k in keys},
               "epochs": [{k: h.get(k) for k in ("epoch", "loss", *keys)} for h in epochs],
               "best_minus_last_test_ap": (best["test_ap"] - last["test_ap"])
               if None not in (best.get("test_ap"), last.get("test_ap")) else None,
               "train_seconds": sum(h["train_seconds"] for h in epochs), "wall_seconds": wall}
        note(f"  best epoch {row['best_epoch']}: test AP {best.get('test_ap')} vs last {last.get('test_ap')}")
        results.append(row)
    gains = [r["best_minus_last_test_ap"] for r in results if r["best_minus_last_test_ap"] is not None]
    emit({"machine": machine(), "epochs": args.epochs, "threads": args.threads, "results": results,
          "mean_best_minus_last_test_ap": sum(gains) / len(gains) if gains else None,
          "runs_best_not_last": sum(r["best_epoch"] != r["epochs"][-1]["epoch"] for r in results),
          "peak_rss_mib": peak_rss_mib()})


if __name__ == "__main__":
    run_main(main)
