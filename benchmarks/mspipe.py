"""MSPipe (issue 26): training speed and test AP at staleness 0, 1, 2, 4 and auto, one process.

    python benchmarks/mspipe.py                                  # Wikipedia, TGN, first 30,000 events
    python benchmarks/mspipe.py --events 0 --epochs 3 --repeats 2

Each configuration is one run as ``tgdist train`` makes it (``tgdist.train.train``), one after the
other in this process after a short warm-up run (imports, numba compiles): ``pipeline.mode=none``
with ``pipeline.prefetch=2`` (the baseline: the same sampling thread, no staleness), then
``pipeline.mode=mspipe`` at each staleness K, also with ``prefetch=2``. Training events/s is the
summary's (kernel compiling left out, evaluation apart); test AP is after the last epoch, in the
same run. ``auto`` reports the K it chose and the stage times it measured.
Prints one JSON object on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from common import at_least, emit, machine, note, run_main

POINTS = {"none": ["pipeline.mode=none"], "K=0": ["pipeline.mode=mspipe", "pipeline.staleness=0"],
          "K=1": ["pipeline.mode=mspipe", "pipeline.staleness=1"],
          "K=2": ["pipeline.mode=mspipe", "pipeline.staleness=2"],
          "K=4": ["pipeline.mode=mspipe", "pipeline.staleness=4"],
          "auto": ["pipeline.mode=mspipe", "pipeline.staleness=auto"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="wikipedia", choices=("wikipedia", "collegemsg", "enron"))
    ap.add_argument("--model", default="tgn", choices=("tgn", "jodie", "apan"))
    ap.add_argument("--events", type=at_least(0), default=30_000, help="data.max_events (0: all)")
    ap.add_argument("--epochs", type=at_least(1), default=2)
    ap.add_argument("--batch-size", type=at_least(1), default=600, help="the paper's batch size")
    ap.add_argument("--repeats", type=at_least(1), default=1, help="rounds over every configuration")
    ap.add_argument("--points", nargs="+", choices=list(POINTS), default=list(POINTS))
    args = ap.parse_args()
    from tgdist.train import train

    base = [f"data={args.data}", f"model={args.model}", f"train.batch_size={args.batch_size}", "train.progress=false",
            "train.num_neg_eval=1", "pipeline.prefetch=2", "train.test_every_epoch=false"]
    if args.events:
        base.append(f"data.max_events={args.events}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tgdist-mspipe-bench-") as d:
        note("warm-up run (imports, kernel compiles)")
        train([*base, "train.epochs=1", "train.stop_after_batches=3"], f"{d}/warm")
        rows = []
        for rep in range(args.repeats):
            for name in args.points:
                s = train([*base, f"train.epochs={args.epochs}", *POINTS[name]], f"{d}/{name}-{rep}")
                p = s["pipeline"]
                rows.append({"config": name, "repeat": rep, "staleness": p.get("staleness"),
                             "train_events_per_s": s["train_events_per_s"], "test_ap": s["test_ap"],
                             "val_ap": s["val_ap"], "bounds": p.get("bounds")})
                note(f"  {name:<5} K={p.get('staleness')}: {s['train_events_per_s']:,.0f} events/s, "
                     f"test AP {s['test_ap']:.4f}")
    emit({"benchmark": "mspipe", "machine": machine(),
          "setup": f"one process, {args.model}, {args.data}, max_events {args.events or 'all'}, batch "
                   f"{args.batch_size}, {args.epochs} epochs, prefetch=2 in every configuration",
          "runs": rows, "seconds": round(time.perf_counter() - started, 1)})
    return 0


if __name__ == "__main__":
    run_main(main)
