"""OpenMP's wait policy, quiet and under load: which default holds when another process is busy.

    python benchmarks/wait_policy.py --data wikipedia --reps 3

Each setting trains TGN for one epoch (``tgdist train``, a fresh
process each, so the OpenMP runtime reads its environment anew) on a quiet machine, then with
another process spinning on one core (``loaded``: a Python busy loop, as a second user's job
would be). Settings, as the variables libgomp (torch's and numba's OpenMP) reads:
- ``ACTIVE``: threads spin between parallel regions without end;
- ``PASSIVE``: they sleep at once;
- ``spin=N``: ``GOMP_SPINCOUNT=N``, spin N iterations, then sleep (libgomp's own default, with
  neither variable set, is 300,000: ``spin=300000``);
- ``tgdist``: neither variable set, so what tgdist sets by default applies.
Runs are interleaved (each repetition runs every setting once, in rotated order). The figure is
the summary's ``train_events_per_s`` (kernel compiling left out); each setting's median is
compared with the best median of its condition. Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import at_least, emit, machine, note, run_main

SETTINGS = {"ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
            **{f"spin={n}": {"GOMP_SPINCOUNT": str(n)} for n in (300000, 30000, 3000, 1000, 300)}, "tgdist": {}}
CONTROLS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "TGDIST_WAIT_POLICY")


def train(setting: str, args, run_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CONTROLS}
    env.update(SETTINGS[setting])
    cmd = [sys.executable, "-m", "tgdist", "train", f"data={args.data}", "train.epochs=1", "train.progress=false",
           f"run_dir={run_dir}", *([f"data.max_events={args.max_events}"] if args.max_events else []), *args.overrides]
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(f"{setting}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    return {"events_per_s": summary["train_events_per_s"], "train_seconds": summary["train_seconds"], "wall_s": wall}


def busy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="collegemsg", help="data= group (configs/data)")
    ap.add_argument("--max-events", type=at_least(0), default=0, help="the first N events (0: all)")
    ap.add_argument("--reps", type=at_least(1), default=2, help="repetitions of every setting per condition")
    ap.add_argument("--loaded-reps", type=at_least(1), default=None, help="repetitions under load (default: --reps)")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--conditions", nargs="+", default=["quiet", "loaded"], choices=["quiet", "loaded"])
    ap.add_argument("--timeout", type=at_least(1), default=900, help="seconds per run")
    ap.add_argument("overrides", nargs="*", help="more tgdist train overrides")
    args = ap.parse_args()
    out = {"machine": machine(), "data": args.data, "max_events": args.max_events, "reps": args.reps, "conditions": {}}
    with tempfile.TemporaryDirectory(prefix="tgdist-wait-policy-") as tmp:
        for cond in args.conditions:
            load = busy() if cond == "loaded" else None
            try:
                runs = {s: [] for s in args.settings}
                reps = args.loaded_reps if cond == "loaded" and args.loaded_reps else args.reps
                for rep in range(reps):
                    order = args.settings[rep % len(args.settings):] + args.settings[:rep % len(args.settings)]
                    for s in order:
                        got = train(s, args, os.path.join(tmp, f"{cond}-{rep}-{s.replace('=', '')}"))
                        runs[s].append(got)
                        note(f"{cond} rep {rep} {s}: {got['events_per_s']:,.0f} events/s, {got['wall_s']:.1f} s")
            finally:
                if load is not None:
                    load.kill()
                    load.wait()
            medians = {s: statistics.median(r["events_per_s"] for r in v) for s, v in runs.items()}
            best = max(medians.values())
            out["conditions"][cond] = {
                "runs": runs, "median_events_per_s": medians,
                "slowdown_vs_best": {s: best / m for s, m in medians.items()}}
    emit(out)


if __name__ == "__main__":
    run_main(main)
