"""The share of a run's time spent evaluating: the default evaluation against the one it replaced.

    python benchmarks/eval_cost.py --data collegemsg --epochs 5

Per data set, one run per setting, in this process, one after the other:
- ``default``: tgdist's defaults (validation against one negative after every epoch, the
  selected epoch tested once at the end against ``train.num_neg_eval`` negatives);
- ``every_epoch_full``: what every run did before ``train.select`` (validation and test against
  ``train.num_neg_eval`` negatives after every epoch): ``train.val_mrr=true train.test_every_epoch=true``.
Training seconds are the epochs' (kernel compiling included); evaluation seconds are the
validations', per-epoch tests' and the final test's, as the metrics lines record them (the
replaced evaluation did not test the last epoch twice: take ``final_test_seconds`` off its
``eval_seconds``). Prints one
JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import at_least, emit, machine, note, peak_rss_mib, run_main

from tgdist.runtime.build import compose, precheck
from tgdist.runtime.run import Run

SETTINGS = {"default": [], "every_epoch_full": ["train.val_mrr=true", "train.test_every_epoch=true",
                                                "train.select=last"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", default=["collegemsg"], help="data= groups (configs/data)")
    ap.add_argument("--model", default="tgn", help="model= group (configs/model)")
    ap.add_argument("--epochs", type=at_least(1), default=5)
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch and numba threads")
    ap.add_argument("--max-events", type=at_least(1), default=None, help="keep only the first N events")
    ap.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["default", "every_epoch_full"])
    args = ap.parse_args()
    runs = {}
    for data in args.data:
        for name in args.settings:
            overrides = [f"data={data}", f"model={args.model}", f"train.epochs={args.epochs}",
                         f"train.num_threads={args.threads}", f"sampler.num_threads={args.threads}",
                         "train.progress=false", *SETTINGS[name]]
            if args.max_events:
                overrides.append(f"data.max_events={args.max_events}")
            precheck(compose(overrides))  # every run's settings and data file, before the first trains
            runs[data, name] = overrides
    results = []
    for (data, name), overrides in runs.items():
        note(f"{data} / {name}")
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            s = Run(compose(overrides + [f"run_dir={d}"]), d).train()
            wall = time.perf_counter() - t0
            lines = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        final = sum(h.get("final_test_seconds") or 0.0 for h in lines)
        share = s["eval_seconds"] / max(s["eval_seconds"] + s["train_seconds"], 1e-9)
        row = {"data": data, "setting": name, "overrides": SETTINGS[name], "train_seconds": s["train_seconds"],
               "eval_seconds": s["eval_seconds"], "final_test_seconds": final, "eval_share": share,
               "validations": sum("val_ap" in h for h in lines), "wall_seconds": wall,
               "train_events_per_s": s["train_events_per_s"], "selected_epoch": s["selected_epoch"],
               **{k: s.get(k) for k in ("test_ap", "test_mrr", "val_ap", "val_mrr")}}
        note(f"  evaluation {s['eval_seconds']:.1f} s of {s['eval_seconds'] + s['train_seconds']:.1f} s ({share:.1%})")
        results.append(row)
    emit({"machine": machine(), "epochs": args.epochs, "model": args.model, "threads": args.threads,
          "results": results, "peak_rss_mib": peak_rss_mib()})


if __name__ == "__main__":
    run_main(main)
