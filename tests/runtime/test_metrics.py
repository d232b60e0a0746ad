"""Evaluation metrics against hand computations (ties included) and, where installed, scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tgdist.runtime.metrics import (
    average_precision,
    f1_multilabel,
    mrr,
    reciprocal_ranks,
    roc_auc,
)


def test_roc_auc_by_hand():
    # positives 0.9 and 0.7 against negatives 0.8 and 0.1: 3 of 4 pairs ordered right
    assert roc_auc([1, 0, 1, 0], [0.9, 0.8, 0.7, 0.1]) == 0.75
    assert roc_auc([1, 0], [0.5, 0.5]) == 0.5  # a tie counts half
    assert roc_auc([1, 0, 0], [0.2, 0.2, 0.1]) == 0.75
    assert math.isnan(roc_auc([1, 1], [0.1, 0.2]))  # no negative: undefined


def test_average_precision_by_hand():
    # ranked 1 0 1 0: precision 1 at recall 1/2, 2/3 at recall 1
    assert average_precision([1, 0, 1, 0], [0.9, 0.8, 0.7, 0.1]) == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)
    # tied scores are one threshold: precision 1/2 at recall 1/2, then 2/3 at recall 1
    assert average_precision([1, 0, 1], [0.5, 0.5, 0.1]) == pytest.approx(0.5 * 0.5 + 0.5 * 2 / 3)
    assert math.isnan(average_precision([0, 0], [0.1, 0.2]))


def test_reciprocal_ranks_by_hand():
    pos = np.array([0.5, 0.2])
    neg = np.array([[0.1, 0.7, 0.5], [0.1, 0.0, 0.3]])
    # row 0: one negative above, one tied (half): rank 2.5; row 1: one above: rank 2
    assert reciprocal_ranks(pos, neg).tolist() == [0.4, 0.5]
    assert mrr(pos, neg) == pytest.approx(0.45)


def test_f1_multilabel_by_hand():
    y = np.array([[1, 0], [1, 1], [0, 1]])
    p = np.array([[1, 1], [0, 1], [0, 1]])
    # class 0: tp 1, fp 0, fn 1 -> 2/3; class 1: tp 2, fp 1, fn 0 -> 4/5; all: tp 3, fp 1, fn 1 -> 3/4
    out = f1_multilabel(y, p)
    assert out["f1_micro"] == pytest.approx(0.75) and out["f1_macro"] == pytest.approx((2 / 3 + 4 / 5) / 2)


def test_against_scikit_learn_with_ties():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 2000)
    score = np.round(rng.random(2000) + 0.3 * y, 2)  # rounded: many ties
    assert average_precision(y, score) == pytest.approx(metrics.average_precision_score(y, score), abs=1e-12)
    assert roc_auc(y, score) == pytest.approx(metrics.roc_auc_score(y, score), abs=1e-12)
    yl, pl = rng.integers(0, 2, (500, 4)), rng.integers(0, 2, (500, 4))
    out = f1_multilabel(yl, pl)
    assert out["f1_micro"] == pytest.approx(metrics.f1_score(yl, pl, average="micro"))
    assert out["f1_macro"] == pytest.approx(metrics.f1_score(yl, pl, average="macro"))


def test_macro_f1_of_classes_scores_the_classes_that_occur():
    """One class per event (multi-class): a class absent from both truth and predictions of a part
    is not averaged in as 0 (scikit-learn's multi-class macro F1); multi-label columns all are."""
    eye = np.eye(3, dtype=bool)
    y, p = eye[[0, 1, 0, 1]], eye[[0, 1, 1, 1]]
    assert f1_multilabel(y, p, present_only=True)["f1_macro"] == pytest.approx((2 / 3 + 4 / 5) / 2)
    assert f1_multilabel(y, p)["f1_macro"] == pytest.approx((2 / 3 + 4 / 5) / 3)
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(1)
    yc, pc = rng.integers(0, 6, 300), rng.integers(0, 4, 300)  # classes 4 and 5 never predicted
    yc[yc == 3] = 0  # class 3 only ever predicted
    out = f1_multilabel(np.eye(8, dtype=bool)[yc], np.eye(8, dtype=bool)[pc], present_only=True)
    assert out["f1_macro"] == pytest.approx(metrics.f1_score(yc, pc, average="macro"))
    assert out["f1_micro"] == pytest.approx(metrics.f1_score(yc, pc, average="micro"))


def test_nan_scores_give_nan_metrics_not_perfect_ones():
    """A diverged model scores NaN: sorted anywhere and never greater than anything, all-NaN
    scores gave AP 1.0, ROC-AUC 0.0 and MRR 1.0 (a sweep would pick the diverged run)."""
    y = np.r_[np.ones(4), np.zeros(4)]
    nan = np.full(8, np.nan)
    assert np.isnan(average_precision(y, nan)) and np.isnan(roc_auc(y, nan))
    one = np.r_[0.9, 0.8, np.nan, 0.7, 0.1, 0.2, 0.3, 0.4]
    assert np.isnan(average_precision(y, one)) and np.isnan(roc_auc(y, one))
    rr = reciprocal_ranks(np.array([0.5, np.nan, 0.5]), np.array([[0.1, 0.9], [0.1, 0.2], [np.nan, 0.1]]))
    assert rr[0] == 0.5 and np.isnan(rr[1]) and np.isnan(rr[2])


def test_the_tensor_metrics_are_the_numpy_ones():
    """``*_t`` (evaluation on the device) against the NumPy functions on the same scores: random
    and heavily tied scores, all-positive and all-negative labels, NaN scores."""
    import torch

    from tgdist.runtime.metrics import average_precision_t, reciprocal_ranks_t, roc_auc_t

    rng = np.random.default_rng(1)
    for trial in range(300):
        n = int(rng.integers(1, 80))
        y = rng.random(n) < (0.0 if trial % 23 == 0 else 1.0 if trial % 29 == 0 else rng.random())
        s = (rng.integers(0, int(rng.integers(1, 8)), n) if trial % 2 else rng.normal(size=n)).astype(np.float32)
        if trial % 17 == 0:
            s[int(rng.integers(0, n))] = np.nan
        neg = rng.integers(0, 4, (n, 5)).astype(np.float32)
        yt, st = torch.from_numpy(y), torch.from_numpy(s)
        for numpy_fn, torch_fn in ((average_precision, average_precision_t), (roc_auc, roc_auc_t)):
            want, got = numpy_fn(y, s), torch_fn(yt, st)
            assert got.dtype == torch.float64 and got.shape == ()
            assert got.item() == pytest.approx(want, abs=1e-12, nan_ok=True), (numpy_fn.__name__, y, s)
        np.testing.assert_array_equal(reciprocal_ranks_t(st, torch.from_numpy(neg)).numpy(), reciprocal_ranks(s, neg))
