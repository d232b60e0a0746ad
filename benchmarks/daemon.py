"""Memory daemon service cost per batch vs in-process LocalMemory on the same ids.

    python benchmarks/daemon.py                 # Wikipedia-sized: 9,227 nodes, mem_dim 100, mail_dim 372
    python benchmarks/daemon.py --no-futex      # doorbells off: spin, then plain sleeps

One batch = read 3,000 unique ids (memory, mem_ts, mail, mail_ts), then write memory and one mail
for 1,200 of them (a 600-event Wikipedia batch: src, dst, one negative and 10 neighbours each give
about 3,000 unique nodes; 1,200 endpoints are written back). Ids are random and distinct, drawn
once per batch from a seeded generator before any clock starts.

Timed in one process against one daemon (1 trainer, i = j = 1), same torch threads for both, in
interleaved blocks of ``--block`` batches (local, back to back, with gaps; the order rotates) so
that all three see the same load on a shared machine; the first round is warm-up:
- ``local``: ``LocalMemory.read`` + ``write_memory`` + ``write_mail`` (index_select / index_copy_).
- ``daemon``: ``begin; read; write_memory; write_mail; end`` back to back, so each read also waits
  until the daemon applied the previous batch's writes: the full service cost per batch. Split
  into the client's time in ``read`` (post the ids, wait, the daemon's gather), in the write calls
  (copying rows into the shared write buffer), and the daemon's own copy time (its counters);
  hand-off = client time - daemon copy time - client copy time (posting, wake-ups, waiting).
- ``daemon_gap``: the same with ``--gap-ms`` of sleep after ``end()`` (a stand-in for the next
  batch's sampling and compute): the daemon applies the writes during the gap and sleeps on its
  doorbell, so the read pays a wake-up but not the writes; the read latency is reported.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse() -> argparse.Namespace:
    # common imports numpy only: tgdist.memory.shm must be imported after --no-futex is read
    from common import at_least

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=at_least(1), default=9227, help="rows of the node memory")
    ap.add_argument("--mem-dim", type=at_least(1), default=100, help="memory columns")
    ap.add_argument("--mail-dim", type=at_least(1), default=372, help="2 * mem_dim + edge_dim (Wikipedia: 172)")
    ap.add_argument("--read-ids", type=at_least(1), default=3000, help="rows read per batch (at most --nodes)")
    ap.add_argument("--write-ids", type=at_least(1), default=1200, help="rows written per batch (at most --read-ids)")
    ap.add_argument("--batches", type=at_least(1), default=400,
                    help="timed batches per variant (one more block warms up)")
    ap.add_argument("--threads", type=at_least(1), default=1, help="torch threads of the client and of the daemon")
    ap.add_argument("--gap-ms", type=at_least(0.0, float), default=5.0, help="sleep after each batch (the next "
                    "batch's compute)")
    ap.add_argument("--block", type=at_least(1), default=25, help="batches per interleaved block")
    ap.add_argument("--no-futex", action="store_true", help="set TGDIST_NO_FUTEX=1 (client and daemon)")
    ap.add_argument("--seed", type=at_least(0), default=0)
    args = ap.parse_args()
    if args.read_ids > args.nodes or args.write_ids > args.read_ids:
        ap.error(f"--write-ids {args.write_ids} <= --read-ids {args.read_ids} <= --nodes {args.nodes} must hold")
    return args


def main() -> None:
    a = parse()
    if a.no_futex:
        os.environ["TGDIST_NO_FUTEX"] = "1"  # before tgdist.memory.shm is imported; the daemon inherits it
    import torch
    from common import emit, machine, note

    from tgdist.memory import shm
    from tgdist.memory.daemon import start_daemon
    from tgdist.memory.store import LocalMemory

    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(a.seed)
    total = a.batches + a.block
    batches = []
    for _ in range(total):
        ids = torch.randperm(a.nodes, generator=g)[: a.read_ids]
        w = ids[torch.randperm(a.read_ids, generator=g)[: a.write_ids]]
        batches.append((ids, w, torch.randn(a.write_ids, a.mem_dim, generator=g),
                        torch.rand(a.write_ids, generator=g, dtype=torch.float64),
                        torch.randn(a.write_ids, a.mail_dim, generator=g)))

    def stats_us(t):
        return {"median": round(statistics.median(t) * 1e6, 1), "mean": round(statistics.fmean(t) * 1e6, 1),
                "p90": round(sorted(t)[int(0.9 * len(t))] * 1e6, 1)}

    local = LocalMemory(a.nodes, a.mem_dim, a.mail_dim, 1)
    note("[daemon] starting the daemon")
    rec = {k: [] for k in ("local", "local_read", "daemon", "daemon_read", "daemon_write", "daemon_end", "gap_read")}
    with start_daemon(0, 1, num_nodes=a.nodes, mem_dim=a.mem_dim, mail_dim=a.mail_dim, max_ids=a.read_ids,
                      max_write=a.write_ids, num_threads=a.threads) as h:
        m = h.attach(0)
        pos = 0
        d_read_ns = d_write_ns = 0
        n_daemon = 0

        def run_local(k, keep):
            ids, w, mem, ts, mail = batches[k]
            t0 = time.perf_counter()
            local.read(ids)
            t1 = time.perf_counter()
            local.write_memory(w, mem, ts)
            local.write_mail(w, mail, ts)
            t2 = time.perf_counter()
            if keep:
                rec["local"].append(t2 - t0)
                rec["local_read"].append(t1 - t0)

        def run_daemon(k, keep, gap):
            nonlocal pos
            ids, w, mem, ts, mail = batches[k]
            t0 = time.perf_counter()
            m.begin(pos)
            m.read(ids)
            t1 = time.perf_counter()
            m.write_memory(w, mem, ts)
            m.write_mail(w, mail, ts)
            t2 = time.perf_counter()
            m.end()
            t3 = time.perf_counter()
            pos += 1
            if gap:
                time.sleep(a.gap_ms / 1e3)
            if keep and gap:
                rec["gap_read"].append(t1 - t0)
            elif keep:
                rec["daemon"].append(t3 - t0)
                rec["daemon_read"].append(t1 - t0)
                rec["daemon_write"].append(t2 - t1)
                rec["daemon_end"].append(t3 - t2)

        # Interleaved blocks (local, back to back, with gaps; the order rotates) so that the three
        # see the same machine load; the first block of each is warm-up. Inside a back-to-back
        # block each read also waits for the previous batch's writes, as in a tight loop.
        block = a.block
        nblocks = -(-total // block)
        note(f"[daemon] {nblocks} rounds of 3 blocks of {block} batches")
        for bi in range(nblocks):
            ks = range(bi * block, min((bi + 1) * block, total))
            keep = bi > 0
            for mode in [("local", "b2b", "gap"), ("b2b", "gap", "local"), ("gap", "local", "b2b")][bi % 3]:
                if mode == "local":
                    for k in ks:
                        run_local(k, keep)
                elif mode == "b2b":
                    s0 = m.daemon_stats()
                    for k in ks:
                        run_daemon(k, keep, False)
                    m.begin(pos)  # wait until the block's last writes are applied
                    m.read(batches[0][0][:1])
                    m.end()
                    pos += 1
                    s1 = m.daemon_stats()
                    if keep:
                        d_read_ns += s1["read_ns"] - s0["read_ns"]
                        d_write_ns += s1["write_ns"] - s0["write_ns"]
                        n_daemon += len(ks)
                else:
                    for k in ks:
                        run_daemon(k, keep, True)
        m.close()
    loc, dae = stats_us(rec["local"]), stats_us(rec["daemon"])
    client = statistics.fmean(rec["daemon"]) * 1e6
    copy_in = statistics.fmean(rec["daemon_write"]) * 1e6
    d_read, d_write = d_read_ns / 1e3 / n_daemon, d_write_ns / 1e3 / n_daemon
    out = {
        "daemon": {
            "per_batch_us": dae,
            "client_read_call_us": stats_us(rec["daemon_read"]),
            "client_write_copy_us": round(copy_in, 1),
            "client_end_us": round(statistics.fmean(rec["daemon_end"]) * 1e6, 1),
            "daemon_read_copy_us": round(d_read, 1),
            "daemon_write_apply_us": round(d_write, 1),
            "handoff_us": round(client - copy_in - d_read - d_write, 1),
        },
        "daemon_gap": {"gap_ms": a.gap_ms, "client_read_call_us": stats_us(rec["gap_read"])},
    }
    res = {
        "benchmark": "daemon", **machine(),
        "setup": {"nodes": a.nodes, "mem_dim": a.mem_dim, "mail_dim": a.mail_dim, "mailbox_size": 1,
                  "read_ids": a.read_ids, "write_ids": a.write_ids, "batches": a.batches, "block": a.block,
                  "threads": a.threads, "futex": shm.has_futex()},
        "local": {"per_batch_us": loc, "read_us": stats_us(rec["local_read"])},
        **out,
        "ratio_daemon_vs_local_median": round(out["daemon"]["per_batch_us"]["median"] / loc["median"], 2),
        "ratio_daemon_vs_local_mean": round(out["daemon"]["per_batch_us"]["mean"] / loc["mean"], 2),
        # DistTGL's point: end() returns at once and the daemon applies the writes off the trainer's
        # critical path, which then holds only the read (after a gap) against local read + write.
        "ratio_gap_read_vs_local_median": round(out["daemon_gap"]["client_read_call_us"]["median"] / loc["median"], 2),
    }
    emit(res)


if __name__ == "__main__":
    from common import run_main

    run_main(main)
