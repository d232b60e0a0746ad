"""Part 4: the pipelines where they matter, each against its baseline in the same run (ratios:
baseline seconds over the pipelined run's, above 1 = faster).

- ``pipelines:sven_ladder``: two ranks sharing the device (gloo, as in part 1), sven memory at
  2 x 1 x 1 under the simulated link (``parallel.link``; ``eth10`` on a GPU, ``100mbps:50us`` on a
  CPU, where compute is about 100x slower: communication about as large as computation either way):
  no pipelining, + prefetch, + micro-batches (auto), + asynchronous all-reduce. Epoch time is the
  slowest rank's training loop (evaluation apart), after a warm-up run in the same ranks.
- ``pipelines:mspipe_2x1x1``: the same launch, depcache memory, the plain loop against MSPipe
  (staleness auto).
- ``pipelines:mspipe_1proc``: one process on the device (MSPipe's stages on their CUDA streams),
  ``pipeline.prefetch=2`` plain against MSPipe at staleness auto; training events/s of each summary.
- ``pipelines:freshgnn_tgat2``: FreshGNN's cache for ``model=tgat2`` (``benchmarks/embedding_cache.py``'s
  settings): one trainer without the cache and one with ``0.9:20`` stepped in lockstep over the same
  batches after a warm-up, the device synchronised around every step; the median over steps of
  the uncached step time over the cached one, and the hit rate.

Speeds are measurements: a line fails only when a run fails or trains to no finite test AP.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import launch
from shared import (
    FAILED,
    REPO,
    deadline_arg,
    device,
    emit,
    events_override,
    good_score,
    guarded,
    on_cuda,
    out_dir,
    say,
    sizes,
    threads_overrides,
)

PART = 4
LADDER = {"none": [], "+prefetch": ["pipeline.prefetch=2"],
          "+micro-batches": ["pipeline.prefetch=2", "pipeline.micro_batches=auto"],
          "+async all-reduce": ["pipeline.prefetch=2", "pipeline.micro_batches=auto", "pipeline.async_allreduce=true"]}
MSPIPE = {"depcache none": ["memory.backend=depcache"],
          "depcache mspipe": ["memory.backend=depcache", "pipeline=mspipe"]}
CACHE_SETTINGS = ("off", "0.9:20")


def ladder(seconds: float) -> None:
    s = sizes()
    base = ["data=wikipedia", events_override(s["pipe_events"]), "parallel.i=2", "parallel.j=1", "parallel.k=1",
            f"train.batch_size={s['pipe_global_batch'] // 2}", "train.epochs=1", "train.num_neg_eval=1",
            "train.progress=false", f"parallel.link={s['pipe_link']}", "memory.timeout=120",
            *([] if on_cuda() else s["dims"]), *threads_overrides(s["threads"])]
    specs = [{"name": "warm-up", "overrides": ["memory.backend=sven", "train.stop_after_batches=3"],
              "devices": [device()]}]
    specs += [{"name": n, "overrides": ["memory.backend=sven", *o], "devices": [device()]} for n, o in LADDER.items()]
    specs += [{"name": n, "overrides": o, "devices": [device()]} for n, o in MSPIPE.items()]
    t0 = time.perf_counter()
    got = launch(specs, base, 2, seconds, out_dir() / "part4_pipelines.log")
    spent = time.perf_counter() - t0

    def row(name):
        r = got.get(name) or {}
        runs = [x["runs"]["dev"] for x in r.get("ranks", []) if x.get("ok") and "dev" in x.get("runs", {})]
        if r.get("error") or len(runs) != 2:
            return None, r.get("error") or f"{len(runs)} ranks reported"
        secs = max(x["train_seconds"] or 0 for x in runs)
        summ = runs[0]["summary"]
        pipe = summ.get("pipeline") or {}
        return {"epoch_seconds": secs, "test_ap": summ.get("test_ap"), "micro_batches": pipe.get("micro_batches"),
                "staleness": pipe.get("staleness"), "iterations": summ.get("iterations")}, None

    for check, names, base_name in (("pipelines:sven_ladder", list(LADDER), "none"),
                                    ("pipelines:mspipe_2x1x1", list(MSPIPE), "depcache none")):
        rows, why = {}, []
        for n in names:
            r, err = row(n)
            if err:
                why.append(f"{n}: {err}")
            else:
                rows[n] = r
                if not good_score(r["test_ap"]):
                    why.append(f"{n}: test AP {r['test_ap']}")
        b = rows.get(base_name)
        ratios = {n: (b["epoch_seconds"] / r["epoch_seconds"] if b and r["epoch_seconds"] else None)
                  for n, r in rows.items()}
        figures = {"layout": "2x1x1", "comm": "gloo", "compute": device(), "link": s["pipe_link"],
                   "link_note": "a model: latency + bytes / bandwidth, slept", "events": s["pipe_events"],
                   "global_batch": s["pipe_global_batch"], "runs": rows, "speedup_vs_baseline": ratios}
        emit(check, PART, not why, figures, seconds=spent / 2, error="; ".join(why) or None)


def mspipe_single() -> None:
    from ranks import one_run

    s = sizes()
    base = ["data=wikipedia", events_override(s["mspipe_events"]),
            f"train.batch_size={s['speed_batch']}",
            "train.epochs=1", "train.num_neg_eval=1", "train.progress=false", f"train.device={device()}",
            "pipeline.prefetch=2", *threads_overrides(s["threads"])]
    t0 = time.perf_counter()
    why, rows = [], {}
    try:
        one_run([*base, "train.stop_after_batches=3"], None, 0, 1)  # warm-up
        for name, over in (("plain prefetch=2", []), ("mspipe auto", ["pipeline.mode=mspipe"])):
            rec, _ = one_run([*base, *over], None, 0, 1)
            summ = rec["summary"]
            rows[name] = {"train_events_per_s": summ.get("train_events_per_s"), "test_ap": summ.get("test_ap"),
                          "staleness": (summ.get("pipeline") or {}).get("staleness"),
                          "cuda_streams": rec.get("cuda_streams")}
            if not good_score(summ.get("test_ap")):
                why.append(f"{name}: test AP {summ.get('test_ap')}")
    except Exception:  # noqa: BLE001
        import traceback

        why.append(traceback.format_exc())
    a, b = rows.get("plain prefetch=2"), rows.get("mspipe auto")
    ratio = b["train_events_per_s"] / a["train_events_per_s"] if a and b and a["train_events_per_s"] else None
    emit("pipelines:mspipe_1proc", PART, not why, {"events": s["mspipe_events"] or "all", "runs": rows,
                                                    "speedup_vs_plain": ratio},
         seconds=time.perf_counter() - t0, error="; ".join(why) or None)


def freshgnn() -> None:
    import argparse

    import numpy as np

    sys.path.insert(0, str(REPO / "benchmarks"))
    from embedding_cache import base_overrides, setting_overrides, step_times

    from tgdist.runtime.build import build_trainer, compose

    s = sizes()
    t0 = time.perf_counter()
    args = argparse.Namespace(batch=s["cache_batch"], epochs=1, num_neg_eval=1, threads=s["threads"] or 0,
                              max_events=s["cache_events"] or None)
    why, figures = [], {}
    try:
        trainers = {st: build_trainer(compose(base_overrides(args, "wikipedia", 0) + setting_overrides(st)
                                              + [f"train.device={device()}", *([] if on_cuda() else s["dims"])]),
                                      progress=False) for st in CACHE_SETTINGS}
        first = next(iter(trainers.values()))
        batches = list(first.batches("train"))[: s["cache_warmup"] + s["cache_steps"]]
        times = step_times(trainers, batches)  # (the device synchronised around each step)
        w = s["cache_warmup"]
        off = np.array(times["off"][w:])
        cached = np.array(times[CACHE_SETTINGS[1]][w:])
        cache = trainers[CACHE_SETTINGS[1]].cache
        stats = cache.take_stats() if cache is not None else {}
        figures = {"model": "tgat2", "events": s["cache_events"] or "all", "batch": s["cache_batch"],
                   "warmup_steps": w, "steps": len(off), "setting": CACHE_SETTINGS[1],
                   "median_step_ms_off": 1000 * float(np.median(off)),
                   "median_step_ms_cached": 1000 * float(np.median(cached)),
                   "median_speedup": float(np.median(off / cached)), "hit_rate": stats.get("hit_rate")}
        if cache is None:
            why.append("the cache was not built (cache.enabled=true gave none)")
        elif on_cuda() and cache.table.device.type != "cuda":
            why.append(f"the cache's table is on {cache.table.device}")
        if not len(off):
            why.append("no timed steps")
    except Exception:  # noqa: BLE001
        import traceback

        why.append(traceback.format_exc())
    emit("pipelines:freshgnn_tgat2", PART, not why, figures, seconds=time.perf_counter() - t0,
         error="; ".join(why) or None)


def main() -> int:
    seconds = deadline_arg(sys.argv)
    t0 = time.perf_counter()
    say(f"part 4: pipelines on {device()} (link {sizes()['pipe_link']})")
    ladder(max(30.0, seconds * 0.6))
    mspipe_single()
    freshgnn()
    say(f"part 4: done in {time.perf_counter() - t0:.0f} s")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(guarded(PART, "pipelines", main))
