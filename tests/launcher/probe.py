"""A tiny distributed program the launcher tests start under torchrun, srun, sbatch and mpiexec.

It resolves the world with ``tgdist.distributed.world.detect()``, validates a layout against it, and
with ``--groups`` builds the named process groups (gloo) and averages each rank's number over every
group. One JSON object per rank, ``{"world": {...}, "groups": {name: [ranks, mean]}, ...}``, on stdout
or as ``rank<N>.json`` in ``--out``; ``"leaked"`` lists the groups still alive after ``destroy()``
(``--hold NAME`` keeps a reference to one on purpose).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default=None, help="i,j,k (default: world_size,1,1)")
    ap.add_argument("--memory-backend", default="daemon")
    ap.add_argument("--groups", action="store_true", help="build process groups and all-reduce over each")
    ap.add_argument("--hold", default=None, help="keep a reference to this group through destroy()")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--sleep", type=float, default=0.0,
                    help="write rank<N>.ready (holding the pid) into --out, then sleep (signal tests)")
    ap.add_argument("--out", default=None, help="write rank<N>.json here instead of stdout (ranks share stdout)")
    args = ap.parse_args()

    from tgdist.distributed import collectives as C
    from tgdist.distributed.schedule import Layout
    from tgdist.distributed.world import GROUP_NAMES, ProcessGroups, detect, validate

    world = detect()
    if args.sleep:
        import os
        import time

        Path(args.out, f"rank{world.rank}.ready").write_text(str(os.getpid()))
        time.sleep(args.sleep)
    layout = Layout(*map(int, args.layout.split(","))) if args.layout else Layout(world.world_size, 1, 1)
    validate(layout, world, args.memory_backend)
    out = {"world": asdict(world), "layout": [layout.i, layout.j, layout.k], "groups": {}}
    if args.groups:
        import torch

        counter = C.ByteCounter()
        pg = ProcessGroups.init(world, layout, backend="gloo", timeout=args.timeout)
        held = pg.get(args.hold) if args.hold else None
        try:
            for name in GROUP_NAMES:
                if not pg.is_member(name):
                    out["groups"][name] = None
                    continue
                x = torch.tensor([float(world.rank)])
                C.all_reduce_mean([x], pg.get(name), name=name, counter=counter)
                out["groups"][name] = [pg.ranks(name), x.item()]
            out["master"] = C.broadcast_object(f"{world.master_addr}:{world.master_port}", src=0, counter=counter)
            C.barrier(pg.get("world"), timeout=args.timeout, counter=counter)
            out["bytes"] = {n: t["bytes_sent"] for n, t in counter.as_dict().items()}
        finally:
            pg.destroy()
        out["leaked"] = pg.leaked
        del held
    if args.out:
        Path(args.out, f"rank{world.rank}.json").write_text(json.dumps(out) + "\n")
    else:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
