"""Evaluation metrics in NumPy, and as tensor operations (no scikit-learn at run time)."""

from __future__ import annotations

import numpy as np
import torch


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their average rank."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    bounds = np.flatnonzero(np.diff(xs)) + 1  # where a run of equal values starts
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(x)]])
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def roc_auc(y_true: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with tie correction). NaN when a class is
    missing or a score is NaN (a diverged model: sorted anywhere, it gave AUC 0 or 1)."""
    y = np.asarray(y_true).astype(bool)
    npos, nneg = int(y.sum()), int((~y).sum())
    if npos == 0 or nneg == 0 or np.isnan(score).any():
        return float("nan")
    r = _ranks(np.asarray(score, dtype=np.float64))
    return float((r[y].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def average_precision(y_true: np.ndarray, score: np.ndarray) -> float:
    """AP = sum_k (R_k - R_{k-1}) P_k over distinct score thresholds (scikit-learn's definition).
    NaN when there is no positive or a score is NaN (all-NaN scores gave AP 1)."""
    y = np.asarray(y_true).astype(bool)
    npos = int(y.sum())
    if npos == 0 or np.isnan(score).any():
        return float("nan")
    order = np.argsort(-np.asarray(score, dtype=np.float64), kind="mergesort")
    s, yy = np.asarray(score, dtype=np.float64)[order], y[order]
    tp = np.cumsum(yy)
    fp = np.cumsum(~yy)
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # last index of each threshold
    tp, fp = tp[last], fp[last]
    precision = tp / (tp + fp)
    recall = tp / npos
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def reciprocal_ranks(pos_score: np.ndarray, neg_score: np.ndarray) -> np.ndarray:
    """``1 / rank`` of each positive among its negatives ``[n, num_neg]``; ties count half. NaN
    where a score of the row is NaN (every comparison with NaN is false: rank 1)."""
    pos = np.asarray(pos_score)[:, None]
    neg = np.asarray(neg_score)
    rr = 1.0 / (1 + (neg > pos).sum(1) + 0.5 * (neg == pos).sum(1))
    return np.where(np.isnan(pos[:, 0]) | np.isnan(neg).any(1), np.nan, rr)


def mrr(pos_score: np.ndarray, neg_score: np.ndarray) -> float:
    """Mean reciprocal rank of each positive among its negatives ``[n, num_neg]``; ties count half."""
    return float(np.mean(reciprocal_ranks(pos_score, neg_score)))


def f1_multilabel(y_true: np.ndarray, y_pred: np.ndarray, present_only: bool = False) -> dict:
    """Micro and macro F1 for multi-label 0/1 arrays ``[n, num_classes]``. Macro F1 averages every
    column (scikit-learn's multi-label convention, a column with neither truth nor prediction
    counting 0); with ``present_only``, the columns that occur in the truth or the predictions
    (its multi-class convention: a class absent from an evaluated part is not scored 0)."""
    y, p = np.asarray(y_true).astype(bool), np.asarray(y_pred).astype(bool)
    tp = (y & p).sum(0).astype(np.float64)
    fp = (~y & p).sum(0).astype(np.float64)
    fn = (y & ~p).sum(0).astype(np.float64)
    micro = 2 * tp.sum() / max(2 * tp.sum() + fp.sum() + fn.sum(), 1e-12)
    per = np.where(2 * tp + fp + fn > 0, 2 * tp / np.maximum(2 * tp + fp + fn, 1e-12), 0.0)
    if present_only:
        per = per[(y | p).any(0)]
    return {"f1_micro": float(micro), "f1_macro": float(per.mean()) if per.size else float("nan")}


# The same metrics as tensor operations on the scores' device (issue 53.4): evaluation keeps its
# scores where the model made them and reads the metrics back once. No operation here has an
# output whose size depends on the values (a GPU would wait for the device to learn it); each
# returns a float64 scalar tensor, NaN where the NumPy version is. ``tests/runtime/test_metrics.py``
# runs both on the same scores.


def _runs(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For sorted ``xs``: where each run of equal values starts and where it ends (booleans)."""
    differs = xs[1:] != xs[:-1]
    edge = torch.ones(1, dtype=torch.bool, device=xs.device)
    return torch.cat([edge, differs]), torch.cat([differs, edge])


def roc_auc_t(y: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """``roc_auc`` of a boolean ``y`` and ``score``: the positives' average ranks (ties their mean rank)."""
    s = score.double()
    n = s.shape[0]
    npos = y.sum().double()
    nneg = n - npos
    order = torch.argsort(s, stable=True)
    first, last = _runs(s.index_select(0, order))
    at = torch.arange(n, device=s.device)
    start = torch.cummax(torch.where(first, at, 0), 0).values
    end = torch.cummin(torch.where(last, at, n - 1).flip(0), 0).values.flip(0)
    rank = (start + end).double() / 2 + 1
    auc = ((rank * y.index_select(0, order)).sum() - npos * (npos + 1) / 2) / (npos * nneg)
    return torch.where((npos == 0) | (nneg == 0) | s.isnan().any(), torch.nan, auc)


def average_precision_t(y: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """``average_precision`` of a boolean ``y`` and ``score``: precision at the last position of
    each run of equal scores (descending), weighted by the recall the run adds."""
    s = score.double()
    npos = y.sum().double()
    order = torch.argsort(-s, stable=True)
    yy = y.index_select(0, order)
    tp = torch.cumsum(yy, 0).double()
    fp = torch.cumsum(~yy, 0).double()
    _, last = _runs(s.index_select(0, order))
    tp_last = torch.where(last, tp, 0.0)
    before = torch.cat([tp_last.new_zeros(1), torch.cummax(tp_last, 0).values[:-1]])  # tp at the previous run's end
    ap = torch.where(last, (tp - before) / npos * (tp / (tp + fp)), 0.0).sum()
    return torch.where((npos == 0) | s.isnan().any(), torch.nan, ap)


def reciprocal_ranks_t(pos_score: torch.Tensor, neg_score: torch.Tensor) -> torch.Tensor:
    """``reciprocal_ranks`` of ``pos [n]`` among ``neg [n, num_neg]``, float64 ``[n]``."""
    pos = pos_score.unsqueeze(1)
    rr = 1.0 / (1 + (neg_score > pos).sum(1).double() + 0.5 * (neg_score == pos).sum(1).double())
    return torch.where(pos_score.isnan() | neg_score.isnan().any(1), torch.nan, rr)
