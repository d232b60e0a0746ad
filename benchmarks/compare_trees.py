"""Training speed of two checkouts of tgdist, in the same run: a change's before and after.

    git worktree add /tmp/before COMMIT
    python benchmarks/compare_trees.py --before /tmp/before --after . --data collegemsg wikipedia --reps 3

For each data set, ``tgdist train data=NAME train.epochs=1`` (plus the given overrides) runs from
each tree in turn (``PYTHONPATH`` set to the tree, a fresh process each, before and after
alternating, so drift in the machine's speed falls on both alike). The figures are the summary's
``train_events_per_s`` (kernel compiling left out) and the training events per CPU-second
(``train_cpu_seconds``: the time the process ran, which another program taking a core away does not
lengthen, as it lengthens the wall-clock time); the ratio after / before is taken pair by pair and
its median reported. ``--eval`` also reports each run's evaluation seconds (the summary's
``eval_seconds``: the validation and the final test against ``train.num_neg_eval`` negatives) and
the speed ratio before / after of those seconds. Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import DATASETS, at_least, emit, machine, note, run_main


def train(tree: Path, data: str, overrides: list[str], run_dir: str, timeout: float) -> tuple[float, float, float]:
    """Training events per second and per CPU-second of one run, and its evaluation seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree), "TGDIST_DATASETS": str(DATASETS)}
    cmd = [sys.executable, "-m", "tgdist", "train", f"data={data}", "train.epochs=1", "train.progress=false",
           f"run_dir={run_dir}", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=tree)
    if r.returncode != 0:
        raise RuntimeError(f"{tree}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    rate = float(summary["train_events_per_s"])
    return (rate, rate * float(summary["train_seconds"]) / float(summary["train_cpu_seconds"]),
            float(summary.get("eval_seconds") or "nan"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    ap.add_argument("--after", type=Path, default=Path("."), help="the checkout after it (default: here)")
    ap.add_argument("--data", nargs="+", default=["collegemsg", "wikipedia"], help="data= groups")
    ap.add_argument("--reps", type=at_least(1), default=3, help="pairs of runs per data set")
    ap.add_argument("--timeout", type=at_least(1), default=900, help="seconds per run")
    ap.add_argument("--eval", action="store_true", help="also compare the runs' evaluation seconds")
    ap.add_argument("overrides", nargs="*", help="more tgdist train overrides")
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, tree in trees.items():
        if not (tree / "tgdist" / "__init__.py").exists():
            ap.error(f"--{name} {tree}: not a tgdist checkout")
    out = {"machine": machine(), "trees": {k: str(v) for k, v in trees.items()}, "overrides": args.overrides,
           "data": {}}
    with tempfile.TemporaryDirectory(prefix="tgdist-compare-") as tmp:
        for data in args.data:
            rates, per_cpu, evals = ({"before": [], "after": []} for _ in range(3))
            for rep in range(args.reps):
                order = ("before", "after") if rep % 2 == 0 else ("after", "before")
                for name in order:
                    rate, cpu_rate, eval_s = train(trees[name], data, args.overrides,
                                                   os.path.join(tmp, f"{data}-{rep}-{name}"), args.timeout)
                    rates[name].append(rate)
                    per_cpu[name].append(cpu_rate)
                    evals[name].append(eval_s)
                    note(f"{data} rep {rep} {name}: {rate:,.0f} events/s, {cpu_rate:,.0f} events/CPU-s, "
                         f"evaluation {eval_s:.2f} s")
            out["data"][data] = {"events_per_s": rates, "events_per_cpu_s": per_cpu,
                                 "median_events_per_s": {k: statistics.median(v) for k, v in rates.items()},
                                 "after_over_before": _ratios(rates),
                                 "after_over_before_per_cpu_s": _ratios(per_cpu)}
            if args.eval:  # seconds: the speed ratio is before / after
                out["data"][data].update({"eval_seconds": evals, "eval_speed_after_over_before": _ratios(
                    {"after": evals["before"], "before": evals["after"]})})
    emit(out)


def _ratios(figures: dict[str, list[float]]) -> dict:
    """after / before pair by pair, with their median, least and greatest."""
    ratios = [a / b for a, b in zip(figures["after"], figures["before"])]
    return {"pairs": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


if __name__ == "__main__":
    run_main(main)
