"""Two (or more) ranks under torchrun sharing one device: CUDA compute, gloo communication.

NCCL refuses two ranks on one GPU, so ``parallel.comm_backend=auto`` takes gloo where a machine's
ranks outnumber its GPUs; each rank here makes its groups once that way (``ProcessGroups.init(...,
backend="auto", device=...)``, part 1 checks that it resolved gloo) and hands them to every ``Run``
it trains: the collectives module then moves what it sends to the CPU (``comm_device``) and gives
the results back on the compute device.

``launch(specs, base, nproc, seconds)`` trains the specs one after the other in the same ranks
(one torchrun), each on the devices it names (records ``runs["ref"]`` and ``runs["dev"]``, or
``runs["dev"]`` alone); a spec trained on two devices (the CPU first) is
compared rank by rank: losses of the first iterations per step, the memory after them, and on
rank 0 the final metrics (tolerances: ``shared.TOL``). A spec that fails on any rank ends the
launch after it (the groups may be left mid-collective), and the specs after it get a new launch.

Worker: ``python ranks.py --worker PREFIX PLAN.json`` (torchrun runs it); each rank rewrites
``PREFIX.rank<R>.json`` after every spec.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared import TOL, close, compare_metrics, error_lines, memory_bound, torchrun

SUMMARY_KEYS = ("loss", "val_ap", "val_auc", "test_ap", "test_auc", "test_mrr", "iterations", "traversed_events",
                "memory_backend", "pipeline", "stopped", "checkpoint", "train_events_per_s")


# ------------------------------------------------------------------------------------------------
# One rank


def one_run(overrides: list[str], groups, rank: int, probe: int, run_dir: str | None = None) -> tuple[dict, dict]:
    """One ``Run`` of ``overrides`` on this rank: its record (losses per iteration, seconds, summary,
    communication, devices) and the memory state after ``probe`` iterations. ``groups``: the
    caller's process groups, or None for the run's own (a world of one: ``auto`` resolves NCCL
    where CUDA is, and selects the device). ``run_dir`` (rank 0's) is kept; without one, a
    temporary directory is used and removed. The memory state is ``{iteration: {name: tensor}}`` after each
    of the first ``probe`` iterations."""
    import shutil

    import torch

    from tgdist.runtime.build import compose
    from tgdist.runtime.run import Run

    cfg = compose(overrides)
    keep = run_dir is not None
    if rank == 0 and run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="gpu-checks-")
    rec: dict = {"losses": []}
    memory: dict = {}
    try:
        run = Run(cfg, run_dir, groups=groups)
        tr = run.trainer
        rec["param_devices"] = sorted({p.device.type for p in tr.model.parameters()})
        rec["comm_backend"] = run.groups.backend
        if torch.cuda.is_available():
            rec["cuda_current_device"] = torch.cuda.current_device()
        stamps: list[float] = []

        def record(t, loss):
            stamps.append(time.perf_counter())
            rec["losses"].append(loss)
            if t < min(probe, run.iterations):  # the memory each of the first iterations left
                memory[t] = {k: v.detach().to("cpu", copy=True) for k, v in tr.memory.state_dict().items()
                             if isinstance(v, torch.Tensor)}

        start = time.perf_counter()
        summary = run.train(on_iteration=record)
        rec["train_seconds"] = (stamps[-1] - start) if stamps else None
        rec["seconds"] = time.perf_counter() - start
        streams = getattr(run.pipeline, "_streams", None)  # MSPipe's stage streams (a run of one keeps its pipeline)
        if streams is not None:
            rec["cuda_streams"] = sorted(streams.streams) if streams.on else []
        rec["summary"] = {k: summary.get(k) for k in SUMMARY_KEYS if k in summary}
        rec["scores"] = {k: v for k, v in summary.items() if k.startswith(("val_", "test_", "loss"))}
        rec["communication"] = {k: {q: v[q] for q in ("calls", "bytes_sent", "bytes_received")}
                                for k, v in run.counter.as_dict().items()}
    finally:
        if run_dir is not None and not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return rec, memory


def compare_rank(ref: dict, dev: dict, mem_ref: dict, mem_dev: dict, rank: int) -> dict:
    """This rank's device run against its CPU run."""
    import torch

    out: dict = {"ok": True, "why": []}
    la, lb = ref["losses"], dev["losses"]
    if [x is None for x in la] != [x is None for x in lb]:
        out["ok"] = False
        out["why"].append(f"rank {rank}: iterations differ ({len(lb)} on the device, {len(la)} on the CPU)")
    pairs = [(b, a) for a, b in zip(la, lb) if a is not None and b is not None][:TOL["probe_iterations"]]
    rel = [abs(b - a) / max(abs(a), 1e-12) for b, a in pairs]
    out["loss_pairs"] = len(pairs)
    out["loss_rel_diff_per_iteration"] = [float(f"{x:.3g}") for x in rel]
    out["loss_max_rel_diff"] = max(rel) if rel else None
    bad = [i for i, (b, a) in enumerate(pairs) if not close(b, a, TOL["loss_atol"], TOL["loss_rtol"])]
    if bad or not pairs:
        out["ok"] = False
        out["why"].append(f"rank {rank}: losses of iterations {bad or 'none compared'} beyond rtol {TOL['loss_rtol']}: "
                          f"{[round(p[0], 7) for p in pairs]} vs {[round(p[1], 7) for p in pairs]}")
    worst, per_iteration, first_bad = 0.0, [], None
    if set(mem_ref) != set(mem_dev) or not mem_ref:
        out["ok"] = False
        out["why"].append(f"rank {rank}: memory snapshots differ or none: iterations {sorted(mem_dev)} vs {sorted(mem_ref)}")
    for t in sorted(set(mem_ref) & set(mem_dev)):
        at, ra, rb = 0.0, mem_ref[t], mem_dev[t]
        bound = memory_bound(t)  # judged after every probed iteration, from the first (shared.TOL)
        if set(ra) != set(rb) or not ra:
            out["ok"] = False
            out["why"].append(f"rank {rank}: memory state keys differ or none after iteration {t}: {sorted(rb)} vs {sorted(ra)}")
        for k in sorted(set(ra) & set(rb)):
            a, b = ra[k], rb[k]
            if a.shape != b.shape:
                out["ok"] = False
                out["why"].append(f"rank {rank}: memory {k} shape {tuple(b.shape)} vs {tuple(a.shape)}")
                continue
            if not a.is_floating_point():
                if not torch.equal(a, b):
                    out["ok"] = False
                    out["why"].append(f"rank {rank}: memory {k} (integer) differs after iteration {t}")
                continue
            if not a.numel():
                continue
            # elementwise |a - b|; where either is not finite (times of no mail yet), equal or infinitely apart
            both = torch.isfinite(a) & torch.isfinite(b)
            same = (a == b) | (a.isnan() & b.isnan())
            d = torch.where(both, (a.double() - b.double()).abs(), torch.where(same, 0.0, math.inf))
            d = d.reshape(a.shape[0], -1)
            at = max(at, float(d.max()))
            off = d > bound
            if not bool(off.any()):
                continue
            beyond = int(off.any(1).sum())
            if first_bad is None:
                r = int(d.max(1).values.argmax())
                first_bad = {"iteration": t, "tensor": k, "rows_beyond": beyond, "rows": int(a.shape[0]),
                             "worst_row": r, "worst_row_columns_beyond": int(off[r].sum()),
                             "worst_row_max_abs_diff": float(d[r].max()), "bound": bound}
            out["ok"] = False
            out["why"].append(f"rank {rank}: memory {k} after iteration {t} beyond its bound {bound:.3g} ({beyond} of "
                              f"{a.shape[0]} rows, max abs diff {float(d.max()):.3g})")
        per_iteration.append(round(at, 7))
        worst = max(worst, at)
    out["memory_max_abs_diff_per_iteration"] = per_iteration
    out["memory_bound_per_iteration"] = [memory_bound(t) for t in sorted(set(mem_ref) & set(mem_dev))]
    out["memory_first_beyond"] = first_bad
    out["memory_max_abs_diff"] = worst
    out["memory_tensors"] = len(next(iter(mem_ref.values()), {}))
    out.update(compare_bytes(ref, dev, rank))
    if not out["bytes_equal"] and not out.get("bytes_note"):
        out["ok"] = False
        out["why"].append(f"rank {rank}: bytes sent or received differ from the CPU run's (device, cpu): "
                          f"{out['bytes_differ']}")
    if rank == 0:
        ok, figs = compare_metrics(dev["summary"], ref["summary"])
        out.update(figs)
        if not ok:
            out["ok"] = False
            out["why"].append(f"final metrics beyond atol {TOL['metric_atol']} (MRR {TOL['mrr_atol']}, loss rtol "
                              f"{TOL['final_loss_rtol']}): {figs['metrics_dev_ref']}")
    return out


def compare_bytes(ref: dict, dev: dict, rank: int) -> dict:
    """The bytes each named exchange sent and received in the two runs of a rank: ``bytes_equal``,
    the exchanges that differ, ``communication_equal`` (calls too, reported), and ``bytes_note``
    where a difference is the runs' own (``shared.TOL``: different micro-batch counts chosen)."""
    def sent(rec: dict) -> dict:
        return {k: (v["bytes_sent"], v["bytes_received"]) for k, v in (rec.get("communication") or {}).items()}

    a, b = sent(ref), sent(dev)
    differ = {k: [b.get(k), a.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    out = {"bytes_equal": not differ, "bytes_differ": differ,
           "communication_equal": ref.get("communication") == dev.get("communication")}
    n = [((r.get("summary") or {}).get("pipeline") or {}).get("micro_batches") for r in (ref, dev)]
    if differ and n[0] != n[1]:
        out["bytes_note"] = f"rank {rank}: micro-batches {n[0]} on the CPU and {n[1]} on the device: bytes reported"
    return out


def worker(prefix: str, plan_path: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tgdist.distributed.schedule import Layout
    from tgdist.distributed.world import ProcessGroups, detect
    from tgdist.runtime.build import compose

    plan = json.loads(Path(plan_path).read_text())
    world = detect()
    cfg = compose(plan["base"])
    # auto: gloo where the ranks of a machine outnumber its GPUs (tgdist's choice, checked here)
    groups = ProcessGroups.init(world, Layout(cfg.parallel.i, cfg.parallel.j, cfg.parallel.k),
                                backend=plan.get("comm_backend", "auto"), device=plan.get("device"),
                                timeout=timedelta(seconds=plan.get("collective_timeout", 120)))
    results = []
    path = Path(f"{prefix}.rank{world.rank}.json")
    try:
        for spec in plan["specs"]:
            res: dict = {"name": spec["name"], "runs": {}}
            t0 = time.perf_counter()
            mems = {}
            try:
                # roles: "ref" (the CPU) then "dev" for a comparison, else "dev" alone
                roles = ["ref", "dev"] if len(spec["devices"]) == 2 else ["dev"]
                for role, dev in zip(roles, spec["devices"]):
                    rec, mems[role] = one_run([*plan["base"], *spec["overrides"], f"train.device={dev}"], groups,
                                              world.rank, spec.get("probe", TOL["probe_iterations"]))
                    rec["device"] = dev
                    res["runs"][role] = rec
                if len(roles) == 2:
                    res["compare"] = compare_rank(res["runs"]["ref"], res["runs"]["dev"], mems["ref"], mems["dev"],
                                                  world.rank)
                res["ok"] = True
            except BaseException as e:  # noqa: BLE001 - reported, then this launch ends
                res["ok"] = False
                res["error"] = f"rank {world.rank}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # a failed kernel shows here, not in the next spec
            res["seconds"] = time.perf_counter() - t0
            results.append(res)
            path.write_text(json.dumps(results, default=str))
            everyone: list = [None] * world.world_size
            dist.all_gather_object(everyone, res["ok"], group=groups.get("world"))
            if not all(everyone):
                break  # the groups may be mid-collective on some rank: the parent relaunches the rest
    finally:
        groups.destroy()


# ------------------------------------------------------------------------------------------------
# The parent


def launch(specs: list[dict], base: list[str], nproc: int, seconds: float, log: Path) -> dict:
    """Every spec's per-rank records ``{name: {"ranks": [res per rank], "error": str|None}}``,
    relaunching after a failed spec, all within ``seconds``."""
    deadline = time.monotonic() + seconds
    done: dict = {}
    todo = list(specs)
    while todo:
        left = deadline - time.monotonic()
        if left < 5:
            for s in todo:
                done[s["name"]] = {"ranks": [], "error": "not run: the part's time budget was spent"}
            break
        with tempfile.TemporaryDirectory(prefix="gpu-checks-ranks-") as d:
            plan = Path(d) / "plan.json"
            # a rank that failed mid-collective leaves the other waiting this long (then it fails too)
            plan.write_text(json.dumps({"base": base, "specs": todo, "collective_timeout": 60,
                                             "device": todo[0]["devices"][-1]}))
            rc, err = torchrun(nproc, Path(__file__), ["--worker", f"{d}/out", str(plan)], left, log=log)
            ranks = []
            for r in range(nproc):
                p = Path(f"{d}/out.rank{r}.json")
                ranks.append(json.loads(p.read_text()) if p.exists() else [])
        got = min(len(x) for x in ranks)
        for i in range(got):
            per = [x[i] for x in ranks]
            errors = [x.get("error") for x in per if not x["ok"]]
            done[todo[i]["name"]] = {"ranks": per, "error": "\n".join(errors) if errors else None}
        broke = got > 0 and done[todo[got - 1]["name"]]["error"] is not None  # the ranks stopped after a failure
        if got < len(todo) and not broke:
            name = todo[got]["name"]
            if name not in done:  # the launch died in it (or timed out) before every rank wrote it
                why = "timed out" if rc == 124 else f"exit {rc}"
                partial = [x[got] for x in ranks if len(x) > got]
                errs = [x.get("error") for x in partial if x.get("error")]
                detail = "\n".join(errs) if errs else ("the part's time budget was spent" if rc == 124
                                                       else error_lines(err))
                done[name] = {"ranks": partial, "error": f"the launch {why} in this spec: {detail}"}
                got += 1
        elif got == len(todo) and rc != 0:  # every spec reported, but the launch failed on the way out
            for s in todo:
                done[s["name"]].setdefault("exit_error", f"launch exit {rc}: {error_lines(err)}")
        todo = todo[got:]
    return done


def worst(values):
    values = [v for v in values if v is not None and (not isinstance(v, float) or math.isfinite(v))]
    return max(values) if values else None


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        print("usage: ranks.py --worker PREFIX PLAN.json (torchrun runs it)", file=sys.stderr)
        sys.exit(2)
