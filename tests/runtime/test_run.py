"""Whole runs: determinism, checkpoint/resume, config checks, downstream tasks, metric files."""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tgdist.errors import ConfigError, DataError
from tgdist.distributed.schedule import Layout
from tgdist.runtime import checkpoint, reshard
from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.pipelines import GradientHooks
from tgdist.runtime.run import Run
from tgdist.runtime.trainer import memory_for

from tests.runtime.runs import SMALL, metrics, run





def test_same_seed_gives_bit_identical_metrics(tmp_path):
    a, _ = run(tmp_path, "a", ["train.epochs=2", "train.deterministic=true"])
    b, _ = run(tmp_path, "b", ["train.epochs=2", "train.deterministic=true"])
    assert metrics(a) == metrics(b) and len(metrics(a)) >= 6
    c, _ = run(tmp_path, "c", ["train.epochs=2", "train.seed=1"])
    assert metrics(c) != metrics(a)


@pytest.mark.parametrize("model", ["tgn", "jodie", "apan"])
def test_reruns_match_without_deterministic_mode(tmp_path, model):
    """With two threads and ``train.deterministic=false`` (the default) a rerun gives the same
    metrics too: no step uses an op whose parallel backward sums in a varying order (JODIE and
    APAN gathered their roots with ``h[root]``, whose backward does)."""
    over = [f"model={model}", "train.epochs=1", "train.num_threads=2", "model.mem_dim=100", "train.batch_size=600",
            "data.max_events=4000"]
    a, _ = run(tmp_path, "a", over)
    b, _ = run(tmp_path, "b", over)
    assert metrics(a) == metrics(b)


@pytest.mark.parametrize("model", ["tgn", "jodie", "apan"])
def test_many_evaluation_negatives_are_scored_in_chunks_with_the_same_results(model, monkeypatch):
    """Evaluation splits many negatives into passes of at most ``EVAL_ROOTS`` roots (so MRR
    against thousands of nodes fits in memory): same metrics and same memory afterwards."""
    from tgdist.runtime.trainer import Trainer

    def evaluated(roots):
        tr = build_trainer(compose(SMALL + [f"model={model}", "train.num_neg_eval=49", "data.max_events=3000"]))
        tr.EVAL_ROOTS = roots
        passes = []
        compute = tr.compute
        monkeypatch.setattr(tr, "compute", lambda *a, **k: passes.append(1) or compute(*a, **k))
        return tr.evaluate("val"), tr.memory.state_dict(), len(passes)

    whole, mem, passes = evaluated(1 << 17)
    chunked, mem_chunked, passes_chunked = evaluated(1000)
    # 450 val events: four batches of 100 (8 negatives a pass: 7 passes) and one of 50 (18: 3 passes)
    assert (passes, passes_chunked) == (5, 4 * 7 + 3) and Trainer.EVAL_ROOTS == 1 << 17
    assert chunked == whole and set(whole) >= {"val_ap", "val_mrr"}
    assert all(torch.equal(mem[k], mem_chunked[k]) for k in mem)


def test_ap_and_auc_do_not_depend_on_the_number_of_mrr_negatives():
    """AP and ROC-AUC score each positive against the first fixed negative, which is the same
    whatever ``train.num_neg_eval`` is: runs that differ only in it report the same AP."""
    def scores(n):
        tr = build_trainer(compose(SMALL + [f"train.num_neg_eval={n}"]))
        return {k: v for k, v in tr.evaluate("val").items() if k != "val_mrr"}

    one = scores(1)
    assert set(one) >= {"val_ap", "val_auc"} and scores(49) == one


def test_uniform_sampling_in_evaluation_does_not_change_training(tmp_path):
    """Evaluation draws its uniform samples from streams of its own: testing every epoch (a key a
    resume may change) trains the same model as testing only at the end."""
    over = ["sampler.strategy=uniform", "train.epochs=2"]
    a, da = run(tmp_path, "a", over + ["train.test_every_epoch=false"])
    b, db = run(tmp_path, "b", over + ["train.test_every_epoch=true"])
    assert metrics(a) == metrics(b)  # the final test of the selected epoch starts where its validation ended
    lines = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (da, db)]
    assert [h["loss"] for h in lines[0]] == [h["loss"] for h in lines[1]] and "test_ap" in lines[1][0]
    tr = build_trainer(compose(SMALL + over))
    first = tr.evaluate("val")
    calls = tr.sampler.calls
    tr.memory.reset_state()
    assert tr.evaluate("val") == first and tr.sampler.calls == calls  # the same state, the same samples


def test_resume_checks_the_data_by_content(tmp_path):
    """The same path holding other data is refused in one line (it crashed on a size mismatch,
    or resumed silently with as many nodes); the same data elsewhere resumes."""
    from tgdist.data.readers.native import save_native
    from tgdist.data.synthetic import generate

    data = tmp_path / "d.npz"
    save_native(generate(1500, 60, seed=1), data)
    over = [f"data.path={data}", "train.epochs=1"]
    run(tmp_path, "a", over)
    save_native(generate(1500, 60, seed=2), data)
    with pytest.raises(ConfigError, match=r"a/checkpoints/last.pt: checkpoint was trained on other data \(source_hash "):
        run(tmp_path, "b", over + ["train.epochs=2", f"train.resume={tmp_path / 'a'}"])
    assert not (tmp_path / "b").exists()
    moved = tmp_path / "elsewhere.npz"
    save_native(generate(1500, 60, seed=1), moved)
    resumed, _ = run(tmp_path, "c", [f"data.path={moved}", "train.epochs=2", f"train.resume={tmp_path / 'a'}"])
    assert resumed["epochs"] == 2


def test_a_run_directory_holding_a_run_is_refused_and_overwrite_removes_the_old_run(tmp_path):
    """A second run into a finished run's folder replaced its summary, metrics and checkpoints with a
    warning, and left the old run's tensorboard/ beside the new run's files."""
    _, d = run(tmp_path, "a", ["train.epochs=1"])
    (d / "tensorboard").mkdir()
    (d / "tensorboard" / "events.out.old").write_text("old")
    (d / "notes.txt").write_text("mine")
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    cfg = compose(SMALL + ["train.epochs=1", "train.seed=3", f"run_dir={d}"])
    with pytest.raises(ConfigError) as e:
        Run(cfg, d)
    assert str(e.value) == (f"run_dir={d} holds a finished tgdist run: continue it with train.resume={d}, or give "
                            f"train.overwrite=true to remove its files and start afresh there (or another run_dir)")
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before
    (d / "summary.json").unlink()  # stopped before its end: an interrupted run, refused alike
    with pytest.raises(ConfigError, match="holds an interrupted tgdist run"):
        Run(cfg, d)
    r = Run(compose(SMALL + ["train.epochs=1", "train.seed=3", "train.overwrite=true", f"run_dir={d}"]), d)
    r.close()
    assert sorted(p.name for p in d.iterdir()) == [".tgdist-run", "config.yaml", "notes.txt"]  # the new run's


def test_an_empty_evaluation_part_is_refused_before_training(tmp_path):
    """A part left empty by the split's cut to whole timestamps was a warning, then a run that exited
    0 with null metrics; a part asked for with a fraction of 0 is left out on purpose."""
    g = _labelled_graph("node", 1000)
    g.t[:] = np.r_[np.repeat(np.arange(6), 100), np.full(400, 6)]  # both cuts move back to event 600
    with pytest.raises(ConfigError, match=r"^no val events: in the chronological split of 1,000 events both of its "
                                          r"cuts fall among the events at time 6 \(from event 600 on\), and a part "
                                          r"never splits a timestamp, so no val metric could be computed: raise "
                                          r"data.val_frac, or set data.val_frac=0 to run without a val part$"):
        build_trainer(compose(SMALL), graph=g)
    assert build_trainer(compose(SMALL + ["data.val_frac=0"]), graph=g) is not None
    assert build_trainer(compose(SMALL + ["data.test_frac=0"])) is not None
    with pytest.raises(ConfigError, match=r"^no test events: .* data.test_frac=1e-12 of 1,000 events is less than "
                                          r"one event"):
        build_trainer(compose(SMALL + ["data.test_frac=1e-12"]), graph=_labelled_graph("node", 1000))
    import subprocess
    import sys

    from tgdist.data.readers.native import save_native

    g = _labelled_graph("node", 1000)  # a data set's own split (TGL's ext_roll) cut by data.max_events
    g.ext_roll = np.repeat(np.array([0, 1, 2], np.int8), [700, 150, 150])
    save_native(g, tmp_path / "roll.npz")
    small = [x for x in SMALL if not x.startswith("data.max_events=")]
    r = subprocess.run([sys.executable, "-m", "tgdist", "train", *small, f"data.path={tmp_path / 'roll.npz'}",
                        "data.max_events=500", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'r'}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "r").exists()
    assert r.stderr.strip().splitlines()[-1] == (
        "tgdist train: error: data.max_events=500 keeps the first 500 events of roll, and none of them is in the val "
        "part of the data's own split (ext_roll), so no val metric could be computed: drop data.max_events, or raise it")


def test_an_empty_val_part_asked_for_reports_null_metrics_and_no_best_epoch(tmp_path):
    """Its keys were left out, and epoch 0 was named best (every epoch tied at -inf) with its test
    AP as test_ap_at_best_val."""
    g = _labelled_graph("node", 1000)
    cfg = compose(SMALL + ["train.epochs=2", "data.val_frac=0", f"run_dir={tmp_path / 'r'}"])
    s = Run(cfg, tmp_path / "r", trainer=build_trainer(cfg, graph=g)).train()
    assert s["val_ap"] is None and s["val_auc"] is None and "val_mrr" not in s  # (train.val_mrr=false)
    assert s["best_epoch"] is None and s["best_val_ap"] is None and s["test_ap_at_best_val"] is None
    assert 0 <= s["test_ap"] <= 1 and "test_ap_inductive" in s and s["selected_epoch"] == 1  # the last
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [h["val_ap"] for h in lines] == [None, None]


def test_a_first_timestamp_holding_the_training_share_is_named():
    """An initial snapshot (80% of the events at the first time) leaves no training events once the
    cut moves back to whole timestamps: the message says why and which fractions would work."""
    g = _labelled_graph("node", 1000)
    g.t[:] = np.r_[np.zeros(800, np.int64), np.arange(1, 201)]
    with pytest.raises(ConfigError, match=r"leaves none before the validation part; the first timestamp \(0\) holds "
                                          r"800 events \(80%\), .*lower data.val_frac \+ data.test_frac below 0.20$"):
        build_trainer(compose(SMALL), graph=g)
    assert build_trainer(compose(SMALL + ["data.val_frac=0.1", "data.test_frac=0.09"]), graph=g) is not None


def test_a_task_without_labels_on_featured_data_points_at_data_columns():
    """A header column named label is read as a feature: the error says how to name it a label."""
    g = _labelled_graph("node", 1000)
    g.label, g.edge_feat = None, np.zeros((1000, 1), np.float32)
    with pytest.raises(ConfigError, match=r"has none \(an edge list's label column is read as an edge feature unless "
                                          r"data.columns names it, e.g. 'src,dst,t,label'\)$"):
        build_trainer(compose(SMALL + ["train.task=edge"]), graph=g)


def test_one_candidate_destination_is_warned_about(caplog):
    """A bipartite star (every event to one hub): each negative is the positive itself."""
    g = _labelled_graph("node", 1000)
    g.dst[:], g.num_nodes, g.node_map, g.node_feat = 30, 31, np.arange(31), None
    with caplog.at_level("WARNING"):
        build_trainer(compose(SMALL), graph=g)
    assert "there is 1 candidate destination (node 30): every negative is the event's own destination" in caplog.text


def test_features_that_saturate_the_model_are_warned_about(tmp_path, caplog):
    """Edge features of magnitude 1e30 make every score tie (AP and ROC-AUC exactly 0.5) with no
    word; the features are named when the data is read, and the tie when it is scored."""
    g = _labelled_graph("node", 1000)
    g.edge_feat = np.full((1000, 2), 1e30, np.float32)
    with caplog.at_level("WARNING"):
        tr = build_trainer(compose(SMALL), graph=g)
        res = tr.evaluate("val")
    assert "edge features reach 1e+30 in magnitude" in caplog.text
    assert res["val_ap"] == 0.5 and "val: every score is " in caplog.text


def test_more_evaluation_negatives_than_nodes_warns(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        build_trainer(compose(SMALL + ["train.num_neg_eval=5000"]))
    assert any("train.num_neg_eval=5000 is more than the" in r.getMessage() for r in caplog.records)


def test_cpu_kernels_switch_selects_the_path_and_both_compute_the_same_step():
    """``model.cpu_kernels=false`` runs the plain torch formulation. From the same state both give
    the same loss and gradients (to float32 rounding). Whole runs are not compared: Adam turns
    rounding-level differences of near-zero gradient components (the time encoder's high
    frequencies) into full-size steps, so trajectories part like any two float32 summation orders."""
    trainers, grads, losses = [], [], []
    for flag in ("true", "false"):
        tr = build_trainer(compose(SMALL + ["model.dropout=0.0", f"model.cpu_kernels={flag}"]), progress=False)
        trainers.append(tr)
    kernels = [m.fused for m in trainers[0].model.modules() if hasattr(m, "fused")]
    plain = [m.fused for m in trainers[1].model.modules() if hasattr(m, "fused")]
    assert kernels and all(kernels) and not any(plain)
    for s, e in list(trainers[0].batches("train"))[:2]:  # the second step has pending mails
        neg = trainers[0].negatives.train(e - s, 1)
        record = GradientHooks(lambda ps: grads.append([p.grad for p in ps]))
        losses.append([tr.step(s, e, neg, train=True, hooks=record).loss
                       for tr in trainers])
        for tr in trainers[1:]:  # continue both from the same state
            tr.model.load_state_dict(trainers[0].model.state_dict())
            tr.optimizer.load_state_dict(trainers[0].optimizer.state_dict())
            tr.memory.load_state_dict(trainers[0].memory.state_dict())
    for a, b in losses:
        assert a == pytest.approx(b, rel=1e-6)
    for k in (0, 2):
        for a, b in zip(grads[k], grads[k + 1]):
            if b is None:  # e.g. the GRU before any mail is pending
                assert a is None
                continue
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_resume_mid_epoch_reaches_the_same_final_metrics(tmp_path):
    full, _ = run(tmp_path, "full", ["train.epochs=2"])
    # 1500 events -> 1049 training events -> 11 batches per epoch; stop in epoch 1 at batch 7.
    stopped, d = run(tmp_path, "part", ["train.epochs=2", "train.checkpoint_every=3", "train.stop_after_batches=18"])
    assert stopped["stopped"]
    state = torch.load(d / "checkpoints" / "last.pt", weights_only=True)
    assert state["iteration"] == 18  # every 3 iterations; the 18th is epoch 1's 7th batch
    resumed, d2 = run(tmp_path, "resumed", ["train.epochs=2", f"train.resume={d}"])
    assert metrics(resumed) == metrics(full)
    lines = (d2 / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [0, 1]


def test_a_killed_writers_temp_file_is_removed_by_the_next_save(tmp_path):
    """SIGKILL (or the OOM killer) while a checkpoint is written leaves its temp file; the next
    save of that checkpoint removes it, and leaves other files alone."""
    stale = tmp_path / ".last.pt.k1ll3d.tmp"
    stale.write_bytes(b"half a checkpoint")
    other = tmp_path / ".memory-0.pt.x.tmp"
    other.write_bytes(b"another file's")
    checkpoint.atomic_save({"a": torch.ones(2)}, tmp_path / "last.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".memory-0.pt.x.tmp", "last.pt"]
    assert torch.equal(torch.load(tmp_path / "last.pt", weights_only=True)["a"], torch.ones(2))


def test_a_full_disk_while_saving_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    """torch's zip writer reports a failed write as a RuntimeError without its errno; with no space
    left it becomes ENOSPC (which the commands print as one line), and the temp file is removed."""
    import errno
    import shutil
    from collections import namedtuple

    def failing_save(obj, f):
        Path(f).write_bytes(b"part")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2694336 vs 2694240")

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: namedtuple("u", "total used free")(10, 10, 0))
    with pytest.raises(OSError) as e:
        checkpoint.atomic_save({}, tmp_path / "last.pt")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "last.pt")
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setattr(checkpoint.torch, "save", lambda obj, f: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # not a write failure: unchanged
        checkpoint.atomic_save({}, tmp_path / "last.pt")


def test_a_state_that_does_not_fit_names_its_first_mismatch_in_full():
    """torch lists every mismatch; cutting its text at 200 characters ended mid-sentence."""
    small = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    wide = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    with pytest.raises(ConfigError) as e:
        checkpoint.restore("c.pt", wide, small.state_dict(), "model")
    assert str(e.value) == ("c.pt: the checkpoint's model does not fit this run's (size mismatch for 0.weight: "
                            "copying a param with shape torch.Size([4, 3]) from checkpoint, the shape in current "
                            "model is torch.Size([5, 3]); and 2 more)")


def test_checkpoint_from_another_config_is_refused(tmp_path):
    _, d = run(tmp_path, "a", ["train.epochs=1"])
    with pytest.raises(ConfigError, match="model.mem_dim: checkpoint 16 vs now 32"):
        run(tmp_path, "b", ["train.epochs=1", "model.mem_dim=32", f"train.resume={d}"])
    with pytest.raises(ConfigError, match="no checkpoint"):
        run(tmp_path, "c", ["train.epochs=1", f"train.resume={tmp_path / 'nowhere'}"])
    torch.save({"a": 1}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match=r"other.pt: not a tgdist checkpoint \(no model state\)$"):
        run(tmp_path, "e", ["train.epochs=1", f"train.resume={tmp_path / 'other.pt'}"])
    cfg = compose(SMALL + ["train.epochs=1", "parallel.k=2", f"train.resume={d}"])
    with pytest.raises(ConfigError, match=r"last.pt: written by a run of layout 1 x 1 x 1, and this run's is 1 x 1 x 2 "
                                          r"\(parallel.i/j/k\), a layout the memory cannot be re-placed to \(with "
                                          r"parallel.k > 1 each memory group .*\); resume with layout 1 x 1 x 1, or "
                                          r"change only parallel.i where j = k = 1$"):
        checkpoint.check_resume(cfg)  # what tgdist launch checks before starting the ranks
    # another trainer count of one memory group is resumed on (issue 55; tests/runtime/test_reshard.py)
    checkpoint.check_resume(compose(SMALL + ["train.epochs=1", "parallel.i=2", f"train.resume={d}"]))


def test_resume_with_more_epochs_equals_the_longer_run(tmp_path):
    _, d = run(tmp_path, "short", ["train.epochs=1"])
    extended, _ = run(tmp_path, "extended", ["train.epochs=2", f"train.resume={d}"])
    longer, _ = run(tmp_path, "longer", ["train.epochs=2"])
    assert metrics(extended) == metrics(longer) and extended["epochs"] == 2


def test_resuming_a_finished_run_says_nothing_is_left(tmp_path, caplog):
    done, d = run(tmp_path, "a", ["train.epochs=1"])
    with caplog.at_level("WARNING", logger="tgdist.runtime.run"):
        again, _ = run(tmp_path, "b", ["train.epochs=1", f"train.resume={d}"])
    assert "nothing left to train: the checkpoint is after epoch 1 and train.epochs=1" in caplog.text
    assert metrics(again) == metrics(done)


def test_unreadable_checkpoint_names_the_cause_in_one_line(tmp_path):
    (tmp_path / "junk.pt").write_text("garbage")
    torch.save({"a": 1}, tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:100])
    for name, cause in [("junk.pt", "UnpicklingError: Unsupported operand"),
                        ("cut.pt", "RuntimeError: PytorchStreamReader failed reading zip archive")]:
        with pytest.raises(ConfigError) as e:
            run(tmp_path, "r", ["train.epochs=1", f"train.resume={tmp_path / name}"])
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / name}: not a readable tgdist checkpoint ({cause}"), msg
        assert "\n" not in msg and "weights_only" not in msg and len(msg) < 300


def _flip(path: Path, at: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(data)


def _mismatch(path: Path) -> str:
    import hashlib

    data = path.read_bytes()
    return (f"{path}: checksum mismatch, the file is corrupt (expected sha256 {data[-64:].decode()[:12]}..., found "
            f"{hashlib.sha256(data[:-64]).hexdigest()[:12]}...)")


def test_a_corrupt_checkpoint_is_refused_before_the_run_directory_is_made(tmp_path):
    _, d = run(tmp_path, "a", ["train.epochs=1"])
    last = d / "checkpoints" / "last.pt"
    _flip(last, last.stat().st_size // 2)
    with pytest.raises(ConfigError) as e:
        run(tmp_path, "b", ["train.epochs=2", f"train.resume={d}"])
    assert str(e.value) == f"{_mismatch(last)}; resume from another checkpoint or start afresh"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_checkpoint_from_before_checksums_resumes(tmp_path):
    """A file without the seal (what torch.save wrote before checksums: no zip comment) is read
    unchecked, to the same results as the sealed one."""
    full, _ = run(tmp_path, "full", ["train.epochs=2"])
    _, d = run(tmp_path, "a", ["train.epochs=1"])
    last = d / "checkpoints" / "last.pt"
    data = bytearray(last.read_bytes()[:-78])
    data[-2:] = b"\0\0"  # the archive's comment length, 0 as torch writes it
    last.write_bytes(data)
    assert torch.load(last, weights_only=True)["iteration"] == 11  # after epoch 0's 11 batches
    resumed, _ = run(tmp_path, "b", ["train.epochs=2", f"train.resume={d}"])
    assert metrics(resumed) == metrics(full)


def test_a_parallel_checkpoint_is_checked_with_the_files_beside_it(tmp_path):
    """last.pt names its iteration directory, which holds every rank's file and every memory
    group's copy: each must be there and intact before any rank starts."""
    d = tmp_path / "p"
    cfg = compose(SMALL + ["train.epochs=1", "parallel.i=2", f"train.resume={d}"])
    it = d / "checkpoints" / "it00000003"
    checkpoint.atomic_save({"format": checkpoint.FORMAT, "config": checkpoint.identity(cfg), "layout": "2 x 1 x 1",
                            "iteration": 3, "epochs": 1, "dir": it.name,
                            "parts": ["rank-0.pt", "rank-1.pt", "memory-0.pt"], "model": {}, "optimizer": {}},
                           d / "checkpoints" / "last.pt")
    for name in ("rank-0.pt", "rank-1.pt", "memory-0.pt"):
        checkpoint.atomic_save({"x": torch.arange(1000)}, it / name)
    path, state = checkpoint.check_resume(cfg)
    assert state["iteration"] == 3 and checkpoint.parts(path, state) == [it / "rank-0.pt", it / "rank-1.pt",
                                                                         it / "memory-0.pt"]
    assert checkpoint.read_part(it / "rank-1.pt")["x"].sum() == 499500
    _flip(it / "memory-0.pt", 2000)
    with pytest.raises(ConfigError) as e:
        checkpoint.check_resume(cfg)
    assert str(e.value) == f"{_mismatch(it / 'memory-0.pt')}; resume from another checkpoint or start afresh"
    with pytest.raises(ConfigError, match="checksum mismatch"):
        checkpoint.read_part(it / "memory-0.pt")
    (it / "rank-1.pt").unlink()
    with pytest.raises(ConfigError) as e:
        checkpoint.check_resume(cfg)
    assert str(e.value) == (f"{it / 'rank-1.pt'}: missing, so the parallel checkpoint beside it is incomplete; "
                            f"resume from another checkpoint or start afresh")


def test_a_failed_seal_names_the_checkpoint_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno

    def full_disk(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpoint.checksum, "seal", full_disk)
    with pytest.raises(OSError) as e:
        checkpoint.atomic_save({"x": 1}, tmp_path / "last.pt")
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "last.pt"))
    assert list(tmp_path.iterdir()) == []


def test_run_directory_files(tmp_path):
    summary, d = run(tmp_path, "a", ["train.epochs=1"])
    rec = json.loads((d / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("loss", "val_ap", "val_auc", "test_ap", "test_mrr", "events_per_s", "eval_seconds"):
        assert np.isfinite(rec[key]), key
    assert set(rec["stage_seconds"]) == {"sample", "features", "memory_read", "compute", "memory_write"}
    # the process's CPU time over the epoch's training: positive, and no more than every core's wall time
    assert 0 < rec["train_cpu_seconds"] <= rec["train_seconds"] * (os.cpu_count() or 1) * 1.05
    assert summary["train_cpu_seconds"] == rec["train_cpu_seconds"]
    assert json.loads((d / "summary.json").read_text())["test_ap"] == summary["test_ap"]
    assert "model:" in (d / "config.yaml").read_text()


def test_zero_epochs_evaluates_the_untrained_model(tmp_path):
    cfg = compose(SMALL + ["train.epochs=0", f"run_dir={tmp_path / 'z'}"])
    r = Run(cfg, tmp_path / "z")
    before = {k: v.clone() for k, v in r.trainer.model.state_dict().items()}
    s = r.train()
    assert s["epochs"] == 0 and "best_epoch" not in s and "train_events_per_s" not in s
    for key in ("val_ap", "val_auc", "val_mrr", "test_ap", "test_auc", "test_mrr"):
        assert 0.0 <= s[key] <= 1.0, key
    after = r.trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # evaluated, not trained
    rec = json.loads((tmp_path / "z" / "metrics.jsonl").read_text())
    assert rec["epoch"] == -1 and rec["test_ap"] == s["test_ap"] and "train_ap" in rec
    trained, _ = run(tmp_path, "t", ["train.epochs=1"])
    assert trained["test_ap"] != s["test_ap"]


@pytest.mark.parametrize("model", ["jodie", "apan", "tgat2"])
def test_other_models_run(tmp_path, model):
    s, _ = run(tmp_path, model, ["train.epochs=1", f"model={model}", "model.mem_dim=16"])
    assert 0.0 <= s["test_ap"] <= 1.0


def test_a_run_with_the_embedding_cache_reports_it_per_epoch(tmp_path):
    s, d = run(tmp_path, "cache", ["train.epochs=2", "model=tgat2", "model.mem_dim=16", "cache=freshgnn"])
    assert 0.0 <= s["test_ap"] <= 1.0
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [ln["epoch"] for ln in lines] == [0, 1]
    for ln in lines:  # each epoch's own figures: the statistics restart with it
        c = ln["cache"]
        assert 0 < c["hit_rows"] < c["rows"] <= c["slots"] and c["computed"] < c["slots"]
        assert c["hit_rate"] == c["hit_rows"] / c["rows"] and c["admitted"] > 0


def test_no_time_encoding_trains_without_torch_warnings(tmp_path, recwarn):
    """``model.time_dim=0`` (an ablation) builds empty time maps; torch's warning about
    initialising them is not passed on."""
    s, _ = run(tmp_path, "t0", ["train.epochs=1", "model.time_dim=0", "model.mem_dim=16"])
    assert np.isfinite(s["test_ap"])
    assert not [w for w in recwarn if "zero-element" in str(w.message)]


def test_static_memory_with_pretraining(tmp_path):
    s, _ = run(tmp_path, "s", ["train.epochs=1", "model.static_memory=true", "model.static_pretrain_epochs=1"])
    assert np.isfinite(s["test_ap"])


@pytest.mark.parametrize("task", ["node", "edge"])
def test_downstream_task_needs_labels_before_any_training(tmp_path, task):
    with pytest.raises(ConfigError, match="needs labels"):
        run(tmp_path, "n", ["train.epochs=1", f"train.task={task}"])
    assert not (tmp_path / "n").exists()  # refused while building: no epoch ran, nothing written


INVALID = [
    (["model.mem_dim=15"], "divisible"),
    (["train.task=regression"], "train.task"),
    (["train.lr=nan"], "train.lr=nan: give a positive, finite learning rate"),
    (["train.batch_size=0"], "train.batch_size=0: give a positive number of events per batch$"),
    (["train.epochs=-1"], r"train.epochs=-1: give a count of at least 0 \(0 evaluates the untrained model\)$"),
    (["sampler.fanouts=[]"], r"sampler.fanouts=\[\]"),
    (["sampler.fanouts=[10,0]"], "one positive neighbour count per hop"),
    (["sampler.fanouts=[10,10]"], (r"sampler.fanouts=\[10, 10\] gives 2 hops, but model.num_layers=1 attends over "
                                   r"1: use model=tgat2 \(or model.num_layers=2\) for two hops$")),
    (["model=tgat2", "sampler.fanouts=[10,10,10]"], (r"gives 3 hops, but model.num_layers=2 attends over 2: give one "
                                                     r"neighbour count per layer$")),
    (["model.mailbox_size=5"], r"model.mailbox_size=5: only APAN keeps a mailbox \(model=apan\); TGN keeps each"),
    (["model=jodie", "model.mailbox_size=3"], "model.mailbox_size=3: only APAN keeps a mailbox"),
    (["model=apan", "model.num_layers=2"], r"model.num_layers=2: APAN has no attention layers to stack"),
    (["model=jodie", "model.num_layers=2"], r"model.num_layers=2: JODIE has no attention layers to stack"),
    (["model=apan", "sampler.fanouts=[5,5]"], r"gives 2 hops, but APAN delivers mails to one hop of sampled"),
    (["model=jodie", "sampler.fanouts=[5,5]"], r"gives 2 hops, but JODIE samples no neighbours$"),
    (["data.max_events=0"], "data.max_events=0 keeps no events"),
    (["data.max_events=1"], "no training events: the chronological split of 1 event "),
    (["model.mem_dim=0"], "model.mem_dim=0: must be at least 1"),
    (["model.num_heads=0"], "model.num_heads=0"),
    (["model=apan", "model.mailbox_size=0"], "model.mailbox_size=0"),
    (["model.time_dim=-1"], "model.time_dim=-1: must be at least 0"),
    (["model.dropout=1.5"], r"model.dropout=1.5: give a probability in \[0, 1\]"),
    (["train.seed=-1"], "train.seed=-1"),
    (["train.checkpoint_every=-1"], "train.checkpoint_every=-1"),
    (["sampler.num_threads=-1"], "sampler.num_threads=-1: must be at least 0"),
    (["train.node_class_epochs=0"], "train.node_class_epochs=0: must be at least 1"),
    (["model.static_pretrain_epochs=-1"], "model.static_pretrain_epochs=-1"),
    (["model.static_pretrain_epochs=2"], ("model.static_pretrain_epochs=2 pre-trains the static node memory, which "
                                          "model.static_memory=false leaves out")),
    (["memory.backend=daemon", "memory.timeout=0"], "memory.timeout=0.0: give a positive, finite number of seconds$"),
    (["memory.backend=daemon", "memory.max_ids=0"], "memory.max_ids=0: give a positive row count, or null$"),
    (["memory.backend=daemon", "memory.num_threads=0"], "memory.num_threads=0: must be at least 1$"),
    (["memory.timeout=30"], "^memory.timeout=30.0 is read by memory.backend=daemon only; memory.backend=auto does not "
                            "read it$"),
    (["memory.backend=nvme"], "^memory.backend=nvme: choose one of auto, daemon, depcache, depcomm, local, sven$"),
    (["train.lr_scaling=log"], "^train.lr_scaling=log: choose one of linear, sqrt, none$"),
    (["train.device=tpu"], "train.device='tpu': choose auto, cpu, cuda or cuda:N"),
    (["data.time_unit=days"], "^data.time_unit=days: choose one of auto, s, ms, us, ns$"),
    (["train.device=cuda:99"], "train.device=cuda:99 but (CUDA is not available|this machine has)"),
    (["data.val_frac=0.9", "data.test_frac=0.2"], r"data.val_frac=0.9, data.test_frac=0.2: each must be in \[0, 1\)"),
    (["data.test_frac=-0.1"], r"data.test_frac=-0.1: each must be"),
    (["train.epochs=0", "parallel.k=2"], r"train.epochs=0 \(evaluate the untrained model\) runs in one process"),
    (["train.resume=/nonexistent/run"], "train.resume=/nonexistent/run: no checkpoint at /nonexistent/run$"),
]


def test_jodie_takes_any_memory_size():
    """JODIE has no attention: its memory size need not divide by a head count it does not use."""
    assert build_trainer(compose(SMALL + ["model=jodie", "model.mem_dim=5"])).model.mem_dim == 5


def test_a_missing_shared_data_set_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TGDIST_DATASETS", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=(r"^data=wikipedia: .*/nowhere/wikipedia/wikipedia.csv.gz is missing; shared "
                                           r"data sets are read from .*/nowhere \(\$TGDIST_DATASETS\): set "
                                           r"TGDIST_DATASETS to the folder that holds wikipedia/$")):
        run(tmp_path, "w", ["data=wikipedia"])
    assert not (tmp_path / "w").exists()


def test_epoch_time_units_are_told_by_their_size():
    from tgdist.data.graph import epoch_time_unit

    t = np.array([1_082_040_961, 1_098_777_142])  # CollegeMsg: Unix seconds, 2004
    assert [epoch_time_unit(t * f) for f in (1, 10**3, 10**6, 10**9)] == ["s", "ms", "us", "ns"]
    assert epoch_time_unit(np.array([0, 2_678_373])) == "s"  # relative times (Wikipedia)
    assert epoch_time_unit(np.array([1.2e12, 9e13])) == "s"  # spans two ranges: no guess
    assert epoch_time_unit(np.array([1289241911.72836])) == "s"


def test_millisecond_times_give_the_model_the_same_seconds(tmp_path):
    """CollegeMsg written in Unix milliseconds: ``data.time_unit=auto`` hands the model the times
    and gaps of the seconds file (to float32 rounding), so the time encoding sees the same inputs;
    ``data.time_unit=s`` reads the milliseconds as they are."""
    from tgdist.data.graph import TemporalGraph, subset
    from tgdist.data.load import load_graph

    g = subset(load_graph(None), 1500)
    ms = TemporalGraph(**{**{f.name: getattr(g, f.name) for f in dataclasses.fields(g)}, "t": g.t * 1000})
    over = SMALL + ["train.num_neg_eval=1"]
    a, b = build_trainer(compose(over), graph=g), build_trainer(compose(over), graph=ms)
    assert np.array_equal(a.t_rel[:], b.t_rel[:]) and b.units_per_second == 1000
    lo = a.split.range("val")[0]
    neg = a.negatives.fixed("val", lo, lo + 100, 1)
    pa, pb = a.prepare(lo, lo + 100, neg), b.prepare(lo, lo + 100, neg)
    np.testing.assert_allclose(pb.hop_tables[0].dt_values.numpy()[pb.hop_tables[0].dt_index.numpy()],
                               pa.hop_tables[0].dt_values.numpy()[pa.hop_tables[0].dt_index.numpy()], rtol=1e-6)
    a.model.eval(), b.model.eval()  # no dropout
    with torch.no_grad():
        oa, ob = a.compute(pa, train=False), b.compute(pb, train=False)
    np.testing.assert_allclose(ob.pos.numpy(), oa.pos.numpy(), rtol=1e-4, atol=1e-5)
    raw = build_trainer(compose(over + ["data.time_unit=s"]), graph=ms)
    assert np.array_equal(raw.t_rel[:], a.t_rel[:] * 1000) and raw.units_per_second == 1
    ja = build_trainer(compose(over + ["model=jodie"]), graph=g)
    jb = build_trainer(compose(over + ["model=jodie"]), graph=ms)
    assert ja.model.embedding.time_scale == jb.model.embedding.time_scale


def test_a_checkpoint_from_before_time_units_resumes(tmp_path):
    """Checkpoints written before ``data.time_unit`` existed count as written under its default."""
    s, d = run(tmp_path, "a", ["train.epochs=1"])
    path = d / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    del state["config"]["data.time_unit"]
    torch.save(state, path)
    again, _ = run(tmp_path, "b", ["train.epochs=1", f"train.resume={d}"])
    assert metrics(again) == metrics(s)
    with pytest.raises(ConfigError, match=r"data.time_unit: checkpoint 'auto' vs now 'ms'"):
        run(tmp_path, "c", ["train.epochs=1", f"train.resume={d}", "data.time_unit=ms"])


def test_one_timestamp_for_every_event_suggests_naming_the_time_column(tmp_path):
    """KONECT's ``src dst weight time`` read as ``src dst t``: every event at weight 1, so no split."""
    path = tmp_path / "out.konect"
    path.write_text("% sym unweighted\n" + "".join(f"{i} {i + 1} 1 {100 + i}\n" for i in range(20)))
    with pytest.raises(ConfigError, match=r"leaves none before the validation part; every event has the time 1: "
                                          r"if the time is another column, name the columns with data.columns"):
        run(tmp_path, "k", [f"data.path={path}", "data.cache=false"])
    s, _ = run(tmp_path, "k", [f"data.path={path}", "data.cache=false", "data.columns='src,dst,_,t'",
                               "train.epochs=1"])
    assert s["traversed_events"] == 14


def test_split_and_resume_are_checked_without_the_data():
    from tgdist.runtime.build import precheck, validate

    with pytest.raises(ConfigError, match="data.val_frac=0.5, data.test_frac=0.5"):
        validate(compose(["data.val_frac=0.5", "data.test_frac=0.5", "data.path=/nonexistent.csv"]))
    with pytest.raises(ConfigError, match="train.resume=/nonexistent/run: no checkpoint"):
        precheck(compose(["train.resume=/nonexistent/run"]))


@pytest.mark.parametrize("overrides, message", INVALID, ids=[o[-1] for o, _ in INVALID])
def test_invalid_settings_fail_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run(tmp_path, "x", overrides)
    assert not (tmp_path / "x").exists()


def test_jodie_needs_no_fanouts(tmp_path):
    s, _ = run(tmp_path, "j", ["model=jodie", "sampler.fanouts=[]", "train.epochs=1"])
    assert np.isfinite(s["test_ap"])


def _labelled_graph(kind: str, num_events: int = 3000, seed: int = 0):
    """Bipartite, 30 sources and 30 destinations in three communities (source s talks to
    destinations d with d % 3 == s % 3), which link prediction learns. ``node``: an event's label is
    1 when its source is in community 0; ``edge``: three multi-label classes, the community;
    ``classes``: the community as one integer column with values -2, 3 and 8."""
    from tgdist.data.graph import TemporalGraph

    rng = np.random.default_rng(seed)
    src = rng.integers(0, 30, num_events)
    dst = 30 + src % 3 + 3 * rng.integers(0, 10, num_events)
    if kind == "node":
        label = (src % 3 == 0).astype(np.int64)
    elif kind == "classes":
        label = 5 * (src % 3) - 2
    else:
        label = np.zeros((num_events, 3), np.int64)
        label[np.arange(num_events), dst % 3] = 1
    return TemporalGraph(src=src, dst=dst, t=np.arange(num_events, dtype=np.int64), num_nodes=60,
                         node_map=np.arange(60), node_feat=np.eye(60, dtype=np.float32), label=label,
                         bipartite=True, num_src_nodes=30)


@pytest.mark.parametrize("task, kind", [("node", "node"), ("edge", "edge"), ("node", "classes"), ("edge", "classes")])
def test_downstream_classification_learns_labels(tmp_path, task, kind):
    """The decoder on frozen embeddings learns labels the embeddings carry. Communities are
    encoded by DistTGL's static node memory pre-trained on the link task (dynamic memory alone
    cannot tell structurally identical nodes apart on this graph: TGN's test AP stays at 0.5).
    Integer classes are one class per event, not a 0/1 target: the F1 is over the three of them."""
    from tgdist.runtime.build import build_trainer

    cfg = compose(SMALL + ["train.epochs=1", "model.static_memory=true", "model.static_pretrain_epochs=40",
                           f"train.task={task}", "train.node_class_epochs=30",
                           f"run_dir={tmp_path / task}"])
    summary = Run(cfg, tmp_path / task, trainer=build_trainer(cfg, graph=_labelled_graph(kind))).train()
    if kind == "node":
        assert summary["test_node_auc"] > 0.9
    else:
        assert summary["test_f1_micro"] > 0.8 and summary["test_f1_macro"] > 0.8
        assert summary.get("classes") == (3 if kind == "classes" else None)


def _node_labelled_graph(num_events: int = 3000, seed: int = 0):
    """``_labelled_graph``'s communities, labelled the TGL way: node labels at times (a source is 1
    in community 0), no label per event."""
    from tgdist.data.graph import NodeLabels

    g = _labelled_graph("node", num_events, seed)
    rng = np.random.default_rng(seed + 1)
    t = np.sort(rng.integers(0, num_events + 50, 1200))  # some after the last event
    node = rng.integers(0, 30, 1200)
    g.label, g.node_labels = None, NodeLabels(node, t, (node % 3 == 0).astype(np.int64))
    return g


@pytest.mark.parametrize("model", ["tgn", "jodie"])
def test_embed_is_the_embedding_a_batch_root_gets(model):
    """``Trainer.embed`` of (node, time) queries before a batch equals the embedding the batch gives
    the same nodes as roots at the same times, and writes no memory."""
    tr = build_trainer(compose(SMALL + [f"model={model}", "train.epochs=1"]), graph=_labelled_graph("node"))
    tr.model.eval()
    for s, e in list(tr.batches("train"))[:5]:
        tr.step(s, e, tr.negatives.train(e - s, 1), train=False)
    s, e = s + 100, e + 100
    mem, mail = tr.memory.mem.clone(), tr.memory.mail.clone()
    queried = tr.embed(tr.g.src[s:e], tr.g.t[s:e])
    assert torch.equal(tr.memory.mem, mem) and torch.equal(tr.memory.mail, mail)
    out = tr.step(s, e, tr.negatives.train(e - s, 1), train=False, keep_emb=True)
    torch.testing.assert_close(queried, out.h_src, rtol=1e-5, atol=1e-6)
    assert not torch.equal(tr.memory.mem, mem)  # the step did write


@pytest.mark.parametrize("override, message", [
    ("+train.epoch=1", r"^\+train.epoch: not a key of tgdist's config .*did you mean 'train.epochs'\?$"),
    ("train.epoch=1", r"^Could not override 'train.epoch': .*did you mean 'train.epochs'\?$"),
    ("train.epochs=abc", r"^Error merging override train.epochs=abc: Value 'abc' .* could not be converted"),
    ("model=nope", r"Could not find 'model/nope' \(options: apan, jodie, tgat2, tgn\)$"),
])
def test_compose_refuses_what_the_command_refuses(override, message):
    """From Python, ``compose`` refuses a bad override as ``tgdist train`` does, as a one-line
    ConfigError: ``+train.epoch=1`` used to be added silently (training the default epochs), and
    the rest raised Hydra's exceptions, whose advice was to add that ``+``."""
    with pytest.raises(ConfigError, match=message):
        compose([override])


def test_a_parallel_layout_in_one_process_is_refused_before_anything_is_written(tmp_path):
    """One driver for every layout: a layout of two processes started as one is refused in one
    line that says how to start it (it trained one process with local memory without a word)."""
    with pytest.raises(ConfigError, match=r"^parallel.i x parallel.j x parallel.k = 2 x 1 x 1 = 2 but the world has 1 "
                                          r"process \(start 2 processes: tgdist launch --nproc 2"):
        Run(compose(SMALL + ["parallel.i=2"]), tmp_path / "r")
    assert not (tmp_path / "r").exists()


_TIMES = ("train_seconds", "train_cpu_seconds", "compile_seconds", "events_per_s", "stage_seconds", "eval_seconds",
          "final_test_seconds")


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["tgn", pytest.param("apan", marks=pytest.mark.slow)])  # ~30, 35 s
def test_every_memory_store_on_one_process_gives_the_metrics_of_local_memory(tmp_path, model, monkeypatch):
    """The same loop drives every store: on one process each trains and evaluates (after every
    epoch, between which the stream restarts) exactly as local memory does. DepCache, Sven and
    DepComm hold a batch's writes until the store's exchange; evaluation made none, so it read
    lagging memory (val AP 0.8832 against 0.8959) and the next epoch applied the held writes after
    its reset. No write may be pending when an evaluation starts or ends, and every batch's writes
    are pending just before its exchange (the count the run's check reads is a real one)."""
    from tgdist.memory.depcache import DepCacheMemory
    from tgdist.memory.sven import PartitionedMemory
    from tgdist.runtime.trainer import Trainer

    pending, before_exchange = [], []
    evaluate = Trainer.evaluate

    def checked(self, part, *a, **k):
        pending.append(self.memory.pending_writes())
        out = evaluate(self, part, *a, **k)
        pending.append(self.memory.pending_writes())
        return out

    def counted(exchange):
        def exchange_counted(self):
            before_exchange.append(self.pending_writes())
            return exchange(self)
        return exchange_counted

    monkeypatch.setattr(Trainer, "evaluate", checked)
    for store in (DepCacheMemory, PartitionedMemory):  # the stores that hold writes until the exchange
        monkeypatch.setattr(store, "exchange", counted(store.exchange))
    over = SMALL + ["train.epochs=2", f"model={model}", "train.checkpoint_every=4", "train.test_every_epoch=true"] + \
        (["model.mailbox_size=3"] if model == "apan" else [])
    local, d_local = run(tmp_path, "local", over)
    lines = {}
    for backend in ("local", "depcache", "daemon", "depcomm", "sven"):
        pending.clear()
        before_exchange.clear()
        got, d = (local, d_local) if backend == "local" else run(tmp_path, backend, over + [f"memory.backend={backend}"])
        assert got["memory_backend"] == backend
        assert metrics(got) == metrics(local) and got["best_epoch"] == local["best_epoch"], backend
        lines[backend] = [{k: v for k, v in json.loads(x).items() if k not in _TIMES}
                          for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert lines[backend] == lines["local"], backend
        if backend != "local":  # (local's ran before the probe was cleared; it holds none anyway)
            assert len(pending) == 2 * 5 and set(pending) == {0}, (backend, pending)  # 2 x (val, test) + final test
        if backend in ("depcache", "depcomm", "sven"):  # every training and evaluation batch wrote, then exchanged
            assert len(before_exchange) > got["iterations"] and min(before_exchange) > 0, (backend, before_exchange)
    assert [x["epoch"] for x in lines["local"]] == [0, 1] and "test_ap" in lines["local"][0]


@pytest.mark.distributed
def test_a_store_of_another_backend_is_built_without_a_whole_local_memory_first(tmp_path, monkeypatch):
    """The trainer was built with the whole memory and mails, which the backend's store then
    replaced: a partitioned store's peak carried the full memory it exists to spread (1.1 GiB per
    rank at 1M nodes). Now the trainer is built with its store: a local memory only for local."""
    import tgdist.runtime.build as build
    import tgdist.runtime.run as run_module

    sizes = []
    counted = lambda model, n: sizes.append(n) or memory_for(model, n)  # noqa: E731
    monkeypatch.setattr(build, "memory_for", counted)
    monkeypatch.setattr(run_module, "memory_for", counted)
    for backend in ("local", "daemon"):
        r = Run(compose(SMALL + [f"memory.backend={backend}"]), tmp_path / backend)
        try:
            assert r.trainer.memory.num_nodes == r.trainer.g.num_nodes
        finally:
            r.close()
    n = r.trainer.g.num_nodes
    assert sizes == [n]


def test_a_run_trains_once(tmp_path):
    """A second ``train()`` trained on and recorded its epochs from 0 again."""
    r = Run(compose(SMALL + ["train.epochs=1", "train.stop_after_batches=2"]), tmp_path / "r")
    r.train()
    with pytest.raises(RuntimeError, match=r"^Run.train\(\) runs once"):
        r.train()


def test_deterministic_mode_follows_each_runs_config():
    """Two runs in one process (a notebook): the second, with train.deterministic=false, ran in
    deterministic mode because the first had turned it on and nothing turned it off."""
    try:
        build_trainer(compose(SMALL + ["train.deterministic=true"]))
        assert torch.are_deterministic_algorithms_enabled()
        build_trainer(compose(SMALL + ["train.deterministic=false"]))
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_deterministic_mode_fixes_cublas_workspace_unless_the_user_did(monkeypatch):
    """torch refuses cuBLAS products in deterministic mode unless CUBLAS_WORKSPACE_CONFIG is set
    (a RuntimeError at a CUDA run's first matmul); deterministic runs set it, keeping a user's."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # restored as it was (maybe unset) after the test
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    try:
        build_trainer(compose(SMALL + ["train.deterministic=false"]))
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        build_trainer(compose(SMALL + ["train.deterministic=true"]))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        build_trainer(compose(SMALL + ["train.deterministic=true"]))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("model", ["tgn", "tgat2"])
def test_embed_answers_the_same_in_any_model_mode(model):
    """A trainer fresh from ``build_trainer`` (and ``checkpoint.load``) is in training mode: embed
    queries ran with dropout, so two identical queries disagreed. They now match the eval-mode
    answer, carry no gradient graph, and leave the mode as it was."""
    tr = build_trainer(compose(SMALL + [f"model={model}", "model.dropout=0.5"]))
    assert tr.model.training
    nodes, times = tr.g.src[-20:], tr.g.t[-20:] + 1
    first, second = tr.embed(nodes, times), tr.embed(nodes, times)
    assert torch.equal(first, second) and not first.requires_grad and tr.model.training
    tr.model.eval()
    assert torch.equal(tr.embed(nodes, times), first) and not tr.model.training


def test_embed_refuses_queries_it_cannot_answer():
    """Bad ids or times would index the sampler's numba kernels out of bounds: refused up front."""
    tr = build_trainer(compose(SMALL))
    t, n = tr.g.t[-1], tr.g.num_nodes
    assert tr.embed(np.array([0, n - 1]), np.array([t, t])).shape == (2, 16)
    for nodes, times, message in [
        ([n], [t], rf"node ids must be integers in 0..{n - 1} \(g.node_map"),
        ([-1], [t], "node ids must be integers in"),
        ([0.5], [t], "node ids must be integers in"),
        ([0, 1], [t], r"one length, got shapes \(2,\) and \(1,\)"),
        ([[0]], [[t]], "must be 1-D arrays"),
        ([0], [np.nan], "times must be finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            tr.embed(np.array(nodes), np.array(times))
    assert tr.embed(np.array([], np.int64), np.array([], tr.g.t.dtype)).shape == (0, 16)


def test_node_task_on_node_labels_at_times(tmp_path):
    """TGL ``labels.csv``: labels of nodes at times, not of events. Each is embedded from the
    events before its time and split by time with the events; the decoder learns them."""
    from tgdist.data.graph import chronological_split, label_ranges
    from tgdist.runtime.build import build_trainer

    g = _node_labelled_graph()
    cfg = compose(SMALL + ["train.epochs=1", "model.static_memory=true", "model.static_pretrain_epochs=40",
                           "train.task=node", "train.node_class_epochs=30", f"run_dir={tmp_path / 'n'}"])
    summary = Run(cfg, tmp_path / "n", trainer=build_trainer(cfg, graph=g)).train()
    assert summary["test_node_auc"] > 0.9 and summary["val_node_auc"] > 0.9
    ranges = label_ranges(g.node_labels, g, chronological_split(g))
    (t0, t1), (v0, v1), (s0, s1) = ranges.values()
    split = chronological_split(g)
    assert t0 == 0 and t1 == v0 and v1 == s0 and s1 == len(g.node_labels) and min(t1, v1 - v0, s1 - s0) > 0
    assert g.node_labels.t[t1 - 1] < g.t[split.train_end] <= g.node_labels.t[t1]


def test_a_part_without_labels_or_of_one_class_is_refused_before_training():
    """Its ROC-AUC or F1 cannot be computed: the run trained, then reported null (before that, 0.0
    as if measured)."""
    from tgdist.data.graph import NodeLabels, chronological_split, label_ranges

    g = _node_labelled_graph()
    split = chronological_split(g)
    keep = g.node_labels.t < g.t[split.val_end]  # no test labels
    lab = NodeLabels(g.node_labels.node[keep], g.node_labels.t[keep], g.node_labels.label[keep].copy())
    node = SMALL + ["train.task=node"]
    with pytest.raises(ConfigError, match=r"^train.task=node: none of the [\d,]+ node labels of data '.*' falls in the "
                                          r"test part, so no test node metric could be computed: move the split"):
        build_trainer(compose(node), graph=dataclasses.replace(g, node_labels=lab))
    (v0, v1) = label_ranges(lab, g, split)["val"]
    lab.label[v0:v1] = 1  # val labels all of one class: ROC-AUC is undefined
    with pytest.raises(ConfigError, match=rf"^train.task=node: the {v1 - v0} node labels of the val part are all 1, "
                                          r"so its ROC-AUC could not be computed"):
        build_trainer(compose(node), graph=dataclasses.replace(g, node_labels=lab))
    edge = _labelled_graph("node")
    edge.label[split.train_end:split.val_end] = 0
    with pytest.raises(ConfigError, match=r"^train.task=edge: the [\d,]+ event labels of the val part are all 0, so "
                                          r"its F1 could not be computed"):
        build_trainer(compose(SMALL + ["train.task=edge"]), graph=edge)
    assert build_trainer(compose(SMALL + ["train.task=link"]), graph=edge) is not None  # the link task has no labels
    multi = _labelled_graph("edge")  # multi-label: F1 over columns is defined
    multi.label[split.train_end:split.val_end] = 0
    assert build_trainer(compose(SMALL + ["train.task=edge"]), graph=multi) is not None


def test_downstream_metrics_of_a_part_asked_away_are_null(tmp_path, caplog):
    """Not 0.0 as if measured, and not NaN, which is not JSON: null, with a warning naming why."""
    edge = _labelled_graph("classes")
    cfg = compose(SMALL + ["train.epochs=1", "train.task=edge", "train.node_class_epochs=1", "data.test_frac=0",
                           f"run_dir={tmp_path / 'e'}"])
    with caplog.at_level("WARNING", logger="tgdist"):
        summary = Run(cfg, tmp_path / "e", trainer=build_trainer(cfg, graph=edge)).train()
    assert summary["test_f1_micro"] is None and summary["test_f1_macro"] is None
    assert summary["val_f1_micro"] is not None
    assert "no test labels, so test_f1_micro and test_f1_macro are null" in caplog.text

    def no_nan(name):
        raise AssertionError(f"{name} in summary.json")

    assert json.loads((tmp_path / "e" / "summary.json").read_text(), parse_constant=no_nan)["test_f1_micro"] is None


def test_untrained_baseline_of_a_classification_task(tmp_path):
    """``train.epochs=0`` with ``train.task=edge``: the metrics line of the untrained model (it was
    left empty) and a summary naming the data and model, then the decoder's metrics."""
    from tgdist.runtime.build import build_trainer

    cfg = compose(SMALL + ["train.epochs=0", "train.task=edge", "train.node_class_epochs=1", f"run_dir={tmp_path / 'e'}"])
    summary = Run(cfg, tmp_path / "e", trainer=build_trainer(cfg, graph=_labelled_graph("classes"))).train()
    lines = [json.loads(x) for x in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in lines] == [-1] and "test_ap" in lines[0]
    assert summary["model"] == "tgn" and summary["epochs"] == 0 and summary["test_ap"] == lines[0]["test_ap"]
    assert summary["test_f1_micro"] is not None and summary["classes"] == 3
    assert (tmp_path / "e" / "checkpoints" / "last.pt").exists()  # the untrained model, as every run keeps its own


def test_node_labels_at_times_are_checked_before_training():
    from tgdist.runtime.build import build_trainer

    g = _node_labelled_graph()
    with pytest.raises(ConfigError, match="^train.task=edge needs a label per event, and data 'g' has node labels "
                                          r"at times \(labels.csv\) only: use train.task=node$"):
        build_trainer(compose(SMALL + ["train.task=edge"]), graph=dataclasses.replace(g, name="g"))
    late = dataclasses.replace(g.node_labels, t=g.node_labels.t + 10**6)
    with pytest.raises(ConfigError, match="none of the 1,200 node labels of data 'g' falls before the validation"):
        build_trainer(compose(SMALL + ["train.task=node"]), graph=dataclasses.replace(g, name="g", node_labels=late))


def test_class_targets():
    from tgdist.data.graph import MAX_CLASSES, class_targets

    y, classes = class_targets(np.array([0, 1, 1]))
    assert y.tolist() == [[0], [1], [1]] and classes is None
    y, classes = class_targets(np.array([[0, 1], [1, 1]]))
    assert y.tolist() == [[0, 1], [1, 1]] and classes is None
    y, classes = class_targets(np.array([3, -1, 3, 0]))
    assert classes.tolist() == [-1, 0, 3] and y.tolist() == [[0, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 0]]
    with pytest.raises(DataError, match=r"^d: multi-label targets \[events, classes\] must be 0 or 1$"):
        class_targets(np.array([[0, 2]]), "d")
    with pytest.raises(DataError, match=f"^d: the label column has {MAX_CLASSES + 1:,} distinct values"):
        class_targets(np.arange(MAX_CLASSES + 1), "d")


def test_a_checkpoint_keeps_the_gpu_generator_and_resume_restores_it(tmp_path, monkeypatch):
    """Dropout on a GPU draws from the device's generator, not the CPU's: a checkpoint of a run on
    CUDA keeps that generator's state and a resume restores it (without it a run resumed on an H200
    drew other dropout masks than the uninterrupted run). A device shim: the run trains on the CPU,
    then says its device is CUDA, whose generator is a stand-in."""
    gen = {"cuda": torch.tensor([7, 7], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gen[str(device)].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": gen.update({str(device): s.clone()}))
    r = Run(compose(SMALL + ["train.epochs=1", f"run_dir={tmp_path}"]), tmp_path)  # set up, not trained
    try:
        r.save(5)  # on the CPU: no GPU state
        assert "cuda_rng" not in checkpoint.read_part(r.ckpt_dir / "it00000005" / "rank-0.pt")
        r.trainer.device = "cuda"
        r.save(6)
        state = checkpoint.read(r.ckpt_path)
        assert torch.equal(checkpoint.read_part(r.ckpt_dir / state["dir"] / "rank-0.pt")["cuda_rng"],
                           torch.tensor([7, 7], dtype=torch.uint8))
        gen["cuda"] = torch.tensor([1, 2], dtype=torch.uint8)  # the generator moves on
        r.load(r.ckpt_path, state)
        assert gen["cuda"].tolist() == [7, 7]
    finally:
        r.close()


def test_a_resume_into_a_store_that_reads_other_files_re_places_the_memory():
    """A sven checkpoint (a shard per trainer) resumed with depcache (a copy per group), or with
    sven under another placement, was refused; since issue 55 its memory is gathered and re-placed
    (``reshard.replaces_memory``), and ``check_store`` refuses only a store this tgdist lacks.
    Stores that keep a whole copy per group read each other's files as they are."""
    par = ["parallel.i=2", "train.epochs=2"]
    layout = Layout(2, 1, 1)
    state = {"layout": str(layout), "memory_backend": "sven", "placement": checkpoint.settings(
        compose([*par, "memory.backend=sven"]), ("partition",), set())}
    for now, replaced in [("depcache", True), ("sven", False), ("depcomm", True)]:
        cfg = compose([*par, f"memory.backend={now}"])
        checkpoint.check_store("last.pt", state, cfg)
        assert reshard.replaces_memory(state, cfg, layout, now) is replaced, now
    cfg = compose([*par, "memory.backend=sven", "partition.method=range"])
    checkpoint.check_store("last.pt", state, cfg)
    assert reshard.replaces_memory(state, cfg, layout, "sven")  # shards of another placement
    whole = {"layout": str(layout), "memory_backend": "depcache", "placement": None}
    checkpoint.check_store("last.pt", whole, compose([*par, "memory.backend=daemon"]))  # a whole copy per group, both
    assert not reshard.replaces_memory(whole, compose([*par, "memory.backend=daemon"]), layout, "daemon")
    checkpoint.check_store("last.pt", {}, compose([*par, "memory.backend=depcache"]))  # an older checkpoint
    assert not reshard.replaces_memory({}, compose(par), layout, "depcache")  # its files read as they are


@pytest.mark.parametrize("backend, store, held", [("depcache", "DepCacheMemory", 2), ("sven", "SvenMemory", 1),
                                                 ("depcomm", "DepCommMemory", 1)])
def test_writes_left_unexchanged_at_an_evaluation_stop_the_run_in_one_line(tmp_path, monkeypatch, backend, store,
                                                                            held):
    """A store that holds a batch's writes until its exchange, with the exchange of the epoch's
    last batch skipped: validation would read memory without that batch's writes (AP from lagging
    memory, then the writes applied after the next epoch's reset). The run stops before evaluating,
    naming how many write batches are held (DepCache: the batch's memory and mail writes; Sven and
    DepComm: its aggregation, issued during the step) and where; nothing is recorded for the epoch."""
    r = Run(compose(SMALL + ["train.epochs=1", f"memory.backend={backend}", f"run_dir={tmp_path / 'r'}"]),
            tmp_path / "r")
    try:
        cls = type(r.trainer.memory)
        assert cls.__name__ == store
        exchange, calls = cls.exchange, []

        def skipping_the_last(self):
            calls.append(1)
            if len(calls) != r.batches_per_epoch:  # (one exchange per training iteration)
                exchange(self)

        monkeypatch.setattr(cls, "exchange", skipping_the_last)
        with pytest.raises(RuntimeError) as e:
            r.train()
        assert str(e.value) == (f"{held} memory write batches not yet exchanged at epoch 0's validation: the memory "
                                f"store ({store}) would be read without them")
        assert len(calls) == r.batches_per_epoch > 1
        lines = tmp_path / "r" / "metrics.jsonl"
        assert not lines.exists() or lines.read_text() == ""
    finally:
        r.close()
