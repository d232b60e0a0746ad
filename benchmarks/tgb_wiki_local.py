"""A local tgbl-wiki for machines without network, rebuilt from the shared JODIE Wikipedia stream in
TGB's file layout, with the validation and test negatives made by py-tgb's own generator as TGB's
script for tgbl-wiki runs it (``hist_rnd``, seed 42, 12000 negatives asked per event, which on
1,000 pages is every page but the event's own destinations at its time).

It differs from TGB's download in one known way: the shared stream has no edge features (TGB's
tgbl-wiki carries JODIE's 172 LIWC features), so the edge list has none and models see none.
Figures from it are labelled "local tgbl-wiki" and are not leaderboard figures.

    python benchmarks/tgb_wiki_local.py OUT_DIR       # writes OUT_DIR/tgbl_wiki/ (~400 MB, a few minutes)

Needs py-tgb and torch-geometric (TGB's generator takes PyG's TemporalData), which the ``bench``
extra installs: ``pip install -e '.[bench]'``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import pickle
import time
from pathlib import Path

import numpy as np

HEADER = "user_id,item_id,timestamp,state_label,comma_separated_list_of_features"
NUM_NEG, SEED, STRATEGY = 12000, 42, "hist_rnd"  # TGB's tgbl-wiki negative generator settings


def shared_wikipedia() -> Path:
    from tgdist.config import datasets_dir
    return Path(datasets_dir()) / "wikipedia" / "wikipedia.csv.gz"


def write_edgelist(folder: Path) -> Path:
    """The shared stream (``u,i,ts,label``, pages already numbered after the 8,227 users) in
    JODIE's layout with pages numbered from 0, as TGB's file has them (its loader moves them back)."""
    with gzip.open(shared_wikipedia(), "rt") as fh:
        rows = np.loadtxt(fh, delimiter=",", skiprows=1, dtype=np.float64)
    user, page, ts, label = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64), rows[:, 2], rows[:, 3]
    page = page - (int(user.max()) + 1)
    out = folder / "tgbl-wiki_edgelist_v2.csv"
    with open(out, "w") as fh:
        fh.write(HEADER + "\n")
        fh.writelines(f"{u},{p},{t:.1f},{int(lab)}\n" for u, p, t, lab in zip(user, page, ts, label))
    return out


def main(out_dir: str) -> None:
    import torch
    from tgb.linkproppred.dataset import LinkPropPredDataset
    from tgb.linkproppred.negative_generator import NegativeEdgeGenerator
    from tgb.utils.info import PROJ_DIR
    from torch_geometric.data import TemporalData

    start = time.perf_counter()
    folder = Path(out_dir).resolve() / "tgbl_wiki"
    folder.mkdir(parents=True, exist_ok=True)
    write_edgelist(folder)
    # TGB's own loader reads the file back: its ids, its split (TGB roots data sets under its package)
    ds = LinkPropPredDataset("tgbl-wiki", root=os.path.relpath(folder.parent, PROJ_DIR), download=False,
                             preprocess=True)
    full = ds.full_data
    data = TemporalData(src=torch.from_numpy(full["sources"]), dst=torch.from_numpy(full["destinations"]),
                        t=torch.from_numpy(full["timestamps"]))
    parts = {"train": data[torch.from_numpy(ds.train_mask)], "val": data[torch.from_numpy(ds.val_mask)],
             "test": data[torch.from_numpy(ds.test_mask)]}
    gen = NegativeEdgeGenerator(dataset_name="tgbl-wiki", first_dst_id=int(data.dst.min()),
                                last_dst_id=int(data.dst.max()), num_neg_e=NUM_NEG, strategy=STRATEGY, rnd_seed=SEED,
                                historical_data=parts["train"])
    lengths = {}
    for part in ("val", "test"):  # in this order, as TGB's script (one random stream across both)
        gen.generate_negative_samples(data=parts[part], split_mode=part, partial_path=str(folder))
        (folder / f"tgbl-wiki_{part}_ns.pkl").rename(folder / f"tgbl-wiki_{part}_ns_v2.pkl")
        with open(folder / f"tgbl-wiki_{part}_ns_v2.pkl", "rb") as fh:
            table = pickle.load(fh)
        n = np.array([len(v) for v in table.values()])
        lengths[part] = {"events": int(len(parts[part].src)), "keys": len(table), "min": int(n.min()),
                         "mean": float(n.mean()), "max": int(n.max())}
    for leftover in folder.glob("ml_tgbl-wiki*.pkl"):  # TGB's processed copies; tgdist reads the CSV
        leftover.unlink()
    print(json.dumps({"root": str(folder.parent), "events": int(len(data.src)), "negatives": lengths,
                      "generator": {"strategy": STRATEGY, "num_neg_e": NUM_NEG, "rnd_seed": SEED},
                      "seconds": round(time.perf_counter() - start, 1)}))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tgb_wiki_local.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder to write tgbl_wiki/ into (data.root of the runs)")
    args = p.parse_args(argv)
    for module in ("tgb", "torch_geometric"):
        try:
            __import__(module)
        except ImportError:
            p.error(f"needs py-tgb and torch-geometric (TGB's generator takes PyG's TemporalData), which the bench "
                    f"extra installs: pip install -e '.[bench]' ({module} is missing)")
    if not shared_wikipedia().is_file():
        p.error(f"{shared_wikipedia()} is missing: set TGDIST_DATASETS to the folder holding wikipedia/")
    return args


if __name__ == "__main__":
    main(parse(sys.argv[1:]).out_dir)
