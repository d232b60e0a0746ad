"""Part 2: a world of one under torchrun (--nproc-per-node 1), the process groups the run makes
itself: ``ProcessGroups.resolve_backend("auto")`` gives NCCL where CUDA is available (and
``torch.cuda.set_device``), gloo on a CPU (the dry run says so in every line).

- ``nccl_smoke``: NCCL itself in this world of one: all_reduce (also asynchronous, its handle
  waited, and on a side CUDA stream), all_gather_into_tensor, all_to_all_single, broadcast and a
  barrier on CUDA tensors; ``collectives.comm_device()`` is the CUDA device; tgdist's helpers,
  which short-circuit in a group of one, give their input back on the caller's device.
- ``world_one:<backend>``: every memory backend at 1 x 1 x 1 with the plain loop, against
  ``local`` (losses of the first iterations and final metrics, ``shared.TOL``).
- ``world_one:<pipeline>``: each pipeline on local memory; prefetch (bit for bit on a CPU) and
  micro_batches=2 (gradients accumulate) against the plain loop within ``TOL``; asynchronous
  all-reduce, pipeline=sven and MSPipe (staleness auto, its stages on CUDA streams) change the
  trajectory by design, so they must train to finite metrics in (0, 1] (the gap is reported).
- ``exact:<backend>``: ``train.deterministic=true`` (no atomic adds on the GPU): every memory
  backend gives local memory's scores exactly, as on the CPU (the runs above part by float noise
  that Adam amplifies, ``shared.TOL``).
- ``resume:<setup>``: ``train.deterministic=true``, 2 epochs: a run stopped mid-epoch 2
  (``train.checkpoint_every``, ``train.stop_after_batches``) then resumed (``train.resume``) gives
  the metrics of the uninterrupted run exactly (every val_*/test_*/loss figure equal).

Worker: ``python world_one.py --worker PREFIX PLAN.json`` (torchrun runs it).
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
from shared import (
    COMPARABLE,
    TOL,
    close,
    compare_metrics,
    deadline_arg,
    device,
    emit,
    events_override,
    error_lines,
    finite_metrics,
    guarded,
    on_cuda,
    out_dir,
    say,
    sizes,
    threads_overrides,
    torchrun,
)

PART = 2
BACKENDS = ["local", "depcache", "depcomm", "sven", "daemon"]
# (name, overrides, compared with the plain loop on local memory within TOL?)
PIPELINES = [
    ("pipeline=prefetch", ["pipeline=prefetch"], True),
    ("pipeline.micro_batches=2", ["pipeline.micro_batches=2"], True),
    ("pipeline=async_allreduce", ["pipeline=async_allreduce"], False),
    ("pipeline=sven", ["pipeline=sven"], False),
    ("sven+pipeline=sven", ["memory.backend=sven", "pipeline=sven"], False),
    ("pipeline=mspipe(auto)", ["pipeline=mspipe"], False),
]
# resumed exactly: fixed settings only (micro_batches=auto and staleness=auto measure times)
RESUMES = [
    ("local", []),
    ("sven+sven-levels(n=2)", ["memory.backend=sven", "pipeline=sven", "pipeline.micro_batches=2"]),
    ("mspipe(K=1)", ["pipeline=mspipe", "pipeline.staleness=1"]),
]


def base() -> list[str]:
    s = sizes()
    return ["data=wikipedia", events_override(s["events"]), f"train.batch_size={s['batch']}", "train.epochs=1",
            f"train.num_neg_eval={s['num_neg_eval']}", "memory.timeout=120", *COMPARABLE, *s["dims"],
            *threads_overrides(s["threads"]), f"train.device={device()}"]


# ------------------------------------------------------------------------------------------------
# The worker (one process under torchrun)


def nccl_smoke() -> dict:
    import torch
    import torch.distributed as dist

    from tgdist.distributed import collectives
    from tgdist.distributed.world import ProcessGroups

    backend = ProcessGroups.resolve_backend("auto")
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group(backend=backend, init_method="env://")
    ran = []
    try:
        x = torch.arange(6, dtype=torch.float32, device=dev)
        want = x.clone()
        dist.all_reduce(x)
        assert torch.equal(x, want), ("all_reduce", x)
        ran.append("all_reduce")
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        assert torch.equal(x, want)
        ran.append("all_reduce(async_op) + wait")
        if cuda:
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                y = torch.ones(5, device=dev)
                dist.all_reduce(y)
            side.synchronize()
            assert float(y.sum()) == 5.0
            ran.append("all_reduce on a side stream")
        out = torch.empty_like(x)
        dist.all_gather_into_tensor(out, x)
        assert torch.equal(out, want)
        ran.append("all_gather_into_tensor")
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        assert torch.equal(out, want)
        ran.append("all_to_all_single")
        dist.broadcast(x, 0)
        ran.append("broadcast")
        dist.barrier()
        ran.append("barrier")
        comm = collectives.comm_device()
        assert comm == dev, (comm, dev)
        ran.append(f"comm_device()={comm}")
        z = torch.full((3,), 2.0, device=dev)
        got = collectives.all_reduce_mean_async([z], counter=collectives.ByteCounter()).wait()
        assert got[0] is z and float(z.sum()) == 6.0 and z.device == dev
        ran.append("collectives.all_reduce_mean_async (a group of one: returned as given)")
        if cuda:
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    return {"backend": backend, "ops": ran, "device": str(dev)}


def resume_trio(overrides: list[str], work: Path) -> dict:
    """Uninterrupted, stopped and resumed runs (deterministic, 2 epochs): their scores."""
    from ranks import one_run

    s = sizes()
    train_events = int(0.7 * s["events"])  # the chronological split's 70 %, about
    per_epoch = max(2, math.ceil(train_events / s["batch"]))
    every, stop = max(1, per_epoch // 3), per_epoch + per_epoch // 2
    det = [*overrides, "train.deterministic=true", "train.epochs=2"]
    full, _ = one_run([*base(), *det], None, 0, 1, run_dir=str(work / "full"))
    part, _ = one_run([*base(), *det, f"train.checkpoint_every={every}", f"train.stop_after_batches={stop}"], None, 0,
                      1, run_dir=str(work / "part"))
    # the resume alone: the stopped run's config.yaml gives every other setting (a group choice
    # such as data=wikipedia given again would be refused)
    resumed, _ = one_run([f"train.resume={work / 'part'}"], None, 0, 1, run_dir=str(work / "resumed"))
    return {"full": full, "part": part, "resumed": resumed, "checkpoint_every": every, "stop_after_batches": stop}


def worker(prefix: str, plan_path: str) -> None:
    import torch
    from ranks import one_run

    plan = json.loads(Path(plan_path).read_text())
    out = Path(f"{prefix}.json")
    results = json.loads(out.read_text()) if out.exists() else []
    for spec in plan["specs"]:
        t0 = time.perf_counter()
        res: dict = {"name": spec["name"], "kind": spec["kind"]}
        try:
            if spec["kind"] == "smoke":
                res["smoke"] = nccl_smoke()
            elif spec["kind"] == "resume":
                with tempfile.TemporaryDirectory(prefix="gpu-checks-resume-") as d:
                    res["trio"] = resume_trio(spec["overrides"], Path(d))
            else:
                res["run"], _ = one_run([*base(), *spec["overrides"]], None, 0, TOL["probe_iterations"])
            res["ok"] = True
        except BaseException as e:  # noqa: BLE001 - reported; the next spec goes on
            res["ok"] = False
            res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
            if torch.cuda.is_available():
                try:
                    torch.cuda.synchronize()
                except Exception as e2:  # noqa: BLE001 - a broken context: the parent starts a new process
                    res["error"] += f"\nCUDA context broken: {e2}"
                    results.append({**res, "seconds": time.perf_counter() - t0})
                    out.write_text(json.dumps(results, default=str))
                    raise SystemExit(3)
        res["seconds"] = time.perf_counter() - t0
        results.append(res)
        out.write_text(json.dumps(results, default=str))


# ------------------------------------------------------------------------------------------------
# The parent


def launch_all(specs: list[dict], seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    done: dict = {}
    todo = list(specs)
    log = out_dir() / "part2_world_one.log"
    while todo:
        left = deadline - time.monotonic()
        if left < 5:
            for s in todo:
                done[s["name"]] = {"ok": False, "error": "not run: the part's time budget was spent"}
            break
        with tempfile.TemporaryDirectory(prefix="gpu-checks-one-") as d:
            plan = Path(d) / "plan.json"
            plan.write_text(json.dumps({"specs": todo}))
            rc, err = torchrun(1, Path(__file__), ["--worker", f"{d}/out", str(plan)], left, log=log)
            p = Path(f"{d}/out.json")
            got = json.loads(p.read_text()) if p.exists() else []
        for r in got:
            done[r["name"]] = r
        n = len(got)
        if n < len(todo):
            why = "timed out" if rc == 124 else f"exit {rc}"
            detail = "the part's time budget was spent" if rc == 124 else error_lines(err)
            done[todo[n]["name"]] = {"ok": False, "error": f"the process {why} in this check: {detail}"}
            n += 1
        todo = todo[n:]
    return done


def losses_close(a: list, b: list) -> tuple[bool, float | None]:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None][:TOL["probe_iterations"]]
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in pairs]
    ok = bool(pairs) and all(close(x, y, TOL["loss_atol"], TOL["loss_rtol"]) for x, y in pairs)
    return ok, (max(rel) if rel else None)


def main() -> int:
    import os

    seconds = deadline_arg(sys.argv)
    cuda = on_cuda()
    # deterministic cuBLAS needs its workspace fixed before the process's first matrix product
    # (torch reads the size once); tgdist sets it only when a deterministic run is built, which in
    # this process comes after the other checks' products (the resume checks)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    note = None if cuda else "no CUDA (dry run): the world of one runs gloo, not NCCL"
    specs = [{"name": "nccl_smoke", "kind": "smoke"}]
    specs += [{"name": f"world_one:{b}", "kind": "run", "overrides": [f"memory.backend={b}"], "compare": True}
              for b in BACKENDS]
    specs += [{"name": f"world_one:{n}", "kind": "run", "overrides": o, "compare": c} for n, o, c in PIPELINES]
    # train.deterministic=true: no atomic adds, so every store must give local memory's scores exactly
    specs += [{"name": f"exact:{b}", "kind": "exact", "overrides": [f"memory.backend={b}", "train.deterministic=true"]}
              for b in BACKENDS]
    specs += [{"name": f"resume:{n}", "kind": "resume", "overrides": o} for n, o in RESUMES]
    say(f"part 2: {len(specs)} checks in a world of one on {device()} ({sizes()['events']} events)")
    t0 = time.perf_counter()
    got = launch_all(specs, seconds)
    want_backend = "nccl" if cuda else "gloo"
    ref = (got.get("world_one:local") or {}).get("run")
    exact_ref = (got.get("exact:local") or {}).get("run")
    failed = 0
    for spec in specs:
        name, r = spec["name"], got[spec["name"]]
        why = [r["error"]] if r.get("error") else []
        figures: dict = {"world": 1, "comm_backend_expected": want_backend}
        if spec["kind"] == "smoke" and r.get("smoke"):
            figures.update(r["smoke"])
            if r["smoke"]["backend"] != want_backend:
                why.append(f"the world of one resolved {r['smoke']['backend']}, not {want_backend}")
        elif spec["kind"] == "run" and r.get("run"):
            run = r["run"]
            figures.update({"comm_backend": run.get("comm_backend"), "param_devices": run.get("param_devices"),
                            "cuda_current_device": run.get("cuda_current_device"),
                            "pipeline": run["summary"].get("pipeline"), "iterations": run["summary"].get("iterations"),
                            "test_ap": run["summary"].get("test_ap"), "seconds": run.get("seconds")})
            if "cuda_streams" in run:
                figures["cuda_streams"] = run["cuda_streams"]
                if cuda and run["cuda_streams"] != ["fetch", "update"]:
                    why.append(f"MSPipe's stages ran on CUDA streams {run['cuda_streams']}, not fetch and update")
            if run.get("comm_backend") != want_backend:
                why.append(f"the run's groups resolved {run.get('comm_backend')}, not {want_backend}")
            if cuda and run.get("param_devices") != ["cuda"]:
                why.append(f"the model was on {run.get('param_devices')}")
            if cuda and run.get("cuda_current_device") != 0:  # ProcessGroups.init's set_device(local rank 0)
                why.append(f"the current CUDA device was {run.get('cuda_current_device')}, not 0")
            if not finite_metrics(run["summary"]):
                why.append(f"metrics not finite in (0, 1]: {run['summary']}")
            compared = spec["compare"]
            if ref is not None and name != "world_one:local":
                ok_m, figs = compare_metrics(run["summary"], ref["summary"])
                ok_l, rel = losses_close(run["losses"], ref["losses"])
                figures.update({"vs_local_plain": figs["metrics_dev_ref"], "worst_metric_gap": figs["worst_metric_gap"],
                                "loss_max_rel_diff_first_iterations": rel, "compared_within_tolerance": compared})
                if compared and not (ok_m and ok_l):
                    why.append(f"not within tolerance of local memory with the plain loop (losses ok: {ok_l}, "
                               f"metrics ok: {ok_m}): {figs['metrics_dev_ref']}")
            elif ref is None and name != "world_one:local":
                why.append("no reference: world_one:local did not run")
        elif spec["kind"] == "exact" and r.get("run"):
            run = r["run"]
            figures.update({"deterministic": True, "comm_backend": run.get("comm_backend"),
                            "param_devices": run.get("param_devices"), "scores": run["scores"]})
            if not finite_metrics(run["summary"]):
                why.append(f"metrics not finite in (0, 1]: {run['summary']}")
            if name != "exact:local":
                if exact_ref is None:
                    why.append("no reference: exact:local did not run")
                else:
                    diff = {k: [v, exact_ref["scores"].get(k)] for k, v in run["scores"].items()
                            if exact_ref["scores"].get(k) != v}
                    figures["differing_from_local"] = diff
                    if diff or len(run["scores"]) < 6:
                        why.append(f"deterministic scores differ from local memory's: {diff}")
        elif spec["kind"] == "resume" and r.get("trio"):
            t = r["trio"]
            full, part, resumed = t["full"], t["part"], t["resumed"]
            figures.update({"checkpoint_every": t["checkpoint_every"], "stop_after_batches": t["stop_after_batches"],
                            "stopped": part["summary"].get("stopped"), "comm_backend": full.get("comm_backend"),
                            "param_devices": full.get("param_devices"),
                            "scores_full": full["scores"], "scores_resumed": resumed["scores"]})
            if not part["summary"].get("stopped") or not part["summary"].get("checkpoint"):
                why.append(f"the stopped run did not stop with a checkpoint: {part['summary']}")
            if resumed["scores"] != full["scores"] or len(full["scores"]) < 6:
                diff = {k: [resumed["scores"].get(k), v] for k, v in full["scores"].items() if resumed["scores"].get(k) != v}
                why.append(f"the resumed run's scores differ from the uninterrupted run's: {diff}")
        elif not why:
            why.append("no result")
        ok = not why
        failed += not ok
        emit(name, PART, ok, figures, seconds=r.get("seconds", 0.0), error="; ".join(why) if why else None, note=note)
    say(f"part 2: {len(specs) - failed}/{len(specs)} passed in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(guarded(PART, "world_one", main))
