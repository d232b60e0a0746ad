"""DistTGL layouts on one machine: training events/s and test AP after the same traversed events.

    python benchmarks/parallel.py --data collegemsg --layouts 1,1,1 2,1,1 1,1,2 1,2,1 --epochs 2

Each layout is a real `torchrun ... -m tgdist.train` launch (gloo on CPU, 1 torch thread per
process, so a 2-process layout uses both cores of a 2-core machine where 1x1x1 uses one). Every
layout traverses `epochs` times the training events. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import at_least, emit, free_port, machine, note, run_main

from tgdist.errors import RunFailure
from tgdist.runtime.build import compose, precheck



def layout_arg(text: str) -> str:
    """``I,J,K``: three positive trainer counts (mini-batch, epoch, memory parallelism)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not I,J,K with three positive integers, e.g. 2,1,1")
    return ",".join(str(int(x)) for x in parts)


def overrides(layout: str, args, run_dir: str) -> list[str]:
    i, j, k = (int(x) for x in layout.split(","))
    return [f"data={args.data}", f"parallel.i={i}", f"parallel.j={j}", f"parallel.k={k}", f"train.epochs={args.epochs}",
            f"train.batch_size={args.batch}", f"train.num_neg_eval={args.num_neg_eval}", "train.num_threads=1",
            "sampler.num_threads=1", "train.progress=false", f"train.lr_scaling={args.lr_scaling}",
            f"run_dir={run_dir}", *args.overrides]


def launch(layout: str, args) -> dict:
    """One ``tgdist launch`` (torchrun underneath; a rank's failure ends in one line naming it)."""
    i, j, k = (int(x) for x in layout.split(","))
    n = i * j * k
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "tgdist", "launch", "--nproc", str(n), "--master-port", str(free_port()), "--",
               *overrides(layout, args, f"{d}/run")]
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - start
        if r.returncode:
            lines = [ln for ln in r.stderr.strip().splitlines() if ": error:" in ln or ln.startswith("tgdist launch:")]
            raise RunFailure(f"layout {layout} failed (exit {r.returncode}): " + " | ".join(lines[-3:]))
        s = json.loads(r.stdout.strip().splitlines()[-1])
    return {"layout": layout, "processes": n, "wall_seconds": wall, "train_events_per_s": s["train_events_per_s"],
            "traversed_events": s["traversed_events"], "loss": s["loss"], "test_ap": s["test_ap"],
            "test_mrr": s.get("test_mrr"), "val_ap": s["val_ap"], "memory_backend": s.get("memory_backend", "local")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="collegemsg", help="a data= group (configs/data)")
    ap.add_argument("--layouts", nargs="+", type=layout_arg, default=["1,1,1", "2,1,1", "1,1,2", "1,2,1"],
                    help="I,J,K per run (default: 1,1,1 2,1,1 1,1,2 1,2,1)")
    ap.add_argument("--epochs", type=at_least(1), default=2, help="train.epochs (a multiple of J x K of each layout)")
    ap.add_argument("--batch", type=at_least(1), default=200, help="train.batch_size per trainer")
    ap.add_argument("--num-neg-eval", type=at_least(1), default=49, help="MRR negatives")
    ap.add_argument("--lr-scaling", default="linear", help="train.lr_scaling: linear, sqrt or none")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()
    for layout in args.layouts:  # every layout's settings and data, before the first launch
        precheck(compose(overrides(layout, args, "run")))
    rows = []
    for layout in args.layouts:
        note(f"{args.data} {layout}")
        rows.append(launch(layout, args))
        note(f"  {rows[-1]}")
    base = rows[0]
    for r in rows:
        r["speedup_vs_first"] = r["train_events_per_s"] / base["train_events_per_s"]
        r["test_ap_minus_first"] = r["test_ap"] - base["test_ap"]
    emit({"machine": machine(), "data": args.data, "epochs": args.epochs, "batch": args.batch, "runs": rows})


if __name__ == "__main__":
    run_main(main)
