"""Memory backends (Sven's partitioned memory): DepCache vs DepComm vs Sven, bytes, balance, memory, time.

    python benchmarks/memory_backends.py                      # every section (about 15 min on 2 cores)
    python benchmarks/memory_backends.py --sections bytes --data wikipedia --models tgn --trainers 2

Every measurement is a real parallel run: one ``torchrun`` per case (gloo on CPU, one torch thread
per rank), this script as each rank (``--worker``), where the backends of the case are trained one
after the other in the same processes, each a ``tgdist.runtime.run.Run`` (as ``tgdist train``
runs them). Each rank writes its byte counters per phase, the rows of node memory it holds, its
peak resident memory and its clock; the parent sums the ranks. Sections:

- ``bytes``: bytes per epoch per phase, payload apart from indices, summed over every rank's sent
  and received bytes (Sven counts each byte twice too), beside Sven's formulas (7)-(9)
  (``tgdist.memory.volumes``) for the epoch's N1, eta1, N2, eta2 and M; DepComm both ways
  (``memory.remote_dispatch``: a row per sampled occurrence, its default, and per distinct node).
- ``links``: the largest per-link dispatch volume of the sven backend under range, interval and
  Re-FlexBiCut placement (the balance Sven eq. (5) targets).
- ``memory``: rows and bytes of node memory held per trainer, and each rank's peak RSS, depcache
  against sven and depcomm on a synthetic graph with many nodes (each backend its own launch, so
  one backend's peak does not hide another's; a few iterations only).
- ``time``: epoch time at M = 2 and 4 under the simulated links ``eth10`` and ``ib100``
  (``parallel.link``, a model of the network, not a measurement of one), every backend in the
  same launch after a warm-up run.

Data slices (``--max-events``) keep it within minutes on 2 cores; the JSON says what ran.
Prints one JSON object on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from common import at_least, emit, machine, note, rank_records, run_main, torchrun_ranks

SECTIONS = ("bytes", "links", "memory", "time")
BACKENDS = ("depcache", "depcomm", "sven")
# the bytes section also runs DepComm with one row per distinct node (its default sends one per
# sampled occurrence, as the paper's DepComm and eq. (8))
DISTINCT = "depcomm:memory.remote_dispatch=distinct"
# the phases a backend's exchanges count under (gradients: the all-reduce every backend shares)
PHASES = ("dispatch", "remote_dispatch", "backward", "aggregation")


# ------------------------------------------------------------------------------------------------
# One rank (under torchrun)


def vm(field: str) -> float:
    """``VmHWM`` / ``VmRSS`` of this process in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one_run(spec: str, base: list[str], groups, rank: int) -> dict:
    """Train one backend (``BACKEND`` or ``BACKEND:KEY=VALUE;KEY=VALUE``) on this rank; its counts."""
    import shutil

    from tgdist.runtime.build import build_trainer, compose
    from tgdist.runtime.run import Run

    backend, _, extra = spec.partition(":")
    cfg = compose([*base, f"memory.backend={backend}", *filter(None, extra.split(";"))])
    run_dir = tempfile.mkdtemp(prefix="tgdist-membench-") if rank == 0 else None
    # no local memory: the backend's store replaces it (as a Run that builds its own trainer does)
    driver = Run(cfg, run_dir, trainer=build_trainer(cfg, progress=False, local_memory=False), groups=groups)
    tr, store = driver.trainer, driver.trainer.memory
    m = tr.model
    rec = {"spec": spec, "rss_after_build_mib": vm("VmRSS"), "peak_rss_after_build_mib": vm("VmHWM"), "n1": 0, "d1": 0, "events": 0, "d2": 0,
           "iterations": 0, "mem_dim": m.mem_dim, "mail_dim": m.mail_dim, "mailbox_size": m.mailbox_size,
           "num_nodes": tr.g.num_nodes}
    prepare, write_memory, end_training = tr.prepare, store.write_memory, store.end_training

    def counting_prepare(lo, hi, neg, read=None, **kw):  # N1, N1 (1 - eta1) and the events of this trainer's batch
        p = prepare(lo, hi, neg, read, **kw)
        rec["n1"] += p.root_idx.numel() + sum(int(h.mask.sum()) for h in p.hop_tables)
        rec["d1"] += p.ids.numel()
        rec["events"] += hi - lo
        return p

    def counting_write_memory(ids, mem, mem_ts):  # N2 (1 - eta2): the distinct nodes it writes
        rec["d2"] += ids.numel()
        return write_memory(ids, mem, mem_ts)

    def held_end_training(evaluates):  # what training held, before rank 0 gathers all for evaluation
        tr.prepare, store.write_memory = prepare, write_memory  # rank 0's evaluation is not training
        rec["rows_held"] = store.rows_held() if hasattr(store, "rows_held") else store.num_nodes
        rec["bytes_held"] = (store.bytes_held() if hasattr(store, "bytes_held") else
                             sum(b.numel() * b.element_size() for b in store.buffers()))
        rec["counters"] = driver.counter.as_dict()  # the training iterations' bytes (evaluation's apart)
        rec["link_rows"] = {k: v.tolist() for k, v in getattr(store, "link_rows", {}).items()}
        rec["rss_end_of_training_mib"] = vm("VmRSS")
        rec["peak_rss_training_mib"] = vm("VmHWM")
        rec["train_seconds"] = time.perf_counter() - rec.pop("_start")
        end_training(evaluates)

    tr.prepare, store.write_memory, store.end_training = counting_prepare, counting_write_memory, held_end_training

    def tick(t, loss):
        rec["iterations"] += 1

    try:
        rec["_start"] = time.perf_counter()
        summary = driver.train(on_iteration=tick)
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
    if "_start" in rec:  # stopped early (train.stop_after_batches): end_training never ran
        rec["train_seconds"] = time.perf_counter() - rec.pop("_start")
        rec["rows_held"] = store.rows_held() if hasattr(store, "rows_held") else store.num_nodes
        rec["bytes_held"] = (store.bytes_held() if hasattr(store, "bytes_held") else
                             sum(b.numel() * b.element_size() for b in store.buffers()))
        rec["counters"] = driver.counter.as_dict()
        rec["link_rows"] = {k: v.tolist() for k, v in getattr(store, "link_rows", {}).items()}
        rec["peak_rss_training_mib"] = vm("VmHWM")
    rec["train_events_per_s"] = summary.get("train_events_per_s")
    rec["stopped"] = bool(summary.get("stopped"))
    return rec


def worker(out: str, runs: list[str], base: list[str]) -> None:
    rank_records(out, base, lambda groups, rank: [one_run(spec, base, groups, rank) for spec in runs])


# ------------------------------------------------------------------------------------------------
# The parent


def launch(nproc: int, runs: list[str], overrides: list[str], timeout: float) -> list[list[dict]]:
    """One torchrun of ``nproc`` ranks training ``runs`` in turn; per rank, per run, its record."""
    ranks = torchrun_ranks(__file__, nproc, [",".join(runs), *overrides], timeout, what=f"{nproc} ranks, {runs}",
                           prefix="tgdist-membench-")
    return [[ranks[k][i] for k in range(nproc)] for i in range(len(runs))]  # [run][rank]


def common_overrides(args, data: str, model: str, m: int, max_events: int | None) -> list[str]:
    out = [f"data={data}", f"model={model}", f"parallel.i={m}", "parallel.j=1", "parallel.k=1", "train.epochs=1",
           f"train.batch_size={args.global_batch // m}", "train.num_threads=1", "sampler.num_threads=1",
           "train.progress=false", "train.num_neg_eval=1", "train.test_every_epoch=false"]
    if max_events:
        out.append(f"data.max_events={max_events}")
    return out


def group_bytes(ranks: list[dict]) -> dict:
    """Per phase: payload and index bytes, sent + received over every rank (each byte twice)."""
    out = {}
    for rec in ranks:
        for name, c in rec["counters"].items():
            out[name] = out.get(name, 0) + c["bytes_sent"] + c["bytes_received"]
    return out


def formulas(ranks: list[dict]) -> dict:
    """Sven (7)-(9) for the epoch this group ran: N1, eta1, N2, eta2 as counted, the ideal remote
    share (M - 1) / M. Rows: d_mem C0 = a memory row + its float64 time; d_msg C0 = the mails a node
    holds (its ring of ``mailbox_size``) for the dispatch term, one mail for the aggregation term."""
    from tgdist.memory import volumes

    r0, m = ranks[0], len(ranks)
    mem_b, mail_b = 4 * r0["mem_dim"] + 8, 4 * r0["mail_dim"] + 8
    ring_b = r0["mailbox_size"] * mail_b
    n1, d1 = sum(r["n1"] for r in ranks), sum(r["d1"] for r in ranks)
    n2, d2 = 2 * sum(r["events"] for r in ranks), sum(r["d2"] for r in ranks)
    eta1, eta2 = 1 - d1 / n1, 1 - d2 / n2
    sven1 = volumes.sven_volume(n1, eta1, n2, eta2, m, mem_b, ring_b)[0]
    sven2 = volumes.sven_volume(n1, eta1, n2, eta2, m, mem_b, mail_b)[1]
    depcomm1, depcomm2 = volumes.depcomm_volume(n1, n2, eta2, m, mem_b, mail_b)
    depcache = volumes.depcache_volume(n2, eta2, m, mem_b, mail_b)
    return {"N1": n1, "eta1": eta1, "N2": n2, "eta2": eta2, "M": m, "mem_row_bytes": mem_b, "mail_row_bytes": mail_b,
            "mailbox_size": r0["mailbox_size"],
            "depcache_7": depcache, "depcomm_8": depcomm1 + depcomm2, "depcomm_8_dispatch": depcomm1,
            "depcomm_8_aggregation": depcomm2,
            # DepComm with memory.remote_dispatch=distinct: a row per distinct node, N1 (1 - eta1)
            "depcomm_8_with_distinct_reads": volumes.depcomm_volume(d1, n2, eta2, m, mem_b + 1, mail_b)[0] + depcomm2,
            "sven_9": sven1 + sven2, "sven_9_dispatch": sven1, "sven_9_aggregation": sven2}


def summarize(ranks: list[dict]) -> dict:
    b = group_bytes(ranks)
    memory_payload = sum(v for k, v in b.items() if k.split(".")[0] in PHASES and k.endswith(".payload"))
    memory_index = sum(v for k, v in b.items() if k.split(".")[0] in PHASES and k.endswith(".index"))
    return {"bytes": {k: v for k, v in b.items() if k.split(".")[0] in (*PHASES, "gradients")},
            "memory_payload": memory_payload, "memory_index": memory_index,
            "iterations": ranks[0]["iterations"], "events": sum(r["events"] for r in ranks),
            "rows_held": [r["rows_held"] for r in ranks], "num_nodes": ranks[0]["num_nodes"],
            "train_seconds_max": max(r["train_seconds"] for r in ranks)}


def section_bytes(args) -> list[dict]:
    rows = []
    for data in args.data:
        for model in args.models:
            for m in args.trainers:
                note(f"bytes: {data} {model} M={m}")
                t0 = time.perf_counter()
                specs = [*BACKENDS, DISTINCT]
                runs = launch(m, specs, common_overrides(args, data, model, m, args.max_events[data]), args.timeout)
                row = {"data": data, "model": model, "M": m, "max_events": args.max_events[data],
                       "global_batch": args.global_batch, "seconds": round(time.perf_counter() - t0, 1),
                       "formulas": formulas(runs[specs.index("sven")])}
                for spec, ranks in zip(specs, runs):
                    name = "depcomm_distinct" if spec == DISTINCT else spec
                    row[name] = summarize(ranks)
                    if spec != "depcache":
                        row[name]["link_rows"] = [r["link_rows"] for r in ranks]
                sven, comm, cache, distinct = (row[b]["memory_payload"]
                                               for b in ("sven", "depcomm", "depcache", "depcomm_distinct"))
                row["sven_vs_depcomm"] = comm / sven if sven else None
                row["sven_vs_depcomm_distinct"] = distinct / sven if sven else None
                row["sven_vs_depcache"] = cache / sven if sven else None
                note(f"  payload depcache {cache:,} depcomm {comm:,} (distinct {distinct:,}) sven {sven:,} "
                     f"({row['seconds']} s)")
                rows.append(row)
    return rows


def section_links(args) -> list[dict]:
    import numpy as np

    rows = []
    methods = ("range", "interval", "reflexbicut")
    for m in args.link_trainers:
        note(f"links: {args.data[0]} {args.models[0]} M={m}, sven under {', '.join(methods)}")
        runs = launch(m, [f"sven:partition.method={x}" for x in methods],
                      common_overrides(args, args.data[0], args.models[0], m, args.max_events[args.data[0]]),
                      args.timeout)
        row = {"data": args.data[0], "model": args.models[0], "M": m, "max_events": args.max_events[args.data[0]],
               "methods": {}}
        for method, ranks in zip(methods, runs):
            served = np.array([r["link_rows"]["dispatch"] for r in ranks])  # [owner, to]: rows
            sent = np.array([r["link_rows"]["aggregation"] for r in ranks])  # [writer, owner]
            # the balance cost of eq. (5) as tgdist.partition.measures reads it: send + receive per trainer
            balance = int(max(served[g].sum() + served[:, g].sum() for g in range(m)))
            row["methods"][method] = {
                "dispatch_max_link_rows": int(served.max()), "dispatch_total_rows": int(served.sum()),
                "dispatch_balance_cost_rows": balance, "aggregation_max_link_rows": int(sent.max()),
                "rows_held": [r["rows_held"] for r in ranks],
                "dispatch_payload_bytes": group_bytes(ranks).get("dispatch.payload", 0),
                "max_rank_dispatch_payload_bytes": max(r["counters"].get("dispatch.payload", {}).get("bytes_sent", 0) +
                                                       r["counters"].get("dispatch.payload", {}).get("bytes_received", 0)
                                                       for r in ranks)}
        rows.append(row)
    return rows


def section_memory(args) -> dict:
    overrides = ["data=synthetic", f"data.synthetic.num_events={args.synthetic_events}",
                 f"data.synthetic.num_nodes={args.synthetic_nodes}", "model=tgn", f"parallel.i={args.memory_trainers}",
                 "train.epochs=1", f"train.batch_size={args.global_batch // args.memory_trainers}",
                 "train.num_threads=1", "sampler.num_threads=1", "train.progress=false",
                 f"train.stop_after_batches={args.memory_batches}", "partition.method=interval"]
    out = {"graph": {"num_events": args.synthetic_events, "num_nodes": args.synthetic_nodes},
           "M": args.memory_trainers, "iterations": args.memory_batches, "model": "tgn", "placement": "interval",
           "backends": {}}
    for backend in BACKENDS:
        note(f"memory: synthetic {args.synthetic_events:,} events, {args.synthetic_nodes:,} nodes, M={args.memory_trainers}, "
             f"{backend}")
        t0 = time.perf_counter()
        (ranks,) = launch(args.memory_trainers, [backend], overrides, args.timeout)
        out["backends"][backend] = {
            "rows_held": [r["rows_held"] for r in ranks], "bytes_held_mib": [r["bytes_held"] / 2**20 for r in ranks],
            "rss_after_build_mib": [r["rss_after_build_mib"] for r in ranks],
            "peak_rss_after_build_mib": [r["peak_rss_after_build_mib"] for r in ranks],
            "peak_rss_mib": [r["peak_rss_training_mib"] for r in ranks], "seconds": round(time.perf_counter() - t0, 1)}
        note(f"  {out['backends'][backend]}")
    cache = out["backends"]["depcache"]
    for backend in ("depcomm", "sven"):
        b = out["backends"][backend]
        b["bytes_held_share_of_depcache"] = max(b["bytes_held_mib"]) / max(cache["bytes_held_mib"])
        b["peak_rss_share_of_depcache"] = max(b["peak_rss_mib"]) / max(cache["peak_rss_mib"])
    return out


def unpriced_seconds(counters: dict, link) -> float:
    """What ``link`` charges this rank's memory exchanges, recomputed from the counts
    (``latency`` per collective, the busier direction over the bandwidth): a cross-check of the
    counters' ``modelled_seconds``, which the exchanges pay since the partitioned collectives
    were priced (the first runs of this section were made before, when only the gradients paid).
    Summing the epoch's bytes before taking the busier direction makes it a slight underestimate."""
    calls = sum(c["calls"] for k, c in counters.items() if k.split(".")[0] in PHASES and k.endswith(".sizes"))
    sent = sum(c["bytes_sent"] for k, c in counters.items() if k.split(".")[0] in PHASES)
    received = sum(c["bytes_received"] for k, c in counters.items() if k.split(".")[0] in PHASES)
    return calls * link.latency + max(sent, received) / link.bandwidth


def section_time(args) -> list[dict]:
    from tgdist.distributed.link import parse_link

    rows = []
    links = ("eth10", "ib100")
    for m in (2, 4):
        specs = ["depcache:train.stop_after_batches=3"]  # warm-up: imports, kernels, first allocations
        specs += [f"{b}:parallel.link={link}" for link in links for b in BACKENDS]
        note(f"time: {args.data[0]} {args.models[0]} M={m}, every backend under {', '.join(links)}")
        runs = launch(m, specs, common_overrides(args, args.data[0], args.models[0], m, args.time_events), args.timeout)
        for spec, ranks in zip(specs[1:], runs[1:]):
            backend, link = spec.split(":")[0], spec.split("=")[1]
            c = group_bytes(ranks)
            modelled = max(sum(v.get("modelled_seconds", 0.0) for v in r["counters"].values()) for r in ranks)
            rows.append({"M": m, "link": link, "backend": backend, "epoch_seconds": max(r["train_seconds"] for r in ranks),
                         "train_events_per_s": ranks[0]["train_events_per_s"], "events": sum(r["events"] for r in ranks),
                         "modelled_link_seconds_max_rank": modelled,
                         "unpriced_memory_exchange_seconds_max_rank": max(unpriced_seconds(r["counters"], parse_link(link))
                                                                          for r in ranks),
                         "memory_payload_bytes": sum(v for k, v in c.items()
                                                     if k.split(".")[0] in PHASES and k.endswith(".payload"))})
            note(f"  {rows[-1]}")
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3].split(","), sys.argv[4:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--data", nargs="+", choices=("wikipedia", "sfhh"), default=["wikipedia", "sfhh"],
                    help="data sets of the bytes section (the first also runs links and time)")
    ap.add_argument("--models", nargs="+", choices=("tgn", "apan", "jodie"), default=["tgn", "apan"])
    ap.add_argument("--trainers", nargs="+", type=at_least(2), default=[2, 4, 8], help="M of the bytes section")
    ap.add_argument("--link-trainers", nargs="+", type=at_least(2), default=[4, 8], help="M of the links section")
    ap.add_argument("--global-batch", type=at_least(8), default=1600,
                    help="events per iteration over all M trainers (each trains global-batch / M)")
    ap.add_argument("--wikipedia-events", type=at_least(0), default=30_000,
                    help="data.max_events of Wikipedia in the bytes and links sections (0: all)")
    ap.add_argument("--sfhh-events", type=at_least(0), default=30_000, help="data.max_events of SFHH (0: all)")
    ap.add_argument("--time-events", type=at_least(1), default=60_000, help="data.max_events of the time section")
    ap.add_argument("--synthetic-events", type=at_least(1), default=2_000_000)
    ap.add_argument("--synthetic-nodes", type=at_least(1), default=1_000_000)
    ap.add_argument("--memory-trainers", type=at_least(2), default=4)
    ap.add_argument("--memory-batches", type=at_least(1), default=5, help="iterations each memory run trains")
    ap.add_argument("--timeout", type=at_least(1.0, float), default=900.0, help="seconds per launch")
    args = ap.parse_args()
    args.max_events = {"wikipedia": args.wikipedia_events, "sfhh": args.sfhh_events}
    if args.global_batch % max([*args.trainers, *args.link_trainers, args.memory_trainers, 4]):
        ap.error(f"--global-batch {args.global_batch} is not a multiple of every trainer count")
    started = time.perf_counter()
    result = {"benchmark": "memory_backends", "machine": machine(),
              "setup": f"mini-batch parallelism M x 1 x 1 under torchrun (gloo, CPU, 1 thread per rank); global batch "
                       f"{args.global_batch} events split over the M trainers; 1 training epoch of the first "
                       f"max_events events (0: all; 70% train); bytes summed over ranks, sent + received"}
    for name in SECTIONS:
        if name in args.sections:
            result[name] = globals()[f"section_{name}"](args)
    result["seconds"] = round(time.perf_counter() - started, 1)
    emit(result)
    return 0


if __name__ == "__main__":
    run_main(main)
