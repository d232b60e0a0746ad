"""``train.tensorboard=true``: a run's metrics lines as TensorBoard scalars, read back."""

import json

import pytest

from tgdist.errors import ConfigError
from tgdist.runtime import tensorboard
from tgdist.runtime.build import compose, validate
from tgdist.runtime.run import Run

SMALL = ["data.max_events=1500", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=100",
         "train.num_neg_eval=4", "train.progress=false", "train.num_threads=1", "sampler.num_threads=1"]


def test_scalars_of_a_metrics_line():
    line = {"epoch": 1, "loss": 1.5, "train_events": 1048, "events_per_s": 900.0, "val_ap": 0.6, "test_ap": 0.7,
            "test_ap_inductive": 0.65, "val_mrr": None, "stage_seconds": {"sample": 0.25, "compute": 1.0}}
    assert tensorboard.scalars(line) == {"train/loss": 1.5, "train/events": 1048.0, "train/events_per_s": 900.0,
                                         "val/ap": 0.6, "test/ap": 0.7, "test/ap_inductive": 0.65,
                                         "stage_seconds/sample": 0.25, "stage_seconds/compute": 1.0}


def test_without_the_package_the_setting_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^train.tensorboard=true needs the tensorboard package: pip install "
                                          r"'tgdist\[tensorboard\]'$"):
        validate(compose(["train.tensorboard=true"]))


def test_a_run_writes_its_metrics_as_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="train.tensorboard needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    Run(compose(SMALL + ["train.epochs=2", "train.tensorboard=true", f"run_dir={run_dir}"]), run_dir).train()
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum("test_ap" in m for m in lines) == 1  # the selected epoch's, tested once at the end
    for tag, key in (("test/ap", "test_ap"), ("val/ap", "val_ap"), ("train/loss", "loss")):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(m["epoch"], pytest.approx(m[key], rel=1e-6)) for m in lines if key in m]  # float32 in the file
    assert "stage_seconds/compute" in events.Tags()["scalars"]


def test_a_fresh_log_drops_an_earlier_runs_events_and_a_resumed_one_keeps_them(tmp_path):
    pytest.importorskip("tensorboard", reason="train.tensorboard needs the tensorboard package")
    (tmp_path / "tensorboard").mkdir()
    old = tmp_path / "tensorboard" / "events.out.tfevents.1.host.1.0"
    old.write_bytes(b"")
    tensorboard.TensorBoardLog(tmp_path, fresh=False).close()
    assert old.exists() and len(list((tmp_path / "tensorboard").iterdir())) == 2
    tensorboard.TensorBoardLog(tmp_path, fresh=True).close()
    assert not old.exists() and len(list((tmp_path / "tensorboard").iterdir())) == 1
