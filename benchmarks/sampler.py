"""Temporal sampler throughput: events/s for recent and uniform sampling, 1 and 2 hops.

    python benchmarks/sampler.py                      # wikipedia, sfhh and a 10M-event synthetic graph
    python benchmarks/sampler.py --dataset wikipedia --threads 2

A batch is ``--batch`` consecutive events with 3 roots each (src, dst, one negative destination)
at the event's time, as in training. The timed work per batch is ``TemporalSampler.sample`` plus
the conversion of every hop to torch tensors; negatives are drawn before the clock starts. Each
data set runs in its own process so that its peak memory is its own. On Wikipedia the same run
times two NumPy peers on the same batches: a vectorised searchsorted sampler (all batches) and
the plain reference sampler (a slice), and quotes the ratios.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import DATASETS, at_least, emit, machine, run_main  # noqa: E402

CONFIGS = [("recent", [10]), ("recent", [10, 10]), ("uniform", [10]), ("uniform", [10, 10])]


def log(msg: str) -> None:
    print(f"[sampler] {msg}", file=sys.stderr, flush=True)


def proc_status(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM), or -1 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs), so later peaks are the phase's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def load(name: str, args) -> tuple:
    from tgdist.data.load import load_graph
    start = time.perf_counter()
    if name == "wikipedia":
        g = load_graph(DATASETS / "wikipedia" / "wikipedia.csv.gz", cache=False)
    elif name == "sfhh":
        g = load_graph(DATASETS / "sociopatterns-copresence" / "tij_pres_SFHH.txt.zip", cache=False)
    elif name == "synthetic":
        from tgdist.data.synthetic import generate
        g = generate(args.synthetic_events, args.synthetic_nodes, seed=0)
    else:
        raise SystemExit(f"unknown dataset {name!r}")
    return g, time.perf_counter() - start


def batches(g, batch: int, neg: np.ndarray, first: int, last: int):
    for s in range(first, last, batch):
        e = min(s + batch, last)
        t = g.t[s:e]
        yield e - s, np.concatenate([g.src[s:e], g.dst[s:e], neg[s:e]]), np.concatenate([t, t, t])


def time_sampler(g, tcsr, strategy, fanouts, threads, neg, args) -> dict:
    from tgdist.data.sampler import TemporalSampler
    s = TemporalSampler(tcsr, fanouts=fanouts, strategy=strategy, seed=0, num_threads=threads)
    first = 0
    # warm-up (numba compile or cache load) on the first batch, outside the clock
    for _, roots, rt in batches(g, args.batch, neg, first, min(first + args.batch, g.num_events)):
        [h.to_torch() for h in s.sample(roots, rt)]
    rates, passes = timed_passes(g, neg, args, lambda roots, rt: [h.to_torch() for h in s.sample(roots, rt)], first)
    return {"strategy": strategy, "fanouts": fanouts, "threads": s.num_threads, **summary(rates), "passes": passes,
            "full_pass": passes[-1]["events"] == g.num_events}


def timed_passes(g, neg, args, sample_batch, first: int = 0) -> tuple[list, list]:
    """``args.repeats`` timed passes of ``sample_batch(roots, root_t)`` over the stream from event
    ``first``, each cut at ``args.budget_s`` seconds: events/s per pass and what each pass covered."""
    rates, passes = [], []
    for _ in range(args.repeats):
        events = 0
        start = time.perf_counter()
        for n, roots, rt in batches(g, args.batch, neg, first, g.num_events):
            sample_batch(roots, rt)
            events += n
            if time.perf_counter() - start > args.budget_s:
                break
        sec = time.perf_counter() - start
        rates.append(events / sec)
        passes.append({"events": events, "seconds": round(sec, 4)})
    return rates, passes


def summary(rates: list[float]) -> dict:
    """Median, best and worst of the passes (the machine is shared: the median is the figure to quote)."""
    return {"events_per_s": round(float(np.median(rates))), "events_per_s_best": round(max(rates)),
            "events_per_s_worst": round(min(rates)), "roots_per_s": round(3 * float(np.median(rates)))}


def numpy_recent(tcsr, key, span, tmin, roots, root_t, k):
    """Vectorised NumPy recent-k: one searchsorted over (node, time) keys, then gathers."""
    hi = np.searchsorted(key, roots * span + (root_t - tmin), side="left")
    lo = tcsr.indptr[roots]
    pos = hi[:, None] - 1 - np.arange(k)[None, :]
    mask = pos >= lo[:, None]
    pos = np.where(mask, pos, 0)
    nbr = np.where(mask, tcsr.nbr[pos], -1)
    eid = np.where(mask, tcsr.eid[pos], -1)
    t = np.where(mask, tcsr.t[pos], 0)
    dt = np.where(mask, root_t[:, None] - t, 0).astype(np.float32)
    return nbr, eid, t, mask, dt


def time_numpy_baseline(g, tcsr, neg, args, hops: int) -> dict:
    import torch

    from tgdist.data.sampler import TemporalSampler
    tmin = int(g.t.min())
    span = int(g.t.max()) - tmin + 2
    node_of_entry = np.repeat(np.arange(tcsr.num_nodes, dtype=np.int64), np.diff(tcsr.indptr))
    key = node_of_entry * span + (tcsr.t - tmin)
    # the baseline must agree with the kernel before it is timed
    check = TemporalSampler(tcsr, fanouts=[10] * hops)
    _, roots, rt = next(batches(g, args.batch, neg, g.num_events // 2, g.num_events))
    r, t_ = roots, rt
    for hop in check.sample(roots, rt):
        got = numpy_recent(tcsr, key, span, tmin, np.maximum(r, 0), t_, 10)
        got_mask = got[3] & (r >= 0)[:, None]
        assert np.array_equal(np.where(got_mask, got[1], -1), hop.eid), "numpy baseline disagrees with the kernel"
        r, t_ = hop.nbr.reshape(-1), hop.t.reshape(-1)

    def sample_batch(roots, rt):
        r, t_ = roots, rt
        for _ in range(hops):
            valid = r >= 0
            nbr, eid, t, mask, dt = numpy_recent(tcsr, key, span, tmin, np.where(valid, r, 0), t_, 10)
            mask &= valid[:, None]
            nbr[~mask] = -1
            [torch.from_numpy(a) for a in (nbr, eid, mask, dt)]
            r, t_ = nbr.reshape(-1), t.reshape(-1)

    rates, passes = timed_passes(g, neg, args, sample_batch)
    return {"sampler": "numpy vectorised searchsorted", "fanouts": [10] * hops, **summary(rates), "passes": passes}


def time_reference(g, neg, args) -> dict:
    """The plain reference sampler (tgdist.kernels.reference): a scan of all events per root."""
    from tgdist.kernels import reference
    n = args.reference_events
    s = g.num_events // 2
    roots = np.concatenate([g.src[s:s + n], g.dst[s:s + n], neg[s:s + n]])
    rt = np.concatenate([g.t[s:s + n]] * 3)
    start = time.perf_counter()
    reference.sample_recent(g.src, g.dst, g.t, roots, rt, 10)
    sec = time.perf_counter() - start
    return {"sampler": "plain reference (reference.sample_recent)", "fanouts": [10], "events": n,
            "seconds": round(sec, 4), "events_per_s": round(n / sec, 1)}


def run_one(name: str, args) -> dict:
    import torch  # noqa: F401  (imported before measuring, as a trainer would have it)

    from tgdist.data.sampler import TCSR, NegativeSampler
    log(f"{name}: loading")
    g, load_s = load(name, args)
    graph_bytes = sum(a.nbytes for a in (g.src, g.dst, g.t))
    start = time.perf_counter()
    tcsr = TCSR.build(g)
    build_s = time.perf_counter() - start
    neg = NegativeSampler(g, seed=0).train(g.num_events, 1)[:, 0]
    rss_loaded = proc_status("VmRSS")
    peak_loading = proc_status("VmHWM")
    reset = reset_peak_rss()
    out = {"dataset": name, "num_events": g.num_events, "num_nodes": g.num_nodes, "load_s": round(load_s, 3),
           "tcsr_build_s": round(build_s, 3), "tcsr_bytes": tcsr.nbytes(), "graph_event_bytes": graph_bytes,
           "rss_after_load_bytes": rss_loaded, "peak_rss_load_bytes": peak_loading, "runs": []}
    for strategy, fanouts in CONFIGS:
        for threads in args.threads:
            log(f"{name}: {strategy} {fanouts} threads={threads}")
            out["runs"].append(time_sampler(g, tcsr, strategy, fanouts, threads, neg, args))
    out["peak_rss_sampling_bytes"] = proc_status("VmHWM") if reset else -1
    out["peak_rss_process_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if name == "wikipedia":
        log(f"{name}: numpy peers")
        out["peers"] = [time_numpy_baseline(g, tcsr, neg, args, 1), time_numpy_baseline(g, tcsr, neg, args, 2),
                        time_reference(g, neg, args)]
        by = {(r["strategy"], tuple(r["fanouts"]), r["threads"]): r["events_per_s"] for r in out["runs"]}
        t = max(args.threads)
        out["ratios"] = {
            "recent10_vs_numpy_vectorised": round(by[("recent", (10,), t)] / out["peers"][0]["events_per_s"], 2),
            "recent10x10_vs_numpy_vectorised": round(by[("recent", (10, 10), t)] / out["peers"][1]["events_per_s"], 2),
            "recent10_vs_plain_reference": round(by[("recent", (10,), t)] / out["peers"][2]["events_per_s"], 1),
            "threads": t,
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="all", choices=["all", "wikipedia", "sfhh", "synthetic"])
    p.add_argument("--threads", type=at_least(1), nargs="+", default=[2], help="numba thread counts to time")
    p.add_argument("--batch", type=at_least(1), default=600, help="events per sampled batch")
    p.add_argument("--budget-s", type=at_least(0.1, float), default=10.0, help="stop a pass after this many seconds")
    p.add_argument("--repeats", type=at_least(1), default=3, help="passes per configuration (median reported)")
    p.add_argument("--synthetic-events", type=at_least(1), default=10_000_000, help="events of the synthetic graph")
    p.add_argument("--synthetic-nodes", type=at_least(2), default=1_000_000, help="nodes of the synthetic graph")
    p.add_argument("--reference-events", type=at_least(1), default=20,
                   help="events timed with the plain reference sampler")
    p.add_argument("--no-omp-compare", action="store_true",
                   help="with --dataset all, skip the extra Wikipedia run with OMP_WAIT_POLICY=PASSIVE")
    args = p.parse_args()
    result = {"benchmark": "sampler", "date": datetime.date.today().isoformat(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "batch_events": args.batch, "roots_per_event": 3, "includes": "sample() + to_torch() of every hop",
              "datasets": []}
    if args.dataset == "all":
        runs = [(name, {}) for name in ("wikipedia", "sfhh", "synthetic")]
        if not args.no_omp_compare:  # the same Wikipedia run with sleeping OpenMP workers, as a peer
            runs.insert(1, ("wikipedia", {"OMP_WAIT_POLICY": "PASSIVE"}))
        for name, env in runs:
            cmd = [sys.executable, __file__, "--dataset", name, "--batch", str(args.batch), "--budget-s", str(args.budget_s),
                   "--repeats", str(args.repeats), "--synthetic-events", str(args.synthetic_events),
                   "--synthetic-nodes", str(args.synthetic_nodes), "--reference-events", str(args.reference_events),
                   "--threads", *map(str, args.threads)]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, env={**os.environ, **env})
            for d in json.loads(proc.stdout)["datasets"]:
                d["env"] = env
                result["datasets"].append(d)
    else:
        result["datasets"].append(run_one(args.dataset, args))
        result["datasets"][-1]["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    emit(result)
    return 0


if __name__ == "__main__":
    run_main(main)
