"""One training epoch of TGN on a large synthetic stream (default 10M events, 1M nodes).

    python benchmarks/synthetic_epoch.py --events 10000000 --nodes 1000000

Reports generation, T-CSR build and epoch times, training events/s, and peak resident memory.
Evaluation uses 1 negative per event (AP), since 49 on 3M events would dominate the run.
"""

from __future__ import annotations

import argparse
import time

from common import at_least, emit, machine, note, peak_rss_mib, run_main

from tgdist.data.synthetic import generate
from tgdist.runtime.build import build_trainer, compose


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=at_least(1), default=10_000_000, help="events in the synthetic stream")
    ap.add_argument("--nodes", type=at_least(2), default=1_000_000, help="nodes in the synthetic stream")
    ap.add_argument("--batch", type=at_least(1), default=600, help="training batch size")
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch and numba threads")
    ap.add_argument("--skip-eval", action="store_true", help="time the training epoch only")
    args = ap.parse_args()
    res = {"machine": machine(), "events": args.events, "nodes": args.nodes, "batch": args.batch}
    t0 = time.perf_counter()
    graph = generate(num_events=args.events, num_nodes=args.nodes, seed=0)
    res["generate_seconds"] = time.perf_counter() - t0
    note(f"generated {graph.describe()} in {res['generate_seconds']:.1f}s")
    cfg = compose([f"train.batch_size={args.batch}", "train.num_neg_eval=1", f"train.num_threads={args.threads}",
                   f"sampler.num_threads={args.threads}", "train.progress=true"])
    t0 = time.perf_counter()
    tr = build_trainer(cfg, graph=graph)
    res["build_seconds"] = time.perf_counter() - t0
    res["rss_after_build_mib"] = peak_rss_mib()
    r = tr.train_epoch(0)
    res.update({"train_events": r["train_events"], "train_seconds": r["train_seconds"],
                "train_events_per_s": r["events_per_s"], "compile_seconds": r["compile_seconds"],
                "stage_seconds": dict(tr.timer.seconds)})
    if not args.skip_eval:
        t0 = time.perf_counter()
        res.update(tr.evaluate("val"))
        res["val_seconds"] = time.perf_counter() - t0
    res["peak_rss_mib"] = peak_rss_mib()
    emit(res)


if __name__ == "__main__":
    run_main(main)
