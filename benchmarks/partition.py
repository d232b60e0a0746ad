"""Partitioning quality and cost: range vs interval vs greedy vs Re-FlexBiCut (Sven 5.4, Fig. 13).

    python benchmarks/partition.py                 # everything (about a minute on 2 cores, results/partitioning.md)
    python benchmarks/partition.py --quick         # Wikipedia headline + timings on a 1M-event graph
    python benchmarks/partition.py --synthetic-events 10000000

Prints one JSON object on stdout (progress on stderr). Quality: the balance cost of eq. (5) as
read in ``tgdist.partition.measures`` (max over trainers of send + receive), on the pre-sampled
epoch, after deduplication (what Sven's all-to-all moves) and raw, plus the per-batch cost
distribution (Fig. 13 plots its upper quartile), and the lower bound no assignment can beat.
Cost: pre-sampling and partitioning time and peak memory, each case in its own child process
(peak resident memory of that process) so one case's memory does not hide another's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import time

from common import DATASETS, at_least, emit, run_main

FILES = {"wikipedia": "wikipedia/wikipedia.csv.gz", "enron": "enron/ml_enron.txt.gz",
         "sfhh": "sociopatterns-copresence/tij_pres_SFHH.txt.zip"}
METHODS = ("range", "interval", "greedy", "reflexbicut")
SYNTH = {"num_nodes": 1_000_000, "num_communities": 1000, "p_in_community": 0.8, "p_repeat": 0.5,
         "activity_exponent": 1.5, "seed": 0}


def note(msg: str) -> None:
    print(f"[partition bench] {msg}", file=sys.stderr, flush=True)


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "date": dt.date.today().isoformat(), "command": " ".join(["python", *sys.argv])}


def peak_mib() -> float:
    """Peak resident memory of this process image. VmHWM, not ru_maxrss: Linux carries ru_maxrss
    over fork + exec, so a child would report the parent's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def load(name: str):
    from tgdist.data.graph import chronological_split
    from tgdist.data.load import load_graph
    path = DATASETS / FILES[name]
    if not path.exists():
        return None, None
    g = load_graph(path)
    return g, chronological_split(g).train_end


def evaluate_all(graph, train_end, *, num_parts, batch_size, fanouts=(10,), seed=0, weights="dedup",
                 imbalance=0.05, methods=METHODS) -> dict:
    """Balance costs of every method on one pre-sampled epoch."""
    import numpy as np

    from tgdist.partition import access, measures
    from tgdist.partition import methods as pm

    t0 = time.perf_counter()
    acc = access.build_access_graph(graph, num_parts=num_parts, batch_size=batch_size, train_end=train_end,
                                    fanouts=fanouts, seed=seed, num_threads=0)
    w = acc.weights(weights)
    cap = pm.capacity(acc.num_nodes, num_parts, imbalance)
    row = {"M": num_parts, "batch_size": batch_size, "K": fanouts[0] if fanouts else 0, "seed": seed,
           "weights": weights, "access_s": round(time.perf_counter() - t0, 3),
           "lower_bound": measures.lower_bound(w, num_parts, cap), "methods": {}}
    for name in methods:
        t0 = time.perf_counter()
        if name == "reflexbicut":
            owner = pm.reflexbicut_search(w, imbalance=imbalance, seed=seed).owner
        else:
            owner = pm.assign(acc, name, weights=weights, imbalance=imbalance, seed=seed)
        secs = time.perf_counter() - t0
        m = measures.measure(w, owner, num_parts, weights)
        cost, link, _ = measures.batch_costs(acc, owner)
        sizes = np.bincount(owner, minlength=num_parts).tolist()
        row["methods"][name] = {"balance_cost": m.balance_cost, "max_link": m.max_link, "total_volume": m.total_volume,
                                "max_send": int(m.send.max()), "max_recv": int(m.recv.max()),
                                "per_batch": measures.summary(cost), "per_batch_max_link": measures.summary(link),
                                "sizes_min_max": [min(sizes), max(sizes)], "seconds": round(secs, 3)}
    costs = {k: v["balance_cost"] for k, v in row["methods"].items()}
    if "reflexbicut" in costs:
        flex = costs["reflexbicut"]
        row["reduction_vs_range"] = round(1 - flex / costs["range"], 4)
        row["reduction_vs_interval"] = round(1 - flex / costs["interval"], 4)
        # no method can go below the lower bound: the largest reduction any partitioner could show
        row["max_possible_reduction_vs_range"] = round(1 - row["lower_bound"] / costs["range"], 4)
        row["max_possible_reduction_vs_interval"] = round(1 - row["lower_bound"] / costs["interval"], 4)
        p75 = {k: v["per_batch"]["p75"] for k, v in row["methods"].items()}
        row["per_batch_p75_reduction_vs_range"] = round(1 - p75["reflexbicut"] / p75["range"], 4)
        row["per_batch_p75_reduction_vs_interval"] = round(1 - p75["reflexbicut"] / p75["interval"], 4)
    return row


def locality(graph, train_end, *, num_parts, batch_size) -> dict:
    """Why balance is hard to improve here: how concentrated each vertex's accesses are."""

    from tgdist.partition import access
    acc = access.build_access_graph(graph, num_parts=num_parts, batch_size=batch_size, train_end=train_end)
    w = acc.dedup
    s = w.sum(axis=1)
    used = s > 0
    top = w.max(axis=1)
    return {"vertices": int(w.shape[0]), "never_accessed": int((~used).sum()),
            "majority_vertices": int((2 * top > s).sum()),
            "top_trainer_share_mean": round(float((top[used] / s[used]).mean()), 4),
            "uniform_share": round(1 / num_parts, 4),
            "volume_floor_share": round(float((s - top).sum() / s.sum()), 4)}


def child(case: str, events: int) -> dict:
    """One timing case, run in its own process: ``wikipedia`` or ``synthetic``."""
    import numpy as np

    from tgdist.data.graph import chronological_split
    from tgdist.partition import access, measures
    from tgdist.partition import methods as pm

    out = {"case": case, "rss_after_imports_mib": peak_mib()}
    t0 = time.perf_counter()
    if case == "synthetic":
        from tgdist.data.synthetic import generate
        g = generate(events, **SYNTH)
        out["graph"] = {"generator": "tgdist.data.synthetic.generate", "num_events": events, **SYNTH}
    else:
        g, _ = load(case)
    split = chronological_split(g)
    out["load_s"] = round(time.perf_counter() - t0, 2)
    out["rss_after_load_mib"] = peak_mib()
    out["describe"] = g.describe()
    fanouts = (10,)
    access.build_access_graph(g, num_parts=8, batch_size=1200, train_end=min(split.train_end, 10_000),
                              fanouts=fanouts, per_batch=False)  # compile the kernels outside the timing
    pm.reflexbicut_search(np.ones((100, 8), dtype=np.int64))
    out["rss_after_jit_warmup_mib"] = peak_mib()
    t0 = time.perf_counter()
    acc = access.build_access_graph(g, num_parts=8, batch_size=1200, train_end=split.train_end, fanouts=fanouts,
                                    num_threads=0, per_batch=case != "synthetic")
    out["access_s"] = round(time.perf_counter() - t0, 2)
    out["rss_after_access_mib"] = peak_mib()
    out["unique_accesses"] = int(acc.dedup.sum())
    out["sampled_accesses"] = int(acc.raw.sum())
    w = acc.dedup
    t0 = time.perf_counter()
    res = pm.reflexbicut_search(w)
    out["reflexbicut_s"] = round(time.perf_counter() - t0, 2)
    out["rss_after_reflexbicut_mib"] = peak_mib()
    t0 = time.perf_counter()
    greedy = pm.greedy_partition(w)
    out["greedy_s"] = round(time.perf_counter() - t0, 2)
    n = g.num_nodes
    sizes = np.bincount(res.owner, minlength=8)
    costs = {"range": measures.balance_cost(w, pm.range_partition(n, 8), 8),
             "interval": measures.balance_cost(w, pm.interval_partition(n, 8), 8),
             "greedy": measures.balance_cost(w, greedy, 8), "reflexbicut": res.balance_cost}
    out.update({"M": 8, "batch_size": 1200, "K": 10, "balance_cost": costs, "lower_bound": res.lower_bound,
                "reflexbicut_searches": res.searches, "reflexbicut_moves": res.moves,
                "sizes_min_max": [int(sizes.min()), int(sizes.max())],
                "peak_rss_mib": peak_mib()})
    return out


def run_child(case: str, events: int) -> dict:
    note(f"timing case {case} in a child process")
    r = subprocess.run([sys.executable, __file__, "--child", case, "--synthetic-events", str(events)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return {"case": case, "error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Wikipedia headline and a 1M-event timing only")
    ap.add_argument("--synthetic-events", type=at_least(1), default=None,
                    help="events of the timed synthetic graph (default 10,000,000; 1,000,000 with --quick)")
    ap.add_argument("--child", choices=("wikipedia", "synthetic"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.synthetic_events)), flush=True)
        return 0
    from tgdist.kernels import graph as kernels
    kernels.set_threads(0)
    started = time.perf_counter()
    result = {"benchmark": "partition", "machine": machine(),
              "metric": "balance cost, Sven eq. (5) read as max_j (send_j + recv_j) of C, in node memories per "
                        "epoch; dedup = unique per (batch, trainer), as Sven's all-to-all moves them",
              "setup": "training events (70%) of each data set, global batch split chronologically over M trainers, "
                       "roots = src + dst + 1 negative, K recent neighbours (L = 1), imbalance 5%, seed 0"}
    wiki, wiki_end = load("wikipedia")
    if wiki is None:
        note(f"no Wikipedia under {DATASETS}: quality sections skipped")
    else:
        note("headline: Wikipedia, M=8, batch 1200, K=10")
        result["headline"] = {w: evaluate_all(wiki, wiki_end, num_parts=8, batch_size=1200, weights=w)
                              for w in ("dedup", "raw")}
        result["headline"]["seeds"] = [
            {k: r[k] for k in ("seed", "lower_bound", "reduction_vs_range", "reduction_vs_interval")}
            | {"reflexbicut": r["methods"]["reflexbicut"]["balance_cost"], "interval": r["methods"]["interval"]["balance_cost"]}
            for r in (evaluate_all(wiki, wiki_end, num_parts=8, batch_size=1200, seed=s) for s in (1, 2))]
        result["headline"]["locality"] = locality(wiki, wiki_end, num_parts=8, batch_size=1200)
    if not args.quick:
        sweeps = {}
        for name in FILES:
            g, end = load(name)
            if g is None:
                note(f"{name}: not found under {DATASETS}, skipped")
                continue
            note(f"{name}: trainers 2..64 at batch 1200, batch 400..2400 at M=8")
            sweeps[name] = {
                "describe": g.describe(),
                "trainers": [evaluate_all(g, end, num_parts=m, batch_size=1200) for m in (2, 4, 8, 16, 64)],
                "batch_size": [evaluate_all(g, end, num_parts=8, batch_size=b) for b in (400, 800, 1200, 1600, 2000, 2400)],
                "locality_M8": locality(g, end, num_parts=8, batch_size=1200),
            }
        result["sweeps"] = sweeps
        if wiki is not None:
            note("imbalance sensitivity on Wikipedia")
            result["imbalance"] = []
            for eps in (0.0, 0.05, 0.2, 1.0):
                r = evaluate_all(wiki, wiki_end, num_parts=8, batch_size=1200, imbalance=eps,
                                 methods=("range", "interval", "reflexbicut"))
                result["imbalance"].append({"imbalance": eps, "lower_bound": r["lower_bound"],
                                            "reflexbicut": r["methods"]["reflexbicut"]["balance_cost"],
                                            "sizes_min_max": r["methods"]["reflexbicut"]["sizes_min_max"],
                                            "reduction_vs_interval": r["reduction_vs_interval"]})
    events = args.synthetic_events or (1_000_000 if args.quick else 10_000_000)
    result["timing"] = [run_child("wikipedia", events)] if wiki is not None else []
    result["timing"].append(run_child("synthetic", events))
    result["seconds"] = round(time.perf_counter() - started, 1)
    emit(result)
    failed = [t for t in result["timing"] if "error" in t]
    for t in failed:
        note(f"partition.py: error: timing case {t['case']} failed: {t['error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
