"""A whole training run, of every layout: one driver from one process to DistTGL's i x j x k.

``Run`` walks the iterations that ``tgdist.distributed.schedule`` gives this rank; 1 x 1 x 1 is the
same loop with a world of one process. What a parallel layout changes, and why results stay
comparable (DESIGN.md "Parallel training"):
- gradients are summed over all ranks and divided by the number of ranks active in the iteration
  (idle ranks of the epoch-parallel fill and drain pass zeros; ``collectives.average_gradients``),
  then every rank takes the same optimizer step, so all trainers stay replicas of one model;
- the learning rate is scaled with the global batch (``train.lr_scaling``, linear by default);
- negatives are a pure function of (seed, negative set, event index), so any rank drawing a set
  draws the same one, and a resumed run draws what the uninterrupted one did;
- each memory group keeps one logical copy of node memory, behind the store the config names
  (``tgdist.memory``): the loop tells it where the stream is (``open_position``, ``close_position``,
  ``exchange``) and never asks which store it holds;
- epoch parallelism: subgroup jj trains position p at iteration p + jj but reads its memory at
  iteration p, before subgroup 0 writes p (DistTGL's j read slots); only subgroup 0 writes.

Evaluation: a run of one process evaluates after every epoch (val, and test after the last or
with ``train.test_every_epoch``); a parallel run evaluates once, at its end, on rank 0 with memory
group 0's copy (group 0 ends its last pass at the end of the training stream), while the other
ranks wait: evaluating between passes would stall every rank for it.

Run directory: ``config.yaml`` (resolved), ``metrics.jsonl`` (one JSON object per evaluation),
``summary.json`` (also printed as the last line of stdout), ``checkpoints/`` (see ``save``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from tgdist import memory
from tgdist.config import model_tag
from tgdist.distributed import collectives
from tgdist.distributed.schedule import Layout, num_global_batches, num_iterations, scaled_lr, step
from tgdist.distributed.world import ProcessGroups, detect, disagreement
from tgdist.distributed.world import validate as validate_layout
from tgdist.errors import ConfigError
from tgdist.kernels import jit
from tgdist.memory.store import MemoryRead
from tgdist.runtime import checkpoint, rundir
from tgdist.runtime.build import build_trainer, validate
from tgdist.runtime.distributed import (cpu_share, fault_injection, memory_backend, model_digest, rank_logging,
                                        shared_settings)
from tgdist.runtime.tasks import downstream_alone, pretrain_static
from tgdist.runtime.tensorboard import TensorBoardLog
from tgdist.runtime.trainer import Progress, StageTimer, Trainer

log = logging.getLogger(__name__)


def jsonable(d: dict) -> dict:
    """Plain floats, and None for a metric that is undefined (NaN is not JSON)."""
    return {k: (float(v) if np.isfinite(v) else None) if isinstance(v, (np.floating, float)) else v
            for k, v in d.items()}


class Run:
    """One rank's part of a training run in ``run_dir`` (rank 0's; ranks but 0 may pass None):
    ``train()`` once. Started in one process it trains alone; under torchrun / SLURM / MPI each
    rank makes its own ``Run`` and they meet in ``__init__``. ``trainer``: one built by the caller
    (its own graph or device, say); with local memory its store is used as it is. ``groups``:
    process groups the caller initialised for this layout (and destroys; tests), else the run's own."""

    def __init__(self, cfg: DictConfig, run_dir: str | Path | None, trainer: Trainer | None = None,
                 groups: ProcessGroups | None = None):
        validate(cfg)  # (build_trainer validates too) a bad setting is named before the layout is refused
        self.cfg = cfg
        self.world = detect() if groups is None else groups.world
        self.layout = Layout(cfg.parallel.i, cfg.parallel.j, cfg.parallel.k)
        self.backend = memory_backend(cfg, self.layout)
        self.alone = self.world.world_size == 1
        validate_layout(self.layout, self.world, self.backend,
                        epochs=cfg.train.epochs if cfg.train.epochs or not self.alone else None)
        if not self.alone:
            rank_logging(self.world.rank)
        self.rank = self.world.rank
        self.ii, self.jj, self.kk = self.layout.coords(self.rank)
        self._trained = False
        self.trainer: Trainer | None = None
        self._own_groups = groups is None
        if self._own_groups and self.alone:
            ProcessGroups.release_single()  # an earlier Run of this process never trained (or closed)
        self.groups = groups or ProcessGroups.init(self.world, self.layout,
                                                   agree=None if self.alone else shared_settings(cfg))
        collectives.set_link(cfg.parallel.link)  # every collective from here on pays the simulated link
        try:
            self._set_up(run_dir, trainer)
        except BaseException as e:
            if e.__traceback__ is not None:  # the frames below hold the trainer, which holds a group
                traceback.clear_frames(e.__traceback__.tb_next)
            self.close()
            raise

    def _set_up(self, run_dir, trainer: Trainer | None) -> None:
        cfg, lay = self.cfg, self.layout
        world_group = self.groups.get("world")
        if not self.alone:  # a default name holds the time, which each rank would read off its own clock
            run_dir = collectives.broadcast_object(str(run_dir) if self.rank == 0 else None, group=world_group,
                                                   name="run_dir")
        self.dir = Path(run_dir)
        if self.rank == 0:
            rundir.check_foreign(self.dir, cfg.train.overwrite)  # (tgdist train claimed it already; Python callers)
        self.lr = scaled_lr(cfg.train.lr, lay.i, lay.j, lay.k, cfg.train.lr_scaling)
        self.run_cfg = cfg if self.lr == cfg.train.lr else OmegaConf.merge(cfg, {"train": {"lr": self.lr}})
        if trainer is None:  # first: a config or data error leaves no directory
            trainer = build_trainer(self.run_cfg, progress=None if self.alone else False,
                                    cpus=None if self.alone else cpu_share(world_group))
        self.trainer = tr = trainer
        if not self.alone:
            g = tr.g  # the same settings, but each machine reads its own copy of the data
            read = {"events": g.num_events, "nodes": g.num_nodes, "first and last time": (float(g.t[0]), float(g.t[-1])),
                    "edge features": g.edge_dim, "node features": g.node_dim}
            if (why := disagreement(collectives.all_gather_object(read, group=world_group, name="data_check"),
                                    "data")) is not None:
                raise ConfigError(why)
        self.n_train = tr.split.range("train")[1]
        validate_layout(lay, self.world, self.backend, num_train_events=self.n_train, batch_size=cfg.train.batch_size,
                        epochs=cfg.train.epochs if cfg.train.epochs or not self.alone else None)
        self.iterations = num_iterations(lay, self.n_train, tr.batch_size, cfg.train.epochs) if cfg.train.epochs else 0
        self.batches_per_epoch = num_global_batches(self.n_train, lay.i, tr.batch_size)
        self.counter = collectives.ByteCounter()
        self._resume = None  # (path, state) of train.resume, checked here and loaded by train()
        if cfg.train.resume:  # a refused resume leaves the run directory (maybe the checkpoint's own) as it was
            self._resume = checkpoint.check_resume(cfg)
            checkpoint.check_data(*self._resume, tr.g)
        if self.backend != "local":  # the store the config names; local memory is the trainer's own
            m = tr.model
            tr.memory = memory.create(self.backend, memory.StoreContext(
                tr.g.num_nodes, m.mem_dim, m.mail_dim, m.mailbox_size, device=tr.device, layout=lay, rank=self.rank,
                groups=self.groups, counter=self.counter, cfg=cfg, batch_size=tr.batch_size,
                fanouts=tuple(tr.sampler.fanouts) if tr.sampler is not None else (), graph=tr.g,
                train_end=self.n_train))
        self.ckpt_dir = self.dir / "checkpoints"
        self.ckpt_path = self.ckpt_dir / "last.pt"
        self.start_iteration = 0
        self.history: list[dict] = []
        self._tensorboard: TensorBoardLog | None = None  # train.tensorboard: made with the first line
        self.losses: list[tuple[int, float, int]] = []  # (pass, loss * events, events) of this rank
        self._passes: dict[int, list] = {}  # pass -> [loss * events, events] summed over self.losses
        self.slots: dict[int, object] = {}  # read slot -> a prepared batch read ahead (epoch parallelism)
        if self.rank == 0:
            if not cfg.train.resume and (self.dir / "metrics.jsonl").exists():
                log.warning("run_dir %s already holds a run; its metrics, summary and checkpoint are replaced", self.dir)
                for old in (self.dir / "summary.json", self.ckpt_path):  # gone now: not taken for this run's
                    old.unlink(missing_ok=True)
            rundir.claim(self.dir, cfg.train.overwrite)
            (self.dir / "config.yaml").write_text(OmegaConf.to_yaml(self.run_cfg, resolve=True))

    def close(self) -> None:
        """Release the store (a daemon's client detaches and stops the daemon it started) and the
        process groups. ``train()`` closes; a ``Run`` never trained should be closed by its maker."""
        if self.trainer is not None and self.backend != "local":  # a store made here (a caller's is the caller's)
            self.trainer.memory.close()
        if not self.alone and self._own_groups:
            self.trainer = None  # it holds group handles; destroy() frees the groups only with the last one
        if self._own_groups:
            self.groups.destroy()
        collectives.set_link(None)  # not carried into a later run of this process
        if getattr(self, "_tensorboard", None) is not None:
            self._tensorboard.close()

    # ------------------------------------------------------------------------------------------

    def train(self, on_iteration=None) -> dict:
        """Every iteration of this rank, the evaluations and the summary (rank 0's is complete; the
        others' too, told by rank 0). ``on_iteration(t, loss or None)`` after each (tests)."""
        if self._trained:  # a second call trained on and numbered its epochs from 0 again
            raise RuntimeError("Run.train() runs once: make a new Run, with train.resume=RUN_DIR to continue this one")
        self._trained = True
        try:
            return self._train(on_iteration)
        except BaseException as e:
            # the frames below this one hold the trainer, whose memory holds a process group: clear
            # their variables (the traceback's lines stay), so destroy() can free every group
            traceback.clear_frames(e.__traceback__.tb_next)
            raise
        finally:
            self.close()

    def _train(self, on_iteration) -> dict:
        cfg, tr = self.cfg, self.trainer
        if self._resume is not None:
            (path, state), self._resume = self._resume, None
            self.load(path, state)
            del state  # its tensors are copied in: the checkpoint's mmap goes
            if self.alone and self.start_iteration >= self.iterations:
                log.warning("nothing left to train: the checkpoint is after epoch %d and train.epochs=%d (raise it "
                            "to continue); reporting the checkpoint's results",
                            self.start_iteration // self.batches_per_epoch, cfg.train.epochs)
        elif cfg.model.static_memory and cfg.model.static_pretrain_epochs > 0:
            # DistTGL 3.1 pre-training is cheap: rank 0 runs it, and every replica starts from its result
            if self.rank == 0:
                pretrain_static(tr, cfg.model.static_pretrain_epochs)
            m = tr.model
            collectives.broadcast_tensors([*m.static.parameters(), *m.predictor.parameters()],
                                          group=self.groups.get("world"), name="static_pretrain")
        if self.rank == 0:
            with open(self.dir / "metrics.jsonl", "w") as mf:  # a resumed run's lines come with its checkpoint
                mf.writelines(json.dumps(h) + "\n" for h in self.history)
        try:
            trained, seconds = self._iterate(on_iteration)
        except _Stop as stop:
            log.info("stopping after %d training iterations (train.stop_after_batches)", stop.done)
            return {"stopped": True, "checkpoint": str(self.ckpt_path) if self.ckpt_path.exists() else None}
        if self.alone:
            return self._finish_alone()
        return self._finish_parallel(trained, seconds)

    def _iterate(self, on_iteration) -> tuple[int, float]:
        """The iterations from ``start_iteration`` on; returns the events this rank trained and the
        seconds it took."""
        cfg, tr = self.cfg, self.trainer
        mem, nb = tr.memory, self.batches_per_epoch
        tr.model.train()
        every, stop_after = cfg.train.checkpoint_every, cfg.train.stop_after_batches
        world_group = self.groups.get("world")
        fault = fault_injection(self.rank)
        start = time.perf_counter()
        trained = done = 0
        epoch = None  # a run of one process: the epoch under way and its clock
        for t in range(self.start_iteration, self.iterations):
            if self.alone and epoch is None:
                epoch = self._begin_epoch(t // nb)
            if fault == t:  # tests: a real SIGKILL of this rank at a chosen iteration
                os.kill(os.getpid(), signal.SIGKILL)
            # read-ahead: the position this subgroup trains at iteration t + jj is read now, before
            # subgroup 0 writes it at the end of this iteration
            ahead = self._step(t + self.jj) if t + self.jj < self.iterations else None
            if ahead is not None and ahead.active:
                mem.open_position(ahead.position, ahead.read_slot, ahead.reset_memory)
                self.slots[ahead.read_slot] = tr.prepare(ahead.lo, ahead.hi, self._negatives(ahead))
                if self.jj:  # this position's read is done; subgroup 0 writes it below
                    mem.close_position()
            now = self._step(t)
            loss = None
            if now.active and now.hi > now.lo:
                out = tr.compute(self.slots.pop(now.read_slot), train=True, write=now.writes,
                                 sync_gradients=self._average)
                loss = out.loss
                self._add_loss(now.pass_index, out.loss * now.num_events, now.num_events)
                trained += now.num_events
            else:  # an idle rank still joins the gradient exchange and applies the same update
                self.slots.pop(now.read_slot, None)
                tr.optimizer.zero_grad(set_to_none=True)
                collectives.average_gradients(tr.model.parameters(), world_group, self.counter, active=False)
                tr.optimizer.step()
            if self.jj == 0 and ahead is not None and ahead.active:
                mem.close_position()  # subgroup 0 has written the position it read
            mem.exchange()  # the group's writes of this iteration, everywhere (depcache's all-gather)
            if on_iteration is not None:
                on_iteration(t, loss)
            done += 1
            if epoch is not None:
                epoch.progress.update(now.num_events, loss=self._epoch_loss(epoch.index)[0])
                epoch.ran += now.num_events
            if epoch is not None and (t + 1) % nb == 0:
                self._end_epoch(epoch, t + 1)  # evaluates and saves
                epoch = None
            elif every and (t + 1) % every == 0 and t + 1 < self.iterations:
                self.save(t + 1)
            if not self.alone and self.rank == 0 and cfg.train.progress and (t % 50 == 0 or t == self.iterations - 1):
                el = time.perf_counter() - start
                log.info("iteration %d/%d, %d events on this rank, %.0f events/s", t + 1, self.iterations, trained,
                         trained / max(el, 1e-9))
            if stop_after is not None and done >= stop_after and t + 1 < self.iterations:
                raise _Stop(done)
        return trained, time.perf_counter() - start

    def _step(self, t: int):
        return step(self.layout, self.rank, t, self.n_train, self.trainer.batch_size, self.cfg.train.epochs)

    def _negatives(self, s) -> np.ndarray:
        return self.trainer.negatives.keyed(3 + s.neg_set, s.lo, s.hi, 1)

    def _average(self, params) -> None:
        collectives.average_gradients(params, self.groups.get("world"), self.counter)

    # ------------------------------------------------------------------------------------------
    # Epochs of a run of one process

    def _begin_epoch(self, index: int) -> "_Epoch":
        tr = self.trainer
        tr.model.train()  # evaluation left it in eval mode
        tr.timer = StageTimer()
        events = self._epoch_loss(index)[1]  # trained before a resume, mid-epoch
        prog = Progress(self.n_train - tr.split.range("train")[0], f"epoch {index} train", tr.progress)
        prog.done = events
        return _Epoch(index, prog, time.perf_counter(), jit.compile_seconds())

    def _add_loss(self, pass_index: int, loss_sum: float, events: int) -> None:
        self.losses.append((pass_index, loss_sum, events))
        acc = self._passes.setdefault(pass_index, [0.0, 0])
        acc[0] += loss_sum
        acc[1] += events

    def _epoch_loss(self, index: int) -> tuple[float, int]:
        """The mean training loss of pass ``index`` so far, and its events."""
        total, events = self._passes.get(index, (0.0, 0))
        return total / max(events, 1), events

    def _end_epoch(self, epoch: "_Epoch", next_iteration: int) -> None:
        cfg, tr = self.cfg, self.trainer
        el, compiled = time.perf_counter() - epoch.start, jit.compile_seconds() - epoch.compiled
        loss, events = self._epoch_loss(epoch.index)
        if not np.isfinite(loss):
            log.warning("epoch %d: the training loss is %s: training diverged (lower train.lr?)", epoch.index, loss)
        res = {"epoch": epoch.index, "loss": loss, "train_events": events, "train_seconds": el,
               "compile_seconds": compiled, "events_per_s": epoch.ran / max(el - compiled, 1e-9)}
        train_stages = StageTimer(dict(tr.timer.seconds))  # before evaluation adds to it
        res.update(tr.evaluate("val"))
        if cfg.train.test_every_epoch or epoch.index == cfg.train.epochs - 1:
            res.update(tr.evaluate("test"))
        res["stage_seconds"] = {k: round(v, 4) for k, v in train_stages.seconds.items()}
        self._record(res)
        compiled = (f" (leaving out {res['compile_seconds']:.1f} s of one-time kernel compiling)"
                    if res["compile_seconds"] >= 0.5 else "")
        shown = [f"{k} {v:.4f}" for k, v in res.items() if k.startswith(("val_", "test_"))]
        log.info("epoch %d: loss %.4f, %s train events/s%s", epoch.index, res["loss"],
                 ", ".join([*shown, f"{res['events_per_s']:,.0f}"]), compiled)
        log.info("training stage times:\n%s", train_stages.table(res["train_events"]))
        self.save(next_iteration)

    def _record(self, res: dict) -> None:
        """One line of ``metrics.jsonl`` (rank 0)."""
        self.history.append(jsonable(res))
        with open(self.dir / "metrics.jsonl", "a") as mf:
            mf.write(json.dumps(self.history[-1]) + "\n")
        if self.cfg.train.tensorboard:
            self._tensorboard = self._tensorboard or TensorBoardLog(self.dir, fresh=not self.cfg.train.resume)
            self._tensorboard.write(self.history[-1])

    def _finish_alone(self) -> dict:
        cfg, tr = self.cfg, self.trainer
        if cfg.train.epochs == 0 and not cfg.train.resume:  # the node and edge tasks too: their link baseline
            self.evaluate_untrained()
        if not self.ckpt_path.exists():  # nothing trained here (epochs=0): still the model
            self.save(self.iterations)
        summary = self.summary()
        if cfg.train.task in ("node", "edge"):
            summary.update(downstream_alone(tr, cfg.train.task, cfg.train.node_class_epochs))
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
        self._record(res)
        log.info("untrained: %s", ", ".join(f"{k} {v:.4f}" for k, v in res.items() if k != "epoch"))

    # ------------------------------------------------------------------------------------------
    # The end of a parallel run

    def _finish_parallel(self, trained: int, seconds: float) -> dict:
        cfg, tr = self.cfg, self.trainer
        world_group = self.groups.get("world")
        if self.start_iteration < self.iterations:
            self.save(self.iterations)  # the trained model and memory, as a run of one process leaves them
        stats = collectives.all_gather_object({"events": trained, "seconds": seconds, "losses": self.losses,
                                               "model": model_digest(tr.model)}, world_group)
        replicas_identical = len({s["model"] for s in stats}) == 1
        if not replicas_identical and self.rank == 0:
            log.warning("the trainers' model replicas differ after training (%d distinct parameter digests "
                        "over %d ranks); rank 0's model is evaluated", len({s["model"] for s in stats}), len(stats))
        tr.memory.end_training(evaluates=self.rank == 0)  # rank 0 evaluates alone on group 0's memory
        trained_any = any(s["events"] for s in stats)

        def evaluate() -> dict:  # rank 0: memory group 0 ends its last pass at the end of the stream
            metrics = {**tr.evaluate("val"), **tr.evaluate("test")}
            loss_sum = sum(l for s in stats for _, l, _ in s["losses"])
            events = sum(e for s in stats for _, _, e in s["losses"])
            rate = (sum(s["events"] for s in stats) / max(max(s["seconds"] for s in stats), 1e-9)
                    if trained_any else None)  # None: nothing trained here (a finished run resumed)
            # one metrics line, as a run of one process writes per epoch: a parallel run evaluates once, at its end
            self._record({"epoch": cfg.train.epochs - 1, "loss": loss_sum / max(events, 1), "train_events": events,
                          "events_per_s": rate, **metrics})
            summary = self.summary(extra={"replicas_identical": replicas_identical})
            if cfg.train.task in ("node", "edge"):
                summary.update(downstream_alone(tr, cfg.train.task, cfg.train.node_class_epochs))
            (self.dir / "summary.json").write_text(json.dumps(summary, indent=1))
            return summary

        # the other ranks wait for rank 0's evaluation however long it takes (not the groups' timeout)
        summary = collectives.result_of(evaluate, world_group, name="summary")
        # every rank is done before any tears its process group down: a rank that leaves while a
        # peer still talks to it can abort in gloo's shutdown ("terminate called without an
        # active exception"). Only on this success path, so failures still exit at once.
        collectives.barrier(world_group, name="shutdown")
        return summary

    # ------------------------------------------------------------------------------------------

    def summary(self, extra: dict | None = None) -> dict:
        """The run's summary from its metrics lines (rank 0)."""
        cfg, m = self.cfg, self.cfg.model
        out = {"run_dir": str(self.dir), "data": cfg.data.name, "model": model_tag(m.name, m.num_layers),
               "parallel": str(self.layout), "memory_backend": self.backend, "epochs": 0,
               "batch_size": cfg.train.batch_size, "lr": self.lr, "iterations": self.iterations}
        if not self.history:
            return out
        last = self.history[-1]
        out.update({k: v for k, v in last.items() if k.startswith(("val_", "test_")) or k == "loss"})
        trained = [h for h in self.history if h["epoch"] >= 0]
        if not trained:  # train.epochs=0: an untrained baseline
            return out
        scored = [h for h in trained if h.get("val_ap") is not None]  # none: an empty val part, or NaN scores
        best = max(scored, key=lambda h: h["val_ap"]) if scored else {}  # no best epoch without a val AP
        rates = [h["events_per_s"] for h in trained if h["events_per_s"] is not None]
        out["epochs"] = len(trained) if self.alone else cfg.train.epochs
        out["best_epoch"] = best.get("epoch")
        out["best_val_ap"] = best.get("val_ap")
        out["test_ap_at_best_val"] = best.get("test_ap")
        out["train_events_per_s"] = float(np.mean(rates)) if rates else None
        out["traversed_events"] = int(sum(h["train_events"] for h in trained))
        out.update(extra or {})
        out["communication"] = self.counter.as_dict()
        return out

    # ------------------------------------------------------------------------------------------
    # Checkpoints, one format for every layout: ``checkpoints/itNNNNNNNN/`` holds every rank's RNG,
    # read slots and losses (``rank-R.pt``) and the memory (``memory-*.pt``, as the store says:
    # a file per memory group, or per shard); rank 0 then commits ``last.pt`` (model, optimizer,
    # iteration, metrics lines, the list of those files) and removes older iteration directories.

    def save(self, iteration: int) -> None:
        tr, d = self.trainer, self.ckpt_dir / f"it{iteration:08d}"
        world_group = self.groups.get("world")
        slots = {slot: {"lo": p.lo, "hi": p.hi, "neg": torch.from_numpy(p.neg), "read": vars(p.read)}
                 for slot, p in self.slots.items()}
        checkpoint.atomic_save({"torch_rng": torch.get_rng_state(), "slots": slots, "losses": self.losses,
                                "sampler_calls": tr.sampler.calls if tr.sampler is not None else 0},
                               d / f"rank-{self.rank}.pt")
        name, writes = tr.memory.checkpoint_part(self.ii, self.jj, self.kk)
        if writes:
            checkpoint.atomic_save(tr.memory.state_dict(), d / name)
        files = collectives.all_gather_object((f"rank-{self.rank}.pt", name if writes else None), world_group,
                                              name="checkpoint", counter=collectives.ByteCounter())  # not training's
        if self.rank == 0:
            checkpoint.atomic_save({"format": checkpoint.FORMAT, "config": checkpoint.identity(self.cfg),
                                    "data": checkpoint.data_identity(tr.g), "layout": str(self.layout),
                                    "iteration": iteration, "epochs": self.cfg.train.epochs, "dir": d.name,
                                    "parts": [r for r, _ in files] + [m for _, m in files if m is not None],
                                    "model": tr.model.state_dict(), "optimizer": tr.optimizer.state_dict(),
                                    "history": [dict(h) for h in self.history]}, self.ckpt_path)
            for old in self.ckpt_dir.glob("it*"):
                if old.name != d.name:
                    shutil.rmtree(old, ignore_errors=True)
        collectives.barrier(world_group, name="checkpoint")

    def load(self, path: Path, state: dict) -> None:
        """Restore every rank's part of the checkpoint ``path`` (``state``: its ``last.pt`` as
        ``check_resume`` read it)."""
        tr = self.trainer
        d = path.parent / state["dir"]
        checkpoint.restore(path, tr.model, state["model"], "model")
        checkpoint.restore(path, tr.optimizer, state["optimizer"], "optimizer state")
        name, writes = tr.memory.checkpoint_part(self.ii, self.jj, self.kk)
        shared = tr.memory.one_copy_per_group  # (a daemon's): its writer loads it
        if not shared or writes:
            checkpoint.restore(d / name, tr.memory, checkpoint.read_part(d / name), "node memory")
        if shared:
            collectives.barrier(self.groups.get("memory"), name="checkpoint")
        mine = checkpoint.read_part(d / f"rank-{self.rank}.pt")
        torch.set_rng_state(mine["torch_rng"])
        if tr.sampler is not None:
            tr.sampler.calls = int(mine["sampler_calls"])
        self.losses, self._passes = [], {}
        for g, loss_sum, events in mine["losses"]:
            self._add_loss(int(g), float(loss_sum), int(events))
        self.slots = {int(slot): tr.prepare(v["lo"], v["hi"], v["neg"].numpy(),  # reads on the compute device
                                            read=MemoryRead(**{k: t.to(tr.device) for k, t in v["read"].items()}))
                      for slot, v in mine["slots"].items()}
        self.history = [dict(h) for h in state["history"]]
        self.start_iteration = int(state["iteration"])
        log.info("resumed from %s at iteration %d of %d", path, self.start_iteration, self.iterations)


class _Epoch:
    """The epoch under way in a run of one process: its index, progress line and clocks."""

    def __init__(self, index: int, progress: Progress, start: float, compiled: float):
        self.index, self.progress, self.start, self.compiled = index, progress, start, compiled
        self.ran = 0  # events trained in this process (a resumed epoch's earlier ones are not timed)


class _Stop(Exception):
    def __init__(self, done: int):
        super().__init__(done)
        self.done = done
