"""The one entry into training for ``tgdist train`` and Python callers: ``run`` makes the run
(``tgdist.runtime.run.Run``, of any layout) and trains it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import DictConfig

from tgdist.distributed.world import detect
from tgdist.runtime.run import Run


def run(cfg: DictConfig, run_dir: str | Path | None, choices=None) -> dict:
    """Train as ``cfg`` says in ``run_dir`` (None on a parallel run's ranks but 0: rank 0's); the
    summary, also written to ``summary.json`` by rank 0. ``choices``: what ``build.validate(cfg)``
    returned, when the caller validated ``cfg`` (else the run validates it)."""
    start = time.perf_counter()
    summary = Run(cfg, run_dir, choices=choices).train()
    summary["wall_seconds"] = round(time.perf_counter() - start, 2)
    if detect().rank == 0 and "run_dir" in summary:  # (a run stopped early has no summary.json to update)
        written = Path(summary["run_dir"]) / "summary.json"
        if written.exists():  # the same summary as stdout's last line
            written.write_text(json.dumps(summary, indent=1))
    return summary
