"""How long a checkpoint holds the training loop: synchronous writes against background writes.

    python benchmarks/checkpoint_stall.py --nodes 1000000 --trainers 4 --backend depcache --every 40

Both modes run in the same invocation, one after the other, as real `torchrun` launches of this
script (gloo on CPU, 1 torch thread per process): M trainers of one memory group (parallel.i=M)
train on a synthetic stream whose node memory has `--nodes` rows (mem_dim 100, mail_dim 200: the
default model) and checkpoint every `--every` iterations. Per checkpoint it reports, for each rank,
the time `Run.save` held the training loop (the stall) and the time the writer thread took for the
files (the write); the mode `sync` waits for its writes inside save (what tgdist did before), the
mode `background` does not. It also reports each rank's mean iteration time, saves left out: a
background write that competes with training for the cores slows the iterations it overlaps, which
the two modes' means show. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import at_least, emit, free_port, machine, note, run_main


def overrides(args, run_dir: str) -> list[str]:
    return ["data=synthetic", f"data.synthetic.num_nodes={args.nodes}", f"data.synthetic.num_events={args.events}",
            f"parallel.i={args.trainers}", f"memory.backend={args.backend}", f"train.batch_size={args.batch}",
            "train.epochs=1", f"train.checkpoint_every={args.every}", "train.num_neg_eval=1",
            "train.num_threads=1", "sampler.num_threads=1", "train.progress=false", f"run_dir={run_dir}"]


def worker(out: str, mode: str, cfg_args: list[str]) -> None:
    """One rank under torchrun: train, then leave this rank's figures in ``out``."""
    from tgdist.runtime.build import compose
    from tgdist.runtime.run import Run

    Run.background_writes = mode == "background"
    run = Run(compose(cfg_args), cfg_args[-1].split("=", 1)[1])
    stamps = []
    run.train(on_iteration=lambda t, loss: stamps.append((t, time.perf_counter())))
    every = run.cfg.train.checkpoint_every
    # iteration t: from t-1's end to t's end, less the save between them (after iteration t-1 when t % every == 0)
    durations = [b - a - (run.save_seconds[t // every - 1] if t % every == 0 else 0.0)
                 for (_, a), (t, b) in zip(stamps, stamps[1:])]
    Path(out, f"{mode}-{run.rank}.json").write_text(json.dumps({
        "rank": run.rank, "save_seconds": run.save_seconds, "write_seconds": run._writer.busy_seconds,
        "checkpoints": len(run.save_seconds), "iteration_s": sum(durations) / max(len(durations), 1),
        "iterations": len(stamps)}))


def launch(args, mode: str) -> dict:
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        cfg_args = overrides(args, f"{d}/run")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.trainers),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", __file__, "--worker", d, mode,
               *cfg_args]
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode:
            raise RuntimeError(f"{mode}: torchrun failed (exit {r.returncode}): {r.stderr[-2000:]}")
        ranks = [json.loads(Path(d, f"{mode}-{i}.json").read_text()) for i in range(args.trainers)]
        last = Path(d, "run", "checkpoints", "last.pt")
        size = sum(p.stat().st_size for p in last.parent.rglob("*.pt"))
    n = ranks[0]["checkpoints"]
    # the checkpoints taken every --every iterations (the last save, at the end of the run, waits for its
    # write in both modes: the run ends only once last.pt names it)
    per = [{"stall_s_max_over_ranks": max(r["save_seconds"][c] for r in ranks),
            "stall_s_per_rank": [round(r["save_seconds"][c], 4) for r in ranks]} for c in range(n - 1)]
    writes = [r["write_seconds"] for r in ranks]
    return {"mode": mode, "wall_seconds": time.perf_counter() - start, "checkpoints_mid_run": n - 1,
            "checkpoint_bytes": size, "per_checkpoint": per,
            "write_s_per_checkpoint_max_over_ranks": max(writes) / n,
            "end_of_run_save_s_max_over_ranks": max(r["save_seconds"][-1] for r in ranks),
            "mean_iteration_s_without_saves": [round(r["iteration_s"], 4) for r in ranks]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=at_least(1), default=1_000_000)
    p.add_argument("--events", type=at_least(1), default=590_000)
    p.add_argument("--trainers", type=at_least(2), default=4, help="M: trainers of the one memory group (parallel.i)")
    p.add_argument("--backend", default="depcache", choices=["depcache", "sven", "daemon"])
    p.add_argument("--batch", type=at_least(1), default=600)
    p.add_argument("--every", type=at_least(1), default=40,
                   help="train.checkpoint_every: iterations long enough for a write to end before the next save")
    p.add_argument("--tmp", default=None, help="where the run directories go (the checkpoints' file system)")
    args = p.parse_args()
    note(f"checkpoint stall: {args.nodes:,} nodes, {args.trainers} trainers, {args.backend}")
    out = {"machine": machine(), "settings": vars(args)}
    for mode in ("sync", "background"):
        out[mode] = launch(args, mode)
        note(f"{mode}: {json.dumps(out[mode]['per_checkpoint'])}")
    write = out["sync"]["write_s_per_checkpoint_max_over_ranks"]
    stalls = [c["stall_s_max_over_ranks"] for c in out["background"]["per_checkpoint"]]
    out["headline"] = {"write_s": write,
                       "sync_stall_s": [c["stall_s_max_over_ranks"] for c in out["sync"]["per_checkpoint"]],
                       "background_stall_s": stalls,
                       "background_stall_over_write": [s / write for s in stalls]}
    emit(out)


if __name__ == "__main__":
    run_main(main)
