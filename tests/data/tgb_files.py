"""Small TGB link-prediction data sets written in TGB's file layout (read from py-tgb 2.3.0's loaders
and negative generator): ``ROOT/tgbl_wiki/tgbl-wiki_edgelist_v2.csv`` (one header line; user,
item, time, state label, features...; items numbered from 0, TGB's loader moves them past the
users), and ``tgbl-wiki_{val,test}_ns_v2.pkl``: a pickled dict from each validation or test event
``(src, dst, t)`` (numpy int64 scalars, TGB's ids) to a numpy array of negative destinations, of
any length, historical destinations of the source first (float64 when there are none, as the
generator's concatenation leaves it), never the event's own destinations at its time."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def tgb_split(t: np.ndarray) -> np.ndarray:
    """0 / 1 / 2 (train / val / test) by TGB's time quantiles (what the reader must reproduce)."""
    q1, q2 = np.quantile(t, [0.7, 0.85])
    return np.where(t <= q1, 0, np.where(t <= q2, 1, 2))


def write_wiki(root: Path, num_events: int = 600, num_users: int = 25, num_items: int = 12, feat_dim: int = 3,
               max_neg: int = 8, seed: int = 0, name: str = "tgbl-wiki", version: str = "_v2") -> dict:
    """Write a JODIE-layout TGB data set under ``root/<name with _>/``; returns its TGB arrays
    (``src``, ``dst`` with TGB's ids, ``t``, ``feat``, ``roll``, ``neg``: the negatives dict)."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / name.replace("-", "_")
    folder.mkdir(parents=True, exist_ok=True)
    user = rng.integers(0, num_users, num_events)
    item = np.where(rng.random(num_events) < 0.6, user % num_items, rng.integers(0, num_items, num_events))
    t = np.sort(rng.integers(0, num_events // 2, num_events)).astype(np.float64) * 7.0  # repeated times too
    label = (rng.random(num_events) < 0.05).astype(int)
    feat = rng.normal(size=(num_events, feat_dim)).round(3)
    lines = ["user_id,item_id,timestamp,state_label,comma_separated_list_of_features"]
    for k in range(num_events):
        lines.append(",".join([str(user[k]), str(item[k]), f"{t[k]:.1f}", str(label[k]), *map(str, feat[k])]))
    (folder / f"{name}_edgelist{version}.csv").write_text("\n".join(lines) + "\n")
    src = user.astype(np.int64)
    dst = item.astype(np.int64) + int(user.max()) + 1
    ti = t.astype(np.int64)
    roll = tgb_split(ti)
    all_dst = np.arange(dst.min(), dst.max() + 1)
    train = roll == 0
    seen = {s: np.unique(dst[train][src[train] == s]) for s in np.unique(src[train])}
    negs = {}
    for part, r in (("val", 1), ("test", 2)):
        table = {}
        for k in np.flatnonzero(roll == r):
            own = dst[(ti == ti[k]) & (src == src[k])]
            n = int(rng.integers(1, max_neg + 1))
            hist = np.setdiff1d(seen.get(src[k], np.zeros(0, np.int64)), own)
            hist = rng.choice(hist, min(len(hist), n // 2), replace=False) if len(hist) else np.array([])
            rest = np.setdiff1d(all_dst, np.concatenate([own, seen.get(src[k], np.zeros(0, np.int64))]))
            rnd = rng.choice(rest, min(len(rest), n - len(hist)), replace=False)
            table[(np.int64(src[k]), np.int64(dst[k]), np.int64(ti[k]))] = np.concatenate([hist, rnd])
        with open(folder / f"{name}_{part}_ns{version}.pkl", "wb") as fh:
            pickle.dump(table, fh, protocol=pickle.HIGHEST_PROTOCOL)
        negs[part] = table
    return {"src": src, "dst": dst, "t": ti, "feat": feat.astype(np.float32), "roll": roll, "neg": negs,
            "folder": folder}
