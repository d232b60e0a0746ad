"""Memory of M ranks on one machine as the stream grows (issue 42): per-rank RSS and PSS, their sums,
and the machine's memory, while ``torchrun`` trains a synthetic stream with edge features.

    python benchmarks/scale.py ranks --events 10000000 --nodes 1000000 --edge-dim 172 --backends depcache sven
    python benchmarks/scale.py build --events 100000000 --edge-dim 16        # the streaming build alone
    python benchmarks/scale.py gather --events 2000000 --edge-dim 172       # feature gather: mapped vs in memory

``ranks``: writes the stream once as a tgdist ``.npz`` (``--workdir``, reused when there), then per
backend starts ``torchrun --nproc-per-node M -m tgdist.train`` on it with ``train.stop_after_batches``
and polls every rank's ``/proc/PID/smaps_rollup`` (RSS: pages resident in the process, shared ones
counted in full; PSS: each shared page divided among the processes that map it, so the sum of PSS
over ranks counts a page cache page once) and the machine's ``MemTotal - MemAvailable``. The peaks
are reported, with the training's iteration time from the run's summary. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import at_least, emit, free_port, machine, note, run_main  # noqa: E402

MIB = 2**20


def meminfo() -> dict:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def machine_used() -> int:
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]


def rollup(pid: int) -> dict | None:
    """``Rss`` and ``Pss`` (bytes) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("Rss:", "Pss:", "Pss_Anon:", "Pss_File:", "Pss_Shmem:"):
            out[parts[0][:-1].lower()] = int(parts[1]) * 1024
    return out


def rank_pids(root: int) -> list[int]:
    """The training processes under a torchrun: its descendants whose command line runs tgdist."""
    import psutil

    try:
        kids = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in kids:
        try:
            if "tgdist.train" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            continue
    return sorted(out)


class Poller(threading.Thread):
    """Samples every rank's RSS and PSS and the machine's memory until stopped; keeps the peaks."""

    def __init__(self, root: int, every: float = 0.25):
        super().__init__(daemon=True)
        self.root, self.every = root, every
        self.stop = threading.Event()
        self.base = machine_used()
        self.peak = {"machine_used": 0, "sum_rss": 0, "sum_pss": 0}
        self.per_pid: dict[int, dict] = {}
        self.samples = 0

    def run(self) -> None:
        while not self.stop.is_set():
            pids = rank_pids(self.root)
            rs = {pid: rollup(pid) for pid in pids}
            rs = {pid: r for pid, r in rs.items() if r}
            if rs:
                self.samples += 1
                self.peak["sum_rss"] = max(self.peak["sum_rss"], sum(r.get("rss", 0) for r in rs.values()))
                self.peak["sum_pss"] = max(self.peak["sum_pss"], sum(r.get("pss", 0) for r in rs.values()))
                for pid, r in rs.items():
                    mine = self.per_pid.setdefault(pid, {})
                    for k, v in r.items():
                        mine[k] = max(mine.get(k, 0), v)
            self.peak["machine_used"] = max(self.peak["machine_used"], machine_used() - self.base)
            self.stop.wait(self.every)

    def result(self) -> dict:
        ranks = [self.per_pid[p] for p in sorted(self.per_pid)]
        return {"ranks": len(ranks), "samples": self.samples,
                "peak_rss_mib": [round(r.get("rss", 0) / MIB, 1) for r in ranks],
                "peak_pss_mib": [round(r.get("pss", 0) / MIB, 1) for r in ranks],
                "peak_pss_anon_mib": [round(r.get("pss_anon", 0) / MIB, 1) for r in ranks],
                "peak_pss_file_mib": [round(r.get("pss_file", 0) / MIB, 1) for r in ranks],
                "peak_sum_rss_mib": round(self.peak["sum_rss"] / MIB, 1),
                "peak_sum_pss_mib": round(self.peak["sum_pss"] / MIB, 1),
                "peak_machine_used_mib": round(self.peak["machine_used"] / MIB, 1)}


def written_once(args, name: str, write) -> Path:
    """``--workdir``/``name``, made by ``write(path)`` unless an earlier run left it there."""
    path = Path(args.workdir) / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        note(f"scale: writing {path} ({args.events:,} events, {args.nodes:,} nodes)")
        t0 = time.perf_counter()
        write(path)
        note(f"scale: written in {time.perf_counter() - t0:.0f} s ({path.stat().st_size / MIB:,.0f} MiB)")
    return path


def stream_file(args) -> Path:
    """The synthetic stream, with ``--edge-dim`` features, as a tgdist .npz."""
    from tgdist.data.readers.native import save_native
    from tgdist.data.synthetic import generate

    return written_once(args, f"synthetic-{args.events}-{args.nodes}-{args.edge_dim}.npz", lambda path: save_native(
        generate(num_events=args.events, num_nodes=args.nodes, edge_dim=args.edge_dim, seed=0), path))


def train_ranks(args, path: Path | None, backend: str) -> dict:
    run_dir = tempfile.mkdtemp(prefix="tgdist-scale-run-")
    data = [f"data.path={path}"] if path is not None else [
        "data=synthetic", f"data.synthetic.num_events={args.events}", f"data.synthetic.num_nodes={args.nodes}",
        f"data.synthetic.edge_dim={args.edge_dim}"]
    overrides = [*data, "data.name=scale", f"data.cache_dir={args.cache_dir}", "model=tgn",
                 f"parallel.i={args.ranks}", f"memory.backend={backend}", "train.epochs=1",
                 f"train.batch_size={args.batch}", "train.num_threads=1", "sampler.num_threads=1",
                 "train.progress=false", f"train.stop_after_batches={args.iterations}", "partition.method=interval",
                 f"run_dir={run_dir}", *args.extra]
    if args.checkpoint:
        overrides.append(f"train.checkpoint_every={args.iterations}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "tgdist.train", *overrides]
    note(f"scale: {args.ranks} ranks, {backend}: {' '.join(overrides)}")
    t0 = time.perf_counter()
    log = open(Path(run_dir).with_suffix(".log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    poll = Poller(proc.pid)
    poll.start()
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = -9
    poll.stop.set()
    poll.join()
    log.close()
    rec = {"backend": backend, "exit": rc, "seconds": round(time.perf_counter() - t0, 1), **poll.result(),
           "log": str(Path(run_dir).with_suffix(".log"))}
    rec.update(log_times(Path(run_dir) / "train.log", args.iterations))
    lines = Path(rec["log"]).read_text().strip().splitlines()
    try:
        rec["summary"] = json.loads(lines[-1]) if lines else None  # rank 0's last line
    except ValueError:
        rec["summary"] = None
    ckpt = Path(run_dir) / "checkpoints"
    rec["checkpoints"] = sorted(p.name for p in ckpt.glob("*")) if ckpt.exists() else []
    if rc:
        tail = Path(rec["log"]).read_text().strip().splitlines()[-5:]
        rec["error"] = " | ".join(tail)
    note(f"scale:   {json.dumps({k: v for k, v in rec.items() if k != 'log'})}")
    return rec


def log_times(log: Path, iterations: int) -> dict:
    """From rank 0's ``train.log``: seconds from its start to the set-up's end (the memory store's
    line) and from there to ``stopping after N training iterations``, per iteration (the log's
    clock has one-second steps, so over 30 iterations or more)."""
    import datetime as dt

    def at(line: str):
        return dt.datetime.strptime(line[1:9], "%H:%M:%S")

    try:
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("[")]
    except OSError:
        return {}
    ready = next((ln for ln in lines if "memory.backend=" in ln or "rows held" in ln), None)
    stop = next((ln for ln in lines if "stopping after" in ln), None)
    if not lines or ready is None or stop is None:
        return {}
    setup, train = (at(ready) - at(lines[0])).total_seconds(), (at(stop) - at(ready)).total_seconds()
    return {"setup_seconds_log": setup, "train_seconds_log": train, "iteration_seconds": round(train / iterations, 3)}


def section_ranks(args) -> dict:
    path = None if args.synthetic else stream_file(args)
    out = {"graph": {"events": args.events, "nodes": args.nodes, "edge_dim": args.edge_dim,
                     "file_mib": round(path.stat().st_size / MIB, 1) if path else None,
                     "source": "data=synthetic, generated by the first rank into the cache" if args.synthetic
                     else "a tgdist .npz"},
           "M": args.ranks, "iterations": args.iterations, "label": args.label, "runs": []}
    for backend in args.backends:
        out["runs"].append(train_ranks(args, path, backend))
    return out


def section_gather(args) -> dict:
    """Per batch: gathering the edge features of a TGN batch's sampled events (recent neighbours,
    fanout 10, of the batch's sources, destinations and negatives, and the batch's own events for
    the mails) from a private in-memory copy, from the map with its pages in the page cache (warm),
    and from the map after its pages were dropped (``posix_fadvise(DONTNEED)``: cold, as when the
    features are larger than memory and come from disk). The same batches, in order, each way."""
    import gc

    import numpy as np
    import torch

    from tgdist.data.load import load_data
    from tgdist.data.sampler import TCSR, NegativeSampler, TemporalSampler
    from tgdist.runtime.build import compose
    from tgdist.runtime.features import host_tensor

    cfg = compose(["data=synthetic", f"data.synthetic.num_events={args.events}",
                   f"data.synthetic.num_nodes={args.nodes}", f"data.synthetic.edge_dim={args.edge_dim}",
                   f"data.cache_dir={args.cache_dir}"])
    g = load_data(cfg.data)
    feat_file = Path(g.mapped) / "edge_feat.npy"
    sampler = TemporalSampler(TCSR.build(g), [10], strategy="recent")
    neg = NegativeSampler(g, 0)
    batches = []
    lo = int(0.1 * g.num_events)  # past the start, where nodes have histories
    for _ in range(args.batches):
        hi = lo + args.batch
        roots = np.concatenate([g.src[lo:hi], g.dst[lo:hi], neg.train(hi - lo)[:, 0]])
        ts = np.tile(g.t[lo:hi], 3)
        hop = sampler.sample(roots, ts)[0]
        ev = np.unique(np.concatenate([hop.eid[hop.mask], np.arange(lo, hi)]))
        batches.append(torch.from_numpy(ev))
        lo = hi
    rows = float(np.mean([b.numel() for b in batches]))
    del g, sampler
    gc.collect()

    def timed(table) -> list[float]:
        out = []
        for b in batches:
            t0 = time.perf_counter()
            x = table.index_select(0, b)
            out.append(time.perf_counter() - t0)
            del x
        return out

    def drop_pages() -> None:
        fd = os.open(feat_file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def mapped_table():
        return host_tensor(np.asarray(np.load(feat_file, mmap_mode="r")))

    res = {}
    drop_pages()
    cached_before = meminfo()["Cached"]
    table = mapped_table()
    res["mapped_cold"] = timed(table)
    res["mapped_warm"] = timed(table)
    cached_after = meminfo()["Cached"]
    del table
    gc.collect()
    private = torch.from_numpy(np.load(feat_file))  # read into this process's own memory
    timed(private)  # first touch of the copy's pages
    res["in_memory"] = timed(private)
    del private

    def stats(xs):
        xs = sorted(xs)
        return {"median_ms": round(1e3 * xs[len(xs) // 2], 3), "mean_ms": round(1e3 * sum(xs) / len(xs), 3)}

    out = {"events": args.events, "edge_dim": args.edge_dim, "batch": args.batch, "batches": args.batches,
           "rows_per_batch": round(rows, 1), "bytes_per_batch": round(rows * args.edge_dim * 4),
           "feature_file_mib": round(feat_file.stat().st_size / MIB, 1),
           "page_cache_growth_mib_over_the_cold_pass": round((cached_after - cached_before) / MIB, 1),
           **{k: stats(v) for k, v in res.items()}}
    base = out["in_memory"]["median_ms"]
    out["median_over_in_memory"] = {k: round(out[k]["median_ms"] / base, 2) for k in ("mapped_warm", "mapped_cold")}
    note(f"scale: gather {json.dumps(out)}")
    return out


CONVERT = """
import json, logging, os, sys, time
from tgdist.data.load import load_graph
logging.basicConfig(level=logging.INFO, format="%(message)s")
t0 = time.perf_counter()
g = load_graph(sys.argv[1], cache_dir=sys.argv[2])
seconds = time.perf_counter() - t0
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
out = sum(os.path.getsize(os.path.join(g.mapped, f)) for f in os.listdir(g.mapped))
print(json.dumps({"seconds": round(seconds, 1), "peak_rss_mib": round(hwm / 2**20, 1), "output_mib": round(out / 2**20, 1),
                  "events": g.num_events, "nodes": g.num_nodes}))
"""


def section_build(args) -> dict:
    """Converting a text edge list (``src,dst,t``, written once from the synthetic stream) to the
    mapped cache entry, in a fresh process: its peak RSS (``VmHWM``) against the entry's size, the
    time, and the progress lines it logged. The baseline is the same process's RSS after imports."""
    from tgdist.data.readers.edgelist import save_edgelist
    from tgdist.data.synthetic import generate

    csv = written_once(args, f"edges-{args.events}-{args.nodes}.csv", lambda path: save_edgelist(
        generate(num_events=args.events, num_nodes=args.nodes, seed=0), path, chunk=1 << 20))
    cache = Path(args.cache_dir) / "build"
    import shutil
    shutil.rmtree(cache, ignore_errors=True)
    base = subprocess.run([sys.executable, "-c", "import tgdist.data.load, tgdist.kernels.graph; print(next(int(l.split()[1]) "
                          "for l in open('/proc/self/status') if l.startswith('VmRSS')) * 1024)"],
                          capture_output=True, text=True, check=True)
    r = subprocess.run([sys.executable, "-c", CONVERT, str(csv), str(cache)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"scale: the conversion failed: {r.stderr.strip().splitlines()[-1:]}")
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    rec.update(csv_mib=round(csv.stat().st_size / MIB, 1), baseline_rss_mib=round(int(base.stdout) / MIB, 1),
               peak_over_output=round(rec["peak_rss_mib"] / rec["output_mib"], 3),
               peak_less_baseline_over_output=round((rec["peak_rss_mib"] - int(base.stdout) / MIB) / rec["output_mib"], 3),
               progress_lines=[ln for ln in r.stderr.splitlines() if "reading " in ln][:12])
    shutil.rmtree(cache, ignore_errors=True)
    note(f"scale: build {json.dumps(rec)}")
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=["ranks", "gather", "build"])
    p.add_argument("--batches", type=at_least(1), default=200, help="gather: batches timed each way")
    p.add_argument("--events", type=at_least(1), default=10_000_000)
    p.add_argument("--nodes", type=at_least(2), default=1_000_000)
    p.add_argument("--edge-dim", type=at_least(0), default=172)
    p.add_argument("--ranks", type=at_least(1), default=4)
    p.add_argument("--backends", nargs="+", default=["depcache", "sven"])
    p.add_argument("--iterations", type=at_least(1), default=30)
    p.add_argument("--batch", type=at_least(1), default=600, help="local batch per rank")
    p.add_argument("--checkpoint", action="store_true", help="checkpoint after the iterations")
    p.add_argument("--synthetic", action="store_true",
                   help="train on data=synthetic (the first rank generates it into the cache) instead of an .npz")
    p.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp") + "/tgdist-scale")
    p.add_argument("--cache-dir", default=None, help="data.cache_dir of the runs (default: WORKDIR/cache)")
    p.add_argument("--label", default="", help="a label in the record, e.g. before / after")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("extra", nargs="*", help="more overrides for the runs")
    args = p.parse_args()
    args.cache_dir = args.cache_dir or f"{args.workdir}/cache"
    result = {"machine": machine(), "section": args.section}
    result[args.section] = {"ranks": section_ranks, "gather": section_gather, "build": section_build}[args.section](args)
    emit(result)
    return 0


if __name__ == "__main__":
    run_main(main)
