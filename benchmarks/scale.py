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
from common import emit, free_port, machine, note, run_main  # noqa: E402

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


def stream_file(args) -> Path:
    """The synthetic stream as a tgdist .npz under ``--workdir``, written once."""
    from tgdist.data.graph import save_native
    from tgdist.data.synthetic import generate

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"synthetic-{args.events}-{args.nodes}-{args.edge_dim}.npz"
    if not path.exists():
        note(f"scale: generating {args.events:,} events, {args.nodes:,} nodes, edge_dim {args.edge_dim} -> {path}")
        t0 = time.perf_counter()
        g = generate(num_events=args.events, num_nodes=args.nodes, edge_dim=args.edge_dim, seed=0)
        save_native(g, path)
        del g
        note(f"scale: written in {time.perf_counter() - t0:.0f} s ({path.stat().st_size / MIB:,.0f} MiB)")
    return path


def train_ranks(args, path: Path, backend: str) -> dict:
    run_dir = tempfile.mkdtemp(prefix="tgdist-scale-run-")
    overrides = [f"data.path={path}", "data.name=scale", f"data.cache_dir={args.cache_dir}", "model=tgn",
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
    summary = Path(run_dir) / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        rec["train_events_per_s"] = s.get("train_events_per_s")
        rec["iteration_seconds"] = s.get("train_seconds", 0) / max(1, args.iterations) if s.get("train_seconds") else None
        rec["checkpoints"] = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("*")) \
            if (Path(run_dir) / "checkpoints").exists() else []
    if rc:
        tail = Path(rec["log"]).read_text().strip().splitlines()[-5:]
        rec["error"] = " | ".join(tail)
    note(f"scale:   {json.dumps({k: v for k, v in rec.items() if k != 'log'})}")
    return rec


def section_ranks(args) -> dict:
    path = stream_file(args)
    out = {"graph": {"events": args.events, "nodes": args.nodes, "edge_dim": args.edge_dim,
                     "file_mib": round(path.stat().st_size / MIB, 1)},
           "M": args.ranks, "iterations": args.iterations, "label": args.label, "runs": []}
    for backend in args.backends:
        out["runs"].append(train_ranks(args, path, backend))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=["ranks"])
    p.add_argument("--events", type=int, default=10_000_000)
    p.add_argument("--nodes", type=int, default=1_000_000)
    p.add_argument("--edge-dim", type=int, default=172)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--backends", nargs="+", default=["depcache", "sven"])
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--batch", type=int, default=600, help="local batch per rank")
    p.add_argument("--checkpoint", action="store_true", help="checkpoint after the iterations")
    p.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp") + "/tgdist-scale")
    p.add_argument("--cache-dir", default=None, help="data.cache_dir of the runs (default: WORKDIR/cache)")
    p.add_argument("--label", default="", help="a label in the record, e.g. before / after")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("extra", nargs="*", help="more overrides for the runs")
    args = p.parse_args()
    args.cache_dir = args.cache_dir or f"{args.workdir}/cache"
    result = {"machine": machine(), "section": args.section}
    result[args.section] = section_ranks(args)
    emit(result)
    return 0


if __name__ == "__main__":
    run_main(main)
