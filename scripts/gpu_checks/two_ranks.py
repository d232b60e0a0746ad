"""Part 1: two ranks sharing the device (torchrun --nproc-per-node 2, train.device=DEVICE on both,
gloo for communication: ``parallel.comm_backend=auto`` picks it where the ranks outnumber the GPUs),
each memory backend and pipeline at 2 x 1 x 1 against the same run on
the CPU, in the same ranks: losses of the first iterations per step, the node memory after them,
the final metrics (tolerances: ``shared.TOL``), and the bytes each exchange sent and received
(equal).

On the CPU (the dry run) the "device" run is a second CPU run: the comparison must then hold too.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import launch, worst
from shared import (
    COMPARABLE,
    TOL,
    deadline_arg,
    device,
    emit,
    events_override,
    guarded,
    out_dir,
    say,
    sizes,
    threads_overrides,
)

PART = 1
# (check name, overrides): every one at 2 x 1 x 1
SPECS = [
    ("depcache", ["memory.backend=depcache"]),
    ("depcomm", ["memory.backend=depcomm"]),
    ("sven", ["memory.backend=sven"]),
    ("daemon", ["memory.backend=daemon"]),
    # all three of Sven's levels; micro_batches=auto may choose another n on each device, which
    # changes rounding only (gradients accumulate, DESIGN.md "Pipelines")
    ("sven+pipeline=sven", ["memory.backend=sven", "pipeline=sven"]),
    # MSPipe at a fixed staleness: auto picks K from measured stage times, which differ by device
    ("mspipe(K=1)+depcache", ["memory.backend=depcache", "pipeline=mspipe", "pipeline.staleness=1"]),
]


def base() -> list[str]:
    s = sizes()
    return ["data=wikipedia", events_override(s["events"]), "parallel.i=2", "parallel.j=1", "parallel.k=1",
            f"train.batch_size={s['batch']}", "train.epochs=1", f"train.num_neg_eval={s['num_neg_eval']}",
            "memory.timeout=120", *COMPARABLE, *s["dims"], *threads_overrides(s["threads"])]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main() -> int:
    seconds = deadline_arg(sys.argv)
    dev = device()
    only = [a for a in sys.argv[1:] if not a.startswith("--") and not a.replace(".", "").isdigit()]
    specs = [{"name": n, "overrides": o, "devices": ["cpu", dev]} for n, o in SPECS
             if not only or n in only]
    say(f"part 1: {len(specs)} runs at 2x1x1 on {dev} against the CPU ({sizes()['events']} events)")
    t0 = time.perf_counter()
    got = launch(specs, base(), 2, seconds, out_dir() / "part1_two_ranks.log")
    failed = 0
    for spec in specs:
        name, r = spec["name"], got[spec["name"]]
        ranks = r["ranks"]
        figures: dict = {"layout": "2x1x1", "comm": "gloo", "compute": dev, "events": sizes()["events"]}
        why = []
        if r.get("error"):
            why.append(r["error"])
        if r.get("exit_error"):  # the ranks trained it, then their launch failed on the way out
            why.append(r["exit_error"])
        comps = [x.get("compare") for x in ranks if x.get("compare")]
        notes: list[str] = []
        if len(comps) == 2:
            for c in comps:
                why += c["why"]
            figures["loss_max_rel_diff"] = worst([c["loss_max_rel_diff"] for c in comps])
            figures["loss_rel_diff_per_iteration"] = [c["loss_rel_diff_per_iteration"] for c in comps]
            figures["losses_compared_per_rank"] = [c["loss_pairs"] for c in comps]
            figures["memory_max_abs_diff"] = worst([c["memory_max_abs_diff"] for c in comps])
            figures["memory_max_abs_diff_per_iteration"] = [c["memory_max_abs_diff_per_iteration"] for c in comps]
            figures["memory_bound_per_iteration"] = comps[0]["memory_bound_per_iteration"]
            figures["memory_first_beyond"] = [c["memory_first_beyond"] for c in comps]
            figures["bytes_equal"] = all(c["bytes_equal"] for c in comps)  # judged (compare_rank)
            figures["bytes_differ"] = [c["bytes_differ"] for c in comps]
            figures["communication_equal"] = all(c["communication_equal"] for c in comps)  # calls too: reported
            notes = [c["bytes_note"] for c in comps if c.get("bytes_note")]
            c0 = comps[0] if "metrics_dev_ref" in comps[0] else comps[1]
            figures["metrics_dev_cpu"] = c0.get("metrics_dev_ref")
            figures["worst_metric_gap"] = c0.get("worst_metric_gap")
            run0 = ranks[0]["runs"].get("dev", {})
            figures["param_devices"] = run0.get("param_devices")
            figures["comm_backend"] = run0.get("comm_backend")
            if "pipeline=sven" in name:  # the n micro_batches=auto chose on each
                figures["micro_batches_cpu_dev"] = [(ranks[0]["runs"][role]["summary"].get("pipeline") or {})
                                                    .get("micro_batches") for role in ("ref", "dev")]
            figures["seconds_cpu_dev"] = [ranks[0]["runs"]["ref"].get("seconds"), run0.get("seconds")]
            if dev.startswith("cuda") and _gpus() < 2 and run0.get("comm_backend") != "gloo":
                why.append(f"two ranks on one GPU resolved {run0.get('comm_backend')}, not gloo (parallel.comm_backend=auto)")
            if dev.startswith("cuda") and run0.get("param_devices") != ["cuda"]:
                why.append(f"the model was on {run0.get('param_devices')}, not cuda")
        elif not why:
            why.append(f"{len(comps)} ranks compared, not 2")
        ok = not why
        failed += not ok
        emit(f"two_ranks:{name}", PART, ok, figures, seconds=max([x.get("seconds", 0) for x in ranks] or [0]),
             error="; ".join(why) if why else None, note="; ".join(notes) or None, tolerance=TOL)
    say(f"part 1: {len(specs) - failed}/{len(specs)} passed in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(guarded(PART, "two_ranks", main))
