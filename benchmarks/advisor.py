"""The strategy advisor checked against real runs (issue 44, point 5): predict, then run.

    python benchmarks/advisor.py                                   # Wikipedia, M = 2 and 4, eth10 and ib100
    python benchmarks/advisor.py --data collegemsg --max-events 6000 --iterations 5   # a dry run
    python benchmarks/advisor.py --device cuda --batch 600 --profile-batches 300 600 1200 --threads 4  # one GPU

1. One profile of the data on this machine (``tgdist.launcher.advisor.measure``, as ``tgdist plan
   --profile`` takes it): one trainer process, one thread, the stage times at three local batch
   sizes, the placements at M = 2 and 4, the cost of a collective between two processes here.
2. For each setting (M trainers on this machine's cores, ``parallel.link`` eth10 or ib100: the
   presets ``cpu-M-LINK``), the model ranks every combination (``predict``), and a fixed set of
   candidates is run, with the predicted best added when it is not among them: M x 1 x 1 with sven
   (no pipelining, and Sven's three levels), depcache with prefetch, the memory daemon, and
   1 x 1 x M with local memory (memory parallelism). Every candidate takes the same local batch.
3. Each run is real: one ``torchrun`` per (setting, layout) (gloo, one torch thread per rank), this
   script as each rank (``--worker``), the candidates trained one after the other in the same
   processes after a short warm-up run (imports, numba compiles), each a ``Run`` of
   ``train.epochs = j x k`` (so that each memory group makes one pass); the measured epoch is the
   slowest rank's training loop (evaluation apart) over the epochs; with ``--repeats R`` each candidate
runs R times in rotation and the least of its times counts (load from other work only adds time).

Reported: predicted against measured epoch seconds per candidate, the absolute error relative to
the measurement, its median (goal: at most 20%), and per setting whether the predicted best (the
candidate ``tgdist plan`` prints as best: ``report.best``) is within 10% of the measured best. The ranks of one setting share this machine's cores: the profile
is of one process, and the model adds the sharing (``model``: shared cores) as measured just before
each setting's runs (``core_sharing``: this machine's two cores and whatever else runs on them then;
``--keep-sharing`` uses the profile's). One
JSON object on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import at_least, emit, machine, note, rank_records, run_main, torchrun_ranks

SETTINGS = [(2, "eth10"), (2, "ib100"), (4, "eth10"), (4, "ib100")]
GOAL_MEDIAN_ERROR = 0.20
GOAL_BEST = 0.10


def chosen(m: int) -> list[tuple[str, str, str | None, str]]:
    """(layout, backend, placement, pipeline) run in every setting with M trainers."""
    if m == 1:  # one trainer (one GPU): the pipeline levels are what is left to choose
        return [("1x1x1", "local", None, p) for p in ("none", "prefetch", "mspipe")]
    return [(f"{m}x1x1", "sven", "reflexbicut", "none"), (f"{m}x1x1", "sven", "reflexbicut", "sven"),
            (f"{m}x1x1", "depcache", None, "prefetch"), (f"{m}x1x1", "daemon", None, "none"),
            (f"1x1x{m}", "local", None, "none")]


# ------------------------------------------------------------------------------------------------
# One rank (under torchrun)


def one_run(spec: list[str], base: list[str], groups, rank: int) -> dict:
    import shutil

    from tgdist.runtime.build import build_trainer, compose
    from tgdist.runtime.run import Run

    cfg = compose([*base, *spec])
    run_dir = tempfile.mkdtemp(prefix="tgdist-advbench-") if rank == 0 else None
    driver = Run(cfg, run_dir, trainer=build_trainer(cfg, progress=False, local_memory=cfg.memory.backend == "auto"),
                 groups=groups)
    tr, store = driver.trainer, driver.trainer.memory
    rec = {"spec": spec, "iterations": 0}
    end_training = store.end_training

    def ended(evaluates):  # the training loop is over; evaluation is not timed
        rec["train_seconds"] = time.perf_counter() - rec.pop("_start")
        rec["cpu_seconds"] = time.process_time() - rec.pop("_cpu")  # every thread of the rank (gloo's too)
        rec["main_thread_cpu_seconds"] = time.thread_time() - rec.pop("_thread_cpu")
        rec["stage_seconds"] = {k: round(v, 4) for k, v in tr.timer.seconds.items()}
        rec["counters"] = driver.counter.as_dict()  # the training iterations' calls, bytes, modelled link seconds
        end_training(evaluates)

    def tick(t, loss):
        rec["iterations"] += 1
        rec["_last"] = time.perf_counter()
        rec["_stages"] = dict(tr.timer.seconds)  # evaluation's apart

    store.end_training = ended
    try:
        rec["_start"], rec["_cpu"], rec["_thread_cpu"] = time.perf_counter(), time.process_time(), time.thread_time()
        summary = driver.train(on_iteration=tick)
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
    if "_start" in rec:  # end_training never ran (one process, or the warm-up stopped early): to the last iteration
        rec["train_seconds"] = rec.pop("_last", time.perf_counter()) - rec.pop("_start")
        rec["stage_seconds"] = {k: round(v, 4) for k, v in rec.get("_stages", tr.timer.seconds).items()}
    for key in ("_last", "_stages", "_cpu", "_thread_cpu"):
        rec.pop(key, None)
    rec["pipeline"] = summary.get("pipeline")
    return rec


def worker(out: str, plan: str, base: list[str]) -> None:
    specs = json.loads(Path(plan).read_text())
    rank_records(out, base, lambda groups, rank: [one_run(spec, base, groups, rank) for spec in specs])


# ------------------------------------------------------------------------------------------------
# The parent


def launch(nproc: int, specs: list[list[str]], base: list[str], timeout: float) -> list[list[dict]]:
    """One torchrun of ``nproc`` ranks training ``specs`` in turn; per spec, per rank, its record."""
    ranks = torchrun_ranks(__file__, nproc, base, timeout, plan=specs, prefix="tgdist-advbench-")
    return [[ranks[k][i] for k in range(nproc)] for i in range(len(specs))]


def data_overrides(args) -> list[str]:
    out = [f"data={args.data}", f"model={args.model}", f"train.device={args.device}"]
    if args.max_events:
        out.append(f"data.max_events={args.max_events}")
    return out


def check_settings(settings: list[str]) -> None:
    """Each ``M:LINK`` names a trainer count and a link ``parallel.link`` knows (one line otherwise)."""
    from tgdist.distributed.link import parse_link
    from tgdist.errors import ConfigError

    for s in settings:
        m, _, link = s.partition(":")
        if not m.isdigit() or int(m) < 1 or not link:
            raise ConfigError(f"--settings {s}: give M:LINK, a trainer count and a link, e.g. 2:eth10")
        if parse_link(link) is None:
            raise ConfigError(f"--settings {s}: give a link, not none")


def key_of(c) -> tuple:
    return (c.layout, c.backend, c.placement, c.pipeline)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="wikipedia")
    ap.add_argument("--model", default="tgn")
    ap.add_argument("--max-events", type=at_least(1), default=None, help="data.max_events (a dry run)")
    ap.add_argument("--batch", type=at_least(1), default=300, help="local batch of every candidate (default 300)")
    ap.add_argument("--profile-batches", type=at_least(1), nargs="+", default=[150, 300, 600])
    ap.add_argument("--iterations", type=at_least(1), default=30, help="profiled iterations per batch size")
    ap.add_argument("--settings", nargs="+", default=[f"{m}:{link}" for m, link in SETTINGS],
                    help="M:LINK settings (default: 2:eth10 2:ib100 4:eth10 4:ib100)")
    ap.add_argument("--profile-in", help="a profile taken before (skips step 1)")
    ap.add_argument("--profile-out", help="write the profile here")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the trainers on this machine's GPU (settings 1:nvlink by default)")
    ap.add_argument("--threads", type=at_least(1), default=1, help="threads of the profile (and of GPU runs)")
    ap.add_argument("--keep-sharing", action="store_true",
                    help="use the profile's core sharing in every setting (default: measure it again before each)")
    ap.add_argument("--repeats", type=at_least(1), default=1,
                    help="runs of each candidate, in rotation in one launch; the least time counts (default 1)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per torchrun")
    args = ap.parse_args()
    if args.device == "cuda" and args.settings == [f"{m}:{link}" for m, link in SETTINGS]:
        args.settings = ["1:nvlink"]
    check_settings(args.settings)

    from tgdist.launcher.advisor import cluster as clusters
    from tgdist.launcher.advisor import profile as profiles
    from tgdist.launcher.advisor import report
    from tgdist.launcher.advisor.measure import core_sharing, measure
    from tgdist.launcher.advisor.model import predict

    data = data_overrides(args)
    t0 = time.perf_counter()
    if args.profile_in:
        prof = profiles.read(args.profile_in)
    else:
        note(f"profile: {' '.join(data)}, batches {args.profile_batches}")
        parts = sorted({int(s.split(':')[0]) for s in args.settings})
        prof = measure(data, batch_sizes=args.profile_batches, iterations=args.iterations,
                       warmup=max(3, args.iterations // 3), parts=[p for p in parts if p > 1], methods=["reflexbicut"],
                       largest_batch=10**9, threads=args.threads, collectives=args.device == "cpu")
    if args.profile_out:
        profiles.write(prof, args.profile_out)
    profile_seconds = time.perf_counter() - t0
    settings, rows = [], []
    for s in args.settings:
        m, link = int(s.split(":")[0]), s.split(":")[1]
        if args.device == "cuda":  # M trainers on this machine's one GPU: no core sharing to model
            cl = clusters.Cluster(name=f"gpu-{m}-{link}", machines=1, trainers_per_machine=m, intra_link=link,
                                  inter_link=link, host_memory_gb=128.0, device_memory_gb=80.0, device="cuda",
                                  simulated=True)
        else:
            cl = clusters.Cluster(name=f"cpu-{m}-{link}", machines=1, trainers_per_machine=m, intra_link=link,
                                  inter_link=link, host_memory_gb=16.0, cores_per_machine=os.cpu_count() or 2,
                                  device="cpu", simulated=True)
        # the cores as others share them now, not when the profile was taken
        if not args.keep_sharing and args.device == "cpu" and m > 1:
            sharing = core_sharing(tuple(sorted({1, 2, m})))
            note(f"M={m} {link}: processes side by side now: {sharing}")
            if "note" not in sharing:
                prof = dataclasses.replace(prof, core_sharing=sharing)
        ranked = [c for c in predict(prof, cl, batch_sizes=[args.batch], placements=["reflexbicut"])
                  if c.refused is None]
        want = chosen(m)
        run = [c for c in ranked if key_of(c) in want]
        pick = report.best(ranked)  # what tgdist plan would print as the best
        if key_of(pick) not in want:
            run.append(pick)
        by_layout: dict[str, list] = {}
        for c in run:
            by_layout.setdefault(c.layout, []).append(c)
        measured, diag, repeats_of = {}, {}, {}
        for layout, cands in by_layout.items():
            i, j, k = map(int, layout.split("x"))
            threads = args.threads if args.device == "cuda" else 1
            base = [*data, f"parallel.i={i}", f"parallel.j={j}", f"parallel.k={k}", f"train.epochs={j * k}",
                    f"train.num_threads={threads}", f"sampler.num_threads={threads}", "train.progress=false",
                    "train.num_neg_eval=1",
                    f"train.batch_size={args.batch}"]
            specs = [["train.stop_after_batches=3", "memory.backend=auto" if i * j == 1 else "memory.backend=depcache"]]
            for _ in range(args.repeats):  # in rotation: ABC ABC
                for c in cands:
                    specs.append([o for o in c.overrides(cl) if not o.startswith((
                        "parallel.i=", "parallel.j=", "parallel.k=", "train.batch_size=", "train.device="))])
            note(f"M={m} {link} {layout}: {len(cands)} candidate(s) x {args.repeats} "
                 f"({', '.join(c.label() for c in cands)})")
            runs = launch(m, specs, base, args.timeout)
            for n, c in enumerate(cands):
                reps = [runs[1 + r * len(cands) + n] for r in range(args.repeats)]
                secs = [max(x["train_seconds"] for x in ranks) / (j * k) for ranks in reps]
                ranks = reps[secs.index(min(secs))]  # the least disturbed repeat: load only ever adds time
                measured[key_of(c)] = min(secs)
                repeats_of[key_of(c)] = [round(x, 3) for x in secs]
                link_s = max(sum(v.get("modelled_seconds", 0.0) for v in r.get("counters", {}).values()) for r in ranks)
                calls = max(sum(v["calls"] for v in r.get("counters", {}).values()) / max(r["iterations"], 1)
                            for r in ranks)
                sent = sum(sum(v["bytes_sent"] for v in r.get("counters", {}).values()) for r in ranks) / (j * k)
                stages = {s: round(max(r.get("stage_seconds", {}).get(s, 0.0) for r in ranks) / (j * k), 3)
                          for s in ("sample", "features", "memory_read", "compute", "memory_write")}
                cpu = {key: round(float(np.mean([r.get(key, float("nan")) for r in ranks])) / (j * k), 3)
                       for key in ("cpu_seconds", "main_thread_cpu_seconds")}
                diag[key_of(c)] = {"link_seconds_measured": round(link_s / (j * k), 3),
                                   "rank_cpu_seconds_measured": cpu["cpu_seconds"],
                                   "rank_main_thread_cpu_seconds_measured": cpu["main_thread_cpu_seconds"],
                                   "collectives_per_iteration": round(calls, 2), "bytes_per_epoch_measured": sent,
                                   "iterations_measured": max(r["iterations"] for r in ranks) // (j * k),
                                   "stages_measured_s": stages}
        for c in run:
            meas = measured[key_of(c)]
            rows.append({"M": m, "link": link, "candidate": c.label(), "layout": c.layout, "backend": c.backend,
                         "pipeline": c.pipeline, "predicted_s": round(c.epoch_s, 3), "measured_s": round(meas, 3),
                         "measured_repeats_s": repeats_of[key_of(c)], "error": round((c.epoch_s - meas) / meas, 4),
                         "predicted_rank": ranked.index(c) + 1,
                         "micro_batches": c.micro_batches, "staleness": c.staleness,
                         "bytes_per_epoch_predicted": round(c.bytes_per_epoch), "iterations_predicted": c.iterations,
                         "stages_predicted_s": {k: round(v, 3) for k, v in c.stages.items()}, **diag[key_of(c)]})
            note(f"  {c.label():<45} predicted {c.epoch_s:7.2f} s  measured {meas:7.2f} s  "
                 f"error {100 * rows[-1]['error']:+6.1f}%")
        mine = [r for r in rows if r["M"] == m and r["link"] == link]
        best_measured = min(mine, key=lambda r: r["measured_s"])
        best_predicted = next(r for r in mine if r["candidate"] == pick.label())
        gap = best_predicted["measured_s"] / best_measured["measured_s"] - 1
        settings.append({"M": m, "link": link, "core_sharing": prof.core_sharing,
                         "predicted_best": best_predicted["candidate"],
                         "its_measured_s": best_predicted["measured_s"], "measured_best": best_measured["candidate"],
                         "measured_best_s": best_measured["measured_s"], "gap": round(gap, 4),
                         "within_goal": gap <= GOAL_BEST})
        note(f"  predicted best {best_predicted['candidate']} measured {best_predicted['measured_s']:.2f} s; "
             f"measured best {best_measured['candidate']} {best_measured['measured_s']:.2f} s: gap {100 * gap:+.1f}%")
    errors = [abs(r["error"]) for r in rows]
    med = statistics.median(errors) if errors else float("nan")
    emit({"machine": machine(), "data": data, "batch": args.batch, "profile_seconds": round(profile_seconds, 1),
          "profile": prof.as_json(), "rows": rows, "settings": settings,
          "median_abs_error": round(med, 4), "goal_median_error": GOAL_MEDIAN_ERROR,
          "median_goal_met": med <= GOAL_MEDIAN_ERROR, "best_goal_met": all(s["within_goal"] for s in settings)})
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        run_main(main)
