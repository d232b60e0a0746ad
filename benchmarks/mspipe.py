"""MSPipe (issue 26): training speed, test AP and test MRR at staleness 0, 1, 2, 4 and auto, with and
without MSPipe-S, over models, data sets and seeds, one process.

    python benchmarks/mspipe.py                                  # TGN and APAN, Wikipedia and CollegeMsg
    python benchmarks/mspipe.py --events 20000 --epochs 2 --plot benchmarks/mspipe_staleness.png
    python benchmarks/mspipe.py --models tgn --data wikipedia --seeds 0 --points none auto

Each configuration is one run as ``tgdist train`` makes it (``tgdist.train.train``), one after the
other in this process after a short warm-up run per data set and model (imports, numba compiles):
``pipeline.mode=none`` with ``pipeline.prefetch=2`` (the baseline: the same sampling thread, no
staleness), then ``pipeline.mode=mspipe`` at each staleness K, also with ``prefetch=2``, once per
``--mitigation`` (``similarity`` is MSPipe-S; the baseline runs once, without it). Every seed
(``train.seed``) runs every configuration, the configurations of one seed back to back in an order
rotated by the seed's position, so that a change in the machine's load falls on all of them.

Training events/s is the summary's (kernel compiling left out, evaluation apart); test AP and MRR
(against ``--neg-eval`` negatives per event) are those of the last epoch's model (``train.select=
last``), in the same run. Speed is compared inside one seed's round only: each run's events/s over
the baseline's of the same round. Each run also reports ``cores_busy``, its training's CPU time (all
threads) over its wall time, and ``cpu_ms_per_kevent``, CPU time per 1,000 trained events: the
machine's cores over the baseline's ``cores_busy`` bound what any overlap could gain here, since a
pipeline does at least the baseline's CPU work (``cpu_work_ratio_to_baseline``). The point
``K=1@nice0`` is K = 1 with the stage threads at training's priority (``pipeline.stage_nice=0``;
the other MSPipe points use the default, 19). ``auto`` reports the K it chose and its five measured
stage times tau; sum(tau) / max(tau) is the most any overlap of the five stages could speed an
iteration up.
Prints one JSON object on stdout, progress on stderr; ``--plot`` draws test AP against staleness.
``--timeline PATH`` also trains the first data set and model once more at staleness 1, recording
when each stage of each iteration ran and in which thread, and draws a window of iterations (the
five stages overlapping, Algorithm 1); the JSON's ``timeline`` has the window's spans.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from common import at_least, emit, machine, note, require, run_main

POINTS = {"none": ["pipeline.mode=none"], "K=0": ["pipeline.mode=mspipe", "pipeline.staleness=0"],
          "K=1": ["pipeline.mode=mspipe", "pipeline.staleness=1"],
          "K=2": ["pipeline.mode=mspipe", "pipeline.staleness=2"],
          "K=4": ["pipeline.mode=mspipe", "pipeline.staleness=4"],
          "auto": ["pipeline.mode=mspipe", "pipeline.staleness=auto"],
          # the stage threads at training's own priority (before pipeline.stage_nice)
          "K=1@nice0": ["pipeline.mode=mspipe", "pipeline.staleness=1", "pipeline.stage_nice=0"]}
MITIGATIONS = ("none", "similarity")
BASELINE = ("none", "none")  # (config, mitigation)


def configurations(points: list[str], mitigations: list[str]) -> list[tuple[str, str]]:
    """(config, mitigation) pairs: the baseline once, every MSPipe point once per mitigation."""
    return [(p, m) for p in points for m in (("none",) if p == "none" else mitigations)]


def mean_sd(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def bound(tau: list[float] | None) -> float | None:
    """sum(tau) / max(tau): an iteration's time with its five stages in sequence over the longest
    stage, the most any overlap of them could gain."""
    return sum(tau) / max(tau) if tau and max(tau) > 0 else None


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean and sd over seeds per (data, model, config, mitigation); test AP's difference from the
    baseline in points (x 100), per seed then averaged; speed as the ratio to the same round's baseline."""
    base = {(r["data"], r["model"], r["seed"]): r for r in rows if (r["config"], r["mitigation"]) == BASELINE}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["data"], r["model"], r["config"], r["mitigation"]), []).append(r)
    out = []
    for (data, model, config, mitigation), rs in groups.items():
        bs = [base.get((data, model, r["seed"])) for r in rs]
        stat = {"data": data, "model": model, "config": config, "mitigation": mitigation,
                "seeds": [r["seed"] for r in rs], "staleness_used": [r["staleness"] for r in rs]}
        for key in ("train_events_per_s", "test_ap", "test_mrr", "cores_busy", "cpu_ms_per_kevent"):
            stat[key] = dict(zip(("mean", "sd"), mean_sd([r[key] for r in rs])))
        stat["delta_test_ap_points"] = dict(zip(("mean", "sd"), mean_sd(
            [100 * (r["test_ap"] - b["test_ap"]) if b else None for r, b in zip(rs, bs)])))
        stat["delta_test_mrr_points"] = dict(zip(("mean", "sd"), mean_sd(
            [100 * (r["test_mrr"] - b["test_mrr"]) if b and r["test_mrr"] is not None else None
             for r, b in zip(rs, bs)])))
        stat["speed_ratio_to_baseline"] = dict(zip(("mean", "sd"), mean_sd(
            [r["train_events_per_s"] / b["train_events_per_s"] if b else None for r, b in zip(rs, bs)])))
        stat["cpu_work_ratio_to_baseline"] = dict(zip(("mean", "sd"), mean_sd(
            [r["cpu_ms_per_kevent"] / b["cpu_ms_per_kevent"] if b and r["cpu_ms_per_kevent"] else None
             for r, b in zip(rs, bs)])))
        bounds = [bound((r["bounds"] or {}).get("tau")) for r in rs]
        if any(b is not None for b in bounds):
            stat["stage_bound_sum_over_max_tau"] = dict(zip(("mean", "sd"), mean_sd(bounds)))
            stat["stage_bound_per_seed"] = bounds
        out.append(stat)
    return out


def plot(stats: list[dict], path: str) -> None:
    """Test AP against staleness K, one panel per (data, model); error bars are the sd over seeds;
    auto is drawn at the mean K it chose; the baseline is a dotted line with its band. The two
    mitigations are shifted apart a little along K so that equal values do not hide each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((s["data"], s["model"]) for s in stats))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (data, model) in zip(axes[0], panels):
        mine = [s for s in stats if (s["data"], s["model"]) == (data, model)]
        for s in mine:
            if (s["config"], s["mitigation"]) == BASELINE:
                m, sd = s["test_ap"]["mean"], s["test_ap"]["sd"] or 0.0
                ax.axhline(m, color="grey", ls=":", label="plain loop")
                ax.axhspan(m - sd, m + sd, color="grey", alpha=0.15)
        for mitigation, color, dx in zip(MITIGATIONS, ("C0", "C3"), (-0.06, 0.06)):  # dx: equal points stay visible
            fixed = sorted((int(s["config"][2:]), s) for s in mine
                           if s["config"].startswith("K=") and s["mitigation"] == mitigation)
            label = "MSPipe-S" if mitigation == "similarity" else "MSPipe"
            if fixed:
                ax.errorbar([k + dx for k, _ in fixed], [s["test_ap"]["mean"] for _, s in fixed],
                            yerr=[s["test_ap"]["sd"] or 0.0 for _, s in fixed], color=color, marker="o",
                            capsize=3, label=label)
            for s in mine:
                if s["config"] == "auto" and s["mitigation"] == mitigation:
                    ks = [k for k in s["staleness_used"] if k is not None]
                    ax.errorbar([statistics.fmean(ks) + dx], [s["test_ap"]["mean"]], yerr=[s["test_ap"]["sd"] or 0.0],
                                color=color, marker="*", ms=12, capsize=3, ls="none", label=f"{label} auto")
        ax.set_title(f"{model.upper()}, {data}")
        ax.set_xlabel("staleness K (iterations)")
        ax.set_xticks([0, 1, 2, 4])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test AP (mean ± sd over seeds)")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


TIMELINE_WINDOW = (8, 14)  # iterations drawn by --timeline (the first ones compile kernels)
STAGE_COLORS = {"sample": "#8fbc8f", "features": "#2e8b57", "memory_read": "#4682b4", "train": "#f4a460",
                "memory_write": "#cd5c5c"}


def timeline(base: list[str], epochs: int, run_dir: str) -> dict:
    """One run at staleness 1 with every stage's turns recorded (``MSPipe.stage_spans``) and each
    training step timed: the spans of the iterations in ``TIMELINE_WINDOW``."""
    from tgdist.runtime.build import build_trainer, compose
    from tgdist.runtime.run import Run

    cfg = compose([*base, f"train.epochs={epochs}", "pipeline.mode=mspipe", "pipeline.staleness=1",
                   "pipeline.prefetch=0", f"run_dir={run_dir}"])
    tr = build_trainer(cfg, progress=False)
    steps: list = []
    compute = tr.compute

    def timed(*a, **k):
        began = time.perf_counter()
        try:
            return compute(*a, **k)
        finally:
            steps.append((began, time.perf_counter()))

    tr.compute = timed
    run = Run(cfg, run_dir, trainer=tr)
    run.pipeline.stage_spans = spans = []
    run.train()
    lo, hi = TIMELINE_WINDOW
    out = [(st, it, th, a, b) for st, it, th, a, b in spans if lo <= it < hi]
    out += [("train", it, "MainThread", a, b) for it, (a, b) in enumerate(steps[:run.batches_per_epoch])
            if lo <= it < hi]  # (evaluation's steps follow the epoch's)
    t0 = min(a for *_, a, _ in out)
    return {"window": list(TIMELINE_WINDOW), "staleness": 1,
            "spans": [[st, it, th, round(a - t0, 6), round(b - t0, 6)]
                      for st, it, th, a, b in sorted(out, key=lambda x: x[3])]}


def draw_timeline(tl: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = {"MainThread": 0}
    for _, _, th, _, _ in tl["spans"]:
        lanes.setdefault(th, len(lanes))
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(lanes) + 1.4))
    for stage, it, th, a, b in tl["spans"]:
        ax.broken_barh([(a, b - a)], (lanes[th] - 0.4, 0.8), color=STAGE_COLORS[stage], edgecolor="white", lw=0.3)
        if b - a > 0.004:
            ax.text((a + b) / 2, lanes[th], str(it), ha="center", va="center", fontsize=6)
    names = {th: ("main thread (train)" if th == "MainThread" else th.replace("tgdist-mspipe-", "")) for th in lanes}
    ax.set_yticks(list(lanes.values()), [names[th] for th in lanes], fontsize=7)
    ax.set_xlabel("seconds (numbers: iteration)")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STAGE_COLORS.values()]
    ax.legend(handles, list(STAGE_COLORS), loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", default=["wikipedia", "collegemsg"], choices=("wikipedia", "collegemsg", "enron"))
    ap.add_argument("--models", nargs="+", default=["tgn", "apan"], choices=("tgn", "jodie", "apan"))
    ap.add_argument("--seeds", nargs="*", type=at_least(0), default=[0, 1, 2],
                    help="train.seed values (none: no grid, only --timeline)")
    ap.add_argument("--events", type=at_least(0), default=30_000, help="data.max_events (0: all)")
    ap.add_argument("--epochs", type=at_least(1), default=2)
    ap.add_argument("--batch-size", type=at_least(1), default=600, help="the paper's batch size")
    ap.add_argument("--neg-eval", type=at_least(1), default=9,
                    help="train.num_neg_eval: negatives per test event (MRR over this many + 1)")
    ap.add_argument("--points", nargs="+", choices=list(POINTS), default=list(POINTS))
    ap.add_argument("--mitigation", nargs="+", choices=MITIGATIONS, default=list(MITIGATIONS),
                    help="pipeline.mitigation at each MSPipe point (similarity: MSPipe-S)")
    ap.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run (e.g. train.num_threads=1)")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG of test AP against staleness")
    ap.add_argument("--timeline", metavar="PATH", help="also draw when each stage of a window of iterations ran")
    args = ap.parse_args()
    if not args.seeds and not args.timeline:
        ap.error("--seeds: give at least one seed (or --timeline alone)")
    if "none" not in args.points:
        ap.error("--points: the baseline 'none' is needed (deltas and speed ratios are taken against it)")
    if args.plot or args.timeline:
        require("matplotlib")
    from tgdist.train import train

    configs = configurations(args.points, args.mitigation)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tgdist-mspipe-bench-") as d:
        for data in args.data:
            for model in args.models:
                base = [f"data={data}", f"model={model}", f"train.batch_size={args.batch_size}",
                        "train.progress=false", f"train.num_neg_eval={args.neg_eval}", "pipeline.prefetch=2",
                        "train.test_every_epoch=false", "train.select=last", *args.overrides]
                if args.events:
                    base.append(f"data.max_events={args.events}")
                if not args.seeds:
                    continue
                note(f"{data} {model}: warm-up run (imports, kernel compiles)")
                train([*base, "train.epochs=1", "train.stop_after_batches=3"], f"{d}/warm-{data}-{model}")
                for i, seed in enumerate(args.seeds):
                    shift = i % len(configs)
                    for config, mitigation in configs[shift:] + configs[:shift]:
                        s = train([*base, f"train.epochs={args.epochs}", f"train.seed={seed}", *POINTS[config],
                                   *([f"pipeline.mitigation={mitigation}"] if config != "none" else [])],
                                  f"{d}/{data}-{model}-{seed}-{config}-{mitigation}")
                        p = s["pipeline"]
                        cpu, wall = s.get("train_cpu_seconds"), s.get("train_seconds")
                        rows.append({"data": data, "model": model, "seed": seed, "config": config,
                                     "mitigation": mitigation, "staleness": p.get("staleness"),
                                     "train_events_per_s": s["train_events_per_s"], "test_ap": s["test_ap"],
                                     "test_mrr": s.get("test_mrr"), "val_ap": s["val_ap"],
                                     "cores_busy": cpu / wall if cpu and wall else None,
                                     "cpu_ms_per_kevent": 1e6 * cpu / s["traversed_events"] if cpu else None,
                                     "bounds": p.get("bounds"), "mitigation_counts": p.get("mitigation")})
                        tau = (p.get("bounds") or {}).get("tau")
                        note(f"  {data} {model} seed {seed} {config:<5} {mitigation:<10} K={p.get('staleness')}: "
                             f"{s['train_events_per_s']:,.0f} events/s, test AP {s['test_ap']:.4f}, "
                             f"MRR {s.get('test_mrr', float('nan')):.4f}, "
                             f"{(cpu or 0) / max(wall or 0, 1e-9):.2f} cores busy"
                             + (f", sum/max tau {bound(tau):.2f}" if tau else "")
                             + (f", rows mitigated {p['mitigation']['rows_mitigated']}" if p.get("mitigation") else ""))
        tl = None
        if args.timeline:
            data, model = args.data[0], args.models[0]
            base = [f"data={data}", f"model={model}", f"train.batch_size={args.batch_size}", "train.progress=false",
                    f"train.num_neg_eval={args.neg_eval}", "train.test_every_epoch=false",
                    *([f"data.max_events={args.events}"] if args.events else [])]
            note(f"timeline: {data} {model}, staleness 1, iterations {TIMELINE_WINDOW[0]}-{TIMELINE_WINDOW[1] - 1}")
            tl = timeline(base, 1, f"{d}/timeline")
            draw_timeline(tl, f"MSPipe stages, {model} on {data}, staleness 1: iterations "
                              f"{TIMELINE_WINDOW[0]}-{TIMELINE_WINDOW[1] - 1}", args.timeline)
            note(f"timeline: {args.timeline}")
    stats = aggregate(rows) if rows else []
    if args.plot:
        plot(stats, args.plot)
        note(f"plot: {args.plot}")
    emit({"benchmark": "mspipe", "machine": machine(),
          "setup": f"one process, models {args.models}, data {args.data}, seeds {args.seeds}, max_events "
                   f"{args.events or 'all'}, batch {args.batch_size}, {args.epochs} epochs, train.select=last, "
                   f"{args.neg_eval} test negatives, prefetch=2 in every configuration, overrides "
                   f"{args.overrides}", "cores": len(os.sched_getaffinity(0)),
          "summary": stats, "runs": rows, "timeline": tl, "seconds": round(time.perf_counter() - started, 1)})
    return 0


if __name__ == "__main__":
    run_main(main)
