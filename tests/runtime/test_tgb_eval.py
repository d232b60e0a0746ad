"""TGB's one-vs-many evaluation (``train.eval=tgb``): TGB's rank rule with ties and padded lists,
the memory it reads and writes, and a whole run whose MRR equals py-tgb's ``Evaluator`` on the
scores the run wrote."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from tests.data.tgb_files import write_wiki
from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.metrics import reciprocal_ranks
from tgdist.runtime.run import Run
from tgdist.runtime.tgb_eval import ranks

SMALL = ["data=tgb", "data.name=tgbl-wiki", "model.mem_dim=16", "model.time_dim=8", "train.batch_size=50",
         "train.progress=false", "train.num_threads=1", "sampler.num_threads=1"]


def tgb_mrr(pos: np.ndarray, neg: np.ndarray, ptr: np.ndarray) -> float:
    """The MRR of TGB's examples: py-tgb's ``Evaluator`` on each event, then the mean over events
    (the test is skipped without py-tgb: a rule written here again would check the code against
    itself; the rule itself is checked against ranks counted by hand)."""
    evaluate = pytest.importorskip("tgb.linkproppred.evaluate", reason="py-tgb is not installed (the dev extra)")
    ev = evaluate.Evaluator(name="tgbl-wiki")
    return float(np.mean([ev.eval({"y_pred_pos": np.array([p]), "y_pred_neg": neg[a:b], "eval_metric": ["mrr"]})["mrr"]
                          for p, a, b in zip(pos, ptr, ptr[1:])]))


def test_rank_rule_counts_ties_half_and_ignores_pads():
    pos = np.array([0.5, 0.5, 0.5, 2.0, -1.0])
    neg = np.array([[0.1, 0.5, 0.9, 7.0], [0.5, 0.5, 0.5, 0.5], [0.9, 0.9, 0.0, 0.0], [1.0, 2.0, 3.0, 0.0],
                    [-1.0, -2.0, 0.0, 0.0]])
    valid = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], bool)
    r = ranks(pos, neg, valid)
    # one above and one equal: 1 + 1 + 0.5; four equal: 1 + 2; two above; one above, one equal, ...
    assert r.tolist() == [2.5, 3.0, 3.0, 2.5, 1.5]
    # tgdist's MRR of fixed-width rows (train.eval=tgdist) is the same rule
    np.testing.assert_allclose(1 / r, reciprocal_ranks(pos, np.where(valid, neg, -np.inf)), rtol=1e-15)
    # NaN scores give a NaN rank (a null MRR), not a rank that counts
    assert np.isnan(ranks(np.array([np.nan, 1.0]), np.array([[0.0], [np.nan]]), np.ones((2, 1), bool))).all()


def test_rank_rule_equals_py_tgb_evaluator():
    pos = np.array([0.5, 0.5, 0.5, 2.0, -1.0])
    neg = [[0.1, 0.5, 0.9], [0.5, 0.5, 0.5, 0.5], [0.9, 0.9], [1.0, 2.0, 3.0, 0.0], [-1.0, -2.0]]
    ptr = np.r_[0, np.cumsum([len(x) for x in neg])]
    hand = np.mean(1 / np.array([2.5, 3.0, 3.0, 2.5, 1.5]))  # the ranks counted by hand above
    assert tgb_mrr(pos, np.concatenate(neg), ptr) == pytest.approx(hand, rel=1e-6)  # (py-tgb works in float32)
    rng = np.random.default_rng(0)
    pos, neg = rng.integers(0, 5, 300).astype(np.float32), rng.integers(0, 5, (300, 40)).astype(np.float32)
    ptr = np.arange(0, 301 * 40, 40)  # many ties: scores of 5 values
    assert float(np.mean(reciprocal_ranks(pos, neg))) == pytest.approx(tgb_mrr(pos, neg.reshape(-1), ptr), rel=1e-6)


def test_scores_come_from_the_memory_before_the_batch_and_only_positives_write(tmp_path):
    """Against the shipped negatives, the positives' scores and the memory left after each part are
    those of tgdist's own evaluation with one negative: negatives never write, whatever their
    number, and every batch reads the memory its predecessors wrote (TGB's order: score, then update)."""
    write_wiki(tmp_path)
    cfg = compose([*SMALL, f"data.root={tmp_path}", "train.eval=tgb", "model.dropout=0"])
    a = build_trainer(cfg)
    b = build_trainer(compose([*SMALL, f"data.root={tmp_path}", "model.dropout=0"]))
    b.model.load_state_dict(a.model.state_dict())
    assert a.shipped is not None and b.shipped is None
    for part in ("val", "test"):
        lo, hi = a.split.range(part)
        for s, e in a.batches(part):
            neg, valid = a.shipped.part(part).padded(s, e, pad=a.g.dst[s:e])
            pos_a, score = a.eval_step(s, e, neg)
            pos_b, _ = b.eval_step(s, e, b.negatives.fixed(part, s, e, 1))
            np.testing.assert_allclose(pos_a, pos_b, rtol=1e-6, atol=1e-7)
            assert score.shape == neg.shape
        for k, v in a.memory.state_dict().items():
            torch.testing.assert_close(v, b.memory.state_dict()[k], rtol=1e-6, atol=1e-7)
    # and the scores of one event do not depend on the other events' negatives in its batch
    a2 = build_trainer(cfg)
    a2.model.load_state_dict(a.model.state_dict())
    s, e = a2.split.range("val")[0], a2.split.range("val")[0] + 50
    neg, _ = a2.shipped.part("val").padded(s, e, pad=a2.g.dst[s:e])
    state = {k: v.clone() for k, v in a2.memory.state_dict().items()}
    _, full = a2.eval_step(s, e, neg)
    a2.memory.load_state_dict(state)
    _, first = a2.eval_step(s, e, neg[:, :2])
    np.testing.assert_allclose(full[:, :2], first, rtol=1e-5, atol=1e-6)


def test_negatives_are_scored_with_the_memory_before_the_batchs_write(tmp_path):
    """The negatives' scores (those TGB's protocol ranks, written by ``train.save_scores``) are
    those of the memory before the batch wrote its positives: each batch is scored here apart
    with no write, then its positives written, and the scores after that write differ."""
    write_wiki(tmp_path)
    cfg = compose([*SMALL, f"data.root={tmp_path}", "train.eval=tgb", "model.dropout=0"])
    a, c = build_trainer(cfg), build_trainer(cfg)
    c.model.load_state_dict(a.model.state_dict())
    a.scores_dir = tmp_path / "scores"
    a.evaluate("val")
    saved = np.load(tmp_path / "scores" / "val.npz")["neg"]
    c.model.eval()
    before, after = [], []
    with torch.no_grad():
        for s, e in c.batches("val"):
            neg, valid = c.shipped.part("val").padded(s, e, pad=c.g.dst[s:e])
            before.append(c.compute(c.prepare(s, e, neg), train=False, write=False).neg.numpy()[valid])
            c.compute(c.prepare(s, e, neg[:, :1]), train=False)  # the batch's write (negatives never write)
            c.memory.exchange()
            after.append(c.compute(c.prepare(s, e, neg), train=False, write=False).neg.numpy()[valid])
    before, after = np.concatenate(before), np.concatenate(after)
    np.testing.assert_allclose(saved, before, rtol=1e-5, atol=1e-6)
    assert np.abs(after - before).max() > 1e-3  # the write moves them: the check above can tell


def test_tgb_evaluation_prints_progress_lines(tmp_path, capsys):
    """Validation and test printed nothing for minutes (8 and 10.6 on tgbl-wiki); now the line
    training and tgdist's evaluation print."""
    write_wiki(tmp_path)
    tr = build_trainer(compose([*SMALL, f"data.root={tmp_path}", "train.eval=tgb"]), progress=True)
    capsys.readouterr()
    tr.evaluate("val")
    tr.evaluate("test")
    err = capsys.readouterr().err
    for part in ("val", "test"):
        lo, hi = tr.split.range(part)
        assert re.search(rf"^  {part}: {hi - lo:,}/{hi - lo:,} events \(100.0%\) [\d,]+ ev/s", err, re.M), err
    quiet = build_trainer(compose([*SMALL, f"data.root={tmp_path}", "train.eval=tgb"]), progress=False)
    capsys.readouterr()
    quiet.evaluate("val")
    assert "val:" not in capsys.readouterr().err


def test_run_reports_tgb_mrr_equal_to_py_tgb_evaluator_on_its_scores(tmp_path):
    write_wiki(tmp_path)
    run_dir = tmp_path / "run"
    cfg = compose([*SMALL, f"data.root={tmp_path}", "train.eval=tgb", "train.save_scores=true", "train.epochs=2",
                   "train.lr=1e-3", f"run_dir={run_dir}"])
    summary = Run(cfg, run_dir).train()
    assert {"val_mrr", "test_mrr", "val_hits@10", "test_hits@10"} <= set(summary)
    assert "test_ap" not in summary and 0 < summary["test_mrr"] <= 1
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("val_mrr" in h for h in lines) and sum("test_mrr" in h for h in lines) == 1
    best = max(lines, key=lambda h: h["val_mrr"])  # TGB's examples keep the epoch of the best val MRR
    assert best.get("selected") and summary["selected_epoch"] == best["epoch"]
    z = np.load(run_dir / "scores" / "test.npz")
    assert len(z["pos"]) == len(z["ptr"]) - 1 == 88 and len(z["neg"]) == z["ptr"][-1]
    v = np.load(run_dir / "scores" / "val.npz")  # the last validation's (epoch 1)
    assert summary["test_mrr"] == pytest.approx(tgb_mrr(z["pos"], z["neg"], z["ptr"]), rel=1e-6)  # (py-tgb)
    assert lines[-1]["val_mrr"] == pytest.approx(tgb_mrr(v["pos"], v["neg"], v["ptr"]), rel=1e-6)
