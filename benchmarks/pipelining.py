"""Sven's hierarchical pipelining (issue 25): epoch time and accuracy of each level on the sven backend.

    python benchmarks/pipelining.py                          # both sections, both data sets, M = 2 and 4
    python benchmarks/pipelining.py --sections speed --data collegemsg --trainers 2 --timeline timeline.png

Every number is a real parallel run: one ``torchrun`` per (data, M) (gloo on CPU, one torch thread
per rank), this script as each rank (``--worker``), where the configurations are trained one after
the other in the same processes, each a ``tgdist.runtime.run.Run`` with ``memory.backend=sven``,
mini-batch parallelism M x 1 x 1, after a short warm-up run (imports, numba compiles).

- ``speed``: the cumulative ladder no pipelining, + prefetch (``pipeline.prefetch=2``),
  + micro-batches (``pipeline.micro_batches=auto``), + asynchronous all-reduce, under each
  simulated link (``parallel.link``: a model of a network, the alpha-beta cost of each collective,
  not a measurement of one). Epoch time is the slowest rank's training loop (evaluation apart).
  Besides the presets ``eth10`` and ``ib100`` the ladder runs on a link 100x slower than ``eth10``
  (``100mbps:50us``): these CPU ranks compute about 100x slower than a GPU, so that link keeps
  communication about as large as computation, the regime Sven's pipelining is for.
- ``accuracy``: at equal traversed events (same epochs), test AP of no pipelining, each level alone
  (micro-batches at a fixed n = 4, since without a link ``auto`` measures no dispatch to hide and
  keeps one) and all three together; no link (accuracy does not depend on it). ``--configs`` picks
  the levels (none, the reference, always runs), ``--seeds`` / ``--seed-start`` the seeds. Against
  none, the differences are paired by seed: their mean, standard error, 95% t interval and a verdict
  against the goal of +-0.5 point (within: the interval inside; outside: wholly beyond; else
  undecided). Seeds run in batches are put together with ``--merge OUT1.json OUT2.json ...``.

- ``single``: one process (``tgdist.train.train``, as ``tgdist train`` runs it), Wikipedia, TGN,
  ``pipeline.prefetch=0`` and ``2`` alternating (``--repeats`` pairs, one epoch each): training events/s
  from each run's summary (one-time kernel compiling left out).

``--timeline PNG`` draws a few iterations of rank 0 without and with all three levels on the slow
link: the main thread's stages, the prefetch thread's sampling and the transfers on the link.
Prints one JSON object on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from common import at_least, emit, machine, note, rank_records, run_main, torchrun_ranks

SECTIONS = ("speed", "accuracy", "single")
SLOW_LINK = "100mbps:50us"
LADDER = {"none": [], "+prefetch": ["pipeline.prefetch=2"],
          "+micro-batches": ["pipeline.prefetch=2", "pipeline.micro_batches=auto"],
          "+async all-reduce": ["pipeline.prefetch=2", "pipeline.micro_batches=auto", "pipeline.async_allreduce=true"]}
ALONE = {"none": [], "prefetch": ["pipeline.prefetch=2"], "micro-batches (n=4)": ["pipeline.micro_batches=4"],
         "async all-reduce": ["pipeline.async_allreduce=true"],
         "all three": ["pipeline.prefetch=2", "pipeline.micro_batches=4", "pipeline.async_allreduce=true"]}
# --configs names of the accuracy section's configurations (none, the reference, always runs)
CONFIGS = {"none": "none", "prefetch": "prefetch", "micro_batches": "micro-batches (n=4)",
           "async_allreduce": "async all-reduce", "all": "all three"}
GOAL_POINTS = 0.5  # issue 25, point 4: test AP within 0.5 point of no pipelining
# Student's t, 97.5% quantile, by degrees of freedom (beyond 30: the Cornish-Fisher expansion in t_975)
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
TIMELINE_WINDOW = (8, 11)  # iterations drawn: after auto's 6 profiled ones (pipeline.profile_iterations)


# ------------------------------------------------------------------------------------------------
# One rank (under torchrun)


def one_run(spec: list[str], base: list[str], groups, rank: int, trace: bool) -> dict:
    import shutil

    from tgdist.distributed import collectives
    from tgdist.runtime.build import build_trainer, compose
    from tgdist.runtime.run import Run

    cfg = compose([*base, *spec])
    run_dir = tempfile.mkdtemp(prefix="tgdist-pipebench-") if rank == 0 else None
    driver = Run(cfg, run_dir, trainer=build_trainer(cfg, progress=False), groups=groups)
    tr, store = driver.trainer, driver.trainer.memory
    rec = {"spec": spec, "iterations": 0}
    stamps, spans, link_spans = [], [], []
    if trace:
        tr.timer.spans = spans
        collectives.trace_link(link_spans)
    end_training = store.end_training

    def ended(evaluates):  # the training loop is over; evaluation (rank 0) is not timed
        rec["train_seconds"] = time.perf_counter() - rec.pop("_start")
        rec["stage_seconds"] = {k: round(v, 4) for k, v in tr.timer.seconds.items()}
        rec["counters"] = driver.counter.as_dict()
        collectives.trace_link(None)
        end_training(evaluates)

    def tick(t, loss):
        rec["iterations"] += 1
        stamps.append(time.perf_counter())

    store.end_training = ended
    try:
        rec["_start"] = time.perf_counter()
        summary = driver.train(on_iteration=tick)
    finally:
        collectives.trace_link(None)
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
    rec["test_ap"] = summary.get("test_ap")
    rec["pipeline"] = summary.get("pipeline")
    if trace:
        lo, hi = TIMELINE_WINDOW
        t0, t1 = stamps[lo - 1], stamps[hi - 1]
        keep = lambda a, b: b > t0 and a < t1  # noqa: E731
        rec["timeline"] = {"start": t0, "end": t1, "iterations": [s - t0 for s in stamps[lo - 1:hi]],
                           "stages": [(n, th, a - t0, b - t0) for n, th, a, b in spans if keep(a, b)],
                           "link": [(n, a - t0, b - t0) for n, a, b in link_spans if keep(a, b)]}
    return rec


def worker(out: str, specs: list[list[str]], traced: list[bool], base: list[str]) -> None:
    rank_records(out, base, lambda groups, rank: [one_run(spec, base, groups, rank, trace and rank == 0)
                                                  for spec, trace in zip(specs, traced)])


# ------------------------------------------------------------------------------------------------
# The parent


def launch(nproc: int, specs: list[list[str]], traced: list[bool], base: list[str], timeout: float) -> list[list[dict]]:
    """One torchrun of ``nproc`` ranks training ``specs`` in turn; per spec, per rank, its record."""
    ranks = torchrun_ranks(__file__, nproc, base, timeout, plan={"specs": specs, "traced": traced},
                           prefix="tgdist-pipebench-")
    return [[ranks[k][i] for k in range(nproc)] for i in range(len(specs))]


def base_overrides(args, data: str, m: int, epochs: int) -> list[str]:
    out = [f"data={data}", f"model={args.model}", "memory.backend=sven", f"parallel.i={m}", "parallel.j=1",
           "parallel.k=1", f"train.epochs={epochs}", f"train.batch_size={args.global_batch // m}",
           "train.num_threads=1", "sampler.num_threads=1", "train.progress=false", "train.num_neg_eval=1"]
    if args.max_events.get(data):
        out.append(f"data.max_events={args.max_events[data]}")
    return out


def modelled(ranks: list[dict]) -> dict:
    """Modelled link seconds per phase, the slowest rank's."""
    phases: dict[str, float] = {}
    for r in ranks:
        per: dict[str, float] = {}
        for k, v in r["counters"].items():
            per[k.split(".")[0]] = per.get(k.split(".")[0], 0.0) + v.get("modelled_seconds", 0.0)
        for k, v in per.items():
            phases[k] = max(phases.get(k, 0.0), v)
    return {k: round(v, 3) for k, v in phases.items() if v}


def section_speed(args) -> tuple[list[dict], dict]:
    """The ladder under each link, each configuration ``--speed-repeats`` times in rotation (ABCD ABCD)
    within one launch; its epoch time is the least of its repeats (load on a shared machine only
    ever adds time)."""
    rows, timelines = [], {}
    for data in args.data:
        for m in args.trainers:
            specs, names, traced = [["train.stop_after_batches=3"]], [None], [False]  # warm-up
            for rep in range(args.speed_repeats):
                for link in args.links:
                    for name, over in LADDER.items():
                        specs.append([*over, f"parallel.link={link}"])
                        names.append((link, name))
                        traced.append(bool(args.timeline) and rep == 0 and link == SLOW_LINK
                                      and name in ("none", "+async all-reduce")
                                      and data == args.data[0] and m == args.trainers[0])
            note(f"speed: {data} M={m}: {len(specs) - 1} runs")
            runs = launch(m, specs, traced, base_overrides(args, data, m, 1), args.timeout)
            got: dict = {}
            for key, ranks, tr in zip(names[1:], runs[1:], traced[1:]):
                got.setdefault(key, []).append(ranks)
                if tr:
                    timelines[key[1]] = ranks[0]["timeline"]
            for link in args.links:
                base = min(max(r["train_seconds"] for r in ranks) for ranks in got[(link, "none")])
                for name in LADDER:
                    reps = got[(link, name)]
                    secs = [max(r["train_seconds"] for r in ranks) for ranks in reps]
                    ranks = reps[secs.index(min(secs))]
                    sec = min(secs)
                    phases = modelled(ranks)
                    stages = {k: round(max(r["stage_seconds"].get(k, 0.0) for r in ranks), 3)
                              for k in ("sample", "features", "memory_read", "compute", "memory_write")}
                    rows.append({"data": data, "M": m, "link": link, "config": name, "epoch_seconds": round(sec, 3),
                                 "epoch_seconds_repeats": [round(x, 3) for x in secs],
                                 "vs_none": round(sec / base, 3), "test_ap": ranks[0]["test_ap"],
                                 "micro_batches": [(r[0]["pipeline"] or {}).get("micro_batches") for r in reps],
                                 "fit": (ranks[0]["pipeline"] or {}).get("fit"),
                                 "modelled_link_seconds": phases, "modelled_link_total": round(sum(phases.values()), 3),
                                 "stage_seconds_max_rank": stages})
                    note(f"  {data} M={m} {link:>12} {name:<18} {sec:7.2f} s  x{rows[-1]['vs_none']:.3f}  "
                         f"link {rows[-1]['modelled_link_total']:.2f} s  n={rows[-1]['micro_batches']}")
    return rows, timelines


def section_accuracy(args) -> list[dict]:
    """Each of ``--configs`` (and none) with seeds ``--seed-start`` .. ``--seed-start + --seeds - 1``
    (``train.seed``), seed by seed in one launch per (data, M): one record per run."""
    configs = ["none", *(c for c in args.configs if c != "none")]
    seeds = list(range(args.seed_start, args.seed_start + args.seeds))
    runs_out = []
    for data in args.data:
        for m in args.trainers:
            specs, names = [["train.stop_after_batches=3"]], [None]
            for seed in seeds:
                for name in configs:
                    specs.append([*ALONE[CONFIGS[name]], f"train.seed={seed}"])
                    names.append((CONFIGS[name], seed))
            note(f"accuracy: {data} M={m}: {len(specs) - 1} runs of {args.epochs} epochs, seeds {seeds[0]}-{seeds[-1]}")
            base = [*base_overrides(args, data, m, args.epochs), *args.overrides]
            runs = launch(m, specs, [False] * len(specs), base, args.timeout)
            for (name, seed), ranks in zip(names[1:], runs[1:]):
                runs_out.append({"data": data, "M": m, "config": name, "seed": seed, "epochs": args.epochs,
                                 "overrides": args.overrides, "test_ap": ranks[0]["test_ap"],
                                 "epoch_seconds": round(max(r["train_seconds"] for r in ranks) / args.epochs, 3)})
                note(f"  {data} M={m} seed {seed} {name:<20} test AP {ranks[0]['test_ap']:.4f}")
    return runs_out


def t_975(df: int) -> float:
    """Student's t 97.5% quantile with ``df`` degrees of freedom (two-sided 95% interval)."""
    if df < 1:
        raise ValueError(f"df={df}: a t quantile needs at least one degree of freedom")
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def paired(diffs: list[float], goal: float = GOAL_POINTS) -> dict:
    """Mean of paired differences (points), its standard error, the 95% t interval and the verdict
    against +-``goal``: within (the interval inside +-goal), outside (the interval wholly beyond
    it) or undecided (it straddles +-goal, or fewer than two pairs)."""
    import statistics

    n = len(diffs)
    mean = statistics.fmean(diffs) if n else None
    if n < 2:
        return {"n": n, "mean_points": mean, "sd_points": None, "se_points": None, "ci95_points": None,
                "verdict": "undecided"}
    sd = statistics.stdev(diffs)
    se = sd / n**0.5
    lo, hi = mean - t_975(n - 1) * se, mean + t_975(n - 1) * se
    verdict = "within" if -goal <= lo and hi <= goal else "outside" if hi < -goal or lo > goal else "undecided"
    return {"n": n, "mean_points": mean, "sd_points": sd, "se_points": se, "ci95_points": [lo, hi],
            "verdict": verdict}


def accuracy_rows(runs: list[dict]) -> list[dict]:
    """Per (data, M, configuration): the seeds' test AP, and against none the paired differences
    (the same seed with and without the level). ``seed_sd_points`` of none over its seeds is what
    a change of seed alone moves AP; the differences of two unrelated runs would spread by about
    sqrt(2) times it, so ``diff_sd_points`` near that says the level's change of the run (float
    rounding, another dropout mask) decorrelates it as much as another seed does."""
    import statistics

    by: dict = {}
    for r in runs:
        key = (r["data"], r["M"], r["config"], r["epochs"], tuple(r.get("overrides", [])))
        seen = by.setdefault(key, {})
        if r["seed"] in seen and seen[r["seed"]]["test_ap"] != r["test_ap"]:
            raise ValueError(f"{key[:3]} seed {r['seed']}: two runs with different test AP "
                             f"({seen[r['seed']]['test_ap']} and {r['test_ap']}); merge runs of one code and setup only")
        seen[r["seed"]] = r
    rows = []
    for key in sorted(by, key=lambda k: (k[0], k[1], k[3], k[4], list(CONFIGS.values()).index(k[2]))):
        data, m, name, epochs, over = key
        got = by[key]
        seeds = sorted(got)
        aps = [got[s]["test_ap"] for s in seeds]
        row = {"data": data, "M": m, "config": name, "epochs": epochs, "overrides": list(over), "seeds": seeds,
               "test_ap_per_seed": aps, "test_ap_mean": statistics.fmean(aps),
               "test_ap_std": statistics.stdev(aps) if len(aps) > 1 else None,
               "epoch_seconds": min(got[s]["epoch_seconds"] for s in seeds)}
        none = by.get((data, m, "none", epochs, over), {})
        if name == "none":
            row["seed_sd_points"] = 100 * row["test_ap_std"] if row["test_ap_std"] is not None else None
        elif none:
            common = [s for s in seeds if s in none]
            row["paired"] = paired([100 * (got[s]["test_ap"] - none[s]["test_ap"]) for s in common])
            row["paired"]["seeds"] = common
            if len(common) > 2:
                row["paired"]["correlation_with_none"] = statistics.correlation(
                    [none[s]["test_ap"] for s in common], [got[s]["test_ap"] for s in common])
        rows.append(row)
    return rows


def report_accuracy(rows: list[dict]) -> None:
    for r in rows:
        p = r.get("paired")
        if r["config"] == "none":
            sd = r["seed_sd_points"]
            note(f"  {r['data']} M={r['M']} none  AP {r['test_ap_mean']:.4f} over {len(r['seeds'])} seeds"
                 + (f", sd {sd:.2f} points" if sd is not None else ""))
        elif p and p["se_points"] is not None:
            lo, hi = p["ci95_points"]
            note(f"  {r['data']} M={r['M']} {r['config']:<20} {p['mean_points']:+.2f} +- {p['se_points']:.2f} points "
                 f"(95% [{lo:+.2f}, {hi:+.2f}], n={p['n']}, sd of differences {p['sd_points']:.2f}): {p['verdict']}")


def section_single(args) -> list[dict]:
    from tgdist.train import train

    rows = []
    for rep in range(args.repeats):
        for q in (0, 2):
            with tempfile.TemporaryDirectory(prefix="tgdist-pipebench-") as d:
                over = ["data=wikipedia", f"model={args.model}", "train.epochs=1", "train.progress=false",
                        "train.num_neg_eval=1", f"pipeline.prefetch={q}"]
                if args.single_events:
                    over.append(f"data.max_events={args.single_events}")
                s = train(over, f"{d}/run")
            rows.append({"repeat": rep, "prefetch": q, "train_events_per_s": s["train_events_per_s"],
                         "test_ap": s["test_ap"]})
            note(f"  single process, prefetch={q}: {s['train_events_per_s']:,.0f} events/s, test AP {s['test_ap']:.4f}")
    return rows


def draw_timeline(timelines: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sample": "#8fbc8f", "features": "#2e8b57", "memory_read": "#4682b4", "compute": "#f4a460",
              "memory_write": "#cd5c5c", "dispatch": "#4682b4", "aggregation": "#cd5c5c", "gradients": "#9370db"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 2.2 * len(timelines) + 0.6), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], timelines.items()):
        lanes = {"main": 2, "tgdist-prefetch": 1, "link": 0}
        for stage, thread, a, b in tl["stages"]:
            lane = lanes.get("main" if thread == "MainThread" else thread, 1)
            ax.broken_barh([(a, b - a)], (lane - 0.4, 0.8), color=colors.get(stage, "gray"))
        for phase, a, b in tl["link"]:
            ax.broken_barh([(a, b - a)], (-0.4, 0.8), color=colors.get(phase.split(".")[0], "lightgray"))
        for s in tl["iterations"]:
            ax.axvline(s, color="black", lw=0.6, ls=":")
        ax.set_yticks([0, 1, 2], ["link (modelled)", "prefetch thread", "main thread"])
        ax.set_xlim(0, tl["end"] - tl["start"])
        ax.set_title(f"{name}: iterations {TIMELINE_WINDOW[0]}-{TIMELINE_WINDOW[1] - 1} of rank 0", fontsize=10)
    axes[-1, 0].set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="lower center", ncol=len(colors), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    note(f"timeline written to {path}")


def merge(ap, paths: list[str]) -> int:
    """The accuracy section of earlier outputs together (seeds run in batches), as one output."""
    runs, sources = [], []
    for path in paths:
        try:
            got = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--merge {path}: {e}")
        if not isinstance(got, dict) or not isinstance(got.get("accuracy_runs"), list):
            ap.error(f"--merge {path}: no accuracy_runs (an accuracy section of this script's output)")
        runs += got["accuracy_runs"]
        sources.append({"path": path, "machine": got.get("machine"), "seconds": got.get("seconds")})
    try:
        rows = accuracy_rows(runs)
    except ValueError as e:
        ap.error(f"--merge: {e}")
    report_accuracy(rows)
    emit({"benchmark": "pipelining", "merged": sources, "accuracy_runs": runs, "accuracy": rows})
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        plan = json.loads(Path(sys.argv[3]).read_text())
        worker(sys.argv[2], plan["specs"], plan["traced"], sys.argv[4:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--data", nargs="+", choices=("collegemsg", "wikipedia"), default=["collegemsg", "wikipedia"])
    ap.add_argument("--model", choices=("tgn", "jodie", "apan"), default="tgn")
    ap.add_argument("--trainers", nargs="+", type=at_least(2), default=[2, 4])
    ap.add_argument("--links", nargs="+", default=["eth10", "ib100", SLOW_LINK])
    ap.add_argument("--global-batch", type=at_least(8), default=1600, help="events per iteration over the M trainers")
    ap.add_argument("--epochs", type=at_least(1), default=3, help="epochs of the accuracy section")
    ap.add_argument("--collegemsg-events", type=at_least(0), default=0, help="data.max_events (0: all)")
    ap.add_argument("--wikipedia-events", type=at_least(0), default=60_000, help="data.max_events (0: all)")
    ap.add_argument("--seeds", type=at_least(1), default=3, help="how many seeds the accuracy section runs")
    ap.add_argument("--seed-start", type=at_least(0), default=0, help="the accuracy section's first seed")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                    help="configurations of the accuracy section (none, the reference, always runs)")
    ap.add_argument("--overrides", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run of the accuracy section (e.g. model.dropout=0)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="run nothing: the accuracy of these earlier outputs (runs of other seeds) together")
    ap.add_argument("--speed-repeats", type=at_least(1), default=2, help="runs of each speed configuration")
    ap.add_argument("--repeats", type=at_least(1), default=2, help="pairs of runs of the single section")
    ap.add_argument("--single-events", type=at_least(0), default=0, help="data.max_events of the single section")
    ap.add_argument("--timeline", default=None, help="PNG of a few iterations without and with pipelining")
    ap.add_argument("--timeout", type=at_least(1.0, float), default=1800.0, help="seconds per launch")
    args = ap.parse_args()
    if args.merge:
        return merge(ap, args.merge)
    args.max_events = {"collegemsg": args.collegemsg_events, "wikipedia": args.wikipedia_events}
    if args.global_batch % max(args.trainers):
        ap.error(f"--global-batch {args.global_batch} is not a multiple of every trainer count")
    from tgdist.distributed.link import parse_link
    for link in args.links:
        parse_link(link)  # a bad one is named before anything runs
    if "accuracy" in args.sections and args.overrides:
        from tgdist.runtime.build import compose
        compose([*base_overrides(args, args.data[0], args.trainers[0], args.epochs), *args.overrides])
    started = time.perf_counter()
    result = {"benchmark": "pipelining", "machine": machine(),
              "setup": f"sven backend, {args.model}, mini-batch parallelism M x 1 x 1 under torchrun (gloo, CPU, 1 "
                       f"thread per rank); global batch {args.global_batch}; max_events {args.max_events} (0: all); "
                       f"links are a model (latency + bytes / bandwidth per collective, one link per rank)"}
    if "speed" in args.sections:
        result["speed"], timelines = section_speed(args)
        if args.timeline and timelines:
            draw_timeline(timelines, args.timeline)
    if "accuracy" in args.sections:
        result["accuracy_runs"] = section_accuracy(args)
        result["accuracy"] = accuracy_rows(result["accuracy_runs"])
        report_accuracy(result["accuracy"])
    if "single" in args.sections:
        result["single"] = section_single(args)
    result["seconds"] = round(time.perf_counter() - started, 1)
    emit(result)
    return 0


if __name__ == "__main__":
    run_main(main)
