"""Run one rank of a training run (``Run``, any layout) and record, after every iteration, the loss of
this rank and (on rank 0) the node memory and averaged gradients; used by test_parallel.py under
torchrun or as a single process. Each rank writes ``OUT.rank<R>``; rank 0 then merges them into OUT.
``PROBE_SGD_LR=LR`` in the environment: train with plain SGD at that rate instead of Adam, so the
scale of the averaged gradients shows in the parameters (Adam divides it out)."""

import json
import os
import sys
import time
from pathlib import Path

import torch

from tgdist.runtime.build import compose
from tgdist.runtime.run import Run


def main(out: str, *overrides: str) -> None:
    cfg = compose(list(overrides))
    run = Run(cfg, out + ".run")  # every rank names rank 0's directory alike
    tr, rank = run.trainer, run.rank
    m = tr.model
    if os.environ.get("PROBE_SGD_LR"):
        tr.optimizer = torch.optim.SGD(m.parameters(), lr=float(os.environ["PROBE_SGD_LR"]))
    losses, mems, grads, params = [], [], [], []

    def record(t, loss):
        losses.append(loss)
        mems.append(tr.memory.mem.clone())
        grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                for p in m.parameters()]))  # (a parameter the step did not use: none)
        params.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))

    summary = run.train(on_iteration=record)
    torch.save({"losses": losses}, f"{out}.part{rank}")
    Path(f"{out}.part{rank}").rename(f"{out}.rank{rank}")  # whole, when rank 0 sees it
    if rank:
        return
    parts = [Path(f"{out}.rank{r}") for r in range(run.world.world_size)]
    deadline = time.monotonic() + 60  # every rank has trained (the run's closing barrier): its file follows
    while not all(p.exists() for p in parts) and time.monotonic() < deadline:
        time.sleep(0.05)
    torch.save({"losses": [torch.load(p, weights_only=True)["losses"] for p in parts], "mem": torch.stack(mems),
                "grads": torch.stack(grads), "params": [p.detach() for p in m.parameters()],
                "trajectory": torch.stack(params),
                "events": summary["traversed_events"]}, out)
    print(json.dumps({"iterations": summary["iterations"]}))


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
