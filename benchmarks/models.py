"""Train TGN, JODIE and APAN on real data sets and report test AP, MRR and training speed.

    python benchmarks/models.py --data wikipedia enron --models tgn jodie apan --epochs 5 --batch 200

Uses the same configs as `tgdist train` (one run per (data, model), in this process). Prints one
JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import tempfile

from common import at_least, emit, machine, note, peak_rss_mib, run_main

from tgdist.runtime.build import compose, precheck
from tgdist.runtime.run import Run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", default=["wikipedia", "enron"], help="data= groups (configs/data)")
    ap.add_argument("--models", nargs="+", default=["tgn", "jodie", "apan"], help="model= groups (configs/model)")
    ap.add_argument("--epochs", type=at_least(1), default=5)
    ap.add_argument("--batch", type=at_least(1), default=200, help="training batch size")
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch and numba threads")
    ap.add_argument("--num-neg-eval", type=at_least(1), default=49, help="MRR negatives")
    ap.add_argument("--max-events", type=at_least(1), default=None, help="keep only the first N events")
    args = ap.parse_args()
    runs = {}
    for data in args.data:
        for model in args.models:
            overrides = [f"data={data}", f"model={model}", f"train.epochs={args.epochs}", f"train.batch_size={args.batch}",
                         f"train.num_threads={args.threads}", f"sampler.num_threads={args.threads}",
                         f"train.num_neg_eval={args.num_neg_eval}", "train.progress=false", "train.test_every_epoch=false"]
            if args.max_events:
                overrides.append(f"data.max_events={args.max_events}")
            precheck(compose(overrides))  # every run's settings and data file, before the first trains
            runs[data, model] = overrides
    results = []
    for (data, model), overrides in runs.items():
        note(f"{data} / {model}")
        with tempfile.TemporaryDirectory() as d:
            s = Run(compose(overrides + [f"run_dir={d}"]), d).train()
        row = {"data": data, "model": model, **{k: s[k] for k in ("test_ap", "test_auc", "test_mrr", "val_ap",
                                                                  "best_epoch", "train_events_per_s") if k in s}}
        note(f"  {row}")
        results.append(row)
    emit({"machine": machine(), "epochs": args.epochs, "batch": args.batch, "threads": args.threads,
          "results": results, "peak_rss_mib": peak_rss_mib()})


if __name__ == "__main__":
    run_main(main)
