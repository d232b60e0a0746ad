"""TGB's one-vs-many evaluation (``train.eval=tgb``): TGB's rank rule with ties and padded lists,
the memory it reads and writes, and a whole run whose MRR equals py-tgb's ``Evaluator`` on the
scores the run wrote."""

from __future__ import annotations

import json

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
    """The MRR of TGB's examples: py-tgb's ``Evaluator`` on each event, then the mean over events;
    without py-tgb, its documented rule (the mean of the optimistic and pessimistic rank)."""
    try:
        from tgb.linkproppred.evaluate import Evaluator
    except ImportError:
        per = [1 / (1 + 0.5 * ((neg[a:b] > p).sum() + (neg[a:b] >= p).sum())) for p, a, b in zip(pos, ptr, ptr[1:])]
        return float(np.mean(per))
    ev = Evaluator(name="tgbl-wiki")
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
    ptr = np.r_[0, np.cumsum(valid.sum(1))]
    assert float(np.mean(1 / r)) == pytest.approx(tgb_mrr(pos, neg[valid], ptr), rel=1e-6)
    # tgdist's MRR of fixed-width rows (train.eval=tgdist) is the same rule
    np.testing.assert_allclose(1 / r, reciprocal_ranks(pos, np.where(valid, neg, -np.inf)), rtol=1e-15)
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
    assert summary["test_mrr"] == pytest.approx(tgb_mrr(z["pos"], z["neg"], z["ptr"]), rel=1e-6)
    v = np.load(run_dir / "scores" / "val.npz")  # the last validation's (epoch 1)
    assert lines[-1]["val_mrr"] == pytest.approx(tgb_mrr(v["pos"], v["neg"], v["ptr"]), rel=1e-6)
