"""What a run does around training: DistTGL's static-memory pre-training, the replay that collects
embeddings, the downstream node / edge classification on frozen embeddings, and the check, before
training, that every evaluation the run will report has events to be computed on."""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from tgdist.data import readers
from tgdist.data.graph import NodeLabels, Split, TemporalGraph, class_targets, label_classes, label_ranges
from tgdist.errors import ConfigError
from tgdist.models.modules import MLPClassifier
from tgdist.runtime.features import host_tensor
from tgdist.runtime.metrics import f1_multilabel, roc_auc
from tgdist.runtime.trainer import SIDE_STREAMS, Progress, Trainer, memory_for

log = logging.getLogger(__name__)


def check_evaluation(cfg, graph: TemporalGraph, split: Split) -> None:
    """Refuse, before training, a run that would report a metric it cannot compute (a
    ``ConfigError``, one line naming the cause and the fix): a validation or test part without
    events (the split's cut to whole timestamps, or ``data.max_events`` cutting a data set's own
    split: TGB's, TGL's ``ext_roll``), and with ``train.task=node|edge`` a part without labels or
    whose 0/1 labels are all one value (ROC-AUC and F1 are undefined). A part asked for with
    ``data.val_frac=0`` / ``data.test_frac=0`` is left out on purpose: its metrics stay null."""
    wanted = [part for part in ("val", "test") if graph.ext_roll is not None or cfg.data[f"{part}_frac"] > 0]
    for part in wanted:
        lo, hi = split.range(part)
        if hi <= lo:
            raise ConfigError(_empty_part(cfg, graph, split, part))
    if cfg.train.task in ("node", "edge"):
        _check_label_parts(cfg.train.task, graph, split, wanted)


def _empty_part(cfg, graph: TemporalGraph, split: Split, part: str) -> str:
    n, m, name = graph.num_events, cfg.data.max_events, cfg.data.name or graph.name
    cut = m is not None and n >= m  # data.max_events cut the stream (the graph kept m events)
    if readers.carries_protocol(cfg.data.format):  # (TGB's: its split by time, its negatives for those events)
        if cut:
            return (f"data=tgb: data.max_events={m} keeps the first {n:,} events of {name}, and none of them is in "
                    f"TGB's {part} part (its split is by time over the whole data set, and its negatives are for "
                    f"those events), so no {part} metric could be computed: drop data.max_events, or raise it")
        return (f"data=tgb: TGB's split of {name}'s {n:,} events leaves no {part} events, so no {part} metric could "
                f"be computed")
    if graph.ext_roll is not None:  # a TGL directory's own split
        if cut:
            return (f"data.max_events={m} keeps the first {n:,} events of {name}, and none of them is in the {part} "
                    f"part of the data's own split (ext_roll), so no {part} metric could be computed: drop "
                    f"data.max_events, or raise it")
        return f"the data's own split (ext_roll) of {name} has no {part} events, so no {part} metric could be computed"
    frac = cfg.data[f"{part}_frac"]
    if part == "val":  # both cuts moved back to the first event of one timestamp
        why = (f"both of its cuts fall among the events at time {graph.t[split.train_end]} (from event "
               f"{split.train_end:,} on), and a part never splits a timestamp")
    else:  # the test cut at or past the end
        why = f"data.test_frac={frac} of {n:,} events is less than one event"
    return (f"no {part} events: in the chronological split of {n:,} events {why}, so no {part} metric could be "
            f"computed: raise data.{part}_frac, or set data.{part}_frac=0 to run without a {part} part")


def _check_label_parts(task: str, graph: TemporalGraph, split: Split, wanted: list[str]) -> None:
    """Each wanted part has labels, and 0/1 labels of both values where the metric needs them."""
    if graph.label is None:  # node labels at times (build.check_labels: task node)
        labels, ranges, what = graph.node_labels.label, label_ranges(graph.node_labels, graph, split), "node labels"
    else:
        labels, ranges, what = graph.label, {p: split.range(p) for p in wanted}, "event labels"
    classes, _ = label_classes(labels, graph.name)  # (no one-hot targets built for a check)
    targets = np.asarray(labels).reshape(len(labels), -1)  # the 0/1 targets, where classes is None
    for part in wanted:
        a, b = ranges[part]
        if b <= a:
            raise ConfigError(f"train.task={task}: none of the {len(labels):,} {what} of data {graph.name!r} falls in "
                              f"the {part} part, so no {part} {task} metric could be computed: move the split "
                              f"(data.val_frac, data.test_frac) or keep more events (data.max_events)")
        if classes is not None or (task == "edge" and targets.shape[1] > 1):
            continue  # classes and multi-label targets: F1 over classes or columns is defined
        col = targets[a:b, 0]
        if col.min() == col.max():
            metric = "ROC-AUC" if task == "node" else "F1"
            raise ConfigError(f"train.task={task}: the {b - a:,} {what} of the {part} part are all {int(col[0])}, so "
                              f"its {metric} could not be computed: move the split (data.val_frac, data.test_frac) "
                              f"so that it holds both values")


def pretrain_static(tr: Trainer, epochs: int) -> None:
    """DistTGL 3.1: pre-train the static node memory on the same link task, without dynamic
    memory (every event supervises it, whatever the batch size)."""
    static, pred = tr.model.static, tr.model.predictor
    lr = max(tr.optimizer.param_groups[0]["lr"], 1e-3)  # a per-node table learns slowly at TGN's 1e-4
    opt = torch.optim.Adam(list(static.parameters()) + list(pred.parameters()), lr=lr)
    log.info("static memory pre-training: %d epoch%s, Adam lr %g (train.lr, at least 1e-3), batches of %d events",
             epochs, "s" * (epochs != 1), lr, 4 * tr.batch_size)
    lo, hi = tr.split.range("train")
    src = host_tensor(tr.g.src[lo:hi])  # (a read-only map of the cache entry: never written)
    dst = host_tensor(tr.g.dst[lo:hi])
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
    g = tr.g  # (build_trainer checked the labels: build.check_labels, check_evaluation)
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


def downstream_alone(trainer: Trainer, task: str, epochs: int) -> dict:
    """``downstream`` on this rank alone, after a parallel run: its replay of the stream from empty
    memory runs on a memory of its own, not on the group's shared copy (which other ranks hold)."""
    shared, trainer.memory = trainer.memory, memory_for(trainer.model, trainer.g.num_nodes).to(trainer.device)
    try:
        return downstream(trainer, task, epochs)
    finally:  # no reference to the shared copy (it holds a process group) outlives this call
        trainer.memory = shared
