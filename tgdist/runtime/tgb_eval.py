"""TGB's one-vs-many evaluation of link prediction (``train.eval=tgb``), as TGB's examples for
memory-based models run it (Huang et al., "Temporal Graph Benchmark", NeurIPS 2023, section 3):

for each batch of positive events, every event's own shipped negatives (``tgdist.data.tgb``, lists
of any length) are scored beside the event's destination with the node memory as it stands before
the batch; then the positives, and only they, update the memory (the batch's write, as in every
evaluation of tgdist). The event's rank is TGB's: ``1 + #(negatives scoring above the positive)
+ #(negatives scoring equal) / 2`` (the mean of the optimistic and the pessimistic rank), and the
MRR is the mean of ``1 / rank`` over the part's events; Hits@10 counts ranks of at most 10.

Lists of different lengths in one batch are padded to the longest with the event's destination,
and the pads' scores are set to -inf before ranking, so they never count.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tgdist.data.tgb import OneVsMany

log = logging.getLogger(__name__)

HITS_K = 10


def ranks(pos: np.ndarray, neg: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """TGB's rank of each positive ``pos [b]`` among its negatives ``neg [b, width]``, of which the
    entries ``valid [b, width]`` are real: ``1 + #above + #equal / 2``, the rank whose inverse is
    ``metrics.reciprocal_ranks`` (with the pads at -inf); NaN where a score of the row is NaN."""
    pos = np.asarray(pos, dtype=np.float64)[:, None]
    neg = np.where(valid, np.asarray(neg, dtype=np.float64), -np.inf)
    rank = 1.0 + (neg > pos).sum(1) + 0.5 * (neg == pos).sum(1)
    return np.where(np.isnan(pos[:, 0]) | np.isnan(neg).any(1), np.nan, rank)


def one_vs_many(trainer, part: str, negatives: OneVsMany, scores_dir: str | Path | None = None,
                progress=None) -> dict:
    """``{part}_mrr`` and ``{part}_hits@10`` of ``trainer`` over the events of ``part`` against
    their shipped ``negatives``, batch after batch (``trainer.eval_step``: scores, then the
    write). ``scores_dir``: also write the scores to ``scores_dir/{part}.npz`` (``pos [n]``,
    ``neg [ptr[-1]]``, ``ptr [n + 1]``: event k's negatives' scores are ``neg[ptr[k]:ptr[k + 1]]``),
    which TGB's ``Evaluator`` can score again. ``progress``: told each batch's events
    (``update(n)``), the progress line training and tgdist's own evaluation print."""
    lo, hi = trainer.split.range(part)
    g = trainer.g
    all_ranks, kept_pos, kept_neg = [], [], []
    for s, e in trainer.batches(part):
        neg, valid = negatives.padded(s, e, pad=g.dst[s:e])
        pos, score = trainer.eval_step(s, e, neg)
        all_ranks.append(ranks(pos, score, valid))
        if progress is not None:
            progress.update(e - s)
        if scores_dir is not None:
            kept_pos.append(pos.astype(np.float32))
            kept_neg.append(score[valid].astype(np.float32))
    rank = np.concatenate(all_ranks) if all_ranks else np.zeros(0)
    if np.isnan(rank).any():
        log.warning("%s: %d of %d events have NaN scores (training diverged: lower train.lr?); its MRR is null",
                    part, int(np.isnan(rank).sum()), len(rank))
    res = {f"{part}_mrr": float(np.mean(1.0 / rank)) if len(rank) else float("nan"),
           f"{part}_hits@{HITS_K}": float(np.mean(rank <= HITS_K)) if len(rank) else float("nan")}
    if scores_dir is not None:
        out = Path(scores_dir)
        out.mkdir(parents=True, exist_ok=True)
        np.savez(out / f"{part}.npz", pos=np.concatenate(kept_pos) if kept_pos else np.zeros(0, np.float32),
                 neg=np.concatenate(kept_neg) if kept_neg else np.zeros(0, np.float32),
                 ptr=negatives.ptr[:hi - lo + 1] - negatives.ptr[0], mrr=res[f"{part}_mrr"])
    return res
