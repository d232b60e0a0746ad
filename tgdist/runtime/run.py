"""A whole training run: epochs, evaluation, metrics files, checkpoints, resume, downstream tasks.

Run directory layout: ``config.yaml`` (resolved), ``metrics.jsonl`` (one JSON object per epoch),
``summary.json`` (also printed as the last line of stdout), ``checkpoints/last.pt``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from tgdist.config import model_tag
from tgdist.data.graph import NodeLabels, class_targets, label_ranges
from tgdist.errors import ConfigError
from tgdist.models.modules import MLPClassifier
from tgdist.runtime import checkpoint, rundir
from tgdist.runtime.build import build_trainer, check_labels, is_parallel, validate
from tgdist.runtime.metrics import f1_multilabel, roc_auc
from tgdist.runtime.trainer import SIDE_STREAMS, Progress, Trainer

log = logging.getLogger(__name__)


def jsonable(d: dict) -> dict:
    """Plain floats, and None for a metric that is undefined (NaN is not JSON)."""
    return {k: (float(v) if np.isfinite(v) else None) if isinstance(v, (np.floating, float)) else v
            for k, v in d.items()}


class Run:
    """One single-process training run in ``run_dir`` (``train()`` once). Parallel layouts and
    daemon memory are refused here: ``run(cfg, run_dir)`` starts the daemon, and several
    processes start with ``tgdist launch`` or torchrun."""

    def __init__(self, cfg: DictConfig, run_dir: str | Path, trainer: Trainer | None = None):
        validate(cfg)  # (build_trainer validates too) a bad setting is named before the layout is refused
        if is_parallel(cfg):  # it would train one process with local memory, without a word
            p = cfg.parallel
            raise ConfigError(f"Run trains one process with local memory, not parallel.i/j/k={p.i}/{p.j}/{p.k} with "
                              f"memory.backend={cfg.memory.backend}: use tgdist.runtime.driver.run(cfg, run_dir) for "
                              f"daemon memory, tgdist launch or torchrun for several processes")
        self.cfg = cfg
        self.dir = Path(run_dir)
        rundir.check_foreign(self.dir, cfg.train.overwrite)  # (tgdist train claimed it already; Python callers)
        self._trained = False
        self.trainer = trainer or build_trainer(cfg)  # first: a config or data error leaves no directory
        self.ckpt_path = self.dir / "checkpoints" / "last.pt"
        self._resume = None  # (path, state) of train.resume, checked here and loaded by train()
        if cfg.train.resume:  # a refused resume leaves the run directory (maybe the checkpoint's own) as it was
            self._resume = checkpoint.check_resume(cfg, parallel=False)
            checkpoint.check_data(*self._resume, self.trainer.g)
        elif (self.dir / "metrics.jsonl").exists():
            log.warning("run_dir %s already holds a run; its metrics, summary and checkpoint are replaced", self.dir)
            for old in (self.dir / "summary.json", self.ckpt_path):  # gone now: not taken for this run's
                old.unlink(missing_ok=True)
        rundir.claim(self.dir, cfg.train.overwrite)
        self.history: list[dict] = []
        (self.dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    # ------------------------------------------------------------------------------------------

    def _checkpoint(self, epoch: int, next_batch: int) -> None:
        tr = self.trainer
        position = {"epoch": epoch, "batch": next_batch, "loss_sum": tr.epoch_loss_sum, "events": tr.epoch_events}
        checkpoint.save(self.ckpt_path, tr, self.cfg, position, self.history)

    def train(self) -> dict:
        if self._trained:  # a second call trained on and numbered its epochs from 0 again
            raise RuntimeError("Run.train() runs once: make a new Run, with train.resume=RUN_DIR to continue this one")
        self._trained = True
        cfg, tr = self.cfg, self.trainer
        start_epoch, start_batch = 0, 0
        if self._resume is not None:
            (path, state), self._resume = self._resume, None
            pos, self.history = checkpoint.load(path, tr, cfg, state)
            del state  # its tensors are copied in: the checkpoint's mmap goes
            start_epoch, start_batch = int(pos["epoch"]), int(pos["batch"])
            tr.epoch_loss_sum, tr.epoch_events = float(pos.get("loss_sum", 0.0)), int(pos.get("events", 0))
            log.info("resumed from %s at epoch %d batch %d", cfg.train.resume, start_epoch, start_batch)
            if start_epoch >= cfg.train.epochs:
                log.warning("nothing left to train: the checkpoint is after epoch %d and train.epochs=%d (raise it "
                            "to continue); reporting the checkpoint's results", start_epoch, cfg.train.epochs)
        elif cfg.model.static_memory and cfg.model.static_pretrain_epochs > 0:
            pretrain_static(tr, cfg.model.static_pretrain_epochs)
        num_batches = len(range(*tr.split.range("train"), tr.batch_size))
        every = cfg.train.checkpoint_every
        stop_after = cfg.train.stop_after_batches
        done_batches = 0

        def on_batch(epoch: int, next_batch: int) -> None:
            nonlocal done_batches
            done_batches += 1
            if every and next_batch % every == 0 and next_batch < num_batches:
                self._checkpoint(epoch, next_batch)
            if stop_after is not None and done_batches >= stop_after:
                raise _Stop()

        with open(self.dir / "metrics.jsonl", "w") as mf:
            for h in self.history:
                mf.write(json.dumps(h) + "\n")
            for epoch in range(start_epoch, cfg.train.epochs):
                if start_batch == 0:
                    tr.memory.reset_state()  # each epoch replays the stream from empty memory
                tr.timer = type(tr.timer)()
                try:
                    res = {"epoch": epoch, **tr.train_epoch(epoch, start_batch, on_batch)}
                except _Stop:
                    log.info("stopping after %d training batches (train.stop_after_batches)", done_batches)
                    return {"stopped": True, "checkpoint": str(self.ckpt_path) if self.ckpt_path.exists() else None}
                start_batch = 0
                train_stages = type(tr.timer)(dict(tr.timer.seconds))  # before evaluation adds to it
                res.update(tr.evaluate("val"))
                last = epoch == cfg.train.epochs - 1
                if cfg.train.test_every_epoch or last:
                    res.update(tr.evaluate("test"))
                res["stage_seconds"] = {k: round(v, 4) for k, v in train_stages.seconds.items()}
                self.history.append(jsonable(res))
                mf.write(json.dumps(self.history[-1]) + "\n")
                mf.flush()
                compiled = (f" (leaving out {res['compile_seconds']:.1f} s of one-time kernel compiling)"
                            if res["compile_seconds"] >= 0.5 else "")
                shown = [f"{k} {v:.4f}" for k, v in res.items() if k.startswith(("val_", "test_"))]
                log.info("epoch %d: loss %.4f, %s train events/s%s", epoch, res["loss"],
                         ", ".join([*shown, f"{res['events_per_s']:,.0f}"]), compiled)
                log.info("training stage times:\n%s", train_stages.table(res["train_events"]))
                self._checkpoint(epoch + 1, 0)
        if cfg.train.epochs == 0 and not cfg.train.resume:  # the node and edge tasks too: their link baseline
            self.evaluate_untrained()
        if not self.ckpt_path.exists():  # nothing trained here (epochs=0, a finished run resumed): still the model
            self._checkpoint(max(start_epoch, cfg.train.epochs), 0)
        summary = self.summary()
        if cfg.train.task in ("node", "edge"):
            summary.update(downstream(tr, cfg.train.task, cfg.train.node_class_epochs))
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def evaluate_untrained(self) -> None:
        """``train.epochs=0``: the link metrics of the model as initialised (a baseline). The
        training events only advance the memory, as evaluation does; no parameter changes."""
        tr = self.trainer
        pretrained = " (its static memory pre-trained)" if self.cfg.model.static_pretrain_epochs else ""
        log.info("train.epochs=0: evaluating the model as initialised%s, without training", pretrained)
        tr.memory.reset_state()
        res = {"epoch": -1, **tr.evaluate("train"), **tr.evaluate("val"), **tr.evaluate("test")}
        self.history.append(jsonable(res))
        with open(self.dir / "metrics.jsonl", "a") as mf:
            mf.write(json.dumps(self.history[-1]) + "\n")
        log.info("untrained: %s", ", ".join(f"{k} {v:.4f}" for k, v in res.items() if k != "epoch"))

    @staticmethod
    def write_summary(run_dir, cfg: DictConfig, summary: dict) -> None:
        d = Path(run_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        (d / "summary.json").write_text(json.dumps(summary, indent=1))

    def summary(self) -> dict:
        if not self.history:
            return {"epochs": 0, "run_dir": str(self.dir)}
        last = self.history[-1]
        m = self.cfg.model
        out = {"run_dir": str(self.dir), "data": self.cfg.data.name, "model": model_tag(m.name, m.num_layers),
               "epochs": 0, "batch_size": self.cfg.train.batch_size}
        out.update({k: v for k, v in last.items() if k.startswith(("val_", "test_")) or k == "loss"})
        trained = [h for h in self.history if h["epoch"] >= 0]
        if not trained:  # train.epochs=0: an untrained baseline
            return out
        scored = [h for h in trained if h.get("val_ap") is not None]  # none: an empty val part, or NaN scores
        best = max(scored, key=lambda h: h["val_ap"]) if scored else {}  # no best epoch without a val AP
        out["epochs"] = len(trained)
        out["best_epoch"] = best.get("epoch")
        out["best_val_ap"] = best.get("val_ap")
        out["test_ap_at_best_val"] = best.get("test_ap")
        out["train_events_per_s"] = float(np.mean([h["events_per_s"] for h in trained]))
        out["traversed_events"] = int(sum(h["train_events"] for h in trained))
        return out


def pretrain_static(tr: Trainer, epochs: int) -> None:
    """DistTGL 3.1: pre-train the static node memory on the same link task, without dynamic
    memory (every event supervises it, whatever the batch size)."""
    static, pred = tr.model.static, tr.model.predictor
    lr = max(tr.optimizer.param_groups[0]["lr"], 1e-3)  # a per-node table learns slowly at TGN's 1e-4
    opt = torch.optim.Adam(list(static.parameters()) + list(pred.parameters()), lr=lr)
    log.info("static memory pre-training: %d epoch%s, Adam lr %g (train.lr, at least 1e-3), batches of %d events",
             epochs, "s" * (epochs != 1), lr, 4 * tr.batch_size)
    lo, hi = tr.split.range("train")
    src = torch.from_numpy(tr.g.src[lo:hi])
    dst = torch.from_numpy(tr.g.dst[lo:hi])
    for ep in range(epochs):
        total = 0.0
        for s in range(0, hi - lo, 4 * tr.batch_size):
            e = min(s + 4 * tr.batch_size, hi - lo)
            neg = torch.from_numpy(tr.negatives.train(e - s, 1)[:, 0])
            hs = static(src[s:e].to(tr.device))
            pos = pred(hs, static(dst[s:e].to(tr.device)).unsqueeze(1))
            negl = pred(hs, static(neg.to(tr.device)).unsqueeze(1))
            loss = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos)) + \
                F.binary_cross_entropy_with_logits(negl, torch.zeros_like(negl))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * (e - s)
        log.info("static memory pre-training epoch %d: loss %.4f", ep, total / max(hi - lo, 1))


@torch.no_grad()
def collect_embeddings(tr: Trainer, labels: NodeLabels | None = None):
    """Replay the whole stream from empty memory. Returns the src and dst embeddings
    ``[num_events, dim]`` and, with ``labels``, the embeddings of ``labels.node`` at ``labels.t``
    ``[num_labels, dim]`` (else None). A label is embedded as a root of the first batch whose last
    event is at or after its time would be, from the memory before that batch: from events
    strictly before it."""
    tr.model.eval()
    tr.memory.reset_state()
    with tr.side_stream(SIDE_STREAMS["replay"]):
        return _replay(tr, labels)


def _replay(tr: Trainer, labels: NodeLabels | None):
    hs, hd, hl = [], [], []
    done = 0

    def embed_labels(upto: int) -> None:
        nonlocal done
        for a in range(done, upto, 4 * tr.batch_size):
            b = min(a + 4 * tr.batch_size, upto)
            hl.append(tr.embed(labels.node[a:b], labels.t[a:b]))
        done = max(done, upto)

    prog = Progress(tr.g.num_events, "embeddings", tr.progress)
    for s in range(0, tr.g.num_events, tr.batch_size):
        e = min(s + tr.batch_size, tr.g.num_events)
        if labels is not None:
            embed_labels(int(np.searchsorted(labels.t, tr.g.t[e - 1], side="right")))
        out = tr.step(s, e, tr.negatives.fixed("train", s, e, 1), train=False, keep_emb=True)
        hs.append(out.h_src)
        hd.append(out.h_dst)
        prog.update(e - s)
    if labels is not None:
        embed_labels(len(labels))
    return torch.cat(hs), torch.cat(hd), (torch.cat(hl) if hl else None)


def downstream(tr: Trainer, task: str, epochs: int) -> dict:
    """Dynamic node classification (the label of the source at each event, e.g. Wikipedia bans,
    or TGL ``labels.csv`` node labels at times) or edge classification, with a decoder trained
    for ``epochs`` on frozen embeddings.

    A 0/1 label gives ROC-AUC for the node task and F1 for the edge task; multi-label 0/1
    targets give micro and macro F1 over their columns; integer classes (one per event) are
    learnt with cross-entropy and give micro F1 (accuracy) and macro F1 over the classes."""
    g = tr.g
    check_labels(task, g, tr.split)
    if g.label is None:  # node labels at times (check_labels: task node)
        targets, classes = class_targets(g.node_labels.label, g.name)
        x = collect_embeddings(tr, g.node_labels)[2]
        ranges = label_ranges(g.node_labels, g, tr.split)
        log.info("node classification on %s node labels (train %d, val %d, test %d)", f"{len(g.node_labels):,}",
                 *(b - a for a, b in ranges.values()))
    else:
        targets, classes = class_targets(g.label, g.name)
        hs, hd, _ = collect_embeddings(tr)
        x = hs if task == "node" else torch.cat([hs, hd], 1)
        ranges = {part: tr.split.range(part) for part in ("train", "val", "test")}
    if classes is not None:
        log.info("%s classification over %d classes (label values %s)", task, len(classes),
                 ", ".join(str(c) for c in classes[:12]) + (", ..." if len(classes) > 12 else ""))
    y = torch.from_numpy(targets).to(x.device)
    dec = MLPClassifier(x.shape[1], y.shape[1]).to(x.device)
    opt = torch.optim.Adam(dec.parameters(), lr=1e-3)
    lo, hi = ranges["train"]
    pos_w = ((y[lo:hi] == 0).sum(0) / (y[lo:hi] == 1).sum(0).clamp(min=1)).clamp(max=100)
    prog = Progress(epochs * (hi - lo), f"{task} decoder ({epochs} epochs)", tr.progress, unit="examples")
    for _ in range(epochs):
        dec.train()
        for s in range(lo, hi, 200):
            e = min(s + 200, hi)
            if classes is None:
                loss = F.binary_cross_entropy_with_logits(dec(x[s:e]), y[s:e], pos_weight=pos_w)
            else:
                loss = F.cross_entropy(dec(x[s:e]), y[s:e].argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        prog.update(hi - lo, loss=float(loss.detach()))
    dec.eval()
    res = {} if classes is None else {"classes": len(classes)}
    with torch.no_grad():
        for part in ("val", "test"):
            a, b = ranges[part]
            keys = [f"{part}_node_auc"] if classes is None and task == "node" else [f"{part}_f1_micro", f"{part}_f1_macro"]
            if b == a:  # null, as the link metrics of an empty part: not a measured 0
                log.warning("%s classification: no %s labels, so %s %s null", task, part, " and ".join(keys),
                            "is" if len(keys) == 1 else "are")
                res.update(dict.fromkeys(keys))
                continue
            logits, truth = dec(x[a:b]).cpu().numpy(), y[a:b].cpu().numpy() > 0.5
            if classes is None and task == "node":
                res[keys[0]] = roc_auc(truth[:, 0], logits[:, 0])
                if not np.isfinite(res[keys[0]]):
                    log.warning("node classification: the %s labels are all %d, so ROC-AUC is undefined (null)",
                                part, int(truth[0, 0]))
                    res[keys[0]] = None
                continue
            if classes is None and truth.shape[1] == 1 and truth.all() == truth.any():  # a 0/1 label of one value
                log.warning("edge classification: the %s labels are all %d, so F1 is undefined (null)",
                            part, int(truth[0, 0]))
                res.update(dict.fromkeys(keys))
                continue
            pred = logits > 0 if classes is None else np.eye(len(classes), dtype=bool)[logits.argmax(1)]
            res.update({f"{part}_{k}": v for k, v in f1_multilabel(truth, pred, classes is not None).items()})
    log.info("%s classification: %s", task, res)
    return res


class _Stop(Exception):
    pass
