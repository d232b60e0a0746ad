"""A config is composed once and validated once per process (``tgdist.runtime.build.validate``, which
returns the resolved choices the run, its trainer and the launcher read), and the trainer is built
with the memory store its config names."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tgdist.memory.depcache import DepCacheMemory
from tgdist.memory.store import LocalMemory
from tgdist.runtime import build
from tgdist.runtime.build import Resolved, build_trainer, compose, validate
from tgdist.runtime.pipelines.mspipe import MSPipe
from tgdist.runtime.pipelines.plain import Plain
from tgdist.runtime.run import Run

from tests.runtime.runs import SMALL

ROOT = Path(__file__).resolve().parents[2]


def test_validate_returns_the_resolved_choices():
    """``auto`` resolved there, once: the store by the layout, the device by the machine, a
    count-or-auto key as None; the learning rate scaled with the global batch; the strategy of an
    older pipeline name under its own name."""
    one = validate(compose(SMALL))
    assert isinstance(one, Resolved) and (one.layout.i, one.layout.j, one.layout.k) == (1, 1, 1)
    assert (one.backend, one.store, one.pipeline, one.strategy) == ("local", LocalMemory, "plain", Plain)
    assert one.device == ("cuda" if torch.cuda.is_available() else "cpu") and one.lr == pytest.approx(1e-4)
    assert one.counts == {"pipeline.micro_batches": 1} and one.micro_batches == 1
    two = validate(compose(SMALL + ["parallel.i=2", "train.lr=0.001", "pipeline=none", "pipeline.micro_batches=auto"]))
    assert (two.backend, two.store, two.pipeline, two.lr_scaling) == ("depcache", DepCacheMemory, "plain", "linear")
    assert two.lr == pytest.approx(0.002) and two.counts == {"pipeline.micro_batches": None} and two.micro_batches is None
    sqrt = validate(compose(SMALL + ["parallel.i=4", "train.lr_scaling=sqrt", "memory.backend=daemon"]))
    assert (sqrt.backend, sqrt.layout.i, sqrt.lr) == ("daemon", 4, pytest.approx(2e-4))  # sqrt(i) x
    ms = validate(compose(SMALL + ["pipeline=mspipe"]))
    assert (ms.pipeline, ms.strategy, ms.counts, ms.micro_batches) == ("mspipe", MSPipe, {"pipeline.staleness": None}, 1)
    assert validate(compose(SMALL + ["pipeline.mode=mspipe", "pipeline.staleness=3"])).counts == {"pipeline.staleness": 3}


def _counting(monkeypatch) -> list:
    calls = []
    checks = build._validate

    def counted(cfg):
        calls.append(cfg)
        return checks(cfg)

    monkeypatch.setattr(build, "_validate", counted)
    return calls


def test_a_run_validates_its_config_once_and_builds_its_trainer_with_its_store(tmp_path, monkeypatch):
    """``Run`` validates once and hands the choices to ``build_trainer``; a caller's choices are
    not checked again. The trainer is constructed holding the store the config names (DepCache
    here), and no local memory is made for it to be replaced."""
    calls = _counting(monkeypatch)
    built = []  # the memory each Trainer was constructed with
    init = build.Trainer.__init__

    def recording(self, graph, split, model, memory, *args, **kwargs):
        built.append(memory)
        init(self, graph, split, model, memory, *args, **kwargs)

    monkeypatch.setattr(build.Trainer, "__init__", recording)
    monkeypatch.setattr(build, "memory_for", lambda *a: pytest.fail("a local memory was made for another store"))
    cfg = compose(SMALL + ["train.epochs=1", "memory.backend=depcache", f"run_dir={tmp_path / 'r'}"])
    run = Run(cfg, tmp_path / "r")
    try:
        assert len(calls) == 1
        assert len(built) == 1 and isinstance(built[0], DepCacheMemory) and run.trainer.memory is built[0]
    finally:
        run.close()
    choices = validate(cfg)
    assert len(calls) == 2
    tr = build_trainer(cfg, choices=choices, store=lambda graph, split, model, fanouts, device:
                       LocalMemory(graph.num_nodes, model.mem_dim, model.mail_dim, model.mailbox_size))
    assert len(calls) == 2 and isinstance(tr.memory, LocalMemory) and tr.memory is built[-1]


def _tgdist_train(tmp_path, *args) -> tuple[subprocess.CompletedProcess, int]:
    """``tgdist train ARGS`` in a subprocess that counts its validations (``validation_counter``)."""
    counted = tmp_path / f"validations-{len(list(tmp_path.glob('validations-*')))}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TGDIST_PLUGINS": "tests.runtime.validation_counter",
           "TGDIST_TEST_VALIDATIONS": str(counted)}
    r = subprocess.run([sys.executable, "-m", "tgdist", "train", *args], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    return r, int(counted.read_text())


def test_tgdist_train_validates_once_per_process(tmp_path):
    """The command line composes and checks its config before Hydra starts, and the run trains with
    that config and what its check resolved: one validation per process, a resume's too."""
    over = ["data=synthetic", "data.synthetic.num_events=2000", "train.epochs=1", "train.progress=false",
            "model.mem_dim=16", "model.time_dim=8", "train.num_threads=1", "sampler.num_threads=1"]
    r, calls = _tgdist_train(tmp_path, *over, "run_dir=run")
    assert r.returncode == 0, r.stderr
    assert calls == 1
    r, calls = _tgdist_train(tmp_path, "train.resume=run", "train.epochs=2")
    assert r.returncode == 0, r.stderr
    assert calls == 1
    r, calls = _tgdist_train(tmp_path, *over, "pipeline.staleness=2", "run_dir=refused")  # refused when composed
    assert r.returncode == 2 and calls == 0 and not (tmp_path / "refused").exists()
    assert r.stderr.strip().splitlines() == ["tgdist train: error: pipeline.staleness=2 is read by pipeline.mode=mspipe "
                                             "only; pipeline.mode=plain does not read it"]
