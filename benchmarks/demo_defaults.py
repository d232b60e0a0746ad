"""The demo's defaults: which training settings make `make train`'s validation curve rise on CollegeMsg.

    python benchmarks/demo_defaults.py --seeds 0 1 2 --epochs 8 --report-epochs 3 5 8 \\
        --settings default "lr=3e-5:train.lr=3e-5" "dropout=0.3:model.dropout=0.3" ...

Each setting is ``NAME`` or ``NAME:OVERRIDE,OVERRIDE...`` (Hydra overrides on top of the default
job, ``default`` meaning none). One run per (setting, seed), in this process, of ``--epochs``
epochs, validated and tested (against one negative, as validation is) after every epoch
(``train.test_every_epoch``); the final test is the default's: the best validated epoch, complete.
Since the learning rate is constant and nothing depends on the number of epochs, the first E
epochs of a run are the run of E epochs, so each run also gives what a shorter default would have
selected (``--report-epochs``): the epoch of highest val AP among the first E and its test AP.

Prints one JSON line per run (progress on stderr), then one JSON object: per setting and E, the
mean over seeds of val AP per epoch, how many epochs after the first rose on that mean curve, the
epoch the mean curve peaks at, each seed's selected epoch, and the mean and sd of the selected
epoch's test AP; and, paired by seed, each one's selected test AP minus the first setting's at
``--baseline-epochs`` (the library default, 5, where reported).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import at_least, emit, machine, note, peak_rss_mib, run_main

from tgdist.runtime.build import compose, precheck
from tgdist.runtime.run import Run


def parse_setting(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition(":")
    return name, [o for o in rest.split(",") if o] if rest else []


def one_run(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        Run(compose(overrides + [f"run_dir={d}"]), d).train()
        wall = time.perf_counter() - t0
        lines = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(d) / "summary.json").read_text())
    epochs = [h for h in lines if h["epoch"] >= 0 and not h.get("final")]
    return {"epochs": [{"epoch": h["epoch"], "loss": h["loss"], "val_ap": h.get("val_ap"),
                        "test_ap": h.get("test_ap")} for h in epochs],
            "selected_epoch": summary["selected_epoch"], "final_test_ap": summary["test_ap"],
            "final_test_mrr": summary.get("test_mrr"),
            "train_seconds": sum(h["train_seconds"] for h in epochs), "wall_seconds": wall}


def truncated(run: dict, n: int) -> tuple[int, float]:
    """The epoch best_val selects in the first ``n`` epochs, and its test AP (against one negative)."""
    first = run["epochs"][:n]
    best = max(first, key=lambda h: h["val_ap"])
    return best["epoch"], best["test_ap"]


def summarize(runs: list[dict], n: int) -> dict:
    curves = [[h["val_ap"] for h in r["epochs"][:n]] for r in runs]
    mean = [statistics.fmean(c[e] for c in curves) for e in range(n)]
    picks = [truncated(r, n) for r in runs]
    tests = [t for _, t in picks]
    losses = [statistics.fmean(r["epochs"][e]["loss"] for r in runs) for e in range(n)]
    return {"epochs": n, "mean_val_ap": [round(v, 4) for v in mean],
            "rises_after_first": sum(mean[e] > mean[e - 1] for e in range(1, n)),
            "mean_curve_best_epoch": max(range(n), key=mean.__getitem__),
            "last_minus_first_val_ap": round(mean[-1] - mean[0], 4),
            "selected_epochs": [e for e, _ in picks],
            "mean_test_ap": round(statistics.fmean(tests), 4),
            "sd_test_ap": round(statistics.stdev(tests), 4) if len(tests) > 1 else None,
            "test_aps": [round(t, 4) for t in tests], "mean_loss": [round(v, 4) for v in losses],
            "mean_wall_seconds_full_run": round(statistics.fmean(r["wall_seconds"] for r in runs), 1)}


def paired(tests: list[float], base: list[float]) -> dict:
    diffs = [t - b for t, b in zip(tests, base)]
    return {"mean": round(statistics.fmean(diffs), 4),
            "sd": round(statistics.stdev(diffs), 4) if len(diffs) > 1 else None,
            "per_seed": [round(d, 4) for d in diffs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", nargs="+", default=["default"],
                    help="NAME or NAME:OVERRIDE,OVERRIDE... on top of the default job")
    ap.add_argument("--seeds", type=at_least(0), nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=at_least(1), default=8, help="epochs of each run")
    ap.add_argument("--report-epochs", type=at_least(1), nargs="+", default=None,
                    help="also summarize the first E epochs of each run, as a run of E epochs (default: --epochs)")
    ap.add_argument("--baseline-epochs", type=at_least(1), default=None,
                    help="E of the first setting that the others are compared with (default: 5 if reported, else the last)")
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch and numba threads")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides added to every run (e.g. data.max_events=5000)")
    args = ap.parse_args()
    report = sorted(set(args.report_epochs or [args.epochs]))
    if report[-1] > args.epochs:
        ap.error(f"--report-epochs {report[-1]} is more than --epochs {args.epochs}")
    baseline_epochs = args.baseline_epochs or (5 if 5 in report else report[-1])
    if baseline_epochs not in report:
        ap.error(f"--baseline-epochs {baseline_epochs} is not one of --report-epochs {report}")
    settings = dict(parse_setting(s) for s in args.settings)
    base = [f"train.epochs={args.epochs}", f"train.num_threads={args.threads}", f"sampler.num_threads={args.threads}",
            "train.progress=false", "train.test_every_epoch=true", "train.select=best_val", "train.eval_every=1",
            "train.patience=0", *args.extra]
    jobs = []
    for name, overrides in settings.items():
        for seed in args.seeds:
            job = base + overrides + [f"train.seed={seed}"]
            precheck(compose(job))  # every setting, before the first run trains
            jobs.append((name, seed, job))
    results = {name: [] for name in settings}
    for name, seed, job in jobs:
        note(f"{name} / seed {seed}")
        run = one_run(job)
        run.update(setting=name, overrides=settings[name], seed=seed)
        print(json.dumps(run), flush=True)
        results[name].append(run)
    summary = {name: {str(n): summarize(runs, n) for n in report} for name, runs in results.items()}
    first = next(iter(summary))
    base = summary[first][str(baseline_epochs)]["test_aps"]
    for entries in summary.values():
        for entry in entries.values():
            entry["test_ap_minus_baseline"] = paired(entry["test_aps"], base)
    emit({"machine": machine(), "epochs": args.epochs, "seeds": args.seeds, "threads": args.threads,
          "extra": args.extra, "baseline": f"{first}, {baseline_epochs} epochs", "summary": summary,
          "peak_rss_mib": peak_rss_mib()})


if __name__ == "__main__":
    run_main(main)
