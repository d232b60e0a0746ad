"""Checks of the CUDA path (issue 3: "the same code runs on CUDA when a GPU is present").

They run where ``torch.cuda.is_available()`` and are skipped elsewhere, so CI (which has no GPU)
skips them. ``TGDIST_TEST_DEVICE=cpu`` runs the same checks on the CPU: that checks the tests
themselves here, and the step comparison then compares the CPU kernels with the torch
formulation. ``scripts/gpu_checks.sh`` runs them, with the GPU benchmark, on a machine that has one.

The data is the shared Wikipedia structure (``$TGDIST_DATASETS``, else ``../shared/datasets``),
cut to its first events.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tgdist.config import datasets_dir
from tgdist.runtime import checkpoint
from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.pipelines import GradientHooks
from tgdist.runtime.run import Run

pytestmark = pytest.mark.gpu

SMALL = ["data=wikipedia", "data.max_events=2000", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=100",
         "train.num_neg_eval=9", "train.progress=false", "train.num_threads=1", "sampler.num_threads=1"]


@pytest.fixture(scope="module")
def device() -> str:
    name = os.environ.get("TGDIST_TEST_DEVICE")
    if not name:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device (TGDIST_TEST_DEVICE=cpu runs these checks on the CPU)")
        name = "cuda"
    if not (Path(datasets_dir()) / "wikipedia" / "wikipedia.csv.gz").is_file():
        pytest.skip(f"the shared Wikipedia data is not at {datasets_dir()} (set TGDIST_DATASETS)")
    return name


def on(dev: str, extra=()) -> list:
    return SMALL + [f"train.device={dev}"] + list(extra)


def scores(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k.startswith(("val_", "test_", "loss"))}


@pytest.mark.parametrize("model", ["tgn", "jodie", "apan", "tgat2"])
def test_each_model_trains_and_evaluates_on_the_device(tmp_path, device, model):
    cfg = compose(on(device, [f"model={model}", "train.epochs=2", f"run_dir={tmp_path}"]))
    run = Run(cfg, tmp_path)
    tr = run.trainer
    want = torch.device(device).type
    assert {p.device.type for p in tr.model.parameters()} == {want}
    assert {b.device.type for b in tr.memory.buffers()} == {want}
    summary = run.train()
    for key in ("val_ap", "test_ap", "test_auc", "test_mrr"):
        assert summary[key] is not None and 0.0 < summary[key] <= 1.0, (key, summary[key])
    assert math.isfinite(summary["loss"])
    assert float(tr.memory.mem.abs().sum()) > 0  # the stream was written to the device's memory


def test_the_embedding_cache_serves_on_the_device(tmp_path, device):
    """FreshGNN's table on the device: served inner embeddings, the run's metrics finite."""
    run = Run(compose(on(device, ["model=tgat2", "cache=freshgnn", "train.epochs=1", f"run_dir={tmp_path}"])),
              tmp_path)
    assert run.trainer.cache.table.device.type == torch.device(device).type
    summary = run.train()
    assert summary["test_ap"] is not None and 0.0 < summary["test_ap"] <= 1.0
    cache = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["cache"]
    assert 0 < cache["hit_rows"] < cache["rows"]


def _edge_features(graph, dim: int = 4):
    graph.edge_feat = np.random.default_rng(0).standard_normal((graph.num_events, dim)).astype(np.float32)
    return graph


@pytest.mark.parametrize("model,edge", [("tgn", False), ("tgn", True), ("jodie", False), ("apan", False),
                                        ("tgat2", False)])
def test_a_step_on_the_device_equals_the_cpu_torch_formulation(device, model, edge):
    """From one state, a training step on the device gives the loss and gradients of the CPU's
    torch formulation (``model.cpu_kernels=false``) to float32 rounding, over two steps (the
    second has pending mails). Dropout is off: the two devices draw different masks."""
    over = [f"model={model}", "model.dropout=0.0"]
    ref = build_trainer(compose(on("cpu", over + ["model.cpu_kernels=false"])), progress=False)
    if edge:
        ref = build_trainer(compose(on("cpu", over + ["model.cpu_kernels=false"])), progress=False,
                            graph=_edge_features(ref.g))
    dev = build_trainer(compose(on(device, over)), graph=ref.g, progress=False)
    dev.model.load_state_dict(ref.model.state_dict())
    grads = {id(ref): [], id(dev): []}
    def recorder(tr):
        return lambda ps: grads[id(tr)].append([None if p.grad is None else p.grad.cpu().clone() for p in ps])

    for s, e in list(ref.batches("train"))[:2]:
        neg = ref.negatives.train(e - s, 1)
        a = ref.step(s, e, neg, train=True, hooks=GradientHooks(recorder(ref)))
        b = dev.step(s, e, neg, train=True, hooks=GradientHooks(recorder(dev)))
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
        torch.testing.assert_close(b.pos.cpu(), a.pos, rtol=1e-4, atol=1e-5)
        dev.model.load_state_dict(ref.model.state_dict())  # continue both from the same state
        dev.optimizer.load_state_dict(ref.optimizer.state_dict())
        dev.memory.load_state_dict(ref.memory.state_dict())
    for step_a, step_b in zip(grads[id(ref)], grads[id(dev)]):
        for a, b in zip(step_a, step_b):
            if a is None:
                assert b is None
                continue
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()) + 1e-12)


def test_deterministic_runs_on_the_device_repeat_and_resume_exactly(tmp_path, device):
    """``train.deterministic=true`` on the device: two runs give bit-identical metrics, and a run
    stopped mid-epoch resumes to them (torch raises for any op without a deterministic kernel)."""
    det = ["train.deterministic=true", "train.epochs=2"]

    def run(name, extra=()):
        cfg = compose(on(device, det + list(extra) + [f"run_dir={tmp_path / name}"]))
        return Run(cfg, tmp_path / name).train(), tmp_path / name

    a, _ = run("a")
    b, _ = run("b")
    assert scores(a) == scores(b) and len(scores(a)) >= 6
    stopped, d = run("part", ["train.checkpoint_every=4", "train.stop_after_batches=18"])
    assert stopped["stopped"] and checkpoint.find(d)
    resumed, _ = run("resumed", [f"train.resume={d}"])
    assert scores(resumed) == scores(a)


def test_mspipe_on_the_device_runs_its_stages_on_their_own_streams(tmp_path, device):
    """MSPipe on the device, its fetch and update stages on their own CUDA streams (a no-op on a
    CPU): staleness 0 gives the plain loop's metrics bit for bit and staleness 2 repeats itself
    bit for bit (deterministic kernels), which a read racing a write across streams would break;
    the streams were used wherever the device is CUDA."""
    det = ["train.deterministic=true", "train.epochs=2"]

    def run(name, extra=()):
        cfg = compose(on(device, det + list(extra) + [f"run_dir={tmp_path / name}"]))
        r = Run(cfg, tmp_path / name)
        return r.train(), r

    plain, _ = run("plain")
    k0, r0 = run("k0", ["pipeline.mode=mspipe", "pipeline.staleness=0", "pipeline.prefetch=2"])
    assert scores(k0) == scores(plain) and len(scores(plain)) >= 6
    a, ra = run("k2a", ["pipeline.mode=mspipe", "pipeline.staleness=2"])
    b, _ = run("k2b", ["pipeline.mode=mspipe", "pipeline.staleness=2"])
    assert scores(a) == scores(b) != scores(plain)
    cuda = torch.device(device).type == "cuda"
    for r in (r0, ra):
        assert r.pipeline._streams.on == cuda and sorted(r.pipeline._streams.streams) == (["fetch", "update"] if cuda else [])


def test_features_left_in_the_host_map_train_as_features_on_the_device(tmp_path, device, monkeypatch):
    """Edge features too large for the device stay in the host map, each batch's rows gathered into
    pinned memory (``runtime.features.HostRows``): the same rows, so a deterministic run's scores
    equal those of a run with the features on the device."""
    from tgdist.runtime import features

    def run(share: float, where: str) -> dict:
        monkeypatch.setattr(features, "DEVICE_SHARE", share)
        over = ["data=synthetic", "data.synthetic.num_events=2000", "data.synthetic.num_nodes=200",
                "data.synthetic.edge_dim=8", *SMALL[2:], f"train.device={device}", "train.epochs=1",
                "train.deterministic=true", f"run_dir={tmp_path / where}", f"data.cache_dir={tmp_path / 'cache'}"]
        cfg = compose(over)
        tr = build_trainer(cfg, progress=False)
        kind = type(tr.edge_feat).__name__
        assert kind == ("HostRows" if share == 0.0 and torch.device(device).type == "cuda" else "Tensor"), kind
        return scores(Run(cfg, tmp_path / where, trainer=tr).train())

    assert run(0.0, "host") == run(features.DEVICE_SHARE, "device")


@pytest.mark.parametrize("model", ["tgn", "jodie", "apan"])
def test_a_training_step_on_the_device_waits_for_nothing(tmp_path, device, model, monkeypatch):
    """Issue 53, point 5: the second epoch's training steps (after a warm first epoch: kernels
    compiled, buffers allocated) under ``torch.cuda.set_sync_debug_mode``, from taking the batch
    through the backward, the optimizer and the memory write. A synchronisation is what ``"error"``
    mode refuses; the test records every one (``"warn"`` mode, its warnings' call sites) so that a
    failure lists them all, not the first. CUDA only: the CPU has nothing to wait for."""
    import warnings

    if torch.device(device).type != "cuda":
        pytest.skip("host-device synchronisation is a CUDA matter")
    cfg = compose(on(device, [f"model={model}", "train.epochs=2", f"run_dir={tmp_path}"]))
    run = Run(cfg, tmp_path)
    tr, pipe, nb = run.trainer, run.pipeline, run.batches_per_epoch
    seen: list[str] = []
    run_t = [0]  # the iteration under way

    def watched(fn, reads_train: bool = False):
        def call(*args, **kwargs):
            train = kwargs.get("train", args[1] if reads_train and len(args) > 1 else True)
            if run_t[0] < nb or not train:  # the first epoch warms up; evaluation reads its scores
                return fn(*args, **kwargs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    seen.extend(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
        return call

    step = run._step

    def step_at(t):
        run_t[0] = t
        return step(t)

    monkeypatch.setattr(run, "_step", step_at)
    monkeypatch.setattr(pipe, "take", watched(pipe.take))
    monkeypatch.setattr(tr, "compute", watched(tr.compute, reads_train=True))
    monkeypatch.setattr(tr.memory, "exchange", watched(tr.memory.exchange))
    run.train()
    assert run_t[0] >= 2 * nb - 1, "the second epoch did not run"
    assert not seen, f"{len(seen)} synchronisations in the second epoch's steps, at: {sorted(set(seen))}"


@pytest.mark.parametrize("model", ["tgn", "tgat2"])
def test_the_device_sampler_on_the_device_scores_as_the_host_sampler(device, model):
    """Issue 53: the recent sampler on the device (a GPU's default for TGN with local memory)
    writes the host kernel's slots, and an evaluation from the same state gives the host path's
    scores to float rounding (on a GPU the kernels differ from one table size to another)."""
    host = build_trainer(compose(on(device, [f"model={model}", "sampler.on_device=false"])), progress=False)
    dev = build_trainer(compose(on(device, [f"model={model}", "sampler.on_device=true"])), progress=False)
    assert dev.device_sampler is not None and dev.device_sampler.key.device.type == torch.device(device).type
    dev.model.load_state_dict(host.model.state_dict())
    lo, hi = host.split.range("val")
    roots = np.r_[host.g.src[lo:hi], host.g.dst[lo:hi]]
    times = np.r_[host.g.t[lo:hi], host.g.t[lo:hi]]
    want = host.sampler.sample(roots, times)
    got = dev.device_sampler.sample(torch.from_numpy(roots).to(device), torch.from_numpy(times).to(device))
    for w, g in zip(want, got):
        for name in ("nbr", "eid", "t", "mask", "dt"):
            assert np.array_equal(getattr(w, name), getattr(g, name).cpu().numpy()), name
    for s, e in list(host.batches("train"))[:3]:
        neg = host.negatives.train(e - s, 1)
        host.step(s, e, neg, train=True)
    dev.model.load_state_dict(host.model.state_dict())
    dev.memory.load_state_dict(host.memory.state_dict())
    a, b = host.evaluate("val"), dev.evaluate("val")
    assert a == pytest.approx(b, rel=1e-4, abs=1e-5, nan_ok=True)


def test_evaluation_on_the_device_waits_once(device):
    """Issue 53, point 4: the scores stay on the device, the metrics are computed there and read
    back once a part; everything else in an evaluation (with the device sampler) is queued."""
    import warnings

    if torch.device(device).type != "cuda":
        pytest.skip("host-device synchronisation is a CUDA matter")
    tr = build_trainer(compose(on(device, ["model=tgn"])), progress=False)
    assert tr.device_sampler is not None
    tr.evaluate("val")  # warm: kernels compiled, buffers allocated
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tr.evaluate("test")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert len(seen) == 1 and seen[0].endswith(("trainer.py:%d" % _line_of("torch.stack(values).tolist()"))), seen


def _line_of(text: str) -> int:
    """The line of tgdist/runtime/trainer.py that holds ``text``."""
    from tgdist.runtime import trainer

    lines = Path(trainer.__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)
