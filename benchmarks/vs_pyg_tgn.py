"""tgdist TGN vs PyG's TGN (torch_geometric.nn.models.tgn) on the same data in one run.

Same data and split (tgdist's chronological 70/15/15), memory/time/embedding dims 100, 10 most
recent neighbours, one attention layer with 2 heads, dropout 0.1, Adam lr 1e-4, batch size and
epochs as given, 1 uniform negative destination per event for training and a fixed negative per
event for evaluation (AP). The PyG side is assembled from PyG's own TGN modules the way its TGN
example does (TGNMemory + IdentityMessage + LastAggregator, LastNeighborLoader, a TransformerConv
embedding and an MLP link predictor).

Both systems run on ``--device`` (default cpu; ``cuda`` puts both on the GPU, with the device
synchronised before every clock read). The speed part reports each system's training time for one
full epoch beside its events/s.

Needs the bench extra: pip install -e '.[bench]'.

    python benchmarks/vs_pyg_tgn.py --data wikipedia --speed-batch 600 --acc-batch 200 --epochs 5
    python benchmarks/vs_pyg_tgn.py --device cuda --epochs 0     # the GPU epoch time of both
    python benchmarks/vs_pyg_tgn.py --epochs 0 --alternating-epochs 3   # also whole epochs, taking turns
"""

from __future__ import annotations

import argparse
import re
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import DATA_FILES, DATASETS, at_least, emit, machine, note, peak_rss_mib, require, run_main

from tgdist.data.graph import chronological_split
from tgdist.data.load import load_graph
from tgdist.data.sampler import NegativeSampler
from tgdist.runtime.build import build_trainer, compose
from tgdist.runtime.features import host_tensor  # (the graph's arrays are read-only maps)
from tgdist.runtime.metrics import average_precision, roc_auc

# ------------------------------------------------------------------------------------------------
# PyG side


class PygTGN:
    def __init__(self, graph, dim: int = 100, num_nbrs: int = 10, lr: float = 1e-4, device: str = "cpu"):
        from torch_geometric.nn import TransformerConv
        from torch_geometric.nn.models.tgn import IdentityMessage, LastAggregator, LastNeighborLoader, TGNMemory

        self.g, self.device = graph, torch.device(device)
        n = graph.num_nodes
        msg_dim = max(graph.edge_dim, 1)  # PyG's message module needs a raw message; zeros when absent
        msg = torch.zeros(graph.num_events, msg_dim) if graph.edge_feat is None else host_tensor(graph.edge_feat)
        self.msg = msg.to(self.device)
        self.t = torch.from_numpy((graph.t - graph.t[0]).astype(np.int64)).to(self.device)
        self.memory = TGNMemory(n, msg_dim, dim, dim, message_module=IdentityMessage(msg_dim, dim, dim),
                                aggregator_module=LastAggregator()).to(self.device)
        edge_dim = msg_dim + dim

        class Embed(torch.nn.Module):
            def __init__(self, time_enc):
                super().__init__()
                self.time_enc = time_enc
                self.conv = TransformerConv(dim, dim // 2, heads=2, dropout=0.1, edge_dim=edge_dim)

            def forward(self, x, last_update, edge_index, t, msg):
                rel_t = last_update[edge_index[0]] - t
                edge_attr = torch.cat([self.time_enc(rel_t.to(x.dtype)), msg], dim=-1)
                return self.conv(x, edge_index, edge_attr)

        class Predict(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.src, self.dst, self.out = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim), torch.nn.Linear(dim, 1)

            def forward(self, zs, zd):
                return self.out(F.relu(self.src(zs) + self.dst(zd)))

        self.gnn = Embed(self.memory.time_enc).to(self.device)
        self.pred = Predict().to(self.device)
        self.loader = LastNeighborLoader(n, size=num_nbrs, device=self.device)
        self.assoc = torch.empty(n, dtype=torch.long, device=self.device)
        self.opt = torch.optim.Adam(set(self.memory.parameters()) | set(self.gnn.parameters()) | set(self.pred.parameters()), lr=lr)
        self.src, self.dst = host_tensor(graph.src).to(self.device), host_tensor(graph.dst).to(self.device)

    def reset(self):
        self.memory.reset_state()
        self.loader.reset_state()

    def _batch(self, lo, hi, neg, train):
        src, dst, t, msg = self.src[lo:hi], self.dst[lo:hi], self.t[lo:hi], self.msg[lo:hi]
        neg = torch.from_numpy(neg).to(self.device)
        n_id = torch.cat([src, dst, neg]).unique()
        n_id, edge_index, e_id = self.loader(n_id)
        self.assoc[n_id] = torch.arange(n_id.size(0), device=self.device)
        z, last_update = self.memory(n_id)
        z = self.gnn(z, last_update, edge_index, self.t[e_id], self.msg[e_id])
        pos = self.pred(z[self.assoc[src]], z[self.assoc[dst]])
        negl = self.pred(z[self.assoc[src]], z[self.assoc[neg]])
        if train:
            loss = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos)) + \
                F.binary_cross_entropy_with_logits(negl, torch.zeros_like(negl))
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.memory.update_state(src, dst, t, msg)
        self.loader.insert(src, dst)
        if train:
            self.memory.detach()
        return pos.detach().view(-1), negl.detach().view(-1)

    def train_epoch(self, lo, hi, batch, negs):
        self.memory.train(), self.gnn.train(), self.pred.train()
        sync(self.device)
        t0 = time.perf_counter()
        for s in range(lo, hi, batch):
            e = min(s + batch, hi)
            self._batch(s, e, negs.train(e - s, 1)[:, 0], True)
        sync(self.device)
        return (hi - lo) / (time.perf_counter() - t0)

    @torch.no_grad()
    def evaluate(self, lo, hi, batch, negs, part):
        self.memory.eval(), self.gnn.eval(), self.pred.eval()
        ps, ns = [], []
        for s in range(lo, hi, batch):
            e = min(s + batch, hi)
            p, n = self._batch(s, e, negs.fixed(part, s, e, 1)[:, 0], False)
            ps.append(p.cpu().numpy())
            ns.append(n.cpu().numpy())
        p, n = np.concatenate(ps), np.concatenate(ns)
        y = np.r_[np.ones(len(p)), np.zeros(len(n))]
        return average_precision(y, np.r_[p, n]), roc_auc(y, np.r_[p, n])


def sync(device) -> None:
    """Wait for queued GPU work, so a clock read after it covers it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------


def _config(batch, seed, threads, device) -> list:
    return [f"train.batch_size={batch}", f"train.seed={seed}", "train.num_neg_eval=1", f"train.device={device}",
            f"train.num_threads={threads}", f"sampler.num_threads={threads}", "train.progress=false"]


def run_pyg(graph, split, batch, epochs, seed, eval_test, device):
    torch.manual_seed(seed)
    m = PygTGN(graph, device=device)
    negs = NegativeSampler(graph, seed)
    out = {"events_per_s": []}
    for _ in range(epochs):
        m.reset()
        out["events_per_s"].append(m.train_epoch(*split.range("train"), batch, negs))
        if eval_test:
            out["val_ap"], out["val_auc"] = m.evaluate(*split.range("val"), batch, negs, "val")
    if eval_test:
        out["test_ap"], out["test_auc"] = m.evaluate(*split.range("test"), batch, negs, "test")
    return out


def run_tgdist(graph, batch, epochs, seed, eval_test, threads, device):
    tr = build_trainer(compose(_config(batch, seed, threads, device)), graph=graph, progress=False)
    out = {"events_per_s": []}
    for ep in range(epochs):
        tr.memory.reset_state()
        r = tr.train_epoch(ep)  # wall time, compiles included, as PyG's figure is measured
        out["events_per_s"].append(r["train_events"] / r["train_seconds"])
        if eval_test:
            out.update(tr.evaluate("val"))
    if eval_test:
        out.update(tr.evaluate("test"))
    out["stage_seconds"] = dict(tr.timer.seconds)
    return out


def interleaved_speed(graph, batch, seed, threads, device, chunk=10):
    """Training seconds of both systems over one full epoch each, run in alternating chunks of
    ``chunk`` batches so both see the same machine conditions (this machine is shared)."""
    tr = build_trainer(compose(_config(batch, seed, threads, device)), graph=graph, progress=False)
    torch.manual_seed(seed)
    pyg = PygTGN(graph, device=device)
    negs = NegativeSampler(graph, seed)
    batches = list(tr.batches("train"))
    spent = {"tgdist": 0.0, "pyg": 0.0}
    for c in range(0, len(batches), chunk):
        part = batches[c:c + chunk]
        sync(device)
        t0 = time.perf_counter()
        for s, e in part:
            tr.step(s, e, tr.negatives.train(e - s, 1), train=True)
        sync(device)
        t1 = time.perf_counter()
        for s, e in part:
            pyg._batch(s, e, negs.train(e - s, 1)[:, 0], True)
        sync(device)
        t2 = time.perf_counter()
        spent["tgdist"] += t1 - t0
        spent["pyg"] += t2 - t1
    return spent, dict(tr.timer.seconds)


def alternating_epochs(graph, batch, seed, threads, device, rounds):
    """Training seconds of whole epochs, the two systems taking turns ``rounds`` times (a check
    that the interleaved chunks do not favour either: each system then runs with its own caches
    warm, as a user's run does). Wall time, as PyG's is measured; memory reset before each epoch."""
    tr = build_trainer(compose(_config(batch, seed, threads, device)), graph=graph, progress=False)
    torch.manual_seed(seed)
    pyg = PygTGN(graph, device=device)
    negs = NegativeSampler(graph, seed)
    lo, hi = chronological_split(graph).range("train")
    out = []
    for _ in range(rounds):
        tr.memory.reset_state()
        sync(device)
        t0 = time.perf_counter()
        for s, e in tr.batches("train"):
            tr.step(s, e, tr.negatives.train(e - s, 1), train=True)
        sync(device)
        t1 = time.perf_counter()
        pyg.reset()
        pyg.train_epoch(lo, hi, batch, negs)  # synchronises itself
        t2 = time.perf_counter()
        out.append({"tgdist_events_per_s": (hi - lo) / (t1 - t0), "pyg_events_per_s": (hi - lo) / (t2 - t1),
                    "ratio": (t2 - t1) / (t1 - t0)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="wikipedia", choices=sorted(DATA_FILES))
    ap.add_argument("--speed-batch", type=at_least(1), default=600, help="batch size of the speed comparison")
    ap.add_argument("--acc-batch", type=at_least(1), default=200, help="batch size of the accuracy comparison")
    ap.add_argument("--epochs", type=at_least(0), default=5, help="epochs for the accuracy comparison (0 skips it)")
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch and numba threads of both systems")
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--max-events", type=at_least(1), default=None, help="keep only the first N events")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: both systems run there")
    ap.add_argument("--alternating-epochs", type=at_least(0), default=0,
                    help="also time this many whole epochs of each system, taking turns")
    args = ap.parse_args()
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        ap.error(f"--device {args.device}: choose cpu, cuda or cuda:N")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device} but CUDA is not available on this machine")
    require("torch_geometric")  # before minutes of tgdist's part
    torch.set_num_threads(args.threads)
    graph = load_graph(DATASETS / DATA_FILES[args.data])
    if args.max_events:
        from tgdist.data.graph import subset
        graph = subset(graph, args.max_events)
    split = chronological_split(graph)
    res = {"machine": machine(), "data": graph.describe(), "threads": args.threads, "device": args.device}
    note(f"speed at batch {args.speed_batch} on {args.device} (interleaved chunks)")
    seconds, stages = interleaved_speed(graph, args.speed_batch, args.seed, args.threads, args.device)
    n = split.range("train")[1] - split.range("train")[0]
    res["speed"] = {"batch": args.speed_batch, "train_events": n,
                    "tgdist_epoch_seconds": seconds["tgdist"], "pyg_epoch_seconds": seconds["pyg"],
                    "tgdist_events_per_s": n / seconds["tgdist"], "pyg_events_per_s": n / seconds["pyg"],
                    "ratio": seconds["pyg"] / seconds["tgdist"], "tgdist_stage_seconds": stages}
    note(f"  {res['speed']}")
    if args.alternating_epochs:
        note(f"whole epochs at batch {args.speed_batch}, taking turns {args.alternating_epochs} times")
        res["alternating_epochs"] = alternating_epochs(graph, args.speed_batch, args.seed, args.threads, args.device,
                                                       args.alternating_epochs)
        note(f"  {res['alternating_epochs']}")
    if args.epochs:
        note(f"accuracy at batch {args.acc_batch}, {args.epochs} epochs")
        t = run_tgdist(graph, args.acc_batch, args.epochs, args.seed, True, args.threads, args.device)
        p = run_pyg(graph, split, args.acc_batch, args.epochs, args.seed, True, args.device)
        res["accuracy"] = {"batch": args.acc_batch, "epochs": args.epochs,
                           "tgdist": {k: v for k, v in t.items() if k != "stage_seconds"}, "pyg": p,
                           "test_ap_diff": t["test_ap"] - p["test_ap"],
                           "train_speed_ratio": float(np.mean(t["events_per_s"]) / np.mean(p["events_per_s"]))}
    res["peak_rss_mib"] = peak_rss_mib()
    emit(res)


if __name__ == "__main__":
    run_main(main)
