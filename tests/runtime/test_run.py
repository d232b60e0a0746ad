"""Whole runs: determinism, checkpoint/resume, config checks, downstream tasks, metric files."""

import json

import numpy as np
import pytest
import torch

from tgdist.errors import ConfigError
from tgdist.runtime.build import compose
from tgdist.runtime.run import Run

SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=100",
         "train.num_neg_eval=9", "train.progress=false", "train.num_threads=1", "sampler.num_threads=1"]


def run(tmp_path, name, extra=()):
    cfg = compose(SMALL + list(extra) + [f"run_dir={tmp_path / name}"])
    return Run(cfg, tmp_path / name).train(), tmp_path / name


def metrics(summary):
    return {k: v for k, v in summary.items() if k.startswith(("val_", "test_", "loss"))}


def test_same_seed_gives_bit_identical_metrics(tmp_path):
    a, _ = run(tmp_path, "a", ["train.epochs=2", "train.deterministic=true"])
    b, _ = run(tmp_path, "b", ["train.epochs=2", "train.deterministic=true"])
    assert metrics(a) == metrics(b) and len(metrics(a)) >= 6
    c, _ = run(tmp_path, "c", ["train.epochs=2", "train.seed=1"])
    assert metrics(c) != metrics(a)


def test_resume_mid_epoch_reaches_the_same_final_metrics(tmp_path):
    full, _ = run(tmp_path, "full", ["train.epochs=2"])
    # 1500 events -> 1049 training events -> 11 batches per epoch; stop in epoch 1 at batch 7.
    stopped, d = run(tmp_path, "part", ["train.epochs=2", "train.checkpoint_every=3", "train.stop_after_batches=18"])
    assert stopped["stopped"]
    state = torch.load(d / "checkpoints" / "last.pt", weights_only=True)
    assert (state["position"]["epoch"], state["position"]["batch"]) == (1, 6)
    resumed, d2 = run(tmp_path, "resumed", ["train.epochs=2", f"train.resume={d}"])
    assert metrics(resumed) == metrics(full)
    lines = (d2 / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [0, 1]


def test_checkpoint_from_another_config_is_refused(tmp_path):
    _, d = run(tmp_path, "a", ["train.epochs=1"])
    with pytest.raises(ConfigError, match="model.mem_dim: checkpoint 16 vs now 32"):
        run(tmp_path, "b", ["train.epochs=1", "model.mem_dim=32", f"train.resume={d}"])
    with pytest.raises(ConfigError, match="no checkpoint"):
        run(tmp_path, "c", ["train.epochs=1", f"train.resume={tmp_path / 'nowhere'}"])


def test_run_directory_files(tmp_path):
    summary, d = run(tmp_path, "a", ["train.epochs=1"])
    rec = json.loads((d / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("loss", "val_ap", "val_auc", "val_mrr", "test_ap", "events_per_s"):
        assert np.isfinite(rec[key]), key
    assert set(rec["stage_seconds"]) == {"sample", "features", "memory_read", "compute", "memory_write"}
    assert json.loads((d / "summary.json").read_text())["test_ap"] == summary["test_ap"]
    assert "model:" in (d / "config.yaml").read_text()


@pytest.mark.parametrize("model", ["jodie", "apan", "tgat2"])
def test_other_models_run(tmp_path, model):
    s, _ = run(tmp_path, model, ["train.epochs=1", f"model={model}", "model.mem_dim=16"])
    assert 0.0 <= s["test_ap"] <= 1.0


def test_static_memory_with_pretraining(tmp_path):
    s, _ = run(tmp_path, "s", ["train.epochs=1", "model.static_memory=true", "model.static_pretrain_epochs=1"])
    assert np.isfinite(s["test_ap"])


def test_node_classification_needs_labels(tmp_path):
    with pytest.raises(ConfigError, match="needs labels"):
        run(tmp_path, "n", ["train.epochs=1", "train.task=node"])


def test_invalid_settings_fail_before_training(tmp_path):
    with pytest.raises(ConfigError, match="divisible"):
        run(tmp_path, "x", ["model.mem_dim=15"])
    with pytest.raises(ConfigError, match="train.task"):
        run(tmp_path, "y", ["train.task=regression"])
