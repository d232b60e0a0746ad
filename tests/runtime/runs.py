"""Whole runs of one process on a small slice of the embedded CollegeMsg data, shared by the
runtime tests (the loop, pipelines, MSPipe, model selection, TensorBoard)."""

import json

from tgdist.runtime.build import compose
from tgdist.runtime.run import Run

SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=100",
         "train.num_neg_eval=9", "train.progress=false", "train.num_threads=1", "sampler.num_threads=1"]


def run(tmp_path, name, extra=(), trainer=None, base=SMALL):
    """``Run(...).train()`` of ``base + extra`` in ``tmp_path / name``: its summary and directory."""
    cfg = compose(list(base) + list(extra) + [f"run_dir={tmp_path / name}"])
    return Run(cfg, tmp_path / name, trainer=trainer).train(), tmp_path / name


def metrics(summary):
    """The summary's loss and validation and test metrics."""
    return {k: v for k, v in summary.items() if k.startswith(("val_", "test_", "loss"))}


def lines(run_dir):
    """The run's ``metrics.jsonl``, one dict a line."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
